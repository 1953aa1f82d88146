"""What deleting data costs everyone else writing to the same disk: 4 KiB durable writes at depth 1 (3 replicas)
while extents of 128 MiB are deleted beside them, with the deleted extents' space freed at once
(``free_step_bytes = 0`` in the nodes' config) and in steps (the default), alternating, each round on a fresh
local cluster (``dnctl cluster up``, sync=always).

    .venv/bin/python -m bench.delete_stall [--rounds 4] [--extents 4] [--extent-mib 128]

On a file system mounted with online discard (this box's root is: ``mount | grep discard``) the journal
commit that frees the blocks discards them, and every fdatasync waiting for that commit -- every other
writer's on the disk -- waits too.  The figures: the writes' p99 and longest in the deletions' window, next
to the same writer's in the seconds before them.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import trio

from client.sdk import DataClient
from tools.bench import percentile
from tools.clikit import cluster_nodes


REPO = pathlib.Path(__file__).resolve().parent.parent

MIB = 1 << 20
VARIANTS = {"at once": 0, "in steps": None}      # free_step_bytes for the nodes (None: the default)


def dnctl(env: dict, *args: str) -> None:
    subprocess.run([sys.executable, "-c", "from tools.dnctl import main; main()", *args], env=env, cwd=REPO,
                   check=True, capture_output=True, text=True)


def cluster_up(env: dict, d: str, free_step: int | None) -> None:
    """A local cluster in ``d`` whose nodes free space ``free_step`` bytes at a time (None: their default).
    The nodes' config comes from cluster.json: they are started, stopped, given the key and started again
    (both variants alike, so neither runs on a fresher cluster)."""
    dnctl(env, "cluster", "up", "--nodes", "3", "--cluster", d, "--sync", "always")
    dnctl(env, "cluster", "down", "--cluster", d)
    path = pathlib.Path(d) / "cluster.json"
    info = json.loads(path.read_text())
    if free_step is not None:
        info["config"]["free_step_bytes"] = free_step
    path.write_text(json.dumps(info, indent=2))
    dnctl(env, "cluster", "up", "--cluster", d)


def summary(ms: list[float]) -> dict:
    """Count, p50, p99 and longest of a window's write times (ms), by dnctl bench's own percentile."""
    ms = sorted(ms)
    return {"n": len(ms), "p50": percentile(ms, 50), "p99": percentile(ms, 99), "max": ms[-1]}


async def measure(nodes: list[str], extents: int, extent_mib: int, pid: int = 1) -> dict:
    async with DataClient.from_env(nodes, block_size=MIB, depth=8, pool_mib=32) as dc:
        part = dc.partition(pid)
        payload = os.urandom(MIB)
        big = []
        for _ in range(extents):                  # the extents to delete, filled at depth 8
            e = await dc.create_extent(pid)
            window = trio.Semaphore(8)

            async def done(fut):
                try:
                    await fut
                finally:
                    window.release()
            async with trio.open_nursery() as n:
                for i in range(extent_mib):
                    await window.acquire()
                    n.start_soon(done, await dc.submit_append(part, e, i * MIB, payload))
            big.append(e)
        await trio.to_thread.run_sync(os.sync)
        await trio.sleep(2)
        small = await dc.create_extent(pid)
        block = os.urandom(4096)
        lat: list[tuple[float, float]] = []       # (start, seconds) of each 4 KiB write
        stop = trio.Event()

        async def writer():
            off = 0
            while not stop.is_set():
                t = time.perf_counter()
                await dc.append(pid, small, off, block)
                lat.append((t, time.perf_counter() - t))
                off += len(block)
        deletes = []
        async with trio.open_nursery() as n:
            n.start_soon(writer)
            await trio.sleep(3)
            t0 = time.perf_counter()
            for e in big:
                t = time.perf_counter()
                await dc.delete_extent(pid, e)
                deletes.append(time.perf_counter() - t)
                await trio.sleep(0.5)
            t1 = time.perf_counter()
            await trio.sleep(0.5)
            stop.set()
    before = [s * 1e3 for t, s in lat if t0 - 3 <= t < t0]
    during = [s * 1e3 for t, s in lat if t0 <= t < t1 + 0.5]
    return {"before": summary(before), "during": summary(during),
            "delete_ms": [round(d * 1e3, 1) for d in deletes]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4, help="rounds per variant (their order turns every round)")
    ap.add_argument("--extents", type=int, default=4, help="extents deleted per round")
    ap.add_argument("--extent-mib", type=int, default=128)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    names = list(VARIANTS)
    results: dict[str, list[dict]] = {k: [] for k in names}
    for r in range(a.rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            env = {**os.environ, "PYTHONPATH": str(REPO)}
            with tempfile.TemporaryDirectory(prefix="delete-stall-") as d:
                cluster_up(env, d, VARIANTS[name])
                try:
                    res = trio.run(measure, cluster_nodes(pathlib.Path(d)), a.extents, a.extent_mib)
                finally:
                    dnctl(env, "cluster", "down", "--cluster", d)
            results[name].append(res)
            b, g = res["before"], res["during"]
            print(f"round {r} {name:8s}  4 KiB writes before: p50 {b['p50']:.2f} p99 {b['p99']:6.2f} max "
                  f"{b['max']:6.2f} ms | during {a.extents} deletes of {a.extent_mib} MiB: p50 {g['p50']:.2f} "
                  f"p99 {g['p99']:6.2f} max {g['max']:6.2f} ms (n={g['n']}) | a delete took "
                  f"{', '.join(map(str, res['delete_ms']))} ms", flush=True)
            if a.json:
                print(json.dumps({"variant": name, "round": r, **res}))
    for name in names:
        rs = results[name]
        med = {k: statistics.median(x["during"][k] for x in rs) for k in ("p50", "p99", "max")}
        print(f"{name:8s} medians over {len(rs)} rounds, during the deletes: p50 {med['p50']:.2f} p99 "
              f"{med['p99']:.2f} max {med['max']:.2f} ms; a delete "
              f"{statistics.median(d for x in rs for d in x['delete_ms']):.1f} ms")


if __name__ == "__main__":
    main()
