"""The rules of an extent's lane as plain state: whose turn it is, and where the extent ends while writes are out.

Tickets are taken in arrival order and turns go in ticket order; a ticket ended before its turn is skipped
when its turn comes.  One exception: a ticket whose request is still *fetching* its payload (a one-sided READ
from the peer's memory) is passed by the tickets of other connections -- a peer that never serves that READ
must not hold the extent for everyone behind it -- while its own connection's later tickets keep waiting
behind it (a client's pipelined appends stay in its order).  Once fetched, it waits for the turn as usual.

An append may hand its local write over (``handed``) and end its turn before the write is back: the next
append then checks its offset against ``tail``.  Any other turn (``settle``) begins only once no handed-over
write is out, so there the store's own size is the extent's end.  No waiting here: ``partition.ExtentLane``
parks the tasks and wakes the ones these rules name.
"""
from __future__ import annotations

TURN = "turn"        # blocker: an earlier ticket holds the turn or has yet to take it
WRITES = "writes"    # blocker: a settling turn waits until no handed-over write is out


class LaneState:
    __slots__ = ("diverged", "issued", "serving", "_skipped", "writing", "tail", "held", "_fetching", "_owners")

    def __init__(self, diverged: str | None = None) -> None:
        self.diverged = diverged     # why appends are refused (replicas may differ), or None
        self.issued = 0              # tickets taken so far
        self.serving = 0             # the oldest ticket not ended: its turn, unless it is fetching
        self._skipped: set[int] = set()   # tickets ended before ``serving`` reached them
        self.writing = 0             # local writes handed over and not back yet
        self.tail: int | None = None  # where the extent ends once they are back (None while none is out)
        self.held: int | None = None  # the ticket in its turn (``begin``), if any
        self._fetching: dict[int, object] = {}   # ticket -> its owner: still fetching its payload
        self._owners: dict[int, object] = {}     # ticket -> its owner, for those taken behind a fetching one

    def ticket(self, owner: object = None, fetching: bool = False) -> int:
        """Taken when a request arrives (arrival order is turn order); every ticket must end with ``done``
        (also on failure).  ``owner``: its connection; ``fetching``: its payload is still to be fetched
        (``fetched`` once it is in hand): until then other owners' tickets pass it."""
        t = self.issued
        self.issued += 1
        if fetching:
            self._fetching[t] = owner
        if self._fetching:
            self._owners[t] = owner
        return t

    def fetched(self, ticket: int) -> None:
        """``ticket``'s payload is in hand: from now on it waits for its turn, and nobody passes it.  (No
        one's turn may begin because of that: no wake-up.)"""
        if self._fetching:
            self._fetching.pop(ticket, None)

    def _next(self) -> int | None:
        """The ticket whose turn may begin next: the oldest not ended, passing fetching tickets and, behind
        one, later tickets of the same owner; None: none may.  Every ticket taken behind a fetching one is in
        ``_owners`` until it ends, so this looks at the tickets in flight only, however many have passed."""
        if self.serving not in self._fetching:
            return self.serving
        blocked = set()
        for u, owner in self._owners.items():
            if u in self._fetching or id(owner) in blocked:
                blocked.add(id(owner))
                continue
            return u
        return None

    def begin(self, ticket: int) -> None:
        """``ticket``'s turn begins (``blocker`` said it may)."""
        self.held = ticket

    def up(self, ticket: int) -> bool:
        """It is ``ticket``'s turn and no handed-over write is out: an append holding it may be done right
        away, with no turn to wait for (``DataOps.append_now``)."""
        if self.writing or (self.held is not None and self.held != ticket):
            return False
        return ticket == self.serving if not self._fetching else ticket == self._next()

    def newest(self, ticket: int) -> bool:
        """No ticket was taken after ``ticket``."""
        return self.issued == ticket + 1

    def blocker(self, ticket: int, settle: bool) -> str | None:
        """What ``ticket``'s turn waits for (``TURN`` or ``WRITES``), or None: it may begin now."""
        if self.held is not None and self.held != ticket:
            return TURN
        if ticket != self.serving and (not self._fetching or ticket != self._next()):
            return TURN
        if settle and self.writing:
            return WRITES
        return None

    def done(self, ticket: int) -> int | None:
        """``ticket``'s turn is over (or it ended before its turn: it is skipped then).  Idempotent.  Returns
        the ticket whose turn begins now -- its waiter is to be woken --, or None if the turn did not move."""
        if ticket < self.serving or ticket in self._skipped:
            return None
        if self.held == ticket:
            self.held = None
        passing = bool(self._owners)        # tickets were taken behind a fetching one: turns may go out of order
        if passing:
            self._fetching.pop(ticket, None)
            self._owners.pop(ticket, None)
        if ticket > self.serving:
            self._skipped.add(ticket)
            return self._next() if passing and self.held is None else None
        nxt = ticket + 1
        while nxt in self._skipped:
            self._skipped.discard(nxt)
            nxt += 1
        self.serving = nxt
        if self.held is not None:
            return None
        return nxt if nxt not in self._fetching else self._next()

    def handed(self, end: int) -> None:
        """In an append's turn: its local write, which ends the extent at ``end``, is handed over."""
        self.writing += 1
        self.tail = end

    def back(self) -> bool:
        """A handed-over write is back (done or failed).  True if none is out any more: settling turns may
        begin."""
        if not self.writing:
            raise RuntimeError("no handed-over write of the extent is out")
        self.writing -= 1
        if self.writing:
            return False
        self.tail = None
        return True

    def seal(self, why: str) -> bool:
        """Refuse appends from now on; the first reason is kept.  True if this sealed it."""
        if self.diverged:
            return False
        self.diverged = why
        return True
