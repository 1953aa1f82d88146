"""The cluster manager on etcd: real etcd, real managers, real datanodes (manager/service.py, wire/etcdmap.py).

Each test starts its own single-member etcd on free ports with its data under the test's tmp_path.
"""
from __future__ import annotations

import json
import shutil
import signal

import pytest
import trio

from wire.etcdmap import Etcd, _b64
from wire.protocol import Op, Result
from tests.conftest import create_partition, open_client, pattern, run
from tools.etcd_cluster import EtcdProc, ManagerProc, etcd_binary, etcd_cluster, urls

try:
    etcd_binary()
except FileNotFoundError as e:      # ./dev installs etcd-server; a bare checkout may not have it
    pytestmark = pytest.mark.skip(reason=str(e))

TTL = 2                   # lease TTL of nodes and managers, seconds (etcd's minimum is about 2)
WAIT = 40.0               # generous bound for a cluster to heal (leases, ticks, repair, 2 busy cores)
ETCD_NODE = {"lease_ttl_s": TTL, "heartbeat_s": 0.5}


@pytest.fixture
def etcd(tmp_path):
    procs = []

    def start(name="etcd"):
        p = EtcdProc(tmp_path / name).start()
        procs.append(p)
        return p
    yield start
    for p in procs:
        p.stop()


@pytest.fixture
def etcd3(tmp_path):
    """A 3-member etcd cluster (its members, stopped at teardown)."""
    members = etcd_cluster(tmp_path / "etcd3", 3)
    yield members
    for m in members:
        m.stop()


@pytest.fixture
def managers(tmp_path):
    procs = []

    def start(url, name="m1", **opts):
        # min_writable 0: these tests place partitions by hand; tests/test_placement.py tests the manager's own
        opts = {"lease_ttl_s": TTL, "down_after_s": 0.5, "tick_s": 0.2, "min_writable": 0, **opts}
        p = ManagerProc(tmp_path / "managers", url, name, **opts).start()
        procs.append(p)
        return p
    yield start
    for p in procs:
        if p.alive():
            p.stop()
    for p in procs:
        print(f"----- manager {p.name} -----")
        print("\n".join(p.log_path.read_text(errors="replace").splitlines()[-30:]))


async def wait_for(what: str, probe, timeout: float = WAIT, interval: float = 0.2):
    """Poll ``probe()`` (async) until it returns something truthy; fail naming ``what`` after ``timeout``."""
    last = None
    with trio.move_on_after(timeout):
        while True:
            last = await probe()
            if last:
                return last
            await trio.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


async def view(et: Etcd, pid: int):
    """The partition's view once it is adopted and writable (every replica synced)."""
    v = await et.part(pid)
    return v if v is not None and v.state == "writable" else None


def managed_partition(nodes, etcd, managers, n: int = 3, pid: int = 1, **node_cfg):
    """``n`` datanodes registered in a fresh etcd (``node_cfg``: node.toml keys beyond ETCD_NODE), partition
    ``pid`` on all of them, a manager that has adopted it (writable).  Returns (etcd proc, node procs, Etcd
    client)."""
    e = etcd()
    ns = nodes(n, etcd=e.url, **{**ETCD_NODE, **node_cfg})
    et = Etcd(e.url)

    async def setup():
        async with open_client("tcp") as dc0:
            await create_partition(dc0, pid, [x.addr for x in ns])
        managers(e.url)
        await wait_for(f"partition {pid} adopted and writable", lambda: view(et, pid))
    run(setup)
    return e, ns, et


