"""The blocking file calls the store is built from: whole writes and reads, zero-fill ahead,
``sync_file_range``, and freeing a big file in steps."""
from __future__ import annotations

import ctypes
import errno
import os
import pathlib

from .errors import WouldBlock

O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
O_DIRECT = getattr(os, "O_DIRECT", 0)
_RWF_NOWAIT = getattr(os, "RWF_NOWAIT", None)


def fdatasync(fd: int) -> None:
    (os.fdatasync if hasattr(os, "fdatasync") else os.fsync)(fd)


def fsync_dir(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY | O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# sync_file_range(2) starts writing a range's dirty pages to the device (and later waits for them), without
# the file's metadata and without flushing the device's write cache.  Python's os has no sync_file_range:
# libc's, through ctypes (which lets go of the GIL for the call).
SFR_START = 1 | 2        # SYNC_FILE_RANGE_WAIT_BEFORE | _WRITE: the range's dirty pages on their way
SFR_WAIT = 4             # SYNC_FILE_RANGE_WAIT_AFTER: until every page of the range on its way has landed


def _libc_sync_file_range():
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _libc_sync_file_range()


def has_sync_file_range() -> bool:
    """Whether this platform's libc has ``sync_file_range`` (a file system may still refuse it)."""
    return _sync_file_range is not None


def sync_range(fd: int, pos: int, n: int, flags: int) -> None:
    """``sync_file_range`` of ``[pos, +n)`` (n = 0: to the end of the file): ``SFR_START`` sends its dirty
    pages to the device, ``SFR_WAIT`` waits for them (no metadata, no cache flush)."""
    if _sync_file_range(fd, pos, n, flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"sync_file_range: {os.strerror(err)}")


# Freeing a big file in steps.  A file system mounted with online discard (ext4/XFS ``-o discard``, common on
# cloud VMs and SSD hosts) discards the blocks a transaction freed when the journal commits it, and every
# fdatasync waiting for that commit -- every other writer's on the disk -- waits for the discard.  Freed a
# step at a time, each step committed by an fsync, no commit holds the others for long, in about the same
# total time (bench/delete_stall.py measures it).  RocksDB's SstFileManager deletes its files in chunks for
# the same reason.  The node's ``free_step_bytes`` sets the step.
FREE_STEP = 8 << 20


def free_in_steps(path, step: int = FREE_STEP) -> None:
    """Truncate the file at ``path`` to 0 bytes.  One bigger than ``step`` loses at most a step per
    truncation, each made durable (fsync) before the next: no journal commit frees more than a step, so a
    discard never stalls the disk's other writers for long.  A file of at most one step (or ``step`` 0) is
    truncated at once, as the caller would have.  A symlink is never followed."""
    fd = os.open(path, os.O_WRONLY | O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0))
    try:
        shrink_in_steps(fd, 0, step)
    finally:
        os.close(fd)


def shrink_in_steps(fd: int, size: int, step: int = FREE_STEP) -> None:
    """``ftruncate(fd, size)``, freeing at most ``step`` bytes per truncation, each fsynced before the next,
    where that takes more than one (``free_in_steps``)."""
    cur = os.fstat(fd).st_size
    if step <= 0 or cur - size <= step:
        os.ftruncate(fd, size)
        return
    while cur > size:
        cur = max(size, cur - step)
        os.ftruncate(fd, cur)
        os.fsync(fd)


def pwrite_all(fd: int, buf, pos: int) -> None:
    mv = memoryview(buf)
    while len(mv):
        n = os.pwrite(fd, mv, pos)
        if n <= 0:
            raise OSError(errno.EIO, "pwrite wrote nothing")
        mv = mv[n:]
        pos += n


_zeros = memoryview(bytes(256 << 10))


def zeros(n: int) -> memoryview:
    """``n`` zero bytes, from one buffer shared by every store (grown for a bigger ``prefill_bytes``)."""
    global _zeros
    z = _zeros          # read once: another thread may grow it meanwhile
    if len(z) < n:
        z = _zeros = memoryview(bytes(n))
    return z[:n]


def ahead(end: int, step: int, cap: int) -> int:
    """The next ``step`` boundary strictly past ``end``, at most ``cap``."""
    return min(cap, (end // step + 1) * step)


def pwrite_ahead(fd: int, mv: memoryview, pos: int, filled: int, step: int, cap: int) -> int:
    """pwrite ``mv`` at ``pos`` and, when it ends past ``filled`` (the bytes the file already has), zeros
    from its end to the next ``step`` boundary.  Returns the bytes the file now has.  On a full disk the
    zeros are given up before the bytes: what landed of them is cut again, and only the bytes are written."""
    end = pos + len(mv)
    if end <= filled:
        pwrite_all(fd, mv, pos)
        return filled
    to = ahead(end, step, cap)
    if to > end:
        try:
            n = os.pwritev(fd, [mv, zeros(to - end)], pos)
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
        else:
            if n == to - pos:
                return to
            if n >= len(mv):         # short (the disk filled up): the bytes are in, give the zeros back
                os.ftruncate(fd, max(filled, end))
                return max(filled, end)
            mv, pos = mv[n:], pos + n
    pwrite_all(fd, mv, pos)
    return max(filled, end)


def preadv_all(fd: int, bufs: list[memoryview], pos: int, nowait: bool = False) -> int:
    """Fill every buffer from ``pos``; returns bytes read (less than asked only at EOF).  ``nowait``: only
    from the page cache (preadv2 RWF_NOWAIT), else ``WouldBlock`` -- for a caller that must not block."""
    bufs = [b for b in bufs if len(b)]
    total = 0
    if nowait and _RWF_NOWAIT is None:
        raise WouldBlock(fd)
    while bufs:
        if nowait:
            try:
                n = os.preadv(fd, bufs, pos, _RWF_NOWAIT)
            except BlockingIOError:
                raise WouldBlock(fd) from None
            except OSError as e:
                if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise WouldBlock(fd) from None
                raise
        else:
            n = os.preadv(fd, bufs, pos)
        if n == 0:
            break
        total += n
        pos += n
        while n:
            if n >= len(bufs[0]):
                n -= len(bufs[0])
                bufs.pop(0)
            else:
                bufs[0] = bufs[0][n:]
                n = 0
    return total


def advance(bufs: list[memoryview], n: int) -> list[memoryview]:
    """``bufs`` without their first ``n`` bytes."""
    out = []
    for b in bufs:
        if n >= len(b):
            n -= len(b)
            continue
        out.append(b[n:] if n else b)
        n = 0
    return out
