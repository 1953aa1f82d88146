"""Crash torture: clients write (and read back) continuously while random nodes are SIGKILLed and restarted.

    python -m lab torture --seed 7 --seconds 120

Three datanodes on 127.0.0.1 host two partitions with different leaders ([n1,n2,n3] and [n2,n3,n1]), so
kills hit leaders and followers alike.  ``--clients`` writer tasks (one DataClient each) write random-sized
payloads derived from (seed, client, n) and, between writes, read back a random earlier acknowledged write:
a read may fail while nodes are down, but it must never return wrong bytes.  A driver kills one random
node (SIGKILL), waits, restarts it, many times.  Writes need every replica, so writes fail while a node is
down; the SDK moves to a new extent after a failure.

At the end every node is up, each leader is asked for a full repair pass and waited on, and then every
acknowledged write is read back from every replica, and every extent must be identical on all replicas.
Exit status 0 only if all of that holds.  Only 127.0.0.1; every process started is killed at the end.
"""
from __future__ import annotations

import json
import logging
import pathlib
import random
import shutil
import signal
import sys
import tempfile
import time

import click
import trio

from client.admin import request_pass, wait_settled
from client.sdk import ClientError, DataClient, Location
from wire.crc import crc32c
from wire.protocol import Op
from tools.clikit import CTX, Command, emit

KiB, MiB = 1 << 10, 1 << 20
NODE_CFG = {"pool_mib": 64, "replica_timeout": 2.0, "pool_wait": 5.0, "sync": "always", "transport": "tcp",
            "heartbeat_s": 0.3, "repair_interval_s": 5.0, "repair_mib_s": 0.0, "scrub_interval_s": 0.0,
            "log_level": "info"}


def payload(seed: int, client: int, n: int, size: int) -> bytes:
    return random.Random(f"{seed}/{client}/{n}").randbytes(size)


async def _run(seed: int, seconds: float, clients: int, root: pathlib.Path, log) -> dict:
    from tools.cluster import NodeProc, free_port

    rng = random.Random(seed)
    procs = [NodeProc(root / f"node{i + 1}", f"127.0.0.1:{free_port()}", **NODE_CFG) for i in range(3)]
    addrs = [p.addr for p in procs]
    parts = {1: addrs, 2: addrs[1:] + addrs[:1]}
    res = {"seed": seed, "seconds": seconds, "clients": clients, "nodes": addrs, "kills": 0, "leader_kills": 0,
           "acked_writes": 0, "acked_bytes": 0, "write_failures": 0, "reads": 0, "read_failures": 0,
           "wrong_reads": [], "verify_errors": [], "ok": False}
    acked: list[tuple[int, int, list[Location]]] = []     # (client, n, locations)
    sizes: dict[tuple[int, int], int] = {}
    try:
        for p in procs:
            await trio.to_thread.run_sync(p.start)
        async with DataClient.from_env(timeout=10, transport="tcp") as admin:
            for pid, reps in parts.items():
                for a in reps:
                    await admin.admin(a, Op.PARTITION_CREATE, partition=pid, body={"replicas": reps, "epoch": 1})
        t0 = time.monotonic()
        deadline = trio.current_time() + seconds

        async def client_task(ci: int):
            crng = random.Random(f"{seed}/c{ci}")
            async with DataClient.from_env(addrs[:1], timeout=5, transport="tcp", pool_mib=32) as dc:
                n = 0
                while trio.current_time() < deadline:
                    pid = crng.choice(list(parts))
                    size = crng.choice([crng.randrange(1, 64 * KiB), crng.randrange(1, 1 * MiB),
                                        crng.randrange(1, 3 * MiB)])
                    n += 1
                    data = payload(seed, ci, n, size)
                    try:
                        locs = await dc.write(pid, data)
                        acked.append((ci, n, locs))
                        sizes[(ci, n)] = size
                        res["acked_writes"] += 1
                        res["acked_bytes"] += size
                    except ClientError:
                        res["write_failures"] += 1
                        await trio.sleep(0.05)
                    if acked:                       # read back a random earlier acknowledged write
                        rc, rn, rlocs = acked[crng.randrange(len(acked))]
                        want = payload(seed, rc, rn, sizes[(rc, rn)])
                        res["reads"] += 1
                        try:
                            got = b"".join([await dc.read_location(loc) for loc in rlocs])
                        except ClientError:
                            res["read_failures"] += 1
                            continue
                        if got != want:
                            res["wrong_reads"].append({"client": rc, "n": rn, "locations":
                                                       [loc.to_dict() for loc in rlocs]})
                            log(f"WRONG BYTES reading client {rc} write {rn} at {rlocs[0]}")

        async def driver():
            while trio.current_time() < deadline - 1.0:
                await trio.sleep(rng.uniform(0.5, 2.0))
                victim = rng.randrange(3)
                p = procs[victim]
                leads = [pid for pid, reps in parts.items() if reps[0] == p.addr]
                p.kill(signal.SIGKILL)
                res["kills"] += 1
                res["leader_kills"] += bool(leads)
                log(f"{time.monotonic() - t0:6.1f}s kill -9 node{victim + 1} ({p.addr})"
                    + (f", leader of partition {leads}" if leads else ""))
                await trio.sleep(rng.uniform(0.2, 1.5))
                await trio.to_thread.run_sync(p.start)

        async with trio.open_nursery() as n:
            n.start_soon(driver)
            for ci in range(clients):
                n.start_soon(client_task, ci)
        res["run_seconds"] = round(time.monotonic() - t0, 1)
        for p in procs:
            if not p.alive():
                await trio.to_thread.run_sync(p.start)
        # settle: a full repair pass on each leader, every follower healthy
        t1 = time.monotonic()
        async with DataClient.from_env(addrs, timeout=10, transport="tcp", pool_mib=32) as dc:
            for pid, reps in parts.items():
                k = await request_pass(dc, reps[0], pid, Op.REPAIR)
                await wait_settled(dc, reps[0], pid, repair_pass=k, timeout=180)
            res["settle_seconds"] = round(time.monotonic() - t1, 1)
            for ci, n, locs in acked:
                want = payload(seed, ci, n, sizes[(ci, n)])
                for a in addrs:
                    try:
                        got = b"".join([await dc.read_location(loc, replica=a) for loc in locs])
                    except ClientError as e:
                        got = None
                        err = str(e)
                    if got != want:
                        res["verify_errors"].append({"client": ci, "n": n, "replica": a,
                                                     "error": err if got is None else "wrong bytes"})
            for pid, reps in parts.items():
                marks = {a: await dc.watermarks(pid, a) for a in reps}
                if len({json.dumps(m, sort_keys=True) for m in marks.values()}) != 1:
                    res["verify_errors"].append({"partition": pid, "error": f"extent sizes differ: {marks}"})
                    continue
                for e, size in marks[reps[0]].items():
                    crcs = {a: crc32c(await dc.read(pid, e, 0, size, replica=a)) for a in reps} if size else {}
                    if len(set(crcs.values())) > 1:
                        res["verify_errors"].append({"partition": pid, "extent": e, "error": f"crcs {crcs}"})
            res["extents"] = {pid: len(await dc.watermarks(pid, reps[0])) for pid, reps in parts.items()}
            res["repair_bytes"] = res["repair_truncates"] = 0
            for a in addrs:
                counters = (await dc.admin(a, Op.NODE_STATUS))["counters"]
                res["repair_bytes"] += counters["repair_bytes"]
                res["repair_truncates"] += counters["repair_truncates"]
        res["ok"] = not res["wrong_reads"] and not res["verify_errors"] and res["acked_writes"] > 0
        res["total_seconds"] = round(time.monotonic() - t0, 1)
    finally:
        for p in procs:
            try:
                p.stop(timeout=10)
            except Exception:       # noqa: BLE001 - make sure the rest are stopped too
                p.kill()
    return res


