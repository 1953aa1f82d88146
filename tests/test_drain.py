"""Controlled shutdown and rolling restarts (datanode/drain.py, manager/tasks.py ``hand_off``,
``dnctl node drain``, ``dnctl cluster rolling-restart``): real etcd, a real manager, real datanodes, a real
FUSE mount.  What a user would notice: writes go on without an error while nodes stop, leadership moves
before the stopping node exits, the node leaves etcd at once, and every acknowledged byte ends up on every
replica."""
from __future__ import annotations

import functools
import json
import os
import pathlib
import signal
import subprocess
import time

import pytest
import trio

from client.sdk import ClientError
from datanode.config import ClusterConfig
from datanode.drain import Drain, NodeControl, movable, still_held
from manager.tasks import handoff_plan
from tests.conftest import create_partition, open_client, pattern, print_tails, run
from tests.conftest import dnctl as conftest_dnctl
from lab import rolling
from tests.test_dnfs import dnfs
from tests.test_etcd import etcd, managed_partition, managers, view, wait_for  # noqa: F401 - fixtures
from tools import cluster as cl
from tools.etcd_cluster import etcd_binary
from wire.etcdmap import Etcd, PartView, open_channel

try:
    etcd_binary()
except FileNotFoundError as e:
    pytestmark = pytest.mark.skip(reason=str(e))

MiB = 1 << 20
REC = 64 << 10                   # one write of the streams below


dnctl = functools.partial(conftest_dnctl, timeout=300)     # a drain moves every partition the node holds


# -- the decisions, without sockets ---------------------------------------------------------------------------
def _view(replicas, synced=None, **kw) -> PartView:
    return PartView(7, list(replicas), 4, want=len(replicas), synced=list(synced if synced is not None else replicas),
                    **kw)


def test_handoff_plan():
    live = {"a", "b", "c"}
    # a leaving leader hands over to the first synced replica that stays; the others stay in order
    assert handoff_plan(_view("abc"), {"a"}, live) == (["b", "c"], "")
    assert handoff_plan(_view("abc", synced="ac"), {"a"}, live) == (["c", "b"], "")
    # a leaving follower is left out; the leader stays
    assert handoff_plan(_view("abc"), {"b"}, live) == (["a", "c"], "")
    assert handoff_plan(_view("abc"), {"b", "c"}, live) == (["a"], "")
    # nothing to do, or nothing that can be done now (and why)
    assert handoff_plan(_view("abc"), {"d"}, live) == (None, "")
    assert "in sync" in handoff_plan(_view("abc", synced="a"), {"a"}, live)[1]
    assert "every replica" in handoff_plan(_view("ab"), {"a", "b"}, live)[1]
    assert "down" in handoff_plan(_view("abc"), {"a"}, {"a", "b"})[1]
    assert "installed" in handoff_plan(_view("abc", installed=False), {"a"}, live)[1]
    assert "read_only" in handoff_plan(_view("abc", state="read_only"), {"a"}, live)[1]


def test_drain_waits_only_for_what_can_move():
    class P:
        def __init__(self, pid, replicas):
            self.pid, self.replicas = pid, replicas
    held = still_held([P(1, ["me", "b"]), P(2, ["me"]), P(3, ["b", "me"])], "me")
    assert [p.pid for p in held] == [1, 3]              # a partition with no other replica has nowhere to go
    assert movable(_view(["me", "b"]), {"me"})
    assert not movable(None, {"me"})                    # etcd does not know it: no manager will move it
    assert not movable(_view(["me", "b"]), {"me", "b"})  # every replica is stopping


