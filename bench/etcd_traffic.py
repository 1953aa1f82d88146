"""etcd requests per second at idle, per datanode and for the active manager (real etcd, nodes, manager).

    python -m bench.etcd_traffic [--nodes 3] [--seconds 30] [--ttl 3] [--json]

How it counts: etcd's own Prometheus counter ``grpc_server_started_total`` (``/metrics``), summed per gRPC
method.  Every request to etcd's JSON gateway (``/v3/...``, what ``wire/etcdmap.py`` speaks) is one gRPC
call started inside etcd, so this counts every range, put, txn, lease grant and keepalive; a watch counts
once when its stream opens (its events are pushed, not requested).

Steps: one etcd, ``--nodes`` datanodes (lease ``--ttl``) holding one 3-replica partition, one manager; once
the partition is adopted and writable and the cluster has been quiet for a few seconds, the counters are
sampled over ``--seconds`` with the manager running, then again with the manager stopped.  The nodes' rate
divided by their number is "per node"; the difference between the two windows is the manager's.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import re
import tempfile
import time
import urllib.request

import trio

from client.sdk import DataClient
from wire.etcdmap import Etcd
from wire.protocol import Op
from tools.cluster import NodeProc, free_port
from tools.etcd_cluster import EtcdProc, ManagerProc

_LINE = re.compile(r'^grpc_server_started_total\{grpc_method="([^"]+)",grpc_service="([^"]+)".*\}\s+(\S+)$')


def started(url: str) -> dict[str, float]:
    """etcd's ``grpc_server_started_total`` per method (``Service/Method``)."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if m:
            out[f"{m.group(2).split('.')[-1]}/{m.group(1)}"] = float(m.group(3))
    return out


def rate(url: str, seconds: float) -> dict[str, float]:
    a = started(url)
    time.sleep(seconds)
    b = started(url)
    return {k: (b[k] - a.get(k, 0)) / seconds for k in b if b[k] - a.get(k, 0) > 0}


async def _settled(et: Etcd, timeout: float = 60) -> None:
    with trio.fail_after(timeout):
        while True:
            v = await et.part(1)
            if v is not None and v.state == "writable" and v.installed:
                return
            await trio.sleep(0.2)


def measure(root: pathlib.Path, n_nodes: int, seconds: float, ttl: int, quiet: float = 5.0) -> dict:
    e = EtcdProc(root / "etcd").start()
    cfg = {"etcd": e.url, "lease_ttl_s": ttl, "pool_mib": 16, "transport": "tcp"}
    nodes = [NodeProc(root / f"node{i}", f"127.0.0.1:{free_port()}", **cfg) for i in range(n_nodes)]
    mgr = ManagerProc(root, e.url, "m1", lease_ttl_s=ttl)
    try:
        for n in nodes:
            n.start()
        reps = [n.addr for n in nodes[:3]]

        async def setup():
            async with DataClient.from_env(transport="tcp", timeout=10) as dc:
                for a in reps:
                    await dc.admin(a, Op.PARTITION_CREATE, partition=1, body={"replicas": reps, "epoch": 1})
            mgr.start()
            await _settled(Etcd(e.url))
        trio.run(setup)
        time.sleep(quiet)
        both = rate(e.url, seconds)
        mgr.stop()
        time.sleep(quiet)
        only_nodes = rate(e.url, seconds)
    finally:
        mgr.stop()
        for n in nodes:
            n.stop()
        e.stop()
    per_node = {k: round(v / n_nodes, 3) for k, v in only_nodes.items()}
    manager = {k: round(both.get(k, 0) - only_nodes.get(k, 0), 3) for k in set(both) | set(only_nodes)}
    manager = {k: v for k, v in manager.items() if abs(v) >= 0.001}
    return {"nodes": n_nodes, "lease_ttl_s": ttl, "window_s": seconds, "counter": "grpc_server_started_total",
            "per_node_req_s": round(sum(only_nodes.values()) / n_nodes, 3), "per_node_by_method": per_node,
            "manager_req_s": round(sum(both.values()) - sum(only_nodes.values()), 3),
            "manager_by_method": manager, "total_idle_req_s": round(sum(both.values()), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=30.0, help="length of each sampling window")
    ap.add_argument("--ttl", type=int, default=3, help="lease TTL of nodes and manager (s)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="etcd-traffic-") as d:
        res = measure(pathlib.Path(d), a.nodes, a.seconds, a.ttl)
    print(json.dumps(res, indent=1) if a.json else
          f"idle etcd traffic ({res['counter']}, {a.seconds:g}s windows, ttl {a.ttl}s): "
          f"{res['per_node_req_s']} req/s per node {res['per_node_by_method']}; "
          f"manager {res['manager_req_s']} req/s {res['manager_by_method']}")


if __name__ == "__main__":
    main()
