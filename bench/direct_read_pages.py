"""How the memory a cold read lands in shapes the disk's requests: 1 MiB O_DIRECT preads of a file, one at a
time, into a buffer of each kind -- a plain ``mmap(-1)`` (shared anonymous, small pages), private anonymous
memory on small pages, and a ``wire/pool.py`` arena (private, on a huge-page boundary, advised
MADV_HUGEPAGE) -- with the disk's own counters around each pass (/proc/diskstats, as
``dnctl bench --cold`` reads them).

    python -m bench.direct_read_pages --dir /tmp [--mib 512] [--rounds 2]

On small pages a 1 MiB buffer is up to 256 physical pieces; a device that takes fewer segments per request
(virtio-blk: /sys/block/DEV/queue/max_segments, 254 on our VMs) splits it in two requests, unless the pages
happen to lie side by side.  Huge pages make the buffer one piece.  The file is written once (urandom,
fdatasync) and dropped from the page cache before each pass; it is removed at the end.
"""
from __future__ import annotations

import argparse
import mmap
import os
import pathlib
import time

from wire.pool import BuddyPool
from wire.transport.base import address_of
from tools.bench import disk_delta, disk_of, disk_sample

MIB = 1 << 20
HUGE = 2 << 20
KINDS = ("shared", "private", "pool")


def buffer(kind: str, nbytes: int):
    """``nbytes`` of memory of ``kind``, every page touched: (a view starting on a 2 MiB boundary, its close).
    ``shared``: ``mmap(-1)``; ``private``: private anonymous memory on small
    pages; ``pool``: a ``BuddyPool``'s arena as the node has it."""
    if kind == "pool":
        pool = BuddyPool(nbytes, MIB)
        pool.arena[::mmap.PAGESIZE] = b"\1" * (nbytes // mmap.PAGESIZE)
        return pool.arena, pool.close
    flags = {} if kind == "shared" else {"flags": mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS}
    m = mmap.mmap(-1, nbytes + HUGE, **flags)
    m[::mmap.PAGESIZE] = b"\1" * (len(m) // mmap.PAGESIZE)
    whole = memoryview(m)
    start = -address_of(whole) % HUGE
    view = whole[start:start + nbytes]

    def close() -> None:
        view.release()
        whole.release()
        m.close()
    return view, close


def one_pass(path: pathlib.Path, disk: str, kind: str, nbytes: int) -> dict:
    view, close = buffer(kind, 32 * MIB)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        a = disk_sample(disk)
        t0 = time.perf_counter()
        for off in range(0, nbytes, MIB):
            at = off % (32 * MIB)
            os.preadv(fd, [view[at:at + MIB]], off)
        dt = time.perf_counter() - t0
        d = disk_delta(a, disk_sample(disk), nbytes) or {}
    finally:
        os.close(fd)
        close()
    return {"kind": kind, "mib_s": round(nbytes / MIB / dt, 1), "requests": d.get("requests"),
            "kib_per_request": d.get("avg_req_kib")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/tmp", help="a directory on the disk to measure")
    ap.add_argument("--mib", type=int, default=512, help="file size")
    ap.add_argument("--rounds", type=int, default=2, help="passes of each kind, interleaved")
    a = ap.parse_args()
    path = pathlib.Path(a.dir) / "direct_read_pages.dat"
    disk = disk_of(pathlib.Path(a.dir))
    if disk is None:
        ap.error(f"{a.dir} is on no block device")
    queue = pathlib.Path(f"/sys/class/block/{disk}").resolve()
    queue = (queue if (queue / "queue").exists() else queue.parent) / "queue"     # a partition: its disk's
    segs = (queue / "max_segments").read_text().strip()
    thp = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
    print(f"disk {disk}: max_segments {segs}; transparent huge pages: {thp}")
    with open(path, "wb") as f:
        for _ in range(a.mib):
            f.write(os.urandom(MIB))
        f.flush()
        os.fdatasync(f.fileno())
    try:
        for _ in range(a.rounds):
            for kind in KINDS:
                r = one_pass(path, disk, kind, a.mib * MIB)
                print(f"{r['kind']:>13}: {r['mib_s']:7.1f} MiB/s  {r['requests']} requests of "
                      f"{r['kib_per_request']} KiB")
    finally:
        path.unlink()


if __name__ == "__main__":
    main()
