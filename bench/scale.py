"""How a default secured cluster copes as its partition count grows.

    python -m bench.scale --partitions 10,100,1000 [--nodes 3] [--clients 50] [--json] [--plot scale.png]
    python -m bench.scale --sim 300 --partitions 30000     (simulated nodes: bench/scale_sim.py)

For each partition count N, in a fresh temporary directory on free ports, the bench does what an operator
would with ``dnctl``: ``cluster up --nodes 3`` (etcd with one user per component, the cluster secret on),
``partition create --count N --replicas 3`` (the manager places them: batches of at most 1,000, the
command's limit), and then measures, one row each:

* etcd's database (``/v3/maintenance/status``: dbSize, dbSizeInUse; and the member's db file) after the
  partitions are created, and again after the failover below;
* create: the ``partition create`` commands' wall time / N (ms per partition);
* a node's idle CPU: utime+stime of each datanode over 10 s once the map is settled, median, in cores;
* failover: kill -9 the node leading the most partitions, then append 4 KiB to every partition through the
  SDK (bounded concurrency, each retried until it succeeds or the step times out): seconds from the kill
  until the last one succeeded, and how many partitions needed a retry (a write that waited inside the SDK
  for the new view and then succeeded is not a retry);
* the CPU seconds the cluster's processes (nodes, managers, etcd) spent on the failover, the refill and the
  controlled stop (until the node exits): the work each costs, which other load on the machine changes far
  less than it changes their wall time;
* refill: ``cluster add-node`` (the killed node stays dead); seconds until every partition has its replica
  count again with every replica synced (the etcd map, tools/cluster.py ``sync_pending``);
* controlled stop: SIGTERM (``cluster stop-node``) the live node holding the most replicas: seconds until
  its process exits (it hands off first: datanode/drain.py); ``cluster start-node``: seconds until every
  partition is back to its replica count, all synced, and how many were not 60 s after the restart;
* clients opening at once: ``--clients K`` SDK clients (bench/client_storm.py; ``--clients-per-process``
  to a process, each client from its own loopback address), all imported first, then told "go" together;
  each opens a ``DataClient`` with the cluster's client credentials (the secret claiming the client role,
  the etcd user ``mount``) and the nodes' addresses, reading the partition map through a node (the
  default): failures, p50/p99 open time, the datanodes' CPU per open, etcd logins, and the most TCP
  connections to etcd's client port (``ss``) seen meanwhile.

Every step has a timeout (``--step-timeout``) and reports "timeout" rather than hanging; every process it
starts is stopped at the end (also on Ctrl-C, SIGTERM or an error).  The map and the SDK run in-process from
this checkout; the daemons and ``dnctl`` run from it too (PYTHONPATH is set for them).  Figures from a
machine shared with other work are noisy: say so beside them.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import pathlib
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

import trio

from tools import cluster as cl


REPO = pathlib.Path(__file__).resolve().parent.parent
# the daemons and dnctl this bench starts must run this checkout too (a venv's editable install may point
# at another one; the datanode runs with -P, so only PYTHONPATH reaches it)
os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])

TIMEOUT = "timeout"
IDLE_S = 10.0
BLOCK = bytes(4096)


class StepTimeout(Exception):
    def __init__(self, msg: str, pending: int | None = None):
        super().__init__(msg)
        self.pending = pending       # partitions not settled when the step gave up


def log(*a) -> None:
    print(time.strftime("%H:%M:%S"), *a, file=sys.stderr, flush=True)


# -- dnctl, as an operator runs it ------------------------------------------------------------------------
async def dnctl(*args: str, timeout: float) -> dict | list:
    """``dnctl ARGS --json`` from this checkout; its JSON answer.  StepTimeout past ``timeout``."""
    argv = [sys.executable, "-m", "tools.dnctl", *args, "--json"]
    with trio.move_on_after(timeout) as scope:
        p = await trio.run_process(argv, cwd=str(REPO), capture_stdout=True, capture_stderr=True, check=False,
                                   stdin=subprocess.DEVNULL)
    if scope.cancelled_caught:
        raise StepTimeout(f"dnctl {' '.join(args[:2])} did not finish within {timeout:g}s")
    if p.returncode != 0:
        raise RuntimeError(f"dnctl {' '.join(args)} failed (status {p.returncode}): "
                           f"{p.stderr.decode(errors='replace').strip()[-800:]}")
    return json.loads(p.stdout)


# -- the map ------------------------------------------------------------------------------------------------
async def snapshot(et) -> dict:
    from client.mapadmin import map_snapshot
    with trio.fail_after(30):
        return await map_snapshot(et)


def settled(snap: dict) -> bool:
    """Every partition installed, at its replica count (``want``), every replica synced; a manager active."""
    return not cl.sync_pending(snap, {})


def under_replicated(snap: dict) -> int:
    return sum(1 for p in snap["partitions"]
               if not p["installed"] or len(p["replicas"]) < (p.get("want") or 0)
               or any(a not in p["synced"] for a in p["replicas"]))


async def wait_settled(et, timeout: float, at: dict[float, str] | None = None, t0: float | None = None) -> float:
    """Seconds (from ``t0``) until the map is settled; StepTimeout naming what was pending.  ``at``: {seconds:
    key} -- record the under-replicated count under ``key`` once ``seconds`` have passed (for "60 s after")."""
    t0 = time.monotonic() if t0 is None else t0
    notes = {}
    left: list[str] = []
    while True:
        snap = await snapshot(et)
        el = time.monotonic() - t0
        for s, key in (at or {}).items():
            if el >= s and key not in notes:
                notes[key] = under_replicated(snap)
        left = cl.sync_pending(snap, {})
        if not left:
            for s, key in (at or {}).items():
                notes.setdefault(key, 0)     # all synced before the mark: none under-replicated then
            if at is not None:
                at.clear()
                at.update({k: v for k, v in notes.items()})
            return el
        if el > timeout:
            if at is not None:
                at.clear()
                at.update(notes)
            raise StepTimeout(f"not settled after {timeout:g}s ({len(left)} pending, e.g. {'; '.join(left[:3])})",
                              pending=len(left))
        await trio.sleep(0.25)


# -- etcd ----------------------------------------------------------------------------------------------------
def etcd_status(info: dict) -> dict:
    """dbSize and dbSizeInUse from etcd's JSON gateway (maintenance status needs no user), and the member's db
    file size (the DB on disk)."""
    url = info["etcd"]["url"]
    out = {}
    try:
        req = urllib.request.Request(url + "/v3/maintenance/status", data=b"{}", method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10, context=cl.local_tls(info["etcd"])) as r:
            st = json.loads(r.read())
        out["db_bytes"] = int(st.get("dbSize", 0))
        out["db_in_use_bytes"] = int(st.get("dbSizeInUse", 0))
    except (OSError, ValueError) as e:
        out["status_error"] = str(e)
    db = pathlib.Path(info["etcd"]["dir"]) / "etcd.data" / "member" / "snap" / "db"
    try:
        out["db_file_bytes"] = db.stat().st_size
    except OSError:
        pass
    return out


def etcd_connections(port: int) -> int:
    """Established TCP connections to etcd's client port (the clients' side of each)."""
    r = subprocess.run(["ss", "-tnH", "state", "established", f"( dport = :{port} )"], capture_output=True,
                       text=True, timeout=10)
    return sum(1 for ln in r.stdout.splitlines() if ln.strip())


# -- figures ------------------------------------------------------------------------------------------------
def node_pids(root: pathlib.Path) -> dict[str, int]:
    return {r["addr"]: r["pid"] for r in cl.status_pids(root) if r["pid"] is not None}


def daemon_pids(root: pathlib.Path) -> list[int]:
    """The cluster's processes now: datanodes, managers, etcd."""
    info = cl.load(root)
    pids = list(node_pids(root).values()) + [m["pid"] for m in info.get("managers") or [] if m.get("pid")]
    return pids + ([info["etcd"]["pid"]] if (info.get("etcd") or {}).get("pid") else [])


