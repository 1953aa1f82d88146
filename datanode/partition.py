"""Data partitions hosted by this node: their durable identity (replicas, epoch) and per-extent write order.

A partition's directory ``data_dir/partitions/<id>/`` holds ``meta.json`` (written atomically: temp file,
fsync, rename, fsync dir) and the extent store.  Deleting a partition here (``PARTITION_DELETE``, or this node
being removed from its replicas) moves the directory to ``data_dir/trash/<id>.<deleted unix ns>``, where it is
kept for ``trash_retention_s`` (``purge_trash``) and can be put back with ``datanode trash restore``.  The
replica list is ordered, leader first.  The epoch goes up on every replica-list change; a request carrying
another epoch is refused (``STALE_EPOCH``).
"""
from __future__ import annotations

import ctypes
import functools
import json
import logging
import os
import pathlib
import secrets
import shutil
import stat
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import trio

from wire.protocol import BodyError, decode_view, decode_volume
from .lane import TURN, LaneState
from .store import ExtentStore, StoreError, StoreOptions, free_in_steps

log = logging.getLogger(__name__)


def write_json_atomic(path: pathlib.Path, obj) -> None:
    tmp = path.with_suffix(f".tmp{threading.get_ident()}")   # saves from two threads must not share it
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


_LIBC = ctypes.CDLL(None, use_errno=True)
_SYNCFS = getattr(_LIBC, "syncfs", None)


def sync_fs(d: pathlib.Path) -> None:
    """Make everything written on the file system holding ``d`` durable: one flush for many files (Linux's
    syncfs(2); elsewhere sync(2)).  Raises OSError when the file system reports a write-back failure."""
    fd = os.open(d, os.O_RDONLY)
    try:
        if _SYNCFS is None:
            os.sync()
        elif _SYNCFS(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), str(d))
    finally:
        os.close(fd)


def write_json_many(items: list[tuple[pathlib.Path, object]], root: pathlib.Path) -> None:
    """``write_json_atomic`` for many files on the file system of ``root``, with two syncs in all instead of
    two per file: every temp file written, one sync (their bytes are on disk), every rename, one more sync
    (the renames are).  A crash in between leaves each file whole: its old content or its new one."""
    tid = threading.get_ident()
    tmps = []
    try:
        for path, obj in items:
            tmp = path.with_suffix(f".tmp{tid}")
            with open(tmp, "w") as f:
                json.dump(obj, f, indent=1)
            tmps.append((tmp, path))
        sync_fs(root)
    except BaseException:
        for tmp, _ in tmps:
            tmp.unlink(missing_ok=True)
        raise
    for tmp, path in tmps:
        os.replace(tmp, path)
    sync_fs(root)


