"""Requests in flight on one connection, as plain state: their ids, the credits, which answer ends which
request, their deadlines, and how long the peer has been silent.

The credit rule: at most ``credits`` requests hold a credit at once (the peer's preposted control slots).  A
credit comes back when its request's caller has taken the outcome or the send failed (``finish``), and goes
straight to the first request queued for one.  Every request sent ends exactly once: answered, late (its
deadline passed -- the whole link is failed then: a late answer would land in a slot nobody accounts for),
silent (the peer answered nothing at all, not even a probe, for its ``PeerClock.limit``: the link is failed
too) or closed (the link died).  No waiting and no clock here: ``rpc.Requester`` does the I/O, passes the time
in and wakes whom these rules name.

Gray failures.  A peer that stops answering -- its process paused, its host hung -- still holds its sockets:
no error ever comes, only silence.  A request's own timeout must allow for a slow disk or a follower that
does not ack, so it is long; silence is told apart from slowness by a probe (a PING, answered by a live
node's event loop whatever its disk does): once a link with requests outstanding has heard nothing for half
its limit it is probed, and once it has heard nothing for the whole limit its requests end SILENT.  The limit
is derived from the peer's own answers (``PeerClock``), so it follows the link and the disk behind it.
"""
from __future__ import annotations

import collections
import math

LATE = object()     # a call's answer once its deadline passed unanswered
SILENT = object()   # a call's answer once its link heard nothing (not even a probe's answer) for its limit

# The silence limit: a few answer times (RFC 6298's smoothed time plus four deviations; a write's answer
# time holds the disk's flush and the followers' acks), bounded below (a busy host pauses a process now and
# then) and above (a live peer answers the probe long before; more would only delay failover).
SILENCE_MIN_S = 2.0
SILENCE_MAX_S = 10.0
SILENCE_RTTS = 3          # limit = SILENCE_RTTS x (srtt + 4 rttvar), within the bounds


class PeerClock:
    """How long one peer takes to answer, learnt from its answers (kept across reconnections), and the silence
    after which it counts as gone (``limit``).  A peer given up on for silence is ``suspect`` until it answers
    again, and each give-up doubles its next limit (within the bounds) until then: a peer that was only slow
    gets longer next time.  For one limit after it was given up on (or a new connection to it failed), it is
    not even dialed (``quiet``): every request to it would wait that long for nothing."""

    __slots__ = ("srtt", "rttvar", "backoff", "suspect", "quiet_until")

    def __init__(self) -> None:
        self.srtt: float | None = None
        self.rttvar = 0.0
        self.backoff = 1
        self.suspect = False
        self.quiet_until = -math.inf

    def sample(self, seconds: float) -> None:
        """An answer came ``seconds`` after its request was sent."""
        if self.srtt is None:
            self.srtt, self.rttvar = seconds, seconds / 2
        else:
            self.rttvar += (abs(self.srtt - seconds) - self.rttvar) / 4
            self.srtt += (seconds - self.srtt) / 8
        self.backoff, self.suspect, self.quiet_until = 1, False, -math.inf

    def limit(self, backoff: bool = True) -> float:
        """Seconds of silence, with requests outstanding, after which the peer is given up on (``backoff``
        False: as if it had never been given up on -- for a hello, which a live node answers at once)."""
        base = SILENCE_RTTS * (self.srtt + 4 * self.rttvar) if self.srtt is not None else 0.0
        return min(SILENCE_MAX_S, max(SILENCE_MIN_S, base) * (self.backoff if backoff else 1))

    def gave_up(self, now: float) -> None:
        """Its link was given up for silence at ``now``."""
        self.suspect = True
        self.backoff = min(self.backoff * 2, 8)
        self.quiet_until = now + self.limit(backoff=False)

    def dial_failed(self, now: float) -> None:
        """A new connection to it failed at ``now`` (only a suspect peer's failure keeps it quiet)."""
        if self.suspect:
            self.quiet_until = now + self.limit(backoff=False)

    def quiet(self, now: float) -> bool:
        """Is it not to be dialed now?"""
        return now < self.quiet_until


class Call:
    """One request, from holding a credit until its caller took its outcome."""

    __slots__ = ("req_id", "deadline", "timeout", "sent", "answer", "ended", "finished", "grant")

    def __init__(self, deadline: float, timeout: float) -> None:
        self.req_id = 0
        self.deadline = deadline
        self.timeout = timeout
        self.sent = deadline - timeout      # when it went out (set again by ``send``)
        self.answer = None         # the response, LATE, or None (not yet, or the link closed)
        self.ended = False         # the outcome is in: answered, late or closed
        self.finished = False      # its credit went back
        self.grant = None          # the requester's grant of our buffer to the peer, revoked as the call ends


