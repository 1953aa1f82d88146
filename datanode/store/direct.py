"""Moving an extent's bytes between its data file and the caller's buffers: around the page cache (O_DIRECT)
where that saves the kernel's copying, through it otherwise.

Reads: a blocking read of at least ``DIRECT_MIN`` bytes of which the page cache holds nothing (cachestat(2),
Linux >= 6.5: it looks without side effects -- a preadv2 RWF_NOWAIT probe starts readahead of what it
misses, and the disk then reads most bytes twice) reads with O_DIRECT straight into the caller's buffer (the
node's pool block) when offset, length and buffer are ``DIRECT_ALIGN``-aligned: no page-cache pages to
allocate and fill, no copy out of them.  A range partly or wholly in the page cache (just written, or read
before) is read through it.  The ``direct_reads`` option turns this off.

Writes: an append of at least ``DIRECT_MIN`` bytes whose offset, length and buffer (the node's pool block)
are aligned is written with O_DIRECT: the bytes go from the pool to the disk without a page-cache copy, the
largest single item of a node's CPU for big appends otherwise (each fills freshly allocated page-cache
pages).  The write has reached the device (perhaps only its volatile cache) when pwrite returns, as after
the flush's sync_file_range, so the flush rules are unchanged; the kernel keeps O_DIRECT and buffered I/O of
one file coherent (a direct write first writes back and drops cached pages of its range).  It pays with the
pool on huge pages (one request per write) and on small pages too.  The ``direct_writes`` option turns it
off.
"""
from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading

from .crcfile import BLOCK
from .extent import Extent
from .files import advance, preadv_all, pwrite_all

DIRECT_ALIGN = 4096           # O_DIRECT: file offset, buffer address and length all multiples of this
DIRECT_MIN = 256 << 10        # smaller I/O is not worth going around the page cache
WILLNEED_MIN = 256 << 10      # blocking reads of at least this many bytes announce their range first
_FADV_WILLNEED = getattr(os, "POSIX_FADV_WILLNEED", None)
_NR_CACHESTAT = 451           # the same number on every architecture (after the 2019 unification)


class _CachestatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Cachestat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in
                ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")]


_libc = None


def cached_pages(fd: int, pos: int, length: int) -> int | None:
    """How many pages of ``[pos, pos+length)`` of ``fd`` the page cache holds (cachestat(2)); None where the
    kernel cannot tell (before Linux 6.5)."""
    global _libc
    libc = _libc          # read once: another thread may set it to False (no cachestat) at any time
    if libc is False:
        return None
    if libc is None:
        try:
            libc = _libc = ctypes.CDLL(None, use_errno=True)
        except OSError:
            _libc = False
            return None
    rng, st = _CachestatRange(pos, length), _Cachestat()
    if libc.syscall(_NR_CACHESTAT, fd, ctypes.byref(rng), ctypes.byref(st), 0) != 0:
        if ctypes.get_errno() in (errno.ENOSYS, errno.EPERM):      # no such syscall (or a seccomp filter)
            _libc = False
        return None
    return st.nr_cache


def _direct_ok(bufs: list[memoryview], pos: int) -> bool:
    """Can ``bufs`` be read at ``pos`` with O_DIRECT: every offset, length and address aligned?"""
    if pos % DIRECT_ALIGN:
        return False
    for b in bufs:
        if len(b) % DIRECT_ALIGN:
            return False
        if not len(b):
            continue
        try:
            addr = ctypes.addressof(ctypes.c_char.from_buffer(b))
        except (TypeError, ValueError):
            return False         # read-only, or not a plain buffer
        if addr % DIRECT_ALIGN:
            return False
    return True


_scratch = threading.local()


def scratch_bufs() -> tuple[memoryview, memoryview]:
    """This thread's two block-sized buffers for the bytes of a read's first and last block outside the
    range asked for (read only to check the blocks' CRCs)."""
    s = getattr(_scratch, "bufs", None)
    if s is None:       # page-aligned (mmap), so a block's head and tail may be read with O_DIRECT too
        s = _scratch.bufs = (memoryview(mmap.mmap(-1, BLOCK)), memoryview(mmap.mmap(-1, BLOCK)))
    return s


def _read_direct(ext: Extent, bufs: list[memoryview], pos: int, want: int) -> int:
    """A blocking read of ``want`` bytes at ``pos`` into ``bufs`` with O_DIRECT, if the page cache holds none
    of it and the buffers and range are aligned.  Returns the bytes read, 0 when it did not read."""
    if want < DIRECT_MIN or not _direct_ok(bufs, pos):
        return 0
    if cached_pages(ext.dat, pos, want) != 0:
        return 0                  # (partly) in the page cache, or we cannot tell: read through it
    fd = ext.direct_fd()
    if fd < 0:
        return 0
    try:
        return preadv_all(fd, bufs, pos)
    except OSError as e:
        if e.errno == errno.EINVAL:   # an alignment this file system wants and we did not guess
            return 0
        raise


def read_range(ext: Extent, bufs: list[memoryview], pos: int, want: int, nowait: bool, direct: bool) -> int:
    """Read ``want`` bytes of the data file at ``pos`` into ``bufs``; returns the bytes read (fewer only at the
    file's end).  ``direct``: a blocking read may go around the page cache.  ``nowait``: only from the page
    cache, else ``WouldBlock``."""
    got = 0 if nowait or not direct else _read_direct(ext, bufs, pos, want)
    if got < want:
        if not nowait and want - got >= WILLNEED_MIN and _FADV_WILLNEED is not None:
            # a read that may go to the disk: ask for the whole range at once (readahead of just this range,
            # every page's I/O in flight together) rather than the file's readahead window at a time, which
            # reads beside it with other reads of the file interleaved
            try:
                os.posix_fadvise(ext.dat, pos + got, want - got, _FADV_WILLNEED)
            except OSError:
                pass            # only advice: the read below is what counts
        got += preadv_all(ext.dat, advance(bufs, got), pos + got, nowait)
    return got


def write_direct(ext: Extent, mv: memoryview, pos: int) -> bool:
    """Write ``mv`` at ``pos`` with O_DIRECT where it is big and aligned enough; False when it did not (the
    caller writes through the page cache)."""
    if len(mv) < DIRECT_MIN or not _direct_ok([mv], pos):
        return False
    fd = ext.direct_fd()
    if fd < 0:
        return False
    try:
        pwrite_all(fd, mv, pos)
    except OSError as e:
        if e.errno == errno.EINVAL:   # an alignment this file system wants and we did not guess: the
            return False              # buffered write that follows writes every byte again
        raise
    return True
