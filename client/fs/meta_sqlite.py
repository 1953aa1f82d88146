"""The embedded metadata engine: one SQLite database (WAL mode), one mount at a time.

A second mount (or ``dnfs fsck`` while mounted) is refused: the engine holds an exclusive ``flock`` on
``PATH.lock`` for as long as it is open, and the lock file names the holder's pid.  Every change is one
transaction (``BEGIN IMMEDIATE``); the connection runs with ``synchronous=NORMAL`` (a commit survives a
killed process at once) and :meth:`sync` checkpoints the WAL, which fsyncs it, before an ``fsync`` returns.
All SQLite calls run in a worker thread, one at a time.
"""
from __future__ import annotations

import errno
import fcntl
import functools
import logging
import os
import sqlite3
import stat
import time

import trio

from client.fs.meta import ROOT, Attr, Meta, MetaBusy, MetaError, Slice, check_name, overlay

log = logging.getLogger(__name__)

SCHEMA = """
CREATE TABLE IF NOT EXISTS inodes (ino INTEGER PRIMARY KEY, mode INT, nlink INT, uid INT, gid INT, rdev INT,
    size INT, atime INT, mtime INT, ctime INT, target BLOB);
CREATE TABLE IF NOT EXISTS dentries (id INTEGER PRIMARY KEY, parent INT, name BLOB, ino INT,
    UNIQUE (parent, name));
CREATE INDEX IF NOT EXISTS dentries_ino ON dentries (ino);
CREATE TABLE IF NOT EXISTS slices (ino INT, off INT, len INT, pid INT, extent INT, ext_off INT, wpos INT,
    wlen INT, crc INT, PRIMARY KEY (ino, off)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS slices_extent ON slices (pid, extent);
CREATE TABLE IF NOT EXISTS extents (pid INT, extent INT, PRIMARY KEY (pid, extent)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS delq (pid INT, extent INT, PRIMARY KEY (pid, extent)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS xattrs (ino INT, name BLOB, value BLOB, PRIMARY KEY (ino, name)) WITHOUT ROWID;
"""
S_IFMT = 0o170000
COLS = "ino, mode, nlink, uid, gid, rdev, size, atime, mtime, ctime"


def _attr(row) -> Attr:
    return Attr(*row)