class InFlight:
    __slots__ = ("free", "calls", "dead", "heard", "probe", "_queued", "_next")

    def __init__(self, credits: int, now: float = 0.0) -> None:
        self.free = credits                  # credits no call holds
        self.calls: dict[int, Call] = {}     # req_id -> the call sent with it, until it ends (oldest first)
        self.dead: str | None = None         # why the link failed (the first reason), or None
        self.heard = now                     # when the last answer came (or the link started)
        self.probe: Call | None = None       # the probe in flight, if any (it holds no credit: ``probing``)
        self._queued: collections.deque = collections.deque()   # waiters for a credit, first come first
        self._next = 1

    # -- credits ------------------------------------------------------------------------------------------
    def take(self) -> bool:
        """Take a free credit now; False if none is free (``queue`` for one)."""
        if self.free:
            self.free -= 1
            return True
        return False

    def queue(self, waiter) -> None:
        """``waiter`` (the requester's, opaque here) waits for a credit: ``give`` hands it one."""
        self._queued.append(waiter)

    def withdraw(self, waiter) -> bool:
        """A queued waiter stops waiting.  True if a credit was handed to it meanwhile: it holds it now."""
        for i, w in enumerate(self._queued):
            if w is waiter:             # by identity: waiters need not compare as themselves
                del self._queued[i]
                return False
        return True

    def give(self):
        """A credit comes back: to the first queued waiter (returned: it is to be woken) or to the free ones."""
        if self._queued:
            return self._queued.popleft()
        self.free += 1
        return None

    # -- calls --------------------------------------------------------------------------------------------
    def send(self, call: Call, now: float | None = None) -> int:
        """A call holding a credit is about to go out (at ``now``): its request id, its answer awaited from
        now on."""
        rid = call.req_id = self._next
        self._next += 1
        self.calls[rid] = call
        if now is not None:
            call.sent = now
        return rid

    def answered(self, req_id: int, resp, now: float | None = None) -> Call | None:
        """An answer came (at ``now``): the call it ends, or None (none waits for it: late, or not ours)."""
        call = self.calls.pop(req_id, None)
        if call is not None:
            call.answer, call.ended = resp, True
            if call is self.probe:
                self.probe = None
        if now is not None and now > self.heard:
            self.heard = now        # any answer, even a late one, says the peer is alive
        return call

    # -- silence ------------------------------------------------------------------------------------------
    def silent_since(self) -> float:
        """Since when the link has heard nothing while a request was outstanding (inf: none is)."""
        for call in self.calls.values():      # the oldest call outstanding: since its send or the last answer
            return max(self.heard, call.sent)
        return math.inf

    def probing(self, call: Call, now: float) -> int:
        """A probe (``call``) goes out at ``now`` on the credit kept for it: its request id."""
        self.probe = call
        return self.send(call, now)

    def silence(self, now: float, limit: float, probes: bool = True) -> str | None:
        """What the link's silence calls for at ``now``: "probe" (nothing heard for half of ``limit``, and no
        probe out yet), "give-up" (nothing heard for ``limit``, and the probe out for half of it) or None.
        The probe goes first even when the whole limit has passed: if it was our own process that stood
        still, the answers are waiting to be read, and half a limit more lets them in.  ``probes`` False (no
        slot kept for one): the silence alone decides."""
        since = self.silent_since()
        if not probes or self.probe is not None:
            late = self.probe is None or now - self.probe.sent >= limit / 2
            return "give-up" if now - since >= limit and late else None
        return "probe" if now - since >= limit / 2 else None

    def next_check(self, limit: float, probes: bool = True) -> float:
        """When ``silence`` may next call for something (inf: no request is outstanding)."""
        since = self.silent_since()
        if not probes:
            return since + limit
        if self.probe is None:
            return since + limit / 2
        return max(since + limit, self.probe.sent + limit / 2)

    def silent(self, why: str) -> list[Call]:
        """The link is given up for silence: every call in flight ends SILENT; returns them."""
        ended = self.fail(why)
        for call in ended:
            call.answer = SILENT
        return ended

    def fail(self, why: str) -> list[Call]:
        """The link died: every call in flight ends (closed); returns them."""
        if self.dead is None:
            self.dead = why
        ended = list(self.calls.values())
        self.calls.clear()
        self.probe = None
        for call in ended:
            call.ended = True
        return ended

    def expire(self, now: float) -> list[Call]:
        """Calls past their deadline at ``now`` end LATE and the link fails for every other one; returns every
        call that ended (none if none was late)."""
        late = [call for call in self.calls.values() if call.deadline <= now]
        if not late:
            return []
        for call in late:
            call.answer = LATE
        return self.fail(f"a request timed out after {late[0].timeout}s")

    def earliest(self) -> float:
        """The earliest deadline of the calls in flight (inf: none)."""
        return min([call.deadline for call in self.calls.values()], default=math.inf)

    def finish(self, call: Call):
        """The caller is done with ``call`` -- took its outcome, gave up waiting, or it never went out (its
        grant or send failed) --: forgotten, its credit back (``give``).  Idempotent."""
        self.calls.pop(call.req_id, None)
        if call.finished:
            return None
        call.finished = True
        return self.give()


class FanIn:
    """Requests whose answers one waiter takes together: all in once every member ended and no more join."""

    __slots__ = ("left", "sealed")

    def __init__(self) -> None:
        self.left = 0                # members not answered yet
        self.sealed = False          # no more members join

    def join(self) -> None:
        if self.sealed:
            raise RuntimeError("a request joined a sealed group")
        self.left += 1

    def seal(self) -> bool:
        """Every member has joined.  True if all are in already (the waiter is to be woken now)."""
        self.sealed = True
        return not self.left

    def answered(self) -> bool:
        """A member ended (call once per member).  True if it was the last, after ``seal``."""
        self.left -= 1
        return not self.left and self.sealed
