"""Requests and responses over one connection, from the requester's side.

``Requester`` gives each request an id, keeps at most ``conn.slots`` requests outstanding (the peer's
preposted control slots: the credit rule), matches each response to its request and fails everything in
flight, promptly, when the connection dies.  A request that times out poisons the connection (its late
answer would otherwise land in a slot we no longer account for) so the caller drops it and reconnects.

A request that names a buffer of ours (``addr/rkey/rlen``) grants the connection's peer exactly that range
(read for a payload or body it fetches, write for an answer it pushes) while the request is in flight: the
grant is revoked when the answer arrives, the request times out or the connection dies
(``transport.base.Grants``) -- a request its caller cancels first waits up to ``ABANDON_GRACE`` for its
answer, shielded, so the peer is not cut off in the middle of moving its bytes --, and ``Pending.result``
returns only once the revocation took effect (on verbs
the window's local invalidation completed), so the caller may reuse the buffer at once.  On verbs the grant
is a type-2 memory window bound on this connection's queue pair, and the header sent carries the window's
rkey in place of the region's.  So a follower can READ a leader's pool block only while the leader waits for
that follower's ack of the forward naming it.
"""
from __future__ import annotations

import itertools
import logging
import math

import trio

from .protocol import BODY_OPS, Header, Op, ProtocolError, decode
from .transport.base import Access, Connection, ConnectionClosed, TransportError

log = logging.getLogger(__name__)


class RequestTimeout(TransportError):
    pass


_LATE = object()     # a request's answer slot once its deadline passed unanswered (Requester._expire)


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
    def __init__(self, conn: Connection):
        self.conn = conn
        self._credits = trio.Semaphore(max(1, conn.slots))
        self._ids = itertools.count(1)
        self._waiting: dict[int, list] = {}     # req_id -> Pending.slot
        self._dead: str | None = None
        self._watch: trio.CancelScope | None = None   # run()'s wait: its deadline is the earliest request's

    @property
    def alive(self) -> bool:
        return self._dead is None

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Matches responses to their requests until the connection ends: each answer is handled right in
        the transport's task as it lands (``Connection.deliver_to``: no task switch per answer).  And keeps
        the requests' deadlines: this task's wait ends at the earliest one (``submit`` moves it earlier when
        it must), so a request waiting for its answer needs no timer of its own -- a cancel scope per request
        was a tenth of a client's CPU per 4 KiB append."""
        self.conn.deliver_to(self._answer)
        task_status.started(self)
        try:
            while True:
                with trio.CancelScope(deadline=self._earliest()) as self._watch:
                    self._answer(await self.conn.recv())      # only what landed before deliver_to
                    continue
                if self._expire(trio.current_time()):
                    await self.conn.aclose()
                    return
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
        slot = self._waiting.pop(resp.req_id, None)
        if slot is None:
            log.debug("late response req=%s from %s dropped", resp.req_id, self.conn.peer)
            return True
        self.conn.grants.drop(slot[2])     # answered: the peer is done with our buffer
        slot[1] = resp
        slot[0].set()
        return True

    def _fail(self, why: str) -> None:
        if self._dead is None:
            self._dead = why
        for ev, _, token, *_ in self._waiting.values():
            self.conn.grants.drop(token)
            ev.set()
        self._waiting.clear()

    def _earliest(self) -> float:
        return min([slot[3] for slot in self._waiting.values()], default=math.inf)

    def _expire(self, now: float) -> bool:
        """Requests past their deadline: each gets RequestTimeout, the link is failed for every other one
        (a late answer could land in a slot nobody accounts for any more).  True if there were any."""
        late = [slot for slot in self._waiting.values() if slot[3] <= now]
        for slot in late:
            slot[1] = _LATE
        if late:
            self._fail(f"a request timed out after {late[0][4]}s")
        return bool(late)

    async def submit(self, header: Header, timeout: float, payload=None, *, group: "AnswerGroup | None" = None
                     ) -> "Pending":
        """Send a copy of ``header`` with a req_id of ours and return at once; ``Pending.result`` waits.
        ``payload``: an inline WRITE's bytes (``header`` has Flag.INLINE; at most ``conn.max_inline``).
        ``group``: the request is one of several the caller waits for together (``AnswerGroup``).

        Splitting the two lets a leader send forwards in a fixed order and wait for the acks later."""
        if self._dead:
            raise ConnectionClosed(f"{self.conn.peer}: {self._dead}")
        p = Pending(self, timeout, group)
        try:
            try:
                self._credits.acquire_nowait()         # the common case: a credit is free, no timer needed
            except trio.WouldBlock:
                with trio.move_on_after(timeout) as scope:
                    await self._credits.acquire()
                if scope.cancelled_caught:
                    await self._timed_out(timeout)
            p.req_id = rid = next(self._ids)
            try:
                p.slot[2], header = await _grant(self.conn, header)    # before the send: the peer may fetch at once
            except BaseException:
                self._credits.release()
                raise
            self._waiting[rid] = p.slot
            watch = self._watch
            if watch is not None and p.deadline < watch.deadline:
                watch.deadline = p.deadline          # run() wakes for it (no wake-up now: trio's deadline heap)
            try:
                sent = await self.conn.send_within(timeout, header.encode(req_id=rid), payload)
            except BaseException:
                self._waiting.pop(rid, None)
                self.conn.grants.drop(p.slot[2])
                self._credits.release()
                await self._settle(p.slot[2])
                raise
            if not sent:
                self.conn.grants.drop(p.slot[2])
                self._credits.release()
                await self._settle(p.slot[2])
                await self._timed_out(timeout)
            return p
        except BaseException:
            p.slot[0].set()          # never on its way: not an answer its group waits for
            raise

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


