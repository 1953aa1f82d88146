"""Repair throughput, with and without client writes, and what repair at its cap costs client writes.

    python -m bench.repair --mib 256 --cap 64

Three local datanodes (127.0.0.1).  Partition 1 holds ``--mib`` MiB on [n1, n2]; partition 2 is on all
three and takes the client load.  Each scenario adds n3 to partition 1 (``dnctl replica add``: epoch + 1,
the leader's repair fills it), times the fill until n3 is healthy, then removes n3 again (its copy is
deleted) for the next scenario:

  1. repair_alone       repair uncapped, no client writes                           -> repair MiB/s
  2. repair_with_load   repair uncapped while a client writes to partition 2        -> both
  3. capped_with_load   repair at --cap MiB/s while a client writes to partition 2  -> both

Before each loaded scenario the same client writes alone for ``--seconds`` (same processes): that is the
baseline its drop is measured against.
"""
from __future__ import annotations

import pathlib
import shutil
import tempfile
import time

import click
import trio

from client.admin import View, change_replicas, partition_list, request_pass, wait_settled
from client.sdk import DataClient
from datanode.config import SyncMode
from wire.protocol import Op
from tools.clikit import CTX, Command, emit

MiB = 1 << 20
CFG = {"pool_mib": 128, "replica_timeout": 5.0, "transport": "tcp", "heartbeat_s": 0.5,
       "repair_interval_s": 600.0, "scrub_interval_s": 0.0, "log_level": "warning"}


async def _bench(root: pathlib.Path, mib: int, cap: float, sync: str, seconds: float) -> dict:
    from tools.cluster import NodeProc, free_port

    procs = [NodeProc(root / f"node{i + 1}", f"127.0.0.1:{free_port()}", **CFG, sync=sync, repair_mib_s=0.0)
             for i in range(3)]
    a, b, c = (p.addr for p in procs)
    out: dict = {"mib": mib, "cap_mib_s": cap, "sync": sync}

    async def restart(repair_mib_s: float):
        for p in procs:
            if p.alive():
                await trio.to_thread.run_sync(p.stop)
            p.cfg["repair_mib_s"] = repair_mib_s
            await trio.to_thread.run_sync(p.start)

    async def load(dc, stop: trio.Event, box: dict):
        data = bytes(4 * MiB)
        t0 = time.monotonic()
        n = 0
        while not stop.is_set():
            await dc.write(2, data)
            n += len(data)
        box["mib_s"] = round(n / MiB / (time.monotonic() - t0), 1)

    async def baseline(dc) -> float:
        box: dict = {}
        stop = trio.Event()
        async with trio.open_nursery() as n:
            n.start_soon(load, dc, stop, box)
            await trio.sleep(seconds)
            stop.set()
        return box["mib_s"]

    async def fill_c(dc, with_load: bool) -> dict:
        base = await baseline(dc) if with_load else None    # same processes, just before
        view = View(1, [a, b], (await partition_list(dc, a))[0]["epoch"], a)
        for p in await partition_list(dc, a):
            if p["id"] == 1:
                view = View(1, p["replicas"], p["epoch"], a)
        box: dict = {}
        stop = trio.Event()
        async with trio.open_nursery() as n:
            if with_load:
                await dc.discover(a)
                n.start_soon(load, dc, stop, box)
                await trio.sleep(0.5)
            t0 = time.monotonic()
            await change_replicas(dc, view, [a, b, c])
            k = await request_pass(dc, a, 1, Op.REPAIR)
            h = await wait_settled(dc, a, 1, only=c, repair_pass=k, timeout=1800, interval=0.1)
            el = time.monotonic() - t0
            stop.set()
        res = {"fill_seconds": round(el, 2), "repair_mib_s": round(mib / el, 1),
               "last_pass_mib_s": (h["repair"]["last"] or {}).get("mib_s")}
        if with_load:
            res["client_baseline_mib_s"] = base
            res["client_mib_s"] = box.get("mib_s")
            res["client_drop_pct"] = round(100 * (1 - box["mib_s"] / base), 1)
        view = View(1, [a, b, c], view.epoch + 1, a)
        await change_replicas(dc, view, [a, b])          # n3 drops its copy for the next scenario
        return res

    try:
        await restart(0.0)
        async with DataClient.from_env(timeout=30, transport="tcp", pool_mib=64) as dc:
            for pid, reps in ((1, [a, b]), (2, [a, b, c])):
                for addr in reps:
                    await dc.admin(addr, Op.PARTITION_CREATE, partition=pid, body={"replicas": reps, "epoch": 1})
            await dc.discover(a)
            piece = bytes(range(256)) * (16 * MiB // 256)
            left = mib * MiB
            while left:
                await dc.write(1, piece[:min(left, len(piece))])
                left -= min(left, len(piece))
            out["repair_alone"] = await fill_c(dc, False)
            out["repair_with_load"] = await fill_c(dc, True)
        await restart(cap)
        async with DataClient.from_env(timeout=30, transport="tcp", pool_mib=64) as dc:
            await dc.discover(a)
            out["capped_with_load"] = await fill_c(dc, True)
    finally:
        for p in procs:
            p.stop(timeout=10)
    return out


@click.command("repair-bench", cls=Command, context_settings=CTX)
@click.option("--mib", type=click.IntRange(1), default=256, show_default=True,
              help="Data in the partition being repaired.")
@click.option("--cap", type=click.FloatRange(0.1), default=64.0, show_default=True,
              help="repair_mib_s for the capped scenario.")
@click.option("--sync", type=click.Choice([m.value for m in SyncMode]), default="always", show_default=True)
@click.option("--seconds", type=click.FloatRange(0.5), default=5.0, show_default=True,
              help="Length of the baseline write run.")
@click.option("--dir", "root", type=click.Path(file_okay=False),
              help="Work dir, kept afterwards (default: a temp dir, removed).")
def repair_bench_command(mib, cap, sync, seconds, root):
    """Repair throughput alone and under client writes, and what capped repair costs client writes.

    \b
    python -m bench.repair --mib 256 --cap 64

    Prints one JSON document (the scenarios are described in bench/repair.py).
    """
    work = pathlib.Path(root or tempfile.mkdtemp(prefix="dn-repair-bench-"))
    try:
        res = trio.run(_bench, work, mib, cap, sync, seconds)
    finally:
        if not root:
            shutil.rmtree(work, ignore_errors=True)
    emit(res, True)


if __name__ == "__main__":
    repair_bench_command()
