"""Abuse soak: do well-behaved clients keep their latency while abusive peers hammer the same datanode?

``dnctl soak`` starts a scratch datanode (authentication on) and measures the p99 of well-behaved clients'
4 KiB appends twice, for the same time each: *unloaded*, then with abusive peers running beside them in a
separate process (so their CPU use on the client side does not count against the clients):

* **unserved reads**  -- WRITE headers of 1 MiB whose payload the peer never serves (the node's one-sided READ
  waits ``peer_timeout``, holding a pool block, then the node drops the connection; the peer reconnects);
* **unread answers**  -- READ requests of 1 MiB whose answers (the node's one-sided WRITEs) the peer never
  reads, sent until its socket stalls; the node drops it; it reconnects;
* **slowloris**       -- connections that send their hello one byte at a time, slower than ``hello_timeout``;
* **idle**            -- 2,000 authenticated connections that say nothing.

It prints both p99s and their ratio (the issue's goal: within 2x), and how often the node dropped or refused
the abusers.  Numbers from a shared 2-core machine are noisy: run it twice.
"""
from __future__ import annotations

import multiprocessing
import os
import random
import resource
import socket
import tempfile
import threading
import time

import click
import trio

from client.sdk import DataClient
from datanode.auth import Credentials, DialAuth, gen_secret
from datanode.protocol import Header, Op, Role
from tools import fuzz
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

    async with DataClient.open([addr], timeout=30.0, pool_mib=8, transport="tcp", secret=secret) as dc:
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

    def unread(s):                                # answers never read
        fuzz.hello(s, auth=auth)
        s.settimeout(1.0)
        i = 0
        while not stop.is_set():
            i += 1
            try:
                fuzz.send_ctrl(s, Header(opcode=Op.READ, partition=PID, extent=extents[0], offset=0, length=MiB,
                                         epoch=epoch, addr=0x100000, rkey=9, rlen=MiB, req_id=i).encode())
            except socket.timeout:
                break                             # stalled: now just sit there, never reading
        while not stop.is_set() and _established(s):   # until the node drops us (never reading a byte)
            time.sleep(0.2)

    def slowloris(s):                             # a hello one byte at a time
        from datanode.protocol import Hello, Transport
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
    async with DataClient.open([], timeout=30.0, pool_mib=8, transport="tcp", secret=secret) as dc:
        await dc.admin(addr, Op.PARTITION_CREATE, partition=PID, body={"replicas": [addr], "epoch": 1})
        await dc.discover(addr)
        extents = [await dc.create_extent(PID) for _ in range(4)]
        await dc.append(PID, extents[0], 0, os.urandom(MiB))       # the unread-answers peers read this
        return {"extents": extents, "epoch": dc.partition(PID).epoch}


async def _status(addr: str, secret: str) -> dict:
    async with DataClient.open([], timeout=30.0, pool_mib=2, transport="tcp", secret=secret) as dc:
        return await dc.admin(addr, Op.NODE_STATUS)


