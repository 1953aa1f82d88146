"""etcd kept bounded and its clients sized: real etcd members, a real manager (manager/etcdcare.py,
wire/etcdmap.py, tools/etcd_cluster.py).

* many etcd calls at once through one ``Etcd`` reuse its connections (no "Connection pool is full");
* the members ``tools/etcd_cluster.py`` starts compact their history on their own and have a quota;
* the active manager defragments a member whose file is much larger than its use, also under etcd's
  authentication (defragment is an admin RPC there: the manager's maintenance user);
* a node's registration is rewritten at a bounded byte rate during a burst of new partitions;
* admin requests beyond what the client's pool holds queue instead of failing.
"""
from __future__ import annotations

import logging

import pytest
import trio

from tests.conftest import run
from tools.etcd_cluster import EtcdProc, etcd_binary

try:
    etcd_binary()
except FileNotFoundError as e:
    pytestmark = pytest.mark.skip(reason=str(e))


def test_concurrent_calls_reuse_connections(tmp_path, caplog):
    e = EtcdProc(tmp_path / "etcd").start()
    try:
        from wire.etcdmap import Etcd
        et = Etcd(e.url, timeout=10)
        caplog.set_level(logging.WARNING, logger="urllib3.connectionpool")

        async def go():
            await et.put(et.key("x"), "v" * 4096)
            async with trio.open_nursery() as n:     # trio's thread limiter: 40 under way at once
                for _ in range(400):
                    n.start_soon(et.get, et.key("x"))
        run(go)
        full = [r.getMessage() for r in caplog.records if "pool is full" in r.getMessage()]
        assert not full, f"{len(full)} connections thrown away, e.g. {full[0]}"
    finally:
        e.stop()


def test_admin_requests_beyond_the_pool_wait_their_turn(nodes):
    """Far more admin requests at once than the client's pool has answers for (the manager moving many
    partitions): they queue for it, none fails for memory."""
    from tests.conftest import open_client
    from wire.protocol import Op
    node, = nodes(1)
    failed = []

    async def go():
        async with open_client("tcp", pool_mib=2, timeout=0.5) as dc:
            async def one():
                try:
                    await dc.admin(node.addr, Op.NODE_STATUS)
                except Exception as e:               # noqa: BLE001 -- counted, shown below
                    failed.append(str(e))
            async with trio.open_nursery() as n:
                for _ in range(1500):
                    n.start_soon(one)
    run(go)
    assert not failed, f"{len(failed)} of 1500 failed, e.g. {failed[0]}"


def _status(url: str) -> dict:
    import json
    import urllib.request
    req = urllib.request.Request(url + "/v3/maintenance/status", data=b"{}", method="POST")
    with urllib.request.urlopen(req, timeout=10) as r:
        s = json.loads(r.read())
    return {"size": int(s["dbSize"]), "in_use": int(s["dbSizeInUse"])}


def _fragment(url: str, access, mib: int = 40) -> None:
    """Grow the member's file by ``mib`` MiB of values, then delete and compact them away: free pages."""
    from wire.etcdmap import _b64, client
    c = client(url, access, timeout=30)
    blob = _b64(b"x" * (512 << 10))
    for i in range(mib * 2):
        c.post(c.get_url("/kv/put"), json={"key": _b64(f"junk/{i}"), "value": blob})
    r = c.post(c.get_url("/kv/deleterange"), json={"key": _b64("junk/"), "range_end": _b64("junk0")})
    c.post(c.get_url("/kv/compaction"), json={"revision": int(r["header"]["revision"]), "physical": True})
    c.post(c.get_url("/kv/put"), json={"key": _b64("junk-done"), "value": ""})   # commits the freed pages


def test_members_run_with_compaction_and_a_quota(tmp_path):
    from tools.etcd_cluster import COMPACTION_RETENTION, QUOTA_BACKEND_BYTES
    e = EtcdProc(tmp_path / "etcd").start()
    try:
        argv = open(f"/proc/{e.proc.pid}/cmdline", "rb").read().decode().split("\0")
        assert argv[argv.index("--auto-compaction-mode") + 1] == "periodic"
        assert argv[argv.index("--auto-compaction-retention") + 1] == COMPACTION_RETENTION
        assert int(argv[argv.index("--quota-backend-bytes") + 1]) == QUOTA_BACKEND_BYTES
    finally:
        e.stop()


