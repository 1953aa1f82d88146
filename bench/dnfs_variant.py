"""What the dnfs A/B benchmarks share: a checkout run as a variant, and a fresh cluster and mount of it.

A variant is NAME=DIR[:MOUNT-OPTIONS]: every process of a round (the cluster, `dnctl`, the mount) runs DIR's
code (PYTHONPATH=DIR), so two checkouts compare side by side on one machine.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

VARIANT_HELP = "NAME=DIR[:MOUNT-OPTIONS]"


def py(code: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """``python ARGS`` with the checkout ``code`` as its tree."""
    env = {**os.environ, "PYTHONPATH": code}
    return subprocess.run([sys.executable, *args], env=env, cwd=code, capture_output=True, text=True, check=check)


def fio(mnt: pathlib.Path, name: str, *args: str) -> dict:
    """One fio job (psync, no preallocation) in ``mnt``: its JSON report."""
    r = subprocess.run(["fio", f"--name={name}", f"--directory={mnt}", "--ioengine=psync", "--fallocate=none",
                        *args, "--output-format=json"], capture_output=True, text=True, check=True)
    return json.loads(r.stdout[r.stdout.index("{"):])["jobs"][0]


def variants(ap: argparse.ArgumentParser, values: list[str]) -> list[tuple[str, str, list[str]]]:
    """``--variant`` values as (name, checkout directory, mount options); a usage error for a bad one."""
    out = []
    for v in values:
        name, sep, rest = v.partition("=")
        code, _, opts = rest.partition(":")
        code = str(pathlib.Path(code).resolve())
        if not sep or not (pathlib.Path(code) / "client" / "fs").is_dir():
            ap.error(f"--variant {v!r}: expected {VARIANT_HELP}, DIR a checkout (with client/fs/)")
        out.append((name, code, opts.split()))
    return out


@dataclass
class Mounted:
    code: str
    opts: list[str]         # the variant's mount options
    root: pathlib.Path      # the round's scratch directory
    cluster: pathlib.Path
    mnt: pathlib.Path
    pid: int = 0            # the mount process, for its CPU
    mounted: bool = False

    def mount(self, log: str) -> None:
        """Mount the cluster at ``mnt``, the mount's log in ``root / log``."""
        out = py(self.code, "-m", "client.fs.cli", "mount", "--cluster", str(self.cluster), "--json", "--log",
                 str(self.root / log), *self.opts, str(self.mnt)).stdout
        self.pid, self.mounted = json.loads(out)["pid"], True

    def umount(self, check: bool = True) -> None:
        py(self.code, "-m", "client.fs.cli", "umount", str(self.mnt), check=check)
        self.mounted = False


@contextmanager
def mounted_cluster(code: str, opts: list[str], work: pathlib.Path, prefix: str) -> Iterator[Mounted]:
    """A fresh local 3-node cluster (sync=always) with partition 1 and a dnfs mount of it, both run from
    ``code``; unmounted, stopped and removed on the way out, whatever happened."""
    root = pathlib.Path(tempfile.mkdtemp(prefix=prefix, dir=work))
    mnt = root / "mnt"
    mnt.mkdir()
    cl = root / "cluster"
    m = None
    try:
        py(code, "-c", f"import pathlib; from tools import cluster as cl; cl.up(pathlib.Path({str(cl)!r}), 3, "
                       f"sync='always')")
        nodes = json.loads((cl / "cluster.json").read_text())["nodes"]
        py(code, "-m", "tools.dnctl", "partition", "create", "--id", "1", "--replicas",
           ",".join(n["addr"] for n in nodes))
        m = Mounted(code, opts, root, cl, mnt)
        m.mount("mount.log")
        yield m
    finally:
        if m is not None and m.mounted:
            m.umount(check=False)
        py(code, "-c", f"import pathlib; from tools import cluster as cl; cl.down(pathlib.Path({str(cl)!r}))",
           check=False)
        subprocess.run(["rm", "-rf", str(root)])
