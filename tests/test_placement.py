"""Placement decisions (manager/placement.py), table-tested: pure functions, no processes."""
from __future__ import annotations

import functools
from collections import Counter

import pytest

from manager.placement import PlacementError, eligible, pick_spare, place

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


def test_nearly_equal_free_space_goes_to_the_least_loaded():
    nodes = {"a": {"free_bytes": 100 * G + 5}, "b": {"free_bytes": 100 * G}, "c": {"free_bytes": 99 * G},
             "d": {"free_bytes": 50 * G}}
    assert set(place(nodes, 1, 2, held={"a": 3, "b": 1, "c": 0})[0]) == {"b", "c"}     # d: far less room
    assert set(place(nodes, 1, 2)[0]) == {"a", "b"}                                    # no load: exact free


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


# -- with real processes: etcd, a manager, datanodes ----------------------------------------------------------
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import time  # noqa: E402
import pathlib  # noqa: E402

import trio  # noqa: E402

from client import admin  # noqa: E402
from wire.etcdmap import Etcd, PartView  # noqa: E402
from wire.protocol import Op  # noqa: E402
from tests.conftest import dnctl as conftest_dnctl  # noqa: E402
from tests.conftest import open_client, pattern, run  # noqa: E402
from tests.test_etcd import ETCD_NODE, etcd, managers, wait_for  # noqa: E402,F401 - fixtures used below

NODE = {**ETCD_NODE, "replica_timeout": 2.0}
MGR = {"min_free_mib": 1}


dnctl = functools.partial(conftest_dnctl, no_traceback=True)


async def _writable(et, n):
    parts = await et.parts()
    good = [v for v in parts.values() if v.state == "writable" and v.installed]
    return parts if len(good) >= n else None


def test_manager_places_and_keeps_min_writable(nodes, etcd, managers):
    """min_writable partitions appear by themselves (and no more); `partition create --count 4 --replicas 3`
    spreads the replicas: distinct nodes, both zones in each partition, every node takes its share."""
    e = etcd()
    ns = nodes(2, etcd=e.url, zone="za", **NODE) + nodes(2, etcd=e.url, zone="zb", **NODE)
    zone = {n.addr: ("za" if i < 2 else "zb") for i, n in enumerate(ns)}
    et = Etcd(e.url)

    async def main():
        managers(e.url, min_writable=2, **MGR)
        first = await wait_for("min_writable partitions", lambda: _writable(et, 2))
        await trio.sleep(2)                                  # and it stops there
        parts = await et.parts()
        assert len(parts) == 2, {p: v.replicas for p, v in parts.items()}
        for v in parts.values():
            assert len(set(v.replicas)) == 3 and {zone[a] for a in v.replicas} == {"za", "zb"}
        # one of them deleted by an admin: it leaves the map and the manager makes another one
        gone = min(first)
        p = await trio.to_thread.run_sync(lambda: dnctl("partition", "delete", "--id", gone, "--replicas",
                                                        ",".join(first[gone].replicas)))
        assert p.returncode == 0, p.stderr
        await wait_for("the deleted partition to leave the map", lambda: _gone(et, gone))
        first = await wait_for("min_writable kept", lambda: _writable(et, 2))
        assert gone not in first and len(first) == 2, sorted(first)
        p = await trio.to_thread.run_sync(lambda: dnctl("partition", "create", "--count", 4, "--replicas", 3,
                                                        "--etcd", e.url, "--json"))
        assert p.returncode == 0, p.stderr
        made = json.loads(p.stdout)["partitions"]
        assert len(made) == 4 and not {m["id"] for m in made} & set(first)
        per_node = {}
        for m in made:
            assert len(set(m["replicas"])) == 3, m               # never two replicas on one node
            assert {zone[a] for a in m["replicas"]} == {"za", "zb"}, m
            for a in m["replicas"]:
                per_node[a] = per_node.get(a, 0) + 1
        assert sorted(per_node.values()) == [3, 3, 3, 3], per_node
        leaders = [v.leader for v in (await et.parts()).values()]
        assert max(leaders.count(a) for a in set(leaders)) <= 2, leaders   # 6 partitions, 4 nodes
        # each node really hosts what etcd says, and the map lists them for scripts
        async with open_client("tcp") as dc:
            for m in made:
                for a in m["replicas"]:
                    assert m["id"] in [q["id"] for q in await dc.admin(a, Op.PARTITION_LIST)]
        p = await trio.to_thread.run_sync(lambda: dnctl("partition", "list", "--etcd", e.url, "--json"))
        rows = json.loads(p.stdout)
        assert {r["id"] for r in rows} == set(first) | {m["id"] for m in made}
        assert all({"id", "replicas", "leader", "epoch", "state"} <= set(r) for r in rows)
        # too many replicas: a clear refusal, nothing created
        p = await trio.to_thread.run_sync(lambda: dnctl("partition", "create", "--replicas", 5, "--etcd", e.url))
        assert p.returncode == 1 and "5 replicas need 5 distinct nodes" in p.stderr, p.stderr
        assert len(await et.parts()) == 6
    run(main)