def main_sync(seed: int | None = None, seconds: float = 60, clients: int = 3, root: str | None = None,
              log=None) -> dict:
    if seed is None:
        seed = random.SystemRandom().randrange(1 << 31)
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    logging.getLogger("client.sdk").setLevel(logging.ERROR)   # "continuing on a new extent" is expected
    log(f"torture: seed {seed}, {seconds:g}s, {clients} clients")
    tmp = None
    if root is None:
        tmp = tempfile.mkdtemp(prefix="dn-torture-")
        root = tmp
    try:
        return trio.run(_run, seed, seconds, clients, pathlib.Path(root), log)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def summary(res: dict) -> str:
    return (f"torture seed {res['seed']}: {'PASS' if res['ok'] else 'FAIL'} -- {res.get('run_seconds')}s under "
            f"fire, {res['kills']} kills ({res['leader_kills']} of a leader), {res['acked_writes']} acked writes "
            f"({res['acked_bytes'] / MiB:.1f} MiB), {res['write_failures']} failed writes, {res['reads']} reads "
            f"during the run ({res['read_failures']} failed, {len(res['wrong_reads'])} wrong), settled in "
            f"{res.get('settle_seconds')}s, {res.get('repair_bytes', 0) / MiB:.1f} MiB repaired ({res.get('repair_truncates', 0)} cuts), "
            f"{len(res['verify_errors'])} verify errors")


@click.command("torture", cls=Command, context_settings=CTX)
@click.option("--seed", type=int, help="Random seed (default: random, printed).")
@click.option("--seconds", type=click.FloatRange(1), default=60, show_default=True)
@click.option("--clients", type=click.IntRange(1, 16), default=3, show_default=True)
@click.option("--dir", "root", type=click.Path(file_okay=False),
              help="Work dir, kept afterwards (default: a temp dir, removed).")
@click.option("--json", "as_json", is_flag=True)
def torture_command(seed, seconds, clients, root, as_json):
    """Crash torture: clients write continuously while random nodes (leaders too) are SIGKILLed and
    restarted; at the end every acknowledged write must read back from every replica.  Exit status 1
    if anything was lost or wrong.

    \b
    python -m lab.torture --seed 7 --seconds 300
    python -m lab torture --seconds 60
    """
    res = main_sync(seed=seed, seconds=seconds, clients=clients, root=root)
    emit(res, as_json, summary(res))
    if not res["ok"]:
        sys.exit(1)


if __name__ == "__main__":
    torture_command()
