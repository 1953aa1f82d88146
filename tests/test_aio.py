"""wire/aio.py: Workers (the threads a node's store calls run in) and InlinePause (when blocking work may
run in the event loop instead)."""
from __future__ import annotations

import threading
import time

import pytest
import trio

from wire.aio import InlinePause, Workers, thread_waits


def test_calls_run_at_once_in_threads_up_to_most_and_the_rest_wait_their_turn():
    w = Workers(most=3, idle=0.5)
    running, peak, main = [0], [0], threading.get_ident()
    lock = threading.Lock()

    def call(i):
        assert threading.get_ident() != main           # never in the event loop's thread
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.2)
        with lock:
            running[0] -= 1
        return i * i

    async def main_():
        out = {}

        async def one(i):
            out[i] = await w.run_sync(call, i)
        t0 = trio.current_time()
        async with trio.open_nursery() as n:
            for i in range(6):
                n.start_soon(one, i)
        return out, trio.current_time() - t0
    out, took = trio.run(main_)
    assert out == {i: i * i for i in range(6)}
    assert peak[0] == 3                   # three at once, never more
    assert 0.35 < took < 1.5              # two rounds of three, not six one after the other
    time.sleep(1.2)                       # idle threads end
    assert w._threads == 0


def test_a_call_raises_its_own_exception_in_the_caller():
    w = Workers()

    async def main_():
        with pytest.raises(ValueError, match="invalid literal"):
            await w.run_sync(int, "x")
        return await w.run_sync(int, "7")
    assert trio.run(main_) == 7


def test_a_cancelled_caller_still_waits_for_its_call_to_finish():
    """What the call touches (a pool block, a file) must outlive it: cancelling the caller does not abandon it."""
    w = Workers()
    done = []

    def slow():
        time.sleep(0.3)
        done.append(True)

    async def main_():
        with trio.move_on_after(0.05):
            await w.run_sync(slow)
        return bool(done)
    assert trio.run(main_) is True


def test_a_slow_call_in_the_loop_sends_the_next_ones_to_the_thread_for_a_while_in_proportion_to_its_length():
    """A flush (or SQLite transaction) run in the event loop that took longer than ``slow`` keeps the next ones
    out of the loop for 1/share - 1 times its length: slow calls stall the loop at most ``share`` of the time.
    A fixed second was too long after a flush just over 5 ms (a third of a depth-1 bench's flushes went to
    the thread) and too short against a failing disk (1 s flushes held the loop half the time)."""
    p = InlinePause(slow=0.005, share=0.05)
    assert not p.took(time.monotonic())                  # quick: nothing changes
    assert p.allowed(time.monotonic())
    assert p.took(time.monotonic() - 0.010)              # 10 ms: the next ~0.19 s go to the thread
    now = time.monotonic()
    assert not p.allowed(now + 0.15) and p.allowed(now + 0.2)
    assert p.took(time.monotonic() - 1.0)                # 1 s, a failing disk: the next ~19 s
    now = time.monotonic()
    assert not p.allowed(now + 18.0) and p.allowed(now + 19.5)


def test_a_slow_call_that_never_waited_for_anything_pauses_nothing():
    """On a busy machine a call in the loop may take long only because other processes had the CPU: a thread
    would not do it sooner, so it does not send the next calls away.  One that waited (a disk) still does."""
    p = InlinePause(slow=0.005, share=0.05)
    w, t0 = thread_waits(), time.monotonic()
    while time.monotonic() - t0 < 0.02:                  # 20 ms of CPU (preempted at most), no wait
        pass
    assert not p.took(t0, w) and p.allowed(time.monotonic())
    w, t0 = thread_waits(), time.monotonic()
    time.sleep(0.02)                                     # 20 ms waiting
    assert p.took(t0, w) and not p.allowed(time.monotonic())
