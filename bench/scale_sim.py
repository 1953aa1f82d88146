"""The real manager and etcd against a simulated cluster of hundreds of nodes (lab/simnode.py).

    python -m bench.scale_sim [--nodes 300] [--partitions 30000] [--replicas 3] [--json]
    python -m bench.scale --sim 300 [--partitions 30000]          (the same)

In a fresh temporary directory, on free ports: one etcd member (no authentication: see lab/simnode.py), one
``dnmanager`` with a new cluster secret (every map entry sealed and checked, every hello authenticated), and
``--nodes`` sim nodes in this process.  Then, one row each:

* create: ``--partitions`` placed by the manager (admin requests of at most 1,000, as ``dnctl partition
  create --count`` sends them) and every view installed; ms per partition;
* the manager's idle CPU (cores, over ``--idle-s``) with the whole map settled;
* failover: the node leading the most partitions stops dead (its lease expires, as after ``kill -9``):
  seconds until every partition it led is *writable* -- a view without it installed on a live leader and on
  every replica of that view (the sim nodes' own state, as a write would find it) -- and until the manager
  has marked every such view installed in etcd; the manager's CPU seconds and cores meanwhile;
* refill: seconds until every partition is back to its replica count with every replica synced;
* etcd's database (dbSize, dbSizeInUse) after the creates and after the failover.

Every step has a timeout (``--step-timeout``) and every process started is stopped at the end.  Figures from a
shared machine are noisy (say the load beside them); CPU seconds per step move far less than wall time.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import signal
import sys
import tempfile
import time
import urllib.request

import trio

REPO = pathlib.Path(__file__).resolve().parent.parent
os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])

from client.mapadmin import place_partitions  # noqa: E402
from client.sdk import ClientError  # noqa: E402
from lab.simnode import SimCluster  # noqa: E402
from tools.etcd_cluster import EtcdProc, ManagerProc  # noqa: E402
from wire.auth import Credentials, gen_secret  # noqa: E402
from wire.etcdmap import Etcd  # noqa: E402
from wire.limits import nodes_error  # noqa: E402
from wire.protocol import Role  # noqa: E402

REQUEST_MAX = 1000          # partitions per create request (dnctl partition create's own bound)
TICK = os.sysconf("SC_CLK_TCK")


def log(*a) -> None:
    print(time.strftime("%H:%M:%S"), *a, file=sys.stderr, flush=True)


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def etcd_db(url: str) -> dict:
    req = urllib.request.Request(url + "/v3/maintenance/status", data=b"{}", method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        st = json.loads(r.read())
    return {"db_bytes": int(st.get("dbSize", 0)), "db_in_use_bytes": int(st.get("dbSizeInUse", 0))}


class StepTimeout(Exception):
    pass


async def until(what: str, probe, timeout: float, every: float = 0.05) -> float:
    """Seconds until ``probe()`` is true; StepTimeout naming ``what`` (and probe's last word) after ``timeout``."""
    t0 = time.monotonic()
    while True:
        got = probe()
        if got is True:
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise StepTimeout(f"{what}: not within {timeout:g}s ({got})")
        await trio.sleep(every)


def settled(sim: SimCluster, want: int) -> bool | str:
    """Every view in etcd installed, at its replica count, every replica synced and holding it."""
    bad = [v.id for v in sim.views.values()
           if not v.installed or len(v.replicas) < want or set(v.synced) != set(v.replicas)
           or v.state != "writable"]
    return True if not bad else f"{len(bad)} not settled, e.g. {bad[:5]}"


@contextlib.asynccontextmanager
async def cluster(root: pathlib.Path, nodes: int, *, lease_ttl_s: int = 3, manager_opts: dict | None = None):
    """etcd, a manager and ``nodes`` sim nodes; yields (sim, manager proc, admin Etcd, etcd proc)."""
    root.mkdir(parents=True, exist_ok=True)
    secret = root / "secret"
    secret.write_text(gen_secret())
    creds = Credentials.load(secret)
    etcd = EtcdProc(root / "etcd").start()
    mgr = None
    try:
        mgr = ManagerProc(root, etcd.url, "m1", secret_file=secret, lease_ttl_s=lease_ttl_s, min_writable=0,
                          down_after_s=1.0, **(manager_opts or {})).start()
        admin = Etcd(etcd.url, "/datanode", timeout=5.0, admin_key=creds.key(Role.ADMIN))
        sim = SimCluster(etcd.url, nodes, secret=creds, lease_ttl_s=lease_ttl_s)
        async with trio.open_nursery() as n:
            await n.start(sim.run)
            yield sim, mgr, admin, etcd
            n.cancel_scope.cancel()
    finally:
        if mgr is not None:
            mgr.stop()
        etcd.stop()


async def create(sim: SimCluster, admin: Etcd, count: int, replicas: int, timeout: float) -> float:
    """Seconds to place ``count`` partitions (requests of REQUEST_MAX, two at a time) and see them settled.  A
    request the manager answers "failed" (a node did not answer in time: a busy machine) is logged, and what
    is still missing asked for again."""
    t0 = time.monotonic()
    while await admin.get(admin.manager_key) is None:
        if time.monotonic() - t0 > 30:
            raise StepTimeout("no active manager after 30 s")
        await trio.sleep(0.1)
    t0 = time.monotonic()
    for _round in range(5):
        missing = count - len(sim.views)
        if missing <= 0:
            break
        left = [REQUEST_MAX] * (missing // REQUEST_MAX) + ([missing % REQUEST_MAX] if missing % REQUEST_MAX else [])

        async def worker():
            while left:
                n = left.pop()
                try:
                    await place_partitions(admin, n, replicas, timeout=timeout)
                except ClientError as e:
                    log(f"a create request failed: {e}")
        async with trio.open_nursery() as nursery:
            for _ in range(2):
                nursery.start_soon(worker)
        await trio.sleep(1)                       # (the last views arrive by the watch)
    await until("creates settled", lambda: settled(sim, replicas) if len(sim.views) >= count else
                f"{len(sim.views)} of {count} made", timeout - (time.monotonic() - t0))
    return time.monotonic() - t0


async def run(a: argparse.Namespace, root: pathlib.Path) -> dict:
    out: dict = {"nodes": a.nodes, "partitions": a.partitions, "replicas": a.replicas,
                 "load": os.getloadavg()[0]}
    async with cluster(root, a.nodes, lease_ttl_s=a.lease_ttl_s) as (sim, mgr, admin, etcd):
        log(f"{a.nodes} sim nodes registered; creating {a.partitions} partitions")
        cpu0 = cpu_seconds(mgr.proc.pid)
        took = await create(sim, admin, a.partitions, a.replicas, a.step_timeout)
        out["create_s"] = round(took, 2)
        out["create_ms_per_partition"] = round(took * 1000 / a.partitions, 2)
        out["create_manager_cpu_s"] = round(cpu_seconds(mgr.proc.pid) - cpu0, 2)
        out.update({f"etcd_{k}_after_create": v for k, v in etcd_db(etcd.url).items()})
        log(f"created in {took:.1f}s; manager idle for {a.idle_s:g}s")
        await trio.sleep(2)
        cpu0, t0 = cpu_seconds(mgr.proc.pid), time.monotonic()
        await trio.sleep(a.idle_s)
        out["manager_idle_cores"] = round((cpu_seconds(mgr.proc.pid) - cpu0) / (time.monotonic() - t0), 4)

        leads = {addr: sim.led_by(addr) for addr in sim.nodes}
        victim = max(leads, key=lambda x: len(leads[x]))
        led = leads[victim]
        held = [pid for pid, v in sim.views.items() if victim in v.replicas]
        out.update(victim_led=len(led), victim_held=len(held))
        log(f"killing {victim} (leads {len(led)}, holds {len(held)})")
        cpu0, t0 = cpu_seconds(mgr.proc.pid), time.monotonic()
        sim.kill(victim)
        first: dict[int, float] = {}

        def all_writable():
            now = time.monotonic() - t0
            for pid in led:
                if pid not in first and sim.writable(pid, victim):
                    first[pid] = now
            return True if len(first) == len(led) else f"{len(led) - len(first)} of {len(led)} not writable"
        out["failover_s"] = round(await until("failover", all_writable, a.step_timeout, every=0.02), 2)
        out["failover_first_s"] = round(min(first.values(), default=0.0), 2)
        cpu = cpu_seconds(mgr.proc.pid) - cpu0
        out["failover_manager_cpu_s"] = round(cpu, 2)
        out["failover_manager_cores"] = round(cpu / max(out["failover_s"], 1e-3), 3)

        def marked():
            bad = [pid for pid in led if not sim.views[pid].installed or victim in sim.views[pid].replicas]
            return True if not bad else f"{len(bad)} not marked installed"
        out["failover_installed_s"] = round(out["failover_s"] + await until("marked installed", marked,
                                                                            a.step_timeout), 2)
        out["refill_s"] = round(time.monotonic() - t0 + await until(
            "refill", lambda: all(victim not in v.replicas for v in sim.views.values()) and settled(sim, a.replicas),
            a.step_timeout, every=0.25), 2)
        out["refill_manager_cpu_s"] = round(cpu_seconds(mgr.proc.pid) - cpu0, 2)
        out.update({f"etcd_{k}_after_failover": v for k, v in etcd_db(etcd.url).items()})
        out["view_batches"] = sim.batches
        await trio.sleep(2)
        cpu0, t0 = cpu_seconds(mgr.proc.pid), time.monotonic()
        await trio.sleep(a.idle_s)
        out["manager_idle_cores_after"] = round((cpu_seconds(mgr.proc.pid) - cpu0) / (time.monotonic() - t0), 4)
    return out


ROWS = [("nodes", "sim nodes"), ("partitions", "partitions"), ("create_ms_per_partition", "create, ms per partition"),
        ("create_manager_cpu_s", "manager CPU for the creates, s"), ("manager_idle_cores", "manager idle, cores"),
        ("victim_led", "partitions the killed node led"), ("failover_s", "kill -> all it led writable, s"),
        ("failover_manager_cores", "manager CPU during it, cores"),
        ("failover_manager_cpu_s", "manager CPU during it, s"),
        ("failover_installed_s", "kill -> all marked installed in etcd, s"),
        ("refill_s", "kill -> every partition at its replica count, s"),
        ("etcd_db_bytes_after_create", "etcd db after create, bytes"),
        ("etcd_db_bytes_after_failover", "etcd db after failover, bytes"),
        ("manager_idle_cores_after", "manager idle afterwards, cores"), ("load", "load average (1 min)")]


def parser(ap: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    ap = ap or argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=300, help="sim nodes (one process)")
    ap.add_argument("--partitions", type=int, default=30000)
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--lease-ttl-s", type=int, default=3, help="nodes' and manager's etcd lease")
    ap.add_argument("--idle-s", type=float, default=10.0, help="how long the manager's idle CPU is measured")
    ap.add_argument("--step-timeout", type=float, default=900.0)
    ap.add_argument("--dir", help="keep etcd's data and the manager's log here (default: a temp dir, removed)")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON (the table goes to stderr)")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    why = nodes_error(a.nodes)
    if why:
        print(f"error: --nodes: {why}", file=sys.stderr)
        return 2
    if a.partitions < 1:
        print("error: --partitions: at least 1", file=sys.stderr)
        return 2
    # Ctrl-C and SIGTERM unwind through the teardown (etcd and the manager stopped)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: os.kill(os.getpid(), signal.SIGINT))
    with contextlib.ExitStack() as stack:
        root = pathlib.Path(a.dir) if a.dir else pathlib.Path(stack.enter_context(tempfile.TemporaryDirectory()))
        try:
            out = trio.run(run, a, root)
        except (StepTimeout, ClientError, OSError) as e:
            print(f"error: {e} (manager log: {root / 'manager-m1.log'})", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 130
    width = max(len(t) for _, t in ROWS)
    for k, text in ROWS:
        print(f"{text:<{width}}  {out.get(k)}", file=sys.stderr if a.json else sys.stdout)
    if a.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
