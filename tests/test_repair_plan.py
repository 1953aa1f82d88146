"""The pure decisions of repair, table-driven: when does a follower's difference need repair?"""
import pytest

from datanode.repair import compare_marks

# (leader marks, follower marks, sealed, deleted on leader, previous follower marks) -> (behind, extents, in flight)
CASES = [
    ("identical", {1: 10, 2: 5}, {1: 10, 2: 5}, set(), set(), None, (0, 0, 0)),
    ("open extent, first look: in flight", {1: 10}, {1: 4}, set(), set(), None, (0, 0, 6)),
    ("open extent, still moving", {1: 10}, {1: 6}, set(), set(), {1: 4}, (0, 0, 4)),
    ("open extent, stuck", {1: 10}, {1: 4}, set(), set(), {1: 4}, (6, 1, 0)),
    ("sealed extent differs: repair at once", {1: 1 << 20}, {1: 0}, {1}, set(), None, (1 << 20, 1, 0)),
    ("sealed extent, follower longer", {1: 100}, {1: 150}, {1}, set(), None, (50, 1, 0)),
    ("follower longer, stuck", {1: 100}, {1: 150}, set(), set(), {1: 150}, (50, 1, 0)),
    ("missing on follower, first look", {1: 0, 2: 7}, {1: 0}, set(), set(), None, (0, 0, 7)),
    ("missing on follower, still missing", {1: 0, 2: 7}, {1: 0}, set(), set(), {1: 0}, (7, 1, 0)),
    ("only on follower, deleted on leader", {1: 3}, {1: 3, 9: 40}, set(), {9}, None, (40, 1, 0)),
    ("only on follower, first look", {1: 3}, {1: 3, 9: 40}, set(), set(), None, (0, 0, 0)),
    ("only on follower, seen before", {1: 3}, {1: 3, 9: 40}, set(), set(), {1: 3, 9: 40}, (40, 1, 0)),
    ("disk-full episode: 16 sealed extents", {e: 1 << 20 for e in range(1, 17)}, {e: 0 for e in range(1, 17)},
     set(range(1, 17)), set(), None, (16 << 20, 16, 0)),
]


@pytest.mark.parametrize("name,lm,fm,sealed,deleted,prev,want", CASES, ids=[c[0] for c in CASES])
def test_compare_marks(name, lm, fm, sealed, deleted, prev, want):
    d = compare_marks(lm, fm, sealed, deleted, prev)
    assert (d.behind, d.extents, d.in_flight) == want
    assert bool(d.first) == bool(d.extents)
