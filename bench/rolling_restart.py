"""A rolling restart under fsync-ed writes through a dnfs mount: per node, the longest write stall and the errors.

    .venv/bin/python -m bench.rolling_restart [--nodes 3] [--writers 2] [--kib 64] [--rounds 1] [--json]

Starts a local cluster (`dnctl cluster up`: etcd, a manager, N datanodes) in a scratch directory, mounts it with
dnfs following etcd's map, and starts ``--writers`` threads, each appending ``--kib`` records to a file of its
own with an fsync after each.  After ``--warmup-s`` it runs `dnctl cluster rolling-restart` (``--rounds``
times).  The table: per node, the seconds from its SIGTERM until the cluster was back in sync, the writes that
ended in that window, the longest of them (write + fsync: what the application waited) and the errors the
writers saw.  The first row is the same writers before the restart began -- what the load alone costs on this
machine, the baseline to read the others against.  Afterwards the files are read back through a fresh mount,
and every byte from every replica of its partition.  Exit status 1 on any error or missing byte.

The goal: no error, and no node's longest stall above 0.5 s.  On a shared or loaded machine every figure is
inflated; compare the node rows with the baseline row of the same run.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

from lab import rolling


REPO = pathlib.Path(__file__).resolve().parent.parent


def _cli(*args, timeout: float = 600) -> str:
    r = subprocess.run([sys.executable, "-m", *map(str, args)], cwd=REPO, capture_output=True, text=True,
                       timeout=timeout)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(map(str, args[:3]))} failed: {(r.stderr or r.stdout).strip()}")
    return r.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=3, help="datanodes in the cluster (3 or more)")
    ap.add_argument("--writers", type=int, default=2, help="threads appending and fsyncing, a file each")
    ap.add_argument("--kib", type=int, default=64, help="bytes per write, KiB")
    ap.add_argument("--rounds", type=int, default=1, help="rolling restarts, one after the other")
    ap.add_argument("--warmup-s", type=float, default=3.0, help="writes before the first restart (the baseline)")
    ap.add_argument("--json", action="store_true", help="the rows as JSON")
    args = ap.parse_args()
    if args.nodes < 3:
        ap.error("--nodes: at least 3 (each node's partitions move to the others)")
    with tempfile.TemporaryDirectory(prefix="rolling-") as tmp:
        root, mnt = pathlib.Path(tmp) / "dn", pathlib.Path(tmp) / "mnt"
        mnt.mkdir()
        _cli("tools.dnctl", "cluster", "up", "--nodes", args.nodes, "--cluster", root, "--json")
        mounted = False
        try:
            _settle(root)
            _cli("client.fs.cli", "mount", "--cluster", root, "--log", root / "mnt.log", mnt)
            mounted = True
            writers = [rolling.MountWriter(mnt / f"w{i}.bin", i, args.kib << 10) for i in range(args.writers)]
            for w in writers:
                w.start()
            time.sleep(args.warmup_s)
            nodes = []
            for _ in range(args.rounds):
                nodes += json.loads(_cli("tools.dnctl", "cluster", "rolling-restart", "--cluster", root, "--json",
                                         "--quiet"))["nodes"]
            time.sleep(0.5)
            for w in writers:
                w.halt.set()
                w.join(60)
            rows = rolling.stall_table(writers, nodes, since=nodes[0]["stopping_at"])
            files = {w.path.name: w.data for w in writers}
            _cli("client.fs.cli", "umount", mnt)
            _cli("client.fs.cli", "mount", "--cluster", root, "--log", root / "mnt2.log", mnt)
            bad = [f"{n} reads back other bytes" for n, want in files.items() if (mnt / n).read_bytes() != want]
            _cli("client.fs.cli", "umount", mnt)
            mounted = False
            bad += rolling.check_replicas(root / "dnfs.db", root, files)
        finally:
            if mounted:
                subprocess.run([sys.executable, "-m", "client.fs.cli", "umount", str(mnt)], cwd=REPO,
                               capture_output=True, timeout=120)
            subprocess.run([sys.executable, "-m", "tools.dnctl", "cluster", "down", "--cluster", str(root)],
                           cwd=REPO, capture_output=True, timeout=300)
    errors = [e for w in writers for _t, e in w.errors]
    if args.json:
        print(json.dumps({"rows": rows, "errors": errors, "bytes_on_every_replica": not bad,
                          "bytes": sum(map(len, files.values())), "problems": bad[:20]}, indent=2))
    else:
        print(f"rolling restart of {args.nodes} nodes x{args.rounds}, {args.writers} writer(s) of "
              f"{args.kib} KiB + fsync, through a dnfs mount (cpus: {os.cpu_count()}, load {os.getloadavg()[0]:.1f})")
        print(f"{'node':22} {'window s':>9} {'writes':>7} {'longest stall':>14} {'errors':>7}")
        for r in rows:
            print(f"{r['node']:22} {r['seconds'] if r['seconds'] is not None else '-':>9} {r['writes']:>7} "
                  f"{r['longest_s'] * 1e3:>11.0f} ms {r['errors']:>7}")
        print(f"every acknowledged byte ({sum(map(len, files.values()))} bytes) on every replica: "
              + ("yes" if not bad else f"NO: {'; '.join(bad[:5])}"))
        for e in errors:
            print(f"error: {e}")
    sys.exit(1 if bad or errors else 0)


def _settle(root: pathlib.Path, timeout: float = 60.0) -> None:
    import trio
    deadline = time.monotonic() + timeout
    while not trio.run(rolling.settled, root):
        if time.monotonic() > deadline:
            raise SystemExit(f"the cluster's partitions did not settle within {timeout:g}s")
        time.sleep(0.2)


if __name__ == "__main__":
    main()