def soak(*, seconds: float, clients: int, size: int, idle: int, warmup: float = 15.0, kinds=KINDS, **cfg) -> dict:
    from tools.fuzz import scratch_node
    with tempfile.TemporaryDirectory(prefix="dnsoak-") as d:
        secret = os.path.join(d, "cluster.secret")
        with open(secret, "w", opener=lambda p, f: os.open(p, f, 0o600)) as f:
            f.write(gen_secret())
        node_cfg = {"secret_file": secret, "max_connections": idle + 512, "peer_timeout": 2.0,
                    "hello_timeout": 2.0, "sync": "none", "penalty_max_s": 2.0, **cfg}
        with scratch_node(d, **node_cfg) as node:
            target = trio.run(_setup, node.addr, secret)
            base = trio.run(_clients, node.addr, secret, seconds, clients, size)
            ctx = multiprocessing.get_context("spawn")
            stop = ctx.Event()
            counts = ctx.Array("q", 5)
            proc = ctx.Process(target=_abusers, args=(node.addr, secret, target, idle, stop, counts, tuple(kinds)),
                               daemon=True)
            proc.start()
            try:
                t0 = time.monotonic()             # let the idle connections pile up first
                while "idle" in kinds and counts[3] + counts[4] < idle and time.monotonic() - t0 < warmup * 4:
                    time.sleep(0.2)
                time.sleep(warmup / 3)            # and the other abusers get going
                st0 = trio.run(_status, node.addr, secret)
                loaded = trio.run(_clients, node.addr, secret, seconds, clients, size)
                st1 = trio.run(_status, node.addr, secret)
            finally:
                stop.set()
                proc.join(30)
                if proc.is_alive():
                    proc.kill()
            alive = node.alive()
            rss = fuzz.rss_kib(st1["pid"])
            tracebacks = node.log_path.read_text(errors="replace").count("Traceback")
    p99u, p99l = _percentile(base, 0.99), _percentile(loaded, 0.99)
    return {"seconds_per_phase": seconds, "clients": clients, "size": size,
            "unloaded": {"appends": len(base), "p50_ms": round(_percentile(base, 0.5) * 1e3, 3),
                         "p99_ms": round(p99u * 1e3, 3)},
            "loaded": {"appends": len(loaded), "p50_ms": round(_percentile(loaded, 0.5) * 1e3, 3),
                       "p99_ms": round(p99l * 1e3, 3)},
            "p99_ratio": round(p99l / p99u, 2) if p99u else None,
            "abusers": {"unserved_read_sessions_dropped": counts[0], "unread_answer_sessions_dropped": counts[1],
                        "slowloris_sessions_dropped": counts[2], "idle_connections_held": counts[3],
                        "idle_connections_refused": counts[4],
                        "node_connections_during": len(st0["connections"]),
                        "node_connections_at_end": len(st1["connections"]),
                        "node_refused_connections": st1["refused_connections"],
                        "node_busy_inflight": st1["counters"].get("busy_inflight")},
            "node_alive": alive, "tracebacks_in_log": tracebacks,
            "node_rss_kib": rss, "node_penalties": st1["counters"].get("penalties")}


@click.command("soak", cls=Command, context_settings=CTX)
@click.option("--seconds", type=click.FloatRange(1, 3600), default=20.0, show_default=True,
              help="Length of each phase (unloaded, then with the abusers).")
@click.option("--clients", type=click.IntRange(1, 64), default=2, show_default=True,
              help="Well-behaved writers (each appends back to back).")
@click.option("--size", type=click.IntRange(1, 4 * MiB), default=4 * KiB, show_default=True,
              help="Bytes per append.")
@click.option("--idle", type=click.IntRange(0, 10000), default=2000, show_default=True,
              help="Idle authenticated connections the abusers hold.")
@click.option("--abusers", default=",".join(KINDS), show_default=True,
              help="Which abusive peers run (comma-separated subset).")
@click.option("--json", "as_json", is_flag=True)
def soak_command(seconds, clients, size, idle, abusers, as_json):
    """Abuse soak: p99 of well-behaved clients' appends on a scratch datanode, unloaded and then with
    abusive peers beside them (unserved reads, unread answers, slowloris, 2,000 idle connections).

    \b
    dnctl soak --seconds 30
    dnctl soak --seconds 10 --idle 500 --json
    """
    kinds = tuple(k.strip() for k in abusers.split(",") if k.strip())
    bad = set(kinds) - set(KINDS)
    if bad or not kinds:
        raise click.BadParameter(f"one or more of {', '.join(KINDS)}", param_hint="--abusers")
    res = soak(seconds=seconds, clients=clients, size=size, idle=idle, kinds=kinds)
    u, lo, a = res["unloaded"], res["loaded"], res["abusers"]
    text = (f"unloaded: {u['appends']} appends of {size} B, p50 {u['p50_ms']} ms, p99 {u['p99_ms']} ms\n"
            f"abused:   {lo['appends']} appends of {size} B, p50 {lo['p50_ms']} ms, p99 {lo['p99_ms']} ms  "
            f"(p99 ratio {res['p99_ratio']}x; goal <= 2x)\n"
            f"abusers: {a['idle_connections_held']} idle connections held ({a['idle_connections_refused']} "
            f"refused), sessions dropped by the node: {a['unserved_read_sessions_dropped']} unserved-read, "
            f"{a['unread_answer_sessions_dropped']} unread-answer, {a['slowloris_sessions_dropped']} slowloris; "
            f"node alive: {res['node_alive']}, tracebacks in its log: {res['tracebacks_in_log']}, "
            f"RSS {res['node_rss_kib']} KiB")
    emit(res, as_json, text)
    if not res["node_alive"]:
        raise click.ClickException("the node died during the soak")


if __name__ == "__main__":
    soak_command()