def _fsync_dir(d: pathlib.Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_tree(root: pathlib.Path, step: int = StoreOptions.free_step_bytes) -> None:
    """``shutil.rmtree`` of a trash entry, its big files (extents) emptied in steps first
    (``store.free_in_steps``: a partition of many 128 MiB extents freed at once would hold the disk's other
    writers' fdatasyncs behind one long discard).  Errors are ignored, as a purge always did: what is left
    stays listed and is purged again."""
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            try:
                st = os.stat(path, follow_symlinks=False)
                if stat.S_ISREG(st.st_mode) and st.st_size:
                    free_in_steps(path, step)    # (one of at most a step: truncated at once)
            except OSError as e:
                log.warning("trash: could not free %s before removing it: %s", path, e)
    shutil.rmtree(root, ignore_errors=True)


class Views(Protocol):
    """How the etcd agent and repair install and drop partitions' views on this node (the same path as
    ``PARTITION_UPDATE``): a view refused (its leader is not known to hold every acknowledged byte) is False.
    ``views``: (partition, replicas, epoch) each."""

    async def install_view(self, pid: int, replicas: list[str], epoch: int) -> bool: ...

    async def install_views(self, views: list[tuple[int, list[str], int]]) -> list[bool]: ...

    async def drop_partition(self, pid: int, replicas: list[str], epoch: int, *, equal_ok: bool = False) -> bool: ...

    async def drop_partitions(self, views: list[tuple[int, list[str], int]]) -> list[bool]: ...


class EarlierWriteFailed(Exception):
    """An append's local write not done because a write of the extent handed over before it failed."""


class _Link:
    """One handed-over local write, as the next one waits for it (in its worker thread)."""
    __slots__ = ("done", "failed")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.failed: str | None = None


def _in_order(prev: _Link | None, link: _Link, fn, *args):
    """In a worker thread: ``fn(*args)`` once the write handed over before it (``prev``) is done -- and not
    at all if that one failed: the extent does not end where this one starts."""
    try:
        if prev is not None:
            prev.done.wait()
            if prev.failed is not None:
                raise EarlierWriteFailed(f"an earlier append's write failed: {prev.failed}")
        return fn(*args)
    except BaseException as e:
        link.failed = str(e) or type(e).__name__
        raise
    finally:
        link.done.set()


class ExtentLane(LaneState):
    """Keeps appends to one extent in arrival order while letting their payload fetches overlap.

    The dispatcher takes a ticket when a request *arrives* (synchronously, so arrival order is ticket
    order); the handler then holds its turn (``async with lane.turn(ticket):``) only around the part that
    must be ordered: checking the offset, forwarding, and handing the local write to a worker thread
    (``hand_over``).  The write itself runs after the turn: each one waits in its thread for the one handed
    over before it, so writes reach the store in turn order, while the next append's turn already checks
    its offset against ``tail`` (where the extent ends once the handed-over writes are done).  So an
    extent's appends wait for each other's ``pwrite`` only, not also for each other's thread hand-overs.
    Every other turn (``settle=True``, the default: repair, truncation) starts once no write is out, so
    there the store's size *is* the extent's end, and nothing else needs to track it.

    The rules (tickets, turns, ``writing``, ``tail``, ``diverged``) are ``lane.LaneState``'s, inherited
    rather than wrapped so that what callers read per append stays a plain attribute; this class adds the
    waiting: it parks the tasks the rules make wait, wakes them, and chains the handed-over writes."""

    __slots__ = ("_events", "_last", "_settled")

    def __init__(self, diverged: str | None = None):
        super().__init__(diverged)
        self._events: dict[int, trio.Event] = {}   # ticket -> its waiting turn's wake-up
        self._last: _Link | None = None   # the newest handed-over write: the next one waits for it
        self._settled: trio.Event | None = None

    def hand_over(self, workers, end: int, fn, *args):
        """In an append's turn: give its local write ``fn(*args)``, which ends the extent at ``end``, to
        ``workers`` (``aio.Workers``); it runs after every write handed over before it (not at all if one of
        them failed: ``EarlierWriteFailed``).  Returns the ``aio.Handed``; the turn may end at once.  Call
        ``handed_back`` once its result is in."""
        prev, link = self._last, _Link()
        self._last = link
        self.handed(end)
        return workers.hand_over(_in_order, prev, link, fn, *args)

    def handed_back(self) -> None:
        if self.back():
            self._last = None
            if self._settled is not None:
                self._settled.set()
                self._settled = None

    async def settled(self) -> None:
        """Until no handed-over write is out."""
        while self.writing:
            if self._settled is None:
                self._settled = trio.Event()
            await self._settled.wait()

    def turn(self, ticket: int | None = None, *, settle: bool = True) -> "_Turn":
        """Hold the extent's turn for ``ticket`` (taken at arrival), or for a new ticket taken now:
        ``async with lane.turn(ticket):`` (a plain class, not ``asynccontextmanager``: it runs per append).
        ``settle``: the turn starts once no handed-over write is out (False: an append's, see the class)."""
        return _Turn(self, self.ticket() if ticket is None else ticket, settle)

    def done(self, ticket: int) -> None:
        """Ends this ticket's turn.  Idempotent; a ticket ended before its turn (its request failed early)
        is skipped when its turn comes."""
        nxt = LaneState.done(self, ticket)
        if nxt is not None:
            ev = self._events.pop(nxt, None)
            if ev is not None:
                ev.set()

    async def _begin(self, ticket: int, settle: bool) -> None:
        """Until ``ticket``'s turn may begin; a wait given up (cancelled) ends the ticket."""
        try:
            while (why := self.blocker(ticket, settle)) is not None:
                if why == TURN:
                    await self._events.setdefault(ticket, trio.Event()).wait()
                else:
                    await self.settled()
        except BaseException:
            self._events.pop(ticket, None)
            self.done(ticket)
            raise


class _Turn:
    __slots__ = ("lane", "t", "settle")

    def __init__(self, lane: ExtentLane, t: int, settle: bool):
        self.lane, self.t, self.settle = lane, t, settle

    async def __aenter__(self) -> None:
        if self.lane.blocker(self.t, self.settle) is not None:
            await self.lane._begin(self.t, self.settle)
        self.lane.held = self.t

    async def __aexit__(self, *exc) -> None:
        self.lane.done(self.t)


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
    unverified: bool = False   # opened without CRC-checking every block (open_verify = tail): the leader's
                               # first scrub after start checks them (datanode/repair.py), then clears this
    dropped: bool = False      # deleted from this node (its directory is in the trash): nothing to persist
    # This copy is known to hold every acknowledged byte: a new partition's, a leader's (only a synced copy
    # may lead), a follower's once its leader confirmed it complete; lost by a cut (TRUNCATE) or by missing an
    # epoch.  A view change whose leader is not known synced is refused (datanode/ops/partitions.py).
    synced: bool = True
    # bumped by every cut: a leader's confirmation names the count it saw, so one sent before a cut is void
    cuts: int = field(default_factory=lambda: secrets.randbelow(1 << 31))
    # leader: where each extent written since it took the lead ends as acknowledged (appends in flight beyond)
    acked: dict[int, int] = field(default_factory=dict)
    # the volume it belongs to ("": none): set when the copy is created, never changed; a connection proving
    # a volume key reaches only its volume's partitions (ops/admit.py)
    volume: str = ""

    @property
    def leader(self) -> str:
        return self.replicas[0]

    def lane(self, extent: int) -> ExtentLane | None:
        """The extent's lane, or None if the extent does not exist."""
        ln = self.lanes.get(extent)
        if ln is None:
            try:
                self.store.size(extent)
            except StoreError:
                return None
            ln = self.lanes[extent] = ExtentLane(self.sealed.get(str(extent)))
        return ln

    def seal(self, extent: int, why: str) -> None:
        """Refuse appends to this extent from now on, durably (its replicas may differ) -- unless the partition
        was dropped meanwhile: a write that was in flight then fails, and its meta.json is in the trash."""
        self.sealed[str(extent)] = why
        if not self.dropped:
            self.save()

    def meta(self) -> dict:
        return {"id": self.pid, "replicas": self.replicas, "epoch": self.epoch, "sealed": self.sealed,
                "synced": self.synced, **({"volume": self.volume} if self.volume else {})}

    def save(self) -> None:
        write_json_atomic(self.root / "meta.json", self.meta())

    def describe(self, me: str) -> dict:
        marks = self.store.watermarks()
        return {**self.meta(), "leader": self.leader, "role": "leader" if me == self.leader else "follower",
                "extents": len(marks), "bytes": sum(marks.values()),
                "sealed_extents": sorted(int(e) for e in self.sealed),
                "state": "degraded" if self.health.get("state") in ("degraded", "repairing") else "read-write",
                "health": self.health}

    # -- repair support (datanode/repair.py) ----------------------------------------------------------
    def deleted_extents(self) -> set[int]:
        """Ids of extents deleted here (their tombstones): repair deletes them on followers too."""
        return self.store.tombstones()

    def block_entries(self, extent: int) -> tuple[int, list[tuple[int, int]]]:
        """(size, [(crc, covered)] per 128 KiB block) of one extent, one consistent snapshot."""
        return self.store.block_entries(extent)


@dataclass
class OpenProgress:
    """How far opening the partitions at start has got.  Written by the loading thread, read by the node's
    status (plain int/float fields: each read sees a whole value)."""
    verify: str = "tail"
    partitions_total: int = 0
    partitions: int = 0
    extents_total: int = 0
    extents: int = 0
    bytes_total: int = 0          # sizes of the data files found (before any torn tail is cut)
    bytes: int = 0
    started: float | None = None  # time.monotonic() when opening began
    finished: float | None = None

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in ("verify", "partitions_total", "partitions", "extents_total",
                                             "extents", "bytes_total", "bytes")}
        end = self.finished if self.finished is not None else time.monotonic()
        d["seconds"] = round(end - self.started, 3) if self.started is not None else 0.0
        return d