class DaemonCPU:
    """CPU seconds the cluster's processes (nodes, managers, etcd) spend between ``start`` and ``stop`` -- the
    work a step costs, which a machine busy with other work does not change as it does the step's wall time.
    A process gone by the end counts up to its last reading; one started meanwhile, from its start."""

    def __init__(self, root: pathlib.Path):
        self.root = root
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}
        self.pids = daemon_pids(root)
        for pid in self.pids:
            s = cl.cpu_seconds(pid)
            if s is not None:
                self.first[pid] = self.last[pid] = s

    def sample(self, look: bool = False) -> None:
        """Read each process's CPU; ``look``: for processes started meanwhile too (counted from 0)."""
        if look:
            self.pids = daemon_pids(self.root)
        for pid in self.pids:
            s = cl.cpu_seconds(pid)
            if s is not None:
                self.first.setdefault(pid, 0.0)
                self.last[pid] = s

    def seconds(self) -> float:
        self.sample(look=True)
        return round(sum(self.last[p] - self.first[p] for p in self.last), 2)


async def idle_cpu(root: pathlib.Path) -> dict:
    pids = node_pids(root)
    before = {a: cl.cpu_seconds(p) for a, p in pids.items()}
    t0 = time.monotonic()
    await trio.sleep(IDLE_S)
    el = time.monotonic() - t0
    cores = {a: round((cl.cpu_seconds(p) - before[a]) / el, 4) for a, p in pids.items()
             if before[a] is not None and cl.cpu_seconds(p) is not None}
    return {"idle_cpu_cores": round(statistics.median(cores.values()), 4), "idle_cpu_by_node": cores}


