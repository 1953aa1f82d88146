"""Connection admission, pure (datanode/ops/admission.py): who gets a connection, whose goes under pressure.
No sockets, no clock: times and the early drop's dice are given."""
from __future__ import annotations

import itertools

from datanode.ops.admission import LOOPBACK_ONLY, TOO_MANY, Admission, Limits, is_loopback

CLIENT, NODE, ADMIN = 1, 2, 3


class Busy:
    def __init__(self, n: int = 0):
        self.busy = n


def adm(rand=lambda: 0.99, **kw) -> Admission:
    return Admission(Limits(**{"max_connections": 100, "reserved": 10, "preauth_max": 8, "preauth_per_host": 4,
                               "preauth_early_drop": 6, **kw}), rand)


def test_the_refusals_are_the_hellos():
    from wire.protocol import HELLO_STATUS
    assert HELLO_STATUS[TOO_MANY] == "too many connections"
    assert "own host only" in HELLO_STATUS[LOOPBACK_ONLY]


def test_loopback_only_without_a_secret():
    a = adm(loopback_only=True)
    v = a.arrive("192.0.2.9", 0.0)
    assert v.entry is None and v.status == LOOPBACK_ONLY
    for host in ("127.0.0.1", "127.0.0.2", "::1", "::ffff:127.0.0.1"):
        assert a.arrive(host, 0.0).entry is not None, host
    assert is_loopback("127.9.9.9") and not is_loopback("10.0.0.1") and not is_loopback("nonsense")


def test_in_transition_only_a_peer_that_proved_nothing_must_be_local():
    a = adm(unproven_loopback_only=True)
    far = a.arrive("192.0.2.9", 0.0).entry
    assert a.hello(far, None, 0.1).status == LOOPBACK_ONLY
    far2 = a.arrive("192.0.2.9", 0.0).entry
    assert a.hello(far2, CLIENT, 0.1).entry is far2           # proven: from anywhere
    near = a.arrive("127.0.0.1", 0.0).entry
    assert a.hello(near, None, 0.1).entry is near


def test_pending_budget_per_address_then_early_drop_then_room_for_quiet_addresses():
    dice = iter([0.5, 0.99, 0.2] + [0.99] * 100)
    a = adm(rand=lambda: next(dice))
    flood = [a.arrive("10.0.0.1", t).entry for t in range(4)]
    assert all(flood)
    v = a.arrive("10.0.0.1", 5)             # per address: it takes the place of its address's oldest
    assert v.entry is not None and v.close == [flood[0]] and a.npending == 4
    flood = flood[1:] + [v.entry]
    for t in range(2):
        assert a.arrive("10.0.0.2", 10 + t).entry is not None
    # 6 pending: from here an address that already has one pending is dropped at random, 30% .. 100%
    v = a.arrive("10.0.0.2", 20)                               # p = 0.3, dice 0.5: kept
    assert v.entry is not None and a.npending == 7
    v = a.arrive("10.0.0.2", 21)                               # p = 0.65, dice 0.99: kept -> 8 = full
    assert v.entry is not None
    assert a.arrive("10.0.0.2", 22).entry is None              # p = 1.0 at full (dice 0.2)
    # full: an address with none pending takes the place of the oldest of the busiest address
    v = a.arrive("10.0.0.3", 30)
    assert v.entry is not None and v.close == [flood[0]] and flood[0].state == "gone"
    # the one whose place was taken cannot finish its hello any more
    assert a.hello(flood[0], CLIENT, 31).entry is None
    assert a.npending == 8 and a.counts()["connections_closed_for_room"] == 2


def test_a_quiet_address_is_never_early_dropped():
    a = adm(rand=lambda: 0.0)                     # the dice always say drop
    for i in range(6):
        assert a.arrive(f"10.0.1.{i}", i).entry is not None
    assert a.arrive("10.0.1.0", 9).entry is None                 # has one pending: dropped
    assert a.arrive("10.0.2.1", 9).entry is not None             # has none: kept


def test_clients_never_take_the_reserved_slots_and_the_least_active_idle_one_goes():
    a = adm(max_connections=6, reserved=2, preauth_max=0)
    ts = itertools.count()
    clients = []
    for i in range(4):
        e = a.arrive("10.0.0.1", next(ts)).entry
        assert a.hello(e, CLIENT, next(ts)).entry is e
        e.served = Busy(1)                         # busy: never closed for room
        clients.append(e)
    e = a.arrive("10.0.0.2", next(ts)).entry
    v = a.hello(e, CLIENT, next(ts))
    assert v.entry is None and "none idle" in v.why
    for role in (NODE, ADMIN):                     # the reserved slots
        e = a.arrive("10.0.0.1", next(ts)).entry
        assert a.hello(e, role, next(ts)).entry is e
    clients[2].served.busy = 0
    clients[1].served.busy = 0
    clients[2].last_active = 0.5                   # the least recently active of the idle ones
    e = a.arrive("10.0.0.3", next(ts)).entry
    v = a.hello(e, CLIENT, next(ts))
    assert v.entry is e and v.close == [clients[2]]
    assert a.counts()["client_connections"] == 4 and a.counts()["node_admin_connections"] == 2
    # every slot taken, none idle but the newcomer's: a node is refused, nothing is closed for it
    e.served = Busy(1)
    clients[1].served.busy = 1
    n = a.arrive("10.0.0.9", next(ts)).entry
    assert a.hello(n, NODE, next(ts)).entry is None


