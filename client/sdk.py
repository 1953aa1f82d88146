"""The client SDK: what a mounted filesystem client calls for its write and read path.

``DataClient`` (trio) knows the partition map, creates extents, writes data of any size as a pipeline of
block-sized appends, reads ranges with CRC checks (failing over to another replica), and moves to a new
extent after a replication failure.  ``BlockingDataClient`` wraps it for callers that are not async.

With ``etcd=URL`` the partition map comes from etcd (datanode/etcdmap.py): read once, then kept current by a
watch, so a new leader or replica set is known within one watch round-trip; a write that fails because a
replica died waits (within ``timeout``) for the manager's new view and goes on with it on a new extent.
``put(data)`` needs no partition: it picks a writable one from etcd's map for each new extent (spreading
over partitions and leaders) and, when a replica dies mid-write, writes the unacknowledged rest to another
partition within ``timeout``.

The client's memory is registered once, like the server's: a staging pool the datanodes may READ (write
payloads) and a landing pool they may WRITE (read answers); each request exposes one block of it, to the
connection it is sent on, until its answer arrives (``rpc.Requester`` grants; nothing else is reachable).
Where every link is TCP (no RDMA device: a registration is a table entry, not a pin) a big append's payload
and a read's answer skip the pools: the caller's own buffer is registered for that one request instead, so
the bytes are not copied on the client.

Credentials: ``secret=`` a cluster secret or role key file (or $DATANODE_SECRET_FILE); ``role=`` the role to
claim (default: admin when the file allows it, else client).  See datanode/auth.py.  TLS: ``tls_ca=`` a CA
bundle (or $DATANODE_TLS_CA): every connection then speaks TLS and checks the node's certificate
(datanode/transport/tls.py).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import random
import threading
from functools import partial
from contextlib import asynccontextmanager
from typing import AsyncIterator, Awaitable, Iterable

import trio

from client.metrics import ClientMetrics
from datanode import aio, trace
from datanode.auth import AuthConfigError, Credentials, DialAuth, ROLE_NAMES, from_env_or
from datanode.transport.tls import TlsConfigError, client_context_from_env
from datanode.crc import crc32c
from datanode.etcdmap import DEFAULT_PREFIX, Etcd, EtcdError, PartView, open_channel
from datanode.pool import BuddyPool, PoolExhausted
from datanode.protocol import INLINE_MAX, Flag, Header, Op, Result, failed_replicas
from datanode.rpc import Links
from datanode.store import MAX_EXTENT
from datanode.transport.base import Access, ConnectionClosed, Domain, TransportError, address_of
from datanode.transport.connect import make_domain

log = logging.getLogger(__name__)
FAILOVER_POLL_S = 1.0     # a failed write waits this long for a new view before trying again anyway


class ClientError(Exception):
    """A request failed.  ``result`` is the protocol Result (or None for a transport failure)."""

    conn_lost = False     # the request failed because an established connection was found closed

    def __init__(self, message: str, result: Result | None = None, node: str | None = None, arg: int = 0):
        super().__init__(message)
        self.result, self.node, self.arg = result, node, arg


class ReplicationError(ClientError):
    """The write is not on every replica; ``replicas`` names every follower that failed (``replica`` the
    first of them)."""

    def __init__(self, message: str, replicas: list[str], **kw):
        super().__init__(message, **kw)
        self.replicas = replicas
        self.replica = replicas[0] if replicas else None


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
    health: dict | None = None      # the leader's replica health, as of ``seen`` (trio time)
    seen: float = 0.0


class DataClient:
    def __init__(self, nursery: trio.Nursery, *, transport: str = "auto", timeout: float = 15.0,
                 block_size: int = 1 << 20, depth: int = 8, pool_mib: int = 64, domain: Domain | None = None,
                 etcd: str | None = None, etcd_prefix: str = DEFAULT_PREFIX,
                 secret: "str | Credentials | None" = None, role: str | None = None, tls_ca: str | None = None,
                 inline_max: int = INLINE_MAX, read_from: str = "leader"):
        if block_size & (block_size - 1) or not (4096 <= block_size <= 4 << 20):
            raise ValueError("block_size must be a power of two between 4 KiB and 4 MiB")
        if role is not None and role not in ROLE_NAMES:
            raise ValueError(f"role must be one of {', '.join(ROLE_NAMES)}, not {role!r}")
        try:
            creds = from_env_or(secret)
            self.auth = DialAuth(creds, ROLE_NAMES[role] if role else None, tls=client_context_from_env(tls_ca))
        except (AuthConfigError, TlsConfigError) as e:
            raise ClientError(str(e)) from None
        self.timeout = timeout
        # appends of at most this many bytes travel inline with their header where the connection allows it
        # (TCP: no READ round trip); 0 turns that off
        self.inline_max = max(0, min(inline_max, INLINE_MAX))
        if read_from not in ("leader", "spread"):
            raise ValueError(f"read_from must be 'leader' or 'spread', not {read_from!r}")
        # "spread": each read request goes to the next replica in turn (acknowledged bytes are on every
        # replica), the others as fallbacks; "leader": the leader first
        self.read_from = read_from
        self._next_replica = 0
        self.block_size = block_size
        self.depth = depth
        self.domain = domain or make_domain(transport)
        self.partitions: dict[int, PartitionInfo] = {}
        self.map = Etcd(etcd, etcd_prefix) if etcd else None   # the cluster map in etcd, if any
        self.views: dict[int, PartView] = {}                    # etcd's views (state, want, ...)
        self._map_changed = trio.Event()
        max_block = max(block_size, 1 << 20)
        self.wpool = BuddyPool(pool_mib << 20, max_block)
        self.rpool = BuddyPool(pool_mib << 20, max_block)
        self.wregion = self.domain.register(self.wpool.arena, self.wpool.base_addr, Access.REMOTE_READ,
                                            scoped=True)
        self.rregion = self.domain.register(self.rpool.arena, self.rpool.base_addr,
                                            Access.LOCAL_WRITE | Access.REMOTE_WRITE, scoped=True)
        self.links = Links(nursery, self.domain, transport=transport, slots=64, connect_timeout=timeout,
                           auth=self.auth)
        self.metrics = ClientMetrics()       # Prometheus families for an embedding program (client/metrics.py)
        # open extents not in use by a write() right now: partition -> [(extent, next offset)].  A write
        # takes one for itself, so concurrent writes never append to the same extent.
        self._idle: dict[int, list[tuple[int, int]]] = {}
        # put(): how many extents this client started per partition, puts in flight per leader, and
        # extents a failed attempt left empty (taken back once the partition can delete again)
        self._picked: dict[int, int] = {}
        self._busy: dict[str, int] = {}
        self._abandoned: dict[tuple[int, int], int] = {}
        self.put_failovers = 0          # times put() went on with another partition after a failure

    @classmethod
    @asynccontextmanager
    async def open(cls, nodes: Iterable[str] = (), **kw) -> AsyncIterator["DataClient"]:
        """A client whose partition map is loaded from ``nodes`` (any datanodes of the cluster)."""
        dc = None
        try:
            async with aio.nursery() as nursery:
                dc = cls(nursery, **kw)
                try:
                    if dc.map is not None:
                        try:
                            rev = await dc.load_map()
                        except EtcdError as e:
                            raise ClientError(f"partition map: {e}") from None
                        nursery.start_soon(dc._follow_map, rev)
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
        finally:
            if dc is not None:
                dc._release()       # once the links are gone (on verbs their windows hold the MRs)

    def _release(self) -> None:
        self.domain.deregister(self.wregion)
        self.domain.deregister(self.rregion)

    # -- plumbing ---------------------------------------------------------------------------------
    async def request(self, addr: str, h: Header, *, body: bytes | None = None, answer: int = 0,
                      sink: memoryview | None = None, timeout: float | None = None) -> tuple[Header, bytes]:
        """Send one request to ``addr``; ``body`` is exposed for the server to READ, ``answer`` bytes of
        landing memory for it to WRITE.  Returns (response, answer bytes) — or, with ``sink``, puts the
        answer into it and returns b"" in its place.

        Where every link is TCP (no RDMA device: registering memory costs a table entry, not a pin), the
        answer lands straight in ``sink``: it is registered for this one request, granted to the node for
        it alone (``rpc``), and deregistered before we return -- no landing block and no copy (a 1 MiB
        read's memmove was ~20% of the client's CPU).  With a device the answer lands in the registered
        pool and is copied (a per-request MR registration would cost more than the copy)."""
        wblock = rblock = sregion = None
        try:
            if body is not None:
                wblock = await self.wpool.alloc(len(body), timeout=self.timeout)
                wblock.view(len(body))[:] = body
                h = dataclasses.replace(h, addr=wblock.addr, rkey=self.wregion.rkey, rlen=len(body),
                                        length=len(body))
            if (answer and sink is not None and self.domain.device is None and len(sink) >= answer
                    and not sink.readonly):
                sregion = self.domain.register(sink, address_of(sink), Access.LOCAL_WRITE | Access.REMOTE_WRITE,
                                               scoped=True)
                h = dataclasses.replace(h, addr=sregion.addr, rkey=sregion.rkey, rlen=answer)
            elif answer:
                rblock = await self.rpool.alloc(answer, timeout=self.timeout)
                h = dataclasses.replace(h, addr=rblock.addr, rkey=self.rregion.rkey, rlen=answer)
            t0 = trio.current_time()
            link = None
            try:
                link = await self.links.get(addr)
                resp = await link.call(h, timeout or self.timeout)
            except TransportError as e:
                self.metrics.observe(h.opcode, -1, h.length, trio.current_time() - t0)
                err = ClientError(f"{addr}: {e}", node=addr)
                # a connection we had, found closed (the node restarted, or reset it): a new one may serve
                err.conn_lost = link is not None and isinstance(e, ConnectionClosed)
                raise err from None
            self.metrics.observe(h.opcode, resp.result, h.length, trio.current_time() - t0)
            data = b""
            if rblock is not None and resp.result == Result.OK:
                if sink is not None:   # (not registered above: a device)
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
            if sregion is not None:
                self.domain.deregister(sregion)

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
            if addr == info.replicas[0] and p.get("health"):      # only the leader keeps replica health
                info.health, info.seen = p["health"], trio.current_time()
            elif old is not None and old.epoch == info.epoch:
                info.health, info.seen = old.health, old.seen
            if old is None or info.epoch >= old.epoch:
                self.partitions[info.pid] = info
            found.append(info)
        return found

    # -- the map from etcd ---------------------------------------------------------------------------
    async def load_map(self) -> int:
        """Read every partition's view from etcd; returns the revision it was read at."""
        kvs, rev = await self.map.get_prefix(self.map.parts_prefix)
        for _k, v, mrev in kvs:
            try:
                self._learn(PartView.decode(v, mrev))
            except (ValueError, TypeError):
                continue
        return rev

    def _learn(self, view: PartView) -> None:
        old = self.partitions.get(view.id)
        if old is None or view.epoch >= old.epoch:
            self.views[view.id] = view
            self.partitions[view.id] = PartitionInfo(view.id, list(view.replicas), view.epoch)
            if old is not None and view.epoch > old.epoch:
                self._idle.pop(view.id, None)       # open extents of the old epoch: start new ones
                log.info("partition %d: epoch %d, leader %s (from etcd)", view.id, view.epoch, view.leader)
            ev, self._map_changed = self._map_changed, trio.Event()
            ev.set()

    async def _follow_map(self, rev: int) -> None:
        send, recv = open_channel()
        async with trio.open_nursery() as n:
            n.start_soon(partial(self.map.watch, self.map.parts_prefix, send, start_revision=rev + 1))
            async for batch in recv:
                if batch is None:                       # reconnected: events may be missing
                    try:
                        await self.load_map()
                    except EtcdError:
                        pass
                    continue
                for typ, _key, value, mrev in batch:
                    if typ == "PUT":
                        try:
                            self._learn(PartView.decode(value, mrev))
                        except (ValueError, TypeError):
                            pass

    async def _await_new_view(self, pid: int, epoch: int, deadline: float) -> bool:
        """Wait until the map has partition ``pid`` above ``epoch``, or a newer installed view of it
        (the manager finished installing the one we have) (True), or ``deadline`` (False)."""
        v0 = self.views.get(pid)
        rev0 = v0.rev if v0 is not None else None
        while True:
            info, v = self.partitions.get(pid), self.views.get(pid)
            if info is not None and info.epoch > epoch:
                return True
            if v is not None and v.rev != rev0 and v.installed:
                return True
            ev = self._map_changed
            with trio.move_on_at(deadline):
                await ev.wait()
            if trio.current_time() >= deadline:
                return False

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

    async def submit_append(self, part: PartitionInfo, extent: int, offset: int, data) -> "Awaitable[Location]":
        """Send one append without waiting for it; returns an awaitable for its Location (so a caller --
        a benchmark, a pipeline -- can keep ``depth`` appends in flight, as ``write`` does).  ``data`` must
        not change until that awaitable is done: where every link is TCP the leader reads it from there."""
        return await self._submit_append(part, extent, offset, memoryview(data))

    async def _submit_append(self, part: PartitionInfo, extent: int, offset: int, data: memoryview):
        """Sends one append and returns an awaitable for its result (so a caller can keep sending).  A small
        one (``inline_max``) goes inline with its header where the link carries it (protocol.Flag.INLINE):
        no staging copy, no READ round trip; a larger one names memory the leader READs: the caller's own
        bytes where every link is TCP, else a staging block of the registered pool."""
        leader = part.replicas[0]
        n = len(data)
        block = region = None
        if trace.ON:
            trace.mark("submit", extent, offset)
        try:
            link = await self.links.get(leader)
            if n <= self.inline_max and n <= link.conn.max_inline:
                crc = crc32c(data)
                h = Header(opcode=Op.WRITE, partition=part.pid, extent=extent, offset=offset, length=n,
                           crc=crc, epoch=part.epoch, flags=Flag.INLINE)
                t0 = trio.current_time()
                pending = await link.submit(h, self.timeout, data)
            else:
                if self.domain.device is None:
                    # every link is TCP: the leader READs the caller's own bytes, registered for this one
                    # append and granted for it alone (as read_into's sink), deregistered once it is
                    # answered -- no staging copy (so the bytes must not change until then: ``finish``)
                    region = self.domain.register(data, address_of(data), Access.REMOTE_READ, scoped=True)
                    addr, rkey, crc = region.addr, region.rkey, crc32c(data)
                else:
                    block = await self.wpool.alloc(n, timeout=self.timeout)
                    view = block.view(n)
                    view[:] = data
                    addr, rkey, crc = block.addr, self.wregion.rkey, crc32c(view)
                h = Header(opcode=Op.WRITE, partition=part.pid, extent=extent, offset=offset, length=n,
                           crc=crc, epoch=part.epoch, addr=addr, rkey=rkey, rlen=n)
                t0 = trio.current_time()
                pending = await link.submit(h, self.timeout)
        except TransportError as e:
            self._unstage(block, region)
            raise ClientError(f"{leader}: {e}", node=leader) from None
        except BaseException:
            self._unstage(block, region)
            raise

        async def finish() -> Location:
            resp = None
            try:
                resp = await pending.result()
            except TransportError as e:
                raise ClientError(f"{leader}: {e}", node=leader) from None
            finally:
                self._unstage(block, region)
                self.metrics.observe(Op.WRITE, resp.result if resp is not None else -1, len(data),
                                     trio.current_time() - t0)
            if trace.ON:
                trace.mark("answered", extent, offset)
            check(resp, leader, part)
            return Location(part.pid, extent, offset, len(data), crc)

        return finish()

    def _unstage(self, block, region) -> None:
        """An append's payload is no longer needed by the leader: its staging block back to the pool, or
        the caller's registered bytes out of the domain."""
        if block is not None:
            self.wpool.free(block)
        if region is not None:
            self.domain.deregister(region)

    async def write(self, pid: int, data, *, on_progress=None) -> list[Location]:
        """Write ``data`` (any size) into partition ``pid``, as pipelined block-sized appends.

        Returns where it went.  A replication failure seals that extent on the leader: the unacknowledged
        blocks are written again to a new extent, so the returned locations are all on every replica.
        A ClientError raised here carries ``done``: the locations acknowledged before it (a prefix of
        ``data``), so a caller can retry only the rest."""
        mv = memoryview(data).cast("B")
        out: list[Location] = []
        pos = 0
        failures = 0
        deadline = None
        while pos < len(mv):
            part = self.partition(pid)
            try:
                extent, offset = await self._extent_for(pid, min(len(mv) - pos, self.block_size))
            except ClientError as e:     # no new extent: only a stale map is worth another try
                failures += 1
                if self.map is not None and _changes_view(e):
                    deadline = deadline or trio.current_time() + self.timeout
                    if not await self._failover(pid, part, e, deadline):
                        raise _acked(e, out)
                    continue
                if failures > 3 or e.result not in (Result.STALE_EPOCH, Result.NOT_LEADER):
                    raise _acked(e, out)
                await self.refresh(pid)
                continue
            chunks, pos, offset = self._chunks(len(mv), pos, offset)
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
            if self.map is not None and isinstance(err, ClientError) and _changes_view(err):
                deadline = deadline or trio.current_time() + self.timeout
                if not await self._failover(pid, part, err, deadline):
                    raise _acked(err, out)
                continue
            if failures > 3 or not isinstance(err, ClientError) or not await self._recoverable(pid, err):
                raise _acked(err, out)
            log.warning("write to partition %d extent %d failed (%s); continuing on a new extent", pid,
                        extent, err)
        return out

    # -- put: the client picks the partition (the map from etcd) -----------------------------------------
    def writable(self, avoid: dict[int, tuple[int, float]] | None = None) -> list[int]:
        """Partitions a new extent may go to now, best first: etcd says it takes writes (``writable``, else
        ``degraded``/``recovering`` with its view installed), it was not just failed on (``avoid``: pid ->
        (view revision, until); a new view of it lifts that), and -- to spread load -- its leader has the
        fewest of our puts in flight and we started the fewest extents in it."""
        now = trio.current_time()
        cands = []
        for pid, v in self.views.items():
            info = self.partitions.get(pid)
            if info is None or not v.installed or v.state not in PUT_STATES or not info.replicas:
                continue
            a = (avoid or {}).get(pid)
            if a is not None and a[0] == v.rev and now < a[1]:
                continue
            cands.append(((PUT_STATES[v.state], self._busy.get(info.replicas[0], 0), self._picked.get(pid, 0),
                           random.random()), pid))     # ties: at random, so separate clients spread too
        return [pid for _k, pid in sorted(cands)]

    async def put(self, data, *, on_progress=None, timeout: float | None = None) -> list[Location]:
        """Write ``data`` (any size) to partitions the client picks from etcd's map; returns where it went
        (the locations may span partitions).

        Each new extent goes to the best writable partition (``writable``).  When a write fails because a
        replica died or the map changed (REPLICATION_FAILED, a timeout or lost connection, NOT_LEADER,
        STALE_EPOCH, ...), the unacknowledged part is written again on another writable partition, until
        ``timeout`` (default: the client's) -- the caller sees an error only when that runs out (or for a
        failure no other partition cures).  Every returned location is on every replica of its partition."""
        if self.map is None:
            raise ClientError("put without a partition needs the cluster map from etcd "
                              "(DataClient.open(etcd=URL)); or write(partition, data)")
        mv = memoryview(data).cast("B")
        deadline = trio.current_time() + (timeout if timeout is not None else self.timeout)
        out: list[Location] = []
        avoid: dict[int, tuple[int, float]] = {}
        last: ClientError | None = None
        pos = 0
        await self._take_back_abandoned()
        while pos < len(mv):
            now = trio.current_time()
            if now >= deadline:
                raise last or ClientError(f"no writable partition within {self.timeout:g}s", Result.NOT_FOUND)
            cands = self.writable(avoid)
            if not cands:
                if not self.views:
                    raise ClientError("no partition in the cluster map (is a manager running? create some: "
                                      "dnctl partition create --count N)", Result.NOT_FOUND)
                ev = self._map_changed           # wait for a new view (a failover, a shrink) or try again
                with trio.move_on_at(min(deadline, now + FAILOVER_POLL_S)):
                    await ev.wait()
                if trio.current_time() >= min(deadline, now + FAILOVER_POLL_S):
                    avoid.clear()
                continue
            pid = cands[0]
            part = self.partition(pid)
            leader = part.replicas[0]
            self._picked[pid] = self._picked.get(pid, 0) + 1
            self._busy[leader] = self._busy.get(leader, 0) + 1
            extent, start, fresh, done = None, pos, False, []
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
                self._busy[leader] -= 1
            out.extend(done)
            if err is None:
                self._idle.setdefault(pid, []).append((extent, offset))
                continue
            pos = start + sum(loc.length for loc in done)      # go on after the acknowledged prefix
            if not _retry_elsewhere(err):
                raise err
            last = err
            self.put_failovers += 1
            avoid[pid] = (self.views[pid].rev if pid in self.views else 0, trio.current_time() + AVOID_S)
            self._idle.pop(pid, None)
            if extent is not None and fresh and not done:
                self._abandoned[(pid, extent)] = avoid[pid][0]
            log.info("put: partition %d failed (%s); going on with another partition", pid, err)
        return out

    async def _take_back_abandoned(self) -> None:
        """Delete extents a failed put left without an acknowledged byte, once their partition has a new
        view (the delete needs every replica of the current one); bounded, best effort."""
        for (pid, extent), rev in list(self._abandoned.items()):
            v = self.views.get(pid)
            if v is None:
                del self._abandoned[(pid, extent)]
                continue
            if v.rev == rev or not v.installed:
                continue
            with trio.move_on_after(min(self.timeout, 2.0)):
                try:
                    await self.delete_extent(pid, extent)
                    del self._abandoned[(pid, extent)]
                except ClientError as e:
                    if e.result == Result.NOT_FOUND:
                        del self._abandoned[(pid, extent)]

    async def _failover(self, pid: int, part: PartitionInfo, err: ClientError, deadline: float) -> bool:
        """With the map in etcd: after a dead replica, a dead leader or a stale map, wait (until
        ``deadline``) for a view newer than the one that failed, at most ``FAILOVER_POLL_S`` at a time
        (the failure may have been passing, with no new view coming).  False: give up."""
        if trio.current_time() >= deadline:
            return False
        log.info("write to partition %d (epoch %d) failed: %s; waiting for a new view", pid, part.epoch, err)
        if not await self._await_new_view(pid, part.epoch, min(deadline, trio.current_time() + FAILOVER_POLL_S)):
            try:
                await self.refresh(pid)
            except ClientError:
                pass
        self._idle.pop(pid, None)
        return True

    async def _recoverable(self, pid: int, err: ClientError) -> bool:
        """Can a write go on after ``err`` (on a new extent, after refreshing the map if it was stale)?"""
        if err.result in (Result.STALE_EPOCH, Result.NOT_LEADER):
            await self.refresh(pid)
            return True
        if err.result in (Result.BUSY, Result.POOL_BUSY):     # our share of the node's pool: back off, go on
            await trio.sleep(0.05)
            return True
        return err.result in (Result.REPLICATION_FAILED, Result.DIVERGED, Result.WRONG_OFFSET, Result.TOO_LARGE)

    async def refresh(self, pid: int) -> PartitionInfo:
        """Re-read the partition's replicas and epoch: from etcd when the map lives there, else from its
        members (after a replica change)."""
        if self.map is not None:
            try:
                view = await self.map.part(pid)
            except EtcdError as e:
                log.warning("partition %d: etcd: %s; asking its members", pid, e)
            else:
                if view is not None:
                    self._learn(view)
                    self._idle.pop(pid, None)
                    return self.partition(pid)
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
        await self._check_followers(self.partition(pid))
        return await self.create_extent(pid), 0

    HEALTH_FRESH_S = 5.0

    async def _check_followers(self, part: PartitionInfo) -> None:
        """Refuse to create an extent that cannot be replicated: if the leader said a moment ago
        (``HEALTH_FRESH_S``) that a follower is unreachable and it does not answer us either, raise the
        ReplicationError the create would end in -- without the create, which would leave one more empty
        extent on the replicas that are up on every attempt."""
        h = part.health or {}
        if trio.current_time() - part.seen > self.HEALTH_FRESH_S:
            return
        for addr, state in (h.get("followers") or {}).items():
            if state != "unreachable" or addr not in part.replicas:
                continue
            try:
                with trio.fail_after(min(self.timeout, 2.0)):
                    await self.admin(addr, Op.NODE_STATUS)
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
        if len(chunks) == 1:             # one append (a small write, an fsync's): no window, nursery or task
            pos, offset, length = chunks[0]
            try:
                loc = await (await self._submit_append(part, extent, offset, mv[pos:pos + length]))
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
        out = bytearray(length)
        await self.read_into(pid, extent, offset, out, replica=replica)
        return bytes(out)

    async def read_into(self, pid: int, extent: int, offset: int, buf, *, replica: str | None = None) -> int:
        """``read`` into ``buf`` (any writable buffer: its length is the range's length), with no buffer of
        our own and no copy -- for a caller that reads many ranges into buffers it reuses.  Returns the
        bytes read.  On an error ``buf`` holds no unverified bytes of the failed piece."""
        part = self.partition(pid)
        order = [replica] if replica else list(part.replicas)
        view = memoryview(buf).cast("B")
        length = len(view)
        if not length:
            return 0
        if length <= self.block_size:          # one request: no nursery
            if not replica and self.read_from == "spread" and len(order) > 1:
                order = self._spread(part)
            await self._read_one(part, order, extent, offset, view)
            return length
        pos = 0
        failed: list[ClientError] = []
        async with aio.nursery() as n:
            limit = trio.Semaphore(self.depth)
            while pos < length:
                k = min(self.block_size, length - pos)
                await limit.acquire()
                if failed:                # start no more; the pieces in flight finish (see _read_piece)
                    limit.release()
                    break
                if not replica and self.read_from == "spread" and len(order) > 1:
                    order = self._spread(part)
                n.start_soon(self._read_piece, part, order, extent, offset + pos, view[pos:pos + k], limit,
                             failed)
                pos += k
        if failed:
            raise failed[0]
        return length

    def _spread(self, part) -> list[str]:
        """The replicas in the order to try for the next read under ``read_from='spread'``."""
        i = self._next_replica % len(part.replicas)
        self._next_replica += 1
        return list(part.replicas[i:]) + list(part.replicas[:i])

    async def _read_piece(self, part, order, extent, offset, dest, limit, failed):
        """One piece of a ``read_into``.  A failed piece does not cancel the others: cancelling a READ in
        flight revokes its landing buffer under the node's answer, and on verbs the node's refused RDMA
        WRITE resets the whole connection (every other request on it fails too)."""
        try:
            await self._read_one(part, order, extent, offset, dest)
        except ClientError as e:
            failed.append(e)
        finally:
            limit.release()

    async def _read_one(self, part, order, extent, offset, dest):
        """One READ request of ``len(dest)`` bytes into ``dest``, trying the replicas in ``order``."""
        length = len(dest)
        errors = []
        refreshed = redialed = False
        queue = list(order)
        while queue:
            addr = queue.pop(0)
            flags = Flag.ANY_REPLICA if addr != part.replicas[0] else Flag.NONE
            h = Header(opcode=Op.READ, partition=part.pid, extent=extent, offset=offset, length=length,
                       epoch=part.epoch, flags=flags)
            try:
                if trace.ON:
                    trace.mark("read.submit", extent, offset)
                resp, _ = await self.request(addr, h, answer=max(length, 1), sink=dest)
                check(resp, addr, part)
                if resp.length != length or crc32c(dest) != resp.crc:
                    raise ClientError(f"{addr}: data arrived with a bad CRC", Result.CRC_MISMATCH, addr)
                if trace.ON:
                    trace.mark("read.answered", extent, offset)
            except ClientError as e:
                if e.result == Result.STALE_EPOCH and not refreshed:   # the map changed: reload, retry
                    refreshed = True
                    part = await self.refresh(part.pid)
                    queue.insert(0, addr)
                    continue
                if e.conn_lost and not redialed:     # a READ is safe to repeat: once, on a new connection
                    redialed = True
                    queue.insert(0, addr)
                    continue
                errors.append(e)     # a replica being repaired may not have the range yet: next one
                continue
            return
        dest[:] = bytes(length)           # never leave unverified bytes in the caller's buffer
        if len(errors) == 1:
            raise errors[-1]
        reasons: dict[str, list[str]] = {}      # one reason, once, with the replicas that gave it
        for e in errors:
            text = str(e)
            node = e.node or ""
            reasons.setdefault(text[len(node) + 2:] if node and text.startswith(node + ": ") else text,
                               []).append(node or "?")
        raise ClientError("read failed on every replica: " + "; ".join(
            f"{', '.join(nodes)}: {why}" for why, nodes in reasons.items()), errors[-1].result,
            errors[-1].node, errors[-1].arg)

    async def read_location(self, loc: Location, replica: str | None = None) -> bytes:
        return await self.read(loc.partition, loc.extent, loc.offset, loc.length, replica=replica)

    async def watermarks(self, pid: int, addr: str | None = None) -> dict[int, int]:
        part = self.partition(pid)
        marks = await self.admin(addr or part.replicas[0], Op.WATERMARKS, partition=pid)
        return {int(k): v for k, v in marks.items()}

    def forget_extent(self, pid: int, extent: int) -> None:
        """Never append to ``extent`` again (call before deleting an extent this client wrote to)."""
        self._idle[pid] = [(e, o) for e, o in self._idle.get(pid, []) if e != extent]

    async def delete_extent(self, pid: int, extent: int) -> None:
        part = self.partition(pid)
        resp, _ = await self.request(part.replicas[0], Header(opcode=Op.MARK_DELETE, partition=pid,
                                                              extent=extent, epoch=part.epoch))
        check(resp, part.replicas[0], part)


def _acked(e: Exception, done: list[Location]) -> Exception:
    """``e`` with the locations a write had acknowledged before it (``e.done``)."""
    e.done = list(done)
    return e


PUT_STATES = {"writable": 0, "degraded": 1, "recovering": 2}     # etcd states a put may use, preferred first
AVOID_S = 2.0     # put: a partition that just failed is skipped this long (or until it has a new view)


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


def check(resp: Header, addr: str, part: PartitionInfo | None = None) -> None:
    """Raise the right ClientError for a response that is not OK."""
    if resp.result == Result.OK:
        return
    res = Result(resp.result)
    text = f"{addr}: {resp.result_text()}"
    if res == Result.REPLICATION_FAILED:
        idx = failed_replicas(resp.arg)
        names = [part.replicas[i] if part and i < len(part.replicas) else f"#{i}" for i in idx]
        raise ReplicationError(f"{addr}: replication failed at replica {', '.join(names) or '?'}",
                               names, result=res, node=addr, arg=resp.arg)
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

    def put(self, data, timeout=None):
        return self._call(self.dc.put, data, timeout=timeout)

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