async def failover(root: pathlib.Path, info: dict, et, timeout: float, concurrency: int) -> dict:
    """kill -9 the node leading the most partitions; append to every partition until each succeeds."""
    from client.sdk import DataClient
    snap = await snapshot(et)
    leads: dict[str, int] = {}
    for p in snap["partitions"]:
        leads[p["leader"]] = leads.get(p["leader"], 0) + 1
    pids = node_pids(root)
    victim = max((a for a in leads if a in pids), key=lambda a: leads[a])
    parts = [p["id"] for p in snap["partitions"]]
    done: dict[int, float] = {}
    tries: dict[int, int] = {}
    errors: dict[str, int] = {}
    login = cl.client_login(info)
    limit = trio.Semaphore(concurrency)
    async with DataClient.from_env(etcd=info["etcd"]["url"], timeout=10, pool_mib=16, **login) as dc:
        await trio.sleep(0.5)                 # the watch is following
        log(f"failover: kill -9 {victim} (leads {leads[victim]} of {len(parts)}; pid {pids[victim]})")
        cpu = DaemonCPU(root)
        t0 = time.monotonic()
        os.kill(pids[victim], signal.SIGKILL)

        async def one(pid: int) -> None:
            async with limit:
                while True:
                    tries[pid] = tries.get(pid, 0) + 1
                    try:
                        await dc.write(pid, BLOCK)
                        done[pid] = time.monotonic() - t0
                        return
                    except Exception as e:  # noqa: BLE001 - any failure is retried until the step's timeout
                        k = f"{type(e).__name__}: {str(e)[:120]}"
                        errors[k] = errors.get(k, 0) + 1
                        await trio.sleep(0.2)

        async def sampled() -> None:            # so the victim's last CPU is read close to its death
            while True:
                cpu.sample()
                await trio.sleep(0.5)
        with trio.move_on_after(timeout):
            async with trio.open_nursery() as n:
                n.start_soon(sampled)
                async with trio.open_nursery() as writes:
                    for pid in parts:
                        writes.start_soon(one, pid)
                n.cancel_scope.cancel()
    out = {"failover_cpu_s": cpu.seconds(),"failover_killed": victim, "failover_partitions": len(parts),
           "failover_retried": sum(1 for p in parts if tries.get(p, 0) > 1),
           "failover_not_writable": len(parts) - len(done),
           "failover_errors": dict(sorted(errors.items(), key=lambda kv: -kv[1])[:8])}
    out["failover_s"] = round(max(done.values()), 3) if len(done) == len(parts) else TIMEOUT
    return out


