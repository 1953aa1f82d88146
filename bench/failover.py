"""Failover timings with real processes: etcd, one manager, four datanodes, one SDK writer.

    python -m bench.failover --leader-kills 9 --follower-kills 3 --manager-kills 5 [--ttl 2] [--json]
    python -m bench.failover --leader-kills 0 --follower-kills 3 --fill-mib 1024   # 1 GiB to re-replicate

The writer is paced (``--rate``, 50 writes/s) and replaced copies are purged at once, so a long run of kills
does not fill the disk.  Each round waits for the full replica count, i.e. re-replicates the whole partition:
at 200 writes/s of 64 KiB, round 17 of a run took longer than the 120 s wait.

Per leader kill (kill -9): seconds from the kill to the writer's next acknowledged write.  Per follower kill:
seconds from the kill to the writer's next acknowledged write after the stall, and to the partition being
back at its full replica count (re-replicated onto the spare and filled by repair).  The killed node is
restarted after each round (its stale copy is dropped; it becomes the next spare).  Per manager kill: seconds
from kill -9 of the active manager until a standby holds the manager key.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import signal
import statistics
import sys
import tempfile
import time

import trio

from client.sdk import DataClient
from wire.etcdmap import Etcd
from wire.protocol import Op
from tools.cluster import NodeProc, free_port
from tools.etcd_cluster import EtcdProc, ManagerProc

MiB = 1 << 20


async def _wait_view(et: Etcd, pred, timeout=120.0):
    with trio.fail_after(timeout):
        while True:
            v = await et.part(1)
            if v is not None and pred(v):
                return v
            await trio.sleep(0.05)


def _full(v):
    return v.installed and v.state == "writable" and len(v.replicas) == v.want


async def _manager_rounds(et: Etcd, root: pathlib.Path, url: str, ttl: int, kills: int) -> list[float]:
    """Kill the active manager ``kills`` times; seconds until a standby holds the manager key."""
    mgrs = {f"m{i}": ManagerProc(root, url, f"m{i}", lease_ttl_s=ttl, down_after_s=0.5, tick_s=0.2,
                                     min_writable=0).start()
            for i in (2, 3)}
    out = []
    try:
        for _ in range(kills):
            with trio.fail_after(60):
                while True:
                    got = await et.get(et.manager_key)
                    if got and got[0].decode().split("@")[0] in mgrs:
                        break
                    await trio.sleep(0.05)
            active = got[0].decode()
            victim = mgrs[active.split("@")[0]]
            t0 = time.monotonic()
            victim.kill()
            with trio.fail_after(60):
                while True:
                    got = await et.get(et.manager_key)
                    if got and got[0].decode() != active:
                        break
                    await trio.sleep(0.02)
            out.append(round(time.monotonic() - t0, 3))
            print("manager", active, "->", got[0].decode(), out[-1], file=sys.stderr)
            victim.start()
    finally:
        for m in mgrs.values():
            m.stop()
    return out


async def bench(root: pathlib.Path, leader_kills: int, follower_kills: int, ttl: int, size: int,
                manager_kills: int = 0, fill: int = 0, repair_mib_s: float | None = None,
                rate: float = 50.0) -> dict:
    e = EtcdProc(root / "etcd").start()
    cfg = {"etcd": e.url, "lease_ttl_s": ttl, "heartbeat_s": 0.5, "pool_mib": 64, "transport": "tcp",
           "replica_timeout": 2.0, "sync": "always",
           "trash_retention_s": 0.0,     # a replaced node's stale copy is purged at once (else: disk fills up)
           **({"repair_mib_s": repair_mib_s} if repair_mib_s is not None else {})}
    nodes = [NodeProc(root / f"node{i}", f"127.0.0.1:{free_port()}", **cfg) for i in range(4)]
    mgr = ManagerProc(root, e.url, "m1", lease_ttl_s=ttl, down_after_s=0.5, tick_s=0.2,
                      min_writable=0)       # partition 1 only: the bench measures it alone
    out = {"lease_ttl_s": ttl, "down_after_s": 0.5, "write_size": size, "leader": [], "follower": [],
           "repair_mib_s": repair_mib_s if repair_mib_s is not None else "datanode default"}
    try:
        for n in nodes:
            n.start()
        byaddr = {n.addr: n for n in nodes}
        async with DataClient.from_env(transport="tcp", timeout=10) as dc0:
            for a in [n.addr for n in nodes[:3]]:
                await dc0.admin(a, Op.PARTITION_CREATE, partition=1,
                                body={"replicas": [n.addr for n in nodes[:3]], "epoch": 1})
        mgr.start()
        et = Etcd(e.url)
        await _wait_view(et, _full)
        acks: list[float] = []
        written = [0]
        async with DataClient.from_env(transport="tcp", timeout=30, etcd=e.url) as dc:
            if fill:                                # data the re-replication has to copy (--fill-mib)
                t_fill = time.monotonic()
                chunk = bytes(4 * MiB)
                while written[0] < fill:
                    await dc.write(1, chunk[:min(len(chunk), fill - written[0])])
                    written[0] += min(len(chunk), fill - written[0])
                out["fill_bytes"] = written[0]
                out["fill_s"] = round(time.monotonic() - t_fill, 1)
                print(f"filled partition 1 with {written[0] / MiB:.0f} MiB in {out['fill_s']}s", file=sys.stderr)

            async def writer():
                # paced (``rate`` writes/s at most): fine enough to time a stall to 1/rate s, and many kills
                # do not fill the disk
                data = bytes(size)
                next_at = trio.current_time()
                while True:
                    await dc.write(1, data)
                    acks.append(time.monotonic())
                    written[0] += size
                    next_at = max(next_at + 1 / rate, trio.current_time() - 1)
                    await trio.sleep_until(next_at)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(writer)
                await trio.sleep(1)
                rounds = [("leader", 0)] * leader_kills + [("follower", 1)] * follower_kills
                for kind, idx in rounds:
                    v = await _wait_view(et, _full)
                    await trio.sleep(0.5)
                    victim = byaddr[v.replicas[idx]]
                    n_before = len(acks)
                    t0 = time.monotonic()
                    victim.kill(signal.SIGKILL)
                    while not [t for t in acks[n_before:] if t > t0 + 0.05]:
                        await trio.sleep(0.01)
                    # the stall ends at the first ack after the longest gap in the next seconds
                    await trio.sleep(ttl + 4)
                    after = [t for t in acks[n_before:] if t > t0]
                    prev = [t0] + after
                    gaps = [(b - a, b) for a, b in zip(prev, after)]
                    resume = max(gaps)[1] - t0 if gaps else None
                    rec = {"killed": victim.addr, "resume_s": round(resume, 3)}
                    if kind == "follower":
                        await _wait_view(et, _full)
                        rec["full_again_s"] = round(time.monotonic() - t0, 3)
                        rec["partition_bytes"] = written[0]
                    out[kind].append(rec)
                    print(kind, rec, file=sys.stderr)
                    victim.start()                  # back as a spare (its stale copy is dropped)
                nursery.cancel_scope.cancel()
        if manager_kills:
            mgr.stop()                              # the bench's managers from here on: two, then kills
            xs = await _manager_rounds(et, root, e.url, ttl, manager_kills)
            out["manager_takeover_s"] = {"n": len(xs), "median": round(statistics.median(xs), 3),
                                         "max": max(xs), "runs": xs}
        for kind in ("leader", "follower"):
            xs = [r["resume_s"] for r in out[kind]]
            if xs:
                out[f"{kind}_resume_s"] = {"n": len(xs), "median": round(statistics.median(xs), 3),
                                           "max": round(max(xs), 3), "min": round(min(xs), 3)}
        xs = [r["full_again_s"] for r in out["follower"]]
        if xs:
            out["follower_full_again_s"] = {"n": len(xs), "median": round(statistics.median(xs), 3),
                                            "max": round(max(xs), 3)}
        return out
    finally:
        mgr.stop()
        for n in nodes:
            n.stop()
        e.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--leader-kills", type=int, default=7)
    ap.add_argument("--follower-kills", type=int, default=3)
    ap.add_argument("--manager-kills", type=int, default=0)
    ap.add_argument("--ttl", type=int, default=2, help="lease TTL of nodes and manager (s)")
    ap.add_argument("--size", type=int, default=64 << 10, help="bytes per write")
    ap.add_argument("--rate", type=float, default=50.0,
                    help="the writer's pace, writes/s at most (the stall is timed to 1/rate s; the partition "
                         "grows by rate x size per second, and each round re-replicates all of it)")
    ap.add_argument("--fill-mib", type=int, default=0,
                    help="write this much into the partition first (what a follower's replacement must copy)")
    ap.add_argument("--repair-mib-s", type=float, default=None,
                    help="datanodes' repair rate cap, MiB/s (default: the datanode's default; 0: uncapped)")
    ap.add_argument("--dir", help="keep the processes' data and logs here (default: a temp dir, removed)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="failover-bench-") as d:
        res = trio.run(bench, pathlib.Path(a.dir or d), a.leader_kills, a.follower_kills, a.ttl, a.size,
                       a.manager_kills, a.fill_mib * MiB, a.repair_mib_s, a.rate)
    print(json.dumps(res, indent=1) if a.json else
          f"lease ttl {res['lease_ttl_s']}s: leader kill -> next ack {res.get('leader_resume_s')}; "
          f"follower kill -> writes again {res.get('follower_resume_s')}, full count {res.get('follower_full_again_s')}; "
          f"manager takeover {res.get('manager_takeover_s')}")


if __name__ == "__main__":
    main()
