"""The lean append: the common case of the one write path (ops/append.py), done by a data-plane thread.

The common case is a plain inline append on TCP at the partition's epoch to an extent that takes appends:
a client's (``Flag.INLINE`` and no other flag) to a partition whose only replica is this node, or a leader's
forward (``INLINE | FORWARDED``) to a follower here, unless it is the only request in flight (then the
follower's in-loop driver, ``Appends.now``, does it cheaper).  For it
the event loop does only what it must: the transport cuts the request from the stream and checks its session
MAC (wire/session.py), the wrapper decodes it and admits it (ops/admit.py ``Admit``: the node's state,
the connection's role and volume, a forward's sender being the leader), counts it in flight, and hands it to the connection's data-plane thread
(``Plane``) -- no task, no turn to await, no group-commit waiter.  The thread, outside trio (the GIL released
in its system calls), does the steps of ``Appends.write``: the payload's CRC32C and its block CRCs
(``_checked``), the checks of its turn (``_in_turn``: the extent takes appends, the offset is its end, the
partition still at the request's epoch with this node leading), the ``pwrite`` (``ExtentStore.append``), and
the flush -- once for every append the thread took from its queue meanwhile, and shared with the other
threads' and the group commit's flushes of the same extent, which take the extent's flush lock: whoever
gets it second finds its bytes durable already (``ExtentStore.flush``).  The answers go back to the event
loop in one hand-over per batch (``TrioToken.run_sync_soon``), which sends them and counts them
(``Lean.finish``).  The durability contract is the write path's: an answer OK only once the bytes and their
CRCs are durable.

Everything else goes the usual way (the WRITE handler's task): a payload still to fetch, a repair write, a
client's append to a replicated partition (its forwards and acks are the replicator's, datanode/replication.py),
another epoch, a sealed extent, a node not serving, any other request.  A failure after the write began
seals the extent, as on the task's path.

The extent's order is the lane's (lane.py): an append goes lean only while the extent's lane has nothing in
flight, or holds this connection's lean *lease*: the first lean append takes a lane ticket and holds its turn
(``begin``) until the connection's last lean append of the extent is answered.  A request of any other path
or connection arriving meanwhile takes its ticket behind the lease, waits its turn, and from then on the
lease takes nothing more: arrival order stays turn order.  Lanes and leases are touched in the event loop
only; the thread reads the store and a lane's ``diverged``.
"""
from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

import trio

from wire.protocol import Flag, Header, Op, Result
from wire.transport.base import Connection
from ..partition import ExtentLane, Partition, PartitionTable
from ..replication import Replicator
from ..store import StoreError, io_error, piece_crcs
from .base import Reply, Request, RequestCounters, store_reply
from .pipeline import forwarded
from .stages import DURABLE, FETCHED, STARTED, TURN, WRITTEN

log = logging.getLogger(__name__)

BATCH = 64               # appends a plane takes from its queue for one flush at most
MAX_PLANES = 256         # connections with a data-plane thread at once; the others' appends go the usual way
_FORWARD = Flag.INLINE | Flag.FORWARDED


class _Lease:
    """A connection's hold on an extent's turn: its lane ticket, and its lean appends not answered yet."""
    __slots__ = ("plane", "ticket", "pending")

    def __init__(self, plane: "Plane", ticket: int) -> None:
        self.plane, self.ticket, self.pending = plane, ticket, 0


