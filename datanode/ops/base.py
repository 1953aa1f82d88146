"""What every request handler uses.  A handler raises ``Reply`` to answer with a result code; anything it
cannot answer (the peer is gone) is a ``TransportError``; ``PeerTimeout`` drops the peer."""
from __future__ import annotations

import dataclasses
import json

import trio

from ..aio import Workers
from ..partition import EarlierWriteFailed, Partition
from ..protocol import BODY_REASONS, BodyError, Header, RemoteBuf, Result, decode_view
from ..pool import PoolExhausted
from ..store import StoreCode, StoreError, WouldBlock, io_error
from ..transport.base import Connection, ConnectionClosed, RemoteAccessError, TransportError

MAX_JSON = 1 << 20
ANSWER_BYTES = 8 << 20      # one connection's one-sided answers (read payloads, JSON) being prepared or sent
LOOP_IO = 128 << 10       # appends up to this size run in the event loop (page cache; no thread hop)
DISK = Workers(name="disk")   # the threads store calls run in (the process's; aio.Workers: a lean hand-over)
STORE_RESULTS = {StoreCode.NOT_FOUND: Result.NOT_FOUND, StoreCode.DELETED: Result.NOT_FOUND,
                 StoreCode.EXISTS: Result.EXISTS, StoreCode.WRONG_OFFSET: Result.WRONG_OFFSET,
                 StoreCode.OUT_OF_RANGE: Result.OUT_OF_RANGE, StoreCode.TOO_LARGE: Result.TOO_LARGE,
                 StoreCode.CRC: Result.CRC_MISMATCH, StoreCode.NO_SPACE: Result.NO_SPACE,
                 StoreCode.DISK: Result.DISK_ERROR}
assert set(STORE_RESULTS) == set(StoreCode)


class Reply(Exception):
    """Raised inside a handler to answer with a result code (and arg)."""

    def __init__(self, result: Result, arg: int = 0, why: str = ""):
        self.result, self.arg, self.why = result, arg, why
        super().__init__(why or result.name)


class PeerTimeout(TransportError):
    """The peer did not serve a one-sided op on its buffer within ``peer_timeout``."""


def bad_body(e: BodyError) -> Reply:
    return Reply(Result.BAD_BODY, arg=BODY_REASONS.index(e.reason), why=str(e))


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


def store_reply(e: StoreError) -> Reply:
    return Reply(STORE_RESULTS[e.code], arg=e.arg, why=str(e))


@dataclasses.dataclass
class RequestCounters:
    requests: int = 0
    protocol_errors: int = 0
    forbidden: int = 0             # requests refused for the connection's role or node identity
    fenced: int = 0                # leader requests refused while self-fenced (etcd lease expired)
    busy_inflight: int = 0         # requests answered BUSY because their connection had max_inflight in flight
    penalties: int = 0             # peers dropped for breaking the rules (their host's next connections wait)
    writes: int = 0                # client appends acknowledged (as leader)
    replica_writes: int = 0        # forwarded appends applied (as follower)
    joined_writes: int = 0         # of both, those that went in the same append as the one before (AppendRun)
    appends_now: int = 0           # of replica_writes, those done right where they arrived (DataOps.append_now)
    write_bytes: int = 0
    reads: int = 0
    read_bytes: int = 0
    answers_refused: int = 0       # READ answers (posted one-sided writes) the peer refused, of ended connections
    # follower: bytes READ from leaders' pools, by the leader's connection (its node identity, or its address
    # when authentication is off; not by rkey: on verbs every forward carries a fresh window rkey); a bounded
    # table, whatever peers send
    forward_fetch_bytes_by_leader: dict = dataclasses.field(default_factory=dict)

    def count_forward_fetch(self, leader: str, n: int, *, keys: int = 16) -> None:
        t = self.forward_fetch_bytes_by_leader
        k = leader if leader in t or len(t) < keys else "other"
        t[k] = t.get(k, 0) + n