def test_registration_under_lease(nodes, etcd, tmp_path):
    e = etcd()
    ns = nodes(2, etcd=e.url, zone="z1", **ETCD_NODE)
    et = Etcd(e.url)

    async def main():
        async with open_client("tcp") as dc:
            await create_partition(dc, 7, [n.addr for n in ns])
        recs = await wait_for("both nodes registered", lambda: _nodes_with(et, 2))
        assert recs[ns[0].addr]["zone"] == "z1"
        assert recs[ns[0].addr]["pid"] == ns[0].pid
        assert recs[ns[0].addr]["free_bytes"] > 0
        await wait_for("partition 7 in the registration",
                       lambda: _has_part(et, ns[0].addr, 7))
        ns[1].kill(signal.SIGKILL)
        left = await wait_for("the killed node's lease to lapse", lambda: _nodes_exactly(et, {ns[0].addr}))
        assert set(left) == {ns[0].addr}
    run(main)


async def _nodes_with(et, n):
    recs = await et.nodes()
    return recs if len(recs) >= n else None


async def _nodes_exactly(et, addrs):
    recs = await et.nodes()
    return recs if set(recs) == addrs else None


async def _has_part(et, addr, pid):
    recs = await et.nodes()
    return str(pid) in (recs.get(addr, {}).get("partitions") or {})


async def _writer(dc, pid, stop: trio.Event, acked: list, errors: list, size=64 << 10):
    """Writes numbered blobs until ``stop``; records every acknowledged (seed, locations)."""
    i = 0
    while not stop.is_set():
        i += 1
        data = pattern(1000 + i, size)
        try:
            locs = await dc.write(pid, data)
        except Exception as e:   # noqa: BLE001 - the test asserts on these
            errors.append(repr(e))
            await trio.sleep(0.1)
            continue
        acked.append((1000 + i, size, locs))
        await trio.sleep(0.01)


async def _verify(dc, acked, replicas):
    for seed, size, locs in acked:
        want = pattern(seed, size)
        for addr in replicas:
            got = b"".join([await dc.read_location(loc, replica=addr) for loc in locs])
            assert got == want, f"blob {seed} differs on {addr}"


def test_follower_killed_shrinks_then_rereplicates(nodes, etcd, managers):
    e = etcd()
    ns = nodes(4, etcd=e.url, **ETCD_NODE)
    addrs = [n.addr for n in ns[:3]]
    spare = ns[3].addr
    et = Etcd(e.url)

    async def main():
        async with open_client("tcp") as dc0:
            await create_partition(dc0, 1, addrs)
        managers(e.url)
        await wait_for("partition 1 adopted and writable", lambda: view(et, 1))
        async with open_client("tcp", etcd=e.url, timeout=20) as dc:
            stop, acked, errors = trio.Event(), [], []
            async with trio.open_nursery() as n:
                n.start_soon(_writer, dc, 1, stop, acked, errors)
                await wait_for("some writes", lambda: _true(len(acked) >= 5))
                ns[2].kill(signal.SIGKILL)                  # a follower
                before = len(acked)
                shrunk = await wait_for("the set to shrink", lambda: _view_where(
                    et, 1, lambda v: addrs[2] not in v.replicas))
                assert shrunk.leader == addrs[0]
                await wait_for("writes after the shrink", lambda: _true(len(acked) >= before + 5))
                full = await wait_for("re-replication onto the spare", lambda: _view_where(
                    et, 1, lambda v: v.state == "writable" and len(v.replicas) == 3 and v.installed))
                assert spare in full.replicas and set(full.synced) == set(full.replicas)
                more = len(acked)
                await wait_for("writes after re-replication", lambda: _true(len(acked) >= more + 3))
                stop.set()
            assert errors == [], errors
            await _verify(dc, acked, full.replicas)
    run(main)


async def _true(x):
    return x


async def _view_where(et, pid, pred):
    v = await et.part(pid)
    return v if v is not None and pred(v) else None


