"""``./dev mount-demo``: a local 3-node cluster mounted with dnfs; a tree of files copied in with ``cp -r``,
read back with ``cmp`` after a remount, throughput printed; then unmounted and stopped."""
from __future__ import annotations

import os
import pathlib
import random
import shutil
import subprocess
import sys
import time

import click

from tools import cluster as cl


def _dnfs(*args) -> str:
    r = subprocess.run([sys.executable, "-m", "client.fs.cli", *map(str, args)], capture_output=True, text=True)
    if r.returncode != 0:
        raise click.ClickException(f"dnfs {args[0]}: {(r.stderr or r.stdout).strip()}")
    return r.stdout.strip()


def _tree(root: pathlib.Path, mib: int) -> int:
    rnd = random.Random(1)
    total = 0
    for i in range(4):                                   # a few big files ...
        d = root / "big"
        d.mkdir(parents=True, exist_ok=True)
        n = (mib << 20) // 5
        (d / f"blob{i}.bin").write_bytes(rnd.randbytes(n))
        total += n
    for i in range(500):                                 # ... and many small ones
        d = root / "src" / f"pkg{i % 25:02d}"
        d.mkdir(parents=True, exist_ok=True)
        n = rnd.randrange(0, 16384)
        (d / f"mod{i:03d}.py").write_bytes(rnd.randbytes(n))
        total += n
    return total


@click.command()
@click.option("--dir", "root", default="./run/mount-demo", show_default=True, type=click.Path(file_okay=False),
              help="Working directory (cluster, mount point, source tree); emptied first.")
@click.option("--mib", type=click.IntRange(1, 100_000), default=200, show_default=True,
              help="About this many MiB of files.")
def main(root, mib):
    """Mount a local cluster, copy a tree in, read it back, show the throughput, unmount."""
    root = pathlib.Path(root).resolve()
    if (root / "cluster" / "cluster.json").exists():
        try:
            cl.down(root / "cluster")
        except Exception:       # noqa: BLE001 - a stale directory from an earlier run
            pass
    if (root / "mnt").exists() and os.path.ismount(root / "mnt"):
        subprocess.run(["fusermount3", "-u", "-z", str(root / "mnt")], capture_output=True)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    src, mnt = root / "tree", root / "mnt"
    mnt.mkdir()
    total = _tree(src, mib)
    subprocess.run([sys.executable, "-m", "tools.dnctl", "cluster", "up", "--nodes", "3", "--dir",
                    str(root / "cluster")], check=True, stdout=subprocess.DEVNULL)
    mounted = False
    try:
        click.echo(_dnfs("mount", "--cluster", root / "cluster", mnt))
        mounted = True
        t0 = time.monotonic()
        subprocess.run(["cp", "-r", str(src), str(mnt / "tree")], check=True)
        subprocess.run(["sync", "-f", str(mnt)], check=True)
        tw = time.monotonic() - t0
        _dnfs("umount", mnt)
        mounted = False
        _dnfs("mount", "--cluster", root / "cluster", mnt)          # read back through a fresh mount
        mounted = True
        t0 = time.monotonic()
        r = subprocess.run(["diff", "-r", "-q", str(src), str(mnt / "tree")], capture_output=True, text=True)
        tr = time.monotonic() - t0
        if r.returncode != 0:
            raise click.ClickException(f"read back differs: {r.stdout[:500]}")
        files = sum(len(f) for _, _, f in os.walk(src))
        click.echo(f"copied {files} files, {total / 2**20:.0f} MiB into the mount (3 replicas): "
                   f"{total / 2**20 / tw:.1f} MiB/s ({files / tw:.0f} files/s); read back and compared after "
                   f"a remount: {total / 2**20 / tr:.1f} MiB/s")
        _dnfs("umount", mnt)
        mounted = False
        click.echo(_dnfs("fsck", "--cluster", root / "cluster", "--no-crc").splitlines()[-1])
    finally:
        if mounted:
            subprocess.run([sys.executable, "-m", "client.fs.cli", "umount", str(mnt)], capture_output=True)
        cl.down(root / "cluster")
    click.echo(f"unmounted and stopped the cluster ({root})")


if __name__ == "__main__":
    main()
