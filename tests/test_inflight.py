"""wire/inflight.py: a connection's requests as plain state, checked with no socket and no event loop --
credits never negative nor lost, handed to waiters first come first served; every request sent ends exactly
once (answered, late or closed) and keeps that outcome; answers only ever end the request they name; a group
of requests wakes its waiter once, when the last is in."""
from __future__ import annotations

import math
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from wire.inflight import LATE, Call, FanIn, InFlight


class Requests(RuleBasedStateMachine):
    """Callers driving an ``InFlight`` as ``rpc.Requester`` does, the peer answering (or not) in any order,
    the clock moving and the link dying at any point."""

    @initialize(credits=st.integers(1, 4))
    def start(self, credits):
        self.capacity = credits
        self.f = InFlight(credits)
        self.now = 0.0
        self.queued: list[Call] = []       # waiting for a credit, in arrival order
        self.woken: list[Call] = []        # handed a credit, not back at work yet
        self.holding: list[Call] = []      # hold a credit, not sent
        self.sent: dict[int, Call] = {}    # in flight: req_id -> call
        self.ended: list[Call] = []        # ended, their callers not done with them yet
        self.outcome: dict[int, object] = {}    # id(call) -> its answer when it ended
        self.calls: dict[int, Call] = {}        # id(call) -> call, every one that ever ended
        self.ids: set[int] = set()
        self.went_out: list[Call] = []         # every call sent
        self.dropped: set[int] = set()          # id(call): its caller was done with it before it ended
        self.made: list[Call] = []             # every call (kept alive: the sets above hold their ids)

    def _give(self, waiter) -> None:
        if waiter is not None:
            assert waiter is self.queued[0]        # first come, first served
            self.woken.append(self.queued.pop(0))

    def _end(self, ended) -> None:
        for call in ended:
            assert call.ended and id(call) not in self.outcome, "a request ended twice"
            self.outcome[id(call)] = call.answer
            self.calls[id(call)] = call
            self.ended.append(call)

    def _fail(self, why: str) -> None:
        ended = self.f.fail(why)
        assert set(map(id, ended)) == set(map(id, self.sent.values()))
        assert all(call.answer is None for call in ended)
        self.sent.clear()
        self._end(ended)

    @precondition(lambda self: self.f.dead is None)
    @rule(timeout=st.sampled_from([0.5, 1.0, 5.0]))
    def submit(self, timeout):
        call = Call(self.now + timeout, timeout)
        self.made.append(call)
        free = self.f.free
        if self.f.take():
            assert free > 0
            self.holding.append(call)
        else:
            assert free == 0
            self.f.queue(call)
            self.queued.append(call)

    @precondition(lambda self: self.woken)
    @rule(data=st.data(), gave_up=st.booleans())
    def credit_came(self, data, gave_up):
        """A waiter handed a credit goes on -- or had just given up, and the credit goes on to the next."""
        call = self.woken.pop(data.draw(st.integers(0, len(self.woken) - 1)))
        assert self.f.withdraw(call)
        if gave_up:
            self._give(self.f.give())
        else:
            self.holding.append(call)

    @precondition(lambda self: self.queued)
    @rule(data=st.data())
    def no_credit_in_time(self, data):
        """Its wait for a credit timed out: the requester fails the link."""
        call = self.queued[data.draw(st.integers(0, len(self.queued) - 1))]
        assert not self.f.withdraw(call)
        self.queued.remove(call)
        self._fail("request timed out")

    @precondition(lambda self: self.holding and self.f.dead is None)
    @rule(data=st.data())
    def send(self, data):
        call = self.holding.pop(data.draw(st.integers(0, len(self.holding) - 1)))
        rid = self.f.send(call)
        assert rid == call.req_id and rid not in self.ids
        self.ids.add(rid)
        self.sent[rid] = call
        self.went_out.append(call)

    @precondition(lambda self: self.holding or self.sent)
    @rule(data=st.data())
    def unsent_or_given_up(self, data):
        """Its grant or send failed, or its caller stopped waiting for the answer: the credit goes back, and
        a later answer to it ends nothing."""
        pick = data.draw(st.sampled_from([("h", i) for i in range(len(self.holding))] +
                                         [("s", rid) for rid in self.sent]))
        call = self.holding.pop(pick[1]) if pick[0] == "h" else self.sent.pop(pick[1])
        self.dropped.add(id(call))
        self._give(self.f.finish(call))
        if call.req_id:
            assert self.f.answered(call.req_id, object()) is None

    @precondition(lambda self: self.sent)
    @rule(data=st.data())
    def answer(self, data):
        rid = data.draw(st.sampled_from(sorted(self.sent)))
        resp = object()
        call = self.f.answered(rid, resp)
        assert call is self.sent.pop(rid) and call.answer is resp
        self._end([call])
        assert self.f.answered(rid, object()) is None       # a second answer ends nothing

    @rule(rid=st.integers(0, 50))
    def stray_answer(self, rid):
        if rid not in self.sent:
            assert self.f.answered(rid, object()) is None

    @rule(dt=st.sampled_from([0.1, 0.5, 2.0]))
    def time_passes(self, dt):
        self.now += dt
        late = [call for call in self.sent.values() if call.deadline <= self.now]
        ended = self.f.expire(self.now)
        if not late:
            assert ended == []
            return
        assert set(map(id, ended)) == set(map(id, self.sent.values()))     # the link fails for all
        assert all((call.answer is LATE) == (call.deadline <= self.now) for call in ended)
        assert self.f.dead is not None
        self.sent.clear()
        self._end(ended)

    @rule()
    def link_dies(self):
        self._fail("connection closed")

    @precondition(lambda self: self.ended)
    @rule(data=st.data())
    def caller_takes_the_outcome(self, data):
        call = self.ended.pop(data.draw(st.integers(0, len(self.ended) - 1)))
        self._give(self.f.finish(call))
        assert self.f.finish(call) is None          # once only: the credit went back once

    @invariant()
    def credits_are_never_negative_nor_lost(self):
        f = self.f
        held = len(self.woken) + len(self.holding) + len(self.sent) + len(self.ended)
        assert f.free >= 0 and f.free + held == self.capacity, (f.free, held, self.capacity)
        assert not (f.free and self.queued)         # a free credit never leaves a waiter waiting

    @invariant()
    def answers_match_requests(self):
        assert set(self.f.calls) == set(self.sent)
        assert self.f.earliest() == min([c.deadline for c in self.sent.values()], default=math.inf)

    @invariant()
    def an_outcome_never_changes(self):
        for key, answer in self.outcome.items():
            assert self.calls[key].answer is answer

    def teardown(self):
        if not hasattr(self, "f"):
            return
        self._fail("closed")
        for call in list(self.queued):
            assert not self.f.withdraw(call)
        self.queued.clear()
        for call in self.woken + self.holding + self.ended:
            assert self.f.finish(call) is None              # nobody is queued any more
        assert self.f.free == self.capacity                  # every credit back
        # every request sent ended (exactly once: _end) unless its caller was done with it before
        assert all((id(call) in self.outcome) != (id(call) in self.dropped) for call in self.went_out)


