"""What group commit can do across many files on this disk: 4 KiB durable writes to N files, made durable
four ways.

- ``fdatasync-each``: N threads, one per file, each a pwrite then its own fdatasync (the kernel's unit: what
  appends to N extents get if every file flushes on its own, concurrently);
- ``fdatasync-serial``: one thread pwrites all N files, then fdatasyncs them one after another;
- ``syncfs``: one thread pwrites all N files, then ONE ``syncfs`` -- a single flush for the whole file system
  (it also flushes every other writer's dirty data there, which is its price on a shared disk);
- ``journal``: the N writes as N 4 KiB records in one file (a per-disk journal), one pwrite, one fdatasync.

Every write lands over zeros written and synced ahead (as the store's zero-fill ahead), so a flush is the data
and the device cache flush, no journal commit for a size change.  Modes run in turns (``--rounds``), each for
``--seconds``: durable 4 KiB writes a second, and this process's CPU per write.

    python -m bench.group_sync [--dir /var/tmp] [--files 1,4,16] [--rounds 3] [--seconds 2] [--json]
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import statistics
import tempfile
import threading
import time

SIZE = 4096
SPAN = 4 << 20                  # zeros ahead per file; writes wrap inside them
MODES = ("fdatasync-each", "fdatasync-serial", "syncfs", "journal")
_libc = ctypes.CDLL(None, use_errno=True)


def _syncfs(fd: int) -> None:
    if _libc.syncfs(fd) != 0:          # ctypes drops the GIL around the call
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def _zeroed(path: str, size: int) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    zeros = bytes(1 << 20)
    for pos in range(0, size, 1 << 20):
        os.pwrite(fd, zeros, pos)
    os.fsync(fd)
    return fd


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def one_turn(mode: str, fds: list[int], journal: int, seconds: float) -> dict:
    n = len(fds)
    payload = os.urandom(SIZE)
    batch = payload * n
    done = [0] * n
    stop = time.monotonic() + seconds
    c0, t0 = _cpu(), time.monotonic()
    if mode == "fdatasync-each":
        def writer(i: int) -> None:
            k = 0
            while time.monotonic() < stop:
                os.pwrite(fds[i], payload, (k * SIZE) % SPAN)
                os.fdatasync(fds[i])
                k += 1
            done[i] = k
        threads = [threading.Thread(target=writer, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        k = 0
        while time.monotonic() < stop:
            pos = (k * SIZE) % SPAN
            if mode == "journal":
                os.pwrite(journal, batch, (k * n * SIZE) % SPAN)
                os.fdatasync(journal)
            else:
                for fd in fds:
                    os.pwrite(fd, payload, pos)
                if mode == "syncfs":
                    _syncfs(fds[0])
                else:
                    for fd in fds:
                        os.fdatasync(fd)
            k += 1
        done = [k * n]
    wall, cpu = time.monotonic() - t0, _cpu() - c0
    writes = sum(done)
    return {"mode": mode, "files": n, "writes_per_s": round(writes / wall),
            "cpu_us_per_write": round(cpu / max(writes, 1) * 1e6, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/var/tmp", help="where the scratch files go (the data disk)")
    ap.add_argument("--files", default="1,4,16", help="how many files written at once, comma-separated")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated, of: " + ", ".join(MODES))
    ap.add_argument("--rounds", type=int, default=3, help="turns of every mode")
    ap.add_argument("--seconds", type=float, default=2.0, help="length of each turn")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    try:
        counts = [int(x) for x in a.files.split(",")]
    except ValueError:
        ap.error("--files takes numbers, e.g. 1,4,16")
    if any(m not in MODES for m in modes) or a.rounds < 1 or not all(1 <= c <= 256 for c in counts):
        ap.error(f"modes are {', '.join(MODES)}; --rounds >= 1; 1 <= files <= 256")
    runs = []
    with tempfile.TemporaryDirectory(dir=a.dir) as d:
        fds = [_zeroed(os.path.join(d, f"f{i}"), SPAN) for i in range(max(counts))]
        journal = _zeroed(os.path.join(d, "journal"), SPAN)
        turns = [(m, c) for c in counts for m in modes]
        for r in range(a.rounds):
            for m, c in (turns if r % 2 == 0 else turns[::-1]):
                x = {"round": r, **one_turn(m, fds[:c], journal, a.seconds)}
                runs.append(x)
                if not a.json:
                    print(f"round {r}  {m:<17} {c:>3} files  {x['writes_per_s']:>6} writes/s  "
                          f"{x['cpu_us_per_write']} us CPU per write", flush=True)
        for fd in (*fds, journal):
            os.close(fd)
    summary = [{"mode": m, "files": c,
                "writes_per_s": statistics.median(x["writes_per_s"] for x in runs if (x["mode"], x["files"]) == (m, c)),
                "cpu_us_per_write": statistics.median(x["cpu_us_per_write"] for x in runs
                                                      if (x["mode"], x["files"]) == (m, c))}
               for c in counts for m in modes]
    if a.json:
        print(json.dumps({"runs": runs, "summary": summary}))
        return
    print(f"medians over {a.rounds} rounds")
    for s in summary:
        print(f"{s['mode']:<17} {s['files']:>3} files  {s['writes_per_s']:>6} writes/s  {s['cpu_us_per_write']} us CPU")


if __name__ == "__main__":
    main()
