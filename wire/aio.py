"""Small helpers for trio code: a nursery whose single failure surfaces as itself, the rule for when
blocking work may run right in the event loop, and the worker threads blocking work runs in otherwise."""
from __future__ import annotations

import queue
import resource
import threading
import time
from contextlib import asynccontextmanager, contextmanager
from typing import AsyncIterator, Iterator

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


async def each(fn, items, catch: type[BaseException] | tuple = ()) -> list:
    """``fn(item)`` for every item side by side: their results in the items' order, with an exception of a
    ``catch`` type in its item's place (the others still run)."""
    out: list = [None] * len(items)

    async def one(i: int) -> None:
        try:
            out[i] = await fn(items[i])
        except catch as e:
            out[i] = e
    async with trio.open_nursery() as n:
        for i in range(len(items)):
            n.start_soon(one, i)
    return out


def thread_waits() -> int:
    """How often the calling thread has waited (blocked: disk, locks) -- not counting the times it was only
    preempted."""
    return resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw


class InlinePause:
    """The rule for blocking work done right in the event loop instead of in a worker thread (a flush, a
    SQLite transaction: the thread's hand-over can cost more than the work): allowed unless a call done so
    took longer than ``slow`` seconds, which sends the calls of a while to the thread -- a while in proportion
    to how long it took, so slow calls in the loop stall it for at most ``share`` of the time, however slow
    the disk.  A fixed pause would be too long after a call just over ``slow`` and too short against a failing
    disk.  It cannot help against a call that hangs.
    It also says when the caller of a short inline call should let the other tasks run (``yield_due``: once a
    ``turn`` of calls back to back)."""

    __slots__ = ("slow", "share", "turn", "_until", "_run", "_end")

    def __init__(self, slow: float = 0.005, share: float = 0.05, turn: float = 0.001) -> None:
        self.slow, self.share, self.turn = slow, share, turn
        self._until = 0.0         # monotonic time before which no call runs inline
        self._run = 0.0           # when the inline calls back to back since yield_due last said yes began
        self._end = -float("inf")  # when the last of them ended

    def allowed(self, now: float) -> bool:
        """May a call start inline at ``now`` (``time.monotonic()``)?"""
        return now >= self._until

    def took(self, started: float, waits: int | None = None) -> bool:
        """An inline call that started at ``started`` has ended; True if it was slow (the pause began).
        ``waits``: the thread's count of waits (:func:`waits`) when the call started -- a call that never
        waited for anything (no disk: only other processes had the CPU meanwhile) is not slow, a thread would
        not have done it sooner; without, the time alone decides."""
        now = time.monotonic()
        took = now - started
        if took <= self.slow or (waits is not None and thread_waits() == waits):
            return False
        self._until = now + took * (1.0 / self.share - 1.0)
        return True

    @contextmanager
    def timed(self, started: float) -> Iterator[None]:
        """Around an inline call that started at ``started``: ``took`` with the thread's waits meanwhile."""
        waits = thread_waits()
        try:
            yield
        finally:
            self.took(started, waits)

    def hold(self) -> None:
        """No call inline from now on (a test's way to the thread path)."""
        self._until = float("inf")

    def yield_due(self, started: float, now: float) -> bool:
        """After an inline call that ran from ``started`` to ``now``: should its caller let the other tasks run
        before it goes on?  Yes once calls back to back (each starting within a ``turn`` of the last one's
        end) have held the loop a ``turn`` since the last yes.  So a run of them (a sweep of many) holds the
        loop about that long at most, while a short call between other awaits -- a FUSE request's metadata
        transaction, requests apart -- costs no scheduler pass of its own."""
        if started - self._end > self.turn:
            self._run = started           # apart from the last one: the loop ran the others meanwhile
        self._end = now
        if now - self._run < self.turn:
            return False
        self._run = now
        return True


class Workers:
    """Blocking calls (the disk) in worker threads, handed over with less than ``trio.to_thread.run_sync``
    does: a queue put, and the result back by ``TrioToken.run_sync_soon`` rescheduling the waiting task -- no
    capacity limiter, no renaming of the thread per call, no context copy: about half the CPU of a
    ``to_thread`` hand-over, and a node makes one per large append and per read the page cache cannot answer
    at once, on every replica.

    Threads start as calls need them, up to ``most`` (more calls queue for them), and end after ``idle``
    seconds without work.  A call once handed over is not cancellable (as ``to_thread.run_sync``): its task
    waits for it, so whatever it touches stays alive until it returns.  A call may wait for another only if
    that one was handed over before it (``hand_over``); any other wait could be behind ``most`` running calls
    and never end."""

    def __init__(self, most: int = 32, idle: float = 10.0, name: str = "worker") -> None:
        self.most, self.idle, self.name = most, idle, name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0        # alive
        self._free = 0           # waiting for a job that nobody has handed them yet
        self._queued = 0         # jobs handed over with no free thread: taken by the next that finishes one

    async def run_sync(self, fn, *args):
        """``fn(*args)`` in a worker thread; its result, or its exception raised here."""
        await trio.lowlevel.checkpoint_if_cancelled()
        return await self.hand_over(fn, *args).result()

    def hand_over(self, fn, *args) -> "Handed":
        """Give ``fn(*args)`` to a worker thread now, without waiting (``await handed.result()`` later, from
        the same trio run).  Calls start in the order they were handed over, so a call may wait for one
        handed over before it (that one already has a thread): how an extent's appends keep their order in
        the disk while their tasks go on (ExtentLane.hand_over)."""
        job = Handed(fn, args, trio.lowlevel.current_trio_token())
        with self._lock:
            if self._free:
                self._free -= 1
            elif self._threads < self.most:
                self._threads += 1
                threading.Thread(target=self._work, name=self.name, daemon=True).start()
            else:
                self._queued += 1
        self._jobs.put(job)
        return job

    def _work(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=self.idle)
            except queue.Empty:
                with self._lock:
                    if self._free:               # nobody counts on this thread: it may go
                        self._free -= 1
                        self._threads -= 1
                        return
                continue                         # a job was handed to it just now
            try:
                job.value = job.fn(*job.args)
            except BaseException as e:           # the caller's to handle, in its task
                job.raised, job.value = True, e
            try:
                job.token.run_sync_soon(job.finish)
            except trio.RunFinishedError:        # pragma: no cover - the run ended under a call
                pass
            del job
            with self._lock:
                if self._queued:
                    self._queued -= 1            # it takes a queued job next
                else:
                    self._free += 1


class Handed:
    """A call given to a worker thread (``Workers.hand_over``): ``await result()`` for what it returned or
    raised.  Not cancellable once handed over: the waiting task waits for the call (what it touches stays
    alive until it returns)."""

    __slots__ = ("fn", "args", "token", "raised", "value", "done", "task")

    def __init__(self, fn, args, token) -> None:
        self.fn, self.args, self.token = fn, args, token
        self.raised, self.value = False, None
        self.done = False        # the call returned (set in the event loop's thread)
        self.task = None         # the task waiting in result(), if one is

    def finish(self) -> None:
        """In the event loop's thread, once the call returned: wake the task waiting for it, if any."""
        self.done = True
        self.fn = self.args = None
        if self.task is not None:
            trio.lowlevel.reschedule(self.task)

    async def result(self):
        if not self.done:
            self.task = trio.lowlevel.current_task()
            await trio.lowlevel.wait_task_rescheduled(lambda _: trio.lowlevel.Abort.FAILED)
        if self.raised:
            raise self.value
        return self.value
