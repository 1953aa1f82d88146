"""The metadata engine interface of the mounted filesystem (dnfs): what every engine stores and answers.

The model (after JuiceFS's metadata engines and CubeFS's metanode, facts only):

* **inodes** with POSIX attributes (times in ns), a symlink target, extended attributes;
* **directory entries** ``(parent, name) -> inode``, listed in a stable order with a resumable cookie;
* **slices**: a file's content is an ordered, non-overlapping list of windows onto data on the datanodes.
  A slice says: file bytes ``[off, off+length)`` are extent ``extent`` of partition ``partition`` from
  ``ext_off`` on.  ``(wpos, wlen, crc)`` name the whole piece as it was written (one SDK append) and its
  CRC32C, so ``fsck`` can verify it even after the window was trimmed.  Newer data wins: committing a slice
  cuts away whatever older slices it covers.  A byte no slice covers (below the file size) reads as zero;
* **inline slices** (engines with ``inline_max``): a small file's bytes kept in the slice itself, committed
  in the same transaction as its other metadata -- no extent, nothing to reclaim;
* a **deletion queue** of extents that may have lost their last slice.  The filesystem deletes an extent
  on the datanodes only after checking, at that moment, that no slice references it any more.

* **open-file sessions**: which mounts have an inode open.  An inode whose last link is gone is removed
  (and its extents queued) only once no mount has it open; the sessions of a mount that died expire (an
  etcd lease; for SQLite, the single mount's own lock) and its open inodes are then reclaimed.

Engines are async (their blocking client calls run in worker threads).  Every method that changes more
than one record is one transaction.  Errors a caller should turn into an errno raise :class:`MetaError`.

The namespace and data rules (lookup, create, link, unlink, rmdir, rename, commit, truncate, remove...)
are written once, here in :class:`Meta`, over the small storage primitives of one transaction
(:class:`MetaTx`) that each engine implements on its store.
"""
from __future__ import annotations

import abc
import dataclasses
import errno
import stat
import time
from typing import Callable, Sequence, TypeVar

from client.fs import acl

T = TypeVar("T")

ROOT = 1
NAME_MAX = 255
DIRENT = 20          # a directory's size grows by this per entry, "." and ".." included (as tmpfs counts)


class MetaError(Exception):
    """A metadata operation was refused; ``errno`` is what the kernel should see."""

    def __init__(self, err: int, message: str = ""):
        super().__init__(message or errno.errorcode.get(err, str(err)))
        self.errno = err


class MetaBusy(Exception):
    """The metadata store is in use by another mount (single-mount engines)."""


@dataclasses.dataclass
class Attr:
    ino: int
    mode: int
    nlink: int
    uid: int
    gid: int
    rdev: int = 0
    size: int = 0
    atime_ns: int = 0
    mtime_ns: int = 0
    ctime_ns: int = 0

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.mode)

    @property
    def is_reg(self) -> bool:
        return stat.S_ISREG(self.mode)


@dataclasses.dataclass(frozen=True)
class Slice:
    off: int          # file offset of the window
    length: int       # window length
    partition: int
    extent: int
    ext_off: int      # extent offset of the window's first byte
    wpos: int         # the written piece: extent offset ...
    wlen: int         # ... its length ...
    crc: int          # ... and its CRC32C
    data: bytes | None = None     # an inline slice's bytes (kept in the metadata; no extent, partition 0)

    @property
    def end(self) -> int:
        return self.off + self.length

    @property
    def inline(self) -> bool:
        return self.data is not None

    def cut(self, start: int, end: int) -> "Slice":
        """The part of this slice inside file range [start, end)."""
        s, e = max(start, self.off), min(end, self.end)
        data = None if self.data is None else self.data[s - self.off:e - self.off]
        return dataclasses.replace(self, off=s, length=e - s, ext_off=self.ext_off + (s - self.off), data=data)


def check_length(name: bytes) -> None:
    if len(name) > NAME_MAX:
        raise MetaError(errno.ENAMETOOLONG, f"name longer than {NAME_MAX} bytes")


def check_name(name: bytes) -> None:
    check_length(name)
    if not name or b"/" in name or name in (b".", b".."):
        raise MetaError(errno.EINVAL, f"bad name {name!r}")


