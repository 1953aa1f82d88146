"""Small helpers for trio code: a nursery whose single failure surfaces as itself, and the rule for when
blocking work may run right in the event loop."""
from __future__ import annotations

import time
from contextlib import asynccontextmanager
from typing import AsyncIterator

import trio


def leaves(exc: BaseException):
    """The exceptions inside (nested) exception groups, in order."""
    if isinstance(exc, BaseExceptionGroup):
        for e in exc.exceptions:
            yield from leaves(e)
    else:
        yield exc


@asynccontextmanager
async def nursery() -> AsyncIterator[trio.Nursery]:
    """``trio.open_nursery()`` whose single failure surfaces as itself, not as a one-item ExceptionGroup,
    so callers can ``except ClientError`` as usual.  Several distinct failures stay grouped."""
    try:
        async with trio.open_nursery() as n:
            yield n
    except BaseExceptionGroup as eg:
        found = list(leaves(eg))
        real = [e for e in found if not isinstance(e, trio.Cancelled)]
        if len(real) == 1:
            raise real[0] from None
        if not real and found:
            raise found[0] from None
        raise


class InlinePause:
    """The rule for blocking work done right in the event loop instead of in a worker thread (a flush, a
    SQLite transaction: the thread's hand-over can cost more than the work): allowed unless a call done so
    took longer than ``slow`` seconds, which sends the next ``pause`` seconds' calls to the thread -- so a
    slow disk stalls the loop at most once per pause.  It cannot help against a call that hangs."""

    __slots__ = ("slow", "pause", "_until")

    def __init__(self, slow: float = 0.005, pause: float = 1.0) -> None:
        self.slow, self.pause = slow, pause
        self._until = 0.0         # monotonic time before which no call runs inline

    def allowed(self, now: float) -> bool:
        """May a call start inline at ``now`` (``time.monotonic()``)?"""
        return now >= self._until

    def took(self, started: float) -> bool:
        """An inline call that started at ``started`` has ended; True if it was slow (the pause began)."""
        now = time.monotonic()
        if now - started <= self.slow:
            return False
        self._until = now + self.pause
        return True

    def hold(self) -> None:
        """No call inline from now on (a test's way to the thread path)."""
        self._until = float("inf")
