"""The fastest a 4 KiB durable 3-replica write at depth 1 can be on this box in this design, with no datanode:
four processes (a client, a leader, two followers) on loopback TCP doing only what the design must.

The client sends a 64-byte header and the 4 KiB payload in one message (as our TCP transport sends a small
append inline); the leader forwards both to the two followers, makes its own copy durable, waits for the
followers' 16-byte acks and answers; each follower makes its copy durable and acks.  A copy is made durable
with the least the store could do: the bytes and an 8-byte entry pwritten over zeros the file already has
(written and synced ahead, as the store's zero-fill ahead), then ONE fdatasync -- one device cache flush, no
journal commit.  No CRC, no pool, no bookkeeping, no Python around it but the loop below.

Each process is one thread, its ends either

- ``blocking``: plain blocking sockets (the cheapest wake-up a process can have), or
- ``trio``: a trio loop per process, sockets tried first and ``wait_readable`` only when they would block,
  the flush run right in the loop (as the node's inline flush at depth 1): what a trio event loop per process
  costs on its own.

and a third topology, ``trio-direct``: as ``trio``, but the followers ack the client too and the leader answers
once its own copy is durable, so the client completes a write on three acks -- one hop fewer on the way back
(what "followers answer the client directly" could buy).

Variants run in turns (``--rounds``, each ``--writes`` writes back to back), so the box's hour weighs on each
alike.  With ``--cluster DIR`` (a running ``dnctl cluster up``, ``sync = always``) every turn also runs
``dnctl bench --size 4KiB --depth 1 --mode write`` on it (``--seconds`` each): ours beside the floor, same run.

    python -m bench.design_floor [--dir /var/tmp] [--rounds 4] [--writes 1500] [--cluster DIR] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time

import trio

from bench.floors import loopback_pair

HDR = 64
SIZE = 4096
ACK = 16
SPAN = 16 << 20          # zeros written ahead per replica file; writes wrap around inside it
WAIT_S = 10.0            # no answer to a write for this long: the round fails (a process is gone or stuck)
ENTRIES = SPAN           # the entries' zone: past the data, in zeros too (SPAN // SIZE * 8 bytes)
VARIANTS = ("blocking", "trio", "trio-direct")
OURS = "dnctl-bench"


def _recv_exact_blocking(s: socket.socket, buf: memoryview) -> bool:
    got = 0
    while got < len(buf):
        n = s.recv_into(buf[got:])
        if n == 0:
            return False
        got += n
    return True


async def _recv_exact_trio(s: socket.socket, buf: memoryview) -> bool:
    got = 0
    while got < len(buf):
        try:
            n = s.recv_into(buf[got:])
        except BlockingIOError:
            await trio.lowlevel.wait_readable(s)
            continue
        if n == 0:
            return False
        got += n
    return True


def _send_all(s: socket.socket, data) -> None:
    """Small messages into an idle 4 MiB socket buffer: one send takes them whole (checked)."""
    if s.send(data) != len(data):
        raise RuntimeError("short send on an idle socket")


class _Copy:
    """One replica's file: zeros written ahead and synced, then each write = data + entry + one fdatasync."""

    def __init__(self, directory: str, name: str):
        self.fd = os.open(os.path.join(directory, name), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        zeros = bytes(1 << 20)
        for pos in range(0, SPAN + (1 << 20), 1 << 20):
            os.pwrite(self.fd, zeros, pos)
        os.fsync(self.fd)
        self.n = 0

    def durable(self, payload) -> None:
        pos = (self.n * SIZE) % SPAN
        os.pwrite(self.fd, payload, pos)
        os.pwrite(self.fd, struct.pack("<Q", self.n), ENTRIES + (pos // SIZE) * 8)   # inside the zeros
        os.fdatasync(self.fd)
        self.n += 1


def _ack_or_fail(got: bool) -> None:
    if not got:
        raise RuntimeError("the peer closed its connection before acking")


def _end(socks: list[socket.socket]) -> None:
    """EOF to the peers (a shutdown: every process holds copies of every socket, forked with them)."""
    for s in socks:
        s.shutdown(socket.SHUT_WR)


def _leader(variant: str, up: socket.socket, downs: list[socket.socket], copy: _Copy) -> None:
    msg = bytearray(HDR + SIZE)
    ack = bytearray(ACK)
    if variant == "blocking":
        while _recv_exact_blocking(up, memoryview(msg)):
            for d in downs:
                _send_all(d, msg)
            copy.durable(memoryview(msg)[HDR:])
            for d in downs:
                _ack_or_fail(_recv_exact_blocking(d, memoryview(ack)))
            _send_all(up, ack)
        _end(downs)
        return
    for s in (up, *downs):
        s.setblocking(False)

    async def main():
        while await _recv_exact_trio(up, memoryview(msg)):
            for d in downs:
                _send_all(d, msg)
            copy.durable(memoryview(msg)[HDR:])
            if variant == "trio-direct":
                _send_all(up, ack)           # the client counts three acks; the leader still takes its two
            for d in downs:
                _ack_or_fail(await _recv_exact_trio(d, memoryview(ack)))
            if variant == "trio":
                _send_all(up, ack)
    trio.run(main)
    _end(downs)


def _follower(variant: str, up: socket.socket, client: socket.socket | None, copy: _Copy) -> None:
    msg = bytearray(HDR + SIZE)
    ack = bytes(ACK)
    if variant == "blocking":
        while _recv_exact_blocking(up, memoryview(msg)):
            copy.durable(memoryview(msg)[HDR:])
            _send_all(up, ack)
        return
    up.setblocking(False)

    async def main():
        while await _recv_exact_trio(up, memoryview(msg)):
            copy.durable(memoryview(msg)[HDR:])
            if client is not None:
                _send_all(client, ack)
            _send_all(up, ack)
    trio.run(main)


def _client(variant: str, leader: socket.socket, followers: list[socket.socket], writes: int) -> list[float]:
    msg = os.urandom(HDR + SIZE)
    ack = bytearray(ACK)
    lat: list[float] = []
    if variant == "blocking":
        leader.settimeout(WAIT_S)
        for _ in range(writes):
            t = time.perf_counter()
            _send_all(leader, msg)
            _ack_or_fail(_recv_exact_blocking(leader, memoryview(ack)))
            lat.append(time.perf_counter() - t)
        return lat
    ends = [leader, *followers]
    for s in ends:
        s.setblocking(False)

    async def main():
        for _ in range(writes):
            t = time.perf_counter()
            _send_all(leader, msg)
            with trio.fail_after(WAIT_S):
                for s in ends:               # trio: the leader's ack; trio-direct: the leader's and both followers'
                    _ack_or_fail(await _recv_exact_trio(s, memoryview(ack)))
            lat.append(time.perf_counter() - t)
    trio.run(main)
    return lat


def _child(fn, *args) -> int:
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            fn(*args)
        except BaseException as e:      # noqa: BLE001 -- a child reports and exits; the parent sees the code
            print(f"design_floor: {fn.__name__}: {e!r}", file=sys.stderr)
            code = 1
        finally:
            os._exit(code)
    return pid


def one_round(variant: str, directory: str, writes: int) -> dict:
    """``writes`` writes back to back through four fresh processes; latency per write and every process's CPU."""
    direct = variant == "trio-direct"
    cl, ld = loopback_pair()
    to_f = [loopback_pair() for _ in range(2)]
    f_cl = [loopback_pair() for _ in range(2)] if direct else []
    with tempfile.TemporaryDirectory(dir=directory) as d:
        copies = [_Copy(d, f"r{i}") for i in range(3)]
        t0 = os.times()
        pids = [_child(_leader, variant, ld, [a for a, _ in to_f], copies[0])]
        for i, (_, b) in enumerate(to_f):
            pids.append(_child(_follower, variant, b, f_cl[i][0] if direct else None, copies[i + 1]))
        for s in (ld, *(p for pair in to_f for p in pair), *(a for a, _ in f_cl)):
            s.close()
        try:
            lat = _client(variant, cl, [b for _, b in f_cl], writes)
        except (OSError, RuntimeError, trio.TooSlowError) as e:
            for p in pids:
                os.kill(p, signal.SIGKILL)
                os.waitpid(p, 0)
            raise SystemExit(f"design_floor: a {variant} round failed: {e!r}") from None
        t1 = os.times()
        _end([cl])
        cl.close()
        for _, b in f_cl:
            b.close()
        codes = [os.waitpid(p, 0)[1] for p in pids]
        t2 = os.times()
    if any(codes):
        raise SystemExit(f"design_floor: a {variant} process failed (status {codes})")
    lat.sort()
    client_cpu = (t1.user - t0.user) + (t1.system - t0.system)
    nodes_cpu = (t2.children_user - t0.children_user) + (t2.children_system - t0.children_system)
    return {"variant": variant, "writes": writes,
            "p50_ms": round(lat[len(lat) // 2] * 1e3, 3), "p99_ms": round(lat[int(len(lat) * 0.99)] * 1e3, 3),
            "client_cpu_us": round(client_cpu / writes * 1e6, 1), "nodes_cpu_us": round(nodes_cpu / writes * 1e6, 1)}


def ours(cluster: str, seconds: float) -> dict:
    """One ``dnctl bench`` write phase, 4 KiB at depth 1, on the running cluster in ``cluster``."""
    args = ["bench", "--cluster", cluster, "--size", "4KiB", "--depth", "1", "--mode", "write",
            "--seconds", str(seconds), "--json"]
    p = subprocess.run([sys.executable, "-c", "from tools.dnctl import main; main()", *args], capture_output=True,
                       text=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if p.returncode != 0:
        raise SystemExit(f"design_floor: dnctl bench failed: {p.stderr.strip()[-500:]}")
    out = json.loads(p.stdout)
    if out["config"].get("sync") != "always":
        raise SystemExit(f"design_floor: the cluster in {cluster} runs sync = {out['config'].get('sync')}: the floor "
                         "is of durable writes (dnctl cluster up --sync always)")
    r = out["results"][0]
    if r["errors"]:
        raise SystemExit(f"design_floor: dnctl bench saw errors: {r['first_errors']}")
    n = r["requests"]
    return {"variant": OURS, "writes": n, "p50_ms": r["latency_ms"]["p50"], "p99_ms": r["latency_ms"]["p99"],
            "client_cpu_us": round(r["client_cpu"]["cpu_s"] / n * 1e6, 1),
            "nodes_cpu_us": round(sum(c["cpu_s"] for c in r["node_cpu"].values()) / n * 1e6, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/var/tmp", help="where the replicas' scratch files go (the data disk)")
    ap.add_argument("--rounds", type=int, default=4, help="turns of every variant")
    ap.add_argument("--writes", type=int, default=1500, help="writes per variant per turn")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of: " + ", ".join(VARIANTS))
    ap.add_argument("--cluster", help="a running local cluster (sync = always): dnctl bench on it every turn too")
    ap.add_argument("--seconds", type=float, default=5.0, help="length of each dnctl bench turn (--cluster)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    bad = [v for v in variants if v not in VARIANTS]
    if bad or a.rounds < 1 or a.writes < 10:
        ap.error(f"unknown variant(s) {bad}" if bad else "--rounds >= 1 and --writes >= 10")
    if a.cluster:
        variants.append(OURS)
    runs = []
    for r in range(a.rounds):
        order = variants if r % 2 == 0 else variants[::-1]      # each variant first as often as last
        for v in order:
            x = ours(a.cluster, a.seconds) if v == OURS else one_round(v, a.dir, a.writes)
            runs.append({"round": r, **x})
            if not a.json:
                x = runs[-1]
                print(f"round {r}  {v:<12} p50 {x['p50_ms']:.3f} ms  p99 {x['p99_ms']:.3f} ms  CPU per write: "
                      f"client {x['client_cpu_us']} us, 3 nodes {x['nodes_cpu_us']} us", flush=True)
    summary = {v: {"p50_ms_median": statistics.median(x["p50_ms"] for x in runs if x["variant"] == v),
                   "p99_ms_median": statistics.median(x["p99_ms"] for x in runs if x["variant"] == v)}
               for v in variants}
    if a.json:
        print(json.dumps({"runs": runs, "summary": summary}))
        return
    for v, s in summary.items():
        print(f"{v:<12} medians over {a.rounds} rounds: p50 {s['p50_ms_median']:.3f} ms, "
              f"p99 {s['p99_ms_median']:.3f} ms")


if __name__ == "__main__":
    main()
