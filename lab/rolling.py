"""A rolling restart under a stream of fsync-ed writes through a dnfs mount, measured from the writers' side:
the errors they saw, the longest write+fsync that ended while each node was being restarted (from its
SIGTERM until the cluster was back in sync), and whether every byte they wrote is on every replica of its
partition afterwards.  bench/rolling_restart.py prints it as a table; tests/test_drain.py asserts on it.
"""
from __future__ import annotations

import os
import pathlib
import sqlite3
import threading
import time

import trio

from client.mapadmin import map_snapshot
from client.sdk import DataClient
from tools.cluster import client_login, cluster_map, load, sync_pending

REC = 64 << 10            # bytes per write (each followed by fsync)


def record(seed: int, i: int, n: int = REC) -> bytes:
    """Record ``i`` of writer ``seed``: bytes that differ from every other record's, so a misplaced one shows."""
    import random
    return random.Random(seed * 1_000_003 + i).randbytes(n)


class MountWriter(threading.Thread):
    """Appends records to one file in the mount, each followed by fsync, until ``halt``; keeps the records
    written, each one's (end, unix time; seconds it took), and the first error (it stops there)."""

    def __init__(self, path: pathlib.Path, seed: int, size: int = REC):
        super().__init__(daemon=True, name=f"writer-{path.name}")
        self.path, self.seed, self.size = path, seed, size
        self.records: list[bytes] = []
        self.times: list[tuple[float, float]] = []
        self.errors: list[tuple[float, str]] = []
        self.halt = threading.Event()

    @property
    def data(self) -> bytes:
        return b"".join(self.records)

    def run(self) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            while not self.halt.is_set():
                rec = record(self.seed, len(self.records), self.size)
                t0 = time.monotonic()
                try:
                    os.write(fd, rec)
                    os.fsync(fd)
                except OSError as e:
                    self.errors.append((time.time(), f"{self.path.name} record {len(self.records)}: {e}"))
                    return
                self.records.append(rec)
                self.times.append((time.time(), time.monotonic() - t0))
        finally:
            os.close(fd)


def stall_table(writers: list[MountWriter], nodes: list[dict], since: float) -> list[dict]:
    """Per node of a rolling restart's result (``addr``, ``stopping_at``, ``in_sync_at``): the writes that
    ended in its window, the longest of them (seconds), the errors; first a row for the writes before
    ``since`` (the same run with no restart under way: what load alone costs)."""
    rows = [("before the restart", 0.0, since)] + [(n["addr"], n["stopping_at"], n["in_sync_at"]) for n in nodes]
    out = []
    for what, a, b in rows:
        took = [s for w in writers for t, s in w.times if a <= t <= b]
        out.append({"node": what, "seconds": round(b - a, 2) if a else None, "writes": len(took),
                    "longest_s": round(max(took, default=0.0), 4),
                    "errors": sum(1 for w in writers for t, _e in w.errors if a <= t <= b)})
    return out


async def settled(root: pathlib.Path) -> dict | None:
    """The cluster map once the partitions of the fresh local cluster in ``root`` (the manager's
    min_writable, at least two) are all in sync, else None."""
    snap = await map_snapshot(cluster_map(load(root)))
    return snap if len(snap["partitions"]) >= 2 and not sync_pending(snap, {}) else None


def slices_of(meta_db: pathlib.Path, names: list[str]) -> dict[str, list[tuple]]:
    """Each file's slices from a mount's SQLite metadata: (file offset, length, partition, extent, offset) --
    those in extents (an inline slice's bytes are in the metadata itself)."""
    db = sqlite3.connect(f"file:{meta_db}?mode=ro", uri=True)
    try:
        out = {}
        for name in names:
            ino = db.execute("SELECT ino FROM dentries WHERE parent=1 AND name=?", (name.encode(),)).fetchone()[0]
            out[name] = db.execute("SELECT off, len, pid, extent, ext_off FROM slices WHERE ino=? AND data IS NULL "
                                   "ORDER BY off", (ino,)).fetchall()
        return out
    finally:
        db.close()


async def replicas_hold(meta_db: pathlib.Path, root: pathlib.Path, files: dict[str, bytes]) -> list[str]:
    """Read every byte of each file, where its metadata says it is, from every replica of its partition (as
    the map of the local cluster in ``root`` names them now); returns what differs or cannot be read (empty:
    every replica holds every byte)."""
    slices = slices_of(meta_db, list(files))
    info = load(root)
    et = cluster_map(info)
    bad = []
    async with DataClient.from_env(etcd=et.urls, timeout=10, pool_mib=16, **client_login(info)) as dc:
        for name, want in files.items():
            for off, ln, pid, extent, ext_off in slices[name]:
                for addr in (await et.part(pid)).replicas:
                    try:
                        got = await dc.read(pid, extent, ext_off, ln, replica=addr)
                    except Exception as e:  # noqa: BLE001 - reported, with the place
                        bad.append(f"{name}+{off}: {addr}: {e}")
                        continue
                    if got != want[off:off + ln]:
                        bad.append(f"{name}+{off}: {addr} holds other bytes")
    return bad


def check_replicas(meta_db: pathlib.Path, root: pathlib.Path, files: dict[str, bytes]) -> list[str]:
    """``replicas_hold`` from code that is not async."""
    return trio.run(lambda: replicas_hold(meta_db, root, files))