async def _gone(et, pid):
    return pid not in await et.parts()


@pytest.mark.parametrize("record", ["ids", "views"])       # as managers write it; as earlier versions did
def test_a_create_request_half_served_by_a_dead_manager_is_finished_not_repeated(nodes, etcd, managers, record):
    """A manager that dies while serving `partition create --count 3` leaves, in one etcd transaction each,
    the partitions it published and their record in the request (``made``).  The manager that takes over
    creates only the missing ones: the admin gets 3 partitions and etcd holds 3, not 4."""
    e = etcd()
    ns = nodes(3, etcd=e.url, **NODE)
    addrs = [n.addr for n in ns]
    et = Etcd(e.url)

    async def main():
        # what the dead manager left: partition 1 on its nodes and in etcd, recorded in the pending request
        async with open_client("tcp") as dc:
            await admin.create_partition(dc, 1, addrs)
        first = PartView(1, addrs, 1, want=3, synced=list(addrs), state="writable", installed=True)
        key = et.key("requests", "half-served")
        body = {"op": "create", "count": 3, "replicas": 3, "state": "pending",
                "made": [1] if record == "ids" else [first.to_dict()]}
        assert await et.cas_part(first, expect_rev=0, also=(key, body))
        managers(e.url, **MGR)

        async def answered():
            got = await et.get(key)
            req = json.loads(got[0]) if got else {}
            return req if req.get("state") != "pending" else None
        req = await wait_for("the request to be answered", answered)
        assert req["state"] == "done", req
        assert len(req["partitions"]) == 3 and req["partitions"][0]["id"] == 1, req
        assert req["partitions"][0]["replicas"] == addrs, req
        parts = await et.parts()
        assert sorted(parts) == sorted(p["id"] for p in req["partitions"]), sorted(parts)
        async with open_client("tcp") as dc:              # each one really exists on its replicas
            for p in req["partitions"]:
                for a in p["replicas"]:
                    assert p["id"] in [q["id"] for q in await dc.admin(a, Op.PARTITION_LIST)]
    run(main)


def test_a_create_that_died_half_way_leaves_no_copies_behind(nodes, etcd, managers):
    """A manager killed while creating a partition -- on its followers, not yet on its leader (the leader is
    created last) -- leaves copies that no map names and nobody adopts.  The next manager removes them, to
    the nodes' trash, once the leader has been registered without the partition for --unfinished-after-s;
    a whole partition created by hand beside it is adopted and keeps its bytes."""
    e = etcd()
    ns = nodes(3, etcd=e.url, **NODE)
    addrs = [n.addr for n in ns]
    et = Etcd(e.url)
    data = pattern(5, 100_000)

    async def holders(pid):
        async with open_client("tcp") as dc:
            return [a for a in addrs if pid in [q["id"] for q in await dc.admin(a, Op.PARTITION_LIST)]]

    async def main():
        async with open_client("tcp", addrs) as dc:
            for a in addrs[1:]:                      # what the dead manager left: the followers' copies only
                await dc.admin(a, Op.PARTITION_CREATE, partition=5, body={"replicas": addrs, "epoch": 1})
            await admin.create_partition(dc, 6, addrs)        # and a whole one, with data
            await dc.discover(addrs[0])
            [loc] = await dc.write(6, data)
        managers(e.url, unfinished_after_s=2, **MGR)
        await wait_for("the half-created copies removed", lambda: _none(holders, 5))
        parts = await et.parts()
        assert 5 not in parts and 6 in parts, sorted(parts)
        for n in ns[1:]:                              # in the trash (kept trash_retention_s), not destroyed
            assert list((pathlib.Path(n.cfg["data_dir"]) / "trash").glob("5.*")), n.addr
        assert await holders(6) == addrs
        async with open_client("tcp", addrs) as dc:
            for a in addrs:
                assert await dc.read(6, loc.extent, loc.offset, loc.length, replica=a) == data
    run(main)


async def _none(probe, *args):
    return not await probe(*args)


def test_a_manager_without_rdma_says_once_which_verbs_only_nodes_it_cannot_reach(etcd, managers):
    """A node registered with transport = "verbs" cannot be reached from a manager on a host without an RDMA
    device (as here): its log says so, naming the node, once -- not a failure per request."""
    e = etcd()
    et = Etcd(e.url)
    addr = "127.0.0.9:7001"

    async def main():
        await et.put(et.key("nodes", addr), json.dumps({"addr": addr, "transport": "verbs", "partitions": {},
                                                        "capacity_bytes": 1 << 40, "free_bytes": 1 << 40}),
                     await et.grant(60))          # a registration lives under its node's lease
        m = managers(e.url, **MGR)
        text = await wait_for("the warning", lambda: _log_has(m, f"node {addr} takes only RDMA verbs"))
        await trio.sleep(1.5)                                 # several passes later: still once
        assert m.log_path.read_text().count(f"node {addr} takes only RDMA verbs") == 1, text
    run(main)


