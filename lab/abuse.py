"""Abuse soak: do well-behaved clients keep their latency while abusive peers hammer the same datanode?

``python -m lab soak`` starts a scratch datanode (authentication on) and measures the p99 of well-behaved clients'
4 KiB appends twice, for the same time each: *unloaded*, then with abusive peers running beside them in a
separate process at the lowest CPU priority (nice 19: abusers live on other hosts, so their own CPU use must
not take the cores from the node and the clients -- what the node does for them is what is measured):

* **unserved reads**  -- WRITE headers of 1 MiB whose payload the peer never serves (the node's one-sided READ
  waits ``payload_timeout``, holding a pool block, then the node answers PAYLOAD_TIMEOUT and drops the
  connection; the peer reconnects);
* **unread answers**  -- READ requests of 1 MiB whose answers (the node's one-sided WRITEs) the peer never
  reads, sent until its socket stalls; the node drops it; it reconnects;
* **slowloris**       -- connections that send their hello one byte at a time, slower than ``hello_timeout``;
* **idle**            -- 2,000 authenticated connections that say nothing.

It alternates unloaded and loaded phases in one run (``--pairs``), prints each pair's p99s and their ratio
and the median ratio (the issue's goal: within 2x), how often the node dropped or refused the abusers, and
for each phase where the time went on the node: its event loop's lag (``datanode/metrics.py``, ``LoopLag``),
the CPU its loop thread used and how long it waited for a CPU (the kernel's run-queue delay, from
/proc/PID/task/PID/schedstat: time the cores were given to other processes).  Pairs of neighbouring
phases and their median make the verdict robust on a shared machine.
"""
from __future__ import annotations

import multiprocessing
import os
import random
import resource
import socket
import statistics
import tempfile
import threading
import time

import click
import trio

from client.sdk import DataClient
from wire.auth import Credentials, DialAuth, gen_secret
from wire.protocol import Header, Op, Role
from lab import fuzz
from tools.clikit import CTX, Command, emit

KiB, MiB = 1 << 10, 1 << 20
PID = 1
KINDS = ("unserved", "unread", "slowloris", "idle")


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def _clients(addr: str, secret: str, seconds: float, clients: int, size: int) -> list[float]:
    """``clients`` well-behaved writers appending ``size`` bytes back to back; every append's latency (s)."""
    lat: list[float] = []
    data = random.Random(1).randbytes(size)

    async def one(dc: DataClient):
        eid = await dc.create_extent(PID)
        off = 0
        end = trio.current_time() + seconds
        while trio.current_time() < end:
            if off + size > 64 * MiB:
                eid, off = await dc.create_extent(PID), 0
            t0 = time.perf_counter()
            await dc.append(PID, eid, off, data)
            lat.append(time.perf_counter() - t0)
            off += size

    async with DataClient.from_env([addr], timeout=30.0, pool_mib=8, transport="tcp", secret=secret) as dc:
        async with trio.open_nursery() as n:
            for _ in range(clients):
                n.start_soon(one, dc)
    return lat


# -- the abusers (a child process; blocking sockets in threads) -----------------------------------------------
def _established(s: socket.socket) -> bool:
    """The kernel's TCP state of ``s`` (struct tcp_info's first byte) is still ESTABLISHED."""
    try:
        return s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0] == 1
    except OSError:
        return False


