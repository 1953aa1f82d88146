"""The embedded metadata engine: one SQLite database (WAL mode), one mount at a time.

A second mount (or ``dnfs fsck`` while mounted) is refused: the engine holds an exclusive ``flock`` on
``PATH.lock`` for as long as it is open, and the lock file names the holder's pid.  Every change is one
transaction (``BEGIN IMMEDIATE``); the connection runs with ``synchronous=NORMAL`` (a commit survives a
killed process at once) and :meth:`sync` fsyncs the WAL (every commit so far) before an ``fsync`` returns.
SQLite calls run one at a time.  A transaction runs right in the event loop when no other SQLite call is
running (a read or a page-cache commit is shorter than the hand-over to a worker thread and back); one that
took longer than 5 ms waiting for something (a WAL checkpoint, a slow disk -- not one that was only preempted
on a busy machine: a thread would not do it sooner) sends the transactions of a while to the worker thread,
a while in proportion to its length, so slow ones stall the loop at most 5% of the time (``aio.InlinePause``).
A transaction in the loop then lets the other tasks run only once transactions back to back have held the loop
a millisecond (``InlinePause.yield_due``): a FUSE request's transaction costs no scheduler pass of its own (a
visible share of the mount's CPU per call), and a run of many still lets the others in.

Durability is a group commit, as the datanodes do theirs: a durable commit (an fsync's) or a ``sync`` waits
until a WAL fsync that started after its commit has ended.  One WAL fsync is out at a time, in a thread of its
own -- not the connection's, so the other files' transactions go on meanwhile -- and every fsync that arrives
while it is out waits for the next one, which then covers them all: eight concurrent fsyncs cost two or three
WAL fsyncs, not eight in a row.  With nothing else in flight in the mount (``quiet``) the WAL fsync runs right
in the loop: nobody waits behind it, and the two hand-overs would cost more than the loop's pause (the same
pause rule applies).

Open-file sessions: the lock makes this mount the only one, so the inodes it has open are kept in its
memory; they end with the process (which also releases the lock), and the next mount removes the inodes
left without links (:meth:`orphans`).
"""
from __future__ import annotations

import errno
import fcntl
import functools
import dataclasses
import logging
import os
import sqlite3
import stat
import time
from collections import Counter

import trio

from client.fs.meta import DIRENT, ROOT, Attr, Meta, MetaBusy, MetaError, MetaTx, Slice
from wire.aio import InlinePause, Workers

log = logging.getLogger(__name__)

SCHEMA = """
CREATE TABLE IF NOT EXISTS inodes (ino INTEGER PRIMARY KEY, mode INT, nlink INT, uid INT, gid INT, rdev INT,
    size INT, atime INT, mtime INT, ctime INT, target BLOB);
CREATE TABLE IF NOT EXISTS dentries (id INTEGER PRIMARY KEY, parent INT, name BLOB, ino INT,
    UNIQUE (parent, name));
CREATE INDEX IF NOT EXISTS dentries_ino ON dentries (ino);
CREATE INDEX IF NOT EXISTS dentries_dir ON dentries (parent);
CREATE TABLE IF NOT EXISTS slices (ino INT, off INT, len INT, pid INT, extent INT, ext_off INT, wpos INT,
    wlen INT, crc INT, data BLOB, PRIMARY KEY (ino, off)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS slices_extent ON slices (pid, extent);
CREATE TABLE IF NOT EXISTS extents (pid INT, extent INT, PRIMARY KEY (pid, extent)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS delq (pid INT, extent INT, PRIMARY KEY (pid, extent)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS xattrs (ino INT, name BLOB, value BLOB, PRIMARY KEY (ino, name)) WITHOUT ROWID;
"""
S_IFMT = 0o170000
INLINE_MAX = 64 << 10      # files up to this size keep their bytes in the database (--inline-kib)
SLICE_COLS = "off, len, pid, extent, ext_off, wpos, wlen, crc, data"
COLS = "ino, mode, nlink, uid, gid, rdev, size, atime, mtime, ctime"


def _attr(row) -> Attr:
    return Attr(*row)


