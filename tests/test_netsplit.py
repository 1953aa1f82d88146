"""Network partition: a datanode in its own network namespace, cut off during writes, then healed.

The test creates a namespace and a veth pair (a private /30: host side .1, namespace side .2; no route
anywhere else).  etcd, the manager and the other datanodes listen on the host side's address, the isolated
datanode on the namespace side's.  It needs root and ``ip netns``; otherwise it is skipped with the reason.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import trio

from wire.etcdmap import Etcd
from tests.conftest import NODE_DEFAULTS, create_partition, open_client, run
from tests.test_etcd import TTL, _true, _verify, _view_where, _writer, view, wait_for
from tools.cluster import NodeProc, free_port
from tools.etcd_cluster import EtcdProc, ManagerProc, etcd_binary

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ip(*args, ns: str | None = None, check=True):
    argv = ["ip", *(["netns", "exec", ns, "ip"] if ns else []), *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=20, check=check)


@pytest.fixture
def netns():
    """(namespace, host-side interface, host address, namespace address); removed at teardown."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create a network namespace and a veth pair")
    try:
        etcd_binary()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    pid = os.getpid()
    ns, vh, vn = f"dnsplit{pid}", f"dnh{pid % 10**8}", f"dnn{pid % 10**8}"
    third, base = (pid // 64) % 256, (pid % 64) * 4
    host, inner = f"10.213.{third}.{base + 1}", f"10.213.{third}.{base + 2}"
    try:
        _ip("netns", "add", ns)
    except (OSError, subprocess.SubprocessError) as e:
        pytest.skip(f"ip netns is not available here: {getattr(e, 'stderr', '') or e}")
    try:
        _ip("link", "add", vh, "type", "veth", "peer", "name", vn)
        _ip("link", "set", vn, "netns", ns)
        _ip("addr", "add", f"{host}/30", "dev", vh)
        _ip("link", "set", vh, "up")
        _ip("addr", "add", f"{inner}/30", "dev", vn, ns=ns)
        _ip("link", "set", vn, "up", ns=ns)
        _ip("link", "set", "lo", "up", ns=ns)
    except subprocess.CalledProcessError as e:
        _ip("link", "del", vh, check=False)
        _ip("netns", "del", ns, check=False)
        pytest.skip(f"cannot set up a veth pair: {e.stderr.strip()}")
    yield ns, vh, host, inner
    _ip("link", "del", vh, check=False)
    _ip("netns", "del", ns, check=False)


# A client *inside* the namespace: it knows only the old map (epoch 1, the isolated node leads) and keeps
# appending to it through the cut.  Every append it reports OK must be on the final replicas: an old leader
# acknowledging anything the new leader does not have would be split brain.
NS_CLIENT = r"""
import json, os, random, sys, time, trio
from client.sdk import ClientError, DataClient
addr, out, stop = sys.argv[1:4]

async def main():
    async with DataClient.open(transport="tcp", timeout=3, pool_mib=8) as dc:
        await dc.discover(addr)
        eid, off, i = None, 0, 0
        with open(out, "a") as f:
            while not os.path.exists(stop):
                i += 1
                data = random.Random(i).randbytes(4096)
                rec = {"t": time.time(), "seed": i, "epoch": dc.partition(1).epoch}
                try:
                    if eid is None:
                        eid, off = await dc.create_extent(1), 0
                    rec.update(extent=eid, offset=off)
                    await dc.append(1, eid, off, data)
                    rec["ok"] = True
                    off += len(data)
                except ClientError as e:
                    rec.update(ok=False, err=str(e))
                    eid = None
                f.write(json.dumps(rec) + "\n")
                f.flush()
                await trio.sleep(0.05)

trio.run(main)
"""


def test_isolated_leader_cut_then_healed(netns, nodes, tmp_path):
    ns, vh, host, inner = netns
    e = EtcdProc(tmp_path / "etcd", host=host).start()
    mgr = None
    ns_client = None
    try:
        cfg = {**NODE_DEFAULTS, "transport": "tcp", "etcd": e.url, "lease_ttl_s": TTL, "heartbeat_s": 0.5,
               "insecure": True}                # hosts of their own, no secret
        iso = NodeProc(tmp_path / "iso", f"{inner}:{7400 + os.getpid() % 1000}", **cfg)
        iso.argv_prefix = ["ip", "netns", "exec", ns]
        others = [NodeProc(tmp_path / f"n{i}", f"{host}:{free_port(host)}", **cfg) for i in range(3)]
        nodes.procs.extend([iso, *others])
        for p in (iso, *others):
            p.start()
        replicas = [iso.addr, others[0].addr, others[1].addr]           # others[2]: the spare
        et = Etcd(e.url)
        out, stop = tmp_path / "ns-client.jsonl", tmp_path / "ns-client.stop"

        async def main():
            nonlocal mgr, ns_client
            async with open_client("tcp") as dc0:
                await create_partition(dc0, 1, replicas)
            mgr = ManagerProc(tmp_path / "managers", e.url, "m1", lease_ttl_s=TTL, down_after_s=0.5,
                              tick_s=0.2).start()
            await wait_for("partition 1 adopted and writable", lambda: view(et, 1))
            ns_client = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c", NS_CLIENT, iso.addr,
                                          str(out), str(stop)], cwd=ROOT, stdout=subprocess.DEVNULL,
                                         stderr=open(tmp_path / "ns-client.log", "wb"))
            async with open_client("tcp", etcd=e.url, timeout=10) as dc:
                stop_w, acked, errors = trio.Event(), [], []
                async with trio.open_nursery() as n:
                    n.start_soon(_writer, dc, 1, stop_w, acked, errors)
                    await wait_for("some writes", lambda: _true(len(acked) >= 5))
                    await wait_for("the namespace client's first acks", lambda: _true(_ns_oks(out) >= 3))
                    _ip("link", "set", vh, "down")                          # cut
                    new = await wait_for("a new leader while the old one is cut off", lambda: _view_where(
                        et, 1, lambda v: v.leader != iso.addr and v.installed))
                    t_new = time.time()
                    assert iso.addr not in new.replicas and new.leader in replicas[1:]
                    before = len(acked)
                    await wait_for("writes after failover", lambda: _true(len(acked) >= before + 5))
                    full = await wait_for("re-replication onto the spare", lambda: _view_where(
                        et, 1, lambda v: v.state == "writable" and len(v.replicas) == 3 and v.installed))
                    assert others[2].addr in full.replicas and iso.addr not in full.replicas
                    await trio.sleep(2)                  # the namespace client keeps trying meanwhile
                    _ip("link", "set", vh, "up")                            # heal
                    await wait_for("the isolated node to re-register and drop its stale copy",
                                   lambda: _registered_without(et, iso.addr, 1), timeout=60)
                    more = len(acked)
                    await wait_for("writes after healing", lambda: _true(len(acked) >= more + 3))
                    stop_w.set()
            stop.touch()
            await trio.to_thread.run_sync(lambda: ns_client.wait(timeout=30))
            final = await et.part(1)
            assert iso.addr not in final.replicas and final.epoch > new.epoch - 1
            async with open_client("tcp", etcd=e.url, timeout=10) as dc:
                await _verify(dc, acked, final.replicas)                # every acked host write, everywhere
                recs = [json.loads(line) for line in out.read_text().splitlines()]
                oks = [r for r in recs if r.get("ok")]
                assert oks, "the namespace client never got an acknowledgement (the test would be vacuous)"
                late = [r for r in oks if r["t"] > t_new]
                assert late == [], f"the isolated old leader acknowledged after the failover: {late[:3]}"
                for r in oks:                           # acked by the old leader => on every final replica
                    want = __import__("random").Random(r["seed"]).randbytes(4096)
                    for addr in final.replicas:
                        got = await dc.read(1, r["extent"], r["offset"], 4096, replica=addr)
                        assert got == want, f"namespace client's acked append {r} differs on {addr}"
                assert any(not r["ok"] for r in recs if r["t"] > t_new), "the cut did not reach the client"
                print(f"namespace client: {len(oks)} acked before the cut, {len(recs) - len(oks)} refused or "
                      f"timed out; host writer: {len(acked)} acked; final view {final.to_dict()}")
        run(main)
    finally:
        if ns_client is not None and ns_client.poll() is None:
            ns_client.kill()
            ns_client.wait(timeout=30)
        if mgr is not None:
            mgr.stop()
            print("----- manager -----\n" + "\n".join(mgr.log_path.read_text(errors="replace").splitlines()[-30:]))
        e.stop()


def _ns_oks(path) -> int:
    try:
        return sum(1 for line in path.read_text().splitlines() if '"ok": true' in line)
    except OSError:
        return 0


async def _registered_without(et, addr, pid):
    rec = (await et.nodes()).get(addr)
    return rec is not None and str(pid) not in (rec.get("partitions") or {})