def _abusers(addr: str, secret: str, target: dict, idle: int, stop, counts, kinds=KINDS) -> None:
    # Abusive peers live on other hosts: their own CPU (Python threads, their side of the sockets) must not
    # take this machine's cores from the node and the clients, only what the node does for them counts.  On
    # one shared box the nearest we get is the lowest CPU priority.
    try:
        os.nice(19)
    except OSError:
        pass
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    auth = DialAuth(Credentials.load(secret), Role.CLIENT)
    extents, epoch = target["extents"], target["epoch"]

    def bump(key):
        with counts.get_lock():
            counts[key] += 1

    def session(fn, key):
        while not stop.is_set():
            try:
                s = fuzz.connect(addr, timeout=1.0)
            except OSError:
                time.sleep(0.1)
                continue
            try:
                fn(s)
            except (OSError, ConnectionError, fuzz.Refused):
                pass
            finally:
                fuzz.end(s, "rst")
            bump(key)            # a session ends when the node dropped or refused us

    def wait_dropped(s):
        s.settimeout(0.5)
        while not stop.is_set():
            try:
                if not s.recv(1 << 16):
                    return
            except socket.timeout:
                continue

    def unserved(s):                              # payloads never served
        fuzz.hello(s, auth=auth)
        for i in range(8):
            fuzz.send_ctrl(s, Header(opcode=Op.WRITE, partition=PID, extent=random.choice(extents), length=MiB,
                                     crc=0, epoch=epoch, addr=0x100000, rkey=9, rlen=MiB, req_id=i + 1).encode())
        wait_dropped(s)

    # 256 READ requests, encoded once: the flood costs this (abusive) side little Python work per request (a
    # session MAC each) -- an abuser's CPU is its own host's, and must not take this machine's cores from the
    # node and the clients
    reads = [Header(opcode=Op.READ, partition=PID, extent=extents[0], offset=0, length=MiB, epoch=epoch,
                    addr=0x100000, rkey=9, rlen=MiB, req_id=i + 1).encode() for i in range(256)]

    def unread(s):                                # answers never read
        fuzz.hello(s, auth=auth)
        s.settimeout(1.0)
        while not stop.is_set():
            try:
                s.sendall(b"".join(fuzz.ctrl_frame(s, raw) for raw in reads))
            except socket.timeout:
                break                             # stalled: now just sit there, never reading
        while not stop.is_set() and _established(s):   # until the node drops us (never reading a byte)
            time.sleep(0.2)

    def slowloris(s):                             # a hello one byte at a time
        from wire.protocol import Hello, Transport
        raw = Hello(transport=Transport.TCP, has_device=False, slots=8, auth=True, role=int(Role.CLIENT),
                    nonce=os.urandom(32), identity="").encode()
        for b in raw:
            if stop.is_set():
                return
            s.sendall(bytes([b]))
            time.sleep(0.5)

    threads = [threading.Thread(target=session, args=(unserved, 0), daemon=True)
               for _ in range(4 if "unserved" in kinds else 0)]
    threads += [threading.Thread(target=session, args=(unread, 1), daemon=True)
                for _ in range(4 if "unread" in kinds else 0)]
    threads += [threading.Thread(target=session, args=(slowloris, 2), daemon=True)
                for _ in range(20 if "slowloris" in kinds else 0)]
    if "idle" not in kinds:
        idle = 0
    held = []
    for _ in range(idle):                         # idle: authenticated, then silent (opened first)
        if stop.is_set():
            break
        try:
            s = fuzz.connect(addr, timeout=5.0)
            fuzz.hello(s, auth=auth)
            held.append(s)
            bump(3)
        except (OSError, ConnectionError, fuzz.Refused):
            bump(4)
    for t in threads:
        t.start()
    stop.wait()
    for s in held:
        s.close()


async def _setup(addr: str, secret: str) -> dict:
    async with DataClient.from_env([], timeout=30.0, pool_mib=8, transport="tcp", secret=secret) as dc:
        await dc.admin(addr, Op.PARTITION_CREATE, partition=PID, body={"replicas": [addr], "epoch": 1})
        await dc.discover(addr)
        extents = [await dc.create_extent(PID) for _ in range(4)]
        await dc.append(PID, extents[0], 0, os.urandom(MiB))       # the unread-answers peers read this
        return {"extents": extents, "epoch": dc.partition(PID).epoch}


async def _status(addr: str, secret: str) -> dict:
    async with DataClient.from_env([], timeout=30.0, pool_mib=2, transport="tcp", secret=secret) as dc:
        return await dc.admin(addr, Op.NODE_STATUS)


