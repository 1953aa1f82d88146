"""Where a replicated write's time goes, across the client and every node: a timeline of one append.

Starts a local cluster and runs `dnctl bench` (writes only) with ``DATANODE_TRACE`` set (datanode/trace.py:
every process notes when each append reached each of its steps), stops the cluster, and prints for every
step the median (and p10/p90) time since the client submitted the append -- so the hops between processes
(a step on one process to the next step on another), each node's own work and each flush stand side by
side.  Followers are F1, F2, ... in the order of their trace files.

    python bench/write_timeline.py                         # 4 KiB, depth 1, 3 replicas, sync always, 5 s
    python bench/write_timeline.py --depth 16 --json

Steps of a run of appends (ops/data.py AppendRun) are noted for its first request only; the table counts
appends whose every step on every process was seen.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent


def dnctl(*args: str, env: dict) -> subprocess.CompletedProcess:
    p = subprocess.run([sys.executable, "-m", "tools.dnctl", *args], cwd=ROOT, env=env, capture_output=True,
                       text=True)
    if p.returncode != 0:
        raise SystemExit(f"dnctl {' '.join(args[:2])} failed: {p.stderr.strip()[-800:]}")
    return p


def timeline(trace_dir: pathlib.Path) -> tuple[int, list[dict]]:
    """The appends seen on every process, and per step its time since submit: [{step, p10, p50, p90}]."""
    per: dict[tuple[int, int], dict[str, float]] = collections.defaultdict(dict)
    followers = 0
    for f in sorted(trace_dir.glob("trace-*.json")):
        steps = json.loads(f.read_text())
        name = ""
        if any(step.endswith(".F") for step, *_ in steps):
            followers += 1
            name = str(followers)                    # F1, F2, ...: this process's steps as a follower
        for step, extent, offset, t in steps:
            per[(extent, offset)].setdefault(step + name if step.endswith(".F") else step, t)
    want = max((len(steps) for steps in per.values()), default=0)     # every step on every process
    rows: dict[str, list[float]] = collections.defaultdict(list)
    complete = 0
    for steps in per.values():
        if len(steps) < want or "submit" not in steps:
            continue                 # a run's joined request, or a step not seen
        complete += 1
        t0 = steps["submit"]
        for step, t in steps.items():
            rows[step].append((t - t0) * 1e3)
    out = []
    for step, v in rows.items():
        v.sort()
        out.append({"step": step, "p10": v[len(v) // 10], "p50": statistics.median(v), "p90": v[len(v) * 9 // 10]})
    out.sort(key=lambda r: r["p50"])
    return complete, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--size", default="4KiB")
    ap.add_argument("--depth", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=5)
    ap.add_argument("--sync", choices=["always", "none"], default="always")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="write-timeline-") as d:
        trace_dir = pathlib.Path(d) / "trace"
        trace_dir.mkdir()
        env = {**os.environ, "DATANODE_TRACE": str(trace_dir), "PYTHONPATH": str(ROOT)}
        cluster = str(pathlib.Path(d) / "cluster")
        dnctl("cluster", "up", "--nodes", str(a.nodes), "--cluster", cluster, "--sync", a.sync, env=env)
        try:
            bench = json.loads(dnctl("bench", "--cluster", cluster, "--partition", "1", "--size", a.size, "--depth",
                                     str(a.depth), "--seconds", str(a.seconds), "--mode", "write", "--json",
                                     env=env).stdout)
        finally:
            dnctl("cluster", "down", "--cluster", cluster, env=env)     # the nodes write their steps as they exit
        complete, rows = timeline(trace_dir)
    row = bench["results"][0]
    if a.json:
        print(json.dumps({"appends": complete, "bench_p50_ms": row["latency_ms"]["p50"], "steps": rows}))
        return
    print(f"{a.size} appends, depth {a.depth}, {a.nodes} replicas, sync {a.sync}: {row['iops']:.0f} writes/s, bench "
          f"p50 {row['latency_ms']['p50']:.3f} ms; {complete} appends seen at every step")
    print("ms since the client's submit (L: leader, F1, F2: followers)")
    prev = 0.0
    for r in rows:
        print(f"  {r['step']:14} p50 {r['p50']:7.3f}  (+{r['p50'] - prev:6.3f})   p10 {r['p10']:7.3f}  "
              f"p90 {r['p90']:7.3f}")
        prev = r["p50"]


if __name__ == "__main__":
    main()
