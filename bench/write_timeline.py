"""Where a replicated write's time goes, across the client and every node: a timeline of one append.

Starts a local cluster and runs `dnctl bench` (writes only) with ``DATANODE_TRACE`` set (wire/trace.py:
every process notes when each append reached each of its steps), stops the cluster, and prints for every
step the median (and p10/p90) time since the client submitted the append -- so the hops between processes
(a step on one process to the next step on another), each node's own work and each flush stand side by
side.  Followers are F1, F2, ... in the order of their trace files.

    python -m bench.write_timeline                         # 4 KiB, depth 1, 3 replicas, sync always, 5 s
    python -m bench.write_timeline --depth 16 --json
    python -m bench.write_timeline --reads --cold --size 1MiB --depth 8      # a read's steps, from the disk

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


def timeline(trace_dir: pathlib.Path, reads: bool = False) -> tuple[int, list[dict]]:
    """The appends (``reads``: the reads) seen on every process, and per step its time since submit:
    [{step, p10, p50, p90}]."""
    per: dict[tuple[int, int], dict[str, float]] = collections.defaultdict(dict)
    followers = 0
    for f in sorted(trace_dir.glob("trace-*.json")):
        steps = [s for s in json.loads(f.read_text()) if s[0].startswith("read.") == reads]
        name = ""
        if any(step.endswith(".F") for step, *_ in steps):
            followers += 1
            name = str(followers)                    # F1, F2, ...: this process's steps as a follower
        for step, extent, offset, t in steps:
            per[(extent, offset)].setdefault(step + name if step.endswith(".F") else step, t)
    want = max((len(steps) for steps in per.values()), default=0)     # every step on every process
    rows: dict[str, list[float]] = collections.defaultdict(list)
    complete = 0
    first = "read.submit" if reads else "submit"
    for steps in per.values():
        if len(steps) < want or first not in steps:
            continue                 # a run's joined request, or a step not seen
        complete += 1
        t0 = steps[first]
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
    ap.add_argument("--reads", action="store_true",
                    help="the reads' timeline instead: the bench writes (unmeasured), then reads it back")
    ap.add_argument("--cold", action="store_true", help="with --reads: from a dropped page cache (dnctl bench "
                    "--cold: needs root; its disk baselines run too)")
    ap.add_argument("--total-mib", type=int, default=512, help="with --cold: MiB read (default 512)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.cold and not a.reads:
        ap.error("--cold goes with --reads")
    phase = ["--mode", "read", "--cold", "--rounds", "1", "--total-mib", str(a.total_mib)] if a.cold else \
        ["--mode", "read" if a.reads else "write", "--seconds", str(a.seconds)]
    with tempfile.TemporaryDirectory(prefix="write-timeline-") as d:
        trace_dir = pathlib.Path(d) / "trace"
        trace_dir.mkdir()
        env = {**os.environ, "DATANODE_TRACE": str(trace_dir), "PYTHONPATH": str(ROOT)}
        cluster = str(pathlib.Path(d) / "cluster")
        dnctl("cluster", "up", "--nodes", str(a.nodes), "--cluster", cluster, "--sync", a.sync, env=env)
        try:
            bench = json.loads(dnctl("bench", "--cluster", cluster, "--partition", "1", "--size", a.size, "--depth",
                                     str(a.depth), *phase, "--json", env=env).stdout)
        finally:
            dnctl("cluster", "down", "--cluster", cluster, env=env)     # the nodes write their steps as they exit
        complete, rows = timeline(trace_dir, a.reads)
    row = [r for r in bench["results"] if r["phase"] == ("read" if a.reads else "write")][0]
    what = "reads" if a.reads else "appends"
    if a.json:
        print(json.dumps({what: complete, "bench_p50_ms": row["latency_ms"]["p50"], "mib_s": row["mib_s"],
                          "steps": rows}))
        return
    print(f"{a.size} {what}{' (cold)' if a.cold else ''}, depth {a.depth}, {a.nodes} replicas, sync {a.sync}: "
          f"{row['iops']:.0f} {what}/s, {row['mib_s']:.1f} MiB/s, bench p50 {row['latency_ms']['p50']:.3f} ms; "
          f"{complete} {what} seen at every step")
    print("ms since the client's submit" + (" (the node serving it: the leader)" if a.reads else
                                             " (L: leader, F1, F2: followers)"))
    prev = 0.0
    for r in rows:
        print(f"  {r['step']:14} p50 {r['p50']:7.3f}  (+{r['p50'] - prev:6.3f})   p10 {r['p10']:7.3f}  "
              f"p90 {r['p90']:7.3f}")
        prev = r["p50"]


if __name__ == "__main__":
    main()
