"""The client SDK: what a mounted filesystem client calls for its write and read path.

``DataClient`` (trio) knows the partition map, creates extents, writes data of any size as a pipeline of
block-sized appends, reads ranges with CRC checks (failing over to another replica), and moves to a new
extent after a replication failure.  ``BlockingDataClient`` wraps it for callers that are not async.

The client's memory is registered once, like the server's: a staging pool the datanodes may READ (write
payloads) and a landing pool they may WRITE (read answers); each request exposes one block of it.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import threading
from contextlib import asynccontextmanager
from typing import AsyncIterator, Iterable

import trio

from datanode import aio
from datanode.crc import crc32c
from datanode.pool import BuddyPool, PoolExhausted
from datanode.protocol import Flag, Header, Op, Result
from datanode.rpc import Links
from datanode.store import MAX_EXTENT
from datanode.transport.base import Access, Domain, TransportError
from datanode.transport.connect import make_domain

log = logging.getLogger("datanode.client")


class ClientError(Exception):
    """A request failed.  ``result`` is the protocol Result (or None for a transport failure)."""

    def __init__(self, message: str, result: Result | None = None, node: str | None = None, arg: int = 0):
        super().__init__(message)
        self.result, self.node, self.arg = result, node, arg


class ReplicationError(ClientError):
    """The write is not on every replica; ``replica`` names the follower that failed."""

    def __init__(self, message: str, replica: str | None, **kw):
        super().__init__(message, **kw)
        self.replica = replica


@dataclasses.dataclass(frozen=True)
class Location:
    partition: int
    extent: int
    offset: int
    length: int
    crc: int

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class PartitionInfo:
    pid: int
    replicas: list[str]
    epoch: int


class DataClient:
    def __init__(self, nursery: trio.Nursery, *, transport: str = "auto", timeout: float = 15.0,
                 block_size: int = 1 << 20, depth: int = 8, pool_mib: int = 64, domain: Domain | None = None):
        if block_size & (block_size - 1) or not (4096 <= block_size <= 4 << 20):
            raise ValueError("block_size must be a power of two between 4 KiB and 4 MiB")
        self.timeout = timeout
        self.block_size = block_size
        self.depth = depth
        self.domain = domain or make_domain(transport)
        self.partitions: dict[int, PartitionInfo] = {}
        max_block = max(block_size, 1 << 20)
        self.wpool = BuddyPool(pool_mib << 20, max_block)
        self.rpool = BuddyPool(pool_mib << 20, max_block)
        self.wregion = self.domain.register(self.wpool.arena, self.wpool.base_addr, Access.REMOTE_READ)
        self.rregion = self.domain.register(self.rpool.arena, self.rpool.base_addr,
                                            Access.LOCAL_WRITE | Access.REMOTE_WRITE)
        self.links = Links(nursery, self.domain, transport=transport, slots=64, connect_timeout=timeout)
        # open extents not in use by a write() right now: partition -> [(extent, next offset)].  A write
        # takes one for itself, so concurrent writes never append to the same extent.
        self._idle: dict[int, list[tuple[int, int]]] = {}

    @classmethod
    @asynccontextmanager
    async def open(cls, nodes: Iterable[str] = (), **kw) -> AsyncIterator["DataClient"]:
        """A client whose partition map is loaded from ``nodes`` (any datanodes of the cluster)."""
        async with aio.nursery() as nursery:
            dc = cls(nursery, **kw)
            try:
                errors = []
                nodes = list(nodes)
                for addr in nodes:
                    try:
                        await dc.discover(addr)
                    except ClientError as e:       # one node down must not stop the client
                        errors.append(e)
                        log.warning("partition map from %s: %s", addr, e)
                if nodes and len(errors) == len(nodes):
                    raise ClientError("no datanode answered: " + "; ".join(map(str, errors)))
                yield dc
            finally:
                nursery.cancel_scope.cancel()
                dc._release()

    def _release(self) -> None:
        self.domain.deregister(self.wregion)
        self.domain.deregister(self.rregion)

    # -- plumbing ---------------------------------------------------------------------------------
    async def request(self, addr: str, h: Header, *, body: bytes | None = None, answer: int = 0,
                      sink: memoryview | None = None, timeout: float | None = None) -> tuple[Header, bytes]:
        """Send one request to ``addr``; ``body`` is exposed for the server to READ, ``answer`` bytes of
        landing memory for it to WRITE.  Returns (response, answer bytes) — or, with ``sink``, copies the
        answer straight into it and returns b"" in its place."""
        wblock = rblock = None
        try:
            if body is not None:
                wblock = await self.wpool.alloc(len(body), timeout=self.timeout)
                wblock.view(len(body))[:] = body
                h.addr, h.rkey, h.rlen, h.length = wblock.addr, self.wregion.rkey, len(body), len(body)
            if answer:
                rblock = await self.rpool.alloc(answer, timeout=self.timeout)
                h.addr, h.rkey, h.rlen = rblock.addr, self.rregion.rkey, answer
            try:
                link = await self.links.get(addr)
                resp = await link.call(h, timeout or self.timeout)
            except TransportError as e:
                raise ClientError(f"{addr}: {e}", node=addr) from None
            data = b""
            if rblock is not None and resp.result == Result.OK:
                if sink is not None:
                    sink[:resp.length] = rblock.view(resp.length)
                else:
                    data = bytes(rblock.view(resp.length))
            return resp, data
        except PoolExhausted as e:
            raise ClientError(f"client buffer pool exhausted: {e}") from None
        finally:
            if wblock is not None:
                self.wpool.free(wblock)
            if rblock is not None:
                self.rpool.free(rblock)

    async def admin(self, addr: str, op: Op, *, partition: int = 0, body=None, answer: int = 1 << 20,
                    epoch: int = 0):
        """An admin request with an optional JSON body and JSON answer; raises ClientError on failure."""
        raw = json.dumps(body).encode() if body is not None else None
        resp, data = await self.request(addr, Header(opcode=op, partition=partition, epoch=epoch), body=raw,
                                        answer=0 if raw is not None else answer)
        check(resp, addr)
        return json.loads(data) if data else resp

    async def discover(self, addr: str) -> list[PartitionInfo]:
        found = []
        for p in await self.admin(addr, Op.PARTITION_LIST):
            info = PartitionInfo(p["id"], p["replicas"], p["epoch"])
            old = self.partitions.get(info.pid)
            if old is None or info.epoch >= old.epoch:
                self.partitions[info.pid] = info
            found.append(info)
        return found

    def partition(self, pid: int) -> PartitionInfo:
        try:
            return self.partitions[pid]
        except KeyError:
            raise ClientError(f"partition {pid} is unknown (known: {sorted(self.partitions)})",
                              Result.NOT_FOUND) from None

    # -- the data path ----------------------------------------------------------------------------
    async def create_extent(self, pid: int) -> int:
        part = self.partition(pid)
        resp, _ = await self.request(part.replicas[0], Header(opcode=Op.CREATE_EXTENT, partition=pid,
                                                              epoch=part.epoch))
        check(resp, part.replicas[0], part)
        return resp.extent

    async def append(self, pid: int, extent: int, offset: int, data) -> Location:
        """One append (``len(data)`` <= the datanode's max block) at the extent's current end."""
        part = self.partition(pid)
        p = await self._submit_append(part, extent, offset, memoryview(data))
        return await p

    async def _submit_append(self, part: PartitionInfo, extent: int, offset: int, data: memoryview):
        """Sends one append and returns an awaitable for its result (so a caller can keep sending)."""
        leader = part.replicas[0]
        block = await self.wpool.alloc(len(data), timeout=self.timeout)
        try:
            view = block.view(len(data))
            view[:] = data
            crc = crc32c(view)
            h = Header(opcode=Op.WRITE, partition=part.pid, extent=extent, offset=offset, length=len(data),
                       crc=crc, epoch=part.epoch, addr=block.addr, rkey=self.wregion.rkey, rlen=len(data))
            link = await self.links.get(leader)
            pending = await link.submit(h, self.timeout)
        except TransportError as e:
            self.wpool.free(block)
            raise ClientError(f"{leader}: {e}", node=leader) from None
        except BaseException:
            self.wpool.free(block)
            raise

        async def finish() -> Location:
            try:
                resp = await pending.result()
            except TransportError as e:
                raise ClientError(f"{leader}: {e}", node=leader) from None
            finally:
                self.wpool.free(block)
            check(resp, leader, part)
            return Location(part.pid, extent, offset, len(data), crc)

        return finish()

    async def write(self, pid: int, data, *, on_progress=None) -> list[Location]:
        """Write ``data`` (any size) into partition ``pid``, as pipelined block-sized appends.

        Returns where it went.  A replication failure seals that extent on the leader: the unacknowledged
        blocks are written again to a new extent, so the returned locations are all on every replica."""
        mv = memoryview(data).cast("B")
        out: list[Location] = []
        pos = 0
        failures = 0
        while pos < len(mv):
            part = self.partition(pid)
            try:
                extent, offset = await self._extent_for(pid, min(len(mv) - pos, self.block_size))
            except ClientError as e:     # no new extent: only a stale map is worth another try
                failures += 1
                if failures > 3 or e.result not in (Result.STALE_EPOCH, Result.NOT_LEADER):
                    raise
                await self.refresh(pid)
                continue
            chunks = []
            while pos < len(mv) and offset + min(self.block_size, len(mv) - pos) <= MAX_EXTENT:
                n = min(self.block_size, len(mv) - pos)
                chunks.append((pos, offset, n))
                pos += n
                offset += n
            if not chunks:       # the extent is full: drop it
                continue
            done, err = await self._pipeline(part, extent, mv, chunks, on_progress)
            out.extend(done)
            if err is None:
                self._idle.setdefault(pid, []).append((extent, offset))
                continue
            # the extent is sealed (or refused): continue after the last acknowledged block on a new one
            failures += 1
            pos = chunks[len(done)][0]
            if failures > 3 or not isinstance(err, ClientError) or not await self._recoverable(pid, err):
                raise err
            log.warning("write to partition %d extent %d failed (%s); continuing on a new extent", pid,
                        extent, err)
        return out

    async def _recoverable(self, pid: int, err: ClientError) -> bool:
        """Can a write go on after ``err`` (on a new extent, after refreshing the map if it was stale)?"""
        if err.result in (Result.STALE_EPOCH, Result.NOT_LEADER):
            await self.refresh(pid)
            return True
        return err.result in (Result.REPLICATION_FAILED, Result.DIVERGED, Result.BAD_REQUEST, Result.NO_SPACE)

    async def refresh(self, pid: int) -> PartitionInfo:
        """Re-read the partition's replicas and epoch from its members (after a replica change)."""
        best: PartitionInfo | None = None
        for addr in list(self.partition(pid).replicas):
            try:
                infos = await self.discover(addr)
            except ClientError:
                continue
            for info in infos:
                if info.pid == pid and (best is None or info.epoch > best.epoch):
                    best = info
        if best is not None:            # the members' newest view wins, even over a newer-looking cache
            self.partitions[pid] = best
        self._idle.pop(pid, None)
        return self.partition(pid)

    async def _extent_for(self, pid: int, need: int) -> tuple[int, int]:
        idle = self._idle.get(pid, [])
        while idle:
            extent, offset = idle.pop()
            if offset + need <= MAX_EXTENT:
                return extent, offset
        return await self.create_extent(pid), 0

    async def _pipeline(self, part, extent, mv, chunks, on_progress):
        """Send appends in order with up to ``depth`` in flight; returns (acked prefix, first error)."""
        results: list = [None] * len(chunks)
        window = trio.Semaphore(self.depth)
        stop = False

        async def wait_one(i, fut):
            try:
                results[i] = await fut
                if on_progress:
                    on_progress(results[i].length)
            except ClientError as e:
                results[i] = e
            finally:
                window.release()

        async with aio.nursery() as n:
            for i, (pos, offset, length) in enumerate(chunks):
                await window.acquire()
                if stop or any(isinstance(r, ClientError) for r in results[:i]):
                    window.release()
                    break
                try:
                    fut = await self._submit_append(part, extent, offset, mv[pos:pos + length])
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

    async def read(self, pid: int, extent: int, offset: int, length: int, *,
                   replica: str | None = None) -> bytes:
        """Read a range; each block's CRC is checked; a failing replica is skipped for the next one."""
        part = self.partition(pid)
        order = [replica] if replica else list(part.replicas)
        out = bytearray(length)
        pos = 0
        async with aio.nursery() as n:
            limit = trio.Semaphore(self.depth)
            while pos < length:
                k = min(self.block_size, length - pos)
                await limit.acquire()
                n.start_soon(self._read_piece, part, order, extent, offset + pos, k, out, pos, limit)
                pos += k
        return bytes(out)

    async def _read_piece(self, part, order, extent, offset, length, out, pos, limit):
        try:
            errors = []
            refreshed = False
            queue = list(order)
            while queue:
                addr = queue.pop(0)
                flags = Flag.ANY_REPLICA if addr != part.replicas[0] else Flag.NONE
                h = Header(opcode=Op.READ, partition=part.pid, extent=extent, offset=offset, length=length,
                           epoch=part.epoch, flags=flags)
                dest = memoryview(out)[pos:pos + length]
                try:
                    resp, _ = await self.request(addr, h, answer=max(length, 1), sink=dest)
                    check(resp, addr, part)
                    if resp.length != length or crc32c(dest) != resp.crc:
                        raise ClientError(f"{addr}: data arrived with a bad CRC", Result.CRC_MISMATCH, addr)
                except ClientError as e:
                    if e.result == Result.STALE_EPOCH and not refreshed:   # the map changed: reload, retry
                        refreshed = True
                        part = await self.refresh(part.pid)
                        queue.insert(0, addr)
                        continue
                    errors.append(e)     # a replica being repaired may not have the range yet: next one
                    continue
                return
            raise errors[-1] if len(errors) == 1 else ClientError(
                "read failed on every replica: " + "; ".join(str(e) for e in errors),
                errors[-1].result, errors[-1].node)
        finally:
            limit.release()

    async def read_location(self, loc: Location, replica: str | None = None) -> bytes:
        return await self.read(loc.partition, loc.extent, loc.offset, loc.length, replica=replica)

    async def watermarks(self, pid: int, addr: str | None = None) -> dict[int, int]:
        part = self.partition(pid)
        marks = await self.admin(addr or part.replicas[0], Op.WATERMARKS, partition=pid)
        return {int(k): v for k, v in marks.items()}

    async def delete_extent(self, pid: int, extent: int) -> None:
        part = self.partition(pid)
        resp, _ = await self.request(part.replicas[0], Header(opcode=Op.MARK_DELETE, partition=pid,
                                                              extent=extent, epoch=part.epoch))
        check(resp, part.replicas[0], part)


def check(resp: Header, addr: str, part: PartitionInfo | None = None) -> None:
    """Raise the right ClientError for a response that is not OK."""
    if resp.result == Result.OK:
        return
    res = Result(resp.result)
    text = f"{addr}: {resp.result_text()}"
    if res == Result.REPLICATION_FAILED:
        replica = part.replicas[resp.arg] if part and 0 < resp.arg < len(part.replicas) else None
        raise ReplicationError(f"{addr}: replication failed at replica {replica or '#%d' % resp.arg}",
                               replica, result=res, node=addr, arg=resp.arg)
    if res == Result.STALE_EPOCH:
        text += f" (node is at epoch {resp.arg})"
    elif res == Result.BAD_REQUEST and resp.arg:
        text += f" (detail {resp.arg})"
    raise ClientError(text, res, addr, resp.arg)


class BlockingDataClient:
    """The same client for code that is not async: runs a trio loop in a helper thread."""

    def __init__(self, nodes: Iterable[str] = (), **kw):
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._stop = None
        self._thread = threading.Thread(target=self._main, args=(list(nodes), kw), daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error:
            raise self._error

    def _main(self, nodes, kw):
        async def run():
            try:
                async with DataClient.open(nodes, **kw) as dc:
                    self.dc = dc
                    self._token = trio.lowlevel.current_trio_token()
                    self._stop = trio.Event()
                    self._ready.set()
                    await self._stop.wait()
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                self._error = e
                self._ready.set()
        trio.run(run)

    def _call(self, fn, *args, **kw):
        return trio.from_thread.run(lambda: fn(*args, **kw), trio_token=self._token)

    def write(self, pid, data):
        return self._call(self.dc.write, pid, data)

    def read(self, pid, extent, offset, length, replica=None):
        return self._call(self.dc.read, pid, extent, offset, length, replica=replica)

    def read_location(self, loc, replica=None):
        return self._call(self.dc.read_location, loc, replica)

    def create_extent(self, pid):
        return self._call(self.dc.create_extent, pid)

    def close(self):
        if self._stop is not None:
            trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
        self._thread.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
