"""The kernel's FUSE protocol (``linux/fuse.h``, version 7.x) as a pure codec: the bytes of one request read
from /dev/fuse -> a typed :class:`Request`; an answer -> the bytes to write back.  No I/O (the session,
:mod:`client.fs.fuse_session`, reads and writes); tested against byte fixtures without a kernel.

Every message starts with a header (``fuse_in_header``: length, opcode, unique id, node id, the caller's
uid/gid/pid); its body is a fixed struct per opcode, then (for some) NUL-terminated names or the data.  A
reply is ``fuse_out_header`` (length, -errno, the request's unique id) and, on success, the opcode's out
struct.  Notifications (the file system telling the kernel to drop cached pages) are replies with unique 0
and the notification's code in the error field.

A request this codec cannot make sense of raises :class:`Malformed` (with its unique id when the header was
readable, so the session answers EIO to that request alone); an opcode it does not know parses to a
request whose ``args`` is None (the session answers ENOSYS, and the kernel stops sending most of those).
"""
from __future__ import annotations

import enum
import struct
from typing import NamedTuple

from client.fs.fuse_types import EntryAttributes, FileInfo, StatvfsData

KERNEL_MAJOR = 7
KERNEL_MINOR = 38            # the newest layout this codec speaks; a newer kernel talks down to it

# INIT flags (fuse_init_in/out.flags; flags2 holds bits 32-63 when INIT_EXT is set)
ASYNC_READ = 1 << 0
POSIX_LOCKS = 1 << 1
ATOMIC_O_TRUNC = 1 << 3
EXPORT_SUPPORT = 1 << 4
BIG_WRITES = 1 << 5
DONT_MASK = 1 << 6
AUTO_INVAL_DATA = 1 << 12
DO_READDIRPLUS = 1 << 13
READDIRPLUS_AUTO = 1 << 14
ASYNC_DIO = 1 << 15
WRITEBACK_CACHE = 1 << 16
PARALLEL_DIROPS = 1 << 18
HANDLE_KILLPRIV = 1 << 19
POSIX_ACL = 1 << 20
MAX_PAGES = 1 << 22
CACHE_SYMLINKS = 1 << 23
HANDLE_KILLPRIV_V2 = 1 << 28
SETXATTR_EXT = 1 << 29
INIT_EXT = 1 << 30

# SETATTR's valid bits
FATTR_MODE, FATTR_UID, FATTR_GID, FATTR_SIZE = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FATTR_ATIME, FATTR_MTIME, FATTR_FH = 1 << 4, 1 << 5, 1 << 6
FATTR_ATIME_NOW, FATTR_MTIME_NOW, FATTR_LOCKOWNER, FATTR_CTIME = 1 << 7, 1 << 8, 1 << 9, 1 << 10
FATTR_KILL_SUIDGID = 1 << 11

FOPEN_DIRECT_IO, FOPEN_KEEP_CACHE, FOPEN_NONSEEKABLE = 1 << 0, 1 << 1, 1 << 2
WRITE_KILL_SUIDGID = 1 << 2          # fuse_write_in.write_flags
OPEN_KILL_SUIDGID = 1 << 0           # fuse_open_in.open_flags / fuse_create_in.open_flags
FSYNC_FDATASYNC = 1 << 0
NOTIFY_INVAL_INODE = 2


class Op(enum.IntEnum):
    LOOKUP = 1
    FORGET = 2
    GETATTR = 3
    SETATTR = 4
    READLINK = 5
    SYMLINK = 6
    MKNOD = 8
    MKDIR = 9
    UNLINK = 10
    RMDIR = 11
    RENAME = 12
    LINK = 13
    OPEN = 14
    READ = 15
    WRITE = 16
    STATFS = 17
    RELEASE = 18
    FSYNC = 20
    SETXATTR = 21
    GETXATTR = 22
    LISTXATTR = 23
    REMOVEXATTR = 24
    FLUSH = 25
    INIT = 26
    OPENDIR = 27
    READDIR = 28
    RELEASEDIR = 29
    FSYNCDIR = 30
    GETLK = 31
    SETLK = 32
    SETLKW = 33
    ACCESS = 34
    CREATE = 35
    INTERRUPT = 36
    BMAP = 37
    DESTROY = 38
    IOCTL = 39
    POLL = 40
    NOTIFY_REPLY = 41
    BATCH_FORGET = 42
    FALLOCATE = 43
    READDIRPLUS = 44
    RENAME2 = 45
    LSEEK = 46
    COPY_FILE_RANGE = 47
    SYNCFS = 50
    TMPFILE = 51
    STATX = 52


