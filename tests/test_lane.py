"""datanode/partition.py ExtentLane: an extent's appends keep arrival order, and an append's turn ends once its
local write is handed to a worker thread -- the writes themselves still reach the store in turn order, a write
behind a failed one is not done, and every other turn waits until no write is out.  Its rules
(datanode/lane.py ``LaneState``) are also checked alone, with no event loop: tasks taking tickets, waiting,
giving up, handing writes over in any order hypothesis finds."""
from __future__ import annotations

import threading
import time

import pytest
import trio
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from wire.aio import Workers
from datanode.lane import TURN, WRITES, LaneState
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


class LaneRules(RuleBasedStateMachine):
    """Requests driving a ``LaneState`` as ``ExtentLane`` does -- a ticket at arrival; at the turn, wait for
    what ``blocker`` names; woken only by the ticket ``done`` returns or by the last write coming back -- in
    any order.  Turns begin in ticket order, one at a time; no waiter is left waiting for a turn that has
    passed it (a lost wake-up); a settling turn never begins while a write is out; ``tail`` is where the last
    handed-over write ends while any is out."""

    def __init__(self) -> None:
        super().__init__()
        self.lane = LaneState()
        self.settle: dict[int, bool] = {}   # ticket -> its turn settles (not an append's)
        self.arrived: set[int] = set()      # taken, not at the turn yet
        self.parked: set[int] = set()       # waiting for their turn (TURN)
        self.settling: set[int] = set()     # their turn, waiting for the writes to be back (WRITES)
        self.woken: set[int] = set()        # woken, not run yet
        self.holding: int | None = None
        self.began: list[int] = []
        self.ended: set[int] = set()
        self.out = 0                         # writes handed over, not back
        self.end = 0                         # where the last handed-over write ends

    def _try(self, t: int) -> None:
        why = self.lane.blocker(t, self.settle[t])
        if why is None:
            assert self.holding is None, (self.holding, t)
            assert not (self.settle[t] and self.out)
            self.holding = t
            self.began.append(t)
        elif why == TURN:
            self.parked.add(t)
        else:
            assert why == WRITES and self.out
            self.settling.add(t)

    def _done(self, t: int) -> None:
        self.ended.add(t)
        nxt = self.lane.done(t)
        if nxt is not None:
            assert nxt == self.lane.serving
            if nxt in self.parked:
                self.parked.remove(nxt)
                self.woken.add(nxt)

    @rule(settle=st.booleans())
    def arrive(self, settle):
        t = self.lane.ticket()
        assert t == len(self.settle)
        self.settle[t] = settle
        self.arrived.add(t)

    @precondition(lambda self: self.arrived or self.woken)
    @rule(data=st.data())
    def go(self, data):
        t = data.draw(st.sampled_from(sorted(self.arrived | self.woken)))
        self.arrived.discard(t)
        self.woken.discard(t)
        self._try(t)

    @precondition(lambda self: self.arrived or self.parked or self.settling or self.woken)
    @rule(data=st.data())
    def give_up(self, data):
        """A request fails, or its wait is cancelled, before its turn begins."""
        t = data.draw(st.sampled_from(sorted(self.arrived | self.parked | self.settling | self.woken)))
        for waiting in (self.arrived, self.parked, self.settling, self.woken):
            waiting.discard(t)
        self._done(t)

    @precondition(lambda self: self.holding is not None and not self.settle[self.holding])
    @rule(n=st.integers(1, 1 << 20))
    def hand_over(self, n):
        self.end += n
        self.lane.handed(self.end)
        self.out += 1

    @precondition(lambda self: self.out)
    @rule()
    def write_back(self):
        self.out -= 1
        settled = self.lane.back()
        assert settled == (self.out == 0)
        if settled:
            self.woken |= self.settling
            self.settling.clear()

    @precondition(lambda self: self.holding is not None)
    @rule()
    def end_turn(self):
        t, self.holding = self.holding, None
        self._done(t)

    @precondition(lambda self: self.ended)
    @rule(data=st.data())
    def done_again(self, data):
        serving = self.lane.serving
        assert self.lane.done(data.draw(st.sampled_from(sorted(self.ended)))) is None
        assert self.lane.serving == serving

    @invariant()
    def turns_in_ticket_order_one_at_a_time(self):
        assert self.began == sorted(self.began) and len(set(self.began)) == len(self.began)
        assert self.holding is None or self.holding == self.lane.serving
        assert all(t in self.ended or t == self.holding for t in range(self.lane.serving))

    @invariant()
    def no_lost_wake_up(self):
        assert all(t > self.lane.serving for t in self.parked), (self.parked, self.lane.serving)
        assert all(t == self.lane.serving and self.out for t in self.settling)
        if self.holding is None and not self.woken and not self.settling:
            # nobody can move: the ticket whose turn it is has yet to come to it, or was never taken
            assert self.lane.serving in self.arrived or self.lane.serving == self.lane.issued

    @invariant()
    def the_extent_ends_where_the_last_write_out_ends(self):
        assert self.lane.writing == self.out
        assert self.lane.tail == (self.end if self.out else None)
        assert self.lane.up(self.lane.serving) == (not self.out)