async def clients_at_once(root: pathlib.Path, k: int, per_process: int, timeout: float) -> dict:
    """K SDK clients open together (bench/client_storm.py: in processes of ``per_process`` clients, each from
    its own loopback address), the map through the nodes as by default; failures, open time, and the most
    etcd client connections seen -- which must not grow with K."""
    from bench.client_storm import storm
    # (each client's open gives up at its own deadline, so the storm ends within the step's time)
    r = await trio.to_thread.run_sync(lambda: storm(root, k, per_process, timeout=min(30.0, timeout / 2),
                                                    via="auto"))
    errs: dict[str, int] = {}
    for e in r["errors"]:
        errs[e[:160]] = errs.get(e[:160], 0) + 1
    return {"clients": k, "clients_failed": r["failed"], "clients_errors": errs,
            "etcd_connections_peak": r["etcd_connections_peak"],
            "etcd_connections_before": r["etcd_connections_before"],
            "clients_etcd_logins": r["etcd_authenticate"], "clients_node_cpu_ms": r["nodes_cpu_ms_per_client"],
            "clients_partitions_seen": r["partitions_seen"],
            "clients_open_p50_s": r["open_p50_s"] if r["failed"] < k else TIMEOUT,
            "clients_open_p99_s": r["open_p99_s"] if r["failed"] < k else TIMEOUT}