NAMES = {op.value: op.name.lower() for op in Op}

IN_HEADER = struct.Struct("<IIQQIIIHH")       # len, opcode, unique, nodeid, uid, gid, pid, total_extlen, pad
OUT_HEADER = struct.Struct("<IiQ")            # len, error (-errno), unique
_ATTR = "QQQqqqIIIIIIIIII"                    # fuse_attr (times signed: before 1970 is a time too)
ATTR = struct.Struct("<" + _ATTR)
ENTRY_OUT = struct.Struct("<QQQQII" + _ATTR)  # nodeid, generation, entry_valid, attr_valid, their nsecs, attr
ATTR_OUT = struct.Struct("<QII" + _ATTR)      # attr_valid, attr_valid_nsec, dummy, attr
OPEN_OUT = struct.Struct("<QII")
WRITE_OUT = struct.Struct("<II")
GETXATTR_OUT = struct.Struct("<II")
STATFS_OUT = struct.Struct("<QQQQQIIII24x")
INIT_OUT = struct.Struct("<IIIIHHIIHHI28x")
DIRENT = struct.Struct("<QQII")               # ino, off, namelen, type; then the name, padded to 8 bytes
NOTIFY_INVAL_INODE_OUT = struct.Struct("<Qqq")

_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")
_2U32 = struct.Struct("<II")
_GETATTR_IN = struct.Struct("<IIQ")
_SETATTR_IN = struct.Struct("<IIQQQqqqIIIIIIII")
_MKNOD_IN = struct.Struct("<IIII")
_RENAME2_IN = struct.Struct("<QII")
_READ_IN = struct.Struct("<QQIIQII")          # fuse_read_in and fuse_write_in have the same layout
_RELEASE_IN = struct.Struct("<QIIQ")
_FLUSH_IN = struct.Struct("<QIIQ")
_FSYNC_IN = struct.Struct("<QII")
_INIT_IN = struct.Struct("<IIII")
_CREATE_IN = struct.Struct("<IIII")
_FORGET_ONE = struct.Struct("<QQ")


class Malformed(ValueError):
    """A request whose bytes do not fit its opcode's layout (``unique``: its id, or None if even the header
    is unreadable)."""

    def __init__(self, msg: str, unique: int | None = None, opcode: int | None = None):
        super().__init__(msg)
        self.unique, self.opcode = unique, opcode


# -- the requests' bodies
class Lookup(NamedTuple):
    name: bytes


class Forget(NamedTuple):
    nlookup: int


class BatchForget(NamedTuple):
    items: list          # [(nodeid, nlookup)]


class Getattr(NamedTuple):
    flags: int
    fh: int


class Setattr(NamedTuple):
    valid: int
    fh: int
    size: int
    lock_owner: int
    atime: int
    mtime: int
    ctime: int
    atimensec: int
    mtimensec: int
    ctimensec: int
    mode: int
    uid: int
    gid: int


class Empty(NamedTuple):
    pass


class Symlink(NamedTuple):
    name: bytes
    target: bytes


class Mknod(NamedTuple):
    mode: int
    rdev: int
    umask: int
    name: bytes


class Mkdir(NamedTuple):
    mode: int
    umask: int
    name: bytes


class Name(NamedTuple):        # UNLINK, RMDIR, REMOVEXATTR
    name: bytes


class Rename(NamedTuple):      # RENAME and RENAME2
    newdir: int
    flags: int
    old: bytes
    new: bytes


class Link(NamedTuple):
    oldnodeid: int
    name: bytes


class Open(NamedTuple):        # OPEN and OPENDIR
    flags: int
    open_flags: int


class Read(NamedTuple):        # READ, READDIR, READDIRPLUS
    fh: int
    offset: int
    size: int
    read_flags: int
    lock_owner: int
    flags: int


class Write(NamedTuple):
    fh: int
    offset: int
    size: int
    write_flags: int
    lock_owner: int
    flags: int
    data: bytes


class Release(NamedTuple):     # RELEASE and RELEASEDIR
    fh: int
    flags: int
    release_flags: int
    lock_owner: int


class Fsync(NamedTuple):       # FSYNC and FSYNCDIR
    fh: int
    fsync_flags: int


