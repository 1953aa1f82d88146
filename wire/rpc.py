"""Requests and responses over one connection, from the requester's side.

``Requester`` gives each request an id, keeps at most ``conn.slots`` requests outstanding (the peer's
preposted control slots: the credit rule), matches each response to its request and fails everything in
flight, promptly, when the connection dies.  A request that times out poisons the connection (its late
answer would otherwise land in a slot we no longer account for) so the caller drops it and reconnects.
Those rules are plain state in ``inflight.py``; this module sends, waits and wakes.

A request that names a buffer of ours (``addr/rkey/rlen``) grants the connection's peer exactly that range
(read for a payload or body it fetches, write for an answer it pushes) while the request is in flight: the
grant is revoked when the answer arrives, the request times out or the connection dies
(``transport.base.Grants``) -- a request its caller cancels first waits up to ``ABANDON_GRACE`` for its
answer, shielded, so the peer is not cut off in the middle of moving its bytes --, and ``Pending.result``
returns only once the revocation took effect (on verbs the window's local invalidation completed), so the
caller may reuse the buffer at once.  On verbs the grant is a type-2 memory window bound on this
connection's queue pair, and the header sent carries the window's rkey in place of the region's.  So a
follower can READ a leader's pool block only while the leader waits for that follower's ack of the forward
naming it.

A peer that stops answering altogether (paused, hung: a gray failure) is not waited for until each request's
own timeout: with a ``PeerClock`` (``Links`` gives every link one, per address) a link that has heard
nothing for half the peer's silence limit while requests are outstanding sends a PING on a credit kept for
it, and one silent for the whole limit fails every request (``PeerSilent``) -- a live peer answers the PING
however slow its disk, so only silence ends a request early.  A new connection to a peer given up on this way
must say hello within that limit too.
"""
from __future__ import annotations

import logging
import math
import random

import trio

from .inflight import LATE, SILENT, Call, FanIn, InFlight, PeerClock
from .protocol import BODY_OPS, Header, Op, ProtocolError, decode
from .transport.base import Access, Connection, ConnectionClosed, TransportError

log = logging.getLogger(__name__)


class RequestTimeout(TransportError):
    pass


class PeerSilent(RequestTimeout):
    """The peer answered nothing, not even a probe, for its silence limit (``inflight.PeerClock``)."""


_PEER_READS = frozenset({Op.WRITE, *BODY_OPS})   # the peer fetches our buffer
ABANDON_GRACE = 1.0     # seconds a cancelled request still waits for its answer before its grant is revoked


async def _grant(conn: Connection, h: Header) -> tuple[int | None, Header]:
    """The one place a buffer named in a request is exposed to the peer: the grant's token, and the header
    carrying the rkey the peer must use (on verbs a memory window's, bound for this request alone)."""
    if not h.rlen:
        return None, h
    token, rkey = await conn.grants.grant(h.addr, h.rkey, h.rlen,
                                          Access.REMOTE_READ if h.opcode in _PEER_READS else Access.REMOTE_WRITE)
    return token, (h if rkey == h.rkey else h.but(rkey=rkey))


