"""A cheaper read of each FUSE request in pyfuse3's request loop.

pyfuse3's loop (its ``_session_loop``) takes a ``trio.Lock`` and then waits with
``trio.lowlevel.wait_readable`` on /dev/fuse before it reads each request: two scheduler passes (and an
epoll change) per request, even when the next request is already waiting -- which it mostly is when the
kernel keeps several in flight (tar, cp -a, rm -r, an application and its fsyncs).  A mount is bound by its
CPU per request (docs/performance.md), and those passes are a visible share of it.

:func:`install` hands pyfuse3 a lock that a task takes without a pass when nobody holds it, and a
``wait_readable`` that returns at once when the descriptor is readable already (one ``poll`` that does not
wait).  It still lets the other tasks run once a millisecond (``wire.aio.InlinePause.yield_due``), so a
stream of requests cannot starve the flushes, the deletion queue or the timers.  It works by replacing the
``trio`` module pyfuse3 sees (everything else passes through), so it is done only for the pyfuse3 versions
whose loop is known to make exactly these two calls; any other runs as it comes.  Its right home is
pyfuse3's loop itself.
"""
from __future__ import annotations

import logging
import select
import time

import pyfuse3
import trio

from wire.aio import InlinePause

log = logging.getLogger(__name__)

KNOWN = ("3.3.", "3.4.", "3.5.")     # pyfuse3 releases whose loop reads requests as described above


class ReadLock:
    """``async with`` exclusion like ``trio.Lock``, without a scheduler pass when it is free; waiters are
    served in order, and a cancelled waiter leaves it as it was."""

    def __init__(self) -> None:
        self._held = False
        self._lot = trio.lowlevel.ParkingLot()

    async def __aenter__(self) -> None:
        if self._held:
            await self._lot.park()          # woken with the lock handed over (see __aexit__)
        else:
            self._held = True

    async def __aexit__(self, *exc) -> None:
        if self._lot:
            self._lot.unpark()              # handed straight to the next waiter: nobody can slip in between
        else:
            self._held = False


class Reads:
    """The ``trio.lowlevel`` pyfuse3 sees: ``wait_readable`` returns at once for a readable descriptor
    (counted in ``at_once``; ``waited``: it had to wait, or it was the others' turn)."""

    def __init__(self) -> None:
        self.turns = InlinePause()
        self.at_once = 0
        self.waited = 0
        self._polls: dict[int, select.poll] = {}

    def __getattr__(self, name):
        return getattr(trio.lowlevel, name)

    async def wait_readable(self, fd) -> None:
        p = self._polls.get(fd)
        if p is None:
            p = self._polls[fd] = select.poll()
            p.register(fd, select.POLLIN)
        if not self.turns.yield_due(time.monotonic()) and p.poll(0):
            self.at_once += 1
            return
        self.waited += 1
        await trio.lowlevel.wait_readable(fd)

    def stats(self) -> dict:
        return {"at_once": self.at_once, "waited": self.waited}


class _Trio:
    """The ``trio`` module as pyfuse3 sees it: ``Lock`` and ``lowlevel`` replaced, the rest trio's own."""

    Lock = ReadLock

    def __init__(self, reads: Reads) -> None:
        self.lowlevel = reads

    def __getattr__(self, name):
        return getattr(trio, name)


def install() -> Reads | None:
    """Give pyfuse3's loop the cheaper read (before ``pyfuse3.main``); returns its counters, or None for a
    pyfuse3 this was not made for (it then runs unchanged)."""
    seen = getattr(pyfuse3, "trio", None)
    if isinstance(seen, _Trio):
        return seen.lowlevel
    version = getattr(pyfuse3, "__version__", "?")
    if seen is not trio or not hasattr(pyfuse3, "_wait_fuse_readable") or not version.startswith(KNOWN):
        log.info("pyfuse3 %s: its own request loop (the cheaper read is made for %s)", version,
                 ", ".join(v + "x" for v in KNOWN))
        return None
    reads = Reads()
    pyfuse3.trio = _Trio(reads)
    return reads