class Setxattr(NamedTuple):
    flags: int
    name: bytes
    value: bytes


class Getxattr(NamedTuple):
    size: int
    name: bytes


class Listxattr(NamedTuple):
    size: int


class Flush(NamedTuple):
    fh: int
    lock_owner: int


class Init(NamedTuple):
    major: int
    minor: int
    max_readahead: int
    flags: int               # flags | flags2 << 32


class Interrupt(NamedTuple):
    unique: int


class Access(NamedTuple):
    mask: int


class Create(NamedTuple):
    flags: int
    mode: int
    umask: int
    open_flags: int
    name: bytes


class Request:
    __slots__ = ("unique", "opcode", "nodeid", "uid", "gid", "pid", "args")

    def __init__(self, unique: int, opcode: int, nodeid: int, uid: int, gid: int, pid: int, args):
        self.unique, self.opcode, self.nodeid = unique, opcode, nodeid
        self.uid, self.gid, self.pid, self.args = uid, gid, pid, args

    def __repr__(self) -> str:
        return (f"Request({NAMES.get(self.opcode, self.opcode)} #{self.unique} node {self.nodeid} "
                f"uid {self.uid} pid {self.pid}: {self.args!r})")


def _cstr(buf: bytes, off: int) -> tuple[bytes, int]:
    """The NUL-terminated string at ``off`` and the offset after its NUL."""
    end = buf.find(b"\0", off)
    if end < 0:
        raise ValueError("a name without its terminating NUL")
    return buf[off:end], end + 1


def _name(buf: bytes, off: int) -> bytes:
    return _cstr(buf, off)[0]


def _body(fmt: struct.Struct, buf: bytes, off: int) -> tuple:
    if len(buf) < off + fmt.size:
        raise ValueError(f"{len(buf) - off} bytes of body, {fmt.size} expected")
    return fmt.unpack_from(buf, off)


H = IN_HEADER.size


def _lookup(b): return Lookup(_name(b, H))
def _forget(b): return Forget(_body(_U64, b, H)[0])
def _getattr(b): return Getattr(*_body(_GETATTR_IN, b, H)[::2])
def _empty(b): return Empty()
def _mkdir(b): return Mkdir(*_body(_2U32, b, H), _name(b, H + 8))
def _unlink(b): return Name(_name(b, H))
def _open(b): return Open(*_body(_2U32, b, H))
def _read(b): return Read(*_body(_READ_IN, b, H)[:6])
def _fsync(b): return Fsync(*_body(_FSYNC_IN, b, H)[:2])
def _listxattr(b): return Listxattr(_body(_2U32, b, H)[0])
def _interrupt(b): return Interrupt(_body(_U64, b, H)[0])
def _access(b): return Access(_body(_2U32, b, H)[0])
def _release(b): return Release(*_body(_RELEASE_IN, b, H))


def _flush(b):
    fh, _unused, _pad, owner = _body(_FLUSH_IN, b, H)
    return Flush(fh, owner)


def _batch_forget(b):
    count, _ = _body(_2U32, b, H)
    if len(b) < H + 8 + count * _FORGET_ONE.size:
        raise ValueError(f"BATCH_FORGET of {count} entries in {len(b)} bytes")
    return BatchForget([_FORGET_ONE.unpack_from(b, H + 8 + i * 16) for i in range(count)])


def _setattr(b):
    v = _body(_SETATTR_IN, b, H)
    # valid, pad, fh, size, lock_owner, atime, mtime, ctime, atimensec, mtimensec, ctimensec, mode, unused,
    # uid, gid, unused
    return Setattr(v[0], v[2], v[3], v[4], v[5], v[6], v[7], v[8], v[9], v[10], v[11], v[13], v[14])


def _symlink(b):
    name, off = _cstr(b, H)
    return Symlink(name, _name(b, off))


def _mknod(b):
    mode, rdev, umask, _ = _body(_MKNOD_IN, b, H)
    return Mknod(mode, rdev, umask, _name(b, H + 16))


def _rename(b):
    newdir = _body(_U64, b, H)[0]
    old, off = _cstr(b, H + 8)
    return Rename(newdir, 0, old, _name(b, off))


def _rename2(b):
    newdir, flags, _ = _body(_RENAME2_IN, b, H)
    old, off = _cstr(b, H + 16)
    return Rename(newdir, flags, old, _name(b, off))