def test_leader_killed_fails_over_no_acked_write_lost(nodes, etcd, managers):
    e = etcd()
    ns = nodes(3, etcd=e.url, **ETCD_NODE)
    addrs = [n.addr for n in ns]
    et = Etcd(e.url)

    async def main():
        async with open_client("tcp") as dc0:
            await create_partition(dc0, 1, addrs)
        managers(e.url)
        await wait_for("partition 1 adopted and writable", lambda: view(et, 1))
        async with open_client("tcp", etcd=e.url, timeout=20) as dc, \
                open_client("tcp", etcd=e.url) as watcher:
            stop, acked, errors = trio.Event(), [], []
            async with trio.open_nursery() as n:
                n.start_soon(_writer, dc, 1, stop, acked, errors)
                await wait_for("some writes", lambda: _true(len(acked) >= 5))
                ns[0].kill(signal.SIGKILL)                  # the leader
                before = len(acked)
                new = await wait_for("a new leader", lambda: _view_where(
                    et, 1, lambda v: v.leader != addrs[0] and v.installed))
                assert new.leader in addrs[1:] and addrs[0] not in new.replicas
                # a client that never wrote learns the new leader from its watch alone
                await wait_for("the watching client to learn it",
                               lambda: _true(watcher.partition(1).replicas[0] == new.leader))
                await wait_for("writes after failover", lambda: _true(len(acked) >= before + 5))
                stop.set()
            assert errors == [], errors
            await _verify(dc, acked, new.replicas)
            # the old leader comes back: it drops its stale copy and rejoins as a follower filled by repair
            ns[0].start()
            back = await wait_for("the old leader back as a synced follower", lambda: _view_where(
                et, 1, lambda v: addrs[0] in v.replicas[1:] and v.state == "writable" and v.installed))
            assert back.leader == new.leader and back.epoch > new.epoch
            await _verify(dc, acked, back.replicas)
    run(main)


def test_a_leader_whose_data_directory_goes_away_leaves_the_map_and_is_failed_over(nodes, etcd, managers):
    """The leader's data directory is removed while a client writes: the node refuses writes (it could not
    keep them) and leaves etcd at once (revokes its lease), so the manager fails the partition over to a
    replica that holds the data, as for a dead node; the writer goes on there without an error (the SDK waits
    for the new view on DISK_ERROR) and every acknowledged blob reads back from every new replica."""
    e, ns, et = managed_partition(nodes, etcd, managers)
    addrs = [n.addr for n in ns]

    async def main():
        async with open_client("tcp", etcd=e.url, timeout=20) as dc:
            stop, acked, errors = trio.Event(), [], []
            async with trio.open_nursery() as n:
                n.start_soon(_writer, dc, 1, stop, acked, errors)
                await wait_for("some writes", lambda: _true(len(acked) >= 5))
                shutil.rmtree(ns[0].cfg["data_dir"])
                await wait_for("the leader to leave etcd", lambda: _nodes_exactly(et, set(addrs[1:])))
                new = await wait_for("a new leader", lambda: _view_where(
                    et, 1, lambda v: v.leader != addrs[0] and v.installed))
                assert new.leader in addrs[1:] and addrs[0] not in new.replicas
                before = len(acked)
                await wait_for("writes after failover", lambda: _true(len(acked) >= before + 5))
                stop.set()
            assert errors == [], errors
            st = await dc.admin(addrs[0], Op.NODE_STATUS)
            assert "was removed" in st["data_dir_lost"]
            await _verify(dc, acked, new.replicas)
    run(main)


def test_standby_manager_takes_over(nodes, etcd, managers):
    e = etcd()
    ns = nodes(3, etcd=e.url, **ETCD_NODE)
    addrs = [n.addr for n in ns]
    et = Etcd(e.url)

    async def main():
        async with open_client("tcp") as dc0:
            await create_partition(dc0, 1, addrs)
        m1 = managers(e.url, "m1")
        first = await wait_for("m1 active", lambda: _manager(et))
        assert first.startswith("m1@")
        m2 = managers(e.url, "m2")
        await wait_for("partition 1 adopted and writable", lambda: view(et, 1))
        await trio.sleep(1)
        assert (await _manager(et)).startswith("m1@")       # the standby stays a standby
        m1.kill(signal.SIGKILL)
        second = await wait_for("m2 to take over", lambda: _manager_named(et, "m2@"))
        assert second.startswith("m2@") and m2.alive()
        # the new active manager does the work: kill a follower, the set shrinks
        ns[2].kill(signal.SIGKILL)
        await wait_for("the set to shrink under m2", lambda: _view_where(
            et, 1, lambda v: addrs[2] not in v.replicas and v.installed))
        async with open_client("tcp", etcd=e.url) as dc:
            locs = await dc.write(1, b"after takeover" * 1000)
            assert b"".join([await dc.read_location(loc) for loc in locs]) == b"after takeover" * 1000
    run(main)