class SqliteMeta(Meta):
    def __init__(self, path: str):
        self.path = os.path.abspath(path)
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
        self.db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(SCHEMA)
        if self.db.execute("SELECT 1 FROM inodes WHERE ino=?", (ROOT,)).fetchone() is None:
            now = time.time_ns()
            self.db.execute(f"INSERT INTO inodes ({COLS}, target) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                            (ROOT, stat.S_IFDIR | 0o755, 2, os.getuid(), os.getgid(), 0, 0, now, now, now, b""))
        self._limiter = trio.CapacityLimiter(1)

    # -- plumbing
    async def _run(self, fn, *args, **kw):
        return await trio.to_thread.run_sync(functools.partial(self._tx, fn, *args, **kw), limiter=self._limiter)

    def _tx(self, fn, *args, **kw):
        db = self.db
        db.execute("BEGIN IMMEDIATE")
        try:
            out = fn(db, *args, **kw)
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")
        return out

    async def close(self) -> None:
        def shut():
            self.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            self.db.close()
        await trio.to_thread.run_sync(shut, limiter=self._limiter)
        self._lockf.close()

    async def sync(self) -> None:
        await trio.to_thread.run_sync(lambda: self.db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone(),
                                      limiter=self._limiter)

    @staticmethod
    def _get(db, ino: int) -> Attr:
        row = db.execute(f"SELECT {COLS} FROM inodes WHERE ino=?", (ino,)).fetchone()
        if row is None:
            raise MetaError(errno.ENOENT, f"inode {ino}")
        return _attr(row)

    @staticmethod
    def _child(db, parent: int, name: bytes) -> int | None:
        row = db.execute("SELECT ino FROM dentries WHERE parent=? AND name=?", (parent, name)).fetchone()
        return row[0] if row else None

    def _dir(self, db, ino: int) -> Attr:
        a = self._get(db, ino)
        if not a.is_dir:
            raise MetaError(errno.ENOTDIR)
        return a

    @staticmethod
    def _touch(db, ino: int, now: int, *, nlink: int = 0) -> None:
        db.execute("UPDATE inodes SET mtime=?, ctime=?, nlink=nlink+? WHERE ino=?", (now, now, nlink, ino))

    # -- tree
    async def lookup(self, parent, name):
        def go(db):
            ino = self._child(db, parent, name)
            if ino is None:
                self._dir(db, parent)
                raise MetaError(errno.ENOENT)
            return self._get(db, ino)
        return await self._run(go)

    async def getattr(self, ino):
        return await self._run(self._get, ino)

    async def setattr(self, ino, *, mode=None, uid=None, gid=None, atime_ns=None, mtime_ns=None, ctime_ns):
        def go(db):
            a = self._get(db, ino)
            if mode is not None:
                a.mode = (a.mode & ~0o7777) | (mode & 0o7777)
            for k, v in (("uid", uid), ("gid", gid), ("atime_ns", atime_ns), ("mtime_ns", mtime_ns)):
                if v is not None:
                    setattr(a, k, v)
            a.ctime_ns = ctime_ns
            db.execute("UPDATE inodes SET mode=?, uid=?, gid=?, atime=?, mtime=?, ctime=? WHERE ino=?",
                       (a.mode, a.uid, a.gid, a.atime_ns, a.mtime_ns, a.ctime_ns, ino))
            return a
        return await self._run(go)

    async def create(self, parent, name, mode, uid, gid, rdev=0, target=b""):
        check_name(name)

        def go(db):
            self._dir(db, parent)
            if self._child(db, parent, name) is not None:
                raise MetaError(errno.EEXIST)
            now = time.time_ns()
            is_dir = stat.S_ISDIR(mode)
            cur = db.execute(f"INSERT INTO inodes ({COLS}, target) VALUES (NULL,?,?,?,?,?,?,?,?,?,?)",
                             (mode, 2 if is_dir else 1, uid, gid, rdev, len(target), now, now, now, target))
            ino = cur.lastrowid
            db.execute("INSERT INTO dentries (parent, name, ino) VALUES (?,?,?)", (parent, name, ino))
            self._touch(db, parent, now, nlink=1 if is_dir else 0)
            return self._get(db, ino)
        return await self._run(go)

    async def link(self, ino, parent, name):
        check_name(name)

        def go(db):
            a = self._get(db, ino)
            if a.is_dir:
                raise MetaError(errno.EPERM, "hard link to a directory")
            self._dir(db, parent)
            if self._child(db, parent, name) is not None:
                raise MetaError(errno.EEXIST)
            now = time.time_ns()
            db.execute("INSERT INTO dentries (parent, name, ino) VALUES (?,?,?)", (parent, name, ino))
            db.execute("UPDATE inodes SET nlink=nlink+1, ctime=? WHERE ino=?", (now, ino))
            self._touch(db, parent, now)
            return self._get(db, ino)
        return await self._run(go)

    def _drop_entry(self, db, parent: int, name: bytes, ino: int, now: int) -> Attr:
        """Remove the entry (parent, name) -> ino; one link less (a directory loses both of its own)."""
        a = self._get(db, ino)
        db.execute("DELETE FROM dentries WHERE parent=? AND name=?", (parent, name))
        if a.is_dir:
            db.execute("UPDATE inodes SET nlink=0, ctime=? WHERE ino=?", (now, ino))
            self._touch(db, parent, now, nlink=-1)
        else:
            db.execute("UPDATE inodes SET nlink=nlink-1, ctime=? WHERE ino=?", (now, ino))
            self._touch(db, parent, now)
        return self._get(db, ino)

    async def unlink(self, parent, name):
        def go(db):
            ino = self._child(db, parent, name)
            if ino is None:
                self._dir(db, parent)
                raise MetaError(errno.ENOENT)
            if self._get(db, ino).is_dir:
                raise MetaError(errno.EISDIR)
            return self._drop_entry(db, parent, name, ino, time.time_ns())
        return await self._run(go)

    def _empty(self, db, ino: int) -> bool:
        return db.execute("SELECT 1 FROM dentries WHERE parent=? LIMIT 1", (ino,)).fetchone() is None

    async def rmdir(self, parent, name):
        def go(db):
            ino = self._child(db, parent, name)
            if ino is None:
                self._dir(db, parent)
                raise MetaError(errno.ENOENT)
            self._dir(db, ino)
            if not self._empty(db, ino):
                raise MetaError(errno.ENOTEMPTY)
            self._drop_entry(db, parent, name, ino, time.time_ns())
            self._remove(db, ino)
        await self._run(go)

    async def rename(self, p1, n1, p2, n2, *, noreplace=False, exchange=False):
        check_name(n2)

        def go(db):
            src = self._child(db, p1, n1)
            if src is None:
                self._dir(db, p1)
                raise MetaError(errno.ENOENT)
            self._dir(db, p2)
            dst = self._child(db, p2, n2)
            if src == dst:
                return None
            now = time.time_ns()
            sa = self._get(db, src)
            if exchange:
                if dst is None:
                    raise MetaError(errno.ENOENT)
                da = self._get(db, dst)
                db.execute("UPDATE dentries SET ino=? WHERE parent=? AND name=?", (dst, p1, n1))
                db.execute("UPDATE dentries SET ino=? WHERE parent=? AND name=?", (src, p2, n2))
                if p1 != p2 and sa.is_dir != da.is_dir:
                    moved = 1 if sa.is_dir else -1
                    self._touch(db, p1, now, nlink=-moved)
                    self._touch(db, p2, now, nlink=moved)
                for i in (src, dst, p1, p2):
                    db.execute("UPDATE inodes SET ctime=? WHERE ino=?", (now, i))
                return None
            replaced = None
            if dst is not None:
                if noreplace:
                    raise MetaError(errno.EEXIST)
                da = self._get(db, dst)
                if sa.is_dir and not da.is_dir:
                    raise MetaError(errno.ENOTDIR)
                if da.is_dir and not sa.is_dir:
                    raise MetaError(errno.EISDIR)
                if da.is_dir and not self._empty(db, dst):
                    raise MetaError(errno.ENOTEMPTY)
                replaced = self._drop_entry(db, p2, n2, dst, now)
                if da.is_dir:
                    self._remove(db, dst)
                    replaced = None
            db.execute("UPDATE dentries SET parent=?, name=? WHERE parent=? AND name=?", (p2, n2, p1, n1))
            db.execute("UPDATE inodes SET ctime=? WHERE ino=?", (now, src))
            moved = 1 if sa.is_dir and p1 != p2 else 0
            self._touch(db, p1, now, nlink=-moved)
            self._touch(db, p2, now, nlink=moved)
            return replaced
        return await self._run(go)

    async def readdir(self, ino, after, limit):
        def go(db):
            self._dir(db, ino)
            rows = db.execute(f"SELECT d.id, d.name, {', '.join('i.' + c.strip() for c in COLS.split(','))} "
                              "FROM dentries d JOIN inodes i ON i.ino = d.ino WHERE d.parent=? AND d.id>? "
                              "ORDER BY d.id LIMIT ?", (ino, after, limit)).fetchall()
            return [(r[1], _attr(r[2:]), r[0]) for r in rows]
        return await self._run(go)

    async def readlink(self, ino):
        def go(db):
            a = self._get(db, ino)
            if not stat.S_ISLNK(a.mode):
                raise MetaError(errno.EINVAL)
            return db.execute("SELECT target FROM inodes WHERE ino=?", (ino,)).fetchone()[0]
        return await self._run(go)

    def _remove(self, db, ino: int) -> None:
        db.execute("INSERT OR IGNORE INTO delq SELECT DISTINCT pid, extent FROM slices WHERE ino=?", (ino,))
        db.execute("DELETE FROM slices WHERE ino=?", (ino,))
        db.execute("DELETE FROM xattrs WHERE ino=?", (ino,))
        db.execute("DELETE FROM inodes WHERE ino=?", (ino,))

    async def remove(self, ino):
        def go(db):
            row = db.execute("SELECT nlink FROM inodes WHERE ino=?", (ino,)).fetchone()
            if row is not None and row[0] <= 0:
                self._remove(db, ino)
        await self._run(go)

    async def orphans(self):
        return await self._run(lambda db: [r[0] for r in db.execute(
            "SELECT ino FROM inodes WHERE nlink<=0 AND ino<>?", (ROOT,))])

    # -- data
    @staticmethod
    def _slices(db, ino: int, start: int = 0, end: int | None = None) -> list[Slice]:
        if end is None:
            rows = db.execute("SELECT off, len, pid, extent, ext_off, wpos, wlen, crc FROM slices WHERE ino=? "
                              "ORDER BY off", (ino,)).fetchall()
        else:        # the slice that starts at or before `start`, and every one starting inside the range
            first = db.execute("SELECT max(off) FROM slices WHERE ino=? AND off<=?", (ino, start)).fetchone()[0]
            rows = db.execute("SELECT off, len, pid, extent, ext_off, wpos, wlen, crc FROM slices WHERE ino=? "
                              "AND off>=? AND off<? ORDER BY off",
                              (ino, start if first is None else first, end)).fetchall()
        return [Slice(*r) for r in rows]

    async def slices(self, ino):
        return await self._run(self._slices, ino)

    def _cut(self, db, ino: int, new: Slice) -> None:
        kept, touched = overlay(self._slices(db, ino, new.off, new.end), new)
        for s in touched:
            db.execute("DELETE FROM slices WHERE ino=? AND off=?", (ino, s.off))
            db.execute("INSERT OR IGNORE INTO delq VALUES (?,?)", (s.partition, s.extent))
        for s in kept:
            self._put(db, ino, s)

    @staticmethod
    def _put(db, ino: int, s: Slice) -> None:
        db.execute("INSERT INTO slices VALUES (?,?,?,?,?,?,?,?,?)",
                   (ino, s.off, s.length, s.partition, s.extent, s.ext_off, s.wpos, s.wlen, s.crc))

    async def commit(self, ino, new, size, mtime_ns):
        def go(db):
            a = self._get(db, ino)
            for s in new:
                self._cut(db, ino, s)
                self._put(db, ino, s)
                db.execute("INSERT OR IGNORE INTO extents VALUES (?,?)", (s.partition, s.extent))
            a.size = max(a.size, size)
            a.mtime_ns = a.ctime_ns = mtime_ns
            db.execute("UPDATE inodes SET size=?, mtime=?, ctime=? WHERE ino=?", (a.size, mtime_ns, mtime_ns, ino))
            return a
        return await self._run(go)

    async def truncate(self, ino, size, mtime_ns):
        def go(db):
            a = self._get(db, ino)
            if a.is_dir:
                raise MetaError(errno.EISDIR)
            if size < a.size:
                self._cut(db, ino, Slice(size, max(a.size, 1 << 62) - size, 0, 0, 0, 0, 0, 0))
            a.size, a.mtime_ns, a.ctime_ns = size, mtime_ns, mtime_ns
            db.execute("UPDATE inodes SET size=?, mtime=?, ctime=? WHERE ino=?", (size, mtime_ns, mtime_ns, ino))
            return a
        return await self._run(go)

    # -- deletion queue
    async def queued(self, limit):
        return await self._run(lambda db: db.execute("SELECT pid, extent FROM delq LIMIT ?", (limit,)).fetchall())

    async def referenced(self, partition, extent):
        return await self._run(lambda db: db.execute("SELECT 1 FROM slices WHERE pid=? AND extent=? LIMIT 1",
                                                     (partition, extent)).fetchone() is not None)

    async def dequeue(self, partition, extent):
        def go(db):
            db.execute("DELETE FROM delq WHERE pid=? AND extent=?", (partition, extent))
            if db.execute("SELECT 1 FROM slices WHERE pid=? AND extent=? LIMIT 1", (partition, extent)).fetchone() \
                    is None:
                db.execute("DELETE FROM extents WHERE pid=? AND extent=?", (partition, extent))
        await self._run(go)

    async def usage(self):
        return await self._run(lambda db: db.execute("SELECT count(*), coalesce(sum(size), 0) FROM inodes "
                                                      "WHERE mode & ? = ?", (S_IFMT, stat.S_IFREG)).fetchone())

    # -- xattrs
    async def getxattr(self, ino, name):
        def go(db):
            self._get(db, ino)
            row = db.execute("SELECT value FROM xattrs WHERE ino=? AND name=?", (ino, name)).fetchone()
            if row is None:
                raise MetaError(errno.ENODATA)
            return row[0]
        return await self._run(go)

    async def setxattr(self, ino, name, value):
        def go(db):
            self._get(db, ino)
            db.execute("INSERT OR REPLACE INTO xattrs VALUES (?,?,?)", (ino, name, value))
            db.execute("UPDATE inodes SET ctime=? WHERE ino=?", (time.time_ns(), ino))
        await self._run(go)

    async def listxattr(self, ino):
        return await self._run(lambda db: [r[0] for r in db.execute("SELECT name FROM xattrs WHERE ino=?", (ino,))])

    async def removexattr(self, ino, name):
        def go(db):
            if db.execute("DELETE FROM xattrs WHERE ino=? AND name=?", (ino, name)).rowcount == 0:
                raise MetaError(errno.ENODATA)
        await self._run(go)

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
            for (ino, *rest) in db.execute("SELECT ino, off, len, pid, extent, ext_off, wpos, wlen, crc FROM slices "
                                           "ORDER BY ino, off"):
                s = Slice(*rest)
                p = prev.get(ino)
                if p is not None and p.end > s.off:
                    out.append({"kind": "overlapping_slices", "ino": ino, "off": s.off})
                prev[ino] = s
            return out
        return await self._run(go)

    async def all_slices(self):
        return await self._run(lambda db: [(r[0], Slice(*r[1:])) for r in db.execute(
            "SELECT ino, off, len, pid, extent, ext_off, wpos, wlen, crc FROM slices ORDER BY pid, extent, wpos")])

    async def known_extents(self):
        return await self._run(lambda db: {tuple(r) for r in db.execute("SELECT pid, extent FROM extents")})

    async def repair(self, problems):
        def go(db):
            done = []
            for p in problems:
                if p["kind"] == "dangling_entry":
                    db.execute("DELETE FROM dentries WHERE parent=? AND ino=?", (p["parent"], p["ino"]))
                    done.append({**p, "action": "entry removed"})
                elif p["kind"] == "orphan_inode":
                    db.execute("UPDATE inodes SET nlink=0 WHERE ino=?", (p["ino"],))
                    self._remove(db, p["ino"])
                    done.append({**p, "action": "inode removed, its extents queued for deletion"})
                elif p["kind"] == "wrong_nlink":
                    db.execute("UPDATE inodes SET nlink=? WHERE ino=?", (p["entries"], p["ino"]))
                    done.append({**p, "action": f"nlink set to {p['entries']}"})
                elif p["kind"] == "unreferenced_extent":
                    db.execute("INSERT OR IGNORE INTO delq VALUES (?,?)", (p["partition"], p["extent"]))
                    done.append({**p, "action": "queued for deletion"})
            return done
        return await self._run(go)
