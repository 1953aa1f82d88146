"""fio on a dnfs mount next to the same fio lines on a local ext4 directory, in one run (a benchmark, not a
test).  Starts a local 3-node cluster (sync=always) in --dir, mounts it, runs each job on the mount then on
--dir/ext4, and prints MiB/s (and IOPS), plus the CPU seconds of the mount process and the datanodes per GiB
moved.  Also: files per second creating 10,000 empty files, and untarring 2,000 small ones (until the mount
is unmounted: what it still buffers is written then).

    python -m bench.dnfs_fio --dir /var/tmp/dnfs-bench [--size 2G] [--writeback] [--json]
Run ../shared/bench/warm-memory first on a fresh VM.
"""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

import click

from tools import cluster as cl
from tools.cluster import cpu_seconds


REPO = pathlib.Path(__file__).resolve().parent.parent

JOBS = [  # the lines; SIZE and SMALL are substituted
    ("seqw1m", "--filename=f1 --rw=write --bs=1M --size={SIZE} --end_fsync=1 --ioengine=psync --fallocate=none"),
    ("seqr1m", "--filename=f1 --rw=read --bs=1M --size={SIZE} --ioengine=psync"),
    ("dsync1m", "--filename=f2 --rw=write --bs=1M --size={SIZE} --fdatasync=1 --ioengine=psync --fallocate=none"),
    ("seqw128k", "--filename=f3 --rw=write --bs=128k --size={SIZE} --end_fsync=1 --ioengine=psync --fallocate=none"),
    ("w4kdsync", "--filename=f4 --rw=write --bs=4k --size={SMALL} --fdatasync=1 --runtime=30 --time_based "
                 "--ioengine=psync --fallocate=none"),
]


def fio(name: str, directory: pathlib.Path, args: str) -> dict:
    if name == "seqr1m":
        subprocess.run(["sync"], check=True)
        pathlib.Path("/proc/sys/vm/drop_caches").write_text("3\n")
    cmd = ["fio", f"--name={name}", f"--directory={directory}", *args.split(), "--output-format=json"]
    r = subprocess.run(cmd, capture_output=True, text=True, check=True)
    job = json.loads(r.stdout[r.stdout.index("{"):])["jobs"][0]
    side = job["read"] if "read" in args.split("--rw=")[1][:5] else job["write"]
    return {"MiB/s": round(side["bw_bytes"] / 2**20, 1), "iops": round(side["iops"]), "bytes": side["io_bytes"],
            "seconds": round(job["job_runtime"] / 1000, 1)}


def make_tar(path: pathlib.Path) -> None:
    import io
    import random
    import tarfile
    rnd = random.Random(1)
    with tarfile.open(path, "w") as t:
        for i in range(2000):
            data = rnd.randbytes(i % 3000)
            ti = tarfile.TarInfo(f"tree/d{i % 40:02d}/f{i:04d}.txt")
            ti.size = len(data)
            t.addfile(ti, io.BytesIO(data))


def cpu(pids) -> float:
    return sum(cpu_seconds(p) or 0.0 for p in pids)


@click.command()
@click.option("--dir", "root", default="/var/tmp/dnfs-bench", show_default=True)
@click.option("--size", default="2G", show_default=True, help="fio --size of the sequential jobs.")
@click.option("--small", default="1G", show_default=True, help="fio --size of the 4k job.")
@click.option("--writeback", is_flag=True, help="Mount with --writeback (close does not wait for the cluster).")
@click.option("--json", "as_json", is_flag=True)
def main(root, size, small, writeback, as_json):
    root = pathlib.Path(root)
    shutil.rmtree(root, ignore_errors=True)
    (root / "mnt").mkdir(parents=True)
    (root / "ext4").mkdir()
    info = cl.up(root / "cluster", 3, sync="always")
    node_pids = [n["pid"] for n in info["nodes"]]
    py = sys.executable
    subprocess.run([py, "-m", "tools.dnctl", "partition", "create", "--id", "1", "--replicas",
                    ",".join(n["addr"] for n in info["nodes"])], check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    results = []
    try:
        out = subprocess.run([py, "-m", "client.fs.cli", "mount", "--cluster", str(root / "cluster"), "--json",
                              *(["--writeback"] if writeback else []), str(root / "mnt")], check=True,
                             capture_output=True, text=True, cwd=REPO).stdout
        mount_pid = json.loads(out)["pid"]
        for name, args in JOBS:
            args = args.format(SIZE=size, SMALL=small)
            c0, n0 = cpu([mount_pid]), cpu(node_pids)
            m = fio(name, root / "mnt", args)
            c1, n1 = cpu([mount_pid]), cpu(node_pids)
            gib = m["bytes"] / 2**30
            m["client_cpu_s_per_gib"] = round((c1 - c0) / gib, 2) if gib else None
            m["datanode_cpu_s_per_gib"] = round((n1 - n0) / gib, 2) if gib else None
            e = fio(name, root / "ext4", args)
            results.append({"job": name, "dnfs": m, "ext4": e})
            if not as_json:
                print(f"{name:9} dnfs {m['MiB/s']:8.1f} MiB/s {m['iops']:7d} IOPS  (client {m['client_cpu_s_per_gib']} "
                      f"+ datanodes {m['datanode_cpu_s_per_gib']} CPU s/GiB)   ext4 {e['MiB/s']:8.1f} MiB/s "
                      f"{e['iops']:7d} IOPS", flush=True)
        for where in ("mnt", "ext4"):
            d = root / where / "empty"
            d.mkdir()
            t0 = time.monotonic()
            for i in range(10_000):
                os.close(os.open(d / f"e{i:05d}", os.O_CREAT | os.O_WRONLY, 0o644))
            rate = 10_000 / (time.monotonic() - t0)
            results.append({"job": f"create10k-{where}", "files/s": round(rate)})
            if not as_json:
                print(f"create 10,000 empty files on {'dnfs' if where == 'mnt' else 'ext4'}: {rate:.0f} files/s",
                      flush=True)
        tar = root / "small.tar"
        make_tar(tar)
        for where in ("mnt", "ext4"):
            d = root / where / "untar"
            d.mkdir()
            t0 = time.monotonic()
            subprocess.run(["tar", "xf", str(tar), "-C", str(d)], check=True)
            if where == "mnt":   # unmounting writes what the mount still buffers (--writeback: closed files too)
                subprocess.run([py, "-m", "client.fs.cli", "umount", str(root / "mnt")], check=True, cwd=REPO,
                               capture_output=True)
            else:
                subprocess.run(["sync", "-f", str(d)], check=True)
            rate = 2000 / (time.monotonic() - t0)
            results.append({"job": f"tar-x-2000-{where}", "files/s": round(rate)})
            if not as_json:
                print(f"tar x of 2,000 small files (0-3 KiB) + {'unmount' if where == 'mnt' else 'sync'} on "
                      f"{'dnfs' if where == 'mnt' else 'ext4'}: {rate:.0f} files/s", flush=True)
    finally:
        subprocess.run([py, "-m", "client.fs.cli", "umount", str(root / "mnt")], cwd=REPO, capture_output=True)
        cl.down(root / "cluster")
    if as_json:
        print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
