"""Every request's way through the node, around the handler table: all that its handler does not say.

In the spirit of CubeFS's ``OperatePacket`` (datanode/wrap_operator.go), the handlers (ops/append.py,
ops/data.py, ops/admin.py, ops/repair.py) say what a request does, and ``Wrap`` does, in one place, what
every request goes through:

* arrival (``_dispatch``, synchronously, as the transport cuts it from the stream): decoding (a malformed
  header is answered PROTOCOL), the extent lane's ticket taken in arrival order (WRITE, TRUNCATE), a small
  inline append joined to the connection's run (ops/run.py ``AppendRun``), the connection's in-flight limit
  (BUSY beyond it);
* admission (``admit``): the node's state (starting, draining, its data directory lost), the connection's
  proven role, a volume key's scope (its volume's partitions only), and a forwarded change's sender being the
  partition's leader;
* the handler, in a task of its own (``_handle``) -- or, for a follower's lone inline append, right where
  it arrived (``_now``: ``Appends.now``, the same steps as the WRITE handler's);
* its failure as a result code and a log line (``_failed``), the step recorder's stage times and trace, the
  audit line of an admin action, the answer sent, and the request counted in the metrics and no longer in
  flight (``_answered``).
"""
from __future__ import annotations

import dataclasses
import logging
import math
from typing import Callable

import trio

from wire import trace
from wire.protocol import (
    ADMIN_ACTIONS,
    PROTOCOL_REASONS,
    Flag,
    Header,
    Op,
    ProtocolError,
    Result,
    decode_message,
    peek_req_id,
    roles_for,
)
from wire.transport.base import Connection, TransportError
from ..audit import NOTE as AUDIT_NOTE, AuditLog
from ..config import Config
from ..metrics import NodeMetrics
from ..partition import PartitionTable
from . import stages
from .admission import is_loopback
from .base import Handler, PeerTimeout, Reply, Request, RequestCounters
from .run import AppendRun

# the request path's lines keep the logger name operators know them by
log = logging.getLogger("datanode.server")

LEADER_ONLY = frozenset({Op.WRITE, Op.TRUNCATE, Op.CREATE_EXTENT, Op.MARK_DELETE})
# the requests on a partition's data (see ``_gone``)
ON_DATA = LEADER_ONLY | {Op.READ, Op.WATERMARKS, Op.BLOCK_CRCS, Op.REPLICA_STATE, Op.SCRUB_EXTENT}
# what a node whose data directory is gone refuses: everything that writes under it -- the extent changes a
# leader alone takes from clients, and the admin ops that change partitions or the trash
CHANGES_DATA = LEADER_ONLY | {Op.PARTITION_CREATE, Op.PARTITION_UPDATE, Op.PARTITION_UPDATE_MANY, Op.PARTITION_DELETE,
                              Op.TRASH_RESTORE, Op.TRASH_PURGE}
PROVEN_ADMIN = frozenset({Op.TRASH_PURGE})     # never from an unauthenticated peer on another host
# what a volume-scoped connection may send without naming a partition of its volume: the ops about the node,
# not a partition (a listing shows ids, replicas and sizes, no data).  Everything else is scoped: an opcode
# added later is refused to volume keys until it is listed here.
VOLUME_FREE = frozenset({Op.PING, Op.NODE_STATUS, Op.POOL_STATS, Op.PARTITION_LIST})


def volume_refusal(volume: str, opcode: int, pid: int, part_volume: str | None) -> str:
    """Why a connection that proved the key of ``volume`` ("": no volume key, unscoped) may not send
    ``opcode`` on partition ``pid``, which belongs to ``part_volume`` ("": none; None: not on this node);
    "": it may."""
    if not volume or opcode in VOLUME_FREE or part_volume == volume:
        return ""
    where = ("is not on this node" if part_volume is None else
             f"belongs to volume {part_volume}" if part_volume else "belongs to no volume")
    return f"volume {volume}'s key may not send {Op(opcode).name} on partition {pid}: it {where}"