def test_a_drain_without_etcd_says_what_stays_and_waits_for_the_requests_in_flight():
    """The stop sequence sees its node only through a NodeControl: here one without etcd, holding a partition
    with another replica and one without, whose last requests end 0.3 s after it stops taking new ones."""
    class P:
        def __init__(self, pid, replicas):
            self.pid, self.replicas = pid, replicas
    inflight, stopped = [2], []

    async def main():
        async def drained():
            pass

        async def leave_etcd():
            return None

        async def requests_end():
            await trio.sleep(0.3)
            inflight[0] = 0
        drain = Drain(NodeControl(
            me="me", cfg=ClusterConfig(drain_timeout_s=10), parts=lambda: [P(1, ["me", "b"]), P(2, ["me"])],
            state=lambda: "serving", inflight=lambda: inflight[0], drained=drained,
            stop_taking=lambda: stopped.append(inflight[0]), agent=None, leave_etcd=leave_etcd))
        assert drain.request("test") and not drain.request("test again")
        t0 = trio.current_time()
        async with trio.open_nursery() as n:
            n.start_soon(requests_end)
            await drain.run(trio.CancelScope())
        return drain, trio.current_time() - t0

    drain, took = trio.run(main)
    p = drain.progress()
    assert stopped == [2] and drain.finished.is_set() and 0.3 <= took < 5, (stopped, took)
    assert p["phase"] == "stopped" and p["inflight"] == 0 and p["handed_off"] == []
    assert any(n.startswith("partition(s) 2 have no other replica") for n in p["notes"]), p["notes"]
    assert any("etcd is not configured): partition(s) 1 not handed off" in n for n in p["notes"]), p["notes"]


def test_sync_pending():
    snap = {"manager": "m", "nodes": [{"addr": "a", "pid": 5}, {"addr": "b", "pid": 6}],
            "partitions": [{"id": 1, "replicas": ["a", "b"], "synced": ["a", "b"], "epoch": 3, "installed": True,
                            "want": 3}]}
    assert cl.sync_pending(snap, {1: 2}, "a", 5) == []
    assert cl.sync_pending(snap, {1: 3}) == ["partition 1: 2 of 3 replicas"]
    assert cl.sync_pending(snap, {1: 2}, "a", 9) == ["a not registered in etcd yet"]      # the old process's
    snap["partitions"][0].update(replicas=["a", "b", "c"])
    assert cl.sync_pending(snap, {1: 2}) == ["partition 1: filling c"]
    snap["partitions"][0]["installed"] = False
    assert cl.sync_pending(snap, {1: 2}) == ["partition 1: installing epoch 3"]
    assert "no active manager" in cl.sync_pending({**snap, "manager": None}, {1: 3})[0]


def test_a_view_installed_during_the_failed_request_ends_the_wait():
    """A planned leader change: the write went to the new leader at epoch 5 while the manager was still
    installing it (refused), and the installed view came by the watch before the SDK looked.  The SDK goes
    on at once instead of waiting for yet another change (its 1 s poll)."""
    from client.routing import PartitionMap

    async def main():
        routes = PartitionMap(None, None)
        routes.learn(PartView(1, ["b", "c"], 5, want=3, synced=["b", "c"], installed=False, rev=10))
        used = routes.partition(1)                          # what the refused write was sent with
        routes.learn(PartView(1, ["b", "c"], 5, want=3, synced=["b", "c"], installed=True, rev=11))
        t0 = trio.current_time()
        assert await routes.await_new_view(1, used.epoch, t0 + 1.0, since_rev=used.rev)
        assert trio.current_time() - t0 < 1.0
        # nothing newer than what the request used: it still waits (here: until the deadline)
        assert not await routes.await_new_view(1, 5, trio.current_time() + 0.05, since_rev=11)
    trio.run(main)


def test_a_write_whose_partition_is_dropped_under_it_is_answered_not_found(tmp_path):
    """A write in flight on a leader whose partition is handed off: its agent drops the copy (to the trash)
    while the write runs, the store closes under it and sealing the extent has no meta.json left to save.  The
    writer hears NOT_FOUND -- the partition moved, its SDK follows the new view -- not an internal error or a
    disk error (which an operator's alert would take for a failing disk), and the node's state is sound."""
    from datanode.ops.base import Request
    from datanode.ops.wrap import Serving
    from datanode.partition import PartitionTable
    from tests.test_write_path import Conn, wrapper
    from wire.protocol import Header, Op, Result

    table = PartitionTable(tmp_path, "always")
    part = table.create(1, ["127.0.0.1:1", "127.0.0.1:2"], 1)
    eid = part.store.create_extent()

    async def dropped_under_it(rq):
        table.delete(1)                                  # the agent, seeing a view that no longer names us
        part.seal(eid, "local flush failed")             # what the failing append does next
        part.store.size(eid)                             # ... and what it hits: the store is closed
    w = wrapper(table, Serving("serving"), tmp=str(tmp_path))
    w.handlers[Op.WRITE] = dropped_under_it
    conn = Conn()
    w.inflight, conn.busy = 1, 1                         # (as arrival counts it)
    trio.run(w._handle, Request(conn, Header(opcode=Op.WRITE, partition=1, extent=eid, epoch=1), None, None,
                                None, 0.0))
    assert [r.result for r in conn.sent] == [Result.NOT_FOUND]
    assert w.inflight == 0 and table.list_trash()[0]["partition"] == 1


