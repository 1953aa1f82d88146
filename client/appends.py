"""Writing: data of any size as a pipeline of block-sized appends to extents, on every replica.

``write`` appends into one partition; ``put`` into partitions it picks from etcd's map.  Each takes an open
extent for itself (concurrent writes never append to the same extent) and, after a failure, goes on after
the acknowledged prefix on a new extent: a replication failure seals the old one on the leader, so every
returned location is on every replica.  With the map in etcd a write that fails because a replica died
waits (within ``timeout``) for the manager's new view; a put writes the rest to another partition.
"""
from __future__ import annotations

import logging
import random
from typing import Awaitable, Callable

import trio

from client.channel import Channel, ClientError, Location, PartitionInfo, ReplicationError, check
from client.routing import AVOID_S, PartitionMap
from wire import aio
from wire.protocol import MAX_EXTENT, Header, Op, Result

log = logging.getLogger(__name__)

FAILOVER_POLL_S = 1.0     # a failed write waits this long for a new view before trying again anyway
PUT_STATES = {"writable": 0, "degraded": 1, "recovering": 2}     # etcd states a put may use, preferred first
HEALTH_FRESH_S = 5.0      # a leader's report of an unreachable follower is believed this long


class Appender:
    """The client's writes: which extents are open, the append pipeline, and going on after a failure."""

    def __init__(self, channel: Channel, routes: PartitionMap, *, block_size: int, depth: int):
        self.channel, self.routes = channel, routes
        self.block_size, self.depth = block_size, depth
        # open extents not in use by a write() right now: partition -> [(extent, next offset)].  A write
        # takes one for itself, so concurrent writes never append to the same extent.
        self.idle: dict[int, list[tuple[int, int]]] = {}
        # (partition, extent) a write holds now, and those of them it must not put back in ``idle`` when it is
        # done (deleted, or their view changed, meanwhile)
        self.held: set[tuple[int, int]] = set()
        self.retired: set[tuple[int, int]] = set()
        # put(): how many extents this client started per partition, puts in flight per leader, and
        # extents a failed attempt left empty (taken back once the partition can delete again)
        self.picked: dict[int, int] = {}
        self.busy: dict[str, int] = {}
        self.abandoned: dict[tuple[int, int], int] = {}
        self.put_failovers = 0          # times put() went on with another partition after a failure
        self.volume = ""                # a volume key's: new extents go to that volume's partitions only

    def drop_extents(self, pid: int) -> None:
        """Append to no open extent of ``pid`` any more (its view changed: new ones are started)."""
        self.idle.pop(pid, None)
        self.retired.update(k for k in self.held if k[0] == pid)

    def forget_extent(self, pid: int, extent: int) -> None:
        """Never append to ``extent`` again -- also when a write holds it now (it is not taken up again)."""
        self.idle[pid] = [(e, o) for e, o in self.idle.get(pid, []) if e != extent]
        if (pid, extent) in self.held:
            self.retired.add((pid, extent))

    def _put_back(self, pid: int, extent: int, offset: int | None) -> None:
        """A write is done with ``extent``: open for the next one at ``offset`` -- unless it failed (None) or the
        extent was forgotten meanwhile."""
        key = (pid, extent)
        self.held.discard(key)
        if key in self.retired:
            self.retired.discard(key)
        elif offset is not None:
            self.idle.setdefault(pid, []).append((extent, offset))

    async def create_extent(self, pid: int) -> int:
        part = self.routes.partition(pid)
        resp, _ = await self.channel.request(part.replicas[0], Header(opcode=Op.CREATE_EXTENT, partition=pid,
                                                                      epoch=part.epoch))
        check(resp, part.replicas[0], part)
        return resp.extent

    async def delete_extent(self, pid: int, extent: int) -> None:
        self.forget_extent(pid, extent)          # the next write to the partition starts a new extent
        part = self.routes.partition(pid)
        resp, _ = await self.channel.request(part.replicas[0], Header(opcode=Op.MARK_DELETE, partition=pid,
                                                                      extent=extent, epoch=part.epoch))
        check(resp, part.replicas[0], part)

    async def append(self, pid: int, extent: int, offset: int, data) -> Location:
        part = self.routes.partition(pid)
        p = await self.channel.submit_append(part, extent, offset, memoryview(data))
        return await p

    async def submit_append(self, part: PartitionInfo, extent: int, offset: int, data) -> Awaitable[Location]:
        return await self.channel.submit_append(part, extent, offset, memoryview(data))

    # -- write: into one partition -------------------------------------------------------------------
    async def write(self, pid: int, data, *, on_progress=None,
                    elsewhere: Callable[[str], bool] | None = None) -> list[Location]:
        mv = memoryview(data).cast("B")
        out: list[Location] = []
        pos = 0
        failures = 0
        deadline = None
        while pos < len(mv):
            part = self.routes.partition(pid)
            try:
                extent, offset = await self._extent_for(pid, min(len(mv) - pos, self.block_size))
            except ClientError as e:     # no new extent: only a stale map is worth another try
                failures += 1
                if self.routes.etcd is not None and _changes_view(e):
                    deadline = deadline or trio.current_time() + self.channel.timeout
                    if not await self._failover(pid, part, e, deadline, elsewhere):
                        raise _acked(e, out)
                    continue
                if failures > 3 or e.result not in (Result.STALE_EPOCH, Result.NOT_LEADER):
                    raise _acked(e, out)
                await self.routes.refresh(pid)
                continue
            chunks, pos, offset = self._chunks(len(mv), pos, offset)
            err = ClientError("write cancelled")
            try:
                done, err = await self._pipeline(part, extent, mv, chunks, on_progress)
            finally:
                self._put_back(pid, extent, offset if err is None else None)
            out.extend(done)
            if err is None:
                continue
            # the extent is sealed (or refused): continue after the last acknowledged block on a new one
            failures += 1
            pos = chunks[len(done)][0]
            if self.routes.etcd is not None and isinstance(err, ClientError) and _changes_view(err):
                deadline = deadline or trio.current_time() + self.channel.timeout
                if not await self._failover(pid, part, err, deadline, elsewhere):
                    raise _acked(err, out)
                continue
            if failures > 3 or not isinstance(err, ClientError) or not await self._recoverable(pid, err):
                raise _acked(err, out)
            log.warning("write to partition %d extent %d failed (%s); continuing on a new extent", pid,
                        extent, err)
        return out

    async def _failover(self, pid: int, part: PartitionInfo, err: ClientError, deadline: float,
                        elsewhere: Callable[[str], bool] | None = None) -> bool:
        """With the map in etcd: after a dead replica, a dead leader or a stale map, wait (until
        ``deadline``) for a view newer than the one that failed, at most ``FAILOVER_POLL_S`` at a time
        (the failure may have been passing, with no new view coming).  False: give up -- the deadline
        passed, or the caller's ``elsewhere`` has another partition for the rest."""
        if trio.current_time() >= deadline:
            return False
        failed = _failed_replica(part, err)
        if failed is not None and elsewhere is not None and elsewhere(failed):
            return False                  # the caller has another partition for it, now
        log.info("write to partition %d (epoch %d) failed: %s; waiting for a new view", pid, part.epoch, err)
        if failed is not None:
            if not await self._view_or_answer(pid, part, failed, deadline, elsewhere):
                return False
        elif not await self.routes.await_new_view(pid, part.epoch,
                                                  min(deadline, trio.current_time() + FAILOVER_POLL_S),
                                                  since_rev=part.rev or None):
            try:
                await self.routes.refresh(pid)
            except ClientError:
                pass
        self.idle.pop(pid, None)
        return True

    async def _view_or_answer(self, pid: int, part: PartitionInfo, node: str, deadline: float,
                              elsewhere: Callable[[str], bool] | None) -> bool:
        """A replica of the partition failed the write (the leader stopped answering, or the leader says a
        follower did): if it is dead or hung, the manager moves the partition once its lease lapses.  Until
        ``deadline``, wait for that view -- or for the replica to answer a ping again (the failure was
        passing, or not the node's: no new view is coming, and the write goes on at once): True.  False: a
        change of the map made ``elsewhere(node)`` true first (the caller has another partition for the
        rest)."""
        go_on = True
        async with trio.open_nursery() as n:
            async def new_view():
                await self.routes.await_new_view(pid, part.epoch, deadline, since_rev=part.rev or None)
                n.cancel_scope.cancel()

            async def other_partition():
                nonlocal go_on
                while True:
                    changed = self.routes.changed
                    if elsewhere(node):
                        go_on = False
                        n.cancel_scope.cancel()
                        return
                    await changed.wait()

            async def answers():
                while True:
                    try:
                        await self.channel.request(node, Header(opcode=Op.PING, partition=pid))
                    except ClientError:
                        await trio.sleep(FAILOVER_POLL_S)
                        continue
                    log.info("partition %d: %s answers", pid, node)
                    n.cancel_scope.cancel()
            n.start_soon(new_view)
            n.start_soon(answers)
            if elsewhere is not None:
                n.start_soon(other_partition)
        return go_on

    async def _recoverable(self, pid: int, err: ClientError) -> bool:
        """Can a write go on after ``err`` (on a new extent, after refreshing the map if it was stale)?"""
        if err.result in (Result.STALE_EPOCH, Result.NOT_LEADER):
            await self.routes.refresh(pid)
            return True
        if err.result in (Result.BUSY, Result.POOL_BUSY):     # our share of the node's pool: back off, go on
            await trio.sleep(0.05)
            return True
        # NOT_FOUND: the extent was deleted under us (another client's reclaim): a new one takes the rest
        return err.result in (Result.REPLICATION_FAILED, Result.DIVERGED, Result.WRONG_OFFSET, Result.TOO_LARGE,
                              Result.NOT_FOUND)

    # -- put: the client picks the partition (the map from etcd) -------------------------------------
    def writable(self, avoid: dict[int, tuple[int, float]] | None = None) -> list[int]:
        now = trio.current_time()
        cands = []
        for pid, v in self.routes.views.items():
            info = self.routes.partitions.get(pid)
            if info is None or not v.installed or v.state not in PUT_STATES or not info.replicas:
                continue
            if self.volume and self.routes.volumes.get(pid) != self.volume:
                continue                # (the nodes would refuse it: FORBIDDEN)
            a = (avoid or {}).get(pid)
            if a is not None and a[0] == v.rev and now < a[1]:
                continue
            cands.append(((PUT_STATES[v.state], self.busy.get(info.replicas[0], 0), self.picked.get(pid, 0),
                           random.random()), pid))     # ties: at random, so separate clients spread too
        return [pid for _k, pid in sorted(cands)]

    async def put(self, data, *, on_progress=None, timeout: float | None = None) -> list[Location]:
        if self.routes.etcd is None:
            raise ClientError("put without a partition needs the cluster map from etcd "
                              "(DataClient.open(etcd=URL)); or write(partition, data)")
        mv = memoryview(data).cast("B")
        deadline = trio.current_time() + (timeout if timeout is not None else self.channel.timeout)
        out: list[Location] = []
        avoid: dict[int, tuple[int, float]] = {}
        last: ClientError | None = None
        pos = 0
        await self._take_back_abandoned()
        while pos < len(mv):
            now = trio.current_time()
            if now >= deadline:
                raise last or ClientError(f"no writable partition within {self.channel.timeout:g}s",
                                          Result.NOT_FOUND)
            cands = self.writable(avoid)
            if not cands:
                if not self.routes.views:
                    raise ClientError("no partition in the cluster map (is a manager running? create some: "
                                      "dnctl partition create --count N)", Result.NOT_FOUND)
                ev = self.routes.changed         # wait for a new view (a failover, a shrink) or try again
                with trio.move_on_at(min(deadline, now + FAILOVER_POLL_S)):
                    await ev.wait()
                if trio.current_time() >= min(deadline, now + FAILOVER_POLL_S):
                    avoid.clear()
                continue
            pid = cands[0]
            part = self.routes.partition(pid)
            leader = part.replicas[0]
            self.picked[pid] = self.picked.get(pid, 0) + 1
            self.busy[leader] = self.busy.get(leader, 0) + 1
            extent, start, fresh, done = None, pos, False, []
            err = ClientError("put cancelled")
            try:
                with trio.move_on_at(deadline) as cs:
                    extent, offset = await self._extent_for(pid, min(len(mv) - pos, self.block_size))
                    fresh = offset == 0
                    chunks, pos, offset = self._chunks(len(mv), pos, offset)
                    done, err = await self._pipeline(part, extent, mv, chunks, on_progress)
                if cs.cancelled_caught:
                    err = ClientError(f"partition {pid}: no answer before the deadline", node=leader)
            except ClientError as e:        # e.g. no extent: this partition cannot take writes now
                err = e
            finally:
                self.busy[leader] -= 1
                if extent is not None:
                    self._put_back(pid, extent, offset if err is None else None)
            out.extend(done)
            if err is None:
                continue
            pos = start + sum(loc.length for loc in done)      # go on after the acknowledged prefix
            if not _retry_elsewhere(err):
                raise err
            last = err
            self.put_failovers += 1
            avoid[pid] = (self.routes.views[pid].rev if pid in self.routes.views else 0,
                          trio.current_time() + AVOID_S)
            self.idle.pop(pid, None)
            if extent is not None and fresh and not done:
                self.abandoned[(pid, extent)] = avoid[pid][0]
            log.info("put: partition %d failed (%s); going on with another partition", pid, err)
        return out

    async def _take_back_abandoned(self) -> None:
        """Delete extents a failed put left without an acknowledged byte, once their partition has a new
        view (the delete needs every replica of the current one); bounded, best effort."""
        for (pid, extent), rev in list(self.abandoned.items()):
            v = self.routes.views.get(pid)
            if v is None:
                del self.abandoned[(pid, extent)]
                continue
            if v.rev == rev or not v.installed:
                continue
            with trio.move_on_after(min(self.channel.timeout, 2.0)):
                try:
                    await self.delete_extent(pid, extent)
                    del self.abandoned[(pid, extent)]
                except ClientError as e:
                    if e.result == Result.NOT_FOUND:
                        del self.abandoned[(pid, extent)]

    # -- extents and the pipeline --------------------------------------------------------------------
    async def _extent_for(self, pid: int, need: int) -> tuple[int, int]:
        idle = self.idle.get(pid, [])
        while idle:
            extent, offset = idle.pop()
            if offset + need <= MAX_EXTENT:
                self.held.add((pid, extent))
                return extent, offset
        await self._check_followers(self.routes.partition(pid))
        extent = await self.create_extent(pid)
        self.held.add((pid, extent))
        return extent, 0

    async def _check_followers(self, part: PartitionInfo) -> None:
        """Refuse to create an extent that cannot be replicated: if the leader said a moment ago
        (``HEALTH_FRESH_S``) that a follower is unreachable and it does not answer us either, raise the
        ReplicationError the create would end in -- without the create, which would leave one more empty
        extent on the replicas that are up on every attempt."""
        h = part.health or {}
        if trio.current_time() - part.seen > HEALTH_FRESH_S:
            return
        for addr, state in (h.get("followers") or {}).items():
            if state != "unreachable" or addr not in part.replicas:
                continue
            try:
                with trio.fail_after(min(self.channel.timeout, 2.0)):
                    await self.channel.admin(addr, Op.NODE_STATUS)
            except (ClientError, trio.TooSlowError):
                idx = part.replicas.index(addr)
                raise ReplicationError(f"{part.replicas[0]}: replication would fail: follower {addr} is "
                                       f"unreachable (partition {part.pid} is degraded; no extent created)",
                                       addr, result=Result.REPLICATION_FAILED, node=part.replicas[0],
                                       arg=idx) from None

    def _chunks(self, total: int, pos: int, offset: int) -> tuple[list[tuple[int, int, int]], int, int]:
        """Split data[pos:total] into (data pos, extent offset, length) requests of at most block_size that
        fit the extent from ``offset``; returns them, and the data position and extent offset after them."""
        chunks = []
        while pos < total and offset + min(self.block_size, total - pos) <= MAX_EXTENT:
            n = min(self.block_size, total - pos)
            chunks.append((pos, offset, n))
            pos += n
            offset += n
        return chunks, pos, offset

    async def _pipeline(self, part, extent, mv, chunks, on_progress):
        """Send appends in order with up to ``depth`` in flight; returns (acked prefix, first error)."""
        submit = self.channel.submit_append
        if len(chunks) == 1:             # one append (a small write, an fsync's): no window, nursery or task
            pos, offset, length = chunks[0]
            try:
                loc = await (await submit(part, extent, offset, mv[pos:pos + length]))
            except ClientError as e:
                return [], e
            if on_progress:
                on_progress(loc.length)
            return [loc], None
        results: list = [None] * len(chunks)
        window = trio.Semaphore(self.depth)
        failed = False                   # an append already answered with an error: send no more

        async def wait_one(i, fut):
            nonlocal failed
            try:
                results[i] = await fut
                if on_progress:
                    on_progress(results[i].length)
            except ClientError as e:
                results[i] = e
                failed = True
            finally:
                window.release()

        async with aio.nursery() as n:
            for i, (pos, offset, length) in enumerate(chunks):
                await window.acquire()
                if failed:
                    window.release()
                    break
                try:
                    fut = await submit(part, extent, offset, mv[pos:pos + length])
                except ClientError as e:
                    results[i] = e
                    window.release()
                    break
                n.start_soon(wait_one, i, fut)
        done = []
        for r in results:
            if not isinstance(r, Location):
                return done, r if r is not None else ClientError("pipeline stopped")
            done.append(r)
        return done, None