def overlay(old: Sequence[Slice], new: Slice) -> tuple[list[Slice], list[Slice]]:
    """``old`` (sorted, non-overlapping) with ``new`` on top: returns (kept pieces to write back in place of
    the overlapping ones, the overlapping old slices that were removed or trimmed)."""
    kept, touched = [], []
    for s in old:
        if s.end <= new.off or s.off >= new.end:
            continue
        touched.append(s)
        if s.off < new.off:
            kept.append(s.cut(s.off, new.off))
        if s.end > new.end:
            kept.append(s.cut(new.end, s.end))
    return kept, touched


def coalesce(pieces: Sequence[Slice]) -> list[Slice]:
    """``pieces`` (in file order) with each run of extent-neighbours -- the next piece's bytes follow the
    previous one's both in the file and in the same extent -- joined into one window, so reading them is one
    request instead of one per piece (a file written 4 KiB + fsync at a time has a slice per write, all in a
    row of one extent).  Only for reading: the joined window's ``(wpos, wlen, crc)`` are its first piece's."""
    out: list[Slice] = []
    for p in pieces:
        last = out[-1] if out else None
        if (last is not None and not p.inline and not last.inline and p.partition == last.partition
                and p.extent == last.extent and p.off == last.end and p.ext_off == last.ext_off + last.length):
            out[-1] = dataclasses.replace(last, length=last.length + p.length)
        else:
            out.append(p)
    return out


class MetaTx(abc.ABC):
    """The storage primitives of one metadata transaction: what an engine implements on its store.  Reads see
    the transaction's own writes; nothing is visible to others before the transaction commits."""

    @abc.abstractmethod
    def attr(self, ino: int) -> Attr | None: ...

    @abc.abstractmethod
    def put_attr(self, a: Attr) -> None:
        """Write an existing inode's attributes (its symlink target is kept)."""

    @abc.abstractmethod
    def new_inode(self, a: Attr, target: bytes) -> Attr:
        """Store a new inode (``a.ino`` is ignored); returns it with its number."""

    @abc.abstractmethod
    def target(self, ino: int) -> bytes: ...

    @abc.abstractmethod
    def child(self, parent: int, name: bytes) -> int | None: ...

    @abc.abstractmethod
    def has_children(self, ino: int) -> bool: ...

    @abc.abstractmethod
    def add_entry(self, parent: int, name: bytes, ino: int) -> None:
        """A new entry (a new readdir position)."""

    @abc.abstractmethod
    def set_entry(self, parent: int, name: bytes, ino: int) -> None:
        """Point an existing entry at another inode (its readdir position is kept)."""

    @abc.abstractmethod
    def move_entry(self, p1: int, n1: bytes, p2: int, n2: bytes, ino: int) -> None:
        """Move entry (p1, n1) -> ino to (p2, n2); no entry exists at (p2, n2)."""

    @abc.abstractmethod
    def del_entry(self, parent: int, name: bytes) -> None: ...

    @abc.abstractmethod
    def drop_inode(self, ino: int) -> None:
        """Delete an inode with its slices (their extents go to the deletion queue) and extended attributes."""

    @abc.abstractmethod
    def unlinked(self, ino: int) -> None:
        """The inode's last link is gone (it is removed once nobody has it open)."""

    @abc.abstractmethod
    def is_open(self, ino: int) -> bool:
        """Does a live mount session have the inode open?"""

    @abc.abstractmethod
    def slices(self, ino: int, start: int = 0, end: int | None = None) -> list[Slice]:
        """The file's slices in offset order (with ``end``: at least those overlapping [start, end))."""

    @abc.abstractmethod
    def add_slice(self, ino: int, s: Slice) -> None: ...

    @abc.abstractmethod
    def drop_slice(self, ino: int, s: Slice) -> None:
        """Remove a slice; its extent (an inline slice has none) goes to the deletion queue (released once
        nothing references it)."""

    @abc.abstractmethod
    def wrote_extent(self, partition: int, extent: int) -> None:
        """Remember an extent data was committed into (fsck: extents nobody references)."""

    @abc.abstractmethod
    def xattr(self, ino: int, name: bytes) -> bytes | None:
        """An extended attribute's value, None if the inode has none of that name."""

    @abc.abstractmethod
    def put_xattr(self, ino: int, name: bytes, value: bytes | None) -> None:
        """Set an extended attribute (None: remove it if there is one)."""