def test_idle_connections_are_bounded_per_host_and_in_all():
    a = adm(idle_per_host=3, idle_max=5, preauth_max=0)
    opened = {}
    for t in range(8):
        host = "10.0.0.1" if t < 6 else "10.0.0.2"
        e = a.arrive(host, t).entry
        v = a.hello(e, CLIENT, t)
        assert v.entry is e and all(x.state == "gone" for x in v.close)
        opened[t] = e
    alive = [t for t, e in opened.items() if e.state == "open"]
    assert alive == [3, 4, 5, 6, 7]                # per host 3 (the newest), and 5 in all
    node = a.arrive("10.0.0.1", 9).entry
    assert a.hello(node, NODE, 9).close == []       # node and admin connections do not count
    a.left(opened[3])
    a.left(opened[3])                              # twice: no harm
    assert a.counts()["client_connections"] == 4 and a.counts()["idle_client_connections"] == 4


def test_a_connection_that_ends_in_its_hello_frees_its_pending_slot():
    a = adm()
    e = a.arrive("10.0.0.1", 0).entry
    assert a.npending == 1
    a.left(e)
    assert a.npending == 0 and a.pending == {}


def test_a_pending_connection_that_sent_its_hello_is_closed_for_room_only_after_silent_ones():
    """From one address at ``preauth_per_host``, a newcomer takes the place of the oldest pending connection
    that has not sent its whole hello -- a flood of silent connections does not close the hello of a peer
    already proving itself --, and of the oldest when all have."""
    a = adm(preauth_per_host=3, preauth_max=0)
    said = {"legit": True}
    legit = a.arrive("h", 0.0, spoke=lambda: said["legit"]).entry
    silent = [a.arrive("h", 0.1 + i).entry for i in range(2)]
    for i in range(5):                                   # the flood: each new one closes a silent one
        v = a.arrive("h", 1.0 + i, spoke=lambda: False)
        assert v.entry is not None and legit not in v.close and len(v.close) == 1
    assert legit.state == "pending" and all(s.state == "gone" for s in silent)
    said["legit"] = False                                # (as if it had not spoken): the oldest goes first
    assert a.arrive("h", 9.0).close == [legit]


def test_a_connection_just_past_its_hello_is_not_idle_yet():
    """A crowd of clients opening at once: each new connection is idle until its first request arrives, and
    with idle_max smaller than the crowd they would close each other's in turn.  For ``fresh_s`` after its
    hello a connection is not closed to make room; after that an idle one is, as before."""
    a = adm(idle_max=2, fresh_s=5.0, preauth_max=0, max_connections=16, reserved=0)
    crowd = []
    for t in range(6):                             # six clients within a second, none has sent a request yet
        e = a.arrive(f"10.0.1.{t}", t / 10).entry
        v = a.hello(e, CLIENT, t / 10)
        assert v.entry is e and v.close == [], v   # nobody closed for room
        crowd.append(e)
    assert a.counts()["client_connections"] == 6
    late = a.arrive("10.0.2.1", 10.0).entry        # later, all six still idle: the limit applies again
    closed = a.hello(late, CLIENT, 10.0).close
    assert sorted(closed, key=lambda x: x.opened) == crowd[:4], closed   # the least recently active go
    anon = adm(idle_max=2, fresh_s=5.0, preauth_max=0, max_connections=16, reserved=0)
    closed = [x for t in range(4) for x in anon.hello(anon.arrive(f"10.0.4.{t}", t / 10).entry, None, t / 10).close]
    assert len(closed) == 2                        # proving nothing (no secret): no grace, the limit holds at once
    full = adm(preauth_max=0, max_connections=4, reserved=0, fresh_s=5.0)
    for t in range(4):
        full.hello(full.arrive(f"10.0.3.{t}", 0).entry, CLIENT, 0)
    v = full.hello(full.arrive("10.0.3.9", 1).entry, CLIENT, 1)
    assert v.entry is not None and len(v.close) == 1     # max_connections: an idle new one still makes room
