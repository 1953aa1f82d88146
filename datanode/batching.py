"""Group commit's batching as plain state: which appends wait for which flush, and when a flush may start.

An append that must wait for durability joins the batch *gathering*; when no flush is out, that batch is
handed to the flusher at once, otherwise it starts as soon as the flush out comes back.  So at most one flush
is out at a time, every batch starts after each of its waiters joined (their appends were made before: the
flush covers them), and a flush's result -- its failures per extent -- is what every waiter of its batch
sees.  No threads and no waiting here: ``commit.GroupCommit`` runs the flushes and wakes the waiters.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class CommitCounters:
    flushes: int = 0            # flusher rounds (each: one worker-thread call)
    flushed_extents: int = 0    # extent flushes done (each: two fdatasyncs, or one: NODE_STATUS one_flushes)
    commit_waits: int = 0       # appends that waited for a flush
    inline_flushes: int = 0     # flushes run in the event loop (the only request in flight)
    slow_inline_flushes: int = 0  # of those, slow ones (the next while's went to the thread: InlinePause)


class Batch:
    """The appends that one flush makes durable."""

    __slots__ = ("want", "failed", "waiters", "wake")

    def __init__(self) -> None:
        self.want: dict = {}         # store -> {extent ids}
        self.failed: dict = {}       # (store, extent) -> the error its flush ended with
        self.waiters = 0             # appends waiting for this flush
        self.wake = None             # the driver's way to wake the waiters (GroupCommit: a trio.Event)

    def error(self, store, extent: int):
        """What the flush of ``extent`` of ``store`` ended with: its error, or None (durable)."""
        return self.failed.get((store, extent))


class Batches:
    __slots__ = ("gathering", "flushing", "counters")

    def __init__(self) -> None:
        self.gathering = Batch()                 # the appends waiting for the next flush
        self.flushing: Batch | None = None       # the flush out now
        self.counters = CommitCounters()

    def idle(self) -> bool:
        """No flush is out and nobody waits for the next: a flush now would be shared with nobody."""
        return self.flushing is None and not self.gathering.want

    def join(self, store, extent: int) -> tuple[Batch, Batch | None]:
        """An append to ``extent`` waits until it is durable: (the batch whose flush it waits for, the batch to
        hand to the flusher now -- or None: a flush is out, the next starts once it is back)."""
        b = self.gathering
        b.want.setdefault(store, set()).add(extent)
        b.waiters += 1
        self.counters.commit_waits += 1
        return b, (self._start() if self.flushing is None else None)

    def flushed(self, batch: Batch, failed: dict) -> Batch | None:
        """The flush out (``batch``) is back with ``failed``: returns the batch to hand to the flusher next, if
        appends gathered meanwhile."""
        if batch is not self.flushing:
            raise RuntimeError("a flush came back that is not the one out")
        batch.failed = failed
        self.counters.flushes += 1
        self.counters.flushed_extents += sum(len(v) for v in batch.want.values())
        self.flushing = None
        return self._start() if self.gathering.want else None

    def flushed_here(self) -> None:
        """A lone append's flush runs right in the event loop, outside any batch."""
        c = self.counters
        c.commit_waits += 1
        c.inline_flushes += 1
        c.flushes += 1
        c.flushed_extents += 1

    def _start(self) -> Batch:
        b, self.gathering = self.gathering, Batch()
        self.flushing = b
        return b
