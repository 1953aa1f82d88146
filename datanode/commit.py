"""Group commit: one flush makes every append made before it durable, however many there were.

Under ``sync = always`` a write handler appends its bytes to the extent file (``ExtentStore.append``:
pwrite, no sync -- for a small payload right in the event loop, no thread hop) and then waits in
``GroupCommit.durable`` until its end is durable.  When no flush is running, the first waiter hands every
extent that has a waiter to the node's flusher thread, which runs ``ExtentStore.flush`` for all of them (per
extent: fdatasync data, write the CRC entries, fdatasync them -- the order of datanode/store.py); its result
wakes every waiter of that batch at once and starts the next batch, if one gathered meanwhile.  Appends that
arrive while a flush runs wait for the next one, so under load each flush covers all the appends that queued
behind the previous one: concurrent appends to one extent, and to other extents of the node, share their
fdatasyncs.  ``sync = always`` keeps its meaning: the handler answers only after ``durable`` returned (and,
on the leader, after every follower answered the same).  Which append waits for which flush is
``batching.Batches``'s to say; this module runs the flushes and wakes the waiters.

A batch's extents are flushed side by side, each in a thread of the flusher's pool (up to ``FLUSH_THREADS``
at once), not one after another: every extent flush ends in a cache flush of the device, and concurrent ones
share it (the block layer merges them; ext4 groups their journal commits), while in a row each pays its own --
eight writers to eight extents took eight flushes' time per batch, and each of their acknowledgements waited
for all of them.

The flusher is one OS thread of its own, fed through a queue, handing each result back with
``TrioToken.run_sync_soon`` -- no flusher task to wake in between: at depth 1 there is a flush per write, and
``trio.to_thread.run_sync`` (a capacity limiter, the thread cache's hand-over, a context copy) plus a flusher
task cost the event loop several times what this hand-over does.

**Alone, right here.**  When the waiter is the only request the node has in flight (``quiet()``, given by the
node) and no flush is running, there is nobody to share a flush with and nothing for the event loop to do
meanwhile: the flush runs right in the event loop, without the thread's hand-over (a queue put, the thread's
wake-up, taking the GIL back, ``run_sync_soon``'s wake-up of the loop).  Nor does the loop go round after it:
the handler goes straight on to its answer (a follower's ack one pass sooner) -- and a follower's lone inline
append, flush and answer all, is done right where its forward arrives (``DataOps.append_now``, which asks
``here`` first).  A flush blocks the loop while it runs, so a flush done this way that takes longer than 5 ms
(a busy or failing disk) sends the flushes of a while back to the thread, a while in proportion to its length
(``aio.InlinePause``): slow flushes stall the loop at most 5% of the time.
"""
from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import trio

from wire.aio import InlinePause
from .batching import Batch, Batches, CommitCounters
from .store import ExtentStore, StoreError

FLUSH_THREADS = 16       # extents of one batch flushed at once (more wait for a free thread)


class GroupCommit:
    """Runs the flushes ``batching.Batches`` decides on: in the flusher thread, or right here for a lone
    request; wakes each batch's waiters with its result."""

    def __init__(self, quiet=None) -> None:
        self._batches = Batches()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._token = None
        self._quiet = quiet                  # () -> bool: this is the only request in flight (None: never)
        self.inline = InlinePause()          # when a flush may run right in the event loop

    @property
    def counters(self) -> CommitCounters:
        return self._batches.counters

    async def durable(self, store: ExtentStore, extent: int, end: int) -> None:
        """Return once ``[0, end)`` of ``extent`` is durable (StoreError if its flush failed)."""
        if store.durable_size(extent) >= end:
            return
        if self._token is None:
            raise StoreError("disk", "the group-commit flusher is not running")
        if self.here():
            self.flush_here(store, extent)
            return
        b, start = self._batches.join(store, extent)
        if b.wake is None:
            b.wake = trio.Event()
        if start is not None:
            self._start(start)
        await b.wake.wait()
        err = b.error(store, extent)
        if err is not None:
            raise err

    def here(self) -> bool:
        """May a flush run right here in the event loop now: the flusher is running, no flush is in it or
        gathering, this is the only request in flight (``quiet``), and no slow flush done so paused it
        (``aio.InlinePause``)?  (The module docstring: "Alone, right here".)"""
        return (self._token is not None and self._batches.idle() and self._quiet is not None and self._quiet()
                and self.inline.allowed(time.monotonic()))

    def flush_here(self, store: ExtentStore, extent: int) -> None:
        """The flush of the only request in flight, right here in the event loop (``here`` said it may):
        StoreError if it failed."""
        t0 = time.monotonic()
        self._batches.flushed_here()
        err = _flush_all({store: {extent}}).get((store, extent))
        if self.inline.took(t0):
            self.counters.slow_inline_flushes += 1
        if err is not None:
            raise err

    def _start(self, batch: Batch) -> None:
        """Hand a batch to the flusher thread (in the event loop; one flush at a time)."""
        self._jobs.put((batch.want, lambda failed: self._flushed(batch, failed)))

    def _flushed(self, batch: Batch, failed: dict) -> None:
        """The flusher thread's result, run in the event loop: wake the batch, start the next one."""
        nxt = self._batches.flushed(batch, failed)
        batch.wake.set()
        if nxt is not None:
            self._start(nxt)

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Owns the flusher thread (one per node): runs in the node's nursery until it ends (``nursery.start``:
        running before any request can wait on it), and then waits for the flush the thread may be in (it
        touches the extents' files, which the node closes next)."""
        self._token = trio.lowlevel.current_trio_token()
        pool = ThreadPoolExecutor(FLUSH_THREADS, thread_name_prefix="group-commit-extent")
        thread = threading.Thread(target=_flusher_thread, args=(self._jobs, self._token, pool), name="group-commit",
                                  daemon=True)
        thread.start()
        task_status.started()
        try:
            await trio.sleep_forever()
        finally:
            self._jobs.put(None)            # the thread ends after the flush it may be in
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(thread.join)
                pool.shutdown(wait=False)


def _flusher_thread(jobs: queue.SimpleQueue, token, pool: ThreadPoolExecutor) -> None:
    while True:
        job = jobs.get()
        if job is None:
            return
        want, deliver = job
        try:
            failed = _flush_all(want, pool)
        except BaseException as e:          # pragma: no cover - _flush_all reports per extent
            failed = {(store, eid): StoreError("disk", f"flush failed: {e}") for store, ids in want.items()
                      for eid in ids}
        try:
            token.run_sync_soon(deliver, failed)
        except trio.RunFinishedError:       # the node is gone
            return


def _flush_all(want: dict, pool: ThreadPoolExecutor | None = None) -> dict:
    """Flush every extent of ``want`` ({store: {extent ids}}); returns {(store, extent): error} of those that
    failed.  With ``pool`` and more than one extent, the extents are flushed side by side in its threads (the
    module docstring)."""
    jobs = [(store, [eid]) for store, extents in want.items() for eid in sorted(extents)]
    if pool is not None and len(jobs) > 1:      # all but the first to the pool; this thread does that one
        jobs = [(*jobs[0], None)] + [(store, ids, pool.submit(store.flush, ids)) for store, ids in jobs[1:]]
    else:
        jobs = [(store, ids, None) for store, ids in jobs]
    failed = {}
    for store, ids, fut in jobs:
        try:
            for eid, err in (store.flush(ids) if fut is None else fut.result()).items():
                failed[(store, eid)] = err
        except StoreError as e:            # pragma: no cover - flush reports per extent
            for eid in ids:
                failed[(store, eid)] = e
    return failed
