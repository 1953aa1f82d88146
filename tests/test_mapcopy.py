"""A node's copy of ``parts/`` as MAP_READ serves it (datanode/mapcopy.py): changes after a revision, paged
between revisions only, deletions, an entry a re-read found that the watch had missed, the long poll."""
from __future__ import annotations

import json

import trio

from datanode.mapcopy import MapCopy


def _keys(answer: dict) -> list[str]:
    return [k for k, _v, _m in answer["entries"]]


def test_changes_after_a_revision_oldest_first_and_deletions_gone():
    c = MapCopy()
    assert not c.since(0)["ready"]
    c.reload([("/d/parts/1", b"a", 5), ("/d/parts/2", b"b", 7)], 9)
    assert c.since(0) == {"ready": True, "fresh": True, "rev": 9, "more": False,
                          "entries": [["/d/parts/1", "a", 5], ["/d/parts/2", "b", 7]]}
    assert _keys(c.since(5)) == ["/d/parts/2"] and c.since(9)["entries"] == []
    c.event("PUT", "/d/parts/1", b"a2", 10)
    c.event("PUT", "/d/parts/1", b"old", 6)                   # older than what is held: ignored
    c.event("DELETE", "/d/parts/2", b"", 11)
    assert c.since(9)["entries"] == [["/d/parts/1", "a2", 10]] and c.since(9)["rev"] == 11
    assert _keys(c.since(0)) == ["/d/parts/1"]


def test_pages_end_between_revisions_and_say_where():
    c = MapCopy()
    c.reload([(f"/d/parts/{i}", b"x" * 100, 10 + i // 2) for i in range(10)], 20)   # two keys per revision
    got, rev = [], 0
    while True:
        a = c.since(rev, page=150)
        revs = {m for _k, _v, m in a["entries"]}
        assert len(a["entries"]) == 2 and len(revs) == 1, a    # one revision's two entries, never split
        got += _keys(a)
        rev = a["rev"]
        if not a["more"]:
            break
    assert sorted(got) == sorted(f"/d/parts/{i}" for i in range(10)) and rev == 20


def test_an_entry_the_watch_missed_is_served_at_the_reread():
    c = MapCopy()
    c.reload([("/d/parts/1", b"a", 5)], 5)
    c.event("PUT", "/d/parts/1", b"a2", 12)                    # the watch moved the copy to 12 ...
    c.reload([("/d/parts/1", b"a2", 12), ("/d/parts/2", b"b", 8)], 14)   # ... and missed parts/2 at 8
    assert c.since(12)["entries"] == [["/d/parts/2", "b", 8]]  # a client at 12 still gets it


def test_the_long_poll_ends_at_a_change_or_its_bound_or_close():
    async def main():
        c = MapCopy(fresh=lambda: False)
        c.reload([], 3)
        assert c.since(3)["fresh"] is False
        t0 = trio.current_time()
        await c.wait_past(3, 0.3)
        assert trio.current_time() - t0 >= 0.29
        async with trio.open_nursery() as n:
            n.start_soon(lambda: c.wait_past(3, 30))
            await trio.sleep(0.05)
            c.event("PUT", "/d/parts/1", b"a", 4)
        c2 = MapCopy()
        c2.reload([], 1)
        async with trio.open_nursery() as n:
            n.start_soon(lambda: c2.wait_past(1, 30))
            await trio.sleep(0.05)
            c2.close()
        assert trio.current_time() - t0 < 5
    trio.run(main)


def test_an_answer_is_encoded_once_for_every_client_that_asks_it_until_the_copy_changes():
    fresh = [True]
    c = MapCopy(fresh=lambda: fresh[0])
    before = c.answer(0)
    assert json.loads(before)["ready"] is False
    c.reload([(f"/d/parts/{i}", b"v", 5 + i) for i in range(100)], 200)
    first = c.answer(0)
    assert first is c.answer(0) and json.loads(first) == c.since(0)     # the same bytes for the next client
    assert json.loads(c.answer(150, page=64)) == c.since(150, page=64)
    fresh[0] = False                                      # cut off from etcd: said at once, no change needed
    assert json.loads(c.answer(0))["fresh"] is False
    fresh[0] = True
    c.event("PUT", "/d/parts/3", b"w", 201)
    woken = c.answer(200)
    assert json.loads(woken)["entries"] == [["/d/parts/3", "w", 201]] and woken is c.answer(200)
    assert json.loads(c.answer(0)) == c.since(0) and ["/d/parts/3", "w", 201] in c.since(0)["entries"]