def _link(b):
    return Link(_body(_U64, b, H)[0], _name(b, H + 8))


def _write(b):
    fh, off, size, wflags, owner, flags, _ = _body(_READ_IN, b, H)
    start = H + _READ_IN.size
    if len(b) != start + size:
        raise ValueError(f"WRITE of {size} bytes carries {len(b) - start}")
    return Write(fh, off, size, wflags, owner, flags, b[start:])


def _setxattr(b):
    size, flags = _body(_2U32, b, H)
    name, off = _cstr(b, H + 8)
    if len(b) != off + size:
        raise ValueError(f"SETXATTR value of {size} bytes carries {len(b) - off}")
    return Setxattr(flags, name, b[off:])


def _getxattr(b):
    size, _ = _body(_2U32, b, H)
    return Getxattr(size, _name(b, H + 8))


def _init(b):
    major, minor, ra, flags = _body(_INIT_IN, b, H)
    if flags & INIT_EXT and len(b) >= H + 20:
        flags |= _U32.unpack_from(b, H + 16)[0] << 32
    return Init(major, minor, ra, flags)


def _create(b):
    flags, mode, umask, open_flags = _body(_CREATE_IN, b, H)
    return Create(flags, mode, umask, open_flags, _name(b, H + 16))


PARSERS = {
    Op.LOOKUP: _lookup, Op.FORGET: _forget, Op.GETATTR: _getattr, Op.SETATTR: _setattr,
    Op.READLINK: _empty, Op.SYMLINK: _symlink, Op.MKNOD: _mknod, Op.MKDIR: _mkdir, Op.UNLINK: _unlink,
    Op.RMDIR: _unlink, Op.RENAME: _rename, Op.LINK: _link, Op.OPEN: _open, Op.READ: _read, Op.WRITE: _write,
    Op.STATFS: _empty, Op.RELEASE: _release, Op.FSYNC: _fsync, Op.SETXATTR: _setxattr,
    Op.GETXATTR: _getxattr, Op.LISTXATTR: _listxattr, Op.REMOVEXATTR: _unlink, Op.FLUSH: _flush,
    Op.INIT: _init, Op.OPENDIR: _open, Op.READDIR: _read, Op.RELEASEDIR: _release, Op.FSYNCDIR: _fsync,
    Op.ACCESS: _access, Op.CREATE: _create, Op.INTERRUPT: _interrupt, Op.DESTROY: _empty,
    Op.BATCH_FORGET: _batch_forget, Op.READDIRPLUS: _read, Op.RENAME2: _rename2, Op.SYNCFS: _empty,
}
_PARSE = {int(k): v for k, v in PARSERS.items()}


def parse(buf: bytes) -> Request:
    """One request as read from /dev/fuse.  Raises :class:`Malformed`."""
    if len(buf) < H:
        raise Malformed(f"a request of {len(buf)} bytes, shorter than its header")
    length, opcode, unique, nodeid, uid, gid, pid, extlen, _ = IN_HEADER.unpack_from(buf)
    if length != len(buf):
        raise Malformed(f"the header says {length} bytes, {len(buf)} were read", unique, opcode)
    fn = _PARSE.get(opcode)
    if fn is None:
        return Request(unique, opcode, nodeid, uid, gid, pid, None)
    if extlen:                       # extensions (security context, supplementary groups) we never ask for
        buf = buf[:len(buf) - extlen * 8]
    try:
        args = fn(buf)
    except (ValueError, struct.error, IndexError) as e:
        raise Malformed(f"{NAMES.get(opcode, opcode)}: {e}", unique, opcode) from None
    return Request(unique, opcode, nodeid, uid, gid, pid, args)


# -- replies
def error(unique: int, err: int) -> bytes:
    """A reply carrying only an errno (0: success with no body)."""
    return OUT_HEADER.pack(OUT_HEADER.size, -err, unique)


def reply(unique: int, body: bytes = b"") -> bytes:
    return OUT_HEADER.pack(OUT_HEADER.size + len(body), 0, unique) + body


def reply_header(unique: int, body_len: int) -> bytes:
    """The header of a success reply whose body goes in the same writev."""
    return OUT_HEADER.pack(OUT_HEADER.size + body_len, 0, unique)


def _secs(t: float) -> tuple[int, int]:
    if t <= 0:
        return 0, 0
    s = int(t)
    return s, int((t - s) * 1e9)