class Requester:
    """Drives ``inflight.InFlight`` (the ids, credits, matching and deadlines) over one connection: sends,
    waits, and wakes the callers whose requests ended."""

    def __init__(self, conn: Connection, clock: PeerClock | None = None):
        self.conn = conn
        self.clock = clock             # the peer's answer times: probes and gives up on silence (None: never)
        self._probes = clock is not None and conn.slots > 1       # one of the peer's slots kept for the probe
        self._calls = InFlight(max(1, conn.slots - self._probes), trio.current_time())
        self._watch: trio.CancelScope | None = None   # run()'s wait: its deadline is the earliest request's
        self._silence = clock.limit() if clock is not None else math.inf    # the limit run() last used

    @property
    def alive(self) -> bool:
        return self._calls.dead is None

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Matches responses to their requests until the connection ends: each answer is handled right in
        the transport's task as it lands (``Connection.deliver_to``: no task switch per answer).  And keeps
        the requests' deadlines: this task's wait ends at the earliest one (``submit`` moves it earlier when
        it must), so a request waiting for its answer needs no timer of its own -- a cancel scope per request
        was a large share of a client's CPU per small append."""
        self.conn.deliver_to(self._answer)
        task_status.started(self)
        calls = self._calls
        try:
            while True:
                deadline = calls.earliest()
                if self.clock is not None:
                    self._silence = self.clock.limit()
                    deadline = min(deadline, calls.next_check(self._silence, self._probes))
                with trio.CancelScope(deadline=deadline) as self._watch:
                    self._answer(await self.conn.recv())      # only what landed before deliver_to
                    continue
                now = trio.current_time()
                if self._ended(calls.expire(now)):
                    await self.conn.aclose()
                    return
                if self.clock is not None:
                    what = calls.silence(now, self._silence, self._probes)
                    if what == "give-up":
                        self._give_up(now)
                        await self.conn.aclose()
                        return
                    if what == "probe":
                        await self._probe(now)
        except TransportError as e:
            self._fail(str(e) or "connection closed")
        finally:
            self._fail("connection closed")

    def _answer(self, raw) -> bool:
        try:
            resp = decode(raw, request=False)
        except ProtocolError as e:
            log.warning("bad response from %s: %s", self.conn.peer, e)
            return True
        if self.clock is None:
            call = self._calls.answered(resp.req_id, resp)
        else:
            now = trio.current_time()
            call = self._calls.answered(resp.req_id, resp, now)
            if call is not None:
                self.clock.sample(now - call.sent)
        if call is None:
            log.debug("late response req=%s from %s dropped", resp.req_id, self.conn.peer)
            return True
        self.conn.grants.drop(call.grant)     # answered: the peer is done with our buffer
        call.answered.set()
        return True

    async def _probe(self, now: float) -> None:
        """Silent for half its limit: ask the peer whether it is alive at all (a PING on the credit kept for
        it; its answer, or any other, ends the silence)."""
        probe = _Probe(math.inf, math.inf)
        rid = self._calls.probing(probe, now)
        try:
            sent = await self.conn.send_within(self._silence / 2,
                                               Header(opcode=Op.PING).encode(req_id=rid, version=self.conn.version))
        except TransportError:
            sent = False
        if not sent:               # it cannot even take the probe: the limit decides
            log.debug("probe of %s not sent", self.conn.peer)

    def _give_up(self, now: float) -> None:
        quiet = now - self._calls.silent_since()
        why = f"answered nothing for {quiet:.1f}s, not even a ping"
        log.warning("%s %s: giving up on its %d request(s) in flight", self.conn.peer, why, len(self._calls.calls))
        self.clock.gave_up(now)
        self._ended(self._calls.silent(why))

    def _fail(self, why: str) -> None:
        self._ended(self._calls.fail(why))

    def _ended(self, calls: list) -> bool:
        """Wake the callers of requests that ended otherwise than by their answer (their grants revoked
        first); True if there were any."""
        for call in calls:
            self.conn.grants.drop(call.grant)
            call.answered.set()
        return bool(calls)

    @staticmethod
    def _wake(waiter) -> None:
        """A credit came back and went to ``waiter`` (``InFlight.give``): let it go on."""
        if waiter is not None:
            waiter.set()

    async def submit(self, header: Header, timeout: float, payload=None, *, group: "AnswerGroup | None" = None
                     ) -> "Pending":
        """Send a copy of ``header`` with a req_id of ours and return at once; ``Pending.result`` waits.
        ``payload``: an inline WRITE's bytes (``header`` has Flag.INLINE; at most ``conn.max_inline``).
        ``group``: the request is one of several the caller waits for together (``AnswerGroup``).

        Splitting the two lets a leader send forwards in a fixed order and wait for the acks later."""
        calls = self._calls
        if calls.dead:
            raise ConnectionClosed(f"{self.conn.peer}: {calls.dead}")
        p = Pending(self, timeout, group)
        try:
            if not calls.take():               # the common case: a credit is free, no timer needed
                await self._credit(timeout)
            try:
                p.grant, header = await _grant(self.conn, header)    # before the send: the peer may fetch at once
                rid = calls.send(p, trio.current_time())
                watch = self._watch
                if watch is not None:
                    wake = p.deadline if self.clock is None else min(p.deadline, p.sent + self._silence / 2)
                    if wake < watch.deadline:
                        watch.deadline = wake    # run() wakes for it (no wake-up now: trio's deadline heap)
                raw = header.encode(req_id=rid, version=self.conn.version)      # the connection's version
                sent = await self.conn.send_within(timeout, raw, payload)
            except BaseException:
                await self._release(p)
                raise
            if not sent:
                await self._release(p)
                await self._timed_out(timeout)
            return p
        except BaseException:
            p.answered.set()          # never on its way: not an answer its group waits for
            raise

    async def _credit(self, timeout: float) -> None:
        """Until a credit is ours: the link times out if none comes within ``timeout``."""
        calls = self._calls
        came = trio.Event()
        calls.queue(came)
        try:
            with trio.move_on_after(timeout):
                await came.wait()
        except BaseException:
            if calls.withdraw(came):          # it came just as the wait was given up: back it goes
                self._wake(calls.give())
            raise
        if not calls.withdraw(came):
            await self._timed_out(timeout)

    async def _release(self, p: "Pending") -> None:
        """Done with a request (its caller took the outcome or gave up, or it never went out): its grant revoked
        -- settled: the caller frees the buffer next -- and its credit back."""
        self.conn.grants.drop(p.grant)
        self._wake(self._calls.finish(p))
        await self._settle(p.grant)

    async def _settle(self, token) -> None:
        """Wait (shielded: the caller frees the buffer next) until a dropped grant is unusable."""
        if token is not None:
            with trio.CancelScope(shield=True):
                await self.conn.grants.settle(token)

    async def call(self, header: Header, timeout: float) -> Header:
        """Send ``header`` and return the matching response."""
        p = await self.submit(header, timeout)
        return await p.result()

    async def _timed_out(self, timeout: float):
        self._fail(f"request timed out after {timeout}s")
        await self.conn.aclose()
        raise RequestTimeout(f"{self.conn.peer} did not answer within {timeout}s")


