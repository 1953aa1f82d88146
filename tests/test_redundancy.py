"""Redundancy is never silently lost: real etcd, real manager, real datanodes.

* A node never keeps a copy for a view that does not name it (datanode/ops/partitions.py ``install_view``,
  datanode/etcdagent.py ``_apply``): such a copy is one no leader repairs and no view counts, while the
  manager, seeing the node hold the partition, gives it no new replica of it.
* The active manager tracks the partitions below their replica count and raises an alarm (log, metrics,
  ``dnctl cluster status``) when one stays under for longer than its bound (manager/redundancy.py).
"""
from __future__ import annotations

import re
import signal
import urllib.request

import pytest
import trio

from client.sdk import ClientError
from wire.etcdmap import Etcd
from wire.protocol import Op
from tests.conftest import create_partition, free_port, open_client, run
from tests.test_etcd import ETCD_NODE, etcd, managed_partition, managers, wait_for  # noqa: F401 - fixtures
from tools.etcd_cluster import etcd_binary

try:
    etcd_binary()
except FileNotFoundError as e:      # ./dev installs etcd-server; a bare checkout may not have it
    pytestmark = pytest.mark.skip(reason=str(e))

HEAL_S = 90.0           # bound for every partition to be back at its replica count, all synced (2 busy cores)


def full(v, want: int = 3) -> bool:
    """At its replica count, every replica synced, installed and taking writes."""
    return (v is not None and len(v.replicas) == want and set(v.synced) == set(v.replicas) and v.installed
            and v.state == "writable")


async def _trash_of(dc, addr: str, pid: int) -> list[dict]:
    return [t for t in await dc.admin(addr, Op.TRASH_LIST) if t["partition"] == pid]


async def _held_by(et: Etcd, addr: str, pid: int) -> bool:
    return str(pid) in ((await et.nodes()).get(addr, {}).get("partitions") or {})


def test_a_view_without_the_node_is_dropped_not_installed(nodes, etcd, managers):  # noqa: F811
    """The hand-off race, made deterministic: a leader whose probe of a follower crossed the change that
    removed that follower pushes it the new view, which does not name it (datanode/repair.py ``_probe`` ->
    ``_push_view``).  The follower must drop its copy (to its trash), not install it; stopped (SIGTERM) and
    started again, it is an ordinary spare and the partition is back to 3 synced replicas.  (Before the fix it
    kept the copy at the map's epoch: nothing dropped or refilled it, the partition stayed at 2 replicas.)"""
    e, ns, et = managed_partition(nodes, etcd, managers)
    c = ns[2]

    async def main():
        v = await et.part(1)
        assert c.addr in v.replicas and v.leader != c.addr
        without = [r for r in v.replicas if r != c.addr]
        async with open_client("tcp") as dc:
            try:
                await dc.admin(c.addr, Op.PARTITION_UPDATE, partition=1,
                               body={"replicas": without, "epoch": v.epoch + 1})
            except ClientError as err:
                print(f"push answered {err}")
        c.stop()
        await wait_for("the stopped node out of the view", lambda: _view_ok(et, 1, lambda x: c.addr not in x.replicas))
        c.start()
        back = await wait_for("3 synced replicas again", lambda: _view_ok(et, 1, full), timeout=HEAL_S)
        assert c.addr in back.replicas
        async with open_client("tcp") as dc:
            assert await _trash_of(dc, c.addr, 1), "the dropped copy is not in the node's trash"
    run(main)


def test_a_copy_kept_at_the_maps_epoch_without_the_node_is_dropped_at_start(nodes, etcd, managers):  # noqa: F811
    """The state an earlier version left behind: a copy at the map's own epoch, for a view that does not name
    its node (it installed such a view).  Started, the node re-reads the map and drops it (equal epochs were
    skipped before: the copy stayed, the partition at 2 replicas), and the partition is refilled."""
    import json
    e, ns, et = managed_partition(nodes, etcd, managers)
    c = ns[2]

    async def main():
        c.kill(signal.SIGKILL)            # no hand-off: the manager removes it once its lease lapses
        v = await wait_for("the killed node out of the view", lambda: _view_ok(
            et, 1, lambda x: c.addr not in x.replicas and x.installed))
        meta = c.root / "data" / "partitions" / "1" / "meta.json"
        m = json.loads(meta.read_text())
        m.update(epoch=v.epoch, replicas=v.replicas)      # what installing that view wrote
        meta.write_text(json.dumps(m))
        c.start()
        back = await wait_for("3 synced replicas again", lambda: _view_ok(et, 1, full), timeout=HEAL_S)
        assert c.addr in back.replicas
        async with open_client("tcp") as dc:
            assert await _trash_of(dc, c.addr, 1), "the dropped copy is not in the node's trash"
    run(main)


