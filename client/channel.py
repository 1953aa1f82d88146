"""One request to a datanode over the client's registered memory, and what a request names and raises.

The client's memory is registered once, like the server's: a staging pool the datanodes may READ (write
payloads) and a landing pool they may WRITE (read answers); each request exposes one block of it, to the
connection it is sent on, until its answer arrives (``rpc.Requester`` grants; nothing else is reachable).
Where every link is TCP (no RDMA device: a registration is a table entry, not a pin) a big append's payload
and a read's answer skip the pools: the caller's own buffer is registered for that one request instead, so
the bytes are not copied on the client.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Awaitable

import trio

from client.metrics import ClientMetrics
from wire import trace
from wire.auth import DialAuth
from wire.crc import crc32c
from wire.pool import BuddyPool, PoolExhausted
from wire.protocol import Flag, Header, Op, Result, failed_replicas
from wire.rpc import Links, PeerSilent
from wire.transport.base import Access, ConnectionClosed, Domain, TransportError, address_of
from wire.transport.connect import AuthError, NotAdmitted

ADMIN_ANSWER = 1 << 20      # bytes of landing memory an admin request reserves for its JSON answer
HUGE_POOL_MIB = 16          # pools of at least this many MiB each go on huge pages (BuddyPool.huge_pages)


class ClientError(Exception):
    """A request failed.  ``result`` is the protocol Result (or None for a transport failure)."""

    conn_lost = False     # the request failed because an established connection was found closed
    silent = False        # the node answered nothing at all, not even a ping (paused, hung: rpc.PeerSilent)
    auth = False          # the hello's authentication failed (no secret, another cluster's, refused)

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
    rev: int = 0                    # etcd's revision of the view this came from (0: learnt from the nodes)


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


def transport_error(addr: str, e: TransportError) -> ClientError:
    err = ClientError(f"{addr}: {e}" if not str(e).startswith(addr) else str(e), node=addr)
    err.silent = isinstance(e, PeerSilent)
    err.auth = isinstance(e, AuthError) and not isinstance(e, NotAdmitted)
    return err


class Channel:
    """The client's requests to the datanodes: the links it dials, the memory it registers for them, and
    the metrics of every request it sends."""

    def __init__(self, nursery: trio.Nursery, domain: Domain, auth: DialAuth, *, transport: str, timeout: float,
                 max_block: int, pool_mib: int, inline_max: int, source: str = ""):
        self.domain = domain
        self.timeout = timeout
        self.inline_max = inline_max
        # huge pages for the pools of a client that moves data in bulk; a small one (a map reader, a short
        # script) would pay their first touches -- each may stall on the kernel's compaction -- at its open
        huge = pool_mib >= HUGE_POOL_MIB
        self.wpool = BuddyPool(pool_mib << 20, max_block, huge_pages=huge)
        self.rpool = BuddyPool(pool_mib << 20, max_block, huge_pages=huge)
        self.wregion = domain.register(self.wpool.arena, self.wpool.base_addr, Access.REMOTE_READ, scoped=True)
        self.rregion = domain.register(self.rpool.arena, self.rpool.base_addr,
                                       Access.LOCAL_WRITE | Access.REMOTE_WRITE, scoped=True)
        self.links = Links(nursery, domain, transport=transport, slots=64, connect_timeout=timeout, auth=auth,
                           source=source)
        # an admin answer reserves ADMIN_ANSWER of the receive pool for the whole request: more admin
        # requests at once than the pool holds would wait for memory and fail ("pool exhausted") -- a
        # manager moving many partitions at once sends hundreds -- so the excess waits here, unhurried
        self.admin_slots = trio.CapacityLimiter(max(1, (pool_mib << 20) // ADMIN_ANSWER))
        self.metrics = ClientMetrics()       # Prometheus families for an embedding program (client/metrics.py)

    async def hello(self, addr: str) -> None:
        """Connect to ``addr`` now, if no link is up: raises the ClientError of a refused hello (``auth``),
        and only that (a node that is down is someone else's concern)."""
        try:
            await self.links.get(addr)
        except TransportError as e:
            err = transport_error(addr, e)
            if err.auth:
                raise err from None

    def suspect(self, addr: str) -> bool:
        """Did ``addr`` stop answering (given up on for silence, and silent since)?"""
        return self.links.suspect(addr)

    def release(self) -> None:
        """Give the pools' registrations back (once the links are gone: on verbs their windows hold them)."""
        self.domain.deregister(self.wregion)
        self.domain.deregister(self.rregion)

    async def request(self, addr: str, h: Header, *, body: bytes | None = None, answer: int = 0,
                      sink: memoryview | None = None, timeout: float | None = None) -> tuple[Header, bytes]:
        """Send one request to ``addr``; ``body`` is exposed for the server to READ, ``answer`` bytes of
        landing memory for it to WRITE.  Returns (response, answer bytes) — or, with ``sink``, puts the
        answer into it and returns b"" in its place.

        Where every link is TCP (no RDMA device: registering memory costs a table entry, not a pin), the
        answer lands straight in ``sink``: it is registered for this one request, granted to the node for
        it alone (``rpc``), and deregistered before we return -- no landing block and no copy (copying a
        large answer costs the client more CPU than the registration).  With a device the answer lands in
        the registered pool and is copied (a per-request MR registration would cost more than the copy)."""
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
                err = transport_error(addr, e)
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

    async def admin(self, addr: str, op: Op, *, partition: int = 0, body=None, answer: int = ADMIN_ANSWER,
                    epoch: int = 0):
        """An admin request with an optional JSON body and JSON answer; raises ClientError on failure."""
        raw = json.dumps(body).encode() if body is not None else None
        async with self.admin_slots:
            resp, data = await self.request(addr, Header(opcode=op, partition=partition, epoch=epoch), body=raw,
                                            answer=0 if raw is not None else answer)
        check(resp, addr)
        return json.loads(data) if data else resp

    async def submit_append(self, part: PartitionInfo, extent: int, offset: int,
                            data: memoryview) -> Awaitable[Location]:
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
            raise transport_error(leader, e) from None
        except BaseException:
            self._unstage(block, region)
            raise

        async def finish() -> Location:
            resp = None
            try:
                resp = await pending.result()
            except TransportError as e:
                raise transport_error(leader, e) from None
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
