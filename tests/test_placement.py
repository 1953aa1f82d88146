"""Placement decisions (tools/placement.py), table-tested: pure functions, no processes."""
from __future__ import annotations

from collections import Counter

import pytest

from tools.placement import PlacementError, eligible, pick_spare, place

G = 1 << 30


def N(*specs):
    """N(("a", "z1", 10), ...) -> {addr: registration}."""
    return {a: {"zone": z, "free_bytes": f * G} for a, z, f in specs}


FOUR_ONE_ZONE = N(("a", "z", 10), ("b", "z", 10), ("c", "z", 10), ("d", "z", 10))
THREE_ZONES = N(("a1", "z1", 10), ("a2", "z1", 50), ("b1", "z2", 10), ("b2", "z2", 20), ("c1", "z3", 5))


@pytest.mark.parametrize("nodes, count, replicas, expect", [
    # one partition: most free space first within one zone
    (N(("a", "z", 1), ("b", "z", 3), ("c", "z", 2), ("d", "z", 4)), 1, 3, [{"d", "b", "c"}]),
    # zones first: one replica per zone even when a zone has the emptiest disks
    (THREE_ZONES, 1, 3, [{"a2", "b2", "c1"}]),
    # two zones, three replicas: both zones used, the third on the freest remaining node
    (N(("a1", "z1", 9), ("a2", "z1", 8), ("b1", "z2", 1)), 1, 3, [{"a1", "a2", "b1"}]),
    # exactly as many nodes as replicas
    (N(("a", "z", 1), ("b", "z", 1)), 2, 2, [{"a", "b"}, {"a", "b"}]),
])
def test_place_table(nodes, count, replicas, expect):
    got = place(nodes, count, replicas)
    assert [set(r) for r in got] == expect
    for r in got:
        assert len(r) == len(set(r)) == replicas          # never two replicas on one node


def test_batch_spreads_over_every_node_and_leaders_rotate():
    got = place(FOUR_ONE_ZONE, 4, 3)
    per_node = Counter(a for r in got for a in r)
    assert set(per_node.values()) == {3}, per_node       # 12 replicas over 4 nodes: 3 each
    assert sorted(r[0] for r in got) == ["a", "b", "c", "d"]    # every node leads one


def test_existing_load_steers_leaders():
    got = place(FOUR_ONE_ZONE, 1, 3, leading={"a": 5, "b": 5, "c": 5, "d": 0}, held={"a": 9})
    assert "a" not in got[0] and got[0][0] == "d"


def test_zones_spread_in_a_batch():
    got = place(THREE_ZONES, 3, 3)
    for r in got:
        assert {THREE_ZONES[a]["zone"] for a in r} == {"z1", "z2", "z3"}


def test_too_few_nodes_is_an_error():
    with pytest.raises(PlacementError, match="3 replicas need 3 distinct nodes; only 2"):
        place(N(("a", "z", 1), ("b", "z", 1)), 1, 3)
    with pytest.raises(ValueError):
        place(FOUR_ONE_ZONE, 0, 3)


def test_eligible_excludes_draining_and_full():
    nodes = N(("a", "z", 10), ("b", "z", 10), ("c", "z", 0))
    assert set(eligible(nodes, exclude=["a"], min_free_bytes=G)) == {"b"}


@pytest.mark.parametrize("replicas, expect", [
    (["a1", "b1"], "c1"),        # a new zone (z3) beats more free space (a2)
    (["a1", "b1", "c1"], "a2"),  # every zone used: the most free space
    (["a2", "b2", "c1", "a1", "b1"], None),
])
def test_pick_spare(replicas, expect):
    assert pick_spare(THREE_ZONES, replicas) == expect