_TICK = os.sysconf("SC_CLK_TCK")


def _proc_cpu(pid: int | None) -> float | None:
    """Seconds of CPU (user + system, all threads) process ``pid`` has used."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / _TICK
    except (OSError, ValueError, IndexError):
        return None


def _box_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine (/proc/stat), every core summed."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + (v[4] if len(v) > 4 else 0)
    return (sum(v) - idle) / _TICK, sum(v) / _TICK


def _phase(addr: str, secret: str, seconds: float, clients: int, size: int, abuser_pid: int | None = None) -> dict:
    """One measured phase: the clients' latencies and, from the node's status before and after, its event
    loop's lag and its own time for the appends (arrival to answer) over the same span."""
    from datanode.metrics import lag_percentile
    st0 = trio.run(_status, addr, secret)
    pids = {"node": st0["pid"], "abusers": abuser_pid}
    c0 = {k: _proc_cpu(p) for k, p in pids.items()}
    me0, box0 = os.times(), _box_cpu()
    s0, t0 = _schedstat(st0["pid"]), time.monotonic()
    lat = trio.run(_clients, addr, secret, seconds, clients, size)
    s1, t1 = _schedstat(st0["pid"]), time.monotonic()
    c1 = {k: _proc_cpu(p) for k, p in pids.items()}
    me1, box1 = os.times(), _box_cpu()
    cpu = {k: round(100 * (c1[k] - c0[k]) / (t1 - t0), 1) if c0[k] is not None and c1[k] is not None else None
           for k in pids}
    cpu["clients"] = round(100 * (me1.user + me1.system - me0.user - me0.system) / (t1 - t0), 1)
    cpu["machine_busy"] = round(100 * (box1[0] - box0[0]) / max(1e-9, box1[1] - box0[1]), 1)
    cpu["load_avg_1m"] = os.getloadavg()[0]
    st1 = trio.run(_status, addr, secret)
    return {"appends": len(lat), "p50_ms": round(_percentile(lat, 0.5) * 1e3, 3),
            "p99_ms": round(_percentile(lat, 0.99) * 1e3, 3), "max_ms": round(max(lat, default=0) * 1e3, 3),
            "loop_lag_p99_le_ms": lag_percentile(st0["loop_lag"], st1["loop_lag"], 0.99) if "loop_lag" in st1 else None,
            "loop_lag_p999_le_ms": lag_percentile(st0["loop_lag"], st1["loop_lag"], 0.999) if "loop_lag" in st1 else None,
            # the node's main thread (its event loop): CPU it used, and time it was ready to run but waited
            # for a CPU (the kernel's run queue: other processes had the cores), both per second of the phase
            "node_loop_cpu_pct": round((s1[0] - s0[0]) / 1e7 / (t1 - t0), 1) if s0 and s1 else None,
            "node_loop_runq_wait_ms_per_s": round((s1[1] - s0[1]) / 1e6 / (t1 - t0), 1) if s0 and s1 else None,
            "gc": _gc_delta(st0.get("gc"), st1.get("gc")),
            "cpu_pct": cpu,         # per process (100 = one core) over the phase; machine_busy: of all cores
            "_status": st1}


def _gc_delta(g0: dict | None, g1: dict | None) -> dict | None:
    """The node's garbage-collector pauses over the phase: per generation, collections and their total ms;
    the worst pause since start."""
    if not g0 or not g1:
        return None
    return {"collections": [b - a for a, b in zip(g0["collections"], g1["collections"])],
            "total_ms": [round(b - a, 1) for a, b in zip(g0["total_ms"], g1["total_ms"])],
            "max_ms_since_start": g1["max_ms"]}