# -- one cluster ----------------------------------------------------------------------------------------------
async def run_one(root: pathlib.Path, n: int, a: argparse.Namespace) -> dict:
    fig: dict = {"partitions": n, "nodes": a.nodes}
    T = a.step_timeout

    async def step(name: str, coro_fn, *args, timeout: float = T):
        """One step: its result, or "timeout"/"error: ..." in ``fig[name]`` (and False) -- the run goes on."""
        t0 = time.monotonic()
        log(f"[{n}] {name} ...")
        try:
            with trio.fail_after(timeout + 30):      # the steps bound themselves; this is the backstop
                res = await coro_fn(*args)
            log(f"[{n}] {name}: {time.monotonic() - t0:.1f}s")
            return res
        except (StepTimeout, trio.TooSlowError) as e:
            log(f"[{n}] {name}: timeout ({e})")
            fig.setdefault("notes", []).append(f"{name}: timeout: {e}")
            fig[name] = TIMEOUT
            if getattr(e, "pending", None) is not None:
                fig[f"{name}_pending"] = e.pending
        except Exception as e:  # noqa: BLE001 - a product failure: reported, the next steps still run
            log(f"[{n}] {name}: error {type(e).__name__}: {e}")
            fig.setdefault("notes", []).append(f"{name}: {type(e).__name__}: {e}")
            fig[name] = f"error: {type(e).__name__}: {str(e)[:300]}"
        return False

    info = await step("up", lambda: dnctl("cluster", "up", "--nodes", str(a.nodes), "--cluster", str(root),
                                          timeout=120), timeout=120)
    if info is False:
        return fig
    info = cl.load(root)
    et = cl.cluster_map(info)

    async def create():
        t0 = time.monotonic()
        left = n
        while left:
            batch = min(left, 1000)       # `partition create --count` takes at most 1,000
            await dnctl("partition", "create", "--count", str(batch), "--replicas", "3", "--cluster", str(root),
                        "--timeout", str(T), timeout=T + 30)
            left -= batch
        fig["create_ms_per_partition"] = round((time.monotonic() - t0) * 1000 / n, 2)
        # the map settled (views installed, replicas synced) before anything is measured on it
        fig["create_settled_s"] = round(await wait_settled(et, T, t0=t0), 2)
        fig["map_partitions"] = len((await snapshot(et))["partitions"])
    if await step("create_ms_per_partition", create) is False:
        return fig

    st = etcd_status(info)
    fig.update({f"etcd_{k}_after_create": v for k, v in st.items()})

    res = await step("idle_cpu_cores", idle_cpu, root, timeout=IDLE_S + 30)
    if res:
        fig.update(res)

    res = await step("failover_s", failover, root, info, et, T, a.concurrency)
    if res:
        fig.update(res)
    await trio.sleep(1)                   # the manager's last view changes land
    st = etcd_status(info)
    fig.update({f"etcd_{k}_after_failover": v for k, v in st.items()})

    async def refill():
        cpu = DaemonCPU(root)
        t0 = time.monotonic()
        await dnctl("cluster", "add-node", "--cluster", str(root), timeout=120)
        fig["refill_s"] = round(await wait_settled(et, T, t0=t0), 2)
        fig["refill_cpu_s"] = cpu.seconds()
    await step("refill_s", refill)

    async def controlled_stop():
        snap = await snapshot(et)
        held: dict[str, int] = {}
        for p in snap["partitions"]:
            for r in p["replicas"]:
                held[r] = held.get(r, 0) + 1
        live = node_pids(root)
        victim = max((x for x in held if x in live), key=lambda x: held[x])
        fig["stop_node"] = victim
        fig["stop_node_replicas"] = held[victim]
        log(f"[{n}] SIGTERM {victim} (holds {held[victim]} replicas)")
        cpu = DaemonCPU(root)

        async def sampled() -> None:
            while True:
                cpu.sample()
                await trio.sleep(0.25)
        async with trio.open_nursery() as sampling:
            sampling.start_soon(sampled)
            r = await dnctl("cluster", "stop-node", victim, "--cluster", str(root), "--timeout", str(T),
                            timeout=T + 30)
            sampling.cancel_scope.cancel()
        fig["stop_cpu_s"] = cpu.seconds()
        if r.get("result") != "stopped":
            fig["notes"] = fig.get("notes", []) + [f"stop-node {victim}: {r.get('result')}"]
            fig["stop_exit_s"] = TIMEOUT
        else:
            fig["stop_exit_s"] = r["seconds"]
        t0 = time.monotonic()
        await dnctl("cluster", "start-node", victim, "--cluster", str(root), timeout=120)
        fig["stop_restart_start_s"] = round(time.monotonic() - t0, 2)
        marks = {60.0: "stop_under_replicated_60s"}
        try:
            fig["stop_resync_s"] = round(await wait_settled(et, T, marks, t0=t0), 2)
        finally:
            fig.update(marks)
    await step("stop_resync_s", controlled_stop)
    for key in ("stop_exit_s", "stop_under_replicated_60s"):
        fig.setdefault(key, fig.get("stop_resync_s") if isinstance(fig.get("stop_resync_s"), str) else TIMEOUT)

    if a.clients:
        res = await step("clients_open_p50_s", clients_at_once, root, a.clients, a.clients_per_process, T)
        if res:
            fig.update(res)
        else:
            fig.setdefault("clients_open_p99_s", fig["clients_open_p50_s"])
    return fig


@contextlib.contextmanager
def signals_held():
    """No Ctrl-C while the processes are being stopped (a second one would leave them running); the
    teardown is bounded in time itself."""
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    old = {s: signal.signal(s, signal.SIG_IGN) for s in sigs}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


_ERROR_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit|Warning)\b")


def crashes(root: pathlib.Path) -> list[dict]:
    """Daemons of the run that died of an exception: each log with a traceback, its last line (the error) and
    the time of the log line before it -- a product failure, whatever the figures say."""
    out = []
    for path in sorted([*root.glob("node*/node.log"), *root.glob("manager-*.log")]):
        try:
            lines = path.read_text(errors="replace").splitlines()
        except OSError:
            continue
        for i, ln in enumerate(lines):
            if "Traceback (most recent call last)" in ln:
                block = []
                for x in lines[i:]:
                    if x[:4].isdigit():       # the next log line: the traceback ended
                        break
                    block.append(x.strip(" |+-"))
                # the innermost error is printed last (an exception group's members after the group)
                errs = [x for x in block if _ERROR_LINE.match(x) and not x.startswith(("ExceptionGroup",
                                                                                       "BaseExceptionGroup"))]
                when = next((x[:23] for x in reversed(lines[:i]) if x[:4].isdigit()), "?")
                out.append({"log": str(path.relative_to(root)), "at": when,
                            "error": (errs[-1] if errs else block[-1] if block else "?")[:300]})
                break                       # the first is the cause; a dead process has one
    return out


