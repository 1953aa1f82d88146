"""Durable appends that grow the data file, with the store's one-flush path on and off, side by side.

Three stores (threads: three replicas on the one disk) each make a 1 MiB append durable, ``--appends`` times,
all three at once per append (``floors.store_floor`` with a 1 MiB size: the bytes page-aligned, so written
with O_DIRECT, as from a node's pool block).  A flush of such an append grows the data file: with the
one-flush path (the store option ``one_flush``, on by default) it writes the CRC entries and the slot first
and ends with the data file's fdatasync -- one fdatasync -- else it syncs the data, then the CRC file -- two
(datanode/store/flush.py, "One flush").  Rounds alternate the order (on, off, off, on, ...); the figures are
each append's write+flush time over the three stores, p50 and p99, and the MiB/s of the three together.

    python -m bench.grow_flush_ab --dir /path/on/the/data/disk --rounds 8
"""
from __future__ import annotations

import argparse

from bench.floors import store_floor
from datanode.store import MAX_EXTENT

SIZE = 1 << 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=".", help="where the three scratch stores go (the data disk)")
    ap.add_argument("--rounds", type=int, default=8, help="rounds per variant")
    ap.add_argument("--appends", type=int, default=120, help="1 MiB appends per store and round")
    a = ap.parse_args()
    if not 6 <= a.appends <= MAX_EXTENT // SIZE:
        ap.error(f"--appends must be 6..{MAX_EXTENT // SIZE} (the first 5 are not timed; an extent holds "
                 f"{MAX_EXTENT >> 20} MiB)")
    for r in range(a.rounds):
        for one in ((True, False) if r % 2 == 0 else (False, True)):
            f = store_floor(a.dir, 3, a.appends, one, size=SIZE)
            name = "one fdatasync" if one else "two fdatasyncs"
            print(f"round {r}  {name:15s} {f['mib_s']:7.1f} MiB/s (3 stores)  write+flush p50 {f['p50_ms']:6.2f} ms  "
                  f"p99 {f['p99_ms']:6.2f} ms  one-flushes {f['one_flushes']}", flush=True)


if __name__ == "__main__":
    main()
