"""What a datanode pays per view change: N ``PARTITION_UPDATE`` requests against N/64 ``PARTITION_UPDATE_MANY``.

    python -m bench.view_batch [--partitions 512] [--rounds 3] [--inflight 64]

One datanode (a fresh temporary directory, a free port, TCP, ``sync = always``) with N single-replica
partitions; each round raises every partition's epoch once with one ``PARTITION_UPDATE`` each (``--inflight``
at once, as the manager's admin requests go), then once more with ``PARTITION_UPDATE_MANY`` requests of
``MAX_VIEWS_PER_UPDATE`` views (all at once).  Prints, per round and way, the node's CPU (utime + stime from
/proc) per view and the wall time for all N: the CPU is what the batch saves (the request's handling and the
per-partition fsyncs), and it hardly moves with other load on the machine, which the wall time does.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import tempfile
import time

import trio

REPO = pathlib.Path(__file__).resolve().parent.parent

from client.sdk import DataClient
from tools import cluster as cl
from tools.cluster import NodeProc, free_port
from wire.limits import MAX_VIEWS_PER_UPDATE
from wire.protocol import Op


async def measure(node: NodeProc, n: int, rounds: int, inflight: int) -> None:
    async with DataClient.open(transport="tcp", timeout=30, pool_mib=16) as dc:
        limit = trio.Semaphore(inflight)
        addr = node.addr

        async def single(pid: int, epoch: int, op=Op.PARTITION_CREATE) -> None:
            async with limit:
                await dc.admin(addr, op, partition=pid, body={"replicas": [addr], "epoch": epoch})
        async with trio.open_nursery() as nursery:
            for pid in range(1, n + 1):
                nursery.start_soon(single, pid, 1)

        async def many(first: int, epoch: int) -> None:
            views = [{"partition": pid, "replicas": [addr], "epoch": epoch}
                     for pid in range(first, min(first + MAX_VIEWS_PER_UPDATE, n + 1))]
            resp = await dc.admin(addr, Op.PARTITION_UPDATE_MANY, body={"views": views})
            if resp.arg:
                raise SystemExit(f"the node did not install some views (mask {resp.arg:#x}): see {node.log_path}")

        epoch = 1
        for r in range(rounds):
            out = []
            for way in ("PARTITION_UPDATE", "PARTITION_UPDATE_MANY"):
                epoch += 1
                cpu0, t0 = cl.cpu_seconds(node.proc.pid), time.monotonic()
                async with trio.open_nursery() as nursery:
                    if way == "PARTITION_UPDATE":
                        for pid in range(1, n + 1):
                            nursery.start_soon(single, pid, epoch, Op.PARTITION_UPDATE)
                    else:
                        for first in range(1, n + 1, MAX_VIEWS_PER_UPDATE):
                            nursery.start_soon(many, first, epoch)
                cpu = cl.cpu_seconds(node.proc.pid) - cpu0
                out.append(f"{way}: {1000 * cpu / n:.2f} ms CPU per view, {time.monotonic() - t0:.2f} s wall")
            print(f"round {r + 1}, {n} views: " + " | ".join(out), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--partitions", type=int, default=512, help="partitions on the node (default 512)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of both ways (default 3)")
    ap.add_argument("--inflight", type=int, default=64, help="PARTITION_UPDATE requests at once (default 64)")
    a = ap.parse_args()
    if not 1 <= a.partitions <= 4096:
        ap.error("--partitions: 1..4096")
    os.environ["PYTHONPATH"] = str(REPO)       # the node runs from this checkout too
    with tempfile.TemporaryDirectory(prefix="view-batch-") as tmp:
        node = NodeProc(pathlib.Path(tmp) / "node", f"127.0.0.1:{free_port()}", transport="tcp", sync="always",
                        pool_mib=64, log_level="warning")
        node.start()
        try:
            trio.run(measure, node, a.partitions, a.rounds, a.inflight)
        except KeyboardInterrupt:
            pass
        finally:
            node.kill()
            if node.proc is not None:
                node.proc.wait(timeout=10)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
