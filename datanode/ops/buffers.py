"""A request's bytes: blocks of the registered pool (a connection gets its share), the one-sided ops that
move bytes between a peer's buffer and a block (bounded in time), a connection's answer budget, and JSON
bodies and answers."""
from __future__ import annotations

import json

import trio

from wire.pool import Block, BuddyPool, PoolExhausted
from wire.protocol import BodyError, Header, RemoteBuf, Result
from wire.transport.base import Access, Connection, ConnectionClosed, Region, RemoteAccessError
from ..config import MemoryConfig
from .base import PeerTimeout, Reply, bad_body

MAX_JSON = 1 << 20
ANSWER_BYTES = 8 << 20      # one connection's one-sided answers (read payloads, JSON) being prepared or sent


class ByteBudget:
    """Bytes one connection's answers may have in preparation or on the wire at once (``ANSWER_BYTES``).  Taken
    *before* the disk is read: a peer that does not read its answers gets at most this much work done for it
    (its other requests wait here, in flight, until it is dropped), and answers never queue in memory."""

    def __init__(self, cap: int):
        self.cap = cap
        self.used = 0
        self._freed = trio.Event()

    async def take(self, n: int) -> int:
        n = min(n, self.cap)                 # one answer larger than the budget runs alone
        while self.used and self.used + n > self.cap:
            await self._freed.wait()
        self.used += n
        return n

    def give(self, n: int) -> None:
        self.used -= n
        self._freed.set()
        self._freed = trio.Event()


