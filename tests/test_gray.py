"""Gray failures on a link: a peer that stops answering altogether is given up on after a silence derived from
its own answer times (wire/inflight.py ``PeerClock``, ``InFlight.silence``), while a peer that is merely slow
-- it answers the probe -- keeps its requests until their own timeouts (wire/rpc.py).

The rules first, as plain state; then a real connection whose far end answers nothing, or only the probe; then
a real datanode process frozen with SIGSTOP."""
from __future__ import annotations

import math
import signal

import pytest
import trio

from tests.conftest import SLACK, run
from tests.test_transport import pair
from wire.inflight import SILENCE_MAX_S, SILENCE_MIN_S, SILENT, Call, InFlight, PeerClock
from wire.protocol import Header, Op, Result, decode
from wire.rpc import Links, PeerSilent, Requester, RequestTimeout
from wire.transport.base import TransportError


# -- the rules --------------------------------------------------------------------------------------------
def test_the_silence_limit_follows_the_answers_within_its_bounds():
    c = PeerClock()
    assert c.limit() == SILENCE_MIN_S                  # nothing heard yet: the floor
    for _ in range(50):
        c.sample(0.002)                                # a fast link: still the floor (a busy host pauses)
    assert c.limit() == SILENCE_MIN_S
    for _ in range(50):
        c.sample(1.5)                                  # a disk whose flushes take 1.5 s: a longer limit
    assert SILENCE_MIN_S < c.limit() <= SILENCE_MAX_S
    slow = c.limit()
    for _ in range(100):
        c.sample(30.0)
    assert c.limit() == SILENCE_MAX_S                  # never more than the ceiling
    steady, varying = PeerClock(), PeerClock()
    for i in range(40):
        steady.sample(0.5)
        varying.sample(0.2 if i % 2 else 0.8)          # the same mean, but answers that vary widen the limit
    assert varying.limit() > steady.limit()
    assert slow > SILENCE_MIN_S


def test_a_peer_given_up_on_is_suspect_quiet_for_a_while_and_gets_longer_until_it_answers():
    c = PeerClock()
    base = c.limit()
    c.dial_failed(5.0)                     # a failed connection alone (refused: it restarts) keeps no one away
    assert not c.quiet(5.0)
    c.gave_up(10.0)
    assert c.suspect and c.limit() == 2 * base and c.limit(backoff=False) == base
    assert c.quiet(10.0 + base - 0.1) and not c.quiet(10.0 + base)
    c.dial_failed(20.0)                    # and a new connection to it failed: quiet again
    assert c.quiet(20.0 + base - 0.1) and not c.quiet(20.0 + base)
    for _ in range(10):
        c.gave_up(30.0)
    assert c.limit() == SILENCE_MAX_S
    c.sample(0.01)
    assert not c.suspect and c.limit() == base and not c.quiet(30.0)


def _sent(f: InFlight, now: float, timeout: float = 60.0) -> Call:
    call = Call(now + timeout, timeout)
    assert f.take()
    f.send(call, now)
    return call


def test_silence_probes_at_half_the_limit_and_gives_up_at_the_limit():
    f = InFlight(4, now=0.0)
    assert f.silent_since() == math.inf and f.next_check(2.0) == math.inf    # nothing outstanding: no silence
    a = _sent(f, 10.0)
    assert f.silence(10.9, 2.0) is None and f.next_check(2.0) == 11.0
    assert f.silence(11.0, 2.0) == "probe"
    probe = Call(math.inf, math.inf)
    f.probing(probe, 11.0)
    assert f.free == 3                                 # the probe holds no credit of the callers'
    assert f.silence(11.5, 2.0) is None and f.next_check(2.0) == 12.0         # one probe at a time
    ended = f.silent("quiet") if f.silence(12.0, 2.0) == "give-up" else []
    assert {id(c) for c in ended} == {id(a), id(probe)} and a.answer is SILENT and f.dead == "quiet"


def test_no_give_up_before_a_probe_had_its_half_limit():
    """Our own process stood still (its loop blocked) for longer than the limit: the silence it finds may be
    its own, the answers waiting to be read.  It probes first and gives up only half a limit later."""
    f = InFlight(4, now=0.0)
    a = _sent(f, 10.0)
    assert f.silence(15.0, 2.0) == "probe"             # five seconds went by unseen
    probe = Call(math.inf, math.inf)
    f.probing(probe, 15.0)
    assert f.silence(15.9, 2.0) is None and f.next_check(2.0) == 16.0
    f.answered(a.req_id, "ok", now=15.01)               # the answer was there all along
    assert f.silence(16.0, 2.0) is None
    g = InFlight(1, now=0.0)                            # no slot for a probe: the silence alone decides
    _sent(g, 10.0)
    assert g.silence(11.9, 2.0, probes=False) is None and g.next_check(2.0, probes=False) == 12.0
    assert g.silence(12.0, 2.0, probes=False) == "give-up"


def test_any_answer_ends_the_silence():
    f = InFlight(4, now=0.0)
    a = _sent(f, 10.0)
    b = _sent(f, 10.5)
    f.answered(a.req_id, "ok", now=11.4)               # the older one answered: b's silence counts from here
    assert f.silence(12.3, 2.0) is None and f.silence(12.4, 2.0) == "probe"
    probe = Call(math.inf, math.inf)
    f.probing(probe, 12.4)
    f.answered(probe.req_id, "pong", now=12.6)          # alive, only slow: b waits on, a new probe later
    assert f.probe is None and f.silence(13.5, 2.0) is None
    assert f.silence(13.6, 2.0) == "probe" and b.answer is None
    f.answered(999, "late", now=14.0)                   # even an answer nobody waits for says it is alive
    assert f.silence(14.9, 2.0) is None


