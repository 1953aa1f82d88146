"""Leader ingest over verbs as a share of ``ib_read_bw``, at RoCE MTU 1024 and 4096, in one Soft-RoCE VM run.

    lab/softroce-vm run --timeout 1800 -- python -m bench.verbs_ratio [--mtu 1024,4096] [--rounds 2]
                                                                       [--size 1MiB] [--seconds 6] [--json]

Per round, for each MTU in turn (interleaved, so drift in the VM's speed hits both alike):
1. raise or lower the netdev under rxe0 (``ip link set DEV mtu``: 1500 gives RoCE active_mtu 1024, 9000
   gives 4096) and wait until the port reports the wanted active MTU;
2. ``ib_read_bw -d rxe0 -x GID -F -s SIZE`` between two processes in this VM, before and after step 3 (the
   better of the two counts): the device's RDMA READ rate, the ceiling for a leader that pulls each payload
   with one RDMA READ;
3. ``dnctl bench --replicas 1 --mode write --transport verbs --size SIZE`` against a local one-node cluster
   with ``transport = verbs`` (node and client open a new queue pair per run, so each run uses the MTU
   of its moment; the path MTU each connection really got is read back from ``dnctl node status``):
   the leader's ingest;
and prints ingest / ib_read_bw per MTU, the median over the rounds, next to the goal (>= 0.60).  Absolute
numbers are slow (TCG emulation; the host's other work shows up too); read the ratios of the same round.
Beside each: where the VM's CPUs went during it (``/proc/stat`` sampled over ib_read_bw's client run and
over the bench's write phase only: user / kernel / softirq / idle shares, busy vCPU-seconds per GB) and the
node's and client's own CPU-s/GB -- a leader whose process uses a whole vCPU is CPU-bound, however idle the
link (rxe moves an RDMA READ's bytes in softirq work on the CPU of whoever posted it).

``--variant NAME:KEY=VALUE,...`` (repeatable) compares settings in the same run: each variant's ingest runs
between the same two ib_read_bw runs, on a cluster started with the variant's environment (e.g.
``DATANODE_VERBS_SPIN_US=0``, ``DATANODE_VERBS_UNSIGNALED=0``, ``DATANODE_VERBS_INLINE=0``,
``DATANODE_RDMA_WINDOWS=0``; see wire/transport/verbs.py), and ``depth=N`` / ``size=S`` / ``clients=N`` / ``replicas=N`` (that many nodes)
change the bench itself for that variant:

    python -m bench.verbs_ratio --variant old:DATANODE_VERBS_SPIN_US=0,DATANODE_VERBS_UNSIGNALED=0 \
                                --variant new: --variant new-d16:depth=16
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import threading
import time

import click

from bench.vm_compare import ADDR, DEV, GID, SIZES, dnctl, ib_read_bw

NETDEV_MTU = {1024: 1500, 2048: 2500, 4096: 9000}   # netdev MTU that gives this RoCE active MTU on rxe
GOAL = 0.60


def rxe_netdev() -> str:
    """The netdev rxe0 is bound to (``rdma link show``)."""
    out = subprocess.run(["rdma", "link", "show", f"{DEV}/1"], capture_output=True, text=True).stdout
    m = re.search(r"netdev (\S+)", out)
    if not m:
        raise SystemExit(f"cannot find the netdev under {DEV}: {out.strip()!r}")
    return m.group(1)


def active_mtu() -> int | None:
    out = subprocess.run(["ibv_devinfo", "-d", DEV], capture_output=True, text=True).stdout
    m = re.search(r"active_mtu:\s*(\d+)", out)
    return int(m.group(1)) if m else None


def hw_counters() -> dict[str, int]:
    """rxe's port counters (retries, sequence errors, RNR NAKs, duplicates ...): where a slow run loses time."""
    d = f"/sys/class/infiniband/{DEV}/ports/1/hw_counters"
    out = {}
    for name in sorted(os.listdir(d)) if os.path.isdir(d) else []:
        try:
            with open(os.path.join(d, name)) as f:
                out[name] = int(f.read().strip() or 0)
        except (OSError, ValueError):
            pass
    return out


def vm_cpu() -> list[int]:
    """The VM's CPU time so far, all CPUs together (``/proc/stat``'s ``cpu`` line, in ticks): user, nice,
    system, idle, iowait, irq, softirq, steal."""
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:9]]