# -- a stopping leader under writes (SDK) ----------------------------------------------------------------------
class Writer:
    """A stream of writes through the SDK (following etcd's map): what was acknowledged, the errors, and
    each write's time."""

    def __init__(self):
        self.acked: list[tuple[object, bytes]] = []
        self.errors: list[str] = []
        self.longest = 0.0
        self.stop = trio.Event()

    async def run(self, dc, pid: int):
        i = 0
        while not self.stop.is_set():
            data = pattern(i, REC)
            t0 = trio.current_time()
            try:
                locs = await dc.write(pid, data)
            except ClientError as e:
                self.errors.append(str(e))
                continue
            finally:
                self.longest = max(self.longest, trio.current_time() - t0)
            pos = 0
            for loc in locs:
                self.acked.append((loc, data[pos:pos + loc.length]))
                pos += loc.length
            i += 1


async def _on_every_replica(dc, et: Etcd, acked) -> None:
    v = await et.part(1)
    for addr in v.replicas:
        for loc, data in acked:
            got = await dc.read(loc.partition, loc.extent, loc.offset, loc.length, replica=addr)
            assert got == data, f"{addr}: bytes of {loc} differ"


def test_sigterm_leader_hands_off_under_writes(nodes, etcd, managers):  # noqa: F811
    """SIGTERM of the leader while a client writes: no write fails; etcd's history has the partition at
    epoch + 1 under another leader *before* the node's registration goes (handed off while it still served,
    not failed over after it left); the registration goes the moment the process exits (its lease is
    revoked: the TTL here is a minute); every acknowledged byte is on every replica -- the survivors at once,
    the restarted node once the manager has refilled it."""
    e, ns, et = managed_partition(nodes, etcd, managers, lease_ttl_s=60)
    old = ns[0]
    w = Writer()
    events = []

    async def history(rev, task_status=trio.TASK_STATUS_IGNORED):
        send, recv = open_channel()
        async with trio.open_nursery() as n:
            await n.start(functools.partial(et.watch, et.prefix + "/", send, start_revision=rev + 1))
            task_status.started()
            async for batch in recv:
                events.extend(batch or [])

    def gone_at() -> int | None:
        return next((i for i, (typ, key, _v, _r) in enumerate(events)
                     if typ == "DELETE" and key == et.node_key(old.addr)), None)

    async def main():
        v0 = await et.part(1)
        assert v0.leader == old.addr
        async with open_client("tcp", etcd=e.url) as dc, trio.open_nursery() as n:
            n.start_soon(w.run, dc, 1)
            await wait_for("some writes", lambda: _true(len(w.acked) > 20))
            before = len(w.acked)
            await n.start(history, (await et.get_prefix(et.prefix + "/"))[1])
            old.proc.send_signal(signal.SIGTERM)
            await trio.to_thread.run_sync(old.proc.wait)
            registered = old.addr in await et.nodes()
            await wait_for("the registration's deletion in the history", lambda: _true(gone_at() is not None))
            await wait_for("writes after the hand-off", lambda: _true(len(w.acked) > before + 40))
            w.stop.set()
            n.cancel_scope.cancel()
        assert old.proc.returncode == 0
        assert not registered, "the stopped node's registration outlived it (lease not revoked)"
        views = [(i, et.open(key, v)) for i, (typ, key, v, _r) in enumerate(events)
                 if typ == "PUT" and key == et.part_key(1)]
        assert views, events
        i, first = views[0]
        assert i < gone_at(), "the partition moved only once the node had left etcd (a failover)"
        assert first.epoch == v0.epoch + 1 and first.leader == ns[1].addr and old.addr not in first.replicas
        assert not w.errors, w.errors[:3]
        print(f"writes: {len(w.acked)}, longest {w.longest * 1e3:.0f} ms")
        async with open_client("tcp", etcd=e.url) as dc:
            await _on_every_replica(dc, et, w.acked)
            old.start()                       # back: the manager refills it, then it holds every byte too

            async def refilled():
                v = await et.part(1)
                return v if old.addr in v.replicas and v.state == "writable" else None
            await wait_for("the restarted node refilled", refilled, timeout=60)
            await _on_every_replica(dc, et, w.acked)
    run(main)