def _schedstat(pid: int) -> tuple[int, int] | None:
    """(ns on a CPU, ns waiting on a run queue) of the main thread of ``pid`` (/proc/PID/task/PID/schedstat)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/schedstat") as f:
            run_ns, wait_ns, _slices = f.read().split()
        return int(run_ns), int(wait_ns)
    except (OSError, ValueError):
        return None


def soak(*, seconds: float, clients: int, size: int, idle: int, pairs: int = 3, warmup: float = 15.0,
         kinds=KINDS, **cfg) -> dict:
    """``pairs`` times: an unloaded phase, then a loaded one (the abusers started afresh in a child process,
    given ``warmup`` to get going, stopped after), each ``seconds`` long, all on one scratch node.  Pairing
    phases that run next to each other cancels most of what else the machine does meanwhile; the verdict is
    the median of the pairs' p99 ratios."""
    from lab.fuzz import scratch_node
    results: list[dict] = []
    totals = [0] * 5
    with tempfile.TemporaryDirectory(prefix="dnsoak-") as d:
        secret = os.path.join(d, "cluster.secret")
        with open(secret, "w", opener=lambda p, f: os.open(p, f, 0o600)) as f:
            f.write(gen_secret())
        node_cfg = {"secret_file": secret, "max_connections": idle + 512, "peer_timeout": 2.0,
                    "payload_timeout": 2.0, "hello_timeout": 2.0, "sync": "none", "penalty_max_s": 2.0, **cfg}
        with scratch_node(d, **node_cfg) as node:
            target = trio.run(_setup, node.addr, secret)
            ctx = multiprocessing.get_context("spawn")
            during = []
            for _ in range(pairs):
                base = _phase(node.addr, secret, seconds, clients, size)
                stop = ctx.Event()
                counts = ctx.Array("q", 5)
                proc = ctx.Process(target=_abusers, args=(node.addr, secret, target, idle, stop, counts,
                                                          tuple(kinds)), daemon=True)
                proc.start()
                try:
                    t0 = time.monotonic()             # let the idle connections pile up first
                    while "idle" in kinds and counts[3] + counts[4] < idle and time.monotonic() - t0 < warmup * 4:
                        time.sleep(0.2)
                    time.sleep(warmup / 3)            # and the other abusers get going
                    loaded = _phase(node.addr, secret, seconds, clients, size, proc.pid)
                finally:
                    stop.set()
                    proc.join(30)
                    if proc.is_alive():
                        proc.kill()
                totals = [a + b for a, b in zip(totals, counts[:])]
                during.append(len(loaded["_status"]["connections"]))
                st1 = loaded["_status"]
                base.pop("_status"), loaded.pop("_status")
                results.append({"unloaded": base, "loaded": loaded,
                                "p99_ratio": round(loaded["p99_ms"] / base["p99_ms"], 2) if base["p99_ms"] else None})
                time.sleep(min(5.0, warmup / 3))      # the node closes what the abusers left
            alive = node.alive()
            rss = fuzz.rss_kib(st1["pid"])
            tracebacks = node.log_path.read_text(errors="replace").count("Traceback")
    ratios = sorted(r["p99_ratio"] for r in results if r["p99_ratio"] is not None)
    return {"seconds_per_phase": seconds, "clients": clients, "size": size, "pairs": results,
            "p99_ratio_median": round(statistics.median(ratios), 2) if ratios else None,
            "p99_ratio_min": ratios[0] if ratios else None, "p99_ratio_max": ratios[-1] if ratios else None,
            "abusers": {"unserved_read_sessions_dropped": totals[0], "unread_answer_sessions_dropped": totals[1],
                        "slowloris_sessions_dropped": totals[2], "idle_connections_held": totals[3],
                        "idle_connections_refused": totals[4], "node_connections_during": during,
                        "node_refused_connections": st1["refused_connections"],
                        "node_busy_inflight": st1["counters"].get("busy_inflight")},
            "node_alive": alive, "tracebacks_in_log": tracebacks,
            "node_rss_kib": rss, "node_penalties": st1["counters"].get("penalties")}