class CpuSampler:
    """``vm_cpu()`` every ``every`` seconds in a thread, so a phase's window (CLOCK_MONOTONIC, e.g. the
    bench's write phase) can be cut out afterwards without the processes' start-up and teardown."""

    def __init__(self, every: float = 0.2):
        self.every, self.samples, self._stop = every, [], threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()

    def _run(self):
        while not self._stop.is_set():
            self.samples.append((time.monotonic(), vm_cpu()))
            self._stop.wait(self.every)

    def window(self, t0: float, t1: float, mbytes: float | None = None) -> dict | None:
        inside = [s for s in self.samples if t0 <= s[0] <= t1]
        if len(inside) < 2:
            return None
        return cpu_split(inside[0][1], inside[-1][1], mbytes)


def cpu_split(before: list[int], after: list[int], mbytes: float | None = None) -> dict:
    """Where the VM's CPUs went between two ``vm_cpu()`` readings: the share of all CPU time (100 = every
    vCPU busy) in user space, the kernel (system + irq), softirq (rxe's packet work runs there and in its
    tasklets) and idle/iowait; with ``mbytes``, the busy vCPU-seconds per GB moved."""
    d = [b - a for a, b in zip(before, after)]
    total = sum(d) or 1
    busy = d[0] + d[1] + d[2] + d[5] + d[6] + d[7]
    out = {"user_pct": round(100 * (d[0] + d[1]) / total, 1), "kernel_pct": round(100 * (d[2] + d[5]) / total, 1),
           "softirq_pct": round(100 * d[6] / total, 1), "idle_pct": round(100 * (d[3] + d[4]) / total, 1),
           "steal_pct": round(100 * d[7] / total, 1)}
    if mbytes:
        hz = os.sysconf("SC_CLK_TCK")
        out["busy_cpu_s_per_gb"] = round(busy / hz / (mbytes / 1000), 2)
    return out


def _cpu_text(c: dict | None) -> str:
    if not c:
        return "n/a"
    return (f"user {c['user_pct']}% kernel {c['kernel_pct']}% softirq {c['softirq_pct']}% idle {c['idle_pct']}%"
            + (f" ({c['busy_cpu_s_per_gb']} busy CPU-s/GB)" if "busy_cpu_s_per_gb" in c else ""))


def delta(before: dict, after: dict) -> dict:
    """Counters that moved, leaving out the plain packet counts."""
    return {k: after[k] - before.get(k, 0) for k in after
            if after[k] != before.get(k, 0) and k not in ("sent_pkts", "rcvd_pkts")}


def set_mtu(netdev: str, roce_mtu: int) -> int | None:
    subprocess.run(["ip", "link", "set", netdev, "mtu", str(NETDEV_MTU[roce_mtu])], check=True)
    for _ in range(50):
        got = active_mtu()
        if got == roce_mtu:
            return got
        time.sleep(0.1)
    return active_mtu()


def node_path_mtus(cluster: str) -> list:
    """The path MTU of every verbs connection the node has now (dnctl node status --json: its own one)."""
    from tools.clikit import cluster_nodes
    found = []
    for a in cluster_nodes(cluster):
        st = json.loads(dnctl("node", "status", a, "--json"))
        for c in st.get("connections", []):
            if c.get("transport") == "verbs":
                found.append(c.get("path_mtu"))
    return found


BENCH_KEYS = ("depth", "size", "clients", "replicas")


def parse_variant(text: str) -> tuple[str, dict, dict]:
    """``NAME:KEY=VALUE,...`` -> (name, environment, bench settings)."""
    name, _, rest = text.partition(":")
    if not name.strip():
        raise click.BadParameter(f"{text!r}: expected NAME:KEY=VALUE,...", param_hint="--variant")
    env, knobs = {}, {}
    for item in filter(None, (x.strip() for x in rest.split(","))):
        k, eq, v = item.partition("=")
        if not eq:
            raise click.BadParameter(f"{item!r} in {text!r}: expected KEY=VALUE", param_hint="--variant")
        if k in BENCH_KEYS:
            if k == "size" and v not in SIZES:
                raise click.BadParameter(f"size {v!r}: one of {', '.join(sorted(SIZES))}", param_hint="--variant")
            knobs[k] = v
        else:
            env[k] = v
    return name.strip(), env, knobs


class Cluster:
    """The verbs cluster (one node, or as many as a variant's ``replicas=``), (re)started when the
    environment or the number of nodes a variant wants differs."""

    def __init__(self, root: str):
        self.root, self.path, self.env, self.nodes, self.up = root, "", None, 0, False

    def ensure(self, env: dict, nodes: int = 1) -> None:
        if self.up and env == self.env and nodes == self.nodes:
            return
        self.down()
        self.path = f"{self.root}-{nodes}"       # a stopped cluster restarts as it was: one per size
        with _environ(env):
            dnctl("cluster", "up", "--nodes", str(nodes), "--cluster", self.path, "--transport", "verbs",
                  "--sync", "always", "--pool-mib", "64", "--replica-timeout", "20", "--no-etcd")
        self.env, self.nodes, self.up = dict(env), nodes, True

    def down(self) -> None:
        if self.up:
            dnctl("cluster", "down", "--cluster", self.path)
            self.up = False


