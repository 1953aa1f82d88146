"""The fastest a 4 KiB durable 3-replica write can be on this box in this design, with no datanode, and what
each candidate shape of the append path costs: four processes (a client, a leader, two followers) on loopback
TCP doing only what the design must.

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

Those three run at depth 1.  The candidate shapes of a lean append path run at every ``--depths`` and do
every step of an append: each node's loop takes what its socket holds, forwards the whole messages to the
followers in one send each, checks each message's length and CRC32C, pwrites it and its entry, makes the
batch durable with ONE fdatasync (group commit: at depth 16 a batch is several appends), and acks them once
the followers have.  The client keeps ``depth`` appends in flight (blocking sockets, the same for every shape).
The shapes differ only in what runs that loop:

- ``c-threads``: a small C data plane (compiled here by cffi, API mode, SSE4.2 CRC32C where the CPU has it)
  on a thread outside trio, the trio loop idle beside it as the control plane would be;
- ``py-threads``: the same loop in Python with blocking sockets on such a thread (the GIL dropped in every
  system call);
- ``trio-lean``: the same loop in the trio loop itself, a socket call first and a wait only when it would
  block, the flush inline.

``fio`` runs fio's 4 KiB write + fdatasync (psync, a file per job, ``depth`` jobs) on the same disk in the same
turns: a durable 3-replica append on one disk should reach at least 0.8x a third of it.

A node's CPU is counted from the start of its serving loop to its end (user + system, every thread; the fork
and the trio loop's start are left out, as a long-running node pays them once); the user/system split is the
kernel's tick sampling, the sum is exact.  Variants run in turns (``--rounds``, each ``--writes`` writes back
to back, four times as many at depths above 1; the order turns each round), so the box's hour weighs on each
alike, and the summary gives medians of same-round ratios against the first shape.  With ``--cluster DIR`` (a
running ``dnctl cluster up``, ``sync = always``) every turn also runs ``dnctl bench --size 4KiB --depth 1
--mode write`` on it (``--seconds`` each): ours beside the floor, same run.

    python -m bench.design_floor [--dir /var/tmp] [--rounds 4] [--writes 1500] [--depths 1,16]
                                    [--variants c-threads,py-threads,trio-lean,fio,blocking,trio]
                                    [--cluster DIR] [--json]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time

import crc32c
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
        _serving()
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
        _serving()
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


def _cpu(who: int) -> float:
    """User + system seconds (getrusage: finer than os.times' clock ticks); children count once waited for."""
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


_meter = {"user": 0.0, "sys": 0.0}


def _serving() -> None:
    """A node's loop starts here: its CPU is counted from now to its end (not the fork, the trio loop's start or
    a thread's, which a long-running node pays once)."""
    u = resource.getrusage(resource.RUSAGE_SELF)
    _meter.update(user=u.ru_utime, sys=u.ru_stime)


def _child(fn, *args) -> tuple[int, int]:
    """Fork ``fn``; returns its pid and the pipe its CPU while serving comes back on (user, system seconds)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 0
        os.close(r)
        _serving()
        try:
            fn(*args)
            u = resource.getrusage(resource.RUSAGE_SELF)
            os.write(w, struct.pack("<dd", u.ru_utime - _meter["user"], u.ru_stime - _meter["sys"]))
        except BaseException as e:      # noqa: BLE001 -- a child reports and exits; the parent sees the code
            print(f"design_floor: {fn.__name__}: {e!r}", file=sys.stderr)
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    return pid, r


def _reap(children: list[tuple[int, int]]) -> tuple[list[int], list[tuple[float, float]]]:
    """Each child's exit status, and its CPU while serving: (user, system) seconds."""
    codes, cpu = [], []
    for pid, r in children:
        codes.append(os.waitpid(pid, 0)[1])
        got = os.read(r, 16)
        os.close(r)
        cpu.append(struct.unpack("<dd", got) if len(got) == 16 else (float("nan"), float("nan")))
    return codes, cpu


def _kill(children: list[tuple[int, int]]) -> None:
    for pid, r in children:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(r)


def _four_processes(what: str, directory: str, writes: int, leader, follower, arg: str, client,
                    direct: bool = False, lone=None) -> tuple:
    """A leader and two followers forked fresh (``leader(arg, up, downs, copy)``, ``follower(arg, up, back,
    copy)``: ``back`` a socket to the client with ``direct``, else ``lone``) and ``client(leader_socket,
    follower_sockets)`` run here: what the client returns, and every process's CPU per write."""
    cl, ld = loopback_pair()
    to_f = [loopback_pair() for _ in range(2)]
    f_cl = [loopback_pair() for _ in range(2)] if direct else []
    with tempfile.TemporaryDirectory(dir=directory) as d:
        copies = [_Copy(d, f"r{i}") for i in range(3)]
        pids = [_child(leader, arg, ld, [a for a, _ in to_f], copies[0])]
        for i, (_, b) in enumerate(to_f):
            pids.append(_child(follower, arg, b, f_cl[i][0] if direct else lone, copies[i + 1]))
        for s in (ld, *(p for pair in to_f for p in pair), *(a for a, _ in f_cl)):
            s.close()
        t0 = _cpu(resource.RUSAGE_SELF)            # the client's CPU: its writes, not the forks
        try:
            got = client(cl, [b for _, b in f_cl])
        except (OSError, RuntimeError, trio.TooSlowError) as e:
            _kill(pids)
            raise SystemExit(f"design_floor: a {what} round failed: {e!r}") from None
        t1 = _cpu(resource.RUSAGE_SELF)
        _end([cl])
        cl.close()
        for _, b in f_cl:
            b.close()
        codes, use = _reap(pids)                       # the leader's is the first
    if any(codes):
        raise SystemExit(f"design_floor: a {what} process failed (status {codes})")
    return got, {"client_cpu_us": round((t1 - t0) / writes * 1e6, 1),
                 "nodes_cpu_us": round(sum(u + k for u, k in use) / writes * 1e6, 1),
                 "nodes_sys_us": round(sum(k for _, k in use) / writes * 1e6, 1),
                 "leader_cpu_us": round(sum(use[0]) / writes * 1e6, 1)}


def _latency(lat: list[float]) -> dict:
    lat = sorted(lat)
    return {"p50_ms": round(lat[len(lat) // 2] * 1e3, 3), "p99_ms": round(lat[int(len(lat) * 0.99)] * 1e3, 3)}


def one_round(variant: str, directory: str, writes: int) -> dict:
    """``writes`` writes back to back through four fresh processes; latency per write and every process's CPU."""
    lat, cpu = _four_processes(variant, directory, writes, _leader, _follower, variant,
                               lambda cl, fs: _client(variant, cl, fs, writes), direct=variant == "trio-direct")
    return {"variant": variant, "writes": writes, **_latency(lat), **cpu}


# ---- the candidate shapes of the lean append path: one loop per node, any depth, every step of an append ----

DEPTH_MAX = 64                    # messages one receive can hold: the client keeps at most this many in flight
MSG = HDR + SIZE
LEN_AT = 16                       # the header's payload length (u32) and CRC32C (u32) sit here
SHAPES = ("c-threads", "py-threads", "trio-lean")
FIO = "fio"

_C_DEFS = """
uint32_t floor_crc32c(const uint8_t *p, size_t n);
long floor_node(int up, int *downs, int ndowns, int fd, uint8_t *buf, size_t cap);
"""

_C_SRC = r"""
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>
#include <sys/socket.h>
#if defined(__SSE4_2__)
#include <nmmintrin.h>
#endif
#define HDR %(HDR)d
#define SIZE %(SIZE)d
#define MSG (HDR + SIZE)
#define ACK %(ACK)d
#define SPAN %(SPAN)dULL
#define DEPTH_MAX %(DEPTH_MAX)d
#define LEN_AT %(LEN_AT)d

#if !defined(__SSE4_2__)
static uint32_t table[256];
#endif

uint32_t floor_crc32c(const uint8_t *p, size_t n) {
    uint64_t c = 0xffffffffu;
#if defined(__SSE4_2__)
    for (; n >= 8; p += 8, n -= 8) { uint64_t v; memcpy(&v, p, 8); c = _mm_crc32_u64(c, v); }
    for (; n; p++, n--) c = _mm_crc32_u8((uint32_t)c, *p);
#else
    if (!table[1])
        for (uint32_t i = 0; i < 256; i++) {
            uint32_t x = i;
            for (int k = 0; k < 8; k++) x = (x >> 1) ^ (0x82f63b78u & -(x & 1u));
            table[i] = x;
        }
    for (; n; p++, n--) c = table[(c ^ *p) & 0xff] ^ (c >> 8);
#endif
    return (uint32_t)c ^ 0xffffffffu;
}

static int send_all(int fd, const uint8_t *p, size_t n) {
    while (n) {
        ssize_t r = send(fd, p, n, MSG_NOSIGNAL);
        if (r < 0) { if (errno == EINTR) continue; return -1; }
        p += r; n -= (size_t)r;
    }
    return 0;
}

static int recv_exact(int fd, uint8_t *p, size_t n) {
    while (n) {
        ssize_t r = recv(fd, p, n, 0);
        if (r == 0) return -1;
        if (r < 0) { if (errno == EINTR) continue; return -1; }
        p += r; n -= (size_t)r;
    }
    return 0;
}

/* One node's data plane: every receive takes what the socket holds; its whole messages are forwarded to the
   followers (one send each), checked (length, CRC32C), pwritten with their entries, made durable by ONE
   fdatasync, and acked once every follower has acked them.  Returns the appends done, or < 0 on an error. */
long floor_node(int up, int *downs, int ndowns, int fd, uint8_t *buf, size_t cap) {
    static const uint8_t acks[ACK * DEPTH_MAX];
    uint8_t facks[ACK * DEPTH_MAX];
    size_t have = 0;
    long n = 0;
    if (cap < MSG) return -10;
    for (;;) {
        ssize_t r = recv(up, buf + have, cap - have, 0);
        if (r == 0) break;
        if (r < 0) { if (errno == EINTR) continue; return -1; }
        have += (size_t)r;
        size_t k = have / MSG;
        if (!k) continue;
        for (int i = 0; i < ndowns; i++)
            if (send_all(downs[i], buf, k * MSG)) return -2;
        for (size_t j = 0; j < k; j++) {
            const uint8_t *m = buf + j * MSG;
            uint32_t len, crc;
            memcpy(&len, m + LEN_AT, 4);
            memcpy(&crc, m + LEN_AT + 4, 4);
            if (len != SIZE) return -3;
            if (floor_crc32c(m + HDR, len) != crc) return -4;
            uint64_t pos = ((uint64_t)n * SIZE) %% SPAN, e = (uint64_t)n;
            if (pwrite(fd, m + HDR, SIZE, (off_t)pos) != SIZE) return -5;
            if (pwrite(fd, &e, 8, (off_t)(SPAN + pos / SIZE * 8)) != 8) return -5;
            n++;
        }
        if (fdatasync(fd)) return -6;
        for (int i = 0; i < ndowns; i++)
            if (recv_exact(downs[i], facks, k * ACK)) return -7;
        if (send_all(up, acks, k * ACK)) return -8;
        have -= k * MSG;
        memmove(buf, buf + k * MSG, have);
    }
    for (int i = 0; i < ndowns; i++) shutdown(downs[i], SHUT_WR);
    return n;
}
"""


def build_c(build_dir: str):
    """The C data plane, compiled by cffi (API mode) into ``build_dir``: what the datanode would build at install."""
    import cffi
    ffi = cffi.FFI()
    ffi.cdef(_C_DEFS)
    flags = ["-O2"]
    with open("/proc/cpuinfo") as f:
        if " sse4_2" in f.read():
            flags.append("-msse4.2")
    consts = {"HDR": HDR, "SIZE": SIZE, "ACK": ACK, "SPAN": SPAN, "DEPTH_MAX": DEPTH_MAX, "LEN_AT": LEN_AT}
    ffi.set_source("_design_floor_c", _C_SRC % consts, extra_compile_args=flags)
    ffi.compile(tmpdir=build_dir, verbose=False)
    sys.path.insert(0, build_dir)
    import _design_floor_c
    sys.path.remove(build_dir)
    payload = os.urandom(SIZE)
    if _design_floor_c.lib.floor_crc32c(payload, SIZE) != crc32c.crc32c(payload):
        raise SystemExit("design_floor: the C CRC32C disagrees with the crc32c package")
    return _design_floor_c


_C = None              # the built module, set by main() before any process forks when a C shape runs
_ACKS = bytes(ACK * DEPTH_MAX)


def _check_and_store(copy: _Copy, m: memoryview) -> None:
    length, crc = struct.unpack_from("<II", m, LEN_AT)
    payload = m[HDR:HDR + SIZE]
    if length != SIZE or crc32c.crc32c(payload) != crc:
        raise RuntimeError("a message failed its length or CRC32C check")
    pos = (copy.n * SIZE) % SPAN
    os.pwrite(copy.fd, payload, pos)
    os.pwrite(copy.fd, struct.pack("<Q", copy.n), ENTRIES + (pos // SIZE) * 8)
    copy.n += 1


def _node_py(up: socket.socket, downs: list[socket.socket], copy: _Copy) -> None:
    """floor_node's loop in Python with blocking sockets (the GIL is released in every system call)."""
    buf = bytearray(DEPTH_MAX * MSG)
    mv = memoryview(buf)
    facks = memoryview(bytearray(ACK * DEPTH_MAX))
    have = 0
    _serving()
    while True:
        r = up.recv_into(mv[have:])
        if r == 0:
            break
        have += r
        k = have // MSG
        if not k:
            continue
        for d in downs:
            d.sendall(mv[:k * MSG])
        for j in range(k):
            _check_and_store(copy, mv[j * MSG:(j + 1) * MSG])
        os.fdatasync(copy.fd)
        for d in downs:
            _ack_or_fail(_recv_exact_blocking(d, facks[:k * ACK]))
        up.sendall(_ACKS[:k * ACK])
        have -= k * MSG
        mv[:have] = buf[k * MSG:k * MSG + have]
    _end(downs)


async def _send_all_trio(s: socket.socket, data: memoryview) -> None:
    while data:
        try:
            data = data[s.send(data):]
        except BlockingIOError:
            await trio.lowlevel.wait_writable(s)


async def _node_trio(up: socket.socket, downs: list[socket.socket], copy: _Copy) -> None:
    """The same loop in trio with the fewest checkpoints: a socket call first, a wait only when it would block,
    the flush inline in the loop."""
    buf = bytearray(DEPTH_MAX * MSG)
    mv = memoryview(buf)
    facks = memoryview(bytearray(ACK * DEPTH_MAX))
    have = 0
    for s in (up, *downs):
        s.setblocking(False)
    _serving()
    while True:
        try:
            r = up.recv_into(mv[have:])
        except BlockingIOError:
            await trio.lowlevel.wait_readable(up)
            continue
        if r == 0:
            break
        have += r
        k = have // MSG
        if not k:
            continue
        for d in downs:
            await _send_all_trio(d, mv[:k * MSG])
        for j in range(k):
            _check_and_store(copy, mv[j * MSG:(j + 1) * MSG])
        os.fdatasync(copy.fd)
        for d in downs:
            _ack_or_fail(await _recv_exact_trio(d, facks[:k * ACK]))
        await _send_all_trio(up, memoryview(_ACKS)[:k * ACK])
        have -= k * MSG
        mv[:have] = buf[k * MSG:k * MSG + have]
    _end(downs)


def _node(shape: str, up: socket.socket, downs: list[socket.socket], copy: _Copy) -> None:
    """One node process: trio is its control plane; the data plane runs on a thread outside trio (c-threads,
    py-threads) or in the trio loop itself (trio-lean)."""
    if shape == "trio-lean":
        trio.run(_node_trio, up, downs, copy)
        return
    if shape == "py-threads":
        def plane():
            _node_py(up, downs, copy)
    else:
        ffi, lib = _C.ffi, _C.lib
        buf = ffi.new("uint8_t[]", DEPTH_MAX * MSG)
        fds = ffi.new("int[]", [d.fileno() for d in downs] or [0])

        def plane():
            _serving()
            n = lib.floor_node(up.fileno(), fds, len(downs), copy.fd, buf, DEPTH_MAX * MSG)
            if n < 0:
                raise RuntimeError(f"the C data plane failed at step {-n}: {ffi.errno}")

    async def control():
        await trio.to_thread.run_sync(plane)
    trio.run(control)


def _client_pipelined(leader: socket.socket, writes: int, depth: int) -> tuple[list[float], float]:
    """``writes`` appends, ``depth`` in flight, each sent on its own: latency per append and the wall time."""
    payload = os.urandom(SIZE)
    hdr = bytearray(HDR)
    struct.pack_into("<II", hdr, LEN_AT, SIZE, crc32c.crc32c(payload))
    msg = bytes(hdr) + payload
    acks = memoryview(bytearray(ACK * DEPTH_MAX))
    leader.settimeout(WAIT_S)
    sent_at: collections.deque[float] = collections.deque()
    lat: list[float] = []
    got = 0
    t0 = time.perf_counter()
    for _ in range(min(depth, writes)):
        sent_at.append(time.perf_counter())
        leader.sendall(msg)
    sent = len(sent_at)
    while len(lat) < writes:
        n = leader.recv_into(acks)
        if n == 0:
            raise RuntimeError("the leader closed its connection before acking")
        got += n
        now = time.perf_counter()
        while got >= ACK:
            got -= ACK
            lat.append(now - sent_at.popleft())
            if sent < writes:
                sent_at.append(time.perf_counter())
                leader.sendall(msg)
                sent += 1
    return lat, time.perf_counter() - t0


def shape_round(shape: str, directory: str, writes: int, depth: int) -> dict:
    """One shape at one depth through four fresh processes: latency, appends/s, every process's CPU."""
    (lat, wall), cpu = _four_processes(f"{shape} (depth {depth})", directory, writes, _node, _node, shape,
                                       lambda cl, _: _client_pipelined(cl, writes, depth), lone=[])  # no downs
    return {"variant": shape, "depth": depth, "writes": writes, "per_s": round(writes / wall), **_latency(lat),
            **cpu}


def fio_round(directory: str, depth: int, seconds: float) -> dict:
    """fio's 4 KiB write + fdatasync with ``depth`` jobs, a file each (psync), on the replicas' disk."""
    with tempfile.TemporaryDirectory(dir=directory) as d:
        cmd = ["fio", "--name=w4k_dsync", f"--directory={d}", "--rw=write", "--bs=4k", "--size=8M",
               "--fdatasync=1", "--ioengine=psync", f"--numjobs={depth}", "--time_based",
               f"--runtime={seconds}", "--group_reporting", "--output-format=json"]
        c0 = _cpu(resource.RUSAGE_CHILDREN)
        p = subprocess.run(cmd, capture_output=True, text=True, check=False)
        c1 = _cpu(resource.RUSAGE_CHILDREN)
    if p.returncode != 0:
        raise SystemExit(f"design_floor: fio failed: {p.stderr.strip()[-500:]}")
    job = json.loads(p.stdout[p.stdout.index("{"):])["jobs"][0]
    ops = job["write"]["total_ios"]
    cpu = c1 - c0
    return {"variant": FIO, "depth": depth, "writes": ops, "per_s": round(job["write"]["iops"]),
            "p50_ms": None, "p99_ms": None, "client_cpu_us": round(cpu / max(ops, 1) * 1e6, 1), "nodes_cpu_us": None}


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


def _ratios(runs: list[dict], key: str, ref) -> dict:
    """Per (variant, depth): the median over rounds of ``key`` over ``ref(round, depth)``'s, same round."""
    out: dict = {}
    for x in runs:
        base = ref(x["round"], x["depth"])
        if x.get(key) and base:
            out.setdefault((x["variant"], x["depth"]), []).append(x[key] / base)
    return {k: round(statistics.median(v), 2) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/var/tmp", help="where the replicas' scratch files go (the data disk)")
    ap.add_argument("--rounds", type=int, default=4, help="turns of every variant")
    ap.add_argument("--writes", type=int, default=1500, help="writes per variant per turn (x4 at depths > 1)")
    ap.add_argument("--variants", default=",".join((*SHAPES, FIO, "blocking", "trio")),
                    help="comma-separated, of: " + ", ".join((*VARIANTS, *SHAPES, FIO)))
    ap.add_argument("--depths", default="1,16", help="appends in flight, comma-separated (the shapes and fio; "
                    f"{', '.join(VARIANTS)} run at depth 1 only)")
    ap.add_argument("--fio-seconds", type=float, default=3.0, help="length of each fio turn")
    ap.add_argument("--cluster", help="a running local cluster (sync = always): dnctl bench on it every turn too")
    ap.add_argument("--seconds", type=float, default=5.0, help="length of each dnctl bench turn (--cluster)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    bad = [v for v in variants if v not in (*VARIANTS, *SHAPES, FIO)]
    try:
        depths = [int(d) for d in a.depths.split(",")]
    except ValueError:
        ap.error("--depths takes numbers, e.g. 1,16")
    if bad or a.rounds < 1 or a.writes < 10 or not all(1 <= d <= DEPTH_MAX for d in depths):
        ap.error(f"unknown variant(s) {bad}" if bad else f"--rounds >= 1, --writes >= 10, 1 <= depth <= {DEPTH_MAX}")
    if a.cluster:
        variants.append(OURS)
    turns = [(v, d) for v in variants for d in ((1,) if v in VARIANTS or v == OURS else depths)]
    global _C
    build = tempfile.TemporaryDirectory(prefix="design-floor-c-")
    if "c-threads" in variants:
        _C = build_c(build.name)
    runs = []
    for r in range(a.rounds):
        for v, depth in (turns if r % 2 == 0 else turns[::-1]):     # each turn first as often as last
            if v == OURS:
                x = {**ours(a.cluster, a.seconds), "depth": 1}
            elif v == FIO:
                x = fio_round(a.dir, depth, a.fio_seconds)
            elif v in SHAPES:
                x = shape_round(v, a.dir, a.writes * (4 if depth > 1 else 1), depth)
            else:
                x = {**one_round(v, a.dir, a.writes), "depth": 1}
            runs.append({"round": r, **x})
            if not a.json:
                print(f"round {r}  {v:<12} depth {depth:<3} {_line(x)}", flush=True)
    build.cleanup()
    first = next((v for v in variants if v in SHAPES), None)

    def pick(v, key):
        return lambda r, d: next((x[key] for x in runs if x["round"] == r and x["depth"] == d
                                  and x["variant"] == v), None)
    cpu_vs = _ratios(runs, "nodes_cpu_us", pick(first, "nodes_cpu_us")) if first else {}
    p50_vs = _ratios(runs, "p50_ms", pick(first, "p50_ms")) if first else {}
    fio_third = pick(FIO, "per_s")
    rate_vs_fio = _ratios(runs, "per_s", lambda r, d: (fio_third(r, d) or 0) / 3) if FIO in variants else {}
    summary = []
    for v, d in turns:
        xs = [x for x in runs if x["variant"] == v and x["depth"] == d]

        def med(key, xs=xs):
            got = [x[key] for x in xs if x.get(key) is not None]
            return statistics.median(got) if got else None
        summary.append({"variant": v, "depth": d, "nodes_cpu_us": med("nodes_cpu_us"),
                        "nodes_sys_us": med("nodes_sys_us"), "leader_cpu_us": med("leader_cpu_us"),
                        "client_cpu_us": med("client_cpu_us"), "p50_ms": med("p50_ms"), "p99_ms": med("p99_ms"),
                        "per_s": med("per_s"), f"nodes_cpu_vs_{first}": cpu_vs.get((v, d)),
                        f"p50_vs_{first}": p50_vs.get((v, d)), "per_s_vs_fio_over_3": rate_vs_fio.get((v, d))})
    if a.json:
        depth1 = {s["variant"]: {"p50_ms_median": s["p50_ms"], "p99_ms_median": s["p99_ms"]}
                  for s in summary if s["depth"] == 1}          # by variant, as bench/targets.py reads it
        print(json.dumps({"runs": runs, "summary": depth1, "table": summary}))
        return
    print(f"medians over {a.rounds} rounds (ratios: medians of same-round ratios)")
    for s in summary:
        print(f"{s['variant']:<12} depth {s['depth']:<3} " + "  ".join(
            f"{k} {val}" for k, val in s.items() if k not in ("variant", "depth") and val is not None))


def _line(x: dict) -> str:
    cpu = ""
    if x.get("nodes_cpu_us") is not None:
        cpu = (f"3 nodes {x['nodes_cpu_us']} us ({x['nodes_sys_us']} in the kernel), "
               f"leader {x['leader_cpu_us']} us, ")
    lat = f"p50 {x['p50_ms']:.3f} ms  p99 {x['p99_ms']:.3f} ms  " if x.get("p50_ms") is not None else ""
    rate = f"{x['per_s']}/s  " if x.get("per_s") is not None else ""
    return f"{rate}{lat}CPU per write: {cpu}client {x['client_cpu_us']} us"


if __name__ == "__main__":
    main()
