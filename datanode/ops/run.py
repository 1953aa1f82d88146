"""A run of small appends handled as one: which requests may join it, and what each of them is answered.
No I/O: the wrapper (ops/wrap.py) drives it as requests arrive and as its handler starts and ends."""
from __future__ import annotations

from wire.crc import crc32c
from wire.protocol import INLINE_MAX, Header, Result
from ..partition import ExtentLane
from ..store import MAX_EXTENT


class AppendRun:
    """Inline appends that came back to back on one connection for one extent -- each starting where the one
    before it ends, all before the first one's handler ran -- handled as ONE append of their bytes: one turn
    of the extent's lane, one forward to each follower, one local write, one flush, one wait for the acks;
    each request is then answered as if it had gone alone (``answers``).  Under load, when requests queue in
    the socket, the per-append work of the leader and of every follower is paid once per run instead of once
    per request; a lone request is a run of one and goes as it always did.

    The wrapper opens a run for every inline append that takes a lane ticket, and ``join`` adds the requests
    that follow it, synchronously, as they are cut from the stream: only while the run's handler has not
    started, only if no other request of the extent took a ticket in between (the extent's arrival order
    stays what it was), and only requests whose payload matches their CRC (checked here; a request that
    fails it goes alone and is refused alone), and never past the extent's size limit.  So every answer is
    the one the request would have had alone: OK with its own end, or the run's refusal, which the requests
    after the first would have met too (a WRONG_OFFSET, a DIVERGED extent, a replica that failed their
    bytes).  One exception: a disk with less room than the run's bytes (at most ``INLINE_MAX``) but enough
    for the first request's answers NO_SPACE to all of them."""

    MAX = 32                        # requests in one run at most (and at most INLINE_MAX bytes)
    __slots__ = ("head", "ticket", "more", "payloads", "end", "length", "started", "checked")

    def __init__(self, h: Header, payload, ticket: tuple[ExtentLane, int]):
        self.head, self.ticket = h, ticket
        self.more: list[tuple[Header, float]] = []     # the requests that joined, with their arrival times
        self.payloads = [payload]   # every request's bytes, until the handler starts
        self.end = h.offset + h.length
        self.length = h.length
        self.started = False        # the handler runs: nothing joins any more
        self.checked = False        # the head's payload matched its CRC (checked when the first one joins)

    def join(self, h: Header, payload, t0: float) -> bool:
        """Add the request that arrived at ``t0`` (True), or leave it to go on its own (False)."""
        head = self.head
        if (self.started or h.offset != self.end or h.extent != head.extent or h.partition != head.partition
                or h.epoch != head.epoch or h.flags != head.flags or self.length + h.length > INLINE_MAX
                or self.end + h.length > MAX_EXTENT or len(self.more) >= self.MAX - 1
                or not self.ticket[0].newest(self.ticket[1]) or crc32c(payload) != h.crc):
            return False
        if not self.checked:
            if crc32c(self.payloads[0]) != head.crc:
                return False
            self.checked = True
        self.more.append((h, t0))
        self.payloads.append(payload)
        self.end += h.length
        self.length += h.length
        return True

    def start(self) -> tuple[Header, memoryview] | None:
        """Called as the handler starts (nothing joins from now on, and the run lets go of the bytes): the
        one append of the run's bytes -- the first request's header grown to cover them all --, or None for
        a lone request (it goes as it came)."""
        self.started = True
        payloads, self.payloads = self.payloads, None
        if not self.more:
            return None
        joined = b"".join(payloads)
        return self.head.but(length=self.length, crc=crc32c(joined)), memoryview(joined)

    def answers(self, resp: Header | None, t0: float) -> list[tuple[Header, float, Header | None]]:
        """Each request of the run with its arrival time and its answer, given the whole append's."""
        return [(h, t, None if resp is None else
                 h.reply(Result.OK, arg=h.offset + h.length, crc=h.crc) if resp.result == Result.OK else
                 h.reply(resp.result, arg=resp.arg))
                for h, t in [(self.head, t0), *self.more]]