class Handlers:
    """The services handlers share.  Attributes come from the Node (datanode/server.py)."""
    cfg: object
    me: str
    table: object
    pool: object
    region: object
    counters: RequestCounters
    commit: object            # datanode.commit.GroupCommit

    # -- the request's partition --------------------------------------------------------------------
    def _hosted(self, h: Header) -> Partition:
        """The request's partition, or NOT_FOUND."""
        part = self.table.get(h.partition)
        if part is None:
            raise Reply(Result.NOT_FOUND, why=f"partition {h.partition} is not on this node")
        return part

    def _partition(self, h: Header) -> Partition:
        """The request's partition, at the request's epoch (else NOT_FOUND / STALE_EPOCH)."""
        part = self._hosted(h)
        if h.epoch != part.epoch:
            raise Reply(Result.STALE_EPOCH, arg=part.epoch,
                        why=f"epoch {h.epoch} but partition {part.pid} is at {part.epoch}")
        return part

    def _leader_of(self, part: Partition) -> None:
        if part.leader != self.me:
            raise Reply(Result.NOT_LEADER, why=f"leader of partition {part.pid} is {part.leader}")

    agent = None              # the node's etcd agent (datanode/etcdagent.py), when etcd is configured

    async def _lead(self, h: Header) -> Partition:
        """The request's partition, led here, at its epoch -- and this leader is not self-fenced: a leader of
        a replicated partition whose etcd lease expired acknowledges nothing until it has re-registered and
        re-read the map (NOT_LEADER; the rule and why: datanode/etcdmap.py, "Self-fencing")."""
        part = self._partition(h)
        self._leader_of(part)
        if self.agent is not None and len(part.replicas) > 1:
            why = await self.agent.fence()
            if why:
                self.counters.fenced += 1
                raise Reply(Result.NOT_LEADER, why=f"self-fenced: {why}")
            part = self._partition(h)            # the map may have changed while we waited for etcd
            self._leader_of(part)
        return part
    def _still_leading(self, part: Partition, h: Header) -> None:
        """After an await: the view may have changed meanwhile (a step-down).  A request may only go on (be
        forwarded) at the view of the epoch it carries, with this node still its leader."""
        if part.epoch != h.epoch:
            raise Reply(Result.STALE_EPOCH, arg=part.epoch,
                        why=f"partition {part.pid} moved to epoch {part.epoch} while handling epoch {h.epoch}")
        self._leader_of(part)

    @staticmethod
    def _size(part: Partition, extent: int) -> int:
        try:
            return part.store.size(extent)
        except StoreError as e:
            raise store_reply(e) from None

    # -- memory and the peer's buffers --------------------------------------------------------------
    pool_holders = 0          # connections holding pool blocks now (for the fair share)

    def _share(self, conn: Connection | None) -> int:
        """The most pool bytes ``conn``'s requests may hold: ``conn_pool_share`` of the arena, and when the
        pool is more than half in use, no more than an equal share among the connections holding blocks."""
        total = self.pool.arena_bytes
        cap = int(total * self.cfg.conn_pool_share)
        if self.pool.in_use * 2 > total:
            holders = self.pool_holders + (0 if conn is not None and conn.pool_held else 1)
            cap = min(cap, max(self.pool.max_block, total // max(1, holders)))
        return cap

    async def _alloc(self, length: int, conn: Connection | None = None):
        """A pool block for a request of ``conn`` (counted against its share; free with ``_free``)."""
        if length > self.pool.max_block:
            raise Reply(Result.TOO_LARGE, arg=self.pool.max_block,
                        why=f"{length} bytes is more than the max block {self.pool.max_block}")
        if conn is not None and conn.pool_held and conn.pool_held + length > self._share(conn):
            raise Reply(Result.BUSY, why=f"{conn.peer} holds {conn.pool_held} pool bytes, its share "
                                         f"is {self._share(conn)}")
        if conn is not None:          # counted before the wait: requests of conn started meanwhile see it
            if not conn.pool_held:
                self.pool_holders += 1
            conn.pool_held += length
        try:
            block = await self.pool.alloc(length, timeout=self.cfg.pool_wait)
        except BaseException as e:
            if conn is not None:
                conn.pool_held -= length
                if not conn.pool_held:
                    self.pool_holders -= 1
            if isinstance(e, PoolExhausted):
                raise Reply(Result.POOL_BUSY, why=str(e)) from None
            raise
        if conn is not None:
            conn.pool_held += block.size - length
        return block

    def _free(self, block, conn: Connection | None = None) -> None:
        size = block.size
        self.pool.free(block)
        if conn is not None:
            conn.pool_held -= size
            if not conn.pool_held:
                self.pool_holders -= 1

    async def _fetch(self, conn: Connection, remote: RemoteBuf, view: memoryview) -> None:
        """One-sided READ of the peer's ``remote`` into ``view`` (a block of our pool), bounded in time."""
        await self._one_sided(conn.read(remote, view, self.region), "read")

    async def _answer_budget(self, conn: Connection, n: int) -> int:
        """Take ``n`` bytes of the connection's answer budget (give them back with ``conn.answers.give``)."""
        budget = getattr(conn, "answers", None)
        if budget is None:
            budget = conn.answers = ByteBudget(ANSWER_BYTES)
        taken = await budget.take(n)
        if not conn.alive:                   # dropped while we waited: do not read the disk for nobody
            budget.give(taken)
            raise ConnectionClosed(f"{conn.peer}: connection closed")
        return taken

    async def _write_remote(self, conn: Connection, view: memoryview, remote: RemoteBuf, *,
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

    # -- the disk -------------------------------------------------------------------------------------
    async def _store(self, fn, *args):
        """A blocking store call in a worker thread (``DISK``); its failure as the one matching result code."""
        try:
            return await DISK.run_sync(fn, *args)
        except StoreError as e:
            raise store_reply(e) from None
        except OSError as e:
            raise store_reply(io_error(getattr(fn, "__name__", "disk"), e)) from None

    def _hand_append(self, lane, store, extent: int, offset: int, view, pieces):
        """In the extent's turn: ``store.append`` (no sync).  A small one right here when no earlier write of
        the extent is still out (a pwrite into the page cache costs less than the hop to a worker thread):
        returns the new size.  Otherwise it is handed to a worker thread, in order behind the extent's earlier
        writes (``ExtentLane.hand_over``): returns the ``aio.Handed``, for ``_appended`` after the turn."""
        if len(view) <= LOOP_IO and not lane.writing:
            try:
                return store.append(extent, offset, view, None, pieces, blocking=False)
            except WouldBlock:
                pass
            except StoreError as e:
                raise store_reply(e) from None
            except OSError as e:
                raise store_reply(io_error("append", e)) from None
        return lane.hand_over(DISK, offset + len(view), store.append, extent, offset, view, None, pieces)

    @staticmethod
    async def _appended(lane, handed) -> int:
        """The extent's new size once a handed-over append is written; its failure as the matching result
        code (DIVERGED when an earlier write of the extent failed and this one was not done)."""
        try:
            return await handed.result()
        except EarlierWriteFailed as e:
            raise Reply(Result.DIVERGED, why=str(e)) from None
        except StoreError as e:
            raise store_reply(e) from None
        except OSError as e:
            raise store_reply(io_error("append", e)) from None
        finally:
            lane.handed_back()

    async def _read(self, store, extent: int, offset: int, length: int, view) -> int:
        """``store.read_into``: right here when the bytes are in the page cache and the extent is not being
        truncated (RWF_NOWAIT: no thread hop, never blocks the loop), else in a worker thread -- so a read
        waits neither for a thread when it need not, nor behind the disk when another read must."""
        if length <= LOOP_IO:
            try:
                return store.read_into(extent, offset, length, view, nowait=True)
            except WouldBlock:
                pass
            except StoreError as e:
                raise store_reply(e) from None
            except OSError as e:
                raise store_reply(io_error("read", e)) from None
        return await self._store(store.read_into, extent, offset, length, view)

    async def _durable(self, store, extent: int, end: int) -> None:
        """Wait until ``[0, end)`` of the extent is durable (group commit; at once under sync=none)."""
        try:
            await self.commit.durable(store, extent, end)
        except StoreError as e:
            raise store_reply(e) from None

    # -- JSON bodies and answers -----------------------------------------------------------------------
    async def _push_json(self, conn: Connection, h: Header, obj) -> Header:
        data = json.dumps(obj).encode()
        if len(data) > h.rlen:
            raise Reply(Result.SHORT_BUFFER, arg=len(data),
                        why=f"answer needs {len(data)} bytes, the buffer holds {h.rlen}")
        taken = await self._answer_budget(conn, len(data))
        try:
            block = await self._alloc(len(data), conn)
            try:
                view = block.view(len(data))
                view[:] = data
                if data:
                    await self._write_remote(conn, view, h.remote.slice(0, len(data)))
            finally:
                self._free(block, conn)
        finally:
            conn.answers.give(taken)
        return h.reply(Result.OK, length=len(data))

    async def _pull_json(self, conn: Connection, h: Header):
        if not h.length:
            raise bad_body(BodyError("missing", "the request names no body"))
        if h.length > MAX_JSON:
            raise bad_body(BodyError("too_large", f"{h.length} bytes, at most {MAX_JSON}"))
        block = await self._alloc(h.length, conn)
        try:
            view = block.view(h.length)
            await self._fetch(conn, h.remote.slice(0, h.length), view)   # rlen >= length: checked by decode
            try:
                return json.loads(bytes(view))
            except ValueError as e:            # UnicodeDecodeError too
                raise bad_body(BodyError("not_json", str(e))) from None
        finally:
            self._free(block, conn)

    async def _pull_view(self, conn: Connection, h: Header) -> tuple[list[str], int]:
        """The (replicas, epoch) body of PARTITION_CREATE / PARTITION_UPDATE, validated."""
        try:
            return decode_view(await self._pull_json(conn, h))
        except BodyError as e:
            raise bad_body(e) from None