@contextlib.contextmanager
def _environ(env: dict | None):
    """``env`` set in os.environ (for the processes started meanwhile), the old values put back after."""
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def ingest(cluster: str, size: str, seconds: float, depth: int, clients: int, env: dict | None = None,
           replicas: int = 1) -> dict:
    with _environ(env), CpuSampler() as cs:
        r = _ingest(cluster, size, seconds, depth, clients, replicas)
    t0, t1 = r.pop("monotonic")
    r["vm_cpu"] = cs.window(t0, t1, r["bytes"] / 1e6)      # the write phase only
    return r


def ib_read_bw_cpu(size: int, iters: int) -> tuple[float | None, dict | None]:
    """ib_read_bw's MB/s and where the VM's CPUs went while its client ran (after the server's start)."""
    with CpuSampler() as cs:
        t0 = time.monotonic() + 1.6          # vm_compare.ib_read_bw sleeps 1.5 s for the server first
        mbs = ib_read_bw(size, iters)
        t1 = time.monotonic()
    return mbs, cs.window(t0, t1, size * iters / 1e6)


def _ingest(cluster: str, size: str, seconds: float, depth: int, clients: int, replicas: int = 1) -> dict:
    out = json.loads(dnctl("bench", "--cluster", cluster, "--replicas", str(replicas), "--mode", "write",
                           "--size", size,
                           "--depth", str(depth), "--clients", str(clients), "--seconds", str(seconds),
                           "--transport", "verbs", "--json"))
    row = out["results"][0]
    node = next(iter(row.get("node_cpu", {}).values()), {})
    return {"mib_s": row["mib_s"], "mb_s": round(row["mib_s"] * (1 << 20) / 1e6, 1),
            "p50_ms": row["latency_ms"]["p50"], "p99_ms": row["latency_ms"]["p99"], "errors": row["errors"],
            "transport": out["config"]["transport"], "bytes": row["bytes"], "monotonic": row["monotonic"],
            "node_cpu_s_per_gb": node.get("s_per_gb"), "client_cpu_s_per_gb": row["client_cpu"]["s_per_gb"]}


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--mtu", "mtus", default="1024,4096", show_default=True,
              help="RoCE MTUs to compare (1024, 2048, 4096), in this order every round.")
@click.option("--rounds", type=click.IntRange(1, 20), default=2, show_default=True)
@click.option("--size", default="1MiB", type=click.Choice(sorted(SIZES)), show_default=True)
@click.option("--seconds", type=float, default=6.0, show_default=True, help="dnctl bench write phase length.")
@click.option("--depth", type=click.IntRange(1, 64), default=8, show_default=True)
@click.option("--clients", type=click.IntRange(1, 16), default=1, show_default=True,
              help="Client processes writing to the leader at once (its ingest, not one client's).")
@click.option("--ib-iters", type=int, default=500, show_default=True, help="ib_read_bw -n.")
@click.option("--variant", "variants", multiple=True, metavar="NAME:KEY=VALUE,...",
              help="Settings to compare in the same run (see the module docstring); default: one, as is.")
