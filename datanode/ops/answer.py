"""Post, the last of a request's three parts (``Wrap``: prepare, operate, post): a request's end, in one
place for every request however it was handled -- its failure as a result code and a log line
(``failure``), its lane ticket given back and its steps recorded (``Post.ended``), the audit line of an admin
action, the answers sent (``Post.answer``, or ``Post.answer_now`` right where it was handled), and each
request counted in the metrics and no longer in flight.  Every answer goes out through ``Post.send``."""
from __future__ import annotations

import logging

import trio

from wire import trace
from wire.protocol import ADMIN_ACTIONS, Header, Op, ProtocolError, Result
from wire.transport.base import Connection, TransportError
from ..audit import NOTE as AUDIT_NOTE, AuditLog
from ..metrics import NodeMetrics
from . import stages
from .base import Reply, Request

# the request path's lines keep the logger name operators know them by
log = logging.getLogger("datanode.server")

Answers = list[tuple[Header, float, Header | None]]      # (request, its arrival, its answer or None: dropped)


def failure(conn: Connection, h: Header, e: Exception) -> Header | None:
    """A handler's (or the admission's) exception as the answer, with its log line; None: the connection
    failed, there is nobody to answer."""
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


class Post:
    """The requests in flight (``inflight``: arrival counts one in, ``begin``; its answer counts it out) and
    the way out of each."""

    def __init__(self, *, peer_timeout: float, metrics: NodeMetrics, audit: AuditLog):
        self.peer_timeout = peer_timeout
        self.metrics = metrics
        self.audit = audit
        self.inflight = 0
        self._idle = trio.Event()

    async def drained(self) -> None:
        """Until no request is in flight."""
        while self.inflight:
            self._idle = trio.Event()
            await self._idle.wait()

    def begin(self, conn: Connection) -> None:
        """A request arrived: in flight until answered (against the connection's ``max_inflight`` too)."""
        self.inflight += 1
        conn.busy += 1

    def ended(self, rq: Request, resp: Header | None) -> Answers:
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

    async def answer(self, conn: Connection, h: Header, answers: Answers, *, why: str = "",
                     drop: bool = False) -> None:
        """The request ``h``'s answers (a run's several) sent, after the audit line of an admin action (on
        file before the answer: whoever got one can find its line); then each request is counted, and the
        connection dropped if ``drop``."""
        try:
            if h.opcode in ADMIN_ACTIONS:
                resp = answers[0][2]
                await self.audit.record(peer=conn.peer, role=conn.role, identity=conn.identity,
                                        op=Op(h.opcode).name, partition=h.partition, epoch=h.epoch,
                                        result=Result(resp.result).name if resp is not None else "DROPPED",
                                        detail=why or AUDIT_NOTE.get())
            replies = self._replies(h, answers)
            if replies:     # still in flight until answered: a drain must not cancel the reply
                await self.send(conn, *replies)
        finally:
            self._answered(conn, answers)
            if drop:
                await conn.aclose()

    def answer_now(self, nursery: trio.Nursery, conn: Connection, h: Header, answers: Answers) -> None:
        """``answer`` for a request handled right where it arrived (no audit: not an admin action): sent right
        here where the connection takes it at once, else by a task."""
        replies = self._replies(h, answers)
        if replies:
            try:
                sent = (conn.send_nowait(self.peer_timeout, replies[0].encode()) if len(replies) == 1 else
                        conn.send_many_nowait(self.peer_timeout, [r.encode() for r in replies]))
            except ProtocolError:
                sent = False                       # (send answers it as the bug it is)
            except TransportError as e:
                log.debug("reply to %s lost: %s", conn.peer, e)
                sent = True                        # (the connection is gone, the answer with it)
            if not sent:
                try:
                    nursery.start_soon(self._send_answered, conn, replies, answers)
                    return
                except RuntimeError:               # the connection's requests are all in: it is gone
                    pass
        self._answered(conn, answers)

    async def _send_answered(self, conn: Connection, replies: list[Header], answers: Answers) -> None:
        try:
            await self.send(conn, *replies)
        finally:
            self._answered(conn, answers)

    @staticmethod
    def _replies(h: Header, answers: Answers) -> list[Header]:
        """The answers to send (traced: the peer may note its next step before the send returns)."""
        replies = [r for _h, _t, r in answers if r is not None]
        if replies and trace.ON:
            stages.replied(h, [a_h for a_h, _t, _r in answers])
        return replies

    def _answered(self, conn: Connection, answers: Answers) -> None:
        """Each request answered (its result; -1: dropped): in the metrics, and no longer in flight."""
        now = trio.current_time()
        for h, t0, r in answers:
            self.metrics.observe(h.opcode, r.result if r is not None else -1, h.length, now - t0)
            self.inflight -= 1
            conn.busy -= 1
        if self.inflight == 0:
            self._idle.set()

    async def send(self, conn: Connection, *resps: Header) -> None:
        """Answers (a run's several at once: one ``sendmsg`` on TCP), within ``peer_timeout``: a peer that reads
        none is dropped.  An answer that does not encode is a bug, answered ERROR."""
        raws = []
        for resp in resps:
            try:
                raws.append(resp.encode())
            except ProtocolError as e:                # a field out of range: a bug, answered as one
                log.error("reply %s to %s does not encode (%s): answering ERROR", resp.describe(), conn.peer, e)
                raws.append(Header(opcode=resp.opcode, req_id=resp.req_id, result=Result.ERROR,
                                   version=resp.version).encode())
        try:
            sent = (await conn.send_within(self.peer_timeout, raws[0]) if len(raws) == 1 else
                    await conn.send_many_within(self.peer_timeout, raws))
            if not sent:      # a peer that reads no answers is dropped
                log.warning("dropping connection from %s: it has not read its answers for %ss", conn.peer,
                            self.peer_timeout)
                conn.misbehaved = conn.misbehaved or "did not read its answers"
                await conn.aclose()
        except TransportError as e:
            log.debug("reply to %s lost: %s", conn.peer, e)
