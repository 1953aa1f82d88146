"""Verbs vs TCP in one Soft-RoCE VM run, next to ib_read_bw on the same device.

    lab/softroce-vm run -- python -m bench.vm_compare [--seconds 8] [--size 1MiB] [--json]

1. ``ib_read_bw -d $DEV -x $GID -F -s SIZE`` (server and client in this VM): the device's RDMA READ rate.
2. A local cluster with ``transport = verbs`` and one with ``transport = tcp``; in each, ``dnctl bench
   --replicas 1,3`` (single node, then 3 replicas) with the client on the same transport.
Prints, per transport: write/read MiB/s, client and node CPU s/GB; and the ratios the design cares about:
leader ingest (single-node write) over verbs / ib_read_bw, and client CPU per GB written, verbs / TCP.
Absolute numbers are slow (TCG emulation); read the ratios.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import types

import click

DEV = os.environ.get("DATANODE_RDMA_DEVICE", "rxe0")
GID = os.environ.get("DATANODE_RDMA_GID_INDEX", os.environ.get("DATANODE_RDMA_GID", "1"))
ADDR = os.environ.get("DATANODE_RDMA_ADDR", "10.0.0.1")
SIZES = {"4KiB": 4096, "128KiB": 131072, "1MiB": 1 << 20, "4MiB": 4 << 20}


def ib_read_bw(size: int, iters: int) -> float | None:
    """MB/s (decimal) of ib_read_bw between two processes on this device, or None."""
    exe = shutil.which("ib_read_bw")
    if not exe:
        print("ib_read_bw not installed (apt: perftest)", file=sys.stderr)
        return None
    base = [exe, "-d", DEV, "-x", str(GID), "-F", "-s", str(size), "-n", str(iters)]
    srv = subprocess.Popen(base, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(1.5)
    try:
        cli = subprocess.run(base + [ADDR], capture_output=True, text=True, timeout=300)
    finally:
        try:
            srv.wait(timeout=30)
        except subprocess.TimeoutExpired:
            srv.kill()
    for line in reversed(cli.stdout.splitlines()):
        parts = line.split()
        if len(parts) >= 4 and parts[0].isdigit():
            return float(parts[3]) * (1 << 20) / 1e6        # perftest's MB is 2^20 bytes
    print("could not parse ib_read_bw:", cli.stdout[-400:], cli.stderr[-400:], file=sys.stderr)
    return None


def dnctl(*args: str, timeout: float = 900) -> str:
    r = subprocess.run([sys.executable, "-m", "tools.dnctl", *args], capture_output=True, text=True,
                       timeout=timeout)
    if r.returncode != 0:
        raise SystemExit(f"dnctl {' '.join(args)} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    return r.stdout


def bench(transport: str, size: str, seconds: float, root: str) -> dict:
    d = os.path.join(root, transport)
    dnctl("cluster", "up", "--nodes", "3", "--cluster", d, "--transport", transport, "--sync", "always",
          "--pool-mib", "64", "--replica-timeout", "20")
    try:
        out = dnctl("bench", "--cluster", d, "--replicas", "1,3", "--size", size, "--seconds", str(seconds),
                    "--transport", transport, "--json")
        return json.loads(out)
    finally:
        dnctl("cluster", "down", "--cluster", d)


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--seconds", type=float, default=8.0, show_default=True)
@click.option("--size", default="1MiB", type=click.Choice(sorted(SIZES)), show_default=True)
@click.option("--ib-iters", type=int, default=300, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def main(seconds, size, ib_iters, as_json) -> None:
    """Compare verbs, TCP and ib_read_bw inside the Soft-RoCE VM (dnctl bench on both transports)."""
    sys.exit(compare(types.SimpleNamespace(seconds=seconds, size=size, ib_iters=ib_iters, json=as_json)))


def compare(args) -> int:
    if not os.path.exists(f"/sys/class/infiniband/{DEV}"):
        print(f"no RDMA device {DEV}: run inside the VM: lab/softroce-vm run -- python -m bench.vm_compare")
        return 2
    root = tempfile.mkdtemp(prefix="vmcmp-")
    res = {"ib_read_bw_MBps": ib_read_bw(SIZES[args.size], args.ib_iters)}
    for t in ("verbs", "tcp"):
        res[t] = bench(t, args.size, args.seconds, root)
    shutil.rmtree(root, ignore_errors=True)
    if args.json:
        print(json.dumps(res, indent=2))
    summarize(res)
    return 0


def summarize(res: dict) -> None:
    """The ratios, from dnctl bench --json rows ({phase, replicas, mib_s, client_cpu: {s_per_gb}, ...})."""
    def pick(t, replicas, phase):
        for row in (res.get(t) or {}).get("results", []):
            if row.get("replicas") == replicas and row.get("phase") == phase:
                return row
        return {}

    def cpu(row):
        return (row.get("client_cpu") or {}).get("s_per_gb") or 0.0

    ib = res.get("ib_read_bw_MBps")
    print("\nsummary")
    print(f"  ib_read_bw {ib:.1f} MB/s" if ib else "  ib_read_bw: n/a")
    for t in ("verbs", "tcp"):
        for k in (1, 3):
            w, r = pick(t, k, "write"), pick(t, k, "read")
            print(f"  {t:5} replicas={k}: write {w.get('mib_s', 0):.1f} MiB/s, read {r.get('mib_s', 0):.1f} MiB/s,"
                  f" client CPU {cpu(w):.2f} s/GB written, {cpu(r):.2f} s/GB read")
    vw, tw = pick("verbs", 1, "write"), pick("tcp", 1, "write")
    if ib and vw.get("mib_s"):
        print(f"  leader ingest over verbs / ib_read_bw = {vw['mib_s'] * (1 << 20) / 1e6 / ib:.2f}")
    if cpu(vw) and cpu(tw):
        print(f"  client CPU per GB written, verbs / tcp = {cpu(vw) / cpu(tw):.2f}")


if __name__ == "__main__":
    main()
