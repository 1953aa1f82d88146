"""Replica health per node pair (datanode/health.py) with real datanode processes: an idle leader's probes
of a follower node do not grow with the partitions they share, and a follower copy that changes while the
partitions are idle is still caught and repaired."""
from __future__ import annotations

import os

import trio

from wire.protocol import OP_SINCE, Op
from tests.conftest import SLACK, create_partition, open_client, pattern, run
from tests.test_repair import assert_identical, extent_file, follower
from client import admin as dr

HB = 0.25
CFG = {"heartbeat_s": HB, "repair_interval_s": 3600.0, "repair_mib_s": 0.0, "scrub_interval_s": 0.0,
       "scrub_mib_s": 0.0}


async def all_healthy(dc, leader: str, pids, timeout: float = 60.0) -> None:
    with trio.fail_after(timeout):
        for pid in pids:
            while True:
                h = await dr.health(dc, leader, pid)
                if h.get("followers") and all(f["state"] == "healthy" for f in h["followers"]):
                    break
                await trio.sleep(HB)


async def fill(dc, addrs: list[str], pids, size: int) -> None:
    """Create each partition of ``pids`` on ``addrs`` (leader first) and write ``size`` bytes into it."""
    for pid in pids:
        await create_partition(dc, pid, addrs)
        await dc.write(pid, pattern(pid, size))


async def requests_per_beat(dc, addr: str, seconds: float) -> float:
    """Requests ``addr`` served per heartbeat over ``seconds`` (less the status requests that measure it)."""
    a = (await dc.admin(addr, Op.NODE_STATUS))["counters"]["requests"]
    await trio.sleep(seconds)
    b = (await dc.admin(addr, Op.NODE_STATUS))["counters"]["requests"]
    return (b - a - 1) / (seconds / HB)


def test_idle_probes_of_a_follower_node_do_not_grow_with_the_partitions(nodes, client):
    """An idle leader of 4 partitions and of 64 partitions on the same two followers: each follower serves
    about as many requests per heartbeat either way (one per partition per beat would be 16 times as many)."""
    a, b, c = nodes(3, **CFG)
    addrs = [a.addr, b.addr, c.addr]

    async def main():
        async with client(addrs) as dc:
            await fill(dc, addrs, range(1, 5), 10_000)
            await all_healthy(dc, a.addr, range(1, 5))
            few = await requests_per_beat(dc, b.addr, 3.0)
            await fill(dc, addrs, range(5, 65), 10_000)
            await all_healthy(dc, a.addr, range(1, 65))
            await trio.sleep(2 * HB)
            many = await requests_per_beat(dc, b.addr, 3.0)
            print(f"follower requests per heartbeat: {few:.2f} with 4 partitions, {many:.2f} with 64")
            assert many <= 2 * few + 1, (few, many)
            st = (await dc.admin(a.addr, Op.NODE_STATUS))["counters"]
            assert st["health_beats"] > 0 and st["health_node_probes"] > 0, st
    run(main)


def test_a_follower_copy_cut_on_disk_while_idle_is_caught_and_repaired(nodes, client):
    """Among idle partitions, one follower's copy of one partition is cut short on its disk while it is
    down (the others stay identical); once it is back the leader finds the difference within a few
    heartbeats and repairs it, and every copy is identical again."""
    a, b, c = nodes(3, **CFG)
    addrs = [a.addr, b.addr, c.addr]
    victim = 3

    async def main():
        async with client(addrs) as dc:
            await fill(dc, addrs, range(1, 9), 300_000)
            await all_healthy(dc, a.addr, range(1, 9))
            await trio.sleep(4 * HB)           # idle: every partition is skipped by the node's prober now
            eid = min(await dc.watermarks(victim, a.addr))
            copied = (await dc.admin(a.addr, Op.NODE_STATUS))["counters"]["repair_bytes"]
            b.stop()
            path = extent_file(b, victim, eid)
            os.truncate(path, 100_000)
            b.start()
            t0 = trio.current_time()
            with trio.fail_after(10 * HB + 2 * SLACK + 10):
                while True:
                    h = await dr.health(dc, a.addr, victim)
                    if (follower(h, b.addr)["state"] == "healthy"
                            and (await dc.watermarks(victim, b.addr)) == (await dc.watermarks(victim, a.addr))):
                        break
                    await trio.sleep(HB / 2)
            copied = (await dc.admin(a.addr, Op.NODE_STATUS))["counters"]["repair_bytes"] - copied
            assert copied >= 300_000 - 100_000 - 128 * 1024, copied    # (from the block the cut fell in)
            print(f"cut copy caught and repaired {trio.current_time() - t0:.2f}s after the follower started")
            for pid in range(1, 9):
                await assert_identical(dc, addrs, pid)
    run(main)


