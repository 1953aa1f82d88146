"""datanode/partition.py ExtentLane: an extent's appends keep arrival order, and an append's turn ends once its
local write is handed to a worker thread -- the writes themselves still reach the store in turn order, a write
behind a failed one is not done, and every other turn waits until no write is out."""
from __future__ import annotations

import threading
import time

import pytest
import trio

from datanode.aio import Workers
from datanode.partition import EarlierWriteFailed, ExtentLane


def _appends(lane: ExtentLane, workers: Workers, fns, log: list) -> list:
    """One append per ``fns[i]`` (its local write), all arriving at once: each takes its turn, hands its write
    over, ends its turn, then waits for the write.  Returns each one's result or exception."""
    out: list = [None] * len(fns)
    tickets = [lane.ticket() for _ in fns]           # arrival order

    async def one(i):
        async with lane.turn(tickets[i], settle=False):
            log.append(("turn", i, time.monotonic()))
            handed = lane.hand_over(workers, (i + 1) * 10, fns[i])
            assert lane.tail == (i + 1) * 10          # where the next append must start
        try:
            out[i] = await handed.result()
        except Exception as e:
            out[i] = e
        finally:
            lane.handed_back()

    async def main():
        async with trio.open_nursery() as n:
            for i in reversed(range(len(fns))):        # started in the wrong order: the tickets decide
                n.start_soon(one, i)
    trio.run(main)
    return out


def test_turns_end_at_the_hand_over_and_the_writes_still_run_in_turn_order():
    """Each write sleeps less than the one before it: run as they came to threads, the last would land first.
    Every turn is over before the first write is done, and the writes still happen 0, 1, 2, 3."""
    lane, workers, log = ExtentLane(), Workers(most=8), []
    done: list = []

    def write(i, pause):
        def fn():
            time.sleep(pause)
            done.append((i, time.monotonic()))
            return i
        return fn
    out = _appends(lane, workers, [write(i, 0.4 - 0.1 * i) for i in range(4)], log)
    assert out == [0, 1, 2, 3]
    assert [i for i, _ in done] == [0, 1, 2, 3]
    assert [i for _, i, _ in log] == [0, 1, 2, 3]                 # turns in arrival order
    assert max(t for _, _, t in log) < min(t for _, t in done)    # every turn ended before any write did
    assert lane.writing == 0 and lane.tail is None


def test_a_write_behind_a_failed_one_is_not_done():
    lane, workers, log = ExtentLane(), Workers(most=8), []
    ran: list = []

    def fails():
        time.sleep(0.1)
        raise OSError(28, "No space left on device")

    def later(i):
        def fn():
            ran.append(i)
            return i
        return fn
    out = _appends(lane, workers, [fails, later(1), later(2)], log)
    assert isinstance(out[0], OSError)
    assert all(isinstance(e, EarlierWriteFailed) for e in out[1:]), out
    assert "No space left" in str(out[1])
    assert ran == []                        # nothing written past the failed write
    assert lane.writing == 0 and lane.tail is None


@pytest.mark.parametrize("settle", [True, False])
def test_a_settling_turn_starts_only_once_no_write_is_out(settle):
    """A turn that needs the store's own end (repair, truncation: ``settle``, the default) waits for the writes
    handed over before it; an append's turn does not."""
    lane, workers = ExtentLane(), Workers(most=4)
    finished = threading.Event()
    seen: dict = {}

    def slow():
        time.sleep(0.3)
        finished.set()

    async def main():
        t_append, t_other = lane.ticket(), lane.ticket()

        async def append():
            async with lane.turn(t_append, settle=False):
                handed = lane.hand_over(workers, 10, slow)
            try:
                await handed.result()
            finally:
                lane.handed_back()

        async def other():
            async with lane.turn(t_other, settle=settle):
                seen["write done at turn start"] = finished.is_set()
        async with trio.open_nursery() as n:
            n.start_soon(append)
            n.start_soon(other)
    trio.run(main)
    assert seen["write done at turn start"] is settle