def _attr_fields(e: EntryAttributes) -> tuple:
    a, an = divmod(e.st_atime_ns, 1_000_000_000)
    m, mn = divmod(e.st_mtime_ns, 1_000_000_000)
    c, cn = divmod(e.st_ctime_ns, 1_000_000_000)
    return (e.st_ino, e.st_size, e.st_blocks, a, m, c, an, mn, cn, e.st_mode, e.st_nlink, e.st_uid,
            e.st_gid, e.st_rdev, e.st_blksize, 0)


def entry_out(e: EntryAttributes) -> bytes:
    """A LOOKUP/MKNOD/MKDIR/SYMLINK/LINK answer (inode 0: "no such name", cached for entry_timeout)."""
    ev, evn = _secs(e.entry_timeout)
    av, avn = _secs(e.attr_timeout)
    return ENTRY_OUT.pack(e.st_ino, e.generation, ev, av, evn, avn, *_attr_fields(e))


def attr_out(e: EntryAttributes) -> bytes:
    av, avn = _secs(e.attr_timeout)
    return ATTR_OUT.pack(av, avn, 0, *_attr_fields(e))


def open_out(fi: FileInfo) -> bytes:
    flags = ((FOPEN_KEEP_CACHE if fi.keep_cache else 0) | (FOPEN_DIRECT_IO if fi.direct_io else 0)
             | (FOPEN_NONSEEKABLE if fi.nonseekable else 0))
    return OPEN_OUT.pack(fi.fh, flags, 0)


def write_out(n: int) -> bytes:
    return WRITE_OUT.pack(n, 0)


def xattr_size(n: int) -> bytes:
    """GETXATTR/LISTXATTR asked with size 0: how many bytes the value (the list) takes."""
    return GETXATTR_OUT.pack(n, 0)


def statfs_out(s: StatvfsData) -> bytes:
    return STATFS_OUT.pack(s.f_blocks, s.f_bfree, s.f_bavail, s.f_files, s.f_ffree, s.f_bsize, s.f_namemax,
                           s.f_frsize, 0)


def init_out(minor: int, max_readahead: int, flags: int, max_write: int, max_pages: int,
             max_background: int = 0, congestion_threshold: int = 0, time_gran: int = 1) -> bytes:
    """The INIT answer for a kernel speaking 7.``minor`` (older kernels take a shorter struct)."""
    body = INIT_OUT.pack(KERNEL_MAJOR, min(minor, KERNEL_MINOR), max_readahead, flags & 0xFFFFFFFF,
                         max_background, congestion_threshold, max_write, time_gran, max_pages, 0,
                         flags >> 32 & 0xFFFFFFFF)
    return body if minor >= 23 else body[:24]


def notify_inval_inode(ino: int, off: int = 0, length: int = -1) -> bytes:
    """Tell the kernel to drop its cached pages ([off, off+length); -1: to the end) and attributes of ``ino``."""
    body = NOTIFY_INVAL_INODE_OUT.pack(ino, off, length)
    return OUT_HEADER.pack(OUT_HEADER.size + len(body), NOTIFY_INVAL_INODE, 0) + body


def _pad8(n: int) -> int:
    return (n + 7) & ~7


class DirBuffer:
    """The answer to one READDIR/READDIRPLUS: entries added until the kernel's buffer (``size``) is full.
    ``plus``: each entry carries its attributes (and the kernel counts a lookup of it)."""
    __slots__ = ("size", "plus", "parts", "used")

    def __init__(self, size: int, plus: bool):
        self.size, self.plus, self.parts, self.used = size, plus, [], 0

    def add(self, name: bytes, e: EntryAttributes, next_off: int) -> bool:
        """Add an entry (``next_off``: the offset the listing goes on from after it); False when it does
        not fit (it is not added: the kernel asks again from the last offset given)."""
        rec = DIRENT.size + len(name)
        need = _pad8(rec) + (ENTRY_OUT.size if self.plus else 0)
        if self.used + need > self.size:
            return False
        dtype = (e.st_mode & 0o170000) >> 12
        pad = b"\0" * (_pad8(rec) - rec)
        if self.plus:
            self.parts.append(entry_out(e))
        self.parts.append(DIRENT.pack(e.st_ino, next_off, len(name), dtype) + name + pad)
        self.used += need
        return True

    def body(self) -> bytes:
        return b"".join(self.parts)