class AnswerGroup:
    """Requests (on any links) whose answers one task waits for together -- a leader's forwards of one
    write: its ``Pending.result`` calls wake it once, when the last answer is in (or the requests ended
    otherwise), not once per answer as it lands.  The answers of a fan-out land in different passes of the
    loop about half the time at depth 1; each wake-up was a task step of the leader's handler.  ``seal`` once
    every request of the group is submitted (an answer may land before the next request is)."""

    __slots__ = ("left", "sealed", "all_in")

    def __init__(self) -> None:
        self.left = 0                # requests of the group not answered yet
        self.sealed = False          # no more requests join
        self.all_in = trio.Event()

    def seal(self) -> None:
        self.sealed = True
        if not self.left:
            self.all_in.set()


class _Answered:
    """A grouped request's "answered" flag (an ``Event``'s ``set``/``is_set``/``wait``): set on its own,
    waited for with the rest of its ``AnswerGroup``."""

    __slots__ = ("group", "done")

    def __init__(self, group: AnswerGroup) -> None:
        self.group, self.done = group, False
        group.left += 1

    def set(self) -> None:
        if not self.done:
            self.done = True
            g = self.group
            g.left -= 1
            if not g.left and g.sealed:
                g.all_in.set()

    def is_set(self) -> bool:
        return self.done

    async def wait(self) -> None:
        if not self.done:
            await self.group.all_in.wait()


class Pending:
    def __init__(self, requester: Requester, timeout: float, group: AnswerGroup | None = None):
        self.requester = requester
        self.deadline = trio.current_time() + timeout
        self.timeout = timeout
        # answered, the answer (_LATE: the deadline passed), our grant to the peer, the deadline, the timeout
        self.slot = [trio.Event() if group is None else _Answered(group), None, None, self.deadline, timeout]
        self.req_id = 0
        self._done = False

    async def result(self) -> Header:
        r = self.requester
        answered = self.slot[0]
        try:
            # already answered: no checkpoint (a leader collects its followers' acks after its own flush,
            # when they have mostly come; a scheduler pass per ack was ~10% of its per-request calls)
            if not answered.is_set():
                try:
                    await answered.wait()        # set by the answer, the link's end, or run() at the deadline
                except trio.Cancelled:
                    # the caller gave up on a request the peer may be serving right now: let it finish with
                    # our buffer for a moment before the grant goes (on verbs a window revoked under the
                    # peer's RDMA op breaks the whole connection: every other request on it fails too)
                    with trio.CancelScope(shield=True):
                        with trio.move_on_at(min(self.deadline, trio.current_time() + ABANDON_GRACE)):
                            await answered.wait()
                    raise
        finally:
            if not self._done:
                self._done = True
                r._waiting.pop(self.req_id, None)
                r.conn.grants.drop(self.slot[2])
                r._credits.release()
                await r._settle(self.slot[2])     # the buffer is the caller's again only once revoked
        resp = self.slot[1]
        if resp is _LATE:
            raise RequestTimeout(f"{r.conn.peer} did not answer within {self.timeout}s")
        if resp is None:
            raise ConnectionClosed(f"{r.conn.peer}: {r._dead or 'connection closed'}")
        return resp


class Links:
    """Lazily dialed, reused request channels to other nodes, each living in ``nursery`` until it dies.

    Used by a leader for its followers and by the client SDK for the datanodes it talks to."""

    def __init__(self, nursery: trio.Nursery, domain, *, transport: str, slots: int, connect_timeout: float,
                 on_conn=None, auth=None):
        self._nursery = nursery
        self._domain = domain
        self._transport = transport
        self._slots = slots
        self._timeout = connect_timeout
        self._on_conn = on_conn            # callback(conn, opened: bool), e.g. for node status
        self._auth = auth                  # auth.DialAuth: the credentials and role presented in every hello
        self._links: dict[str, Requester] = {}
        self._locks: dict[str, trio.Lock] = {}

    async def get(self, addr: str) -> Requester:
        req = self._links.get(addr)
        if req is not None and req.alive:
            return req
        async with self._locks.setdefault(addr, trio.Lock()):
            req = self._links.get(addr)
            if req is None or not req.alive:
                host, _, port = addr.rpartition(":")
                req = await self._nursery.start(self._run, host, int(port))
                self._links[addr] = req
            return req

    async def _run(self, host: str, port: int, task_status=trio.TASK_STATUS_IGNORED) -> None:
        from .transport.connect import dial
        started = False

        def _started(value):
            nonlocal started
            started = True
            task_status.started(value)

        try:
            async with dial(host, port, self._domain, transport=self._transport, slots=self._slots,
                            timeout=self._timeout, auth=self._auth) as conn:
                req = Requester(conn)
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