async def _true(x):
    return x


# -- dnctl node drain -------------------------------------------------------------------------------------------
def test_dnctl_node_drain(nodes, etcd, managers):  # noqa: F811
    """`dnctl node drain ADDR` stops the node the way SIGTERM does: it reports the partitions handed off, the
    process is gone, and etcd names it nowhere.  A second drain of it is a clear one-line error."""
    e, ns, et = managed_partition(nodes, etcd, managers)
    r = dnctl("node", "drain", ns[1].addr, "--etcd", e.url, "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(r.stdout)
    assert res["stopped"] and res["handed_off"] == [1] and not res["left"], res
    assert res["etcd"] == {"registered": False, "named_by": []}, res
    assert ns[1].proc.wait(timeout=30) == 0
    r = dnctl("node", "drain", ns[1].addr)
    assert r.returncode == 1 and "Traceback" not in r.stderr and ns[1].addr in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_drain_that_cannot_hand_off_stops_in_bounded_time(nodes, etcd, managers):  # noqa: F811
    """A manager that does not act (stopped with SIGSTOP: its key stays in etcd) cannot move anything: the
    node says what is left and why, and stops anyway once drain_timeout_s is up -- no hang."""
    e = etcd()
    ns = nodes(2, etcd=e.url, heartbeat_s=0.5, drain_timeout_s=4)
    et = Etcd(e.url)

    async def setup():
        async with open_client("tcp") as dc:
            await create_partition(dc, 1, [x.addr for x in ns])
        await wait_for("partition 1 adopted", lambda: view(et, 1))
    m = managers(e.url, lease_ttl_s=60)
    run(setup)
    m.proc.send_signal(signal.SIGSTOP)
    try:
        r = dnctl("node", "drain", ns[0].addr, "--etcd", e.url, "--json", "--timeout", "60")
        assert r.returncode == 0, r.stdout + r.stderr
        res = json.loads(r.stdout)
        assert res["stopped"] and list(res["left"]) == ["1"], res
        assert "etcd's view" in res["left"]["1"], res
        assert any("the hand-off did not finish within 3s" in n for n in res["notes"]), res
        assert res["etcd"]["named_by"] == [1]
    finally:
        m.proc.send_signal(signal.SIGCONT)


def test_drain_without_etcd_says_so(nodes):
    """A cluster run by hand: nothing can be handed off; the node says which partitions wait for it, and
    stops."""
    ns = nodes(2)

    async def setup():
        async with open_client("tcp") as dc:
            await create_partition(dc, 1, [x.addr for x in ns])
    run(setup)
    r = dnctl("node", "drain", ns[0].addr, "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads(r.stdout)
    assert res["stopped"] and res["handed_off"] == [], res
    assert any("no cluster map" in n and "1" in n for n in res["notes"]), res
    assert ns[0].proc.wait(timeout=30) == 0


# -- rolling restart under fsync-ed writes through the mount -----------------------------------------------------
@pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="no /dev/fuse")
@pytest.mark.timeout(600)
def test_rolling_restart_under_fsynced_writes_through_the_mount(tmp_path):
    """`dnctl cluster rolling-restart` of a 3-node cluster while two writers append and fsync through a
    dnfs mount: no write fails, every partition is handed off by the stopping nodes (the manager fails
    nothing over), the files read back whole after a remount, and every byte is on every replica of its
    partition.  The longest write stall per node is printed (loaded CI hosts inflate it).  A failure prints
    the rolling restart's progress and the end of every log."""
    root = tmp_path / "dn"
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = dnctl("cluster", "up", "--nodes", "3", "--cluster", root, "--json", timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    mounted = False
    writers: list[rolling.MountWriter] = []
    try:
        run(wait_for, "the manager's partitions writable", lambda: rolling.settled(root), 60)
        dnfs("mount", "--cluster", root, "--log", tmp_path / "mnt.log", mnt)
        mounted = True
        writers = [rolling.MountWriter(mnt / f"w{i}.bin", i) for i in range(2)]
        for w in writers:
            w.start()
        time.sleep(1.0)
        try:         # each wait bounded below the test's timeout, so a stuck step says which it is
            r = dnctl("cluster", "rolling-restart", "--cluster", root, "--json", "--timeout", 45,
                      "--sync-timeout", 90, timeout=480)
        except subprocess.TimeoutExpired as e:
            progress = (e.stderr or b"").decode(errors="replace")       # (run() hands it over undecoded)
            pytest.fail(f"rolling-restart still running after {e.timeout:g}s; its progress:\n{progress}")
        time.sleep(0.5)
        for w in writers:
            w.halt.set()
            w.join(60)
            assert not w.is_alive(), f"{w.path.name}: a write or fsync has not returned for 60s"
        assert r.returncode == 0, r.stdout + r.stderr
        res = json.loads(r.stdout)
        assert res["restarted"] == 3 and all(n["stop"] == "stopped" for n in res["nodes"]), res
        assert all(n["pid"] != n["old_pid"] for n in res["nodes"])
        for w in writers:
            assert not w.errors, w.errors
        mlog = (root / "manager-m1.log").read_text()
        assert mlog.count("stopping: ") >= 3 and "lost its lease" not in mlog and "lost their lease" not in mlog, \
            "partitions were failed over, not handed off:\n" + mlog[-3000:]
        for row in rolling.stall_table(writers, res["nodes"], since=res["nodes"][0]["stopping_at"]):
            print(f"{row['node']:22} longest write+fsync {row['longest_s'] * 1e3:6.0f} ms over {row['writes']} "
                  f"writes, {row['errors']} errors")
        files = {w.path.name: w.data for w in writers}
        dnfs("umount", mnt)
        mounted = False
        dnfs("mount", "--cluster", root, "--log", tmp_path / "mnt2.log", mnt)
        mounted = True
        for name, want in files.items():
            assert (mnt / name).read_bytes() == want, f"{name} reads back other bytes"
        dnfs("umount", mnt)
        mounted = False
        assert rolling.check_replicas(root / "dnfs.db", root, files) == []
    except BaseException:
        for w in writers:
            print(f"{w.path.name}: {len(w.records)} records, errors {w.errors}, last ended "
                  f"{time.time() - w.times[-1][0] if w.times else float('nan'):.1f}s ago")
        print_tails([tmp_path / "mnt.log", root / "manager-m1.log", *sorted(root.glob("node*/node.log"))], 60)
        raise
    finally:
        for w in writers:
            w.halt.set()
        if mounted:
            dnfs("umount", mnt, check=False)
        dnctl("cluster", "down", "--cluster", root)


def test_rolling_restart_stops_at_a_node_that_does_not_come_back(tmp_path):
    """A node that cannot start again (its data directory replaced by a file) stops the rolling restart with
    an error naming it; the nodes after it are not touched.  A cluster with a node down is refused up
    front."""
    root = tmp_path / "dn"
    r = dnctl("cluster", "up", "--nodes", "3", "--cluster", root, "--json", timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    info = json.loads(r.stdout)
    second, third = info["nodes"][1], info["nodes"][2]
    data = pathlib.Path(second["dir"]) / "data"
    try:
        run(wait_for, "the manager's partitions writable", lambda: rolling.settled(root), 60)

        def sabotage(p):
            if p["addr"] == second["addr"] and p["step"] == "stopped":
                data.rename(data.with_name("data.aside"))
                data.write_text("not a directory")
        with pytest.raises(cl.RolloutError, match=f"{second['addr']} did not come back") as err:
            cl.rolling_restart(root, on_progress=sabotage)
        assert "after 1 of 3" in str(err.value)
        assert [n["addr"] for n in err.value.done] == [info["nodes"][0]["addr"], second["addr"]]
        assert cl.node_process(third)[0] == third["pid"], "a node after the failed one was restarted"
        r = dnctl("cluster", "rolling-restart", "--cluster", root)
        assert r.returncode == 1 and "not running" in r.stderr and "Traceback" not in r.stderr, r.stderr
    finally:
        if data.is_file():
            data.unlink()
            data.with_name("data.aside").rename(data)
        dnctl("cluster", "down", "--cluster", root)