# -- a real connection --------------------------------------------------------------------------------------
def test_a_peer_that_answers_nothing_is_given_up_on_after_its_limit():
    """The far end reads our request and answers nothing: the request (its own timeout a minute) ends
    PeerSilent after the silence limit, having probed once; the link is dead."""
    async def body():
        async with pair("tcp") as (cli, srv):
            clock = PeerClock()
            req = Requester(cli.conn, clock)
            async with trio.open_nursery() as n:
                await n.start(req.run)
                t0 = trio.current_time()
                p = await req.submit(Header(opcode=Op.READ, partition=1, length=0), timeout=60)
                seen = [decode(await srv.conn.recv()).opcode]
                with trio.fail_after(clock.limit() + SLACK):
                    with pytest.raises(PeerSilent):
                        await p.result()
                took = trio.current_time() - t0
                with trio.move_on_after(1):
                    seen.append(decode(await srv.conn.recv()).opcode)
                assert seen == [Op.READ, Op.PING]
                assert SILENCE_MIN_S <= took < SILENCE_MIN_S + SLACK
                assert not req.alive and clock.suspect
                n.cancel_scope.cancel()
    run(body)


def test_a_peer_that_answers_the_probe_keeps_its_requests_until_their_timeout():
    """Slow, not silent: the far end answers every PING but holds the request -- it ends on its own
    timeout (RequestTimeout), well after the silence limit, not PeerSilent."""
    async def body():
        async with pair("tcp") as (cli, srv):
            clock = PeerClock()
            req = Requester(cli.conn, clock)
            pings = 0

            async def serve_pings_only():
                nonlocal pings
                try:
                    while True:
                        h = decode(await srv.conn.recv())
                        if h.opcode == Op.PING:
                            pings += 1
                            await srv.conn.send(h.reply(Result.OK).encode())
                except TransportError:
                    pass           # the requester closed the link when the request timed out

            timeout = clock.limit() * 2.5
            async with trio.open_nursery() as n:
                await n.start(req.run)
                n.start_soon(serve_pings_only)
                t0 = trio.current_time()
                with trio.fail_after(timeout + SLACK):
                    with pytest.raises(RequestTimeout) as ei:
                        await req.call(Header(opcode=Op.READ, partition=1, length=0), timeout=timeout)
                assert not isinstance(ei.value, PeerSilent)
                assert trio.current_time() - t0 >= timeout and pings >= 2
                n.cancel_scope.cancel()
    run(body)


# -- a real datanode, frozen ----------------------------------------------------------------------------------
def test_a_frozen_node_is_given_up_on_and_not_waited_for_again(nodes):
    """SIGSTOP: the node holds its sockets (its kernel even completes new connections) and answers nothing.
    A request with a minute's timeout fails within the silence limit; dialing it again fails within the limit
    too, and callers queued behind that dial fail with it instead of dialing in turn; for a while after each
    failure it is not dialed at all; once it wakes, it serves again."""
    [n] = nodes(1)

    async def body():
        async with trio.open_nursery() as nursery:
            links = Links(nursery, _domain(), transport="tcp", slots=8, connect_timeout=60)
            link = await links.get(n.addr)
            assert (await link.call(Header(opcode=Op.PING), 60)).result == Result.OK
            n.proc.send_signal(signal.SIGSTOP)
            try:
                limit = links.clocks[n.addr].limit()
                t0 = trio.current_time()
                with trio.fail_after(limit + SLACK):
                    with pytest.raises(PeerSilent):
                        await link.call(Header(opcode=Op.PING), 60)
                assert links.suspect(n.addr)
                failed = []

                async def dial():
                    try:
                        await links.get(n.addr)
                    except TransportError as e:
                        failed.append((trio.current_time() - t0, e))
                t0 = trio.current_time()
                with trio.fail_after(limit + SLACK):
                    async with trio.open_nursery() as many:
                        for _ in range(4):
                            many.start_soon(dial)
                assert len(failed) == 4, failed
                assert max(t for t, _e in failed) < SLACK     # not even dialed: it was given up on a moment ago
                await trio.sleep(max(0.0, links.clocks[n.addr].quiet_until - trio.current_time()))
                t0 = trio.current_time()
                failed.clear()
                with trio.fail_after(limit + SLACK):
                    async with trio.open_nursery() as many:
                        for _ in range(4):
                            many.start_soon(dial)
                assert len(failed) == 4, failed
                assert max(t for t, _e in failed) < limit + SLACK      # one dial's time, not four
                with pytest.raises(TransportError):
                    await links.get(n.addr)                # and again quiet for a while: no dial at all
            finally:
                n.proc.send_signal(signal.SIGCONT)
            await trio.sleep(max(0.0, links.clocks[n.addr].quiet_until - trio.current_time()))
            link = await links.get(n.addr)
            assert (await link.call(Header(opcode=Op.PING), 60)).result == Result.OK
            assert not links.suspect(n.addr)
            nursery.cancel_scope.cancel()
    run(body)


def _domain():
    from tests.conftest import client_domain
    return client_domain("tcp")
