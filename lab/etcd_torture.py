"""Cluster soak on etcd: writes under random kill -9 of datanodes, managers and one etcd member, then verify.

    python -m lab.etcd_torture --seed 7 --seconds 600          # the long soak
    python -m lab.etcd_torture --seconds 60 --json

The cluster (all real processes on 127.0.0.1): a 3-member etcd cluster, two managers (one active, one
standby), four datanodes holding two 3-replica partitions with different leaders (so there is always a
spare for re-replication).  ``--clients`` SDK clients, each following the map in etcd, write (together at most
``--mib-s``) random-sized payloads derived from (seed, client, n) and read back a random earlier acknowledged write between writes:
a read may fail while the cluster heals, it must never return wrong bytes.

A driver picks, every 1-4 s, one victim -- a datanode (most often), a manager, or an etcd member -- kills it
with SIGKILL and restarts it after 0.5-4 s.  At most one datanode and one etcd member are down at a time
(etcd keeps its quorum; a partition never loses two replicas at once, so a synced replica always survives).
A killed datanode that was replaced meanwhile comes back as a spare and drops its stale copy.

Verify pass: everything is restarted, the run waits until every partition is back to its full replica
count, installed, ``writable``, and its leader's repair has settled; then every acknowledged write is read
back from every replica of the final view, and every extent must have the same size and CRC on all of them.
Exit status 0 only if that holds (0 acknowledged writes lost, 0 wrong reads).  The tool's own processes are
stopped at the end; nothing but 127.0.0.1 is used.
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
from wire.etcdmap import Etcd, EtcdError
from wire.protocol import Op
from tools.clikit import CTX, Command, emit
from lab.torture import KiB, MiB, payload

TTL = 2
NODE_CFG = {"pool_mib": 64, "replica_timeout": 2.0, "pool_wait": 5.0, "sync": "always", "transport": "tcp",
            "heartbeat_s": 0.5, "repair_interval_s": 5.0, "repair_mib_s": 0.0, "scrub_interval_s": 0.0,
            "lease_ttl_s": TTL, "log_level": "info",
            "trash_retention_s": 0.0}    # a replaced node's stale copy is purged at once (else: disk fills up)
N_NODES = 4


async def _settled_views(et: Etcd, pids, timeout: float) -> dict:
    """Every partition back at full count, installed, synced and writable (raises TooSlowError)."""
    with trio.fail_after(timeout):
        while True:
            try:
                parts = await et.parts()
            except EtcdError:
                parts = {}
            ok = {p: v for p, v in parts.items() if p in pids and v.installed and v.state == "writable"
                  and len(v.replicas) == v.want and set(v.synced) == set(v.replicas)}
            if len(ok) == len(pids):
                return ok
            await trio.sleep(0.25)


async def _run(seed: int, seconds: float, clients: int, root: pathlib.Path, log, mib_s: float = 4.0) -> dict:
    from tools.cluster import NodeProc, free_port
    from tools.etcd_cluster import ManagerProc, etcd_cluster, urls

    rng = random.Random(seed)
    res = {"seed": seed, "seconds": seconds, "clients": clients, "kills": {"datanode": 0, "manager": 0, "etcd": 0},
           "leader_kills": 0, "acked_writes": 0, "acked_bytes": 0, "write_failures": 0, "reads": 0,
           "read_failures": 0, "wrong_reads": [], "verify_errors": [], "ok": False}
    members = etcd_cluster(root / "etcd", 3)
    url = urls(members)
    cfg = {**NODE_CFG, "etcd": url}
    procs = [NodeProc(root / f"node{i + 1}", f"127.0.0.1:{free_port()}", **cfg) for i in range(N_NODES)]
    addrs = [p.addr for p in procs]
    mgrs = [ManagerProc(root / "managers", url, f"m{i}", lease_ttl_s=TTL, down_after_s=0.5, tick_s=0.2)
            for i in (1, 2)]
    parts = {1: addrs[:3], 2: addrs[1:4]}
    acked: list[tuple[int, int, list[Location]]] = []
    sizes: dict[tuple[int, int], int] = {}
    et = Etcd(url)
    try:
        for p in procs:
            await trio.to_thread.run_sync(p.start)
        async with DataClient.from_env(timeout=10, transport="tcp") as admin:
            for pid, reps in parts.items():
                for a in reps:
                    await admin.admin(a, Op.PARTITION_CREATE, partition=pid, body={"replicas": reps, "epoch": 1})
        for m in mgrs:
            m.start()
        await _settled_views(et, set(parts), 60)
        t0 = time.monotonic()
        deadline = trio.current_time() + seconds
        pace = [trio.current_time()]

        async def throttle(n: int) -> None:
            """All clients together write at most ``mib_s`` (a long soak must not fill the disk)."""
            if mib_s > 0:
                t = max(pace[0], trio.current_time())
                pace[0] = t + n / (mib_s * MiB)
                await trio.sleep_until(t)

        async def client_task(ci: int):
            crng = random.Random(f"{seed}/c{ci}")
            async with DataClient.from_env(timeout=15, transport="tcp", pool_mib=32, etcd=url) as dc:
                n = 0
                while trio.current_time() < deadline:
                    pid = crng.choice(list(parts))
                    size = crng.choice([crng.randrange(1, 64 * KiB), crng.randrange(1, 1 * MiB)])
                    await throttle(size)
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
                        await trio.sleep(0.1)
                    if acked:
                        rc, rn, rlocs = acked[crng.randrange(len(acked))]
                        res["reads"] += 1
                        try:
                            got = b"".join([await dc.read_location(loc) for loc in rlocs])
                        except ClientError:
                            res["read_failures"] += 1
                            continue
                        if got != payload(seed, rc, rn, sizes[(rc, rn)]):
                            res["wrong_reads"].append({"client": rc, "n": rn,
                                                       "locations": [loc.to_dict() for loc in rlocs]})
                            log(f"WRONG BYTES reading client {rc} write {rn} at {rlocs[0]}")

        async def driver():
            first = ["datanode", "manager", "etcd"]     # every kind at least once, then at random
            while trio.current_time() < deadline - 2.0:
                await trio.sleep(rng.uniform(1.0, 4.0))
                kind = first.pop(0) if first else rng.choices(["datanode", "manager", "etcd"], weights=[6, 2, 2])[0]
                if kind == "datanode":
                    p = procs[rng.randrange(N_NODES)]
                    try:
                        views = await et.parts()
                    except EtcdError:
                        views = {}
                    leads = [pid for pid, v in views.items() if v.leader == p.addr]
                    res["leader_kills"] += bool(leads)
                    what = f"datanode {p.addr}" + (f" (leader of {leads})" if leads else "")
                    kill, start = (lambda p=p: p.kill(signal.SIGKILL)), p.start
                elif kind == "manager":                 # the active one (a standby's death changes nothing)
                    try:
                        got = await et.get(et.manager_key)
                    except EtcdError:
                        got = None
                    active = got[0].decode().split("@")[0] if got else None
                    m = next((m for m in mgrs if m.name == active), mgrs[rng.randrange(2)])
                    what, kill, start = f"manager {m.name}" + (" (active)" if m.name == active else ""), m.kill, m.start
                else:
                    m = members[rng.randrange(3)]
                    what, kill, start = f"etcd member {m.name}", m.kill, (lambda m=m: m.start(wait=False))
                kill()
                res["kills"][kind] += 1
                log(f"{time.monotonic() - t0:6.1f}s kill -9 {what}")
                await trio.sleep(rng.uniform(0.5, 4.0))
                await trio.to_thread.run_sync(start)

        async with trio.open_nursery() as n:
            n.start_soon(driver)
            for ci in range(clients):
                n.start_soon(client_task, ci)
        res["run_seconds"] = round(time.monotonic() - t0, 1)

        # -- verify ---------------------------------------------------------------------------------
        t1 = time.monotonic()
        for m in members:
            if not m.alive():
                m.start()
        for m in mgrs:
            if not m.alive():
                m.start()
        for p in procs:
            if not p.alive():
                await trio.to_thread.run_sync(p.start)
        views = await _settled_views(et, set(parts), 180)
        async with DataClient.from_env(timeout=15, transport="tcp", pool_mib=32, etcd=url) as dc:
            for pid, v in views.items():
                k = await request_pass(dc, v.leader, pid, Op.REPAIR)
                await wait_settled(dc, v.leader, pid, repair_pass=k, timeout=180)
            views = await _settled_views(et, set(parts), 60)
            res["settle_seconds"] = round(time.monotonic() - t1, 1)
            res["final_views"] = {pid: v.to_dict() for pid, v in views.items()}
            for ci, n, locs in acked:
                want = payload(seed, ci, n, sizes[(ci, n)])
                for a in views[locs[0].partition].replicas:
                    err = "wrong bytes"
                    try:
                        got = b"".join([await dc.read_location(loc, replica=a) for loc in locs])
                    except ClientError as e:
                        got, err = None, str(e)
                    if got != want:
                        res["verify_errors"].append({"client": ci, "n": n, "replica": a, "error": err})
            for pid, v in views.items():
                marks = {a: await dc.watermarks(pid, a) for a in v.replicas}
                if len({json.dumps(m, sort_keys=True) for m in marks.values()}) != 1:
                    res["verify_errors"].append({"partition": pid, "error": f"extent sizes differ: {marks}"})
                    continue
                for e, size in marks[v.leader].items():
                    crcs = {a: crc32c(await dc.read(pid, e, 0, size, replica=a)) for a in v.replicas} if size else {}
                    if len(set(crcs.values())) > 1:
                        res["verify_errors"].append({"partition": pid, "extent": e, "error": f"crcs {crcs}"})
        res["ok"] = not res["wrong_reads"] and not res["verify_errors"] and res["acked_writes"] > 0
        res["total_seconds"] = round(time.monotonic() - t0, 1)
    finally:
        for m in mgrs:
            m.stop()
        for p in procs:
            try:
                p.stop(timeout=10)
            except Exception:       # noqa: BLE001 - make sure the rest are stopped too
                p.kill()
        for m in members:
            m.stop()
    return res


def main_sync(seed: int | None = None, seconds: float = 60, clients: int = 3, root: str | None = None,
              log=None, mib_s: float = 4.0) -> dict:
    if seed is None:
        seed = random.SystemRandom().randrange(1 << 31)
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    logging.getLogger("client.sdk").setLevel(logging.ERROR)
    log(f"etcd torture: seed {seed}, {seconds:g}s, {clients} clients")
    tmp = None
    if root is None:
        tmp = tempfile.mkdtemp(prefix="dn-etcd-torture-")
        root = tmp
    try:
        return trio.run(_run, seed, seconds, clients, pathlib.Path(root), log, mib_s)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def summary(res: dict) -> str:
    k = res["kills"]
    return (f"etcd torture seed {res['seed']}: {'PASS' if res['ok'] else 'FAIL'} -- {res.get('run_seconds')}s "
            f"under fire, kill -9 of {k['datanode']} datanodes ({res['leader_kills']} leaders), {k['manager']} "
            f"managers, {k['etcd']} etcd members; {res['acked_writes']} acked writes "
            f"({res['acked_bytes'] / MiB:.1f} MiB), {res['write_failures']} failed writes, {res['reads']} reads "
            f"during the run ({res['read_failures']} failed, {len(res['wrong_reads'])} wrong); settled in "
            f"{res.get('settle_seconds')}s; {len(res['verify_errors'])} verify errors")


@click.command("etcd-torture", cls=Command, context_settings=CTX)
@click.option("--seed", type=int, help="Random seed (default: random, printed).")
@click.option("--seconds", type=click.FloatRange(5), default=60, show_default=True)
@click.option("--clients", type=click.IntRange(1, 16), default=3, show_default=True)
@click.option("--dir", "root", type=click.Path(file_okay=False),
              help="Work dir, kept afterwards (default: a temp dir, removed).")
@click.option("--mib-s", type=click.FloatRange(0), default=4.0, show_default=True,
              help="Cap on what all clients write together, MiB/s (0: no cap; mind the disk: 3 replicas).")
@click.option("--json", "as_json", is_flag=True)
def etcd_torture_command(seed, seconds, clients, root, as_json, mib_s):
    """Soak a whole cluster on etcd: clients write while random datanodes, managers and one etcd member
    (of 3) are killed with SIGKILL and restarted; at the end every acknowledged write must read back from
    every replica.  Exit status 1 if anything was lost or wrong.

    \b
    python -m lab.etcd_torture --seed 7 --seconds 600
    """
    from tools.etcd_cluster import etcd_binary
    try:
        etcd_binary()
    except FileNotFoundError as e:
        raise click.ClickException(str(e)) from None
    res = main_sync(seed=seed, seconds=seconds, clients=clients, root=root, mib_s=mib_s)
    emit(res, as_json, summary(res))
    if not res["ok"]:
        sys.exit(1)


if __name__ == "__main__":
    etcd_torture_command()