def _trash_op(fn):
    """Purges and restores of trash entries run one at a time (in worker threads): a restore must never
    rename an entry a purge is removing -- ``rmtree`` works through the open directory and would go on
    deleting the restored partition's files."""
    @functools.wraps(fn)
    def locked(self, *args, **kw):
        with self._trash_lock:
            return fn(self, *args, **kw)
    return locked


class PartitionTable:
    def __init__(self, data_dir: pathlib.Path, sync: str, verify: str = "full", options: StoreOptions | None = None):
        self.root = data_dir / "partitions"
        self.root.mkdir(parents=True, exist_ok=True)
        self.sync = sync
        self.verify = verify      # how stores are opened: "tail" or "full" (datanode/store/recovery.py)
        self.options = options or StoreOptions()     # given to every store it opens
        self.parts: dict[int, Partition] = {}
        self._trash_lock = threading.Lock()        # see _trash_op
        self._deleted_counts = {"one_flushes": 0, "direct_writes": 0}   # of the stores of deleted partitions

    def load(self, progress: OpenProgress | None = None,
             checkpoint: Callable[[], None] | None = None) -> None:
        """Open every partition under the data dir (blocking: the node runs it in a worker thread).
        ``progress`` is kept up to date as extents open; ``checkpoint`` is called after each extent and may
        raise to stop (e.g. the node is told to stop while starting): what was opened is closed again.
        The partitions appear in ``parts`` together, once all are open."""
        prog = progress or OpenProgress(verify=self.verify)
        prog.started = time.monotonic() if prog.started is None else prog.started
        dirs = [d for d in sorted(self.root.iterdir()) if d.is_dir() and (d / "meta.json").exists()]
        prog.partitions_total = len(dirs)
        for d in dirs:                          # size the work (a directory listing: cheap next to opening)
            try:
                with os.scandir(d / "store" / "extents") as it:
                    for ent in it:
                        if ent.name.endswith(".dat"):
                            prog.extents_total += 1
                            prog.bytes_total += ent.stat().st_size
            except FileNotFoundError:
                pass

        def on_extent(size: int) -> None:
            prog.extents += 1
            prog.bytes += size
            if checkpoint is not None:
                checkpoint()

        loaded: dict[int, Partition] = {}
        try:
            for d in dirs:
                try:
                    pid, replicas, epoch, sealed, synced, volume = self._meta(d, d.name)
                except (OSError, ValueError, KeyError, BodyError) as e:
                    log.error("partition directory %s: unusable meta.json (%s): not loaded, data left in place",
                              d, e)
                    prog.partitions_total -= 1
                    continue
                loaded[pid] = self._open(d, pid, replicas, epoch, sealed, on_extent, synced, volume)
                prog.partitions += 1
                if checkpoint is not None:
                    checkpoint()
        except BaseException:
            for p in loaded.values():
                p.store.close()
            raise
        self.parts.update(loaded)
        prog.finished = time.monotonic()

    @staticmethod
    def _meta(d: pathlib.Path, expect_id: str) -> tuple[int, list[str], int, dict, bool, str]:
        """(id, replicas, epoch, sealed, synced, volume) from a partition directory's meta.json, checked
        completely (a meta.json written before ``synced`` existed: synced, as every copy was then taken to be;
        without ``volume``: in none)."""
        m = json.loads((d / "meta.json").read_text())
        replicas, epoch = decode_view(m)
        pid, sealed, synced = m["id"], m.get("sealed", {}), m.get("synced", True)
        if (not isinstance(pid, int) or str(pid) != expect_id or not isinstance(sealed, dict)
                or not isinstance(synced, bool)):
            raise BodyError("other", f"id {pid!r} / sealed {type(sealed).__name__} / synced {synced!r}")
        return pid, replicas, epoch, sealed, synced, decode_volume(m)

    def _open(self, d: pathlib.Path, pid: int, replicas: list[str], epoch: int, sealed: dict,
              on_extent=None, synced: bool = True, volume: str = "") -> Partition:
        store = ExtentStore(d / "store", sync=self.sync, verify=self.verify, on_extent=on_extent,
                            options=self.options)
        marks = store.watermarks()
        log.info("partition %d loaded: epoch %d, replicas %s, %d extents, %d bytes (verify=%s)", pid,
                 epoch, ",".join(replicas), len(marks), sum(marks.values()), self.verify)
        return Partition(pid, replicas, epoch, d, store, sealed,
                         unverified=self.verify != "full" and any(marks.values()), synced=synced, volume=volume)

    def get(self, pid: int) -> Partition | None:
        return self.parts.get(pid)

    def all(self) -> list[Partition]:
        """Every partition held, as a list taken at once.  ``parts`` changes in the disk's worker threads
        (``create``, ``delete``, ``restore`` run through ``store_call``), so a walk over the dict itself on the
        trio thread can meet a change half-way ("dictionary changed size during iteration") and end the node."""
        return list(self.parts.values())

    def create(self, pid: int, replicas: list[str], epoch: int, synced: bool = True, volume: str = "") -> Partition:
        """A new, empty copy; ``synced``: it holds every acknowledged byte (a new partition's copies; not a
        replica added to a partition that already has data); ``volume``: the volume it belongs to."""
        d = self.root / str(pid)
        d.mkdir(parents=True, exist_ok=True)
        p = Partition(pid, list(replicas), epoch, d,
                      ExtentStore(d / "store", sync=self.sync, verify=self.verify, options=self.options),
                      synced=synced, volume=volume)
        p.save()
        self.parts[pid] = p
        return p

    def save_many(self, parts: list[Partition]) -> None:
        """Save the meta.json of each of ``parts`` (a batch of view changes) with one durable sync for all
        (``write_json_many``); a dropped one is skipped (its directory is in the trash)."""
        items = [(p.root / "meta.json", p.meta()) for p in parts if not p.dropped]
        if items:
            write_json_many(items, self.root)

    def store_counts(self) -> dict[str, int]:
        """The stores' counters (``one_flushes``, ``direct_writes``) since the node started: its partitions'
        and those of the partitions it deleted meanwhile (a counter must not go down: a bench's scratch
        partition, deleted at its end, took its counts with it)."""
        return {k: n + sum(getattr(p.store, k) for p in self.all())
                for k, n in self._deleted_counts.items()}

    @property
    def trash(self) -> pathlib.Path:
        return self.root.parent / "trash"

    def delete(self, pid: int) -> pathlib.Path:
        """Stop serving partition ``pid`` and move its data to the trash; returns where it went."""
        return self.delete_many([pid])[0]

    def delete_many(self, pids: list[int]) -> list[pathlib.Path]:
        """``delete`` for many partitions (a stopping node's hand-off drops every copy it holds): the renames,
        then one fsync of each of the two directories for all of them; returns where each went."""
        moved = []
        try:
            for pid in pids:
                p = self.parts.pop(pid)
                p.dropped = True
                p.store.close()
                for k in self._deleted_counts:
                    self._deleted_counts[k] += getattr(p.store, k)
                self.trash.mkdir(exist_ok=True)
                dest = self.trash / f"{pid}.{time.time_ns()}"
                os.rename(p.root, dest)
                moved.append((pid, dest))
        finally:
            if moved:
                for d in (self.root, self.trash):
                    _fsync_dir(d)
        for pid, dest in moved:
            log.warning("partition %d: data moved to the trash: %s", pid, dest)
        return [dest for _, dest in moved]

    def list_trash(self) -> list[dict]:
        """What the trash holds: [{"name", "partition", "deleted" (unix seconds), "bytes"}], oldest first."""
        out = []
        if not self.trash.is_dir():
            return out
        for d in self.trash.iterdir():
            pid, _, ns = d.name.partition(".")
            if not (d.is_dir() and pid.isdigit() and ns.isdigit()):
                continue
            size = sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
            out.append({"name": d.name, "partition": int(pid), "deleted": int(ns) / 1e9, "bytes": size})
        return sorted(out, key=lambda e: e["deleted"])

    @_trash_op
    def purge_trash(self, retention_s: float, now: float | None = None) -> list[str]:
        """Remove trash entries older than ``retention_s``; returns their names."""
        now = time.time() if now is None else now
        gone = []
        for e in self.list_trash():
            if now - e["deleted"] >= retention_s:
                remove_tree(self.trash / e["name"], self.options.free_step_bytes)
                log.info("trash: purged %s (partition %d, %d bytes)", e["name"], e["partition"], e["bytes"])
                gone.append(e["name"])
        return gone

    @_trash_op
    def restore(self, name: str) -> int:
        """Put a trash entry back as its partition (offline: the node is not running); returns its id."""
        src = self.trash / name
        pid, _, ns = name.partition(".")
        if not (src.is_dir() and pid.isdigit() and ns.isdigit() and "/" not in name):
            raise FileNotFoundError(f"no trash entry {name!r} in {self.trash}")
        dest = self.root / pid
        if dest.exists():
            raise FileExistsError(f"partition {pid} exists again at {dest}: move it away first")
        os.rename(src, dest)
        for d in (self.root, self.trash):
            _fsync_dir(d)
        return int(pid)

    @_trash_op
    def restore_live(self, name: str) -> Partition:
        """Put a trash entry back as its partition on a running node and open it (blocking: the node runs it
        in a worker thread, holding its view lock).  FileNotFoundError: no such entry; FileExistsError: the
        partition is live here (or its directory exists again) -- nothing is touched then; ValueError: the
        entry's meta.json is unusable (it stays in the trash)."""
        src = self.trash / name
        pid_s, _, ns = name.partition(".")
        if not (pid_s.isdigit() and ns.isdigit() and src.is_dir()):
            raise FileNotFoundError(f"no trash entry {name!r} on this node")
        pid = int(pid_s)
        if pid in self.parts:
            raise FileExistsError(f"partition {pid} is live on this node: restoring {name} would clobber it "
                                  f"(delete the live copy first, it goes to the trash too)")
        dest = self.root / pid_s
        if dest.exists():
            raise FileExistsError(f"partition {pid} exists again at {dest}: move it away first")
        try:
            _, replicas, epoch, sealed, synced, volume = self._meta(src, pid_s)
        except (OSError, KeyError, BodyError, ValueError) as e:
            raise ValueError(f"trash entry {name}: unusable meta.json ({e}): left in the trash") from None
        os.rename(src, dest)
        try:
            part = self._open(dest, pid, replicas, epoch, sealed, synced=synced, volume=volume)
        except BaseException:
            os.rename(dest, src)
            raise
        for d in (self.root, self.trash):
            _fsync_dir(d)
        self.parts[pid] = part
        log.warning("partition %d restored from the trash (%s): epoch %d, replicas %s", pid, name, epoch,
                    ",".join(replicas))
        return part

    @_trash_op
    def purge_names(self, names) -> list[dict]:
        """Remove the trash entries named (those that exist); returns the entries removed."""
        want = set(names)
        gone = []
        for e in self.list_trash():
            if e["name"] in want:
                remove_tree(self.trash / e["name"], self.options.free_step_bytes)
                log.info("trash: purged %s (partition %d, %d bytes)", e["name"], e["partition"], e["bytes"])
                gone.append(e)
        return gone

    def close(self) -> None:
        for p in self.all():
            p.store.close()