def teardown(root: pathlib.Path) -> None:
    """Stop everything the run started in ``root``: the cluster (managers, nodes, etcd), then anything left
    (a node or etcd started by a command cut short before cluster.json named it)."""
    try:
        if (root / "cluster.json").exists():
            cl.down(root, timeout=30)
    except Exception as e:  # noqa: BLE001 - stop the rest anyway
        log(f"cluster down {root}: {e}")
    try:
        for r in cl.stop_strays(root, timeout=15):
            log(f"stopped a stray {r['kind']} pid {r['pid']}: {r.get('result')}")
    except Exception as e:  # noqa: BLE001
        log(f"stray processes of {root}: {e}")


# -- output -----------------------------------------------------------------------------------------------
ROWS = [
    ("etcd db after create, bytes (in use)", "etcd_db_bytes_after_create", "etcd_db_in_use_bytes_after_create"),
    ("etcd db file after create, bytes", "etcd_db_file_bytes_after_create", None),
    ("etcd db after failover, bytes (in use)", "etcd_db_bytes_after_failover", "etcd_db_in_use_bytes_after_failover"),
    ("create, ms per partition", "create_ms_per_partition", None),
    ("create until settled, s", "create_settled_s", None),
    ("a node's idle CPU, cores (median)", "idle_cpu_cores", None),
    ("failover: last partition writable, s", "failover_s", None),
    ("failover: partitions that needed a retry", "failover_retried", None),
    ("failover: CPU of nodes, manager and etcd, s", "failover_cpu_s", None),
    ("refill after add-node, s", "refill_s", None),
    ("refill: CPU of nodes, manager and etcd, s", "refill_cpu_s", None),
    ("controlled stop: SIGTERM to exit, s", "stop_exit_s", None),
    ("controlled stop: CPU until exit, s", "stop_cpu_s", None),
    ("controlled stop: restart to all synced, s", "stop_resync_s", None),
    ("controlled stop: under-replicated 60 s after restart", "stop_under_replicated_60s", None),
    ("clients at once: failures", "clients_failed", None),
    ("clients at once: open p50, s", "clients_open_p50_s", None),
    ("clients at once: open p99, s", "clients_open_p99_s", None),
    ("clients at once: etcd connections (peak)", "etcd_connections_peak", None),
    ("clients at once: datanode CPU per open, ms (all nodes)", "clients_node_cpu_ms", None),
    ("daemons that died of an exception", "crashed_processes", None),
]


def _cell(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, str):
        return v if len(v) < 40 else v[:37] + "..."
    return f"{v:,}" if isinstance(v, int) else f"{v:g}"


def table(runs: list[dict]) -> str:
    head = "| figure | " + " | ".join(f"{r['partitions']} partitions" for r in runs) + " |"
    lines = [head, "| --- |" + " --- |" * len(runs)]
    for label, key, extra in ROWS:
        cells = []
        for r in runs:
            c = _cell(r.get(key))
            if extra and r.get(extra) is not None:
                c += f" ({_cell(r.get(extra))})"
            cells.append(c)
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(runs: list[dict], path: str) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot"
    rows = [r for r in ROWS if any(isinstance(x.get(r[1]), (int, float)) for x in runs)]
    cols = 4
    fig, axes = plt.subplots(math.ceil(len(rows) / cols), cols, figsize=(4.2 * cols, 3 * math.ceil(len(rows) / cols)),
                             squeeze=False)
    for ax, (label, key, _extra) in zip(axes.flat, rows):
        pts = [(x["partitions"], x[key]) for x in runs if isinstance(x.get(key), (int, float))]
        ax.plot([p for p, _ in pts], [v for _, v in pts], "o-")
        ax.set_title(label, fontsize=8)
        ax.set_xlabel("partitions", fontsize=8)
        if len(runs) > 1 and max(x["partitions"] for x in runs) / max(1, min(x["partitions"] for x in runs)) >= 20:
            ax.set_xscale("log")
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(rows):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return None