class _Probe(Call):
    """A liveness probe (``Requester._probe``): nobody waits for its answer; it only ends the silence."""

    __slots__ = ("answered",)

    def __init__(self, deadline: float, timeout: float):
        super().__init__(deadline, timeout)
        self.answered = trio.Event()


class AnswerGroup(FanIn):
    """Requests (on any links) whose answers one task waits for together -- a leader's forwards of one
    write: its ``Pending.result`` calls wake it once, when the last answer is in (or the requests ended
    otherwise), not once per answer as it lands.  The answers of a fan-out often land in different passes of
    the loop, and each wake-up would be a task step of the leader's handler.  ``seal`` once
    every request of the group is submitted (an answer may land before the next request is)."""

    __slots__ = ("all_in",)

    def __init__(self) -> None:
        super().__init__()
        self.all_in = trio.Event()

    def seal(self) -> None:
        if super().seal():
            self.all_in.set()


class _Answered:
    """A grouped request's "answered" flag (an ``Event``'s ``set``/``is_set``/``wait``): set on its own,
    waited for with the rest of its ``AnswerGroup``."""

    __slots__ = ("group", "done")

    def __init__(self, group: AnswerGroup) -> None:
        self.group, self.done = group, False
        group.join()

    def set(self) -> None:
        if not self.done:
            self.done = True
            if self.group.answered():
                self.group.all_in.set()

    def is_set(self) -> bool:
        return self.done

    async def wait(self) -> None:
        if not self.done:
            await self.group.all_in.wait()


class Pending(Call):
    """A request sent (``Requester.submit``): ``await result()`` for its answer."""

    __slots__ = ("requester", "answered")

    def __init__(self, requester: Requester, timeout: float, group: AnswerGroup | None = None):
        super().__init__(trio.current_time() + timeout, timeout)
        self.requester = requester
        self.answered = trio.Event() if group is None else _Answered(group)   # set once the call ended

    async def result(self) -> Header:
        r = self.requester
        answered = self.answered
        try:
            # already answered: no checkpoint (a leader collects its followers' acks after its own flush,
            # when they have mostly come; a scheduler pass per ack was a large share of its per-request calls)
            if not answered.is_set():
                try:
                    await answered.wait()        # set by the answer, the link's end, or run() at the deadline
                except trio.Cancelled:
                    # the caller gave up on a request the peer may be serving right now: let it finish with
                    # our buffer for a moment before the grant goes (on verbs a window revoked under the
                    # peer's RDMA op breaks the whole connection: every other request on it fails too).  A
                    # request that exposes no buffer of ours has nothing to finish with: it goes at once
                    if self.grant is not None:
                        with trio.CancelScope(shield=True):
                            with trio.move_on_at(min(self.deadline, trio.current_time() + ABANDON_GRACE)):
                                await answered.wait()
                    raise
        finally:
            if not self.finished:
                await r._release(self)          # the buffer is the caller's again only once revoked
        resp = self.answer
        if resp is LATE:
            raise RequestTimeout(f"{r.conn.peer} did not answer within {self.timeout}s")
        if resp is SILENT:
            raise PeerSilent(f"{r.conn.peer}: {r._calls.dead}")
        if resp is None:
            raise ConnectionClosed(f"{r.conn.peer}: {r._calls.dead or 'connection closed'}")
        return resp


class Redial:
    """The pauses between dials of a hello the node did not admit: exponential from ``FIRST`` up to ``CAP``
    seconds, each drawn between half and all of it (jitter: callers turned away together do not come back
    together)."""
    FIRST = 0.02
    CAP = 1.0
    LEAST = 0.25        # no dial with less time left than this: it could only time out

    def __init__(self, rand=random.random) -> None:
        self.rand = rand
        self.tries = 1
        self._step = self.FIRST

    def next(self) -> float:
        """The pause before the next dial."""
        pause = self._step * (0.5 + self.rand() / 2)
        self._step = min(self.CAP, self._step * 2)
        self.tries += 1
        return pause


