"""A datanode's CPU at idle, against the number of partitions it holds (real processes, no etcd).

    python -m bench.idle_cpu [--partitions 100,300] [--nodes 3] [--settle 10] [--seconds 15] [--json]

Steps, for each count N: ``--nodes`` datanodes (TCP, default heartbeat) on free ports; N partitions of 3
replicas created, their leaders spread round robin over the nodes; one small write into each (so each
partition has an extent with data, as a used one would); then ``--settle`` seconds for the first repair
passes to finish, and each node's utime+stime (``/proc/PID/stat``) over ``--seconds``.  Reported per node:
cores (CPU seconds per second) and that divided by the partitions it holds, in milliseconds per second.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import tempfile
import time

import trio

from client.sdk import DataClient
from wire.protocol import Op
from tools.cluster import NodeProc, cpu_seconds, free_port


REPO = pathlib.Path(__file__).resolve().parent.parent
# the nodes run this checkout (``python -P`` would otherwise import the venv's installed tree)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))


async def _populate(addrs: list[str], n: int, r: int) -> None:
    async with DataClient.from_env(list(addrs), transport="tcp", timeout=30, pool_mib=16) as dc:
        limit = trio.CapacityLimiter(16)

        async def one(pid: int) -> None:
            async with limit:
                k = (pid - 1) % len(addrs)
                reps = [addrs[(k + i) % len(addrs)] for i in range(r)]
                for a in reps:
                    await dc.admin(a, Op.PARTITION_CREATE, partition=pid, body={"replicas": reps, "epoch": 1})
        async with trio.open_nursery() as nursery:
            for pid in range(1, n + 1):
                nursery.start_soon(one, pid)
        for a in addrs:
            await dc.discover(a)

        async def write(pid: int) -> None:
            async with limit:
                await dc.write(pid, b"x" * 4096)
        async with trio.open_nursery() as nursery:
            for pid in range(1, n + 1):
                nursery.start_soon(write, pid)


def measure(root: pathlib.Path, n: int, n_nodes: int, settle: float, seconds: float, cfg: dict) -> dict:
    nodes = [NodeProc(root / f"node{i}", f"127.0.0.1:{free_port()}", pool_mib=32, transport="tcp", **cfg)
             for i in range(n_nodes)]
    try:
        for p in nodes:
            p.start()
        t0 = time.monotonic()
        trio.run(_populate, [p.addr for p in nodes], n, min(3, n_nodes))
        setup = time.monotonic() - t0
        time.sleep(settle)
        a = {p.addr: cpu_seconds(p.pid) for p in nodes}
        t = time.monotonic()
        time.sleep(seconds)
        el = time.monotonic() - t
        b = {p.addr: cpu_seconds(p.pid) for p in nodes}
    finally:
        for p in nodes:
            p.stop()
    held = n * min(3, n_nodes) / n_nodes
    cores = {addr: (b[addr] - a[addr]) / el for addr in a}
    return {"partitions": n, "nodes": n_nodes, "held_per_node": held, "setup_s": round(setup, 1),
            "window_s": round(el, 1), "cores": {k: round(v, 4) for k, v in cores.items()},
            "cores_mean": round(sum(cores.values()) / len(cores), 4),
            "ms_per_s_per_partition": round(sum(cores.values()) / len(cores) / held * 1000, 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--partitions", default="100,300", help="comma-separated partition counts")
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--settle", type=float, default=10.0, help="seconds after setup before measuring")
    ap.add_argument("--seconds", type=float, default=15.0, help="measuring window")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    out = []
    for n in [int(x) for x in a.partitions.split(",")]:
        with tempfile.TemporaryDirectory(prefix="idle-cpu-") as d:
            res = measure(pathlib.Path(d), n, a.nodes, a.settle, a.seconds, {})
        out.append(res)
        if not a.json:
            print(f"{n} partitions x3 on {a.nodes} nodes ({res['held_per_node']:g} held per node): "
                  f"{res['cores_mean']:.4f} cores per node ({res['ms_per_s_per_partition']:.3f} ms/s per "
                  f"partition held); per node {res['cores']}", flush=True)
    if a.json:
        print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