class Meta(abc.ABC):
    """One metadata engine.  Names are bytes; times are ns since the epoch.

    The rules below run inside :meth:`_run`: one transaction of the engine, given its :class:`MetaTx`."""

    single_mount = True      # only one mount changes this tree (the kernel may cache negative lookups)
    quiet = None             # () -> bool, set by the mount: one request in flight, nothing waits behind it
    reclaim_all = False      # fsck: release extents whatever mount session wrote them
    inline_max = 0           # files no larger than this keep their bytes in their slices (0: never)
    created: tuple[str, ...] = ()   # files this open created (a new database): a mount that fails removes them

    @abc.abstractmethod
    async def _run(self, fn: Callable[..., T], *args) -> T:
        """``fn(tx, *args)`` as one transaction (retried as a whole if the engine needs to)."""

    def _now(self, fn: Callable[..., T], *args) -> T | None:
        """``fn(tx, *args)`` as one transaction right now, without waiting -- or None if the engine cannot
        (busy, or it waits for its store): then ``_run``.  For the mount's requests answered without a task."""
        return None

    async def _run_durable(self, fn: Callable[..., T], *args) -> T:
        """``_run``, then ``sync``: this transaction and every one before it are durable when it returns.  An
        engine that can do both in one step overrides it."""
        out = await self._run(fn, *args)
        await self.sync()
        return out

    # -- lifecycle
    @abc.abstractmethod
    async def close(self) -> None: ...

    @abc.abstractmethod
    async def sync(self) -> None:
        """Make every committed change durable (fsync returns only after this)."""

    def stats(self) -> dict:
        """The engine's own counters (``dnfs stats``)."""
        return {}

    # -- open-file sessions
    async def keep_session(self) -> None:
        """Run for as long as the mount lives: keeps this mount's session alive (where it can expire)."""

    @abc.abstractmethod
    async def opened(self, ino: int) -> None:
        """This mount has the inode open (its first open here)."""

    @abc.abstractmethod
    async def closed(self, ino: int) -> bool:
        """This mount closed the inode (its last close here).  Removes the inode if its last link is gone and
        no mount has it open any more; returns whether it did."""

    # -- tree (the rules)
    @staticmethod
    def _get(tx: MetaTx, ino: int) -> Attr:
        a = tx.attr(ino)
        if a is None:
            raise MetaError(errno.ENOENT, f"inode {ino}")
        return a

    def _dir(self, tx: MetaTx, ino: int) -> Attr:
        a = self._get(tx, ino)
        if not a.is_dir:
            raise MetaError(errno.ENOTDIR)
        return a

    def _existing(self, tx: MetaTx, parent: int, name: bytes) -> int:
        ino = tx.child(parent, name)
        if ino is None:
            self._dir(tx, parent)
            raise MetaError(errno.ENOENT)
        return ino

    def _touch(self, tx: MetaTx, ino: int, now: int, nlink: int = 0, entries: int = 0) -> None:
        """A directory's entries changed: its times, its link count (subdirectories) and its size."""
        a = self._get(tx, ino)
        a.mtime_ns = a.ctime_ns = now
        a.nlink += nlink
        a.size = max(2 * DIRENT, a.size + entries * DIRENT)
        tx.put_attr(a)

    def _drop_entry(self, tx: MetaTx, parent: int, name: bytes, ino: int, now: int) -> Attr:
        """Remove the entry (parent, name) -> ino; one link less (a directory loses both of its own)."""
        a = self._get(tx, ino)
        tx.del_entry(parent, name)
        if a.is_dir:
            a.nlink = 0
            self._touch(tx, parent, now, -1, -1)
        else:
            a.nlink -= 1
            self._touch(tx, parent, now, 0, -1)
        a.ctime_ns = now
        tx.put_attr(a)
        if a.nlink <= 0 and not a.is_dir:
            tx.unlinked(ino)
        return a

    async def lookup(self, parent: int, name: bytes) -> Attr:
        check_length(name)
        return await self._run(lambda tx: self._get(tx, self._existing(tx, parent, name)))

    async def getattr(self, ino: int) -> Attr:
        return await self._run(self._get, ino)

    def lookup_now(self, parent: int, name: bytes) -> Attr | None:
        """``lookup`` if the engine can answer at once (``_now``), else None."""
        check_length(name)
        return self._now(lambda tx: self._get(tx, self._existing(tx, parent, name)))

    def getattr_now(self, ino: int) -> Attr | None:
        """``getattr`` if the engine can answer at once (``_now``), else None."""
        return self._now(self._get, ino)

    async def setattr(self, ino: int, *, mode=None, uid=None, gid=None, atime_ns=None, mtime_ns=None,
                      ctime_ns: int) -> Attr:
        def go(tx):
            a = self._get(tx, ino)
            if mode is not None:
                a.mode = (a.mode & ~0o7777) | (mode & 0o7777)
                rules = tx.xattr(ino, acl.ACCESS)
                if rules is not None:        # a chmod rewrites the access ACL's owner, mask and other entries
                    tx.put_xattr(ino, acl.ACCESS, acl.encode(acl.chmod(acl.parse(rules), a.mode)))
            for k, v in (("uid", uid), ("gid", gid), ("atime_ns", atime_ns), ("mtime_ns", mtime_ns)):
                if v is not None:
                    setattr(a, k, v)
            a.ctime_ns = ctime_ns
            tx.put_attr(a)
            return a
        return await self._run(go)

    async def create(self, parent: int, name: bytes, mode: int, uid: int, gid: int, rdev: int = 0,
                     target: bytes = b"") -> Attr:
        """A new inode (file, directory, symlink with ``target``, device, fifo) and its entry.  In a
        set-group-ID directory it takes the directory's group (a directory also the bit); in a directory with
        a default ACL, the ACL (:func:`client.fs.acl.inherit`)."""
        check_name(name)

        def go(tx):
            p = self._dir(tx, parent)
            if tx.child(parent, name) is not None:
                raise MetaError(errno.EEXIST)
            now = time.time_ns()
            is_dir = stat.S_ISDIR(mode)
            m, g = mode, gid
            if p.mode & stat.S_ISGID:
                g = p.gid
                if is_dir:
                    m |= stat.S_ISGID
            default = tx.xattr(parent, acl.DEFAULT)
            rules = inherited = None
            if default is not None:
                m, rules, inherited = acl.inherit(default, m)
            a = tx.new_inode(Attr(0, m, 2 if is_dir else 1, uid, g, rdev, 2 * DIRENT if is_dir else len(target),
                                  now, now, now), target)
            if rules is not None:
                tx.put_xattr(a.ino, acl.ACCESS, rules)
            if inherited is not None:
                tx.put_xattr(a.ino, acl.DEFAULT, inherited)
            tx.add_entry(parent, name, a.ino)
            self._touch(tx, parent, now, 1 if is_dir else 0, 1)
            return a
        return await self._run(go)

    async def set_acl(self, ino: int, rules: bytes, *, keep_sgid: bool, ctime_ns: int) -> Attr:
        """Set an inode's access ACL: its mode's permission bits follow the ACL (and its set-group-ID bit goes
        unless ``keep_sgid``: the caller is in the file's group or may keep it), and an ACL the mode says
        exactly is not stored -- one transaction, so no reader sees the one without the other."""
        entries = acl.parse(rules)

        def go(tx):
            a = self._get(tx, ino)
            a.mode = (a.mode & ~0o777) | acl.mode_bits(entries)
            if not keep_sgid:
                a.mode &= ~stat.S_ISGID
            a.ctime_ns = ctime_ns
            tx.put_attr(a)
            tx.put_xattr(ino, acl.ACCESS, None if acl.equivalent(entries) else rules)
            return a
        return await self._run(go)

    async def link(self, ino: int, parent: int, name: bytes) -> Attr:
        check_name(name)

        def go(tx):
            a = self._get(tx, ino)
            if a.is_dir:
                raise MetaError(errno.EPERM, "hard link to a directory")
            self._dir(tx, parent)
            if tx.child(parent, name) is not None:
                raise MetaError(errno.EEXIST)
            now = time.time_ns()
            tx.add_entry(parent, name, ino)
            a.nlink += 1
            a.ctime_ns = now
            tx.put_attr(a)
            self._touch(tx, parent, now, 0, 1)
            return a
        return await self._run(go)

    async def unlink(self, parent: int, name: bytes, *,
                     held: Callable[[int], bool] | None = None) -> tuple[Attr, bool]:
        """Remove a non-directory entry; returns the inode's attributes after and whether the inode went too.
        With ``held`` (does this process still keep something of the inode?), an inode that lost its last
        link, that no mount has open and that ``held`` says is not kept is removed in the same transaction
        (what :meth:`remove` does): `rm` of a closed file is one transaction, not a second one at the
        kernel's FORGET.  Otherwise nlink may be 0 and the caller removes it once nothing has it open."""
        def go(tx):
            ino = self._existing(tx, parent, name)
            if self._get(tx, ino).is_dir:
                raise MetaError(errno.EISDIR)
            a = self._drop_entry(tx, parent, name, ino, time.time_ns())
            gone = a.nlink <= 0 and held is not None and not held(ino) and self._remove(tx, ino)
            return a, gone
        return await self._run(go)

    async def rmdir(self, parent: int, name: bytes) -> None:
        def go(tx):
            ino = self._existing(tx, parent, name)
            self._dir(tx, ino)
            if tx.has_children(ino):
                raise MetaError(errno.ENOTEMPTY)
            self._drop_entry(tx, parent, name, ino, time.time_ns())
            tx.drop_inode(ino)
        await self._run(go)

    async def rename(self, p1: int, n1: bytes, p2: int, n2: bytes, *, noreplace: bool = False,
                     exchange: bool = False) -> Attr | None:
        """Returns the replaced inode's attributes (nlink may now be 0), or None."""
        check_name(n2)

        def go(tx):
            src = self._existing(tx, p1, n1)
            self._dir(tx, p2)
            dst = tx.child(p2, n2)
            if src == dst:
                return None
            now = time.time_ns()
            sa = self._get(tx, src)
            if exchange:
                if dst is None:
                    raise MetaError(errno.ENOENT)
                da = self._get(tx, dst)
                tx.set_entry(p1, n1, dst)
                tx.set_entry(p2, n2, src)
                moved = (1 if sa.is_dir else -1) if p1 != p2 and sa.is_dir != da.is_dir else 0
                self._touch(tx, p1, now, -moved)
                self._touch(tx, p2, now, moved)
                for a in (self._get(tx, src), self._get(tx, dst)):
                    a.ctime_ns = now
                    tx.put_attr(a)
                return None
            replaced = None
            if dst is not None:
                if noreplace:
                    raise MetaError(errno.EEXIST)
                da = self._get(tx, dst)
                if sa.is_dir and not da.is_dir:
                    raise MetaError(errno.ENOTDIR)
                if da.is_dir and not sa.is_dir:
                    raise MetaError(errno.EISDIR)
                if da.is_dir and tx.has_children(dst):
                    raise MetaError(errno.ENOTEMPTY)
                replaced = self._drop_entry(tx, p2, n2, dst, now)
                if da.is_dir:
                    tx.drop_inode(dst)
                    replaced = None
            tx.move_entry(p1, n1, p2, n2, src)
            sa = self._get(tx, src)
            sa.ctime_ns = now
            tx.put_attr(sa)
            moved = 1 if sa.is_dir and p1 != p2 else 0
            self._touch(tx, p1, now, -moved, -1)
            self._touch(tx, p2, now, moved, 1)
            return replaced
        return await self._run(go)

    @abc.abstractmethod
    async def readdir(self, ino: int, after: int, limit: int) -> list[tuple[bytes, Attr, int]]:
        """Up to ``limit`` entries after cookie ``after`` (0: from the start): (name, attr, cookie)."""

    async def readlink(self, ino: int) -> bytes:
        def go(tx):
            if not stat.S_ISLNK(self._get(tx, ino).mode):
                raise MetaError(errno.EINVAL)
            return tx.target(ino)
        return await self._run(go)

    def _remove(self, tx: MetaTx, ino: int) -> bool:
        a = tx.attr(ino)
        if a is None or a.nlink > 0 or tx.is_open(ino):
            return False
        tx.drop_inode(ino)
        return True

    async def remove(self, ino: int) -> bool:
        """Drop an inode whose link count is 0 and that no mount has open (its slices' extents go to the
        deletion queue); returns whether it did."""
        return await self._run(self._remove, ino)

    @abc.abstractmethod
    async def orphans(self) -> list[int]:
        """Inodes with no links left that no live mount has open (a crash between the last unlink and the
        last close): :meth:`remove` them."""

    # -- data
    async def slices(self, ino: int) -> list[Slice]:
        def go(tx):
            self._get(tx, ino)
            return tx.slices(ino)
        return await self._run(go)

    @staticmethod
    def _lay(tx: MetaTx, ino: int, new: Slice) -> None:
        """Cut away what ``new`` covers of the file's slices (``new`` itself is not added)."""
        kept, touched = overlay(tx.slices(ino, new.off, new.end), new)
        for s in touched:
            tx.drop_slice(ino, s)
        for s in kept:
            tx.add_slice(ino, s)

    async def commit(self, ino: int, new: Sequence[Slice], size: int, mtime_ns: int, *,
                     durable: bool = False) -> Attr:
        """Lay ``new`` (in order) over the file's slices, grow its size to at least ``size``.  ``durable``
        (an fsync): this commit and every one before it are durable when it returns (``_run_durable``)."""
        def go(tx):
            a = self._get(tx, ino)
            for s in new:
                self._lay(tx, ino, s)
                tx.add_slice(ino, s)
                if not s.inline:
                    tx.wrote_extent(s.partition, s.extent)
            a.size = max(a.size, size)
            a.mtime_ns = a.ctime_ns = mtime_ns
            tx.put_attr(a)
            return a
        return await (self._run_durable(go) if durable else self._run(go))

    async def truncate(self, ino: int, size: int, mtime_ns: int) -> Attr:
        def go(tx):
            a = self._get(tx, ino)
            if a.is_dir:
                raise MetaError(errno.EISDIR)
            if size < a.size:
                self._lay(tx, ino, Slice(size, max(a.size, 1 << 62) - size, 0, 0, 0, 0, 0, 0))
            a.size, a.mtime_ns, a.ctime_ns = size, mtime_ns, mtime_ns
            tx.put_attr(a)
            return a
        return await self._run(go)

    # -- deletion queue and accounting
    @abc.abstractmethod
    async def queued(self, limit: int) -> list[tuple[int, int]]:
        """(partition, extent) pairs waiting in the deletion queue."""

    @abc.abstractmethod
    async def referenced(self, partition: int, extent: int) -> bool: ...

    @abc.abstractmethod
    async def dequeue(self, partition: int, extent: int) -> None: ...

    @abc.abstractmethod
    async def usage(self) -> tuple[int, int]:
        """(inode count -- every kind, sum of the regular files' sizes)."""

    # -- extended attributes
    @abc.abstractmethod
    async def getxattr(self, ino: int, name: bytes) -> bytes: ...

    @abc.abstractmethod
    async def setxattr(self, ino: int, name: bytes, value: bytes) -> None: ...

    @abc.abstractmethod
    async def listxattr(self, ino: int) -> list[bytes]: ...

    @abc.abstractmethod
    async def removexattr(self, ino: int, name: bytes) -> None: ...

    # -- fsck
    @abc.abstractmethod
    async def check(self) -> list[dict]:
        """Structural problems (dangling entries, wrong link counts, overlapping slices): [{kind, ...}]."""

    @abc.abstractmethod
    async def all_slices(self) -> list[tuple[int, Slice]]: ...

    @abc.abstractmethod
    async def known_extents(self) -> set[tuple[int, int]]:
        """Every (partition, extent) a slice was ever committed into and not yet deleted."""

    @abc.abstractmethod
    async def repair(self, problems: list[dict]) -> list[dict]:
        """Fix what is safe to fix; returns what was done."""
