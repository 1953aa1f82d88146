"""The FUSE codec against byte fixtures laid out by hand from linux/fuse.h (no kernel), and the session's
dispatch against a socket playing the kernel: unknown opcodes get ENOSYS, malformed requests EIO, and the
session goes on."""
from __future__ import annotations

import errno
import os
import socket
import stat
import struct

import pytest
import trio

from client.fs import fuse_proto as fp
from client.fs.fuse_session import Session
from client.fs.fuse_types import EntryAttributes, FileInfo, FUSEError, StatvfsData

UNIQUE, NODE, UID, GID, PID = 0x1122334455, 7, 1000, 100, 4242


def req(opcode: int, body: bytes = b"", unique: int = UNIQUE, nodeid: int = NODE, length: int | None = None) -> bytes:
    """A request as the kernel writes it: fuse_in_header (len, opcode, unique, nodeid, uid, gid, pid,
    total_extlen, padding), then the body."""
    n = 40 + len(body) if length is None else length
    return struct.pack("<IIQQIIIHH", n, opcode, unique, nodeid, UID, GID, PID, 0, 0) + body


def parse(opcode, body=b""):
    r = fp.parse(req(opcode, body))
    assert (r.unique, r.opcode, r.nodeid, r.uid, r.gid, r.pid) == (UNIQUE, opcode, NODE, UID, GID, PID)
    return r.args


# -- requests
def test_name_requests():
    assert parse(1, b"file.txt\0") == fp.Lookup(b"file.txt")                         # LOOKUP
    assert parse(10, b"gone\0") == fp.Name(b"gone")                                  # UNLINK
    assert parse(11, b"d\0") == fp.Name(b"d")                                        # RMDIR
    assert parse(24, b"user.x\0") == fp.Name(b"user.x")                              # REMOVEXATTR
    assert parse(6, b"link\0/some/target\0") == fp.Symlink(b"link", b"/some/target")  # SYMLINK: name, target
    assert parse(13, struct.pack("<Q", 99) + b"hard\0") == fp.Link(99, b"hard")      # LINK: oldnodeid, name


def test_create_mknod_mkdir_carry_mode_and_umask():
    assert parse(8, struct.pack("<IIII", stat.S_IFIFO | 0o640, 0x0801, 0o022, 0) + b"p\0") == \
        fp.Mknod(stat.S_IFIFO | 0o640, 0x0801, 0o022, b"p")
    assert parse(9, struct.pack("<II", 0o755, 0o002) + b"dir\0") == fp.Mkdir(0o755, 0o002, b"dir")
    assert parse(35, struct.pack("<IIII", os.O_WRONLY | os.O_CREAT, 0o100644, 0o022, 1) + b"new\0") == \
        fp.Create(os.O_WRONLY | os.O_CREAT, 0o100644, 0o022, 1, b"new")


def test_rename_and_rename2():
    assert parse(12, struct.pack("<Q", 5) + b"a\0b\0") == fp.Rename(5, 0, b"a", b"b")
    assert parse(45, struct.pack("<QII", 6, 2, 0) + b"x\0y\0") == fp.Rename(6, 2, b"x", b"y")


def test_getattr_setattr():
    assert parse(3, struct.pack("<IIQ", 1, 0, 77)) == fp.Getattr(1, 77)
    body = struct.pack("<IIQQQqqqIIIIIIII", fp.FATTR_SIZE | fp.FATTR_KILL_SUIDGID | fp.FATTR_MTIME, 0, 3, 4096,
                       0, 10, 20, 30, 1, 2, 3, 0o4755, 0, 1001, 1002, 0)
    assert parse(4, body) == fp.Setattr(fp.FATTR_SIZE | fp.FATTR_KILL_SUIDGID | fp.FATTR_MTIME, 3, 4096, 0,
                                        10, 20, 30, 1, 2, 3, 0o4755, 1001, 1002)


