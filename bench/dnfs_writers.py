"""Concurrent writers through a dnfs mount, interleaved A/B of two checkouts (a benchmark, not a test).

The peers harness's ``w4k_dsync`` and ``w4k_dsync_j8`` rows side by side on one mount: fio 4 KiB writes, each
followed by fdatasync, from 1 writer and then from 8 (each its own file).  Each round and variant: a fresh
local 3-node cluster (sync=always) and mount run from the variant's checkout, both phases, unmount.  Prints
IOPS, fdatasync p50/p99, the mount's CPU per operation (/proc/PID/stat), the metadata engine's WAL syncs and
hand-overs to its threads per fsync (``dnfs stats``, where the engine counts them) and the 8-writer/1-writer
IOPS ratio.  Variants run interleaved (A, B, A, B, ...): on a shared, noisy machine only figures taken side
by side compare.

    git archive main | tar -x -C /tmp/main-copy
    python -m bench.dnfs_writers --variant base=/tmp/main-copy --variant now=. --rounds 2 --seconds 15
Run ../shared/bench/warm-memory first on a fresh VM.
"""
from __future__ import annotations

import argparse
import json
import pathlib

from bench.dnfs_variant import VARIANT_HELP, fio, mounted_cluster, py, variants
from tools.cluster import cpu_seconds as _cpu


def _stats(code: str, mnt: pathlib.Path) -> dict:
    r = py(code, "-m", "client.fs.cli", "stats", str(mnt), "--json", check=False)
    try:
        return json.loads(r.stdout)
    except ValueError:
        return {}


def _meta(st: dict, key: str) -> int | None:
    return (st.get("metadata") or st.get("meta") or {}).get(key)


def _per(s0: dict, s1: dict, key: str, n: int) -> float | None:
    a, b = _meta(s0, key), _meta(s1, key)
    return None if a is None or b is None else (b - a) / max(1, n)


def phase(code: str, pid: int, mnt: pathlib.Path, jobs: int, a) -> dict:
    s0, c0 = _stats(code, mnt), _cpu(pid)
    j = fio(mnt, f"w{jobs}", "--rw=write", "--bs=4k", f"--size={a.size}", "--fdatasync=1", f"--runtime={a.seconds}",
            "--time_based", f"--numjobs={jobs}", "--group_reporting")
    cpu = _cpu(pid) - c0
    s1 = _stats(code, mnt)
    w, n = j["write"], j["write"]["total_ios"]
    sync = j["sync"]["lat_ns"]["percentile"]
    return {"iops": w["iops"], "p50": sync["50.000000"] / 1e6, "p99": sync["99.000000"] / 1e6,
            "cpu_ms": cpu / max(1, n) * 1e3,
            "wal_per_fsync": _per(s0, s1, "wal_syncs", n),
            "thread_per_fsync": _per(s0, s1, "transactions_in_thread", n)}


def one(code: str, opts: list[str], a, work: pathlib.Path) -> str:
    with mounted_cluster(code, opts, work, "dnfs-writers-") as m:
        pid, mnt = m.pid, m.mnt
        r1 = phase(code, pid, mnt, 1, a)
        r8 = phase(code, pid, mnt, 8, a)

        def show(r):
            wal = "" if r["wal_per_fsync"] is None else f" wal/fsync {r['wal_per_fsync']:.2f}"
            if r["thread_per_fsync"] is not None:
                wal += f" thread/fsync {r['thread_per_fsync']:.2f}"
            return (f"{r['iops']:6.0f} IOPS p50 {r['p50']:5.2f} p99 {r['p99']:6.2f} ms cpu {r['cpu_ms']:.3f} "
                    f"ms/op{wal}")
        return f"j1 {show(r1)} | j8 {show(r8)} | j8/j1 {r8['iops'] / r1['iops']:.2f}x"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", action="append", required=True, metavar=VARIANT_HELP)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seconds", type=int, default=15, help="each phase's fio --runtime")
    ap.add_argument("--size", default="256M", help="each writer's fio --size (the harness's j8 row: 256M)")
    ap.add_argument("--dir", default="/var/tmp", help="where the clusters and mounts go")
    a = ap.parse_args()
    runs = variants(ap, a.variant)
    for r in range(a.rounds):
        for name, code, opts in runs:
            print(f"{name:10} round {r}  {one(code, opts, a, pathlib.Path(a.dir))}", flush=True)


if __name__ == "__main__":
    main()