class SqliteTx(MetaTx):
    """The storage primitives on one SQLite transaction."""

    def __init__(self, db, m: "SqliteMeta"):
        self.db, self.m = db, m

    def attr(self, ino):
        row = self.db.execute(f"SELECT {COLS} FROM inodes WHERE ino=?", (ino,)).fetchone()
        return _attr(row) if row else None

    def put_attr(self, a):
        self.db.execute("UPDATE inodes SET mode=?, nlink=?, uid=?, gid=?, rdev=?, size=?, atime=?, mtime=?, ctime=? "
                        "WHERE ino=?", (a.mode, a.nlink, a.uid, a.gid, a.rdev, a.size, a.atime_ns, a.mtime_ns,
                                        a.ctime_ns, a.ino))

    def new_inode(self, a, target):
        cur = self.db.execute(f"INSERT INTO inodes ({COLS}, target) VALUES (NULL,?,?,?,?,?,?,?,?,?,?)",
                              (a.mode, a.nlink, a.uid, a.gid, a.rdev, a.size, a.atime_ns, a.mtime_ns, a.ctime_ns,
                               target))
        return dataclasses.replace(a, ino=cur.lastrowid)

    def target(self, ino):
        return self.db.execute("SELECT target FROM inodes WHERE ino=?", (ino,)).fetchone()[0]

    def child(self, parent, name):
        row = self.db.execute("SELECT ino FROM dentries WHERE parent=? AND name=?", (parent, name)).fetchone()
        return row[0] if row else None

    def has_children(self, ino):
        return self.db.execute("SELECT 1 FROM dentries WHERE parent=? LIMIT 1", (ino,)).fetchone() is not None

    def add_entry(self, parent, name, ino):
        self.db.execute("INSERT INTO dentries (parent, name, ino) VALUES (?,?,?)", (parent, name, ino))

    def set_entry(self, parent, name, ino):
        self.db.execute("UPDATE dentries SET ino=? WHERE parent=? AND name=?", (ino, parent, name))

    def move_entry(self, p1, n1, p2, n2, ino):
        self.db.execute("UPDATE dentries SET parent=?, name=? WHERE parent=? AND name=?", (p2, n2, p1, n1))

    def del_entry(self, parent, name):
        self.db.execute("DELETE FROM dentries WHERE parent=? AND name=?", (parent, name))

    def drop_inode(self, ino):
        db = self.db
        db.execute("INSERT OR IGNORE INTO delq SELECT DISTINCT pid, extent FROM slices WHERE ino=? AND data IS NULL",
                   (ino,))
        db.execute("DELETE FROM slices WHERE ino=?", (ino,))
        db.execute("DELETE FROM xattrs WHERE ino=?", (ino,))
        db.execute("DELETE FROM inodes WHERE ino=?", (ino,))
        self.m._zero.discard(ino)

    def unlinked(self, ino):
        self.m._zero.add(ino)      # (orphans() finds such inodes by their link count)

    def is_open(self, ino):
        return self.m._opens[ino] > 0

    def slices(self, ino, start=0, end=None):
        return SqliteMeta._slices(self.db, ino, start, end)

    def add_slice(self, ino, s):
        self.db.execute("INSERT INTO slices VALUES (?,?,?,?,?,?,?,?,?,?)",
                        (ino, s.off, s.length, s.partition, s.extent, s.ext_off, s.wpos, s.wlen, s.crc, s.data))

    def drop_slice(self, ino, s):
        self.db.execute("DELETE FROM slices WHERE ino=? AND off=?", (ino, s.off))
        if not s.inline:
            self.db.execute("INSERT OR IGNORE INTO delq VALUES (?,?)", (s.partition, s.extent))

    def wrote_extent(self, partition, extent):
        self.db.execute("INSERT OR IGNORE INTO extents VALUES (?,?)", (partition, extent))

    def xattr(self, ino, name):
        row = self.db.execute("SELECT value FROM xattrs WHERE ino=? AND name=?", (ino, name)).fetchone()
        return row[0] if row else None

    def put_xattr(self, ino, name, value):
        if value is None:
            self.db.execute("DELETE FROM xattrs WHERE ino=? AND name=?", (ino, name))
        else:
            self.db.execute("INSERT OR REPLACE INTO xattrs VALUES (?,?,?)", (ino, name, value))