def test_manager_has_a_stale_copy_dropped_that_its_node_could_not_drop(nodes, etcd, managers, tmp_path):  # noqa: F811
    """A node back after it was replaced keeps its copy when the view's new leader cannot be asked whether it
    holds every acknowledged byte (here: paused); its agent would try again only at its next re-read of the
    map.  The manager, seeing it report a copy etcd's view does not name, sends it that view once its leader
    answers again: the node drops the copy (checked) and is refilled as a spare."""
    from client import admin
    e, ns, et = managed_partition(nodes, etcd, managers, lease_ttl_s=10)
    a, b, c = ns

    async def main():
        c.kill(signal.SIGKILL)                 # keeps its copy: [a, b, c] at epoch 1
        await wait_for("the killed node out of the view", lambda: _view_ok(
            et, 1, lambda x: c.addr not in x.replicas and x.installed), timeout=60)
        async with open_client("tcp") as dc:   # b leads now: the copy's leader (a) is not the view's
            await admin.set_leader(dc, 1, b.addr, [a.addr, b.addr])
        v = await wait_for("b's lead in etcd", lambda: _view_ok(et, 1, lambda x: x.leader == b.addr and x.installed
                                                                 and set(x.synced) == set(x.replicas)))
        b.proc.send_signal(signal.SIGSTOP)     # (its lease outlasts the pause)
        try:
            c.start()

            async def refused():
                return "cannot be asked" in c.log_path.read_text()
            await wait_for("the node's own drop refused", refused, timeout=8)
        finally:
            b.proc.send_signal(signal.SIGCONT)

        async def told():               # (before the node's own next re-read of the map, RESYNC_S)
            return "told it that view: it dropped the copy" in (tmp_path / "managers" / "manager-m1.log").read_text()
        await wait_for("the manager to have the copy dropped", told, timeout=25)
        back = await wait_for("3 synced replicas again", lambda: _view_ok(et, 1, full), timeout=HEAL_S)
        assert c.addr in back.replicas and back.epoch > v.epoch
        async with open_client("tcp") as dc:
            assert await _trash_of(dc, c.addr, 1), "the dropped copy is not in the node's trash"
    run(main)


async def _view_ok(et: Etcd, pid: int, pred):
    v = await et.part(pid)
    return v if v is not None and pred(v) else None


async def _all_full(et: Etcd, pids: list[int], want: int = 3):
    parts = await et.parts()
    short = [p for p in pids if not full(parts.get(p), want)]
    return True if not short else None


def test_sigterm_handoff_and_restart_restores_every_partition(nodes, etcd, managers):  # noqa: F811
    """A node with a few dozen partitions (leading a third, following the rest) is stopped with SIGTERM (it
    hands off: every partition moves off it) and started again: every partition is back at 3 replicas, all
    synced, within HEAL_S.  The stopping node is paused (SIGSTOP) for a moment while the manager moves its
    partitions, as a loaded node may be: the leaders' probes of it are then in flight across the hand-off,
    and answered at the old epoch once it runs again -- the race that left copies at views without their
    node (each leader pushes it the new view, datanode/repair.py ``_probe``)."""
    count = 36
    e = etcd()
    # a lease long enough for the pause (the hand-off moves the partitions, not a failover); probes outlast it
    ns = nodes(3, etcd=e.url, **{**ETCD_NODE, "lease_ttl_s": 10, "heartbeat_s": 0.2, "replica_timeout": 10.0})
    addrs = [n.addr for n in ns]
    et = Etcd(e.url)
    pids = list(range(1, count + 1))
    c = ns[2]

    async def handing_off():
        kvs, _ = await et.get_prefix(et.key("handoff") + "/")
        return any(k.endswith("/" + c.addr) for k, _v, _r in kvs)

    async def moved():
        parts = await et.parts()
        return all(c.addr not in parts[p].replicas and parts[p].installed for p in pids)

    async def main():
        async with open_client("tcp") as dc:
            for pid in pids:
                k = pid % 3
                await create_partition(dc, pid, addrs[k:] + addrs[:k])
        managers(e.url)
        await wait_for("every partition adopted and writable", lambda: _all_full(et, pids), timeout=HEAL_S)
        c.proc.send_signal(signal.SIGTERM)
        await wait_for("the hand-off asked", handing_off, interval=0.01)
        c.proc.send_signal(signal.SIGSTOP)
        try:
            await wait_for("every partition moved off the paused node", moved, timeout=8)
            await trio.sleep(0.5)
        finally:
            c.proc.send_signal(signal.SIGCONT)
        assert await trio.to_thread.run_sync(lambda: c.proc.wait(timeout=60)) == 0
        c.start()
        try:
            await wait_for(f"all {count} partitions at 3 synced replicas", lambda: _all_full(et, pids),
                           timeout=HEAL_S)
        except AssertionError:
            parts = await et.parts()
            held = (await et.nodes()).get(c.addr, {}).get("partitions") or {}
            short = {p: (parts[p].epoch, parts[p].replicas, held.get(str(p)))
                     for p in pids if not full(parts.get(p))}
            raise AssertionError(f"{len(short)} partition(s) short (epoch, replicas, the node's copy): {short}")
    run(main)