class Lean:
    """The node's lean appends: which request goes lean (``take``, in the event loop, at arrival), the
    connections' planes, and the answers (``finish``, in the event loop)."""

    def __init__(self, me: str, table: PartitionTable, replication: Replicator, counters: RequestCounters,
                 sync_always: bool, here: Callable[[], bool]) -> None:
        self.me = me
        self.here = here                   # a lone request may flush right in the event loop (GroupCommit.here)
        self.table = table
        self.replication = replication
        self.counters = counters
        self.sync_always = sync_always
        self.leases: dict[ExtentLane, _Lease] = {}
        self.planes: dict[Connection, Plane] = {}
        # set by the wrapper: admit(conn, h) raises its refusal; answer(nursery, conn, [(rq, resp)]) sends them
        self.admit: Callable[[Connection, Header], None] | None = None
        self.answer: Callable | None = None

    def take(self, conn: Connection, h: Header, payload, t0: float, nursery: trio.Nursery) -> Request | None:
        """In the event loop, as the request arrives: the request handed to its connection's plane (the
        caller counts it in flight), or None: it goes the usual way, untouched."""
        as_follower = h.flags == _FORWARD
        if (h.flags != Flag.INLINE and not as_follower) or h.opcode != Op.WRITE or conn.transport != "tcp":
            return None
        part = self.table.get(h.partition)
        if part is None or part.dropped or h.epoch != part.epoch:
            return None
        if as_follower:
            # a follower's: a lone one is cheaper done right where it arrived (``Appends.now``)
            if self.me not in part.replicas[1:] or self.here():
                return None
        elif len(part.replicas) != 1 or part.replicas[0] != self.me:
            return None
        lane = part.lane(h.extent)
        if lane is None or lane.diverged:
            return None
        lease = self.leases.get(lane)
        if lease is not None:
            # the lease takes more only while it is the lane's newest ticket: one taken behind it waits for it
            if lease.plane.conn is not conn or not lane.newest(lease.ticket):
                return None
        elif lane.issued != lane.serving or lane.writing or lane.held is not None:
            return None                    # the lane has something in flight: behind it, the usual way
        plane = self.planes.get(conn)
        if plane is None and len(self.planes) >= MAX_PLANES:
            return None                    # (a thread per connection: bounded, whatever the connections)
        self.admit(conn, h)                # (its refusal is answered by the caller)
        if plane is None:
            plane = self.planes[conn] = Plane(self, conn, trio.lowlevel.current_trio_token(), nursery)
        if lease is None:
            t = lane.ticket(conn)
            lane.begin(t)
            lease = self.leases[lane] = _Lease(plane, t)
        lease.pending += 1
        rq = Request(conn, h, None, payload, None, t0)
        plane.put((rq, part, lane))
        return rq

    def finish(self, plane: "Plane", done: list) -> None:
        """In the event loop: the plane's answered batch -- seals, leases given back, answers sent, counts."""
        c = self.counters
        answers = []
        for rq, part, lane, resp, seal in done:
            if seal:
                self.replication.seal(part, rq.h.extent, lane, seal)
            lease = self.leases.get(lane)
            if lease is not None and lease.plane is plane:
                lease.pending -= 1
                if not lease.pending:
                    del self.leases[lane]
                    lane.done(lease.ticket)
            if resp.result == Result.OK:
                if forwarded(rq.h):
                    c.replica_writes += 1
                else:
                    c.writes += 1
                c.lean_writes += 1
                c.write_bytes += rq.h.length
            elif part.dropped and resp.result != Result.NOT_FOUND:
                resp = rq.h.reply(Result.NOT_FOUND)   # dropped from this node meanwhile (``Wrap._gone``)
            answers.append((rq, resp))
        self.answer(plane.nursery, plane.conn, answers)

    def closed(self, conn: Connection) -> None:
        """The connection's requests are all in; its plane ends once it answered what it holds."""
        plane = self.planes.pop(conn, None)
        if plane is not None:
            plane.put(None)

    def stop(self) -> None:
        for conn in list(self.planes):
            self.closed(conn)

    # -- in the plane's thread --------------------------------------------------------------------------------
    def step(self, rq: Request, part: Partition, lane: ExtentLane) -> tuple[Header | None, str]:
        """An append's steps up to its ``pwrite``: (its answer now, or None: written, to be made durable;
        why to seal the extent, or "")."""
        h, st = rq.h, rq.stages
        st.mark(STARTED)
        pieces, whole = piece_crcs(h.offset, rq.payload)
        if whole != h.crc:
            return h.reply(Result.CRC_MISMATCH), ""
        st.mark(FETCHED)
        if lane.diverged:
            return h.reply(Result.DIVERGED), ""
        if part.dropped:
            return h.reply(Result.NOT_FOUND), ""
        if part.epoch != h.epoch:
            return h.reply(Result.STALE_EPOCH, arg=part.epoch), ""
        if part.leader != self.me and not forwarded(h):
            return h.reply(Result.NOT_LEADER), ""
        try:
            end = part.store.size(h.extent)
        except StoreError as e:
            return _answer(h, store_reply(e)), ""
        if h.offset != end:
            return h.reply(Result.WRONG_OFFSET, arg=end), ""
        st.mark(TURN)
        try:
            part.store.append(h.extent, h.offset, rq.payload, None, pieces)
        except StoreError as e:
            return _answer(h, store_reply(e)), f"local write failed: {e}"
        except OSError as e:
            e = io_error("append", e)
            return _answer(h, store_reply(e)), f"local write failed: {e}"
        st.mark(WRITTEN)
        return None, ""