async def _log_has(proc, text):
    got = proc.log_path.read_text(errors="replace")
    return got if text in got else None


def test_decommission_empties_node_and_data_reads_back(nodes, etcd, managers):
    e = etcd()
    nodes(4, etcd=e.url, **NODE)
    et = Etcd(e.url)

    async def main():
        managers(e.url, min_writable=2, **MGR)
        await wait_for("two writable partitions", lambda: _writable(et, 2))
        acked = []
        async with open_client("tcp", etcd=e.url, timeout=20) as dc:
            for i in range(24):
                data = pattern(500 + i, 200_000)
                acked.append((data, await dc.put(data)))
            parts = await et.parts()
            victim = parts[min(parts)].leader                 # it leads a partition: leadership moves too
            held = [p for p, v in parts.items() if victim in v.replicas]
            assert held
            p = await trio.to_thread.run_sync(lambda: dnctl("node", "decommission", victim, "--etcd", e.url,
                                                            "--json", "--timeout", 120))
            assert p.returncode == 0, p.stderr
            res = json.loads(p.stdout)
            assert res["done"] and res["remaining"] == [] and res["held_by_node"] == []
            assert set(res["moved"]) == {str(p) for p in held}
            after = await et.parts()
            for v in after.values():
                assert victim not in v.replicas and v.installed and set(v.synced) == set(v.replicas)
                assert len(v.replicas) == 3
            rec = (await et.nodes())[victim]
            assert rec["partitions"] == {}                     # it dropped its copies
            await dc.load_map()
            for data, locs in acked:                           # intact from every new replica
                for loc in locs:
                    for a in after[loc.partition].replicas:
                        got = await dc.read_location(loc, replica=a)
                        assert got == data[sum(x.length for x in locs[:locs.index(loc)]):][:loc.length], a
            # no new replica goes to a decommissioned node, even to keep min_writable
            p = await trio.to_thread.run_sync(lambda: dnctl("partition", "create", "--count", 2, "--replicas", 3,
                                                            "--etcd", e.url, "--json"))
            assert p.returncode == 0, p.stderr
            assert all(victim not in m["replicas"] for m in json.loads(p.stdout)["partitions"])
    run(main)


def test_follower_killed_writer_moves_on_stale_copy_dropped(nodes, etcd, managers):
    """kill -9 a node that leads nothing during a stream of SDK puts: the writer sees no error (its writes
    go to other partitions), every acknowledged write reads back; restarted, the node drops the copies it
    was replaced on."""
    e = etcd()
    ns = nodes(4, etcd=e.url, **NODE)
    et = Etcd(e.url)

    async def main():
        managers(e.url, min_writable=3, **MGR)
        parts = await wait_for("three writable partitions", lambda: _writable(et, 3))
        leaders = {v.leader for v in parts.values()}
        victim = next(n for n in ns if n.addr not in leaders
                      and any(n.addr in v.replicas for v in parts.values()))    # a follower only
        hit = {p for p, v in parts.items() if victim.addr in v.replicas}
        assert hit
        async with open_client("tcp", etcd=e.url, timeout=20) as dc:
            stop, acked, errors = trio.Event(), [], []

            async def writer():
                i = 0
                while not stop.is_set():
                    i += 1
                    data = pattern(9000 + i, 96 << 10)
                    try:
                        locs = await dc.put(data)
                    except Exception as ex:  # noqa: BLE001 - asserted below
                        errors.append(repr(ex))
                        continue
                    acked.append((data, locs, trio.current_time()))
            async with trio.open_nursery() as n:
                n.start_soon(writer)
                await wait_for("some writes", lambda: _val(len(acked) >= 10))
                victim.kill(signal.SIGKILL)
                t_kill = trio.current_time()
                await wait_for("the partitions it was in to shrink or move", lambda: _none_name(et, victim.addr))
                before = len(acked)
                await wait_for("writes after", lambda: _val(len(acked) >= before + 10))
                stop.set()
            assert errors == [], errors
            assert dc.put_failovers >= 1          # a put did hit the dead node, and went on elsewhere
            later = {loc.partition for _d, locs, t in acked if t > t_kill + 1 for loc in locs}
            assert later, "no write acknowledged after the kill"
            await dc.load_map()
            for data, locs, _t in acked:
                got = b"".join([await dc.read_location(loc) for loc in locs])
                assert got == data
            # no extent is left behind by a failed attempt: once the map has settled, the next put takes
            # back the ones that got no acknowledged byte, and every extent a leader has holds acked data
            await wait_for("the map to settle", lambda: _settled(et))
            await dc.load_map()
            acked.append((b"x" * 1000, await dc.put(b"x" * 1000), 0))
            assert dc._abandoned == {}, dc._abandoned
            used = {(loc.partition, loc.extent) for _d, locs, _t in acked for loc in locs}
            for pid, v in (await et.parts()).items():
                for eid, size in (await dc.watermarks(pid, v.leader)).items():
                    assert (pid, eid) in used, (pid, eid, size)
        victim.start()
        dropped = await wait_for("the returning node to drop its stale copies",
                                 lambda: _dropped(et, victim.addr, hit))
        assert dropped
    run(main)


