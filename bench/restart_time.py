"""Restart time of a datanode holding N GiB: process start -> listening, and -> serving.

    .venv/bin/python -m bench.restart_time --gib 2 --gib 10 [--cache warm --cache cold] [--before-src DIR] [--json]

For each size: a data dir with one partition is filled through the store API (``PartitionTable`` /
``ExtentStore``, sync=none, 128 MiB extents of incompressible bytes), then a datanode process is started on
it once per variant and cache state:

* ``before``     -- the code in ``--before-src`` (e.g. ``git archive <commit> | tar -x -C DIR``), run as is:
                    it CRC-checks every block before it listens;
* ``full``       -- this checkout with ``open_verify = "full"`` (listens at once, serves after checking all);
* ``tail``       -- this checkout with ``open_verify = "tail"`` (the default).

``cold`` drops this data dir's pages from the page cache first (fsync + posix_fadvise DONTNEED on our own
files only: nothing else on the machine is touched); ``warm`` reads them right after a run that read them.
Listening = a TCP connect succeeds; serving = NODE_STATUS says ``"state": "serving"`` (a node that reports
no state serves once it listens).  The data dir is removed at the end.
"""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import click
import trio

from client.sdk import ClientError, DataClient
from datanode import config as config_mod
from datanode.partition import PartitionTable
from wire.protocol import Op
from datanode.store import MAX_EXTENT
from tools.cluster import free_port


REPO = pathlib.Path(__file__).resolve().parent.parent

MiB = 1 << 20
GiB = 1 << 30
CHUNK = 4 * MiB


def fill(data_dir: pathlib.Path, addr: str, nbytes: int) -> None:
    """One partition led by ``addr`` holding ``nbytes`` in 128 MiB extents, written with the store API."""
    table = PartitionTable(data_dir, "none")
    part = table.create(1, [addr], 1)
    buf = bytearray(os.urandom(CHUNK))
    written, n = 0, 0
    try:
        while written < nbytes:
            eid = part.store.create_extent()
            off = 0
            while off < MAX_EXTENT and written < nbytes:
                take = min(CHUNK, nbytes - written, MAX_EXTENT - off)
                buf[:8] = n.to_bytes(8, "big")         # every chunk differs
                n += 1
                part.store.write(eid, off, memoryview(buf)[:take])
                off += take
                written += take
    finally:
        table.close()


def drop_cache(data_dir: pathlib.Path) -> None:
    """Evict this data dir's files from the page cache (clean pages only: fsync first)."""
    for p in data_dir.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


async def _measure(cmd: list[str], env: dict, cwd: str, addr: str, log_path: pathlib.Path,
                   limit: float) -> dict:
    host, _, port = addr.rpartition(":")
    with open(log_path, "ab") as log:
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    out: dict = {}
    seen_starting = False
    try:
        with trio.fail_after(limit):
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"node exited with {proc.returncode}; see {log_path}")
                try:
                    stream = await trio.open_tcp_stream(host, int(port))
                except OSError:
                    await trio.sleep(0.005)
                    continue
                out["listening_s"] = round(time.monotonic() - t0, 3)
                await stream.aclose()
                break
            async with DataClient.from_env(timeout=10, pool_mib=2, transport="tcp") as dc:
                while True:
                    try:
                        st = await dc.admin(addr, Op.NODE_STATUS)
                    except ClientError:
                        await trio.sleep(0.01)
                        continue
                    if st.get("state", "serving") == "serving":
                        out["serving_s"] = round(time.monotonic() - t0, 3)
                        out["opening"] = st.get("opening")
                        break
                    seen_starting = True
                    await trio.sleep(0.01)
                parts = await dc.admin(addr, Op.PARTITION_LIST)
                out["extents"] = sum(p["extents"] for p in parts)
                out["bytes"] = sum(p["bytes"] for p in parts)
        out["answered_while_starting"] = seen_starting
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return out


def run_node(src: pathlib.Path, node_dir: pathlib.Path, addr: str, data_dir: pathlib.Path,
             open_verify: str | None, limit: float) -> dict:
    cfg = {"listen": addr, "data_dir": str(data_dir), "pool_mib": 64, "transport": "tcp", "sync": "none",
           "scrub_interval_s": 0.0, "log_level": "info"}
    if open_verify is not None:
        cfg["open_verify"] = open_verify
        config_mod.from_dict(cfg)            # this checkout's config accepts it
    # (older code is given only the keys it knows: the ones above, without open_verify)
    text = "".join(f"{k} = {json.dumps(v)}\n" for k, v in cfg.items())
    conf = node_dir / f"node-{open_verify or 'before'}.toml"
    conf.write_text(text)
    env = {**os.environ, "PYTHONPATH": str(src)}
    cmd = [sys.executable, "-m", "datanode.cli", "serve", "--config", str(conf)]
    return trio.run(_measure, cmd, env, str(src), addr, node_dir / "node.log", limit)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--gib", "sizes", type=float, multiple=True, default=[2.0], show_default=True,
              help="Data held by the node, GiB (repeat for several sizes).")
@click.option("--cache", "caches", type=click.Choice(["warm", "cold"]), multiple=True,
              default=["cold", "warm"], show_default=True, help="Page-cache state of the data at start.")
@click.option("--before-src", type=click.Path(file_okay=False, exists=True),
              help="A source tree of the code before the change (its datanode/ is run as is).")
@click.option("--work-dir", type=click.Path(file_okay=False), help="Where the data dir goes (default: a temp dir).")
@click.option("--limit", type=float, default=900.0, show_default=True, help="Seconds one start may take.")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
def main(sizes, caches, before_src, work_dir, limit, as_json):
    """Measure how long a datanode holding N GiB takes to listen and to serve after a restart."""
    variants = ([("before", pathlib.Path(before_src).resolve(), None)] if before_src else []) + [
        ("full", REPO, "full"), ("tail", REPO, "tail")]
    results = []
    for gib in sizes:
        root = pathlib.Path(tempfile.mkdtemp(prefix="restart-bench-", dir=work_dir))
        try:
            addr = f"127.0.0.1:{free_port()}"
            data_dir = root / "data"
            t = time.monotonic()
            fill(data_dir, addr, int(gib * GiB))
            drop_cache(data_dir)
            click.echo(f"{gib:g} GiB written and synced in {time.monotonic() - t:.1f}s ({root})", err=True)
            for cache in caches:
                for name, src, verify in variants:
                    if cache == "cold":
                        drop_cache(data_dir)
                    else:
                        run_node(REPO, root, addr, data_dir, "full", limit)    # read everything once
                    r = run_node(src, root, addr, data_dir, verify, limit)
                    rec = {"gib": gib, "cache": cache, "variant": name, **r}
                    results.append(rec)
                    click.echo(f"{gib:5g} GiB {cache:4} {name:6}  listening {r['listening_s']:7.3f}s  "
                               f"serving {r['serving_s']:7.3f}s  ({r['extents']} extents, {r['bytes']} bytes)",
                               err=True)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    if as_json:
        click.echo(json.dumps(results, indent=2))
    else:
        click.echo(f"{'GiB':>5} {'cache':5} {'variant':7} {'listening s':>12} {'serving s':>10}")
        for r in results:
            click.echo(f"{r['gib']:5g} {r['cache']:5} {r['variant']:7} {r['listening_s']:12.3f} "
                       f"{r['serving_s']:10.3f}")


if __name__ == "__main__":
    main()
