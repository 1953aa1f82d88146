"""The floors of a replicated write on this box, with no datanode at all: what the bytes' journey costs in
CPU, and how long the replicas' flushes take when they share the one disk.

**CPU** (``journey``).  One 3-replica write of N bytes moves them, at the least: client -> leader over TCP, leader -> each of two
followers over TCP (every hop a send and a receive, on loopback both in this kernel), three page-cache
writes (one per replica), and a CRC32C over the bytes at the client and at every replica (each checks what
it received).  This runs exactly those system calls and CRCs, in one process, on real loopback TCP sockets
and real files beside the data directory, and reports the CPU seconds per GB they cost (user + system, this
process).  Divided into the cores of the box, that is the most any implementation of this design can move
on one machine -- the baseline for the "1 MiB buffered, depth 8" row, next to ``dnctl bench``.

**Latency** (``flush``).  Under ``sync = always`` each replica makes an append durable the way the store
does (datanode/store/flush.py): pwrite the data, fdatasync it, pwrite the block's CRC entry, fdatasync that.  Our
three replicas share one disk, so at depth 1 the three flushes of one write run at once and queue in the
file system's journal.  This times that sequence for one file alone and for three at once (threads, started
together per round): the floor under the "4 KiB durable, 3 replicas, depth 1" row's p50.  Twice: on files
that grow with every append (each fdatasync also commits the journal for the new size), and on files
zero-filled ahead as the store now does for small durable appends (``PREFILL``: data-only fdatasyncs).
A third time with ONE fdatasync per append (the entry written into the data file itself, zeros ahead): the
floor of a layout that makes an append durable with a single device flush.  Then the store itself
(``ExtentStore.write``, three stores at once, one thread each), with its one-flush path (sync_file_range of
the data, one fdatasync of the CRC file: the store's "One flush") and without it (two fdatasyncs),
alternating, ``--store-reps`` times each: what that path buys on this disk, the Python around it included.

    python -m bench.floors [--dir /var/tmp] [--mib 1024] [--size-kib 1024] [--rounds 300] [--json]
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import socket
import tempfile
import threading
import time

from wire.crc import crc32c

BUF = 4 << 20


def loopback_pair() -> tuple[socket.socket, socket.socket]:
    """A connected loopback TCP pair, tuned as the datanode tunes its sockets (no Nagle, 4 MiB buffers)."""
    lst = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(lst.getsockname())
    b, _ = lst.accept()
    lst.close()
    for s in (a, b):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, BUF)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, BUF)
    return a, b


def _hop(tx: socket.socket, rx: socket.socket, data: memoryview, into: memoryview) -> None:
    """Send ``data`` on tx while receiving it on rx (a thread receives, as the peer process would)."""
    def recv():
        got = 0
        while got < len(into):
            got += rx.recv_into(into[got:])
    t = threading.Thread(target=recv)
    t.start()
    tx.sendall(data)
    t.join()


def run(directory: str, mib: int, size: int) -> dict:
    """The CPU floor (``journey``)."""
    payload = memoryview(bytearray(os.urandom(size)))
    leader_buf, f1_buf, f2_buf = (memoryview(bytearray(size)) for _ in range(3))
    hops = [loopback_pair() for _ in range(3)]
    with tempfile.TemporaryDirectory(dir=directory) as d:
        fds = [os.open(os.path.join(d, f"r{i}.dat"), os.O_RDWR | os.O_CREAT, 0o600) for i in range(3)]
        n = (mib << 20) // size
        # touch the files' page cache once at the start is part of what is measured (as in a bench)
        t0, c0 = time.monotonic(), os.times()
        for i in range(n):
            off = i * size
            crc32c(payload)                                     # client: the header's CRC
            _hop(*hops[0], payload, leader_buf)                 # client -> leader
            crc32c(leader_buf)                                  # leader checks it
            os.pwrite(fds[0], leader_buf, off)
            _hop(*hops[1], leader_buf, f1_buf)                  # leader -> follower 1
            _hop(*hops[2], leader_buf, f2_buf)                  # leader -> follower 2
            for buf, fd in ((f1_buf, fds[1]), (f2_buf, fds[2])):
                crc32c(buf)
                os.pwrite(fd, buf, off)
        c1, t1 = os.times(), time.monotonic()
        for fd in fds:
            os.close(fd)
    for a, b in hops:
        a.close()
        b.close()
    cpu = (c1.user - c0.user) + (c1.system - c0.system)
    gb = n * size / 1e9
    cores = os.cpu_count() or 1
    return {"bytes": n * size, "size": size, "cpu_s": round(cpu, 3), "user_s": round(c1.user - c0.user, 3),
            "system_s": round(c1.system - c0.system, 3), "wall_s": round(t1 - t0, 3),
            "cpu_s_per_gb": round(cpu / gb, 2), "cores": cores,
            "ceiling_mib_s": round(cores * (n * size / cpu) / (1 << 20), 1) if cpu else None}


def _p50_p99(lat: list[float]) -> dict:
    """Median and 99th percentile of sorted latencies (seconds), in ms."""
    return {"p50_ms": round(lat[len(lat) // 2] * 1e3, 3),
            "p99_ms": round(lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e3, 3)}


def flush_floor(directory: str, replicas: int, rounds: int, prefilled: bool, single: bool = False) -> dict:
    """Per round, ``replicas`` threads each append 4 KiB to their own extent-like file as the store does
    under sync=always; the round's time is the slowest one's (a write waits for every replica).
    ``prefilled``: the files hold zeros (synced) where the appends land, so no flush changes their size.
    ``single``: the entry goes into the data file, past the appends, and one fdatasync covers both."""
    buf = os.urandom(4096)
    lat: list[float] = []
    with tempfile.TemporaryDirectory(dir=directory) as d:
        files = [(os.open(os.path.join(d, f"r{i}.dat"), os.O_RDWR | os.O_CREAT, 0o600),
                  os.open(os.path.join(d, f"r{i}.crc"), os.O_RDWR | os.O_CREAT, 0o600)) for i in range(replicas)]
        if prefilled:
            for dat, crc in files:
                os.pwrite(dat, bytes(rounds * 4096 + 4096), 0)
                os.pwrite(crc, bytes(4096), 0)
                os.fsync(dat)
                os.fsync(crc)
        go = threading.Barrier(replicas + 1)
        done = threading.Barrier(replicas + 1)

        def replica(i: int) -> None:
            dat, crc = files[i]
            for j in range(rounds):
                go.wait()
                os.pwrite(dat, buf, j * 4096)
                if single:
                    os.pwrite(dat, b"\0" * 8, rounds * 4096 + (j // 32) * 8)
                    os.fdatasync(dat)
                    done.wait()
                    continue
                os.fdatasync(dat)
                os.pwrite(crc, b"\0" * 8, (j // 32) * 8)   # a 128 KiB block's entry: rewritten in place
                os.fdatasync(crc)
                done.wait()

        threads = [threading.Thread(target=replica, args=(i,)) for i in range(replicas)]
        for t in threads:
            t.start()
        for _ in range(rounds):
            t0 = time.perf_counter()
            go.wait()
            done.wait()
            lat.append(time.perf_counter() - t0)
        for t in threads:
            t.join()
        for dat, crc in files:
            os.close(dat)
            os.close(crc)
    lat.sort()
    return {"replicas": replicas, "prefilled": prefilled, "single": single, "rounds": rounds, **_p50_p99(lat)}


def store_floor(directory: str, replicas: int, rounds: int, one_flush: bool, size: int = 4096) -> dict:
    """Per round, ``replicas`` threads each make a ``size``-byte append durable with their own ExtentStore
    (sync=always), started together; latency per append (each replica's own).  The bytes sit in a page-aligned
    buffer, so an append of at least DIRECT_MIN goes with O_DIRECT, as one from a node's pool block does."""
    from datanode.store import ExtentStore, StoreOptions
    data = memoryview(mmap.mmap(-1, size))
    data[:] = os.urandom(size)
    lat: list[float] = []
    ones = 0
    with tempfile.TemporaryDirectory(dir=directory) as d:
        opts = StoreOptions(one_flush=one_flush)
        stores = [ExtentStore(os.path.join(d, f"s{i}"), sync="always", options=opts) for i in range(replicas)]
        try:
            eids = [s.create_extent() for s in stores]
            go = threading.Barrier(replicas)
            mine: list[list[float]] = [[] for _ in range(replicas)]

            def replica(i: int) -> None:
                for j in range(rounds):
                    go.wait()
                    t0 = time.perf_counter()
                    stores[i].write(eids[i], j * size, data)
                    mine[i].append(time.perf_counter() - t0)

            threads = [threading.Thread(target=replica, args=(i,)) for i in range(replicas)]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            elapsed = time.perf_counter() - t0
            lat = sorted(x for m in mine for x in m[5:])        # the first appends create the files' zeros
            ones = sum(s.one_flushes for s in stores)
        finally:
            for s in stores:
                s.close()
    if len(lat) != replicas * (rounds - 5):
        raise SystemExit("a store thread failed (see above)")
    return {"replicas": replicas, "one_flush": one_flush, "rounds": rounds, "size": size, "one_flushes": ones,
            "mib_s": round(replicas * rounds * size / elapsed / (1 << 20), 1), **_p50_p99(lat)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/var/tmp", help="where the three scratch files go (the data disk)")
    ap.add_argument("--mib", type=int, default=1024, help="MiB per replica to move")
    ap.add_argument("--size-kib", type=int, default=1024, help="bytes per write, KiB")
    ap.add_argument("--rounds", type=int, default=300, help="flush rounds per measurement")
    ap.add_argument("--store-reps", type=int, default=4, help="alternations of the store's flush with/without one flush")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    r = {"journey": run(a.dir, a.mib, a.size_kib << 10),
         "flush": [flush_floor(a.dir, k, a.rounds, p) for p in (False, True) for k in (1, 3)]
         + [flush_floor(a.dir, k, a.rounds, True, single=True) for k in (1, 3)],
         "store": [store_floor(a.dir, 3, a.rounds, one) for _ in range(a.store_reps) for one in (False, True)]}
    if a.json:
        print(json.dumps(r))
        return
    j = r["journey"]
    print(f"CPU: 3-replica byte journey, {j['size'] >> 10} KiB writes, {j['bytes'] >> 20} MiB: {j['cpu_s_per_gb']} "
          f"CPU-s/GB (user {j['user_s']} s, system {j['system_s']} s); on {j['cores']} cores at most "
          f"{j['ceiling_mib_s']} MiB/s of replicated writes")
    for f in r["flush"]:
        how = ("with ONE fdatasync (data and entry in one file, into zeros written ahead; not the store's layout)"
               if f["single"] else "as the store does (into zeros written ahead)" if f["prefilled"]
               else "as the store does (growing the file)")
        print(f"flush: 4 KiB append made durable {how}, {f['replicas']} replica(s) on this disk at "
              f"once: p50 {f['p50_ms']} ms, p99 {f['p99_ms']} ms ({f['rounds']} rounds)")
    for one in (False, True):
        runs = [f for f in r["store"] if f["one_flush"] == one]
        p50s = sorted(f["p50_ms"] for f in runs)
        p99s = sorted(f["p99_ms"] for f in runs)
        print(f"store: ExtentStore.write 4 KiB durable, 3 stores at once, {'ONE fdatasync' if one else 'two fdatasyncs'}"
              f" ({sum(f['one_flushes'] for f in runs)} one-flushes): p50 {' '.join(map(str, p50s))} ms, "
              f"p99 {' '.join(map(str, p99s))} ms ({len(runs)} runs of {a.rounds}, sorted)")


if __name__ == "__main__":
    main()