def test_a_follower_of_the_previous_version_is_probed_per_partition(nodes, tmp_path):
    """A follower speaking the version before NODE_HEALTH: the leader probes its partitions one by one as
    before (and the follower of this build once per beat), and both stay healthy.  Over TCP, as every
    version-skew test (tests/test_skew.py starts its nodes so)."""
    from tests.test_skew import MIN_VERSION, _start, build
    before = OP_SINCE[Op.NODE_HEALTH] - 1
    old = build(tmp_path / "prev", before, MIN_VERSION)
    a, b, c = _start(nodes, [None, old, None], **CFG)
    addrs = [a.addr, b.addr, c.addr]

    async def main():
        async with open_client("tcp", addrs) as dc:
            await fill(dc, addrs, range(1, 9), 10_000)
            await all_healthy(dc, a.addr, range(1, 9))
            conns = {x["identity"]: x for x in (await dc.admin(b.addr, Op.NODE_STATUS))["connections"]
                     if x["identity"]}
            assert conns[a.addr]["version"] == before, conns            # the leader's link to it
            p0 = (await dc.admin(a.addr, Op.NODE_STATUS))["counters"]["health_partition_probes"]
            per_beat = await requests_per_beat(dc, c.addr, 3.0)
            p1 = (await dc.admin(a.addr, Op.NODE_STATUS))["counters"]["health_partition_probes"]
            beats = 3.0 / HB
            assert per_beat <= 2, per_beat                      # this build: one NODE_HEALTH a beat
            assert 8 * beats * 0.5 <= p1 - p0 <= 8 * (beats + 4), (p0, p1)   # the old one: each partition
            await all_healthy(dc, a.addr, range(1, 9), timeout=10)
    run(main)


def test_node_health_answers_come_in_pages_that_cover_each_partition_once(monkeypatch):
    """The tokens of the partitions the asker leads, from ``start`` up, at most a page each; ``next`` is
    where the following page starts (None: the last)."""
    from types import SimpleNamespace as NS
    from datanode import health
    monkeypatch.setattr(health, "PAGE", 3)
    parts = {pid: NS(pid=pid, leader="L" if pid % 3 else "M", epoch=1, cuts=0, synced=True,
                     store=NS(changes=pid)) for pid in range(1, 21)}
    table = NS(parts=parts, get=parts.get, all=lambda: list(parts.values()))
    seen, start, pages = [], 0, 0
    while start is not None:
        page = health.tokens_page(table, "L", start)
        assert len(page["tokens"]) <= 3
        seen += [pid for pid, _ in page["tokens"]]
        start, pages = page["next"], pages + 1
    assert seen == [pid for pid in range(1, 21) if pid % 3] and pages == 5
    assert {pid for pid, _ in health.tokens_page(table, "", 0)["tokens"]} == {1, 2, 3}     # an admin: all
    parts[4].store.changes += 1
    assert dict(health.tokens_page(table, "L", 4)["tokens"])[4] != health.follower_token(NS(**{
        **vars(parts[4]), "store": NS(changes=4)}))


def test_a_new_replica_not_created_yet_is_not_probed_each_beat_then_filled(nodes, client):
    """A leader has a view naming a follower that does not hold the partition yet (the manager's new replica,
    whose create comes after the view): once told so, the leader probes and repairs it no more than its
    node's NODE_HEALTH lists it -- not a REPLICA_STATE and a repair pass per partition and heartbeat -- and
    as soon as the copy is created there, it is filled and found healthy."""
    a, b = nodes(2, **CFG)
    pids = list(range(1, 25))

    async def main():
        async with client([a.addr]) as dc:
            for pid in pids:       # on a only, naming b
                await dc.admin(a.addr, Op.PARTITION_CREATE, partition=pid,
                               body={"replicas": [a.addr, b.addr], "epoch": 1})
            await trio.sleep(6 * HB)                # told NOT_FOUND by b, by each partition's first probe
            per_beat = await requests_per_beat(dc, b.addr, 3.0)
            print(f"b served {per_beat:.2f} requests per heartbeat for {len(pids)} partitions it lacks")
            assert per_beat <= 4, per_beat          # (NODE_HEALTH, not 2 per partition)
            for pid in pids:       # created on b now, at the same view
                await dc.admin(b.addr, Op.PARTITION_CREATE, partition=pid,
                               body={"replicas": [a.addr, b.addr], "epoch": 1})
            await all_healthy(dc, a.addr, pids, timeout=30)
    run(main)
