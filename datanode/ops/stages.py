"""A request's steps, timed: the recorder the wrapper (ops/wrap.py) gives each request.

A handler notes each step as it reaches it (``mark``: one clock read); once the request has its answer the
wrapper adds an append's stage times to ``metrics.WriteStages`` and, with ``DATANODE_TRACE`` set, writes
the steps to the trace (wire/trace.py).  Noting first and writing at the end keeps the handlers free of
both concerns, and an append the follower's fast path gave up on leaves nothing behind.
"""
from __future__ import annotations

from time import perf_counter

from wire import trace
from wire.protocol import Flag, Header, Op
from ..metrics import WriteStages

# an append's steps: the stages of metrics.WriteStages lie between them
STARTED, FETCHED, TURN, FORWARDED, WRITTEN, DURABLE, ACKED = range(7)
# a read's, after STARTED
READ_DISK, READ_SENT = 7, 8

# the steps a trace names (wire/trace.py): a write's get ".L" (leader) or ".F" (follower) appended
_WRITE_TRACE = ((STARTED, "started"), (FORWARDED, "forwarded"), (WRITTEN, "written"), (DURABLE, "durable"),
                (ACKED, "acked"))
_READ_TRACE = ((STARTED, "read.started"), (READ_DISK, "read.disk"), (READ_SENT, "read.sent"))


class Stages:
    __slots__ = ("at",)

    def __init__(self) -> None:
        self.at = [0.0] * 9          # perf_counter() per step; 0.0: not reached

    def mark(self, step: int) -> None:
        self.at[step] = perf_counter()

    def clear(self) -> None:
        self.at = [0.0] * 9

    def count(self, stages: WriteStages, h: Header, requests: int) -> None:
        """An acknowledged append's stage times, counted ``requests`` times (each request of a run waited
        that long)."""
        at = self.at
        acc = stages.follower if h.flags & Flag.FORWARDED else stages.leader
        acc[0] += requests
        acc[1] += (at[FETCHED] - at[STARTED]) * requests
        acc[2] += (at[TURN] - at[FETCHED]) * requests
        acc[3] += (at[WRITTEN] - at[TURN]) * requests
        acc[4] += (at[DURABLE] - at[WRITTEN]) * requests
        if at[ACKED]:                 # it had followers
            acc[5] += requests
            acc[6] += (at[ACKED] - at[DURABLE]) * requests

    def trace(self, h: Header) -> None:
        """The steps reached, into the trace (call only when ``trace.ON``)."""
        if h.opcode == Op.WRITE:
            suffix = ".F" if h.flags & Flag.FORWARDED else ".L"
            steps = [(name + suffix, i) for i, name in _WRITE_TRACE]
        elif h.opcode == Op.READ:
            steps = [(name, i) for i, name in _READ_TRACE]
        else:
            return
        for name, i in steps:
            if self.at[i]:
                trace.mark(name, h.extent, h.offset, at=self.at[i])


def arrived(h: Header) -> None:
    """A request was cut from the stream (call only when ``trace.ON``)."""
    if h.opcode in (Op.WRITE, Op.READ):
        trace.mark(trace.arrived(h.opcode == Op.READ, h.flags & Flag.FORWARDED), h.extent, h.offset)


def replied(h: Header, answered: list[Header]) -> None:
    """Answers go out, just before the send: the peer may note its next step before the send returns (call
    only when ``trace.ON``)."""
    if h.opcode in (Op.WRITE, Op.READ):
        step = trace.replied(h.opcode == Op.READ, h.flags & Flag.FORWARDED)
        for a in answered:
            trace.mark(step, a.extent, a.offset)
