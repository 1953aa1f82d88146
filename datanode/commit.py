"""Group commit: one flush makes every append made before it durable, however many there were.

Under ``sync = always`` a write handler appends its bytes to the extent file (``ExtentStore.append``:
pwrite, no sync -- for a small payload right in the event loop, no thread hop) and then waits in
``GroupCommit.durable`` until its end is durable.  One flusher task per node takes every extent that has a
waiter, runs ``ExtentStore.flush`` for all of them in one worker thread (per extent: fdatasync data, write
the CRC entries, fdatasync them -- the order of datanode/store.py), and wakes every waiter of that batch at
once.  Appends that arrive while a flush runs wait for the next one, so under load each flush covers all
the appends that queued behind the previous one: concurrent appends to one extent, and to other extents of
the node, share their fdatasyncs.  ``sync = always`` keeps its meaning: the handler answers only after
``durable`` returned (and, on the leader, after every follower answered the same).
"""
from __future__ import annotations

import dataclasses

import trio

from .store import ExtentStore, StoreError


@dataclasses.dataclass(eq=False)
class _Batch:
    want: dict = dataclasses.field(default_factory=dict)      # store -> {extent ids}
    failed: dict = dataclasses.field(default_factory=dict)    # (store, extent) -> StoreError
    done: trio.Event = dataclasses.field(default_factory=trio.Event)


@dataclasses.dataclass
class CommitCounters:
    flushes: int = 0            # flusher rounds (each: one worker-thread call)
    flushed_extents: int = 0    # extent flushes done (each: two fdatasyncs)
    commit_waits: int = 0       # appends that waited for a flush


class GroupCommit:
    def __init__(self) -> None:
        self._batch = _Batch()
        self._wake = trio.Event()
        self.counters = CommitCounters()

    async def durable(self, store: ExtentStore, extent: int, end: int) -> None:
        """Return once ``[0, end)`` of ``extent`` is durable (StoreError if its flush failed)."""
        if store.durable_size(extent) >= end:
            return
        b = self._batch
        b.want.setdefault(store, set()).add(extent)
        self.counters.commit_waits += 1
        self._wake.set()
        await b.done.wait()
        err = b.failed.get((store, extent))
        if err is not None:
            raise err

    async def run(self) -> None:
        """The flusher (one per node; runs in the node's nursery until it ends)."""
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            batch, self._batch = self._batch, _Batch()
            batch.failed = await trio.to_thread.run_sync(_flush_all, batch.want)
            self.counters.flushes += 1
            self.counters.flushed_extents += sum(len(v) for v in batch.want.values())
            batch.done.set()


def _flush_all(want: dict) -> dict:
    failed = {}
    for store, extents in want.items():
        try:
            for eid, err in store.flush(sorted(extents)).items():
                failed[(store, eid)] = err
        except StoreError as e:            # pragma: no cover - flush reports per extent
            for eid in extents:
                failed[(store, eid)] = e
    return failed