def main() -> None:
    if "--sim" in sys.argv[1:]:               # the simulated cluster: bench/scale_sim.py, its own figures
        from bench import scale_sim
        argv = ["--nodes" if x == "--sim" else x for x in sys.argv[1:]]
        sys.exit(scale_sim.main(argv))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--partitions", default="10,100",
                    help="comma-separated partition counts; a fresh cluster for each (default: 10,100)")
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--clients", type=int, default=10, help="SDK clients opening at once (0: skip)")
    ap.add_argument("--clients-per-process", type=int, default=50,
                    help="clients opened by one process (a thousand processes do not fit a small machine)")
    ap.add_argument("--concurrency", type=int, default=32, help="the failover's writes in flight at most")
    ap.add_argument("--step-timeout", type=float, default=600.0,
                    help="seconds any one step may take before it is reported as a timeout")
    ap.add_argument("--dir", help="keep the clusters' data and logs here (default: a temp dir, removed)")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON (the table goes to stderr)")
    ap.add_argument("--plot", metavar="FILE.png", help="each figure against partitions (matplotlib)")
    ap.add_argument("--sim", type=int, metavar="NODES",
                    help="instead: the real manager and etcd against NODES simulated nodes in this process, "
                         "--partitions N of them (python -m bench.scale_sim --help)")
    a = ap.parse_args()
    counts = [int(x) for x in a.partitions.split(",") if x.strip()]
    if shutil.which("etcd") is None:
        sys.exit("scale.py needs etcd on PATH (Debian: apt install etcd-server)")

    # Ctrl-C unwinds through the teardown also when this was started with SIGINT ignored (a shell's
    # background job); SIGTERM and SIGHUP become a SIGINT, which trio turns into KeyboardInterrupt safely
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: os.kill(os.getpid(), signal.SIGINT))

    base = pathlib.Path(a.dir) if a.dir else pathlib.Path(tempfile.mkdtemp(prefix="scale-bench-"))
    runs = []
    try:
        for n in counts:
            root = base / f"p{n}"
            t0 = time.monotonic()
            try:
                runs.append(trio.run(run_one, root, n, a))
            finally:
                with signals_held():
                    teardown(root)
            runs[-1]["crashes"] = crashes(root)
            runs[-1]["crashed_processes"] = len(runs[-1]["crashes"])
            for c in runs[-1]["crashes"]:
                log(f"[{n}] crashed: {c['log']} at {c['at']}: {c['error']}")
            runs[-1]["wall_s"] = round(time.monotonic() - t0, 1)
            log(f"[{n}] done in {runs[-1]['wall_s']}s")
    finally:
        if not a.dir:
            shutil.rmtree(base, ignore_errors=True)
    md = table(runs)
    note = plot(runs, a.plot) if a.plot else None
    if note:
        print(note, file=sys.stderr)
    if a.json:
        print(md, file=sys.stderr)
        print(json.dumps({"runs": runs, "table": md, **({"plot": note} if note else {})}, indent=1))
    else:
        print(md)
        for r in runs:
            for x in r.get("notes", []):
                print(f"- {r['partitions']} partitions: {x}")
            for c in r.get("crashes", []):
                print(f"- {r['partitions']} partitions: {c['log']} died at {c['at']}: {c['error']}")


if __name__ == "__main__":
    try:
        main()
    except BaseException as e:  # noqa: BLE001 - Ctrl-C inside a nursery arrives in a group
        if isinstance(e, KeyboardInterrupt) or (isinstance(e, BaseExceptionGroup)
                                                and e.split(KeyboardInterrupt)[1] is None):
            sys.exit("interrupted: the clusters started were stopped")
        raise