class Buffers:
    def __init__(self, cfg: MemoryConfig, pool: BuddyPool, region: Region):
        self.cfg = cfg
        self.pool = pool
        self.region = region       # the whole pool, registered once: peers may read it, never write
        self.holders = 0           # connections holding pool blocks now (for the fair share)
        # pool bytes in blocks awaiting a client's payload READ (a peer may never serve it): per connection,
        # and in all (``fetch_share``)
        self.awaiting: dict[Connection, int] = {}
        self.awaiting_bytes = 0
        self._freed: trio.Event | None = None   # set when awaited bytes go back (for those waiting for some)

    def stats(self, reveal: bool = True) -> dict:
        """The pool's figures; its rkey and base address only when ``reveal`` (to admins, or with
        authentication off): a peer has no use for them (it reaches our memory only through grants)."""
        out = {**self.pool.stats(), "registered_once": True,
               "remote_write": bool(self.region.access & Access.REMOTE_WRITE), "grants_required": True}
        if reveal:
            out.update(rkey=self.region.rkey, base_addr=self.pool.base_addr)
        return out

    # -- pool blocks --------------------------------------------------------------------------------------
    def share(self, conn: Connection | None) -> int:
        """The most pool bytes ``conn``'s requests may hold: ``conn_pool_share`` of the arena, and when the
        pool is more than half in use, no more than an equal share among the connections holding blocks."""
        total = self.pool.arena_bytes
        cap = int(total * self.cfg.conn_pool_share)
        if self.pool.in_use * 2 > total:
            holders = self.holders + (0 if conn is not None and conn.pool_held else 1)
            cap = min(cap, max(self.pool.max_block, total // max(1, holders)))
        return cap

    async def alloc(self, length: int, conn: Connection | None = None) -> Block:
        """A pool block for a request of ``conn`` (counted against its share; free with ``free``)."""
        if length > self.pool.max_block:
            raise Reply(Result.TOO_LARGE, arg=self.pool.max_block,
                        why=f"{length} bytes is more than the max block {self.pool.max_block}")
        if conn is not None and conn.pool_held and conn.pool_held + length > self.share(conn):
            raise Reply(Result.BUSY, why=f"{conn.peer} holds {conn.pool_held} pool bytes, its share "
                                         f"is {self.share(conn)}")
        if conn is not None:          # counted before the wait: requests of conn started meanwhile see it
            if not conn.pool_held:
                self.holders += 1
            conn.pool_held += length
        try:
            block = await self.pool.alloc(length, timeout=self.cfg.pool_wait)
        except BaseException as e:
            if conn is not None:
                conn.pool_held -= length
                if not conn.pool_held:
                    self.holders -= 1
            if isinstance(e, PoolExhausted):
                raise Reply(Result.POOL_BUSY, why=str(e)) from None
            raise
        if conn is not None:
            conn.pool_held += block.size - length
        return block

    def free(self, block: Block, conn: Connection | None = None) -> None:
        size = block.size
        self.pool.free(block)
        if conn is not None:
            conn.pool_held -= size
            if not conn.pool_held:
                self.holders -= 1

    # -- blocks awaiting a client's payload -------------------------------------------------------------------
    def fetch_share(self, conn: Connection) -> int:
        """The most pool bytes ``conn``'s requests may hold awaiting their payload READs: ``conn_fetch_mib``,
        within ``fetch_pool_share`` of the pool for every connection together; when more than half of that
        is taken, no more than an equal share of it among the connections awaiting one."""
        budget = int(self.pool.arena_bytes * self.cfg.fetch_pool_share)
        cap = min(self.cfg.conn_fetch_mib << 20, budget)
        if self.awaiting_bytes * 2 > budget:
            fetchers = len(self.awaiting) + (0 if conn in self.awaiting else 1)
            cap = min(cap, max(self.pool.max_block, budget // fetchers))
        return cap

    async def await_payload(self, conn: Connection, length: int) -> None:
        """``length`` bytes of pool for ``conn``'s payload READ, counted until ``payload_done``.  A connection
        that already has payloads awaited is answered BUSY at once (it backs off) beyond its share; one that
        has none waits -- up to ``pool_wait``, then POOL_BUSY -- while every connection together holds the
        whole budget: the bytes freed when a peer that does not serve its READs is dropped go to it, before
        that peer is back."""
        mine = self.awaiting.get(conn, 0)
        budget = int(self.pool.arena_bytes * self.cfg.fetch_pool_share)
        if mine and (mine + length > self.fetch_share(conn) or self.awaiting_bytes + length > budget):
            raise Reply(Result.BUSY, why=f"{conn.peer} has {mine} pool bytes awaiting its payloads, its share "
                                         f"is {self.fetch_share(conn)} ({self.awaiting_bytes} in all)")
        if not mine and self.awaiting_bytes + length > budget:
            with trio.move_on_after(self.cfg.pool_wait):
                while self.awaiting_bytes + length > budget:
                    if self._freed is None:
                        self._freed = trio.Event()
                    await self._freed.wait()
            if self.awaiting_bytes + length > budget:
                raise Reply(Result.POOL_BUSY, why=f"{self.awaiting_bytes} pool bytes await payloads "
                                                  f"(fetch_pool_share) for more than pool_wait")
        self.awaiting[conn] = self.awaiting.get(conn, 0) + length
        self.awaiting_bytes += length

    def payload_done(self, conn: Connection, length: int) -> None:
        left = self.awaiting[conn] - length
        if left:
            self.awaiting[conn] = left
        else:
            del self.awaiting[conn]
        self.awaiting_bytes -= length
        if self._freed is not None:
            self._freed.set()
            self._freed = None

    # -- the peer's buffers ---------------------------------------------------------------------------------
    async def fetch(self, conn: Connection, remote: RemoteBuf, view: memoryview, client: bool = True) -> None:
        """One-sided READ of the peer's ``remote`` into ``view`` (a block of our pool), bounded in time: a
        client's payload by ``payload_timeout`` (PAYLOAD_TIMEOUT, then its connection is dropped), a node's
        (a leader's forward) by ``peer_timeout``."""
        if not client:
            return await self._one_sided(conn.read(remote, view, self.region), "read")
        try:
            with trio.fail_after(self.cfg.payload_timeout):
                await conn.read(remote, view, self.region)
        except RemoteAccessError as e:
            raise Reply(Result.REMOTE_ACCESS, why=str(e)) from None
        except trio.TooSlowError:
            raise PeerTimeout(f"payload not served within payload_timeout {self.cfg.payload_timeout}s",
                              Result.PAYLOAD_TIMEOUT) from None

    async def write_remote(self, conn: Connection, view: memoryview, remote: RemoteBuf, *,
                           posted: bool = False, release=None) -> None:
        """One-sided WRITE of ``view`` into the peer's ``remote``, bounded in time (``posted``, ``release``:
        see ``Connection.write``)."""
        await self._one_sided(conn.write(view, self.region, remote, posted=posted, release=release), "write")

    async def _one_sided(self, op, what: str) -> None:
        try:
            with trio.fail_after(self.cfg.peer_timeout):
                await op
        except RemoteAccessError as e:
            raise Reply(Result.REMOTE_ACCESS, why=str(e)) from None
        except trio.TooSlowError:
            # the transport already made the late answer harmless (TCP drains it or ends the connection;
            # verbs kills the QP and waits for the flush), so our block may be freed
            raise PeerTimeout(f"one-sided {what} not served within {self.cfg.peer_timeout}s") from None

    @staticmethod
    async def answer_budget(conn: Connection, n: int) -> int:
        """Take ``n`` bytes of the connection's answer budget (give them back with ``conn.answers.give``)."""
        budget = getattr(conn, "answers", None)
        if budget is None:
            budget = conn.answers = ByteBudget(ANSWER_BYTES)
        taken = await budget.take(n)
        if not conn.alive:                   # dropped while we waited: do not read the disk for nobody
            budget.give(taken)
            raise ConnectionClosed(f"{conn.peer}: connection closed")
        return taken

    # -- JSON bodies and answers ----------------------------------------------------------------------------
    async def push_json(self, conn: Connection, h: Header, obj) -> Header:
        """Answer ``h`` with ``obj`` as JSON, written into the buffer the request named."""
        return await self.push_bytes(conn, h, json.dumps(obj).encode())

    async def push_bytes(self, conn: Connection, h: Header, data: bytes) -> Header:
        """Answer ``h`` with ``data`` (an encoded answer), written into the buffer the request named."""
        if len(data) > h.rlen:
            raise Reply(Result.SHORT_BUFFER, arg=len(data),
                        why=f"answer needs {len(data)} bytes, the buffer holds {h.rlen}")
        taken = await self.answer_budget(conn, len(data))
        try:
            block = await self.alloc(len(data), conn)
            try:
                view = block.view(len(data))
                view[:] = data
                if data:
                    await self.write_remote(conn, view, h.remote.slice(0, len(data)))
            finally:
                self.free(block, conn)
        finally:
            conn.answers.give(taken)
        return h.reply(Result.OK, length=len(data))

    async def pull_json(self, conn: Connection, h: Header):
        """The request's JSON body, read from the buffer it named."""
        if not h.length:
            raise bad_body(BodyError("missing", "the request names no body"))
        if h.length > MAX_JSON:
            raise bad_body(BodyError("too_large", f"{h.length} bytes, at most {MAX_JSON}"))
        block = await self.alloc(h.length, conn)
        try:
            view = block.view(h.length)
            await self.fetch(conn, h.remote.slice(0, h.length), view)   # rlen >= length: checked by decode
            try:
                return json.loads(bytes(view))
            except ValueError as e:            # UnicodeDecodeError too
                raise bad_body(BodyError("not_json", str(e))) from None
        finally:
            self.free(block, conn)

    async def pull_body(self, conn: Connection, h: Header, decode):
        """The request's JSON body through ``decode`` (a protocol ``decode_*``: BAD_BODY if it refuses it)."""
        try:
            return decode(await self.pull_json(conn, h))
        except BodyError as e:
            raise bad_body(e) from None
