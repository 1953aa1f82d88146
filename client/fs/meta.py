"""The metadata engine interface of the mounted filesystem (dnfs): what every engine stores and answers.

The model (after JuiceFS's metadata engines and CubeFS's metanode, facts only):

* **inodes** with POSIX attributes (times in ns), a symlink target, extended attributes;
* **directory entries** ``(parent, name) -> inode``, listed in a stable order with a resumable cookie;
* **slices**: a file's content is an ordered, non-overlapping list of windows onto data on the datanodes.
  A slice says: file bytes ``[off, off+length)`` are extent ``extent`` of partition ``partition`` from
  ``ext_off`` on.  ``(wpos, wlen, crc)`` name the whole piece as it was written (one SDK append) and its
  CRC32C, so ``fsck`` can verify it even after the window was trimmed.  Newer data wins: committing a slice
  cuts away whatever older slices it covers.  A byte no slice covers (below the file size) reads as zero;
* a **deletion queue** of extents that may have lost their last slice.  The filesystem deletes an extent
  on the datanodes only after checking, at that moment, that no slice references it any more.

Engines are async (their blocking client calls run in worker threads).  Every method that changes more
than one record is one transaction.  Errors a caller should turn into an errno raise :class:`MetaError`.
"""
from __future__ import annotations

import abc
import dataclasses
import errno
import stat
from typing import Sequence

ROOT = 1
NAME_MAX = 255


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

    @property
    def end(self) -> int:
        return self.off + self.length

    def cut(self, start: int, end: int) -> "Slice":
        """The part of this slice inside file range [start, end)."""
        s, e = max(start, self.off), min(end, self.end)
        return dataclasses.replace(self, off=s, length=e - s, ext_off=self.ext_off + (s - self.off))


def check_name(name: bytes) -> None:
    if len(name) > NAME_MAX:
        raise MetaError(errno.ENAMETOOLONG, f"name longer than {NAME_MAX} bytes")
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


class Meta(abc.ABC):
    """One metadata engine.  Names are bytes; times are ns since the epoch."""

    single_mount = True      # only one mount changes this tree (the kernel may cache negative lookups)
    reclaim_all = False      # fsck: release extents whatever mount session wrote them

    # -- lifecycle
    @abc.abstractmethod
    async def close(self) -> None: ...

    @abc.abstractmethod
    async def sync(self) -> None:
        """Make every committed change durable (fsync returns only after this)."""

    # -- tree
    @abc.abstractmethod
    async def lookup(self, parent: int, name: bytes) -> Attr: ...

    @abc.abstractmethod
    async def getattr(self, ino: int) -> Attr: ...

    @abc.abstractmethod
    async def setattr(self, ino: int, *, mode=None, uid=None, gid=None, atime_ns=None, mtime_ns=None,
                      ctime_ns: int) -> Attr: ...

    @abc.abstractmethod
    async def create(self, parent: int, name: bytes, mode: int, uid: int, gid: int, rdev: int = 0,
                     target: bytes = b"") -> Attr:
        """A new inode (file, directory, symlink with ``target``, device, fifo) and its entry."""

    @abc.abstractmethod
    async def link(self, ino: int, parent: int, name: bytes) -> Attr: ...

    @abc.abstractmethod
    async def unlink(self, parent: int, name: bytes) -> Attr:
        """Remove a non-directory entry; returns the inode's attributes after (nlink may be 0: the caller
        removes the inode with :meth:`remove` once nothing has it open)."""

    @abc.abstractmethod
    async def rmdir(self, parent: int, name: bytes) -> None: ...

    @abc.abstractmethod
    async def rename(self, p1: int, n1: bytes, p2: int, n2: bytes, *, noreplace: bool = False,
                     exchange: bool = False) -> Attr | None:
        """Returns the replaced inode's attributes (nlink may now be 0), or None."""

    @abc.abstractmethod
    async def readdir(self, ino: int, after: int, limit: int) -> list[tuple[bytes, Attr, int]]:
        """Up to ``limit`` entries after cookie ``after`` (0: from the start): (name, attr, cookie)."""

    @abc.abstractmethod
    async def readlink(self, ino: int) -> bytes: ...

    @abc.abstractmethod
    async def remove(self, ino: int) -> None:
        """Drop an inode whose link count is 0 (its slices' extents go to the deletion queue)."""

    @abc.abstractmethod
    async def orphans(self) -> list[int]:
        """Inodes with no links left (a crash between the last unlink and the last close)."""

    # -- data
    @abc.abstractmethod
    async def slices(self, ino: int) -> list[Slice]: ...

    @abc.abstractmethod
    async def commit(self, ino: int, new: Sequence[Slice], size: int, mtime_ns: int) -> Attr:
        """Lay ``new`` (in order) over the file's slices, grow its size to at least ``size``."""

    @abc.abstractmethod
    async def truncate(self, ino: int, size: int, mtime_ns: int) -> Attr: ...

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
        """(inode count, sum of file sizes)."""

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
