"""datanode/batching.py: group commit's batching as plain state, checked with no disk, thread or event loop --
one flush out at a time; a waiter's flush starts after it joined (so it covers the append made before); no
batch loses a waiter, and every waiter of a flush sees that flush's result for its own extent, failures
included; nobody is left gathering while no flush is out."""
from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from datanode.batching import Batches

STORES = ("store-a", "store-b")


class Waiter:
    __slots__ = ("store", "extent", "batch", "outcome", "woken")

    def __init__(self, store, extent, batch) -> None:
        self.store, self.extent, self.batch = store, extent, batch
        self.outcome = None
        self.woken = 0


class Flushes(RuleBasedStateMachine):
    """Appends on two stores' extents waiting for durability as ``GroupCommit.durable`` makes them wait,
    flushes coming back (some extents failed) at any point, a lone request's flush run in place when the
    batching is idle."""

    def __init__(self) -> None:
        super().__init__()
        self.b = Batches()
        self.waiting: list[Waiter] = []      # joined, not woken
        self.every: list[Waiter] = []
        self.started: list = []              # batches handed to the flusher, in order
        self.joins = self.flushes = self.inline = 0

    def _hand(self, batch) -> None:
        assert batch is self.b.flushing and batch.waiters and batch.want
        assert batch not in self.started
        self.started.append(batch)

    @rule(store=st.sampled_from(STORES), extent=st.integers(0, 3))
    def append_waits(self, store, extent):
        gathering = self.b.gathering
        batch, start = self.b.join(store, extent)
        self.joins += 1
        # it waits for a flush that starts from now on: the one it gathers for, handed over now or later
        assert batch is gathering and batch not in self.started
        assert extent in batch.want[store]
        w = Waiter(store, extent, batch)
        self.waiting.append(w)
        self.every.append(w)
        if start is not None:
            assert start is batch
            self._hand(start)

    @precondition(lambda self: self.b.flushing is not None)
    @rule(data=st.data())
    def flush_comes_back(self, data):
        batch = self.b.flushing
        extents = sorted((s, e) for s, ids in batch.want.items() for e in ids)
        failed = {key: OSError(5, f"I/O error on {key}") for key in data.draw(st.sets(st.sampled_from(extents)))}
        nxt = self.b.flushed(batch, failed)
        self.flushes += 1
        woken = [w for w in self.waiting if w.batch is batch]
        assert len(woken) == batch.waiters                 # every waiter of the batch, no other
        for w in woken:
            w.outcome = batch.error(w.store, w.extent)
            w.woken += 1
            assert w.outcome is failed.get((w.store, w.extent))
            self.waiting.remove(w)
        if nxt is not None:
            self._hand(nxt)

    @precondition(lambda self: self.b.idle())
    @rule()
    def lone_flush_in_place(self):
        self.b.flushed_here()
        self.inline += 1

    @invariant()
    def one_flush_out_and_nobody_stranded(self):
        assert self.b.flushing is None or self.b.flushing is self.started[-1]
        if self.b.flushing is None:
            assert not self.b.gathering.want and not self.waiting
        assert self.b.idle() == (self.b.flushing is None)

    @invariant()
    def no_batch_loses_a_waiter(self):
        live = [b for b in (self.b.gathering, self.b.flushing) if b is not None]
        assert sum(b.waiters for b in live) == len(self.waiting)
        assert all(w.batch in live for w in self.waiting)

    @invariant()
    def counters_say_what_happened(self):
        c = self.b.counters
        assert c.commit_waits == self.joins + self.inline
        assert c.flushes == self.flushes + self.inline and c.inline_flushes == self.inline

    def teardown(self):
        while self.b.flushing is not None:
            batch = self.b.flushing
            nxt = self.b.flushed(batch, {})
            for w in [w for w in self.waiting if w.batch is batch]:
                w.woken += 1
                self.waiting.remove(w)
            if nxt is not None:
                self._hand(nxt)
        assert not self.waiting and all(w.woken == 1 for w in self.every)


TestFlushes = Flushes.TestCase
TestFlushes.settings = settings(max_examples=300, stateful_step_count=50, deadline=None,
                                suppress_health_check=[HealthCheck.too_slow])


def test_appends_that_came_during_a_flush_share_the_next_one():
    """Three appends on two extents arrive while a flush is out: the next flush is one, for all of them."""
    b = Batches()
    first, start = b.join("s", 1)
    assert start is first
    later = [b.join("s", e) for e in (1, 2, 2)]
    assert all(batch is later[0][0] and start is None for batch, start in later)
    assert b.flushed(first, {}) is later[0][0]
    assert later[0][0].want == {"s": {1, 2}} and later[0][0].waiters == 3
    assert b.counters.flushes == 1 and b.counters.flushed_extents == 1 and b.counters.commit_waits == 4
