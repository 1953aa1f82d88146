"""Durable appends that grow the data file, with the store's one-flush path on and off, side by side.

Three stores (threads: three replicas on the one disk) each append 1 MiB from an aligned buffer (so
O_DIRECT, as a node's pool block is) and flush it, ``--appends`` times, all three at once.  A flush of
such an append grows the data file: with the one-flush path (``one_flush=True``, the default) it writes the
CRC entries and the slot first and ends with the data file's fdatasync -- one fdatasync -- else it syncs
the data, then the CRC file -- two (datanode/store.py, "One flush").  Rounds alternate the order (on, off,
off, on, ...); the figure is each append's write+flush time over the three stores: p50 and p99, and the
MiB/s of the three together.

    python bench/grow_flush_ab.py --dir /path/on/the/data/disk --rounds 8
"""
from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from datanode.store import MAX_EXTENT, ExtentStore  # noqa: E402

SIZE = 1 << 20


def one_round(base: str, one_flush: bool, appends: int) -> tuple[float, float, float, int]:
    roots = [os.path.join(base, f"grow-{'one' if one_flush else 'two'}-{i}") for i in range(3)]
    for r in roots:
        shutil.rmtree(r, ignore_errors=True)
    stores = [ExtentStore(r, sync="always", one_flush=one_flush) for r in roots]
    times: list[list[float]] = [[] for _ in stores]
    start = threading.Barrier(len(stores) + 1)

    def replica(i: int) -> None:
        buf = memoryview(mmap.mmap(-1, SIZE))        # page-aligned: the store writes it with O_DIRECT
        buf[:] = os.urandom(SIZE)
        s = stores[i]
        eid = s.create_extent()
        s.write(eid, 0, buf)                          # the first flush after create: two fdatasyncs either way
        start.wait()
        for k in range(1, appends + 1):
            t = time.perf_counter()
            s.append(eid, k * SIZE, buf)
            if s.flush([eid]):
                raise SystemExit(f"flush failed in {roots[i]}")
            times[i].append(time.perf_counter() - t)

    threads = [threading.Thread(target=replica, args=(i,)) for i in range(len(stores))]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    ones = sum(s.one_flushes for s in stores)
    for s in stores:
        s.close()
    for r in roots:
        shutil.rmtree(r, ignore_errors=True)
    flat = sorted(x for ts in times for x in ts)
    if len(flat) != len(stores) * appends:
        raise SystemExit("a replica thread failed (see above)")
    p50, p99 = statistics.median(flat) * 1e3, flat[int(len(flat) * 0.99)] * 1e3
    return len(flat) * SIZE / elapsed / (1 << 20), p50, p99, ones


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=".", help="where the three scratch stores go (the data disk)")
    ap.add_argument("--rounds", type=int, default=8, help="rounds per variant")
    ap.add_argument("--appends", type=int, default=120, help="1 MiB appends per store and round")
    a = ap.parse_args()
    if not 1 <= a.appends < MAX_EXTENT // SIZE:
        ap.error(f"--appends must be 1..{MAX_EXTENT // SIZE - 1} (an extent holds {MAX_EXTENT >> 20} MiB)")
    for r in range(a.rounds):
        for one in ((True, False) if r % 2 == 0 else (False, True)):
            mibs, p50, p99, ones = one_round(a.dir, one, a.appends)
            name = "one fdatasync" if one else "two fdatasyncs"
            print(f"round {r}  {name:15s} {mibs:7.1f} MiB/s (3 stores)  write+flush p50 {p50:6.2f} ms  "
                  f"p99 {p99:6.2f} ms  one-flushes {ones}", flush=True)


if __name__ == "__main__":
    main()