TestLaneRules = LaneRules.TestCase
TestLaneRules.settings = settings(max_examples=300, stateful_step_count=60, deadline=None,
                                  suppress_health_check=[HealthCheck.too_slow])


def test_a_sealed_lane_keeps_its_first_reason():
    lane = LaneState()
    assert lane.seal("replica 2 failed a write") and not lane.seal("local flush failed")
    assert lane.diverged == "replica 2 failed a write"
    assert not LaneState("sealed at open").seal("again")


def test_a_write_back_that_was_never_handed_over_is_refused():
    lane = LaneState()
    lane.handed(10)
    assert lane.back()
    with pytest.raises(RuntimeError):
        lane.back()
    assert lane.writing == 0 and lane.tail is None


def test_a_ticket_still_fetching_its_payload_is_passed_by_other_connections_only():
    """A request whose payload is still being fetched (a peer that may never serve it) holds nobody else's
    turn: another connection's later ticket goes first; its own connection's later ticket waits behind it
    (pipelined appends keep their order); once fetched it waits for its turn like any other."""
    lane = LaneState()
    attacker, victim = object(), object()
    a = lane.ticket(attacker, fetching=True)
    a2 = lane.ticket(attacker)                     # the same connection's next append: behind ``a``
    v = lane.ticket(victim)
    assert lane.blocker(a2, False) == TURN and lane.blocker(v, False) is None and lane.up(v)
    lane.begin(v)
    lane.fetched(a)                                # in hand now, while the victim holds the turn
    assert lane.blocker(a, False) == TURN
    assert lane.done(v) == a                       # the victim's turn ends: ``a`` is woken
    lane.begin(a)
    assert lane.blocker(a2, False) == TURN
    assert lane.done(a) == a2 and lane.blocker(a2, False) is None
    assert lane.done(a2) == lane.issued == 3 and lane.serving == 3


def test_a_fetch_that_fails_lets_its_connections_later_tickets_go():
    lane = LaneState()
    attacker = object()
    a = lane.ticket(attacker, fetching=True)
    a2 = lane.ticket(attacker)
    assert lane.blocker(a2, False) == TURN
    assert lane.done(a) == a2 and lane.blocker(a2, False) is None


def test_appends_passing_a_fetch_cost_no_more_as_they_pile_up():
    """Thousands of another connection's appends pass a ticket that stays fetching (a peer that never serves
    its READ, until ``payload_timeout``): each costs a look at the tickets in flight, not at every one that
    passed (the attacker would otherwise buy quadratic work on the node)."""
    import time
    lane = LaneState()
    a = lane.ticket(object(), fetching=True)
    victim = object()

    def pass_n(n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            t = lane.ticket(victim)
            assert lane.blocker(t, False) is None
            lane.begin(t)
            lane.done(t)
        return time.perf_counter() - t0
    first, later = pass_n(2000), pass_n(2000)
    assert later < 3 * first + 0.05, (first, later)
    lane.fetched(a)
    assert lane.blocker(a, False) is None
    assert lane.done(a) == lane.issued and lane.serving == lane.issued
