"""The rules of an extent's lane as plain state: whose turn it is, and where the extent ends while writes are out.

Tickets are taken in arrival order and turns go in ticket order; a ticket ended before its turn is skipped
when its turn comes.  An append may hand its local write over (``handed``) and end its turn before the write
is back: the next append then checks its offset against ``tail``.  Any other turn (``settle``) begins only
once no handed-over write is out, so there the store's own size is the extent's end.  No waiting here:
``partition.ExtentLane`` parks the tasks and wakes the ones these rules name.
"""
from __future__ import annotations

TURN = "turn"        # blocker: an earlier ticket holds the turn or has yet to take it
WRITES = "writes"    # blocker: a settling turn waits until no handed-over write is out


class LaneState:
    __slots__ = ("diverged", "issued", "serving", "_skipped", "writing", "tail")

    def __init__(self, diverged: str | None = None) -> None:
        self.diverged = diverged     # why appends are refused (replicas may differ), or None
        self.issued = 0              # tickets taken so far
        self.serving = 0             # the ticket whose turn it is
        self._skipped: set[int] = set()   # tickets ended before their turn came
        self.writing = 0             # local writes handed over and not back yet
        self.tail: int | None = None  # where the extent ends once they are back (None while none is out)

    def ticket(self) -> int:
        """Taken when a request arrives (arrival order is turn order); every ticket must end with ``done``
        (also on failure)."""
        t = self.issued
        self.issued += 1
        return t

    def up(self, ticket: int) -> bool:
        """It is ``ticket``'s turn and no handed-over write is out: an append holding it may be done right
        away, with no turn to wait for (``DataOps.append_now``)."""
        return ticket == self.serving and not self.writing

    def newest(self, ticket: int) -> bool:
        """No ticket was taken after ``ticket``."""
        return self.issued == ticket + 1

    def blocker(self, ticket: int, settle: bool) -> str | None:
        """What ``ticket``'s turn waits for (``TURN`` or ``WRITES``), or None: it may begin now."""
        if ticket != self.serving:
            return TURN
        if settle and self.writing:
            return WRITES
        return None

    def done(self, ticket: int) -> int | None:
        """``ticket``'s turn is over (or it ended before its turn: it is skipped then).  Idempotent.  Returns
        the ticket whose turn begins now -- its waiter is to be woken --, or None if the turn did not move."""
        if ticket < self.serving:
            return None
        if ticket > self.serving:
            self._skipped.add(ticket)
            return None
        nxt = ticket + 1
        while nxt in self._skipped:
            self._skipped.discard(nxt)
            nxt += 1
        self.serving = nxt
        return nxt

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
