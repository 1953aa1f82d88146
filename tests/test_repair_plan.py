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


def test_same_size_different_digest_needs_repair_at_once():
    lm, fm = {1: 100, 2: 50}, {1: 100, 2: 40}
    d = compare_marks(lm, fm, set(), set(), None, {1: 0xAAAA, 2: 7}, {1: 0xBBBB, 2: 7})
    assert (d.behind, d.extents, d.in_flight) == (100, 1, 10) and "digest" in d.first
    d = compare_marks(lm, fm, set(), set(), None, {1: 0xAAAA, 2: 7}, {1: 0xAAAA, 2: 9})   # sizes differ: in flight
    assert (d.behind, d.extents, d.in_flight) == (0, 0, 10)
    d = compare_marks(lm, fm, set(), set(), None, {1: 0xAAAA}, None)                     # an old follower
    assert d.extents == 0


def test_store_digest_tracks_the_bytes(tmp_path):
    from datanode.store import BLOCK, ExtentStore
    with ExtentStore(tmp_path / "a", "none") as a, ExtentStore(tmp_path / "b", "none") as b:
        for s in (a, b):
            s.create_extent(1)
            s.write(1, 0, b"x" * (BLOCK + 10))
        assert a.digests() == b.digests()
        b.truncate(1, 5)
        b.write(1, 5, b"y" + b"x" * (BLOCK + 4))               # same size, one byte differs in block 0
        assert a.digests()[1][0] == b.digests()[1][0] and a.digests()[1][1] != b.digests()[1][1]
        b.truncate(1, 5)
        b.write(1, 5, b"x" * (BLOCK + 5))                       # the same bytes again: the same digest
        assert a.digests() == b.digests()
