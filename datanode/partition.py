"""Data partitions hosted by this node: their durable identity (replicas, epoch) and per-extent write order.

A partition's directory ``data_dir/partitions/<id>/`` holds ``meta.json`` (written atomically: temp file,
fsync, rename, fsync dir) and the extent store.  The replica list is ordered, leader first.  The epoch goes
up on every replica-list change; a request carrying another epoch is refused (``STALE_EPOCH``).
"""
from __future__ import annotations

import json
import logging
import os
import pathlib
import shutil
from dataclasses import dataclass, field

import trio

from .store import ExtentStore, StoreError

log = logging.getLogger("datanode.partition")


def write_json_atomic(path: pathlib.Path, obj) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ExtentLane:
    """Keeps appends to one extent in arrival order while letting their payload fetches overlap.

    The dispatcher takes a ticket when a request *arrives* (synchronously, so arrival order is ticket
    order); the handler then waits for its turn only around the part that must be ordered."""

    def __init__(self, size: int, diverged: str | None = None):
        self.next_offset = size      # where the next accepted append starts (durable size + in-flight)
        self.diverged = diverged     # why appends are refused (replicas may differ), or None
        self._issued = 0
        self._serving = 0
        self._events: dict[int, trio.Event] = {}
        self._skipped: set[int] = set()

    def ticket(self) -> int:
        """Taken when a request arrives; every ticket must end with ``done`` (also on failure)."""
        t = self._issued
        self._issued += 1
        return t

    async def wait_turn(self, ticket: int) -> None:
        if ticket != self._serving:
            ev = self._events.setdefault(ticket, trio.Event())
            await ev.wait()

    def done(self, ticket: int) -> None:
        """Ends this ticket's turn.  Idempotent; a ticket ended before its turn (its request failed early)
        is skipped when its turn comes."""
        if ticket < self._serving:
            return
        if ticket > self._serving:
            self._skipped.add(ticket)
            return
        self._serving += 1
        while self._serving in self._skipped:
            self._skipped.discard(self._serving)
            self._serving += 1
        ev = self._events.pop(self._serving, None)
        if ev is not None:
            ev.set()


@dataclass
class Partition:
    pid: int
    replicas: list[str]
    epoch: int
    root: pathlib.Path
    store: ExtentStore
    sealed: dict[str, str] = field(default_factory=dict)   # extent -> why no more appends
    lanes: dict[int, ExtentLane] = field(default_factory=dict)
    health: dict = field(default_factory=dict)   # the leader's summary of its replicas (datanode/repair.py)

    @property
    def leader(self) -> str:
        return self.replicas[0]

    def lane(self, extent: int) -> ExtentLane | None:
        """The extent's lane, or None if the extent does not exist."""
        ln = self.lanes.get(extent)
        if ln is None:
            try:
                size = self.store.size(extent)
            except StoreError:
                return None
            ln = self.lanes[extent] = ExtentLane(size, self.sealed.get(str(extent)))
        return ln

    def seal(self, extent: int, why: str) -> None:
        """Refuse appends to this extent from now on, durably (its replicas may differ)."""
        self.sealed[str(extent)] = why
        self.save()

    def meta(self) -> dict:
        return {"id": self.pid, "replicas": self.replicas, "epoch": self.epoch, "sealed": self.sealed}

    def save(self) -> None:
        write_json_atomic(self.root / "meta.json", self.meta())

    def describe(self, me: str) -> dict:
        marks = self.store.watermarks()
        return {**self.meta(), "leader": self.leader, "role": "leader" if me == self.leader else "follower",
                "extents": len(marks), "bytes": sum(marks.values()),
                "sealed_extents": sorted(int(e) for e in self.sealed),
                "state": "read-write", "health": self.health}

    # -- repair support (datanode/repair.py) ----------------------------------------------------------
    def deleted_extents(self) -> set[int]:
        """Ids of extents deleted here (their tombstones): repair deletes them on followers too."""
        st = self.store
        with st._lock:
            return set(st._tombstones)

    def block_entries(self, extent: int) -> tuple[int, list[tuple[int, int]]]:
        """(size, [(crc, covered)] per 128 KiB block) of one extent, one consistent snapshot."""
        ext = self.store._get(extent)
        with ext.mu:
            return ext.size, list(ext.entries)


class PartitionTable:
    def __init__(self, data_dir: pathlib.Path, sync: str):
        self.root = data_dir / "partitions"
        self.root.mkdir(parents=True, exist_ok=True)
        self.sync = sync
        self.parts: dict[int, Partition] = {}

    def load(self) -> None:
        for d in sorted(self.root.iterdir()):
            meta = d / "meta.json"
            if not d.is_dir() or not meta.exists():
                continue
            m = json.loads(meta.read_text())
            self.parts[m["id"]] = Partition(m["id"], m["replicas"], m["epoch"], d,
                                            ExtentStore(d / "store", sync=self.sync), m.get("sealed", {}))
            log.info("partition %d loaded: epoch %d, replicas %s, %d extents", m["id"], m["epoch"],
                     ",".join(m["replicas"]), len(self.parts[m["id"]].store.watermarks()))

    def get(self, pid: int) -> Partition | None:
        return self.parts.get(pid)

    def create(self, pid: int, replicas: list[str], epoch: int) -> Partition:
        d = self.root / str(pid)
        d.mkdir(parents=True, exist_ok=True)
        p = Partition(pid, list(replicas), epoch, d, ExtentStore(d / "store", sync=self.sync))
        p.save()
        self.parts[pid] = p
        return p

    def delete(self, pid: int) -> None:
        p = self.parts.pop(pid)
        p.store.close()
        shutil.rmtree(p.root, ignore_errors=True)

    def close(self) -> None:
        for p in self.parts.values():
            p.store.close()