async def _manager(et):
    got = await et.get(et.manager_key)
    return got[0].decode() if got else None


async def _manager_named(et, prefix):
    m = await _manager(et)
    return m if m and m.startswith(prefix) else None


def test_map_snapshot_json(nodes, etcd, managers):
    """The admin view (for `dnctl partition list --etcd URL --json`) lists nodes, partitions, manager."""
    from wire.etcdmap import snapshot
    e = etcd()
    ns = nodes(2, etcd=e.url, **ETCD_NODE)
    et = Etcd(e.url)

    async def main():
        async with open_client("tcp") as dc0:
            await create_partition(dc0, 3, [n.addr for n in ns])
        managers(e.url)
        await wait_for("partition 3 adopted and writable", lambda: view(et, 3))
        snap = json.loads(json.dumps(await snapshot(et)))
        assert [p["id"] for p in snap["partitions"]] == [3]
        p = snap["partitions"][0]
        assert p["leader"] == ns[0].addr and p["epoch"] == 1 and p["state"] == "writable"
        assert {n["addr"] for n in snap["nodes"]} == {n.addr for n in ns}
        assert snap["manager"].startswith("m1@")
    run(main)


def test_etcd_member_loss_then_etcd_down(nodes, etcd3, managers):
    """Kill one of 3 etcd members: a follower's death is still handled; stop all of them: reads and
    writes on the existing partition go on with the map every process already has."""
    url = urls(etcd3)
    ns = nodes(3, etcd=url, **ETCD_NODE)
    addrs = [n.addr for n in ns]
    et = Etcd(url)

    async def main():
        async with open_client("tcp") as dc0:
            await create_partition(dc0, 1, addrs)
        managers(url)
        await wait_for("partition 1 adopted and writable", lambda: view(et, 1))
        async with open_client("tcp", etcd=url, timeout=20) as dc:
            stop, acked, errors = trio.Event(), [], []
            async with trio.open_nursery() as n:
                n.start_soon(_writer, dc, 1, stop, acked, errors)
                await wait_for("some writes", lambda: _true(len(acked) >= 5))
                etcd3[0].kill()                              # the member everybody talks to first
                ns[2].kill(signal.SIGKILL)
                shrunk = await wait_for("the set to shrink", lambda: _view_where(
                    et, 1, lambda v: addrs[2] not in v.replicas and v.installed))
                before = len(acked)
                await wait_for("writes after the shrink", lambda: _true(len(acked) >= before + 5))
                for m in etcd3[1:]:
                    m.kill()
                before = len(acked)
                await trio.sleep(TTL + 2)                    # past every lease: nobody can reach etcd
                await wait_for("writes with etcd down", lambda: _true(len(acked) >= before + 20))
                stop.set()
            assert errors == [], errors
            await _verify(dc, acked, shrunk.replicas)
    run(main)


