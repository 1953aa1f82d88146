"""Interleaved A/B of two checkouts with `dnctl bench`: CPU seconds per request of each node.

On a shared, noisy machine absolute latencies move with the neighbours; comparing A and B in the same run,
interleaved, and reading the nodes' CPU seconds per request (from /proc/PID/stat, which `dnctl bench --json`
reports) is what survives the noise.  Each round starts a fresh local 3-node cluster from the variant's
checkout (PYTHONPATH=DIR), runs one bench, stops it.  The order turns every round (A B, B A, A B, ...): in
a fixed order the position itself shows (whichever runs first tends to be ahead).
The last lines give each variant's medians over the rounds (compare them with an even number of rounds).

    python -m bench.perf_ab --variant base=/tmp/main-copy --variant now=. --rounds 2 --sync always \\
        -- --size 4KiB --depth 16 --seconds 5 --mode write

(`git archive main | tar -x -C /tmp/main-copy` makes a checkout of main to compare against.)
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


def dnctl(code: str, *args: str, check: bool = False) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(pathlib.Path(code).resolve())}
    # cwd too: ``python -c`` puts the working directory first on sys.path, ahead of PYTHONPATH -- run from a
    # checkout, every variant would otherwise import that checkout (and the nodes it starts the same)
    p = subprocess.run([sys.executable, "-c", "from tools.dnctl import main; main()", *args], env=env,
                       cwd=code, capture_output=True, text=True)
    if check and p.returncode != 0:
        raise SystemExit(f"dnctl {' '.join(args[:2])} ({code}) failed: {p.stderr.strip()[-500:]}")
    return p


def one(code: str, sync: str, bench: list[str], nodes: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="perf-ab-") as d:
        dnctl(code, "cluster", "up", "--nodes", str(nodes), "--cluster", d, "--sync", sync, check=True)
        try:
            p = dnctl(code, "bench", "--cluster", d, *bench, "--json")
        finally:
            dnctl(code, "cluster", "down", "--cluster", d)
    if p.returncode != 0 or "{" not in p.stdout:
        raise SystemExit(f"bench ({code}) failed: {p.stderr.strip()[-800:]}")
    return json.loads(p.stdout[p.stdout.index("{"):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", action="append", required=True, metavar="NAME=DIR",
                    help="a checkout to run the cluster and bench from (give two or more)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--sync", choices=["always", "none"], default="always")
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="print every bench result as a JSON line")
    ap.add_argument("bench", nargs=argparse.REMAINDER, help="-- then the dnctl bench options")
    a = ap.parse_args()
    bench = a.bench[1:] if a.bench[:1] == ["--"] else a.bench
    variants = []
    for v in a.variant:
        name, sep, code = v.partition("=")
        if not sep or not (pathlib.Path(code) / "datanode").is_dir():
            ap.error(f"--variant {v!r}: expected NAME=DIR, DIR a checkout (with datanode/)")
        variants.append((name, code))
        where = subprocess.run([sys.executable, "-c", "import datanode; print(datanode.__file__)"], cwd=code,
                               env={**os.environ, "PYTHONPATH": str(pathlib.Path(code).resolve())},
                               capture_output=True, text=True).stdout.strip()
        if not pathlib.Path(where).resolve().is_relative_to(pathlib.Path(code).resolve()):
            ap.error(f"--variant {v!r} imports {where or 'no datanode'}, not its own checkout")
    seen: dict[tuple[str, str], list[tuple[float, float, float]]] = {}   # (variant, phase) -> per round
    for r in range(a.rounds):
        k = r % len(variants)
        for name, code in variants[k:] + variants[:k]:        # each variant runs first in turn
            out = one(code, a.sync, bench, a.nodes)
            for row in out["results"]:
                if a.json:
                    print(json.dumps({"variant": name, "round": r, **row}), flush=True)
                    continue
                cpu = [row["node_cpu"][n]["cpu_s"] for n in row["replica_nodes"] if n in row["node_cpu"]]
                per = "/".join(f"{c / row['requests'] * 1000:.3f}" for c in cpu)
                lat = row["latency_ms"]
                print(f"{name:8} round {r} {row['replicas']} replicas {row['phase']:5} {row['mib_s']:8.1f} MiB/s "
                      f"{row['iops']:7.0f} req/s p50 {lat['p50']:7.2f} p99 {lat['p99']:7.2f} ms  node CPU ms/request "
                      f"{per}  client {row['client_cpu']['cpu_s'] / row['requests'] * 1000:.3f}", flush=True)
                seen.setdefault((name, row["phase"]), []).append(
                    (row["mib_s"], lat["p50"], sum(cpu) / row["requests"] * 1000))
    for (name, phase), got in seen.items():
        mib, p50, cpu = (statistics.median(x) for x in zip(*got))
        print(f"{name:8} median of {len(got)} {phase:5} {mib:8.1f} MiB/s  p50 {p50:7.2f} ms  node CPU ms/request "
              f"{cpu:.3f} (all nodes)", flush=True)


if __name__ == "__main__":
    main()