TestRequests = Requests.TestCase
TestRequests.settings = settings(max_examples=300, stateful_step_count=60, deadline=None,
                                 suppress_health_check=[HealthCheck.too_slow])


@settings(max_examples=300, deadline=None)
@given(data=st.data(), members=st.integers(0, 6))
def test_a_group_wakes_its_waiter_once_when_the_last_member_is_in_and_it_is_sealed(data, members):
    """Answers may land before the group is sealed (a forward's ack before the next forward is sent): the
    waiter is woken once, at the first moment every member is in *and* no more may join."""
    g = FanIn()
    joined, answered, sealed, wakes = 0, 0, False, 0
    while not (sealed and answered == members):
        steps = (["join"] * (joined < members) + ["answer"] * (answered < joined)
                 + ["seal"] * (joined == members and not sealed))
        step = data.draw(st.sampled_from(steps))
        if step == "join":
            g.join()
            joined += 1
            continue
        if step == "answer":
            answered += 1
            woke = g.answered()
        else:
            sealed = True
            woke = g.seal()
        assert woke == (sealed and answered == members)
        wakes += woke
    assert wakes == 1


def test_a_sealed_group_takes_no_more_members():
    g = FanIn()
    g.join()
    g.seal()
    with pytest.raises(RuntimeError):
        g.join()


def test_the_rules_modules_need_no_event_loop():
    """The lane's, the requests' and group commit's rules import no trio (nor sockets): they run anywhere."""
    code = ("import sys, datanode.lane, datanode.batching, wire.inflight; "
            "print(sorted(m for m in ('trio', 'socket', 'threading') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