def test_open_read_write_flush_release_fsync():
    assert parse(14, struct.pack("<II", os.O_RDWR | os.O_TRUNC, 1)) == fp.Open(os.O_RDWR | os.O_TRUNC, 1)
    assert parse(27, struct.pack("<II", os.O_RDONLY, 0)) == fp.Open(os.O_RDONLY, 0)              # OPENDIR
    assert parse(15, struct.pack("<QQIIQII", 9, 1 << 33, 131072, 0, 0, 0, 0)) == \
        fp.Read(9, 1 << 33, 131072, 0, 0, 0)
    data = bytes(range(256)) * 16
    w = parse(16, struct.pack("<QQIIQII", 9, 4096, len(data), 4, 0, os.O_WRONLY, 0) + data)
    assert w == fp.Write(9, 4096, len(data), fp.WRITE_KILL_SUIDGID, 0, os.O_WRONLY, data)
    assert parse(25, struct.pack("<QIIQ", 9, 0, 0, 0xabc)) == fp.Flush(9, 0xabc)
    assert parse(18, struct.pack("<QIIQ", 9, os.O_RDWR, 1, 0)) == fp.Release(9, os.O_RDWR, 1, 0)
    assert parse(29, struct.pack("<QIIQ", 4, 0, 0, 0)) == fp.Release(4, 0, 0, 0)                # RELEASEDIR
    assert parse(20, struct.pack("<QII", 9, 1, 0)) == fp.Fsync(9, fp.FSYNC_FDATASYNC)
    assert parse(30, struct.pack("<QII", 4, 0, 0)) == fp.Fsync(4, 0)                             # FSYNCDIR
    assert parse(28, struct.pack("<QQIIQII", 4, 2, 4096, 0, 0, 0, 0)) == fp.Read(4, 2, 4096, 0, 0, 0)
    assert parse(44, struct.pack("<QQIIQII", 4, 0, 4096, 0, 0, 0, 0)) == fp.Read(4, 0, 4096, 0, 0, 0)


def test_xattrs():
    assert parse(21, struct.pack("<II", 3, 1) + b"user.k\0abc") == fp.Setxattr(1, b"user.k", b"abc")
    assert parse(21, struct.pack("<II", 0, 0) + b"user.e\0") == fp.Setxattr(0, b"user.e", b"")
    assert parse(22, struct.pack("<II", 0, 0) + b"security.capability\0") == \
        fp.Getxattr(0, b"security.capability")
    assert parse(23, struct.pack("<II", 4096, 0)) == fp.Listxattr(4096)


def test_forgets_interrupt_statfs_readlink_init():
    assert parse(2, struct.pack("<Q", 3)) == fp.Forget(3)
    body = struct.pack("<II", 2, 0) + struct.pack("<QQ", 10, 1) + struct.pack("<QQ", 11, 5)
    assert parse(42, body) == fp.BatchForget([(10, 1), (11, 5)])
    assert parse(36, struct.pack("<Q", 12345)) == fp.Interrupt(12345)
    assert parse(17) == fp.Empty() and parse(5) == fp.Empty()                   # STATFS, READLINK
    init = struct.pack("<IIIII", 7, 44, 131072, fp.INIT_EXT | fp.ASYNC_READ | fp.HANDLE_KILLPRIV_V2, 1) + \
        b"\0" * 44
    assert parse(26, init) == fp.Init(7, 44, 131072, fp.INIT_EXT | fp.ASYNC_READ | fp.HANDLE_KILLPRIV_V2 | 1 << 32)
    assert parse(26, struct.pack("<IIII", 7, 22, 65536, fp.ASYNC_READ)) == fp.Init(7, 22, 65536, fp.ASYNC_READ)


def test_unknown_opcodes_parse_with_no_arguments():
    r = fp.parse(req(4000, b"whatever"))
    assert r.args is None and r.unique == UNIQUE
    assert fp.parse(req(fp.Op.FALLOCATE, b"\0" * 32)).args is None       # known to the kernel, not served


@pytest.mark.parametrize("raw, unique", [
    (b"\x01\x02", None),                                                    # shorter than a header
    (req(1, b"no-nul"), UNIQUE),                                            # a name without its NUL
    (req(16, struct.pack("<QQIIQII", 1, 0, 100, 0, 0, 0, 0) + b"x" * 10), UNIQUE),   # WRITE shorter than it says
    (req(3, b"\0" * 4), UNIQUE),                                            # GETATTR body cut short
    (req(1, b"a\0", length=99), UNIQUE),                                    # header length is not what was read
    (req(42, struct.pack("<II", 1000, 0)), UNIQUE),                         # BATCH_FORGET of entries not there
    (req(21, struct.pack("<II", 50, 0) + b"user.x\0abc"), UNIQUE),          # SETXATTR value shorter than it says
])
def test_malformed_requests_raise_with_their_unique(raw, unique):
    with pytest.raises(fp.Malformed) as ei:
        fp.parse(raw)
    assert ei.value.unique == unique