def _answer(h: Header, r: Reply) -> Header:
    return h.reply(r.result, arg=r.arg)


class Plane:
    """A connection's data-plane thread: takes its lean appends in arrival order, writes a batch of them,
    flushes each extent once for the batch, and hands the answers back to the event loop."""

    def __init__(self, lean: Lean, conn: Connection, token, nursery: trio.Nursery) -> None:
        self.lean, self.conn, self.token, self.nursery = lean, conn, token, nursery
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"lean {conn.peer}", daemon=True)
        self._thread.start()

    def _finish(self, done: list) -> None:
        """In the event loop (a callback of ``run_sync_soon``, where an exception would end the whole node):
        a bug costs the batch's answers, logged."""
        try:
            self.lean.finish(self, done)
        except Exception:
            log.exception("answering lean appends from %s failed", self.conn.peer)

    def put(self, item) -> None:
        self._q.put(item)

    def _run(self) -> None:
        q = self._q
        while True:
            item = q.get()
            batch = []
            while item is not None:
                batch.append(item)
                if len(batch) >= BATCH:
                    break
                try:
                    item = q.get_nowait()
                except queue.Empty:
                    break
            if batch:
                self._write(batch)
            if item is None:
                return

    def _write(self, batch: list) -> None:
        lean = self.lean
        done = []
        ends: dict[tuple[int, int], tuple[Partition, int]] = {}   # (partition, extent) -> its end
        for rq, part, lane in batch:
            try:
                resp, seal = lean.step(rq, part, lane)
            except Exception as e:      # a bug costs this request (ERROR), as on the task's path
                log.exception("%s from %s failed", rq.h.describe(), rq.conn.peer)
                resp, seal = rq.h.reply(Result.ERROR), f"local write failed: {e}"
            done.append([rq, part, lane, resp, seal])
            if resp is None:
                ends[(part.pid, rq.h.extent)] = (part, rq.h.offset + rq.h.length)
        failed: dict[tuple[int, int], StoreError] = {}
        if lean.sync_always:
            for key, (part, end) in ends.items():
                try:
                    if part.store.durable_size(key[1]) < end:
                        err = part.store.flush([key[1]]).get(key[1])
                        if err is not None:
                            failed[key] = err
                except StoreError as e:
                    failed[key] = e
        for d in done:
            rq = d[0]
            if d[3] is None:
                err = failed.get((d[1].pid, rq.h.extent))
                if err is None:
                    rq.stages.mark(DURABLE)
                    d[3] = rq.h.reply(Result.OK, arg=rq.h.offset + rq.h.length, crc=rq.h.crc)
                else:
                    d[3], d[4] = _answer(rq.h, store_reply(err)), f"local flush failed: {err}"
        try:
            self.token.run_sync_soon(self._finish, done)
        except trio.RunFinishedError:       # the node is gone
            pass