class SqliteMeta(Meta):
    CHECKPOINT_COMMITS = 256      # commits between two checkpoints (~1,000 WAL pages, as SQLite's default)

    def __init__(self, path: str, inline_max: int = INLINE_MAX):
        self.path = os.path.abspath(path)
        # A small file's bytes committed with its metadata: one local transaction instead of a replicated
        # append, and as safe -- the same WAL holds both, so whatever keeps the file's metadata (a close: a
        # killed mount; an fsync: the WAL's fsync) keeps its bytes too.
        self.inline_max = inline_max
        parent = os.path.dirname(self.path)
        if not os.path.isdir(parent):
            raise ValueError(f"metadata directory {parent} does not exist")
        self._lockf = open(self.path + ".lock", "a+")
        try:
            fcntl.flock(self._lockf, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lockf.seek(0)
            holder = self._lockf.read().strip() or "?"
            self._lockf.close()
            raise MetaBusy(f"metadata {self.path} is in use by another mount or fsck (pid {holder}); "
                           f"unmount it first (dnfs umount MOUNTPOINT)") from None
        self._lockf.seek(0)
        self._lockf.truncate()
        self._lockf.write(str(os.getpid()))
        self._lockf.flush()
        if not os.path.lexists(self.path):        # looked at under the lock: no other mount can be creating it
            self.created = tuple(self.path + s for s in ("", "-wal", "-shm", "-journal", ".lock"))
        self.db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.execute("PRAGMA wal_autocheckpoint=0")    # we checkpoint, in the worker thread (_call)
        self.db.executescript(SCHEMA)
        if "data" not in {r[1] for r in self.db.execute("PRAGMA table_info(slices)")}:
            self.db.execute("ALTER TABLE slices ADD COLUMN data BLOB")     # a database from before inline slices
        if self.db.execute("SELECT 1 FROM inodes WHERE ino=?", (ROOT,)).fetchone() is None:
            now = time.time_ns()
            self.db.execute(f"INSERT INTO inodes ({COLS}, target) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                            (ROOT, stat.S_IFDIR | 0o755, 2, os.getuid(), os.getgid(), 0, 2 * DIRENT, now, now, now,
                             b""))
        self._limiter = trio.CapacityLimiter(1)          # the connection: one SQLite call at a time
        self._syncer = Workers(most=1, name="meta-wal-sync")   # the WAL fsync's own thread (a lean hand-over)
        self._seq = 0                 # commits made (counted once COMMIT has returned)
        self._synced = 0              # of those, the ones a finished WAL fsync covers
        self._sync_out: trio.Event | None = None          # set when the WAL fsync out ends
        # A failed WAL fsync may have dropped dirty pages the kernel then calls clean: a later fsync would
        # "succeed" without them.  So one failure fails every durable commit after it (remount to recover).
        self._wal_failed: OSError | None = None
        self.wal_syncs = 0            # WAL fsyncs done ...
        self.wal_syncs_in_thread = 0  # (of those, in a thread: the loop paused them, or others were in flight)
        self.durable_waits = 0        # ... for this many durable commits and syncs (group commit: fewer)
        self.inline = InlinePause()   # when a transaction may run right in the event loop
        # ... and when a WAL fsync may: a pause of its own, so a slow disk sync sends the next while's fsyncs
        # to their thread but leaves the ordinary transactions (page-cache commits) in the loop
        self.inline_sync = InlinePause()
        self.inline_txs = 0           # transactions run in the event loop ...
        self.thread_txs = 0           # ... and in the worker thread
        self._commits = 0             # since the last checkpoint
        self.checkpoints = 0
        self._opens: Counter[int] = Counter()
        self._zero: set[int] = set()      # inodes this mount saw lose their last link (closed() checks only these)

    # -- plumbing
    async def _run(self, fn, *args):
        """``fn(SqliteTx, *args)`` as one transaction."""
        return await self._raw(lambda db: fn(SqliteTx(db, self), *args))

    def _now(self, fn, *args):
        """The transaction right here if the connection is free and no slow call paused that (as ``_call``
        would run it in the loop), else None."""
        t0 = time.monotonic()
        if not self._inline_free(t0):
            return None
        self.inline_txs += 1
        with self.inline.timed(t0):
            return self._tx(lambda db: fn(SqliteTx(db, self), *args))

    async def _raw(self, fn, *args):
        """``fn(connection, *args)`` as one transaction (the engine's own queries): in the event loop when the
        connection is free and no slow transaction paused that (the module docstring), else in the worker
        thread."""
        return await self._call(functools.partial(self._tx, fn, *args), True)

    async def _run_durable(self, fn, *args):
        """The transaction, then a WAL fsync that covers it -- shared with the other durable commits and
        syncs waiting meanwhile (the module docstring).  Alone in the mount (``quiet``, no WAL fsync out) with
        the transaction bound for the worker thread anyway, the fsync goes along: one hand-over for both."""
        self._check_wal()
        if (self._sync_out is None and self.quiet is not None and self.quiet()
                and not self._inline_free(time.monotonic())):
            def both():
                out = self._tx(lambda db: fn(SqliteTx(db, self), *args))
                upto = self._seq
                self._fsync_wal()
                self.wal_syncs += 1
                self.wal_syncs_in_thread += 1
                self.durable_waits += 1
                self._synced = max(self._synced, upto)
                return out
            return await self._call(both, False)
        out = await self._run(fn, *args)
        await self._durable()
        return out

    def _inline_free(self, now: float) -> bool:
        """May a transaction run right here at ``now``: the connection free, no slow transaction paused it."""
        return self._limiter.borrowed_tokens == 0 and self.inline.allowed(now)

    async def _durable(self) -> None:
        """Return once every commit made so far is durable: wait for a WAL fsync that started after them,
        starting one if none is out (the waiters of the fsync out when we came start the next one together)."""
        want = self._seq
        self.durable_waits += 1
        while self._synced < want:
            self._check_wal()
            if self._sync_out is not None:
                await self._sync_out.wait()             # it may have started before our commit: look again
                continue
            done = self._sync_out = trio.Event()
            upto = self._seq                            # every commit counted so far is in the WAL file
            try:
                t0 = time.monotonic()
                if self.quiet is not None and self.quiet() and self.inline_sync.allowed(t0):
                    self.inline_txs += 1
                    with self.inline_sync.timed(t0):
                        self._fsync_wal()               # nobody waits behind it: no hand-over
                else:
                    self.thread_txs += 1
                    self.wal_syncs_in_thread += 1
                    await self._syncer.run_sync(self._fsync_wal)
                self.wal_syncs += 1
                self._synced = max(self._synced, upto)
            finally:
                self._sync_out = None
                done.set()

    async def _call(self, job, inline: bool):
        """``job()`` on the connection: right here if ``inline`` and the connection is free and no slow call
        paused that (the module docstring), else in the worker thread."""
        t0 = time.monotonic()
        if inline and self._inline_free(t0):
            self.inline_txs += 1
            try:
                with self.inline.timed(t0):     # (a call that was only preempted pauses nothing)
                    out = job()                 # no await inside: nothing else can reach the connection
            finally:
                if self.inline.yield_due(t0, time.monotonic()):
                    await trio.lowlevel.cancel_shielded_checkpoint()    # the others' turn (done is done)
        else:
            self.thread_txs += 1
            out = await trio.to_thread.run_sync(job, limiter=self._limiter)
        if self._commits >= self.CHECKPOINT_COMMITS:
            self._commits = 0
            with trio.CancelScope(shield=True):     # the caller's transaction is done: it must hear so
                await trio.to_thread.run_sync(self._checkpoint, limiter=self._limiter)
        return out

    def _tx(self, fn, *args):
        db = self.db
        db.execute("BEGIN IMMEDIATE")
        try:
            out = fn(db, *args)
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")
        self._commits += 1
        self._seq += 1
        return out

    def _checkpoint(self) -> None:
        """Copy the WAL's pages into the database file, so the WAL starts over (SQLite's own automatic
        checkpoint, turned off: it ran inside a commit -- in the event loop, stalling it for a 4 MiB write
        and two fsyncs, and sending the next second's transactions to the thread, which under a burst of
        changes was nearly all of them)."""
        try:
            self.db.execute("PRAGMA wal_checkpoint(PASSIVE)")
            self.checkpoints += 1
        except sqlite3.Error as e:          # the WAL only grows meanwhile; the next one tries again
            log.warning("metadata checkpoint of %s failed: %s", self.path, e)

    def stats(self) -> dict:
        return {"engine": "sqlite", "transactions_in_loop": self.inline_txs,
                "transactions_in_thread": self.thread_txs, "checkpoints": self.checkpoints,
                "wal_syncs": self.wal_syncs,
                "wal_syncs_in_thread": self.wal_syncs_in_thread, "durable_waits": self.durable_waits}

    async def close(self) -> None:
        def shut():
            self.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            self.db.close()
        await trio.to_thread.run_sync(shut, limiter=self._limiter)
        self._lockf.close()

    async def sync(self) -> None:
        """Make every commit so far durable: fsync the WAL, which holds them (what ``synchronous=FULL`` does
        at each commit).  A checkpoint would also copy the pages into the database file and fsync that too
        -- twice the syncs for the same guarantee; SQLite checkpoints by itself as the WAL grows.  Shared with
        the other syncs and durable commits waiting meanwhile (``_durable``)."""
        await self._durable()

    def _check_wal(self) -> None:
        if self._wal_failed is not None:
            raise OSError(errno.EIO, f"metadata WAL of {self.path} failed to sync earlier "
                                     f"({self._wal_failed.strerror}): remount") from self._wal_failed

    def _fsync_wal(self) -> None:
        self._check_wal()
        try:
            fd = os.open(self.path + "-wal", os.O_RDONLY)
        except FileNotFoundError:       # no WAL: every commit is in the database file (closed cleanly)
            fd = os.open(self.path, os.O_RDONLY)
        try:
            os.fdatasync(fd)            # what SQLite itself does: the bytes and the length that reads them
        except OSError as e:
            self._wal_failed = e
            log.error("metadata WAL fsync of %s failed: %s; durable commits fail until remount", self.path, e)
            raise
        finally:
            os.close(fd)

    # -- open-file sessions (this process's own: see the module docstring)
    async def opened(self, ino):
        self._opens[ino] += 1

    async def closed(self, ino):
        n = self._opens.pop(ino, 0) - 1
        if n > 0:
            self._opens[ino] = n
            return False
        if ino not in self._zero:      # only this mount unlinks (the lock): still linked, nothing to do
            return False
        return await self._run(self._remove, ino)

    # -- tree
    async def readdir(self, ino, after, limit):
        def go(db):
            self._dir(SqliteTx(db, self), ino)
            rows = db.execute(f"SELECT d.id, d.name, {', '.join('i.' + c.strip() for c in COLS.split(','))} "
                              "FROM dentries d JOIN inodes i ON i.ino = d.ino WHERE d.parent=? AND d.id>? "
                              "ORDER BY d.id LIMIT ?", (ino, after, limit)).fetchall()
            return [(r[1], _attr(r[2:]), r[0]) for r in rows]
        return await self._raw(go)

    async def orphans(self):
        return await self._raw(lambda db: [r[0] for r in db.execute(
            "SELECT ino FROM inodes WHERE nlink<=0 AND ino<>?", (ROOT,)) if not self._opens[r[0]]])

    # -- data
    @staticmethod
    def _slices(db, ino: int, start: int = 0, end: int | None = None) -> list[Slice]:
        if end is None:
            rows = db.execute(f"SELECT {SLICE_COLS} FROM slices WHERE ino=? ORDER BY off", (ino,)).fetchall()
        else:        # the slice that starts at or before `start`, and every one starting inside the range
            first = db.execute("SELECT max(off) FROM slices WHERE ino=? AND off<=?", (ino, start)).fetchone()[0]
            rows = db.execute(f"SELECT {SLICE_COLS} FROM slices WHERE ino=? AND off>=? AND off<? ORDER BY off",
                              (ino, start if first is None else first, end)).fetchall()
        return [Slice(*r) for r in rows]

    # -- deletion queue
    async def queued(self, limit):
        return await self._raw(lambda db: db.execute("SELECT pid, extent FROM delq LIMIT ?", (limit,)).fetchall())

    async def referenced(self, partition, extent):
        return await self._raw(lambda db: db.execute("SELECT 1 FROM slices WHERE pid=? AND extent=? AND data IS NULL "
                                                     "LIMIT 1", (partition, extent)).fetchone() is not None)

    async def dequeue(self, partition, extent):
        def go(db):
            db.execute("DELETE FROM delq WHERE pid=? AND extent=?", (partition, extent))
            if db.execute("SELECT 1 FROM slices WHERE pid=? AND extent=? AND data IS NULL LIMIT 1",
                          (partition, extent)).fetchone() is None:
                db.execute("DELETE FROM extents WHERE pid=? AND extent=?", (partition, extent))
        await self._raw(go)

    async def usage(self):
        return await self._raw(lambda db: db.execute("SELECT count(*), coalesce(sum(CASE WHEN mode & ? = ? THEN size "
                                                      "END), 0) FROM inodes", (S_IFMT, stat.S_IFREG)).fetchone())

    # -- xattrs
    async def getxattr(self, ino, name):
        def go(db):
            self._get(SqliteTx(db, self), ino)
            row = db.execute("SELECT value FROM xattrs WHERE ino=? AND name=?", (ino, name)).fetchone()
            if row is None:
                raise MetaError(errno.ENODATA)
            return row[0]
        return await self._raw(go)

    async def setxattr(self, ino, name, value):
        def go(db):
            self._get(SqliteTx(db, self), ino)
            db.execute("INSERT OR REPLACE INTO xattrs VALUES (?,?,?)", (ino, name, value))
            db.execute("UPDATE inodes SET ctime=? WHERE ino=?", (time.time_ns(), ino))
        await self._raw(go)

    async def listxattr(self, ino):
        return await self._raw(lambda db: [r[0] for r in db.execute("SELECT name FROM xattrs WHERE ino=?", (ino,))])

    async def removexattr(self, ino, name):
        def go(db):
            if db.execute("DELETE FROM xattrs WHERE ino=? AND name=?", (ino, name)).rowcount == 0:
                raise MetaError(errno.ENODATA)
        await self._raw(go)

    # -- fsck
    async def check(self):
        def go(db):
            out = []
            for (parent, name, ino) in db.execute("SELECT d.parent, d.name, d.ino FROM dentries d LEFT JOIN inodes i "
                                                  "ON i.ino=d.ino WHERE i.ino IS NULL").fetchall():
                out.append({"kind": "dangling_entry", "parent": parent, "name": name.decode(errors="replace"),
                            "ino": ino})
            for (ino, nlink, links) in db.execute(
                    "SELECT i.ino, i.nlink, (SELECT count(*) FROM dentries d WHERE d.ino=i.ino) FROM inodes i "
                    "WHERE (i.mode & ?) <> ? AND i.ino<>?", (S_IFMT, stat.S_IFDIR, ROOT)).fetchall():
                if nlink != links or links == 0:
                    out.append({"kind": "orphan_inode" if links == 0 else "wrong_nlink", "ino": ino,
                                "nlink": nlink, "entries": links})
            prev: dict[int, Slice] = {}
            for (ino, *rest) in db.execute(f"SELECT ino, {SLICE_COLS} FROM slices ORDER BY ino, off"):
                s = Slice(*rest)
                p = prev.get(ino)
                if p is not None and p.end > s.off:
                    out.append({"kind": "overlapping_slices", "ino": ino, "off": s.off})
                prev[ino] = s
            return out
        return await self._raw(go)

    async def all_slices(self):
        return await self._raw(lambda db: [(r[0], Slice(*r[1:])) for r in db.execute(
            f"SELECT ino, {SLICE_COLS} FROM slices ORDER BY pid, extent, wpos")])

    async def known_extents(self):
        return await self._raw(lambda db: {tuple(r) for r in db.execute("SELECT pid, extent FROM extents")})

    async def repair(self, problems):
        def go(db):
            done = []
            for p in problems:
                if p["kind"] == "dangling_entry":
                    db.execute("DELETE FROM dentries WHERE parent=? AND ino=?", (p["parent"], p["ino"]))
                    done.append({**p, "action": "entry removed"})
                elif p["kind"] == "orphan_inode":
                    db.execute("UPDATE inodes SET nlink=0 WHERE ino=?", (p["ino"],))
                    SqliteTx(db, self).drop_inode(p["ino"])
                    done.append({**p, "action": "inode removed, its extents queued for deletion"})
                elif p["kind"] == "wrong_nlink":
                    db.execute("UPDATE inodes SET nlink=? WHERE ino=?", (p["entries"], p["ino"]))
                    done.append({**p, "action": f"nlink set to {p['entries']}"})
                elif p["kind"] == "unreferenced_extent":
                    db.execute("INSERT OR IGNORE INTO delq VALUES (?,?)", (p["partition"], p["extent"]))
                    done.append({**p, "action": "queued for deletion"})
            return done
        return await self._raw(go)