def _metrics(listen: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://{listen}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r"^(dnmanager_under_replicated_\w+) (\S+)$", text, re.M)}


def test_alarm_counts_partitions_below_their_replica_count(nodes, etcd, managers):  # noqa: F811
    """A node gone for good and no spare to take its place: the partitions it held stay below their replica
    count.  The active manager counts them (metrics), says how long the oldest has been under, logs a
    warning once one is under for longer than --under-replicated-warn-s, and the map read the way `dnctl
    cluster status` reads it names them; back at 3 replicas, the count is 0 again."""
    from client import mapadmin
    e = etcd()
    ns = nodes(3, etcd=e.url, **ETCD_NODE)
    addrs = [n.addr for n in ns]
    et = Etcd(e.url)
    listen = f"127.0.0.1:{free_port()}"

    async def main():
        async with open_client("tcp") as dc:
            await create_partition(dc, 1, addrs)
            await create_partition(dc, 2, addrs[1:] + addrs[:1])
        mgr = managers(e.url, metrics_listen=listen, under_replicated_warn_s=1)
        await wait_for("both partitions adopted and writable", lambda: _all_full(et, [1, 2]))
        m = await trio.to_thread.run_sync(_metrics, listen)
        assert m["dnmanager_under_replicated_partitions"] == 0 and m["dnmanager_under_replicated_oldest_seconds"] == 0, m
        st = await mapadmin.under_replicated(et)
        assert st["count"] == 0 and st["of"] == 2 and st["oldest"] is None, st
        ns[2].kill(signal.SIGKILL)

        async def alarmed():
            m = await trio.to_thread.run_sync(_metrics, listen)
            return m if m["dnmanager_under_replicated_over_bound_partitions"] == 2 else None
        m = await wait_for("the alarm on both partitions", alarmed)
        assert m["dnmanager_under_replicated_partitions"] == 2, m
        assert m["dnmanager_under_replicated_oldest_seconds"] >= 1, m
        st = await mapadmin.under_replicated(et)
        assert st["count"] == 2 and sorted(st["partitions"]) == [1, 2], st
        assert st["oldest"]["want"] == 3 and st["oldest"]["live_synced"] == 2, st

        async def logged():
            return "partition 1 under-replicated for" in mgr.log_path.read_text()
        await wait_for("the warning in the manager's log", logged, timeout=10)
        ns[2].start()                        # back: refilled as a spare

        async def cleared():
            m = await trio.to_thread.run_sync(_metrics, listen)
            return m if m["dnmanager_under_replicated_partitions"] == 0 else None
        await wait_for("both partitions back at 3 synced replicas", lambda: _all_full(et, [1, 2]), timeout=HEAL_S)
        m = await wait_for("the alarm cleared", cleared)
        assert m["dnmanager_under_replicated_oldest_seconds"] == 0, m
        assert (await mapadmin.under_replicated(et))["count"] == 0
        text = mgr.log_path.read_text()
        assert len(re.findall(r"partition 1 under-replicated for", text)) == 1, "warned more than once"
        assert "partition 1: back at its replica count" in text
    run(main)


def test_dnctl_cluster_status_shows_under_replicated(tmp_path):
    """`dnctl cluster status` (text and --json) counts the partitions below their replica count, from etcd's
    map, and names the oldest: none on a settled cluster, partition 1 once a node is stopped (3 nodes: no
    spare to refill it)."""
    import json
    import time
    from tests.test_cli import FAST, dnctl
    root = tmp_path / "c"
    dnctl("cluster", "up", "--nodes", 3, "--cluster", root, *FAST, check=True)
    try:
        def status():
            return json.loads(dnctl("cluster", "status", "--cluster", root, "--json").stdout)
        deadline = time.monotonic() + HEAL_S
        while (u := status()["under_replicated"]) is None or u["count"] or not u["of"]:
            assert time.monotonic() < deadline, u
            time.sleep(0.5)
        assert u["oldest"] is None, u
        info = json.loads((root / "cluster.json").read_text())
        dnctl("cluster", "stop-node", info["nodes"][2]["addr"], "--cluster", root, check=True)
        while 1 not in (u := status()["under_replicated"])["partitions"]:
            assert time.monotonic() < deadline, u
            time.sleep(0.5)
        assert u["count"] == len(u["partitions"]) and u["oldest"]["id"] in u["partitions"], u
        assert u["oldest"]["live_synced"] < u["oldest"]["want"], u
        text = dnctl("cluster", "status", "--cluster", root).stdout
        # (the counts may have moved since the --json look: the manager keeps min_writable partitions)
        assert re.search(r"\d+/\d+ partitions under-replicated \(oldest: partition \d+", text), text
    finally:
        dnctl("cluster", "down", "--cluster", root, "--timeout", 10)