def test_paused_leader_cannot_ack_at_old_epoch(nodes, etcd, managers):
    """SIGSTOP the leader past its lease: the manager fails over; after SIGCONT a client that still has the
    old map gets no acknowledgement from the old leader at the old epoch."""
    from client.sdk import ClientError
    e = etcd()
    ns = nodes(3, etcd=e.url, **ETCD_NODE)
    addrs = [n.addr for n in ns]
    et = Etcd(e.url)

    async def main():
        async with open_client("tcp") as old:            # its map comes from the nodes: it never hears of etcd
            await create_partition(old, 1, addrs)
            managers(e.url)
            await wait_for("partition 1 adopted and writable", lambda: view(et, 1))
            eid = await old.create_extent(1)
            first = await old.append(1, eid, 0, b"a" * 4096)
            ns[0].proc.send_signal(signal.SIGSTOP)
            try:
                new = await wait_for("a new leader", lambda: _view_where(
                    et, 1, lambda v: v.leader != addrs[0] and v.installed))
            finally:
                ns[0].proc.send_signal(signal.SIGCONT)
            assert old.partition(1).epoch == 1 and old.partition(1).replicas[0] == addrs[0]
            with pytest.raises(ClientError) as ei:
                await old.append(1, eid, 4096, b"b" * 4096)
            # fenced (its lease expired), or already dropped its stale copy: never a forward at epoch 1
            assert ei.value.result in (Result.NOT_LEADER, Result.NOT_FOUND), ei.value
            async with open_client("tcp", etcd=e.url) as dc:
                assert dc.partition(1).replicas[0] == new.leader
                for addr in new.replicas:                 # the acknowledged append is there, nothing after it
                    assert await dc.read(1, eid, 0, 4096, replica=addr) == b"a" * 4096
                    marks = await dc.watermarks(1, addr)
                    assert marks[eid] == 4096, (addr, marks)
                assert first.length == 4096
    run(main)


def test_paused_leader_self_fences_until_reregistered(nodes, etcd):
    """No manager: nobody moves the partition, so only self-fencing can refuse.  A write sent to the leader
    while it is paused past its lease is refused (NOT_LEADER, "self-fenced") when it resumes, although every
    replica is still at its epoch; once it has re-registered (a new lease) it leads again."""
    from client.sdk import ClientError
    e = etcd()
    ns = nodes(3, etcd=e.url, **ETCD_NODE)
    addrs = [n.addr for n in ns]
    et = Etcd(e.url)

    async def main():
        async with open_client("tcp", timeout=20) as dc:
            await create_partition(dc, 1, addrs)
            await wait_for("the leader registered", lambda: _has_part(et, addrs[0], 1))
            first_lease = await _lease_of(et, addrs[0])
            eid = await dc.create_extent(1)
            await dc.append(1, eid, 0, b"a" * 4096)
            ns[0].proc.send_signal(signal.SIGSTOP)
            try:
                await wait_for("the paused leader's lease to lapse", lambda: _nodes_exactly(et, set(addrs[1:])))
                result = []

                async def late_append():
                    try:
                        result.append(await dc.append(1, eid, 4096, b"b" * 4096))
                    except ClientError as err:
                        result.append(err)
                async with trio.open_nursery() as n:
                    n.start_soon(late_append)          # queued in the paused node's socket
                    await trio.sleep(0.3)
                    ns[0].proc.send_signal(signal.SIGCONT)
            finally:
                ns[0].proc.send_signal(signal.SIGCONT)
            err = result[0]
            assert isinstance(err, ClientError) and err.result == Result.NOT_LEADER, err
            for addr in addrs:                         # nothing of the refused append landed anywhere
                assert (await dc.watermarks(1, addr))[eid] == 4096
            await wait_for("the leader re-registered", lambda: _lease_changed(et, addrs[0], first_lease))
            loc = await dc.append(1, eid, 4096, b"c" * 4096)
            assert loc.length == 4096
            for addr in addrs:
                assert await dc.read(1, eid, 0, 8192, replica=addr) == b"a" * 4096 + b"c" * 4096
            st = await dc.admin(addrs[0], Op.NODE_STATUS)
            assert st["counters"]["fenced"] >= 1
    run(main)


async def _lease_of(et, addr):
    r = await et._post("/kv/range", {"key": _b64(et.node_key(addr))})
    kvs = r.get("kvs", [])
    return kvs[0].get("lease") if kvs else None


async def _lease_changed(et, addr, old):
    lease = await _lease_of(et, addr)
    return lease is not None and lease != old
