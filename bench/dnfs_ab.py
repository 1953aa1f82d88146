"""Interleaved A/B of two checkouts through a dnfs mount (a benchmark, not a test).

Each round and variant: a fresh local 3-node cluster (sync=always) and a fresh mount, both run from the
variant's checkout (PYTHONPATH=DIR), one workload, then unmount and stop.  Variants run interleaved (A, B, A,
B, ...): on a shared, noisy machine only figures taken side by side compare.  The mount's CPU comes from
/proc/PID/stat.

    python -m bench.dnfs_ab --variant base=/tmp/main-copy --variant now=. --rounds 3 --workload tar
    python -m bench.dnfs_ab --variant close-waits=. --variant writeback=.:--writeback --workload tar

A variant is NAME=DIR[:MOUNT-OPTIONS] (`git archive REV | tar -x -C DIR` makes a checkout of REV).
Workloads:
  fsync4k   fio 4 KiB write+fdatasync (psync) for --seconds: IOPS, the FUSE write's and the fdatasync's p50
  seq128k   fio 128 KiB sequential write of --size with end_fsync: MiB/s, write p99, mount CPU per GB
  seq1m     the same with 1 MiB writes
  read1m    fio 1 MiB sequential reads of a --size file written and then remounted (its pages not cached):
            MiB/s, mount CPU per GiB read, the READ requests and their mean size (`dnfs stats`)
  tar       tar x of 2,000 small files (0-3 KiB), timed until unmounted: files/s, mount CPU per file
  utime     os.utime in a loop for --seconds: ops/s, mount CPU per op (one FUSE SETATTR each)
  tree      the peers' small-file row: tar -x of a real source tree (--tree, default Python's standard
            library) + sync -f, cp -a of it + sync -f, rm -rf of both: seconds and mount CPU of each step,
            and the FUSE requests per tree entry (files, directories, links) of the untar (`dnfs stats`)
Run ../shared/bench/warm-memory first on a fresh VM.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

from bench.dnfs_fio import make_tar  # (the same 2,000-file tree as dnfs_fio's untar)
from bench.dnfs_variant import VARIANT_HELP, fio, mounted_cluster, py, variants
from tools.cluster import cpu_seconds as _cpu


def one(code: str, opts: list[str], workload: str, a, work: pathlib.Path) -> str:
    with mounted_cluster(code, opts, work, "dnfs-ab-") as m:
        root, mnt, pid = m.root, m.mnt, m.pid
        c0 = _cpu(pid)
        if workload == "fsync4k":
            j = fio(mnt, "ab", "--filename=f", "--rw=write", "--bs=4k", f"--size={a.size}", "--fdatasync=1",
                    f"--runtime={a.seconds}", "--time_based")
            w, n = j["write"], j["write"]["total_ios"]
            return (f"{w['iops']:7.0f} IOPS  write p50 {w['clat_ns']['percentile']['50.000000'] / 1e6:.3f} ms  "
                    f"fdatasync p50 {j['sync']['lat_ns']['percentile']['50.000000'] / 1e6:.3f} ms  "
                    f"mount CPU {(_cpu(pid) - c0) / max(1, n) * 1e3:.3f} ms/op")
        if workload in ("seq128k", "seq1m"):
            bs = "128k" if workload == "seq128k" else "1m"
            j = fio(mnt, "ab", "--filename=f", "--rw=write", f"--bs={bs}", f"--size={a.size}", "--end_fsync=1")
            w = j["write"]
            return (f"{w['bw_bytes'] / 2**20:7.1f} MiB/s  write p99 "
                    f"{w['clat_ns']['percentile']['99.000000'] / 1e6:6.1f} ms  "
                    f"mount CPU {(_cpu(pid) - c0) / (w['io_bytes'] / 1e9):.2f} s/GB")
        if workload == "read1m":
            fio(mnt, "ab", "--filename=f", "--rw=write", "--bs=1m", f"--size={a.size}", "--end_fsync=1")
            m.umount()
            m.mount("mount2.log")      # a fresh mount: none of the file's pages cached
            pid = m.pid
            c0 = _cpu(pid)
            j = fio(mnt, "ab", "--filename=f", "--rw=read", "--bs=1m", f"--size={a.size}")
            r = j["read"]
            st = json.loads(py(code, "-m", "client.fs.cli", "stats", str(mnt), "--json").stdout)
            reads = st["requests"].get("read", {}).get("count", 0)
            return (f"{r['bw_bytes'] / 2**20:7.1f} MiB/s  mount CPU {(_cpu(pid) - c0) / (r['io_bytes'] / 2**30):.2f} "
                    f"s/GiB  {reads} READs, {r['io_bytes'] / max(1, reads) / 1024:.0f} KiB each")
        if workload == "tar":
            tar = root / "small.tar"
            make_tar(tar)
            (mnt / "u").mkdir()
            t0 = time.monotonic()
            subprocess.run(["tar", "xf", str(tar), "-C", str(mnt / "u")], check=True)
            c1 = _cpu(pid)
            m.umount()     # writes what the mount still buffers
            return (f"{2000 / (time.monotonic() - t0):7.0f} files/s until unmounted  mount CPU "
                    f"{(c1 - c0) / 2000 * 1e3:.2f} ms/file (to the end of tar)")
        if workload == "tree":
            tar = root / "tree.tar"
            subprocess.run(["tar", "-C", a.tree, "-cf", str(tar), "."], check=True)
            w = mnt / "tree"
            t, cpu = {}, {}
            entries = len(subprocess.run(["tar", "-tf", str(tar)], capture_output=True, text=True,
                                         check=True).stdout.splitlines())

            def requests() -> int:
                st = json.loads(py(code, "-m", "client.fs.cli", "stats", str(mnt), "--json").stdout)
                return sum(r["count"] for r in st["requests"].values())
            r0 = requests()
            for step, cmd in (("untar+sync", f"mkdir -p {w} && tar -C {w} -xf {tar} && sync -f {w}"),
                              ("cp -a+sync", f"cp -a {w} {w}.copy && sync -f {w}"),
                              ("rm -rf", f"rm -rf {w} {w}.copy")):
                t0, c1 = time.monotonic(), _cpu(pid)
                subprocess.run(cmd, shell=True, check=True)
                t[step], cpu[step] = time.monotonic() - t0, _cpu(pid) - c1
                if step == "untar+sync":
                    per_entry = (requests() - r0) / entries
            return (" / ".join(f"{k} {v:6.2f} s" for k, v in t.items()) + f"  untar {per_entry:.1f} requests/entry" +
                    f"  total {sum(t.values()):6.2f} s  mount CPU " +
                    " / ".join(f"{v:.2f}" for v in cpu.values()) + f" = {_cpu(pid) - c0:.1f} s")
        if workload == "utime":
            f = mnt / "f"
            f.write_bytes(b"")
            n, t0 = 0, time.monotonic()
            while time.monotonic() - t0 < a.seconds:
                os.utime(f, ns=(n, n))
                n += 1
            dt = time.monotonic() - t0
            return f"{n / dt:7.0f} ops/s  mount CPU {(_cpu(pid) - c0) / n * 1e6:.0f} us/op"
        raise SystemExit(f"unknown workload {workload}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", action="append", required=True, metavar=VARIANT_HELP)
    ap.add_argument("--workload", choices=["fsync4k", "seq128k", "seq1m", "read1m", "tar", "utime", "tree"], required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=int, default=10, help="fsync4k and utime: how long")
    ap.add_argument("--size", default="1G", help="fsync4k, seq128k, seq1m, read1m: fio --size")
    ap.add_argument("--dir", default="/var/tmp", help="where the clusters and mounts go")
    ap.add_argument("--tree", default=f"/usr/lib/python3.{sys.version_info.minor}",
                    help="tree: the directory tarred and then untarred into the mount")
    a = ap.parse_args()
    runs = variants(ap, a.variant)
    for r in range(a.rounds):
        for name, code, opts in runs:
            print(f"{name:12} round {r}  {a.workload:8} {one(code, opts, a.workload, a, pathlib.Path(a.dir))}",
                  flush=True)


if __name__ == "__main__":
    main()