class Links:
    """Lazily dialed, reused request channels to other nodes, each living in ``nursery`` until it dies.

    Used by a leader for its followers and by the client SDK for the datanodes it talks to."""

    def __init__(self, nursery: trio.Nursery, domain, *, transport: str, slots: int, connect_timeout: float,
                 on_conn=None, auth=None, source: str = ""):
        self._nursery = nursery
        self._source = source              # the local address every dial binds to (empty: the kernel's choice)
        self._domain = domain
        self._transport = transport
        self._slots = slots
        self._timeout = connect_timeout
        self._on_conn = on_conn            # callback(conn, opened: bool), e.g. for node status
        self._auth = auth                  # auth.DialAuth: the credentials and role presented in every hello
        self._links: dict[str, Requester] = {}
        self._locks: dict[str, trio.Lock] = {}
        self.clocks: dict[str, PeerClock] = {}     # per address: its answer times, across reconnections
        self._failed: dict[str, tuple[float, TransportError]] = {}    # per address: its last failed dial

    def suspect(self, addr: str) -> bool:
        """Was ``addr`` given up on for silence, and has it not answered since?"""
        clock = self.clocks.get(addr)
        return clock is not None and clock.suspect

    async def get(self, addr: str) -> Requester:
        req = self._links.get(addr)
        if req is not None and req.alive:
            return req
        asked = trio.current_time()
        async with self._locks.setdefault(addr, trio.Lock()):
            req = self._links.get(addr)
            if req is None or not req.alive:
                failed = self._failed.get(addr)
                if failed is not None and failed[0] >= asked:
                    # a dial that ended while we waited for our turn failed: ours would too (a peer that takes
                    # connections but never says hello would cost every caller the whole timeout in turn)
                    raise type(failed[1])(str(failed[1]))
                clock = self.clocks.setdefault(addr, PeerClock())
                if clock.quiet(trio.current_time()):
                    raise PeerSilent(f"{addr} stopped answering: not dialed again for another "
                                     f"{clock.quiet_until - trio.current_time():.1f}s")
                host, _, port = addr.rpartition(":")
                try:
                    req = await self._dial(host, int(port), clock, trio.current_time() + self._timeout)
                except TransportError as e:
                    self._failed[addr] = (trio.current_time(), e)
                    clock.dial_failed(trio.current_time())
                    raise
                self._failed.pop(addr, None)
                self._links[addr] = req
            return req

    async def _dial(self, host: str, port: int, clock: PeerClock, deadline: float) -> Requester:
        """A running link to ``host:port``, dialed again -- after a backoff with jitter (``Redial``) -- while
        the node closes the hello before it completes or says "too many connections" (``NotAdmitted``: its
        pre-auth budget under a flood, nothing about our credentials), until ``deadline``.  Any other failure
        (a refused connection, an authentication refusal) is raised at once."""
        from .transport.connect import NotAdmitted
        redial = Redial()
        while True:
            try:
                return await self._nursery.start(self._run, host, port, clock,
                                                 max(0.0, deadline - trio.current_time()))
            except NotAdmitted as e:
                pause = redial.next()
                if trio.current_time() + pause + Redial.LEAST >= deadline:
                    raise NotAdmitted(f"{e} (dialed {redial.tries} times)") from None
                log.debug("%s:%s: %s; dialing again in %.2fs", host, port, e, pause)
                await trio.sleep(pause)

    async def _run(self, host: str, port: int, clock: PeerClock, timeout: float,
                   task_status=trio.TASK_STATUS_IGNORED) -> None:
        from .transport.connect import dial
        started = False
        # a peer given up on for silence may still take connections (its kernel does) and never say hello
        timeout = min(timeout, clock.limit(backoff=False)) if clock.suspect else timeout

        def _started(value):
            nonlocal started
            started = True
            task_status.started(value)

        try:
            async with dial(host, port, self._domain, transport=self._transport, slots=self._slots,
                            timeout=timeout, auth=self._auth, source=self._source) as conn:
                req = Requester(conn, clock)
                if self._on_conn:
                    self._on_conn(conn, True)
                try:
                    req_status = type("S", (), {"started": staticmethod(_started)})
                    await req.run(task_status=req_status)
                finally:
                    if self._on_conn:
                        self._on_conn(conn, False)
        except TransportError as e:
            if not started:
                raise                      # the caller of get() sees why it could not connect
            log.debug("link to %s:%s ended: %s", host, port, e)
