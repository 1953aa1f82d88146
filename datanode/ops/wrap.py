"""Every request's way through the node, around the handler table: all that its handler does not say.

In the spirit of CubeFS's ``OperatePacket`` (datanode/wrap_operator.go) and its prepare / operate / post,
the handlers (ops/append.py, ops/data.py, ops/admin.py, ops/repair.py) say what a request does, and every
request goes through the same three parts, each in one place:

* prepare -- arrival (``Wrap._dispatch``, synchronously, as the transport cuts it from the stream): decoding
  (a malformed header is answered PROTOCOL), the extent lane's ticket taken in arrival order (WRITE,
  TRUNCATE), a small inline append joined to the connection's run (ops/run.py ``AppendRun``), the
  connection's in-flight limit (BUSY beyond it); and admission (ops/admit.py ``Admit``);
* operate -- the handler, in a task of its own (``_handle``) -- or, for a follower's lone inline append, right
  where it arrived (``_now``: ``Appends.now``, the same steps as the WRITE handler's);
* post (ops/answer.py ``Post``) -- its failure as a result code and a log line, the step recorder's stage
  times and trace, the audit line of an admin action, the answer sent, and the request counted in the
  metrics and no longer in flight.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from typing import Callable

import trio

from wire import trace
from wire.protocol import PROTOCOL_REASONS, Header, Op, ProtocolError, Result, decode_message, peek_req_id
from wire.transport.base import Connection, TransportError
from ..audit import AuditLog
from ..config import Config
from ..metrics import NodeMetrics
from ..partition import PartitionTable
from . import stages
from .admit import ON_DATA, VOLUME_FREE, Admit, Serving, volume_refusal
from .answer import Post, failure
from .base import Handler, PeerTimeout, Reply, Request, RequestCounters
from .pipeline import forwarded
from .run import AppendRun

__all__ = ["VOLUME_FREE", "Serving", "Wrap", "volume_refusal"]

# the request path's lines keep the logger name operators know them by
log = logging.getLogger("datanode.server")


class _Activity:
    __slots__ = ("last_active",)


@dataclasses.dataclass(slots=True, eq=False)
class ConnState:
    """What the wrapper keeps of one connection (plain state): its admission entry, whose ``last_active`` is
    when its last request arrived (the idle timeout, and which idle connection goes first under pressure,
    count from it), and its newest run of appends, which the next inline append may join."""
    activity: object = None
    run: AppendRun | None = None


class Wrap:
    def __init__(self, *, cfg: Config, serving: Serving, table: PartitionTable, counters: RequestCounters,
                 metrics: NodeMetrics, audit: AuditLog, handlers: dict[Op, Handler],
                 now: Callable[[Request], Header | None], lean=None):
        assert set(handlers) == set(Op), "every opcode has exactly one handler"
        self.cfg = cfg
        self.table = table
        self.counters = counters
        self.metrics = metrics
        self.handlers = {op.value: fn for op, fn in handlers.items()}
        self.now = now                   # a follower's lone inline append, right here (Appends.now)
        self.admit = Admit(serving, table, counters)
        self.post = Post(peer_timeout=cfg.peer_timeout, metrics=metrics, audit=audit)
        self.lean = lean                 # the common case of a plain inline append, by its connection's thread
        if lean is not None:
            lean.admit, lean.answer = self.admit, self._lean_answers

    @property
    def inflight(self) -> int:
        """Requests arrived and not yet answered (a drain waits for none)."""
        return self.post.inflight

    @inflight.setter
    def inflight(self, n: int) -> None:
        self.post.inflight = n

    async def drained(self) -> None:
        """Until no request is in flight."""
        await self.post.drained()

    # -- prepare: arrival -------------------------------------------------------------------------------------
    async def serve(self, conn: Connection, activity=None) -> None:
        """Starts one task per request of the connection, at most ``max_inflight`` at once: a request beyond
        that is answered BUSY by this connection's own task (so a peer that floods requests and never reads
        the answers stalls its own connection on TCP backpressure, and is dropped after ``peer_timeout``:
        neither tasks nor queued answers grow without bound).  A request within the limit is started right
        where the transport delivers it (``deliver_to``: no task switch); the others, and whatever arrives
        behind them, queue for this task.  ``activity.last_active`` (the connection's admission entry,
        ops/admission.py) is when the last request arrived: the idle timeout, and which idle connection goes
        first under pressure, count from it."""
        idle = self.cfg.idle_timeout_s or math.inf
        limit = self.cfg.max_inflight or self.cfg.slots
        cs = ConnState(activity if activity is not None else _Activity())
        last = cs.activity
        last.last_active = trio.current_time()
        async with trio.open_nursery() as nursery:
            def arrived(raw) -> bool:
                if conn.busy >= limit:
                    return False          # queued: answered BUSY below, in order
                last.last_active = now = trio.current_time()
                self._dispatch(nursery, conn, cs, raw, now)
                return True
            conn.deliver_to(arrived)
            try:
                while True:
                    try:
                        with trio.move_on_at(last.last_active + idle) as waiting:
                            raw = await conn.recv()
                    except TransportError:
                        break
                    if waiting.cancelled_caught:
                        if conn.busy or trio.current_time() < last.last_active + idle:   # requests came meanwhile
                            if conn.busy:
                                last.last_active = trio.current_time()
                            continue
                        log.info("closing connection from %s: idle for %ss", conn.peer, idle)
                        await conn.aclose()
                        break
                    last.last_active = trio.current_time()
                    if conn.busy >= limit:
                        if not await self._busy(conn, raw, limit):
                            break
                        continue
                    self._dispatch(nursery, conn, cs, raw, last.last_active)
            finally:
                conn.deliver_to(None)     # the nursery is about to close to new arrivals
                if self.lean is not None:
                    self.lean.closed(conn)

    async def _busy(self, conn: Connection, raw: bytes, limit: int) -> bool:
        """Answer a request over the connection's in-flight limit BUSY, inline (not in flight: no task, no
        count); False: the peer does not read its answers (not sent within ``peer_timeout``), the connection
        is dropped."""
        self.counters.requests += 1
        self.counters.busy_inflight += 1
        if self.counters.busy_inflight % 1000 == 1:
            log.warning("%s has %d requests in flight (max_inflight %d): answering BUSY (%d so far)",
                        conn.peer, conn.busy, limit, self.counters.busy_inflight)
        try:
            h, _payload = decode_message(raw)
            resp = h.reply(Result.BUSY, arg=limit)
        except ProtocolError:
            resp = Header(opcode=raw[3] if len(raw) > 3 else 0, req_id=peek_req_id(raw) or 0,
                          result=Result.BUSY, arg=limit, version=conn.version)
        await self.post.send(conn, resp)      # bounded by peer_timeout: else the connection is dropped
        return conn.alive

    def _dispatch(self, nursery: trio.Nursery, conn: Connection, cs: ConnState, raw: bytes, now: float) -> None:
        """Start the request's handler -- or, for an inline append that continues the connection's newest
        run of appends (``cs.run``), add it to that run: it is handled with it, no task of its own.
        ``now``: the request's arrival."""
        self.counters.requests += 1
        try:
            h, payload = decode_message(raw)
        except ProtocolError as e:
            self.counters.protocol_errors += 1
            log.warning("malformed header from %s: %s", conn.peer, e)
            opcode = raw[3] if len(raw) > 3 else 0
            resp = Header(opcode=opcode, req_id=peek_req_id(raw) or 0, result=Result.PROTOCOL,
                          arg=PROTOCOL_REASONS.index(e.reason), version=conn.version)
            conn.busy += 1                        # an answer in flight counts against max_inflight too
            nursery.start_soon(self._send_refusal, conn, resp)
            return
        if trace.ON:
            stages.arrived(h)
        if payload is not None and self.lean is not None and self._lean(nursery, conn, h, payload, now):
            return
        run = cs.run
        if payload is not None and run is not None and run.join(h, payload, now):
            self.post.begin(conn)
            return
        ticket = run = None
        if h.opcode in (Op.WRITE, Op.TRUNCATE):   # ordered by arrival: take the ticket now, synchronously
            part = self.table.get(h.partition)
            lane = part.lane(h.extent) if part is not None else None
            if lane is not None:          # a payload still to fetch is passed by other connections' tickets
                ticket = (lane, lane.ticket(conn, payload is None and h.opcode == Op.WRITE))
                if payload is not None:
                    run = cs.run = AppendRun(h, payload, ticket)
        self.post.begin(conn)
        rq = Request(conn, h, ticket, payload, run, now)
        if run is not None and forwarded(h) and self._now(nursery, rq):
            return
        nursery.start_soon(self._handle, rq)

    async def _send_refusal(self, conn: Connection, resp: Header) -> None:
        """A malformed request's answer: not a request in flight, only against the connection's limit."""
        try:
            await self.post.send(conn, resp)
        finally:
            conn.busy -= 1

    # -- operate ----------------------------------------------------------------------------------------------
    async def _handle(self, rq: Request) -> None:
        conn = rq.conn
        if rq.run is not None:
            self._start_run(rq)
        h = rq.h
        resp = None
        why = ""
        drop = False                     # the connection is dropped once the answer is sent
        part = None                      # the request's partition as its handler started (see ``_gone``)
        try:
            self.admit(conn, h)
            if h.opcode in ON_DATA:
                part = self.table.get(h.partition)
            resp = await self.handlers[h.opcode](rq)
        except PeerTimeout as e:
            log.warning("%s from %s: %s: dropping the connection", h.describe(), conn.peer, e)
            conn.misbehaved = conn.misbehaved or "did not serve a one-sided op in time"
            if e.result is not None:     # told why first (its payload's READ: the stream is still whole)
                resp, drop = h.reply(e.result), True
            else:
                await conn.aclose()
        except Exception as e:  # a bug must cost one request, not the node (failure)
            if part is not None:
                e = self._gone(h, part, e)
            resp = failure(conn, h, e)
            why = e.why if isinstance(e, Reply) else ""
        finally:
            await self.post.answer(conn, h, self.post.ended(rq, resp), why=why, drop=drop)

    def _now(self, nursery: trio.Nursery, rq: Request) -> bool:
        """A follower's lone inline append (a run just opened), done and answered right where it arrived --
        in the transport's delivery, no task of its own -- when ``Appends.now`` can: True.  False: it goes
        as a task, untouched."""
        conn, h = rq.conn, rq.h
        try:
            self.admit(conn, h)
            resp = self.now(rq)
            if resp is None:
                return False
        except Exception as e:  # a refusal; or a bug, which must cost one request, not the node
            resp = failure(conn, h, e)
        self._start_run(rq)
        self.post.answer_now(nursery, conn, h, self.post.ended(rq, resp))
        return True

    def _lean(self, nursery: trio.Nursery, conn: Connection, h: Header, payload, t0: float) -> bool:
        """The common case of a plain inline append, handed to its connection's data-plane thread
        (ops/lean.py), or refused by the admission right here: True.  False: it goes the usual way, untouched."""
        self.post.begin(conn)            # (in flight while it is looked at: ``GroupCommit.here`` counts it)
        try:
            rq = self.lean.take(conn, h, payload, t0, nursery)
        except Reply as e:
            rq = Request(conn, h, None, payload, None, t0)
            self.post.answer_now(nursery, conn, h, self.post.ended(rq, failure(conn, h, e)))
            return True
        if rq is None:
            self.post.inflight -= 1
            conn.busy -= 1
            return False
        return True

    def _lean_answers(self, nursery: trio.Nursery, conn: Connection, done: list[tuple[Request, Header]]) -> None:
        """Lean appends' answers (``Lean.finish``: a batch of one connection's), sent at once where the
        connection takes them (one ``sendmsg`` on TCP), else by a task; counted like every answer."""
        answers = []
        for rq, resp in done:
            if resp.result not in (Result.OK, Result.STALE_EPOCH, Result.NOT_FOUND):
                log.info("%s from %s -> %s", rq.h.describe(), conn.peer, Result(resp.result).name)
            answers += self.post.ended(rq, resp)
        self.post.answer_now(nursery, conn, done[0][0].h, answers)

    @staticmethod
    def _start_run(rq: Request) -> None:
        """The run's handler starts (nothing joins it from now on): the request becomes the run's one append
        of all its bytes, or stays the lone request it was."""
        whole = rq.run.start()
        if whole is None:
            rq.run = None
        else:
            rq.h, rq.payload = whole
            rq.requests = 1 + len(rq.run.more)

    @staticmethod
    def _gone(h: Header, part, e: Exception) -> Exception:
        """A request on a partition dropped from this node while it ran (``part``, as its handler started: a
        newer view no longer names the node -- a hand-off, a removal) failed because of that, whatever it hit
        on the way (a closed store, a directory moved to the trash): NOT_FOUND, as a moment later -- not a
        disk error or a bug, in the log and the metrics."""
        if (part.dropped and not isinstance(e, TransportError)
                and not (isinstance(e, Reply) and e.result == Result.NOT_FOUND)):
            return Reply(Result.NOT_FOUND, why=f"partition {h.partition} was dropped from this node meanwhile ({e})")
        return e