async def _val(x):
    return x


async def _none_name(et, addr):
    parts = await et.parts()
    return all(addr not in v.replicas for v in parts.values() if v.installed) and parts


async def _settled(et):
    parts = await et.parts()
    return all(v.installed and v.state in ("writable", "degraded") for v in parts.values()) and parts


async def _dropped(et, addr, pids):
    rec = (await et.nodes()).get(addr)
    if rec is None:
        return False
    parts = await et.parts()
    held = {int(p) for p in rec.get("partitions") or {}}
    # a copy it still holds must be one etcd names it in again (re-replicated there), never a stale one
    return all(p not in held or addr in parts[p].replicas for p in pids) and rec


def test_one_command_cluster_put_without_partition(tmp_path):
    """`dnctl cluster up` runs etcd + a manager + nodes, all authenticated; `put` without --partition
    goes where the client picks and reads back; status lists etcd and the manager with pids; `cluster down` stops all of them."""
    from tools import cluster as cl
    root = tmp_path / "c"
    p = dnctl("cluster", "up", "--nodes", 3, "--cluster", root, "--replica-timeout", 2, "--json")
    assert p.returncode == 0, p.stderr
    up = json.loads(p.stdout)
    try:
        # with the secret: the nodes refuse whoever lacks it, so the manager's min_writable partition below
        # proves the manager authenticates as admin, and dnctl --cluster picks the secret up by itself
        assert (root / "cluster.secret").exists() and up["config"]["secret_file"]
        assert up["etcd"]["managed"] and cl.pid_alive(up["etcd"]["pid"]) and len(up["managers"]) == 1
        src = tmp_path / "f.bin"
        src.write_bytes(os.urandom(3_000_000))
        p = dnctl("put", "--cluster", root, src, "--json")
        assert p.returncode == 0, p.stderr
        put = json.loads(p.stdout)
        assert put["size"] == 3_000_000 and put["partitions"]
        got = b""
        for loc in put["locations"]:
            out = tmp_path / "piece"
            q = dnctl("get", "--cluster", root, "--partition", loc["partition"], "--extent", loc["extent"],
                      "--offset", loc["offset"], "--length", loc["length"], "--out", out)
            assert q.returncode == 0, q.stderr
            got += out.read_bytes()
        assert got == src.read_bytes()
        text = dnctl("put", "--cluster", root, src).stdout
        assert text.startswith("partition "), text
        # etcd's map for scripts: partition 1 (made by `up`) and the manager's min_writable one
        deadline = time.monotonic() + 30
        while True:
            rows = json.loads(dnctl("partition", "list", "--cluster", root, "--json").stdout)
            if len([r for r in rows if r["state"] == "writable"]) >= 2 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert {r["id"] for r in rows} >= {1} and len(rows) >= 2, rows
        for r in rows:
            assert r["leader"] == r["replicas"][0] and r["epoch"] >= 1 and r["state"] == "writable"
        p = dnctl("cluster", "status", "--cluster", root, "--json")
        st = json.loads(p.stdout)
        assert p.returncode == 0 and st["healthy"], p.stdout
        assert [e["health"] for e in st["etcd"]] == ["up"] and st["etcd"][0]["pid"] == up["etcd"]["pid"]
        assert [m["health"] for m in st["managers"]] == ["active"]
        assert st["managers"][0]["pid"] == up["managers"][0]["pid"]
        # --no-etcd / --etcd together: refused cleanly
        p = dnctl("cluster", "up", "--cluster", tmp_path / "x", "--no-etcd", "--etcd", "http://127.0.0.1:1")
        assert p.returncode == 2 and "not both" in p.stderr
    finally:
        p = dnctl("cluster", "down", "--cluster", root, "--timeout", 10)
    assert p.returncode == 0, p.stderr
    for pid in [up["etcd"]["pid"], up["managers"][0]["pid"]] + [n["pid"] for n in up["nodes"]]:
        assert not cl.pid_alive(pid), pid
