"""What the FUSE handlers (:mod:`client.fs.fs`) and the session (:mod:`client.fs.fuse_session`) hand each
other: attributes, an open file's handle and flags, statfs figures, which fields a SETATTR changes, who asks,
and the one error type a handler raises.  Plain data, no I/O."""
from __future__ import annotations

import errno

ENOATTR = errno.ENODATA          # "no such extended attribute" (Linux spells it ENODATA)
RENAME_NOREPLACE = 1             # rename2(2)'s flags, as the kernel passes them
RENAME_EXCHANGE = 2


class FUSEError(Exception):
    """A handler's answer is this errno (the kernel hands it to the caller)."""

    def __init__(self, errno_: int):
        super().__init__(errno_)
        self.errno = errno_

    def __str__(self) -> str:
        return f"FUSEError({errno.errorcode.get(self.errno, self.errno)})"


class EntryAttributes:
    """An inode's attributes, and how long the kernel may keep them (and the name that led to it)."""
    __slots__ = ("st_ino", "generation", "entry_timeout", "attr_timeout", "st_mode", "st_nlink", "st_uid",
                 "st_gid", "st_rdev", "st_size", "st_blksize", "st_blocks", "st_atime_ns", "st_mtime_ns",
                 "st_ctime_ns")

    def __init__(self) -> None:
        self.st_ino = self.generation = 0
        self.entry_timeout = self.attr_timeout = 0.0
        self.st_mode = self.st_nlink = self.st_uid = self.st_gid = self.st_rdev = 0
        self.st_size = self.st_blocks = 0
        self.st_blksize = 4096
        self.st_atime_ns = self.st_mtime_ns = self.st_ctime_ns = 0


class FileInfo:
    """An open's answer: its handle, and whether the kernel may keep the file's cached pages."""
    __slots__ = ("fh", "keep_cache", "direct_io", "nonseekable")

    def __init__(self, fh: int = 0, keep_cache: bool = False, direct_io: bool = False,
                 nonseekable: bool = False):
        self.fh, self.keep_cache, self.direct_io, self.nonseekable = fh, keep_cache, direct_io, nonseekable


class StatvfsData:
    __slots__ = ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files", "f_ffree", "f_favail",
                 "f_namemax")

    def __init__(self) -> None:
        for k in self.__slots__:
            setattr(self, k, 0)


class SetattrFields:
    """Which of a SETATTR's attributes are to change (``kill_suidgid``: clear set-user-ID, and set-group-ID
    on a group-executable file, as a write by an unprivileged caller would)."""
    __slots__ = ("update_mode", "update_uid", "update_gid", "update_size", "update_atime", "update_mtime",
                 "update_ctime", "kill_suidgid")

    def __init__(self, update_mode=False, update_uid=False, update_gid=False, update_size=False,
                 update_atime=False, update_mtime=False, update_ctime=False, kill_suidgid=False) -> None:
        self.update_mode, self.update_uid, self.update_gid = update_mode, update_uid, update_gid
        self.update_size, self.update_atime, self.update_mtime = update_size, update_atime, update_mtime
        self.update_ctime, self.kill_suidgid = update_ctime, kill_suidgid


class RequestContext:
    """Who made a request: its file-system uid and gid, its process, its umask (create, mkdir, mknod)."""
    __slots__ = ("uid", "gid", "pid", "umask")

    def __init__(self, uid: int = 0, gid: int = 0, pid: int = 0, umask: int = 0):
        self.uid, self.gid, self.pid, self.umask = uid, gid, pid, umask
