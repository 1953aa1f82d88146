"""What a writer using ``DataClient.put`` (no partition) sees when a follower is killed -9.

    .venv/bin/python -m bench.put_failover --kills 5 [--nodes 6] [--partitions 4] [--ttl 2] [--size 65536] [--json]

Real processes: one etcd member, one manager (min_writable = --partitions), --nodes datanodes, one SDK writer calling
``put`` back to back.  Each round kills a node that leads no partition but is a follower in some (so the
writes that hit it fail with REPLICATION_FAILED or a lost connection and go on elsewhere; if every node
holding a replica leads one, a leader is killed and the round says ``it_led``), measures the
longest gap between two acknowledged puts in the ``ttl + 4`` s after the kill, and -- same run, same
writer -- the longest gap in the 3 s before it (the baseline).  Errors the writer saw are counted (the
point: 0).  The node is restarted and the map left to settle before the next round.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import signal
import statistics
import sys
import tempfile
import time

import trio


from client.sdk import DataClient
from wire.etcdmap import Etcd
from tools.cluster import NodeProc, free_port
from tools.etcd_cluster import EtcdProc, ManagerProc


def _gap(ts: list[float], lo: float, hi: float) -> float:
    xs = [lo] + [t for t in ts if lo < t <= hi]
    return max((b - a for a, b in zip(xs, xs[1:])), default=hi - lo)


async def run(root: pathlib.Path, kills: int, ttl: int, size: int, partitions: int, n_nodes: int) -> dict:
    e = EtcdProc(root / "etcd").start()
    cfg = {"etcd": e.url, "lease_ttl_s": ttl, "heartbeat_s": 0.5, "pool_mib": 64, "transport": "tcp",
           "replica_timeout": 2.0, "sync": "always"}
    nodes = [NodeProc(root / f"node{i}", f"127.0.0.1:{free_port()}", **cfg) for i in range(n_nodes)]
    mgr = ManagerProc(root, e.url, "m1", lease_ttl_s=ttl, down_after_s=0.5, tick_s=0.2, min_writable=partitions,
                      min_free_mib=1)
    out = {"lease_ttl_s": ttl, "write_size": size, "partitions": partitions, "nodes": n_nodes, "rounds": []}
    try:
        for n in nodes:
            n.start()
        byaddr = {n.addr: n for n in nodes}
        mgr.start()
        et = Etcd(e.url)

        async def settled():
            while True:
                parts = await et.parts()
                good = [v for v in parts.values() if v.installed and v.state == "writable"
                        and len(v.replicas) == v.want and set(v.synced) == set(v.replicas)]
                if len(good) >= partitions and len(good) == len(parts) and len(await et.nodes()) == n_nodes:
                    return parts
                await trio.sleep(0.1)

        with trio.fail_after(60):
            await settled()
        acks: list[float] = []
        errors: list[str] = []
        async with DataClient.from_env(transport="tcp", timeout=30, etcd=e.url) as dc:
            async def writer():
                data = bytes(size)
                while True:
                    try:
                        await dc.put(data)
                    except Exception as ex:  # noqa: BLE001 - counted: the point is that there are none
                        errors.append(repr(ex))
                        continue
                    acks.append(time.monotonic())

            async with trio.open_nursery() as nursery:
                nursery.start_soon(writer)
                for _ in range(kills):
                    with trio.fail_after(120):
                        parts = await settled()
                    await trio.sleep(3)
                    leaders = {v.leader for v in parts.values()}
                    holders = [a for a in byaddr if any(a in v.replicas for v in parts.values())]
                    n_in = {a: sum(a in v.replicas for v in parts.values()) for a in holders}
                    victim = byaddr[min(holders, key=lambda a: (a in leaders, n_in[a], a))]  # a follower if any
                    t0 = time.monotonic()
                    f0, e0 = dc.put_failovers, len(errors)
                    victim.kill(signal.SIGKILL)
                    await trio.sleep(ttl + 4)
                    rec = {"killed": victim.addr, "it_led": victim.addr in leaders,
                           "in_partitions": sum(victim.addr in v.replicas for v in parts.values()), "baseline_max_gap_s": round(_gap(acks, t0 - 3, t0), 3),
                           "max_gap_s": round(_gap(acks, t0, t0 + ttl + 4), 3),
                           "put_failovers": dc.put_failovers - f0, "errors": len(errors) - e0,
                           "error_texts": errors[e0:][:3]}
                    out["rounds"].append(rec)
                    print(json.dumps(rec), file=sys.stderr)
                    victim.start()
                nursery.cancel_scope.cancel()
        out["errors"] = len(errors)
        gaps = [r["max_gap_s"] for r in out["rounds"]]
        base = [r["baseline_max_gap_s"] for r in out["rounds"]]
        out["summary"] = {"max_gap_p50_s": statistics.median(gaps), "max_gap_max_s": max(gaps),
                          "baseline_max_gap_p50_s": statistics.median(base), "writer_errors": len(errors)}
        return out
    finally:
        mgr.stop()
        for n in nodes:
            n.stop()
        e.stop()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=5)
    ap.add_argument("--ttl", type=int, default=2)
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--nodes", type=int, default=6)
    ap.add_argument("--size", type=int, default=64 << 10)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="put-failover-") as d:
        res = trio.run(run, pathlib.Path(d), a.kills, a.ttl, a.size, a.partitions, a.nodes)
    if a.json:
        print(json.dumps(res, indent=2))
    else:
        s = res["summary"]
        print(f"{len(res['rounds'])} kills, {res['nodes']} nodes, {res['partitions']}+ partitions (lease ttl {res['lease_ttl_s']}s, {res['write_size']} B puts): "
              f"longest gap between acknowledged puts after a kill p50 {s['max_gap_p50_s']}s, max "
              f"{s['max_gap_max_s']}s (before the kills: p50 {s['baseline_max_gap_p50_s']}s); "
              f"writer errors {s['writer_errors']}")


if __name__ == "__main__":
    main()