Answers = list[tuple[Header, float, Header | None]]      # (request, its arrival, its answer or None: dropped)


class _Activity:
    __slots__ = ("last_active",)


@dataclasses.dataclass
class Serving:
    """Whether the node takes requests now (the node sets it; ``Wrap.admit`` reads it)."""
    state: str = "starting"              # -> "serving" once the partitions are open
    draining: bool = False               # stopping: only PING and NODE_STATUS (its progress) are answered
    data_dir_lost: str | None = None     # why changes are refused (Node._watch_data_dir)


class Wrap:
    def __init__(self, *, cfg: Config, serving: Serving, table: PartitionTable, counters: RequestCounters,
                 metrics: NodeMetrics, audit: AuditLog, handlers: dict[Op, Handler],
                 now: Callable[[Request], Header | None], lean=None):
        assert set(handlers) == set(Op), "every opcode has exactly one handler"
        self.cfg = cfg
        self.serving = serving
        self.table = table
        self.counters = counters
        self.metrics = metrics
        self.audit = audit
        self.handlers = {op.value: fn for op, fn in handlers.items()}
        self.now = now                   # a follower's lone inline append, right here (Appends.now)
        self.lean = lean                 # the common case of a client's append, by its connection's thread
        if lean is not None:
            lean.admit, lean.answer = self.admit, self._lean_answers
        self.inflight = 0
        self._idle = trio.Event()

    async def drained(self) -> None:
        """Until no request is in flight."""
        while self.inflight:
            self._idle = trio.Event()
            await self._idle.wait()

    # -- arrival ----------------------------------------------------------------------------------------------
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
        last = activity if activity is not None else _Activity()
        last.last_active = trio.current_time()
        runs: list[AppendRun | None] = [None]   # the connection's newest run of appends
        async with trio.open_nursery() as nursery:
            def arrived(raw) -> bool:
                if conn.busy >= limit:
                    return False          # queued: answered BUSY below, in order
                last.last_active = now = trio.current_time()
                self._dispatch(nursery, conn, raw, runs, now)
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
                    self._dispatch(nursery, conn, raw, runs, last.last_active)
            finally:
                conn.deliver_to(None)     # the nursery is about to close to new arrivals
                if self.lean is not None:
                    self.lean.closed(conn)

    async def _busy(self, conn: Connection, raw: bytes, limit: int) -> bool:
        """Answer a request over the connection's in-flight limit BUSY, inline; False: the peer does not
        read its answers (not sent within ``peer_timeout``), the connection is dropped."""
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
        await self._send(conn, resp)          # bounded by peer_timeout: else the connection is dropped
        return conn.alive

    def _dispatch(self, nursery: trio.Nursery, conn: Connection, raw: bytes, runs: list, now: float) -> None:
        """Start the request's handler -- or, for an inline append that continues the connection's newest
        run of appends, add it to that run: it is handled with it, no task of its own.  ``runs``: the
        connection's one-item list holding that run; ``now``: the request's arrival."""
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
            nursery.start_soon(self._send_counted, conn, resp)
            return
        if trace.ON:
            stages.arrived(h)
        if payload is not None and self.lean is not None and self._lean(nursery, conn, h, payload, now):
            return
        run = runs[0]
        if payload is not None and run is not None and run.join(h, payload, now):
            self.inflight += 1
            conn.busy += 1
            return
        ticket = run = None
        if h.opcode in (Op.WRITE, Op.TRUNCATE):   # ordered by arrival: take the ticket now, synchronously
            part = self.table.get(h.partition)
            lane = part.lane(h.extent) if part is not None else None
            if lane is not None:          # a payload still to fetch is passed by other connections' tickets
                ticket = (lane, lane.ticket(conn, payload is None and h.opcode == Op.WRITE))
                if payload is not None:
                    run = runs[0] = AppendRun(h, payload, ticket)
        self.inflight += 1
        conn.busy += 1
        rq = Request(conn, h, ticket, payload, run, now)
        if run is not None and h.flags & Flag.FORWARDED and self._now(nursery, rq):
            return
        nursery.start_soon(self._handle, rq)

    # -- admission --------------------------------------------------------------------------------------------
    def admit(self, conn: Connection, h: Header) -> None:
        """Raises the request's refusal, if the node refuses it before any handler runs."""
        s = self.serving
        if s.draining and h.opcode not in (Op.PING, Op.NODE_STATUS):
            raise Reply(Result.RETRY, why="node is shutting down")
        if s.state != "serving" and h.opcode not in (Op.PING, Op.NODE_STATUS):
            raise Reply(Result.RETRY, why="node is starting (opening its partitions)")
        if s.data_dir_lost is not None and h.opcode in CHANGES_DATA:
            raise Reply(Result.DISK_ERROR, why=s.data_dir_lost)
        why = self._forbidden(conn, h)
        if why:
            self.counters.forbidden += 1
            raise Reply(Result.FORBIDDEN, why=why)

    def _forbidden(self, conn: Connection, h: Header) -> str:
        """The connection's proven role must be one the request's opcode accepts (protocol.OP_ROLES); a
        forwarded change, and a leader's confirmation that a follower is synced, must come from the
        partition's current leader (the node identity proven in the hello; without authentication, the one the
        peer named -- unproven, but a peer that does not pretend to be the leader is refused); purging the
        trash needs a proven admin (without authentication: a peer on this host); a connection that proved a
        volume key reaches only that volume's partitions (``volume_refusal``): why not ("": it may)."""
        if conn.role is not None and conn.role not in roles_for(h):
            return (f"role {conn.role.name.lower()} may not send "
                    f"{'forwarded ' if h.flags & Flag.FORWARDED else ''}{Op(h.opcode).name}")
        if conn.volume:
            part = self.table.get(h.partition)
            why = volume_refusal(conn.volume, h.opcode, h.partition, part.volume if part is not None else None)
            if why:
                return why
        if conn.role is None and h.opcode in PROVEN_ADMIN and not is_loopback(conn.peer.rpartition(":")[0]):
            return (f"{Op(h.opcode).name} needs an authenticated admin (this node has no secret: only from "
                    f"its own host)")
        if (h.flags & Flag.FORWARDED and h.opcode in LEADER_ONLY) or (h.opcode == Op.REPLICA_STATE and h.arg):
            part = self.table.get(h.partition)       # (at another epoch: refused STALE_EPOCH by the handler)
            if part is not None and h.epoch == part.epoch and part.leader != conn.identity:
                what = "confirmation" if h.opcode == Op.REPLICA_STATE else f"forwarded {Op(h.opcode).name}"
                return (f"{what} from {'node ' + conn.identity if conn.identity else 'a peer that is no node'}, "
                        f"but the leader of partition {part.pid} is {part.leader}")
        return ""

    # -- the handler and the answer ---------------------------------------------------------------------------
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
        except Exception as e:  # a bug must cost one request, not the node (_failed)
            if part is not None:
                e = self._gone(h, part, e)
            resp = self._failed(conn, h, e)
            why = e.why if isinstance(e, Reply) else ""
        finally:
            answers = self._ended(rq, resp)
            try:
                if h.opcode in ADMIN_ACTIONS:   # on file before the answer: whoever got one can find its line
                    await self.audit.record(peer=conn.peer, role=conn.role, identity=conn.identity,
                                            op=Op(h.opcode).name, partition=h.partition, epoch=h.epoch,
                                            result=Result(resp.result).name if resp is not None else "DROPPED",
                                            detail=why or AUDIT_NOTE.get())
                replies = [r for _h, _t, r in answers if r is not None]
                if replies:     # still in flight until answered: a drain must not cancel the reply
                    if trace.ON:
                        stages.replied(h, [a_h for a_h, _t, _r in answers])
                    await self._send(conn, *replies)
            finally:
                now = trio.current_time()
                for a_h, a_t0, r in answers:
                    self._answered(conn, a_h, r.result if r is not None else -1, now - a_t0)
                if drop:
                    await conn.aclose()

    def _now(self, nursery: trio.Nursery, rq: Request) -> bool:
        """A follower's lone inline append (a run just opened), done and answered right where it arrived --
        in the transport's delivery, no task of its own -- when ``Appends.now`` can; its answer sent right
        away where the connection takes it at once (else by a task, as ``_handle`` sends): True.  False: it
        goes as a task, untouched."""
        conn, h = rq.conn, rq.h
        try:
            self.admit(conn, h)
            resp = self.now(rq)
            if resp is None:
                return False
        except Exception as e:  # a refusal; or a bug, which must cost one request, not the node
            resp = self._failed(conn, h, e)
        self._start_run(rq)
        self._ended(rq, resp)
        if resp is None:
            self._answered(conn, h, -1, trio.current_time() - rq.t0)
            return True
        if trace.ON:
            stages.replied(h, [h])
        try:
            sent = conn.send_nowait(self.cfg.peer_timeout, resp.encode())
        except ProtocolError:
            sent = False                       # (_send answers it as the bug it is)
        except TransportError as e:
            log.debug("reply to %s lost: %s", conn.peer, e)
            sent = True                        # (the connection is gone, the answer with it)
        if not sent:
            nursery.start_soon(self._send_answer, conn, h, rq.t0, resp)
            return True
        self._answered(conn, h, resp.result, trio.current_time() - rq.t0)
        return True

    def _lean(self, nursery: trio.Nursery, conn: Connection, h: Header, payload, t0: float) -> bool:
        """The common case of a client's append, handed to its connection's data-plane thread (ops/lean.py),
        or refused by the admission right here: True.  False: it goes the usual way, untouched."""
        self.inflight += 1               # (in flight while it is looked at: ``GroupCommit.here`` counts it)
        conn.busy += 1
        try:
            rq = self.lean.take(conn, h, payload, t0, nursery)
        except Reply as e:
            self._lean_answer(nursery, Request(conn, h, None, payload, None, t0), self._failed(conn, h, e))
            return True
        if rq is None:
            self.inflight -= 1
            conn.busy -= 1
            return False
        return True

    def _lean_answer(self, nursery: trio.Nursery, rq: Request, resp: Header) -> None:
        self._lean_answers(nursery, rq.conn, [(rq, resp)])

    def _lean_answers(self, nursery: trio.Nursery, conn: Connection, done: list[tuple[Request, Header]]) -> None:
        """Lean appends' answers (``Lean.finish``: a batch of one connection's), sent right away -- one
        ``sendmsg`` on TCP -- where the connection takes them at once (else by a task of the connection's),
        with their stage times, trace and metrics."""
        raws = []
        for rq, resp in done:
            h = rq.h
            if resp.result not in (Result.OK, Result.STALE_EPOCH, Result.NOT_FOUND):
                log.info("%s from %s -> %s", h.describe(), conn.peer, Result(resp.result).name)
            elif resp.result == Result.OK:
                rq.stages.count(self.metrics.write_stages, h, 1)
            if trace.ON:
                rq.stages.trace(h)
                stages.replied(h, [h])
            try:
                raws.append(resp.encode())
            except ProtocolError as e:               # a field out of range: a bug, answered as one
                log.error("reply %s to %s does not encode (%s): answering ERROR", resp.describe(), conn.peer, e)
                raws.append(Header(opcode=resp.opcode, req_id=resp.req_id, result=Result.ERROR,
                                   version=resp.version).encode())
        try:
            sent = (conn.send_nowait(self.cfg.peer_timeout, raws[0]) if len(raws) == 1 else
                    conn.send_many_nowait(self.cfg.peer_timeout, raws))
        except TransportError as e:
            log.debug("reply to %s lost: %s", conn.peer, e)
            sent = True                        # (the connection is gone, the answers with it)
        if not sent:
            try:
                nursery.start_soon(self._send_answers, conn, done)
                return
            except RuntimeError:               # the connection's requests are all in: it is gone
                pass
        now = trio.current_time()
        for rq, resp in done:
            self._answered(conn, rq.h, resp.result, now - rq.t0)

    async def _send_answers(self, conn: Connection, done: list[tuple[Request, Header]]) -> None:
        try:
            await self._send(conn, *[resp for _rq, resp in done])
        finally:
            now = trio.current_time()
            for rq, resp in done:
                self._answered(conn, rq.h, resp.result, now - rq.t0)

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

    @staticmethod
    def _failed(conn: Connection, h: Header, e: Exception) -> Header | None:
        """A handler's (or the admission's) exception as the answer, with its log line; None: the
        connection failed, there is nobody to answer."""
        if isinstance(e, Reply):
            if e.result not in (Result.OK, Result.STALE_EPOCH, Result.NOT_FOUND):
                log.info("%s from %s -> %s %s", h.describe(), conn.peer, e.result.name, e.why)
            return h.reply(e.result, arg=e.arg)
        if isinstance(e, TransportError):
            # one line per connection is logged where it ends (Node._on_stream); its other requests at debug
            (log.debug if not conn.alive else log.warning)("%s from %s: connection failed: %s", h.describe(),
                                                            conn.peer, e)
            return None
        log.exception("%s from %s failed", h.describe(), conn.peer)
        return h.reply(Result.ERROR)

    def _ended(self, rq: Request, resp: Header | None) -> Answers:
        """The request's handler is done: its lane ticket ends, its steps are recorded (an acknowledged
        append's stage times; the trace); each request it answers, with its arrival and its answer."""
        if rq.ticket is not None:
            rq.ticket[0].done(rq.ticket[1])
        h = rq.h
        if resp is not None and h.opcode == Op.WRITE and resp.result == Result.OK:
            rq.stages.count(self.metrics.write_stages, h, rq.requests)
        if trace.ON:
            rq.stages.trace(h)
        return [(h, rq.t0, resp)] if rq.run is None else rq.run.answers(resp, rq.t0)

    async def _send_answer(self, conn: Connection, h: Header, t0: float, resp: Header) -> None:
        try:
            await self._send(conn, resp)
        finally:
            self._answered(conn, h, resp.result, trio.current_time() - t0)

    def _answered(self, conn: Connection, h: Header, result: int, took: float) -> None:
        """A request has been answered (``result``; -1: dropped) ``took`` seconds after it arrived: in the
        metrics, and no longer in flight."""
        self.metrics.observe(h.opcode, result, h.length, took)
        self.inflight -= 1
        conn.busy -= 1
        if self.inflight == 0:
            self._idle.set()

    async def _send_counted(self, conn: Connection, resp: Header) -> None:
        try:
            await self._send(conn, resp)
        finally:
            conn.busy -= 1

    async def _send(self, conn: Connection, *resps: Header) -> None:
        """Answers (a run's several at once: one ``sendmsg`` on TCP)."""
        raws = []
        for resp in resps:
            try:
                raws.append(resp.encode())
            except ProtocolError as e:                # a field out of range: a bug, answered as one
                log.error("reply %s to %s does not encode (%s): answering ERROR", resp.describe(), conn.peer, e)
                raws.append(Header(opcode=resp.opcode, req_id=resp.req_id, result=Result.ERROR,
                                   version=resp.version).encode())
        try:
            sent = (await conn.send_within(self.cfg.peer_timeout, raws[0]) if len(raws) == 1 else
                    await conn.send_many_within(self.cfg.peer_timeout, raws))
            if not sent:      # a peer that reads no answers is dropped
                log.warning("dropping connection from %s: it has not read its answers for %ss", conn.peer,
                            self.cfg.peer_timeout)
                conn.misbehaved = conn.misbehaved or "did not read its answers"
                await conn.aclose()
        except TransportError as e:
            log.debug("reply to %s lost: %s", conn.peer, e)
