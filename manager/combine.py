"""Requests that arrive together, sent together: the active manager's per-partition steps (a view's CAS in
etcd, its install on a node) run as one task per partition, and a failover starts hundreds at once.  A
``Combiner`` lets each task ask for its own item and sends the items waiting for the same destination in
one request (``send_many``), at most ``max_batch`` at a time and ``senders`` requests under way per
destination.

No caller waits for a timer: the first item for a destination goes at once (alone), and the ones that arrive
while it is under way go in the next request.  The callers take turns sending: each sends batches (its own
and others') until its own is answered, so no task outlives them and a cancelled sender fails only the
items of the batch it was sending (with the cancellation's cause), never strands the others.
"""
from __future__ import annotations

from typing import Awaitable, Callable, Hashable

import trio


class _Item:
    __slots__ = ("value", "done", "result", "error")

    def __init__(self, value):
        self.value = value
        self.done = trio.Event()
        self.result = None
        self.error: BaseException | None = None


class Combiner:
    """``send_many(dest, values) -> results`` answers a batch: one result per value, in order; a result that
    is an exception is raised to that value's caller.  An exception it raises fails the whole batch; when the
    sender is cancelled, the batch's other callers get ``cut_short(dest)`` (never another task's Cancelled)."""

    def __init__(self, send_many: Callable[[Hashable, list], Awaitable[list]], *, max_batch: int,
                 cut_short: Callable[[Hashable], Exception], senders: int = 2):
        self.send_many = send_many
        self.cut_short = cut_short
        self.max_batch = max_batch
        self.senders = senders
        self._queue: dict[Hashable, list[_Item]] = {}
        self._sending: dict[Hashable, int] = {}
        self._moved: dict[Hashable, trio.Event] = {}     # per destination: a batch was answered
        self.requests = 0                                 # batches sent (for tests and logs)

    async def submit(self, dest: Hashable, value):
        """The result of ``value`` sent to ``dest`` in some batch (raises what its result is)."""
        item = _Item(value)
        self._queue.setdefault(dest, []).append(item)
        while not item.done.is_set():
            queue = self._queue.get(dest) or []
            if queue and self._sending.get(dest, 0) < self.senders:
                batch = queue[:self.max_batch]
                del queue[:self.max_batch]
                self._sending[dest] = self._sending.get(dest, 0) + 1
                try:
                    await self._send(dest, batch)
                finally:
                    self._sending[dest] -= 1
                    self._moved.pop(dest, trio.Event()).set()
            else:
                await self._moved.setdefault(dest, trio.Event()).wait()
        if not self._queue.get(dest, True):
            del self._queue[dest]
        if item.error is not None:
            raise item.error
        return item.result

    async def _send(self, dest: Hashable, batch: list[_Item]) -> None:
        self.requests += 1
        try:
            results = await self.send_many(dest, [i.value for i in batch])
            assert len(results) == len(batch), "send_many answers every value"
            for i, r in zip(batch, results):
                if isinstance(r, BaseException):
                    i.error = r
                else:
                    i.result = r
        except Exception as e:
            for i in batch:
                i.error = e
            raise
        except BaseException:
            for i in batch:
                i.error = self.cut_short(dest)
            raise
        finally:
            for i in batch:
                i.done.set()
