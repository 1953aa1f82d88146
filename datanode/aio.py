"""Small structured-concurrency helpers."""
from __future__ import annotations

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