@pytest.mark.timeout(240)
def test_active_manager_defragments_under_etcd_auth(tmp_path):
    """Under etcd's authentication the manager's own user may not defragment: it warns, naming what to do;
    given the maintenance user (etcd's root role) it defragments the member and logs it."""
    import time
    from tools.etcd_cluster import ManagerProc, setup_auth
    from wire.etcdmap import EtcdAccess
    e = EtcdProc(tmp_path / "etcd").start()
    mgr = None
    try:
        auth = setup_auth(e.url, tmp_path / "auth", maintenance=True)
        _fragment(e.url, EtcdAccess.load(auth["root"]))
        deadline = time.monotonic() + 30                 # etcd frees compacted pages in the background
        while (before := _status(e.url))["size"] - before["in_use"] < 30 << 20 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert before["size"] - before["in_use"] >= 30 << 20, before
        opts = {"etcd_credentials": auth["manager"], "min_writable": 0, "lease_ttl_s": 2,
                "etcd_defrag_check_s": 0.5, "etcd_defrag_min_free_mib": 8}

        def wait_log(m, text: str, timeout: float = 60) -> str:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                log = m.log_path.read_text(errors="replace") if m.log_path.exists() else ""
                if text in log:
                    return log
                assert m.alive(), log[-2000:]
                time.sleep(0.3)
            raise AssertionError(f"no {text!r} in {m.log_path}:\n{log[-2000:]}")

        mgr = ManagerProc(tmp_path / "m", e.url, "m1", **opts).start()
        wait_log(mgr, "--etcd-maintenance-credentials")
        assert _status(e.url)["size"] >= before["size"] - (1 << 20)     # left alone
        mgr.stop()
        mgr = ManagerProc(tmp_path / "m", e.url, "m2", etcd_maintenance_credentials=auth["maintenance"],
                          **opts).start()
        log = wait_log(mgr, "defragmented in")
        after = _status(e.url)
        assert after["size"] < 8 << 20, (before, after, log[-2000:])
        assert "failed" not in log, log[-2000:]
    finally:
        if mgr is not None:
            mgr.stop()
        e.stop()


def test_a_burst_of_new_partitions_rewrites_the_registration_at_a_bounded_rate(nodes, tmp_path):
    """A node's registration lists every partition it holds: while hundreds are created one after another it
    is rewritten at most at REPUBLISH_BYTES_PER_S (every version it had is read back from etcd's history),
    not once per partition."""
    import time
    from datanode.etcdagent import REPUBLISH_BYTES_PER_S
    from tests.conftest import open_client
    from wire.etcdmap import Etcd, _b64
    from wire.protocol import Op
    e = EtcdProc(tmp_path / "etcd").start()
    try:
        node, = nodes(1, etcd=e.url, lease_ttl_s=2, heartbeat_s=0.5)
        et = Etcd(e.url, timeout=10)
        key = et.node_key(node.addr)

        async def go():
            async with open_client("tcp") as dc:
                for pid in range(1, 501):
                    await dc.admin(node.addr, Op.PARTITION_CREATE, partition=pid,
                                   body={"replicas": [node.addr], "epoch": 1})
            await trio.sleep(2)
            for _ in range(100):                    # until the last rewrite lists all of them
                raw, rev = await et.get(key)
                if raw.count(b'"replicas"') == 500:
                    return rev
                await trio.sleep(0.2)
            raise AssertionError("the registration never listed all 500 partitions")
        t0 = time.monotonic()
        rev = run(go)
        elapsed = time.monotonic() - t0
        sizes = []

        async def history():
            r = rev
            while r:                                # each version, newest first, through its mod revision
                body = {"key": _b64(key), "revision": r}
                got = await et.call(lambda c: c.post(c.get_url("/kv/range"), json=body))
                kv = got["kvs"][0]
                sizes.append(len(kv.get("value", "")) * 3 // 4)
                r = int(kv["mod_revision"]) - 1 if int(kv["version"]) > 1 else 0
        run(history)
        written = sum(sizes[:-1])                  # every rewrite after the first registration
        assert written <= REPUBLISH_BYTES_PER_S * elapsed + max(sizes), (len(sizes), written, elapsed)
    finally:
        e.stop()