@click.option("--json", "as_json", is_flag=True, help="Also print every measurement as JSON.")
def main(mtus, rounds, size, seconds, depth, clients, ib_iters, variants, as_json) -> None:
    """Leader ingest over verbs / ib_read_bw per RoCE MTU, in this Soft-RoCE VM (see the module docstring)."""
    if not os.path.exists(f"/sys/class/infiniband/{DEV}"):
        raise SystemExit(f"no RDMA device {DEV}: run inside the VM: "
                         "lab/softroce-vm run -- python -m bench.verbs_ratio")
    if not shutil.which("ib_read_bw"):
        raise SystemExit("ib_read_bw is not installed (apt-get install perftest)")
    try:
        wanted = [int(x) for x in mtus.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter("expected MTUs like 1024,4096", param_hint="--mtu") from None
    if not wanted or any(m not in NETDEV_MTU for m in wanted):
        raise click.BadParameter(f"each MTU must be one of {sorted(NETDEV_MTU)}", param_hint="--mtu")
    plan = [parse_variant(v) for v in variants] or [("as-is", {}, {})]
    if len({n for n, _, _ in plan}) != len(plan):
        raise click.BadParameter("variant names must differ", param_hint="--variant")
    netdev = rxe_netdev()
    root = tempfile.mkdtemp(prefix="verbsratio-")
    cluster = os.path.join(root, "c")
    runs: list[dict] = []
    print(f"device {DEV} (GID {GID}, {ADDR}) on {netdev}; {size} writes, {clients} client(s) x depth {depth}, "
          f"{seconds:g} s; "
          f"{rounds} round(s) of MTU {', '.join(map(str, wanted))}", flush=True)
    cl = Cluster(cluster)
    try:
        for rnd in range(1, rounds + 1):
            for mtu in wanted:
                got = set_mtu(netdev, mtu)
                c0 = hw_counters()
                ib0, ibcpu0 = ib_read_bw_cpu(SIZES[size], ib_iters)
                c1 = hw_counters()
                ings, moved, paths = {}, {}, {}
                # the variants in turn (rotated each round, so none always runs first)
                k = (rnd - 1) % len(plan)
                for name, env, knobs in plan[k:] + plan[:k]:
                    reps = int(knobs.get("replicas", 1))
                    cl.ensure(env, reps)
                    ca = hw_counters()
                    ings[name] = ingest(cl.path, knobs.get("size", size), seconds,
                                        int(knobs.get("depth", depth)), int(knobs.get("clients", clients)), env,
                                        reps)
                    moved[name] = delta(ca, hw_counters())
                    if len(plan) > 1:
                        i = ings[name]
                        print(f"    [{name}] ingest {i['mb_s']:.1f} MB/s, p50 {i['p50_ms']} ms, errors {i['errors']}; "
                              f"rxe {moved[name]}", flush=True)
                    paths[name] = sorted({m for m in node_path_mtus(cl.path) if m})
                c2 = hw_counters()
                ib1, ibcpu1 = ib_read_bw_cpu(SIZES[size], ib_iters)
                c3 = hw_counters()
                # the device's rate: the better of the runs before and after (a run under a burst of the
                # host's other work, or one that reports 0, must not flatter the ratio)
                ib = max([x for x in (ib0, ib1) if x] or [0.0]) or None
                for name, env, knobs in plan:
                    ing = ings[name]
                    r = {"round": rnd, "roce_mtu": mtu, "active_mtu": got, "netdev_mtu": NETDEV_MTU[mtu],
                         "variant": name, "env": env, "bench": knobs,
                         "ib_read_bw_MBps": ib, "ib_read_bw_runs": [ib0, ib1], "ingest": ing,
                         "ib_read_bw_vm_cpu": [ibcpu0, ibcpu1],
                         "rxe_counters": {"ib_read_bw": [delta(c0, c1), delta(c2, c3)], "ingest": moved[name]},
                         "node_path_mtus": paths[name], "ratio": round(ing["mb_s"] / ib, 3) if ib else None}
                    runs.append(r)
                    tag = f" [{name}]" if len(plan) > 1 else ""
                    print(f"round {rnd} MTU {mtu} (active {got}){tag}: ib_read_bw {ib or 0:.1f} MB/s, leader "
                          f"ingest {ing['mb_s']:.1f} MB/s ({ing['mib_s']:.1f} MiB/s, p50 {ing['p50_ms']} ms, "
                          f"errors {ing['errors']}), ratio {r['ratio']}", flush=True)
                    print(f"    rxe counters that moved: ib_read_bw {r['rxe_counters']['ib_read_bw']}, ingest "
                          f"{r['rxe_counters']['ingest']}", flush=True)
                    print(f"    VM CPU: ib_read_bw {[_cpu_text(c) for c in (ibcpu0, ibcpu1)]}; ingest "
                          f"{_cpu_text(ing.get('vm_cpu'))}, node {ing.get('node_cpu_s_per_gb')} / client "
                          f"{ing.get('client_cpu_s_per_gb')} CPU-s/GB, p99 {ing.get('p99_ms')} ms", flush=True)
    finally:
        cl.down()
        shutil.rmtree(root, ignore_errors=True)
    if as_json:
        print(json.dumps(runs, indent=2))
    print("\nsummary (medians over rounds)")
    for (name, _, _), mtu in ((v, m) for v in plan for m in wanted):
        mine = [r for r in runs if r["roce_mtu"] == mtu and r["variant"] == name]
        if len(plan) > 1:
            print(f"  [{name}]", end="")
        ib = [r["ib_read_bw_MBps"] for r in mine if r["ib_read_bw_MBps"]]
        ing = [r["ingest"]["mb_s"] for r in mine]
        rat = [r["ratio"] for r in mine if r["ratio"]]
        med = round(statistics.median(rat), 3) if rat else None
        print(f"  MTU {mtu}: ib_read_bw {statistics.median(ib) if ib else 0:.1f} MB/s, leader ingest "
              f"{statistics.median(ing):.1f} MB/s, ingest / ib_read_bw = {med if med is not None else 'n/a'}"
              f"  (goal >= {GOAL:.2f}: {'met' if med is not None and med >= GOAL else 'NOT met'})")


if __name__ == "__main__":
    main()