@click.command("soak", cls=Command, context_settings=CTX)
@click.option("--seconds", type=click.FloatRange(1, 3600), default=10.0, show_default=True,
              help="Length of each phase (unloaded, then with the abusers).")
@click.option("--pairs", type=click.IntRange(1, 100), default=3, show_default=True,
              help="Unloaded/loaded phase pairs, alternating in one run; the verdict is their median ratio.")
@click.option("--clients", type=click.IntRange(1, 64), default=2, show_default=True,
              help="Well-behaved writers (each appends back to back).")
@click.option("--size", type=click.IntRange(1, 4 * MiB), default=4 * KiB, show_default=True,
              help="Bytes per append.")
@click.option("--idle", type=click.IntRange(0, 10000), default=2000, show_default=True,
              help="Idle authenticated connections the abusers hold.")
@click.option("--abusers", default=",".join(KINDS), show_default=True,
              help="Which abusive peers run (comma-separated subset).")
@click.option("--json", "as_json", is_flag=True)
def soak_command(seconds, pairs, clients, size, idle, abusers, as_json):
    """Abuse soak: p99 of well-behaved clients' appends on a scratch datanode, unloaded and then with
    abusive peers beside them (unserved reads, unread answers, slowloris, 2,000 idle connections).

    \b
    python -m lab soak --seconds 10 --pairs 3
    python -m lab soak --seconds 5 --pairs 5 --idle 500 --json
    """
    kinds = tuple(k.strip() for k in abusers.split(",") if k.strip())
    bad = set(kinds) - set(KINDS)
    if bad or not kinds:
        raise click.BadParameter(f"one or more of {', '.join(KINDS)}", param_hint="--abusers")
    res = soak(seconds=seconds, pairs=pairs, clients=clients, size=size, idle=idle, kinds=kinds)
    a = res["abusers"]
    lines = []
    for i, p in enumerate(res["pairs"], 1):
        for name in ("unloaded", "loaded"):
            r = p[name]
            lines.append(f"pair {i} {name:8}: {r['appends']:6} appends of {size} B, p50 {r['p50_ms']:7.3f} ms, "
                         f"p99 {r['p99_ms']:7.3f} ms, max {r['max_ms']:8.3f} ms | node: loop lag p99 <= "
                         f"{r['loop_lag_p99_le_ms']} ms, p99.9 <= {r['loop_lag_p999_le_ms']} ms, loop thread CPU {r['node_loop_cpu_pct']}%, "
                         f"waited for a CPU {r['node_loop_runq_wait_ms_per_s']} ms/s")
            c = r["cpu_pct"]
            lines.append(f"    CPU % (100 = a core): node {c['node']}, clients {c['clients']}, abusers {c['abusers']}; "
                         f"machine {c['machine_busy']}% busy, load {c['load_avg_1m']:.1f}")
            g = r["gc"]
            if g:
                lines.append(f"    node GC: {g['collections']} collections (gen 0/1/2), {g['total_ms']} ms; worst "
                             f"pause so far {g['max_ms_since_start']} ms")
        lines.append(f"pair {i} p99 ratio {p['p99_ratio']}x")
    lines.append(f"p99 ratio: median {res['p99_ratio_median']}x (min {res['p99_ratio_min']}x, max "
                 f"{res['p99_ratio_max']}x; goal <= 2x)")
    lines.append(f"abusers: {a['idle_connections_held']} idle connections held ({a['idle_connections_refused']} "
                 f"refused), sessions dropped by the node: {a['unserved_read_sessions_dropped']} unserved-read, "
                 f"{a['unread_answer_sessions_dropped']} unread-answer, {a['slowloris_sessions_dropped']} slowloris; "
                 f"node alive: {res['node_alive']}, tracebacks in its log: {res['tracebacks_in_log']}, "
                 f"RSS {res['node_rss_kib']} KiB")
    text = "\n".join(lines)
    emit(res, as_json, text)
    if not res["node_alive"]:
        raise click.ClickException("the node died during the soak")


if __name__ == "__main__":
    soak_command()