# -- replies
def _entry() -> EntryAttributes:
    e = EntryAttributes()
    e.st_ino, e.generation, e.entry_timeout, e.attr_timeout = 42, 0, 1.5, 0.25
    e.st_mode, e.st_nlink, e.st_uid, e.st_gid, e.st_rdev = stat.S_IFREG | 0o644, 1, 1000, 100, 0
    e.st_size, e.st_blocks, e.st_blksize = 5000, 10, 1 << 20
    e.st_atime_ns, e.st_mtime_ns, e.st_ctime_ns = 1_700_000_000_123_456_789, 5, -1_500_000_000
    return e


ATTR_BYTES = struct.pack("<QQQqqqIIIIIIIIII", 42, 5000, 10, 1_700_000_000, 0, -2, 123_456_789, 5, 500_000_000,
                         stat.S_IFREG | 0o644, 1, 1000, 100, 0, 1 << 20, 0)


def test_entry_and_attr_replies():
    assert fp.entry_out(_entry()) == struct.pack("<QQQQII", 42, 0, 1, 0, 500_000_000, 250_000_000) + ATTR_BYTES
    assert len(fp.entry_out(_entry())) == 128
    assert fp.attr_out(_entry()) == struct.pack("<QII", 0, 250_000_000, 0) + ATTR_BYTES
    assert fp.reply(UNIQUE, fp.attr_out(_entry()))[:16] == struct.pack("<IiQ", 16 + 104, 0, UNIQUE)


def test_error_open_write_statfs_xattr_replies():
    assert fp.error(UNIQUE, errno.ENOENT) == struct.pack("<IiQ", 16, -errno.ENOENT, UNIQUE)
    assert fp.error(UNIQUE, 0) == struct.pack("<IiQ", 16, 0, UNIQUE)
    assert fp.open_out(FileInfo(fh=9, keep_cache=True)) == struct.pack("<QII", 9, fp.FOPEN_KEEP_CACHE, 0)
    assert fp.open_out(FileInfo(fh=3)) == struct.pack("<QII", 3, 0, 0)
    assert fp.write_out(4096) == struct.pack("<II", 4096, 0)
    assert fp.xattr_size(20) == struct.pack("<II", 20, 0)
    s = StatvfsData()
    s.f_blocks, s.f_bfree, s.f_bavail, s.f_files, s.f_ffree = 100, 50, 40, 1 << 32, 1000
    s.f_bsize, s.f_namemax, s.f_frsize = 1 << 20, 255, 4096
    assert fp.statfs_out(s) == struct.pack("<QQQQQIIII", 100, 50, 40, 1 << 32, 1000, 1 << 20, 255, 4096, 0) + \
        b"\0" * 24


def test_init_reply_and_notification():
    flags = fp.ASYNC_READ | fp.MAX_PAGES | fp.INIT_EXT | 1 << 33
    out = fp.init_out(44, 131072, flags, 1 << 20, 256)
    assert out == struct.pack("<IIIIHHIIHHI", 7, fp.KERNEL_MINOR, 131072, flags & 0xFFFFFFFF, 0, 0, 1 << 20, 1,
                              256, 0, 2) + b"\0" * 28
    assert len(fp.init_out(22, 4096, 0, 1 << 20, 256)) == 24          # an old kernel's shorter struct
    assert fp.notify_inval_inode(42) == struct.pack("<IiQ", 40, fp.NOTIFY_INVAL_INODE, 0) + \
        struct.pack("<Qqq", 42, 0, -1)


