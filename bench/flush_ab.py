"""The store's one-flush sequence at the syscall level, two orders side by side (no datanode, no store: its
``sync_file_range`` call only).

Three "replicas" (threads, each a data file and a CRC file on the one disk) make a 4 KiB append durable at
once, as the store's one-flush path does (datanode/store/flush.py, "One flush"), in one of two orders:

  serial   sync_file_range(data, WAIT_BEFORE|WRITE|WAIT_AFTER), then fdatasync(crc) -- the data lands before
           the CRC file's write is even sent
  overlap  sync_file_range(data, WAIT_BEFORE|WRITE), sync_file_range(crc, WAIT_BEFORE|WRITE),
           sync_file_range(data, WAIT_AFTER), fdatasync(crc) -- both writes in flight together (the store now)

Rounds alternate (serial, overlap, overlap, serial, ...), 50 flushes each; the figure is the slowest of the
three per flush (what a 3-replica write waits for): p50/p90/p99.

    python -m bench.flush_ab --dir /path/on/the/data/disk --rounds 20
"""
from __future__ import annotations

import argparse
import os
import threading
import time

from datanode.store.files import SFR_START, SFR_WAIT, sync_range  # (the store's own sync_file_range)

ORDERS = {"serial": ((SFR_START | SFR_WAIT, "data"),),
          "overlap": ((SFR_START, "data"), (SFR_START, "crc"), (SFR_WAIT, "data"))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=".", help="where the six scratch files go (the data disk)")
    ap.add_argument("--rounds", type=int, default=20, help="rounds of 50 flushes per order")
    a = ap.parse_args()
    span = 64 << 20
    paths, replicas = [], []
    for i in range(3):
        fds = []
        for kind, size in (("data", span), ("crc", 1 << 20)):
            path = os.path.join(a.dir, f".flush_ab.{kind}{i}")
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            os.pwrite(fd, bytes(size), 0)        # zeros written ahead and durable, as the store's prefill
            os.fsync(fd)
            paths.append(path)
            fds.append(fd)
        replicas.append({"data": fds[0], "crc": fds[1], "off": 0})
    payload = os.urandom(4096)

    def flush(r: dict, order) -> None:
        off = r["off"]
        os.pwrite(r["data"], payload, off)
        os.pwrite(r["crc"], payload[:8], (off // 4096 * 8) % (1 << 20))
        for flags, kind in order:
            sync_range(r[kind], off if kind == "data" else 0, 4096 if kind == "data" else 0, flags)
        os.fdatasync(r["crc"])
        r["off"] = (off + 4096) % span

    took: dict[str, list[float]] = {name: [] for name in ORDERS}
    try:
        for rnd in range(a.rounds):
            for name in (list(ORDERS) if rnd % 2 == 0 else list(ORDERS)[::-1]):
                for _ in range(50):
                    start, times = threading.Barrier(3), []

                    def one(r):
                        start.wait()
                        t = time.perf_counter()
                        flush(r, ORDERS[name])
                        times.append(time.perf_counter() - t)
                    threads = [threading.Thread(target=one, args=(r,)) for r in replicas]
                    for t in threads:
                        t.start()
                    for t in threads:
                        t.join()
                    took[name].append(max(times) * 1e3)
    finally:
        for r in replicas:
            os.close(r["data"])
            os.close(r["crc"])
        for p in paths:
            os.unlink(p)
    for name, v in took.items():
        v.sort()
        print(f"{name:8} 3 replicas at once, slowest per flush: p50 {v[len(v) // 2]:.3f} p90 {v[int(len(v) * .9)]:.3f} "
              f"p99 {v[int(len(v) * .99)]:.3f} ms ({len(v)} flushes)")


if __name__ == "__main__":
    main()