def _failed_replica(part: PartitionInfo, e: ClientError) -> str | None:
    """The replica whose failure (silence, or a follower the leader names) ``e`` is -- a node that a new view
    may replace -- or None."""
    if e.silent and part.replicas and e.node == part.replicas[0]:
        return e.node
    if isinstance(e, ReplicationError) and e.replica in part.replicas[1:]:
        return e.replica
    return None


def _acked(e: Exception, done: list[Location]) -> Exception:
    """``e`` with the locations a write had acknowledged before it (``e.done``)."""
    e.done = list(done)
    return e


def _retry_elsewhere(e: ClientError) -> bool:
    """Failures after which a put goes on with another partition (ERROR: a bug on that node, logged there
    with its traceback -- one partition's trouble, not the writer's)."""
    return _changes_view(e) or e.result in (Result.BUSY, Result.POOL_BUSY, Result.WRONG_OFFSET, Result.TOO_LARGE,
                                            Result.NO_SPACE, Result.ERROR)


def _changes_view(e: ClientError) -> bool:
    """Failures that a new view of the partition (a failover, a shrink) cures -- DISK_ERROR too: a node whose
    disk is gone leaves the map (datanode/server.py ``_watch_data_dir``), and the write goes on on a new
    extent either way."""
    return e.result in (None, Result.REPLICATION_FAILED, Result.NOT_LEADER, Result.STALE_EPOCH, Result.DIVERGED,
                        Result.NOT_FOUND, Result.RETRY, Result.DISK_ERROR)