def test_directory_listing_fills_the_kernels_buffer_and_no_more():
    e = _entry()
    plain = fp.DirBuffer(64, plus=False)
    assert plain.add(b"abc", e, 3)                           # 24 + 3 -> 32 bytes
    assert plain.add(b"abcdefgh", e, 4)                      # 24 + 8 -> 32 bytes: 64, full
    assert not plain.add(b"x", e, 5)
    assert plain.body() == struct.pack("<QQII", 42, 3, 3, stat.S_IFREG >> 12) + b"abc" + b"\0" * 5 + \
        struct.pack("<QQII", 42, 4, 8, stat.S_IFREG >> 12) + b"abcdefgh"
    plus = fp.DirBuffer(4096, plus=True)
    assert plus.add(b"f", e, 7)
    assert plus.body() == fp.entry_out(e) + struct.pack("<QQII", 42, 7, 1, stat.S_IFREG >> 12) + b"f" + b"\0" * 7
    assert not fp.DirBuffer(150, plus=True).add(b"f", e, 7)  # 128 + 32 does not fit


# -- the session's dispatch, with a socket standing in for /dev/fuse
class Ops:
    enable_acl = True

    def __init__(self):
        self.forgotten = []
        self.ops = {}

    async def lookup(self, parent, name, ctx):
        if name == b"boom":
            raise RuntimeError("a bug in a handler")
        if name == b"slow":
            await trio.sleep(30)
        if name != b"f":
            raise FUSEError(errno.ENOENT)
        return _entry()

    def forget_now(self, items):
        self.forgotten += items
        return []


def test_session_answers_init_enosys_eio_and_goes_on():
    kernel, dev = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)

    async def main():
        s = Session(Ops(), "/nonexistent", {"fsname=t"})
        s.fd = dev.fileno()
        os.set_blocking(s.fd, False)
        kernel.setblocking(False)

        async def answer():
            await trio.lowlevel.wait_readable(kernel.fileno())
            return kernel.recv(1 << 16)

        async with trio.open_nursery() as n:
            n.start_soon(s.run)
            init = struct.pack("<IIIII", 7, 44, 131072, fp.INIT_EXT | 0xFFFFFFFF, 0xFFFFFFFF) + b"\0" * 44
            kernel.send(req(26, init, unique=1))
            out = await answer()
            hdr = struct.unpack_from("<IiQ", out)
            major, minor, _ra, flags = struct.unpack_from("<IIII", out, 16)
            assert hdr == (len(out), 0, 1) and (major, minor) == (7, fp.KERNEL_MINOR)
            assert flags & fp.HANDLE_KILLPRIV_V2 and flags & fp.MAX_PAGES and flags & fp.POSIX_ACL
            assert not flags & fp.WRITEBACK_CACHE                       # only when asked for
            assert struct.unpack_from("<IIHH", out, 16 + 20)[:3] == (1 << 20, 1, 256)   # max_write, gran, pages
            kernel.send(req(4000, b"", unique=2))                         # unknown: ENOSYS
            assert await answer() == struct.pack("<IiQ", 16, -errno.ENOSYS, 2)
            kernel.send(req(1, b"no-nul", unique=3))                       # malformed: EIO
            assert await answer() == struct.pack("<IiQ", 16, -errno.EIO, 3)
            kernel.send(req(1, b"boom\0", unique=4))                       # a handler's bug: EIO
            assert await answer() == struct.pack("<IiQ", 16, -errno.EIO, 4)
            kernel.send(req(2, struct.pack("<Q", 2), unique=5, nodeid=42))  # FORGET: no answer ...
            kernel.send(req(1, b"missing\0", unique=6))                    # ... the next request's comes
            assert await answer() == struct.pack("<IiQ", 16, -errno.ENOENT, 6)
            assert s.ops.forgotten == [(42, 2)]
            kernel.send(req(1, b"slow\0", unique=7))
            kernel.send(req(1, b"f\0", unique=10))                         # not held up by the slow one
            assert await answer() == fp.reply(10, fp.entry_out(_entry()))
            kernel.send(req(36, struct.pack("<Q", 7), unique=8))           # INTERRUPT: the lookup gives up
            assert await answer() == struct.pack("<IiQ", 16, -errno.EINTR, 7)
            kernel.send(req(1, b"f\0", unique=9))
            assert await answer() == fp.reply(9, fp.entry_out(_entry()))
            assert s.stats()["malformed"] == 1 and s.stats()["interrupted"] == 1
            s.terminate()
    trio.run(main)
    kernel.close()
    dev.close()
