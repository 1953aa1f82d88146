"""On-disk extent store of one data partition (blocking code; the async server calls it in worker threads,
``aio.Workers``).

Layout (under ``root``)::

    next_extent_id          decimal, the next id create_extent(None) hands out (atomic replace)
    extents/<id>.dat        extent data, append-only, at most MAX_EXTENT bytes
    extents/<id>.crc        one 8-byte entry per 128 KiB block: (crc32c u32, covered_length u32) big-endian;
                            at 8 KiB, two tail slots (sync=always: see "One flush")
    extents/<id>.deleted    tombstone of a deleted extent (emptied in steps: ``free_in_steps``); the id is never
                            handed out again

Entry ``i`` covers ``data[i*BLOCK : i*BLOCK + covered]``.  Every block but the last is full
(covered == BLOCK).  An append that extends a partial last block recomputes its CRC incrementally
(``crc32c(new_bytes, old_crc)``) and rewrites that 8-byte entry in place; bytes below the current size are
never rewritten.

Write order (one ``write()``)::

    pwrite(data)  ->  [sync=always: fdatasync(data)]  ->  pwrite(crc entries)  ->  [sync=always: fdatasync(crc)]

i.e. the data is made durable *before* the CRC entries that describe it are even written.  Under
sync=always a write is two halves (group commit): ``append`` pwrites the data and keeps the new entries in
memory (the extent's size moves, the next append may follow at once); ``flush`` then does the fdatasync(data)
-> pwrite(crc entries) -> fdatasync(crc) above once for every append made before it, however many, and
moves the extent's ``durable_size``; a write is acknowledged only once its end is durable.  (The brief
suggested pwrite data, pwrite crc, fdatasync data, fdatasync crc; that lets the kernel write the new CRC
page back before the data, so a power cut could leave a durable entry for bytes that never reached the disk
and the recovery below would have to throw away the acknowledged bytes of that block too.  Same number of
fdatasyncs either way.)  Consequences, for sync=always:

* every durable entry describes durable bytes;
* an 8-byte entry rewrite is atomic (8-byte aligned, never straddles a sector), so after a crash each entry
  is either its old value (which still verifies: the bytes it covers were not touched) or its new value
  (which verifies: its bytes were synced first);
* an acknowledged write has its entries synced, so it survives.

With kill -9 (no power loss) the page cache survives, so the same holds for sync=none; after a power cut
sync=none promises nothing beyond "what is recovered is verified".

One flush (sync=always)
-----------------------
Two fdatasyncs are two cache flushes of the device per flush, on every replica.  Where it is safe, a flush
takes one: ``sync_file_range`` sends the data pages to the device (no metadata, no cache flush), the entries
and the slot are written and sent after them while they are on their way, and once the data has landed one
``fdatasync`` of the CRC file flushes the device's cache for both files.
Until that cache flush, a power cut may keep any of the flush's writes and lose any other -- a rewritten
entry of the last partial block without its bytes would make that block's *acknowledged* start unreadable.
So the CRC file also holds two **tail slots** past the entries of a full extent (at 8 KiB, 32 bytes each,
the newest by sequence number)::

    magic "DNT1" | seq u32 | size u64 | CRC of the partial last block u32 | flags u32 | CRC32C of the rest u32

Each flush writes the slot that is *not* the newest: the state before the flush stays on disk, described,
until the flush is complete.  A flush takes one fdatasync only when a durable slot describes the state
before it and its bytes overwrite zeros already durable in the data file (zero-fill ahead: the file's
length is not changing); otherwise data first, as above (the first flush after open, create or truncate).
A flush whose appends grew the data file (past the zeros written ahead: a 1 MiB direct append always does)
takes one fdatasync too, the data file's, last: the entries and the slot are written and waited for first
-- they overwrite blocks of the CRC file this process made durable, so it has no metadata to commit --
and the data file's fdatasync then writes what is left of the data, commits its new length (ext4, XFS:
only once the bytes under it are written) and flushes the device's cache, for both files.  A power cut
before it ends leaves the old length (the new slot does not fit the files: the one before it gives the
size) or the new one with its bytes; the first flush after open keeps to the order above.  (1 MiB
appends, 3 stores flushing at once on this disk: write+flush p50 ahead in 6 of 8 interleaved rounds,
2.27-3.14 vs 2.63-3.50 ms, bench/grow_flush_ab.py.)
Recovery, when there are slots: the newest whose blocks (those its flush wrote, and the partial last one by
the slot's CRC) verify gives the size; a one-flush slot that does not verify, with a sector of its range
still reading as the zeros it overwrote, was cut short by a power cut (never acknowledged) and the slot
before it gives the size; a slot whose bytes are all there yet fail is a damaged medium -- those blocks
are kept and reported, as by rule 3 below.  Anything else (no slot, or none
that fits) falls back to the entry rules below.  Slots are dropped by truncate and a clean close (the
entries then say it all); sync=none appends remove them (their entries would be outvoted by an old slot).
DATANODE_ONE_FLUSH=0 turns the one-flush path off (slots are still written).

Recovery rule (on open, for every extent)
-----------------------------------------
Classify each complete 8-byte entry ``i`` (a trailing partial entry is ignored) as

* GOOD     -- 0 < covered <= BLOCK, the data file holds ``[i*BLOCK, i*BLOCK+covered)`` and its CRC matches;
* BAD      -- covered valid and the bytes are all there, but the CRC does not match;
* SHORT    -- covered valid but the data file ends before ``i*BLOCK+covered``;
* INVALID  -- covered == 0 or covered > BLOCK.

The end of the extent is the *end of the last completed append*, found like this:

1. If some entry is a GOOD *partial* block (covered < BLOCK), the first such entry ends the extent.
   A partial block can only be the last block of a completed append; anything after it was written by an
   append that did not complete (e.g. its entry for the next block landed but the rewrite of this one did not).
2. Otherwise the last GOOD (full) entry ``g`` is the anchor.  Everything up to ``g`` is kept: an entry before
   ``g`` that is BAD or INVALID or claims a partial length is *corrupted acknowledged data*, not a torn
   tail -- a crash can only disturb the tail, and something verified comes after it.  Such entries are
   normalised to covered=BLOCK (in memory and on disk; the CRC field is kept) and, if they still do not
   match, kept as bad blocks: reads touching them raise StoreError("crc"), they are logged at open, and
   repair (truncate + re-replicate) is the way to fix them.
3. After the anchor, BAD entries whose bytes are all present are kept too (walking forward, stopping after a
   partial one): given the write order a crash cannot produce an entry whose bytes are present but wrong,
   so this is a bit flip in the last acknowledged block(s), and cutting it would silently drop acked data.
4. The tail is cut at the first entry that is missing, partial, SHORT or INVALID after that point: the data
   file is truncated to the recovered size, the CRC file to the kept entries, both fsynced, and the cut is
   logged.  Bytes in the data file beyond the last entry's coverage are always cut (an append whose entries
   never landed).

So only the tail -- bytes beyond what the entries cover, and entries whose bytes never fully reached the data
file -- is ever cut; a bad CRC in the middle (or at the end, with all its bytes present) is kept and reported.
Limits: damage to the *length* field of the last entry (making it longer than the file) looks exactly like a
torn tail and that block is cut (logged); SHORT on a partial last block cuts the whole block, including bytes
acknowledged before (only reachable after a power cut with sync=none, or external damage).

``verify="full"`` (default) CRC-checks every block at open so mid-extent damage is logged then;
``verify="tail"`` checks only what the rule needs (partial entries, and backwards from the end to the last
good block) -- same recovered sizes, much faster open for big partitions (about one block read per extent
instead of every byte); damage is then found on read, or by the scrub (the datanode opens with
``open_verify = tail`` by default and has its leader scrub soon after start: datanode/repair.py).
``on_extent(size)``, if given, is called after each extent is opened (progress for a node that is starting);
it may raise to stop opening: the extents opened so far are closed again and the exception propagates.

Concurrency: a per-extent mutation lock serialises write/truncate/delete; reads run concurrently with each
other and with appends (they snapshot size + entries and only read bytes below the snapshot, which are never
rewritten); truncate/delete wait for in-flight reads to drain and block new ones.
"""
from __future__ import annotations

import ctypes
import enum
import errno
import logging
import mmap
import os
import pathlib
import stat
import struct
import threading
from typing import Callable

from .config import SyncMode
from .crc import HARDWARE, crc32c, crc32c_combine

log = logging.getLogger(__name__)

BLOCK = 128 * 1024              # one CRC32C per 128 KiB block
MAX_EXTENT = 128 * 1024 * 1024  # extents are append-only, up to 128 MiB

_ENTRY = struct.Struct(">II")
_ESZ = _ENTRY.size  # 8
_ENTRIES_END = MAX_EXTENT // BLOCK * _ESZ   # where the entries of a full extent end (8 KiB): the slots follow
# A tail slot (see "One flush" in the module docstring): magic, seq, size, CRC of the partial last block,
# flags, and a CRC32C of the fields before it.  Two of them, SLOT_SIZE apart, the newest by seq.
_SLOT = struct.Struct(">4sIQII")
_SLOT_MAGIC = b"DNT1"
SLOT_SIZE = 32
_SLOT_ONE_FLUSH = 1          # flags: written by a one-flush (its data was not synced before it)
_SYNC_MODES = tuple(SyncMode)
_VERIFY_MODES = ("full", "tail")
_NEXT_ID = "next_extent_id"
MAX_EXTENT_ID = (1 << 48) - 1     # ids stay far from the 64-bit wire field's end
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class StoreCode(enum.StrEnum):
    """Why a store operation failed: one code per condition (the server maps each to one result code)."""
    NOT_FOUND = "not_found"          # no such extent
    DELETED = "deleted"              # the extent was deleted (its id is never reused)
    EXISTS = "exists"                # create of an id that exists; arg = the id
    WRONG_OFFSET = "wrong_offset"    # an append not at the end; arg = the extent's end
    OUT_OF_RANGE = "out_of_range"    # a read/truncate beyond the end (or negative); arg = the extent's size
    TOO_LARGE = "too_large"          # the extent would exceed MAX_EXTENT; arg = MAX_EXTENT
    CRC = "crc"                      # bytes fail their CRC (a payload, or a stored block)
    NO_SPACE = "no_space"            # the file system is full (ENOSPC/EDQUOT)
    DISK = "disk"                    # any other I/O failure, a closed store, a broken extent


class WouldBlock(Exception):
    """``append(blocking=False)`` found the extent's mutation lock taken (a truncate, delete or close)."""


class StoreError(Exception):
    """``code`` is a StoreCode; ``arg`` what that code says it carries (else 0)."""

    def __init__(self, code: StoreCode, message: str, arg: int = 0):
        super().__init__(f"{code}: {message}")
        self.code = StoreCode(code)
        self.message = message
        self.arg = arg


def io_error(what: str, e: OSError) -> StoreError:
    """An OSError as a StoreError: a full disk is NO_SPACE, anything else DISK."""
    code = StoreCode.NO_SPACE if e.errno in (errno.ENOSPC, errno.EDQUOT) else StoreCode.DISK
    return StoreError(code, f"{what}: {e}")


def _fdatasync(fd: int) -> None:
    (os.fdatasync if hasattr(os, "fdatasync") else os.fsync)(fd)


# One flush (see the module docstring): sync_file_range(2) starts writing a range's dirty pages to the
# device (and later waits for them), without the file's metadata and without flushing the device's write
# cache -- the fdatasync of the CRC file after it does that, for both files.  Python's os has no
# sync_file_range: libc's, through ctypes (which lets go of the GIL for the call).  DATANODE_ONE_FLUSH=0
# turns it off.
ONE_FLUSH = os.environ.get("DATANODE_ONE_FLUSH", "1") != "0"
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


def _sync_range(fd: int, pos: int, n: int, flags: int) -> None:
    """``sync_file_range`` of ``[pos, +n)`` (n = 0: to the end of the file): ``SFR_START`` sends its dirty
    pages to the device, ``SFR_WAIT`` waits for them (no metadata, no cache flush)."""
    if _sync_file_range(fd, pos, n, flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"sync_file_range: {os.strerror(err)}")


def _slot_pos(seq: int) -> int:
    return _ENTRIES_END + (seq & 1) * SLOT_SIZE


def _pack_slot(seq: int, size: int, tail_crc: int, flags: int) -> bytes:
    body = _SLOT.pack(_SLOT_MAGIC, seq, size, tail_crc, flags)
    return body + struct.pack(">I", crc32c(body)) + bytes(SLOT_SIZE - _SLOT.size - 4)


def _unpack_slots(raw: bytes) -> list[tuple[int, int, int, int]]:
    """The valid tail slots in a CRC file's bytes, newest first: [(seq, size, tail_crc, flags)]."""
    out = []
    for k in range(2):
        pos = _ENTRIES_END + k * SLOT_SIZE
        rec = raw[pos:pos + _SLOT.size + 4]
        if len(rec) < _SLOT.size + 4 or rec[:4] != _SLOT_MAGIC:
            continue
        magic, seq, size, tail_crc, flags = _SLOT.unpack_from(rec)
        if (struct.unpack_from(">I", rec, _SLOT.size)[0] != crc32c(rec[:_SLOT.size]) or (seq & 1) != k
                or size > MAX_EXTENT):
            continue
        out.append((seq, size, tail_crc, flags))
    return sorted(out, reverse=True)


def _fsync_dir(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY | _O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# Freeing a big file in steps.  A file system mounted with online discard (ext4/XFS ``-o discard``, common on
# cloud VMs and SSD hosts: this box's root is) discards the blocks a transaction freed when the journal commits
# it, and every fdatasync waiting for that commit -- every other writer's on the disk -- waits for the discard.
# Freeing a whole 128 MiB extent at once held a concurrent 4 KiB write+fdatasync up to 23-36 ms here; freed
# 8 MiB at a time, each step committed by an fsync, at most 3-8 ms, in about the same total time (through a
# cluster, bench/delete_stall.py: README, "Deleting frees space in steps").  RocksDB's SstFileManager deletes
# its files in chunks for the same reason.  DATANODE_FREE_STEP (bytes; 0: at once) sets the step.
FREE_STEP = int(os.environ.get("DATANODE_FREE_STEP", str(8 << 20)))


def free_in_steps(path, step: int | None = None) -> None:
    """Truncate the file at ``path`` to 0 bytes.  One bigger than ``step`` (``FREE_STEP``) loses at most a
    step per truncation, each made durable (fsync) before the next: no journal commit frees more than a
    step, so a discard never stalls the disk's other writers for long.  A file of at most one step (or
    ``step`` 0) is truncated at once, as the caller would have."""
    fd = os.open(path, os.O_WRONLY | _O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0))
    try:
        shrink_in_steps(fd, 0, step)
    finally:
        os.close(fd)


def shrink_in_steps(fd: int, size: int, step: int | None = None) -> None:
    """``ftruncate(fd, size)``, freeing at most ``step`` (``FREE_STEP``) bytes per truncation, each fsynced
    before the next, where that takes more than one (``free_in_steps``)."""
    step = FREE_STEP if step is None else step
    cur = os.fstat(fd).st_size
    if step <= 0 or cur - size <= step:
        os.ftruncate(fd, size)
        return
    while cur > size:
        cur = max(size, cur - step)
        os.ftruncate(fd, cur)
        os.fsync(fd)


def piece_crcs(offset: int, data) -> tuple[list[int], int]:
    """The CRC32C of each piece of ``data`` cut where an append at ``offset`` crosses a block boundary, and
    of all of it: one pass over the bytes.  A caller that must check the payload's CRC before it appends
    (the request path: before it forwards to the followers) passes the pieces on to ``append``, which then
    does not read the bytes a second time."""
    mv = _byte_view(data)
    n = len(mv)
    out: list[int] = []
    whole = pos = 0
    within = offset % BLOCK
    while pos < n:
        take = min(BLOCK - within, n - pos)
        piece = mv[pos:pos + take] if take != n else mv
        c = crc32c(piece)
        whole = c if pos == 0 else _cat(whole, piece, c)
        out.append(c)
        pos += take
        within = 0
    return out, whole


def _cat(crc_a: int, piece, crc_piece: int) -> int:
    """crc32c(a + piece) given crc32c(a), the piece and crc32c(piece): combine when that is cheaper."""
    n = len(piece)
    if n == BLOCK or not HARDWARE or n > 64 * 1024:
        return crc32c_combine(crc_a, crc_piece, n)
    return crc32c(piece, crc_a)


def _pwrite_all(fd: int, buf, pos: int) -> None:
    mv = memoryview(buf)
    while len(mv):
        n = os.pwrite(fd, mv, pos)
        if n <= 0:
            raise OSError(errno.EIO, "pwrite wrote nothing")
        mv = mv[n:]
        pos += n


# Zero-fill ahead (sync=always only).  fdatasync after an append that grows the file must commit the
# file system's journal (the new size, the new blocks) besides writing the data: on ext4 here that is
# 0.35 ms for our two files against 0.24 ms when both writes land inside already-written blocks, and the
# three replicas' journal commits on one disk queue behind each other (p99 2.1-2.6 ms against 0.6-1.5).
# So a small append also writes zeros up to the next PREFILL boundary of the data file (and the flush
# writes zero entries up to the next page of the CRC file): the following appends overwrite those zeros
# and their flush is data only.  Zeros are never an extent's bytes -- size and entries say where it
# ends, and recovery cuts everything past the last verified entry as before.  Not under sync=none: no
# fdatasync to save, and after a power cut zeros would turn a short (cut) tail into a "present" block.
# DATANODE_PREFILL=0 turns it off.
PREFILL = int(os.environ.get("DATANODE_PREFILL", str(256 << 10)))
_CRC_PREFILL = 4096
_ZEROS = memoryview(bytes(max(PREFILL, _CRC_PREFILL)))


def _ahead(end: int, step: int, cap: int) -> int:
    """The next ``step`` boundary strictly past ``end``, at most ``cap``."""
    return min(cap, (end // step + 1) * step)


def _pwrite_ahead(fd: int, mv: memoryview, pos: int, filled: int, step: int, cap: int) -> int:
    """pwrite ``mv`` at ``pos`` and, when it ends past ``filled`` (the bytes the file already has), zeros
    from its end to the next ``step`` boundary.  Returns the bytes the file now has.  On a full disk the
    zeros are given up before the bytes: what landed of them is cut again, and only the bytes are written."""
    end = pos + len(mv)
    if end <= filled:
        _pwrite_all(fd, mv, pos)
        return filled
    ahead = _ahead(end, step, cap)
    if ahead > end:
        try:
            n = os.pwritev(fd, [mv, _ZEROS[:ahead - end]], pos)
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
        else:
            if n == ahead - pos:
                return ahead
            if n >= len(mv):         # short (the disk filled up): the bytes are in, give the zeros back
                os.ftruncate(fd, max(filled, end))
                return max(filled, end)
            mv, pos = mv[n:], pos + n
    _pwrite_all(fd, mv, pos)
    return max(filled, end)


_RWF_NOWAIT = getattr(os, "RWF_NOWAIT", None)
_FADV_WILLNEED = getattr(os, "POSIX_FADV_WILLNEED", None)
WILLNEED_MIN = 256 << 10      # blocking reads of at least this many bytes announce their range first
_O_DIRECT = getattr(os, "O_DIRECT", 0)
DIRECT_ALIGN = 4096           # O_DIRECT: file offset, buffer address and length all multiples of this
# A blocking read of at least DIRECT_MIN bytes of which the page cache holds nothing (cachestat(2), Linux >=
# 6.5: it looks without side effects -- a preadv2 RWF_NOWAIT probe starts readahead of what it misses, and the
# disk then read most bytes twice) reads with O_DIRECT straight into the caller's buffer (the node's pool
# block), when offset, length and buffer are DIRECT_ALIGN-aligned: no page-cache pages to allocate and fill,
# no copy out of them, about a third of the kernel CPU.  A range partly or wholly in the page cache (just
# written, or read before) is read through it.  DATANODE_DIRECT_READS=0 turns direct reads off (every read
# then goes through the page cache, announced with WILLNEED).
DIRECT_MIN = 256 << 10
DIRECT_READS = os.environ.get("DATANODE_DIRECT_READS", "1") != "0" and bool(_O_DIRECT)
# The same for appends: one of at least DIRECT_MIN bytes whose offset, length and buffer (the node's pool
# block) are aligned is written with O_DIRECT -- the bytes go from the pool to the disk without a page-cache
# copy, which on these VMs is the largest single item of a node's CPU for 1 MiB appends (54% of all CPU of a
# buffered 1 MiB x depth 8 run in copy_folio_from_iter_atomic, perf record -a in stop 29: each append fills
# freshly allocated page-cache pages, slow on guest memory not touched for a while).  The write has reached
# the device (perhaps only its volatile cache) when pwrite returns, as after the flush's sync_file_range, so
# the flush rules ("One flush" below) are unchanged; the kernel keeps O_DIRECT and buffered I/O of one file
# coherent (a direct write first writes back and drops cached pages of its range).
# On by default since the pool lives on huge pages (pool.py HUGE_PAGE), when each 1 MiB direct write became
# one request instead of two: 1 MiB x depth 8, 3 replicas, 3 interleaved rounds (bench/perf_ab.py, after
# warm-memory): sync=none 157-189 -> 369-420 MiB/s and 7.8-10.5 -> 3.8-4.2 CPU-s/GB (client + 3 nodes),
# p99.9 116-816 -> 46-571 ms; sync=always 131-146 -> 226-305 MiB/s, 11.2-12.5 -> 5.0-6.8 CPU-s/GB.  On a
# kernel without huge pages (THP mode 'never', common on database hosts) it still pays: the same bench with
# THP set to 'never', this code against page-cache appends (a node that turned direct appends off when its
# pool was on small pages), 3 interleaved rounds: sync=always 304-338 vs 152-160 MiB/s at 4.3-4.6 vs
# 9.3-10.6 CPU-s/GB; sync=none 351-368 vs 165-184 MiB/s (stop 30).  So it stays on there too.
# DATANODE_DIRECT_WRITES=0 in a node's environment turns it off.
DIRECT_WRITES = os.environ.get("DATANODE_DIRECT_WRITES", "1") != "0" and bool(_O_DIRECT)
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


def _preadv_all(fd: int, bufs: list[memoryview], pos: int, nowait: bool = False) -> int:
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


def _advance(bufs: list[memoryview], n: int) -> list[memoryview]:
    """``bufs`` without their first ``n`` bytes."""
    out = []
    for b in bufs:
        if n >= len(b):
            n -= len(b)
            continue
        out.append(b[n:] if n else b)
        n = 0
    return out


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


def _byte_view(buf) -> memoryview:
    mv = buf if isinstance(buf, memoryview) else memoryview(buf)
    if mv.ndim != 1 or mv.format != "B":
        mv = mv.cast("B")
    return mv


_scratch = threading.local()


def _scratch_bufs() -> tuple[memoryview, memoryview]:
    s = getattr(_scratch, "bufs", None)
    if s is None:       # page-aligned (mmap), so a block's head and tail may be read with O_DIRECT too
        s = _scratch.bufs = (memoryview(mmap.mmap(-1, BLOCK)), memoryview(mmap.mmap(-1, BLOCK)))
    return s


class _Extent:
    __slots__ = ("id", "dat", "crc", "size", "entries", "bad", "mu", "cond", "wlock", "readers",
                 "exclusive", "dead", "broken", "gen", "flock", "dirty_from", "durable", "direct", "filled",
                 "crc_filled", "slot_seq", "synced", "crc_synced")

    def __init__(self, eid: int, dat_fd: int, crc_fd: int, size: int, entries: list[tuple[int, int]],
                 bad: set[int]):
        self.id = eid
        self.dat = dat_fd
        self.crc = crc_fd
        self.size = size
        self.entries = entries          # [(crc, covered)] per block; replaced/appended only under mu
        self.bad = bad                  # block indexes known to fail their CRC
        self.mu = threading.Lock()      # guards size/entries/readers/exclusive/dead (short holds only)
        self.cond = threading.Condition(self.mu)
        self.wlock = threading.Lock()   # serialises mutations (write / truncate / delete / close)
        self.readers = 0
        self.exclusive = False
        self.dead = False               # deleted or closed: fds are gone
        self.broken = None              # str: a failed fdatasync/rollback; writes refused until reopen
        self.gen = 0                    # bumped by every change of size/entries (the digest cache's key)
        # group commit (sync=always): appends leave their CRC entries in memory (``entries``) and mark the
        # first changed one in ``dirty_from``; ``flush`` syncs the data, then writes and syncs the entries,
        # and moves ``durable`` (bytes acknowledged-safe) up.  ``flock`` is held by a flush of this extent
        # and by truncate/delete/close, so no stale entry lands after them.
        self.flock = threading.Lock()
        self.dirty_from: int | None = None
        self.durable = size
        self.direct: int | None = None  # the data file opened O_DIRECT (on the first I/O that can use it); -1: cannot
        self.filled = size              # bytes the data file has (zero-filled ahead of size: PREFILL)
        self.crc_filled = len(entries) * _ESZ   # bytes the CRC file has (below the slots)
        self.slot_seq: int | None = None    # the durable tail slot that describes ``durable`` (None: none does)
        self.synced = size                  # the data file's length known durable (its last fdatasync)
        self.crc_synced: int | None = None  # crc_filled at this process's last fdatasync of the CRC file (the
        #                                     slots' block included); None: none since open, truncate, sync=none

    # -- reader side ------------------------------------------------------------------------------------
    def begin_read(self, b0: int, b1: int, nowait: bool = False):
        with self.mu:
            while self.exclusive:
                if nowait:
                    raise WouldBlock(self.id)
                self.cond.wait()
            if self.dead:
                raise StoreError("not_found", f"extent {self.id} does not exist")
            self.readers += 1
            return self.size, self.entries[b0:b1 + 1]

    def end_read(self) -> None:
        with self.mu:
            self.readers -= 1
            if self.readers == 0 and self.exclusive:
                self.cond.notify_all()

    # -- exclusive side (caller holds wlock) ------------------------------------------------------------
    def begin_exclusive(self) -> None:
        with self.mu:
            self.exclusive = True
            while self.readers:
                self.cond.wait()

    def end_exclusive(self) -> None:
        with self.mu:
            self.exclusive = False
            self.cond.notify_all()

    def direct_fd(self) -> int:
        """The data file opened with O_DIRECT (the same inode as ``dat``), or -1 where the file system
        refuses O_DIRECT.  Called by a reader (between begin_read and end_read) or the writer (holding
        ``wlock``): the fds stay open meanwhile."""
        with self.mu:
            if self.direct is None:
                try:
                    self.direct = os.open(f"/proc/self/fd/{self.dat}", os.O_RDWR | _O_DIRECT | _O_CLOEXEC)
                except OSError as e:
                    log.info("extent %d: no O_DIRECT I/O (%s): through the page cache", self.id, e)
                    self.direct = -1
            return self.direct

    def close_fds(self) -> None:
        for fd in (self.dat, self.crc, self.direct):
            if fd is None or fd < 0:
                continue
            try:
                os.close(fd)
            except OSError:
                pass
        self.dat = self.crc = -1
        self.direct = None


class ExtentStore:
    def __init__(self, root: pathlib.Path, sync: str = SyncMode.ALWAYS, *, verify: str = "full",
                 on_extent: Callable[[int], None] | None = None, one_flush: bool = ONE_FLUSH):
        if sync not in _SYNC_MODES:
            raise ValueError(f"sync must be one of {_SYNC_MODES}, not {sync!r}")
        if verify not in _VERIFY_MODES:
            raise ValueError(f"verify must be one of {_VERIFY_MODES}, not {verify!r}")
        self.root = pathlib.Path(root)
        self.sync = sync
        self.verify = verify
        self._dir = self.root / "extents"
        self._lock = threading.Lock()       # guards _extents, _tombstones, _next_id, _closed (short holds)
        self._create_lock = threading.Lock()  # serialises create_extent (held across its fsyncs)
        self._digests: dict[int, tuple] = {}   # extent id -> (its _Extent, gen, digest): see digests()
        self._extents: dict[int, _Extent] = {}
        self._tombstones: set[int] = set()
        self._closed = False
        self.one_flushes = 0                # flushes that took one fdatasync (see "One flush"; approximate)
        self.direct_writes = 0              # appends written with O_DIRECT (DIRECT_WRITES; approximate)
        self._one_flush = one_flush and _sync_file_range is not None
        created = not self._dir.exists()
        self._dir.mkdir(parents=True, exist_ok=True)
        if created and self._durable:
            _fsync_dir(self._dir)
            _fsync_dir(self.root)
            if self.root.parent != self.root:
                _fsync_dir(self.root.parent)
        self._next_id = 1
        try:
            self._next_id = max(1, int((self.root / _NEXT_ID).read_text().strip() or 1))
        except FileNotFoundError:
            pass
        except ValueError:
            log.warning("%s: unreadable %s, recomputing from the extents present", self.root, _NEXT_ID)
        self._on_extent = on_extent
        try:
            self._open_all()
        except BaseException:
            self.close()
            raise
        self._on_extent = None

    @property
    def _durable(self) -> bool:
        return self.sync == SyncMode.ALWAYS

    # ------------------------------------------------------------------------------------------- open
    def _paths(self, eid: int) -> tuple[pathlib.Path, pathlib.Path, pathlib.Path]:
        return self._dir / f"{eid}.dat", self._dir / f"{eid}.crc", self._dir / f"{eid}.deleted"

    def _empty_deleted(self, p: pathlib.Path, eid: int) -> None:
        """A file of a deleted extent still holding data (a crash came while ``mark_delete`` freed it): free
        it now, in steps.  Only a regular file; a failure is logged, not raised -- a tombstone's name is what
        counts, its space can wait for the next open."""
        try:
            st = p.lstat()
            if stat.S_ISREG(st.st_mode) and st.st_size:
                log.warning("%s: %s of deleted extent %d still holds %d bytes, freeing them", self._dir, p.name,
                            eid, st.st_size)
                free_in_steps(p)
        except OSError as e:
            log.warning("%s: could not free %s of deleted extent %d: %s", self._dir, p.name, eid, e)

    def _open_all(self) -> None:
        dats, crcs = set(), set()
        for p in self._dir.iterdir():
            stem, _, ext = p.name.partition(".")
            if not stem.isdigit():
                continue
            eid = int(stem)
            if ext == "dat":
                dats.add(eid)
            elif ext == "crc":
                crcs.add(eid)
            elif ext == "deleted":
                self._tombstones.add(eid)
                self._empty_deleted(p, eid)
        dir_changed = False
        for eid in sorted(crcs - dats):          # crash inside create_extent / mark_delete
            log.warning("%s: removing orphan %s.crc (no data file)", self._dir, eid)
            os.unlink(self._paths(eid)[1])
            dir_changed = True
        for eid in sorted(dats & self._tombstones):
            log.warning("%s: extent %d has a tombstone, finishing its deletion", self._dir, eid)
            self._empty_deleted(self._paths(eid)[0], eid)      # (the data file: freed in steps, then gone)
            for p in self._paths(eid)[:2]:
                p.unlink(missing_ok=True)
            dats.discard(eid)
            dir_changed = True
        cut_total = bad_total = 0
        for eid in sorted(dats):
            ext, cut = self._recover(eid)
            self._extents[eid] = ext
            if self._on_extent is not None:
                self._on_extent(ext.size)
            cut_total += cut
            bad_total += len(ext.bad)
            dir_changed = dir_changed or eid not in crcs
        if dir_changed:
            _fsync_dir(self._dir)
        top = max([*self._extents, *self._tombstones], default=0)
        if self._next_id <= top:
            self._next_id = top + 1
        log.info("%s: opened %d extents (%d bytes), cut %d torn-tail bytes, %d bad blocks, next id %d",
                 self.root, len(self._extents), sum(e.size for e in self._extents.values()), cut_total,
                 bad_total, self._next_id)

    def _recover(self, eid: int) -> tuple[_Extent, int]:
        dat_p, crc_p, _ = self._paths(eid)
        dat = os.open(dat_p, os.O_RDWR | _O_CLOEXEC)
        try:
            crc = os.open(crc_p, os.O_RDWR | os.O_CREAT | _O_CLOEXEC, 0o644)
        except BaseException:
            os.close(dat)
            raise
        try:
            return self._recover_fds(eid, dat, crc)
        except BaseException:
            os.close(dat)
            os.close(crc)
            raise

    def _recover_fds(self, eid: int, dat: int, crcfd: int) -> tuple[_Extent, int]:
        data_len = os.fstat(dat).st_size
        raw = b""
        crc_len = os.fstat(crcfd).st_size
        if crc_len:
            raw = os.pread(crcfd, crc_len, 0)
            crc_len = len(raw)
        n = min(len(raw) // _ESZ, MAX_EXTENT // BLOCK)
        entries = [_ENTRY.unpack_from(raw, i * _ESZ) for i in range(n)]
        buf = memoryview(bytearray(BLOCK))
        memo: dict[tuple[int, int], bool] = {}

        def check(i: int, cov: int) -> bool:
            key = (i, cov)
            r = memo.get(key)
            if r is None:
                got = _preadv_all(dat, [buf[:cov]], i * BLOCK)
                r = memo[key] = got == cov and crc32c(buf[:cov]) == entries[i][0]
            return r

        def valid(i: int) -> bool:
            return 0 < entries[i][1] <= BLOCK

        def present(i: int) -> bool:
            return data_len >= i * BLOCK + entries[i][1]

        def good(i: int) -> bool:
            return valid(i) and present(i) and check(i, entries[i][1])

        slots = _unpack_slots(raw)
        if slots:
            ext = self._recover_by_slot(eid, dat, crcfd, data_len, raw, entries, slots, check, buf)
            if ext is not None:
                return ext

        # 1. the first GOOD partial entry ends the extent
        last = None
        partial_end = False
        for i in range(n):
            if valid(i) and entries[i][1] < BLOCK and present(i) and good(i):
                last, partial_end = i, True
                break
        # 2. otherwise the last GOOD entry is the anchor
        if last is None:
            for i in range(n - 1, -1, -1):
                if good(i):
                    last = i
                    break
        keep = 0 if last is None else last + 1
        bad: set[int] = set()
        fixed: list[int] = []
        for i in range(keep - 1):               # entries before the anchor are full blocks
            c, cov = entries[i]
            if cov != BLOCK:
                fixed.append(i)
                entries[i] = (c, BLOCK)
                if not check(i, BLOCK):
                    bad.add(i)
            elif self.verify == "full" and not check(i, BLOCK):
                bad.add(i)
        # 3. BAD-but-complete entries after the anchor are kept (bit flips in acked data)
        if not partial_end:
            while keep < n and valid(keep) and present(keep):
                bad.add(keep)
                keep += 1
                if entries[keep - 1][1] < BLOCK:
                    break
        entries = entries[:keep]
        size = 0 if not entries else (keep - 1) * BLOCK + entries[-1][1]
        # 4. cut the torn tail
        cut = data_len - size
        if fixed:
            for i in fixed:
                _pwrite_all(crcfd, _ENTRY.pack(*entries[i]), i * _ESZ)
            log.warning("extent %d (%s): rewrote covered length of mid-extent entries %s to a full block",
                        eid, self.root, fixed)
        # what zero-fill ahead (PREFILL) leaves past the end is expected: dropped quietly (info)
        zeros_only = not raw[keep * _ESZ:_ENTRIES_END].strip(b"\0")
        if crc_len != keep * _ESZ:
            os.ftruncate(crcfd, keep * _ESZ)
            log.log(logging.INFO if zeros_only else logging.WARNING,
                    "extent %d (%s): dropped %d bytes of CRC entries beyond the last verified block "
                    "(%d entries kept of %d)", eid, self.root, crc_len - keep * _ESZ, keep, n)
        if cut:
            os.ftruncate(dat, size)
            ahead = zeros_only and PREFILL and data_len <= _ahead(size, PREFILL, MAX_EXTENT)
            log.log(logging.INFO if ahead else logging.WARNING,
                    "extent %d (%s): cut %s: data %d -> %d bytes (%d bytes cut)", eid, self.root,
                    "the tail past the last verified block (zero-filled ahead, or an append never "
                    "acknowledged)" if ahead else "torn tail", data_len, size, cut)
        if fixed or crc_len != keep * _ESZ:
            os.fsync(crcfd)
        if cut:
            os.fsync(dat)
        if bad:
            log.error("extent %d (%s): %d block(s) fail their CRC and are kept (reads of them will fail): %s",
                      eid, self.root, len(bad), sorted(bad))
        return _Extent(eid, dat, crcfd, size, entries, bad), cut

    def _recover_by_slot(self, eid: int, dat: int, crcfd: int, data_len: int, raw: bytes,
                         entries: list[tuple[int, int]], slots: list, check, buf) -> tuple[_Extent, int] | None:
        """Recovery by the tail slots (see "One flush"): the extent as the newest slot that verifies describes
        it, a torn flush after it cut; None when the entry rules must decide."""
        def older(k: int):
            return slots[k + 1] if k + 1 < len(slots) and slots[k + 1][0] == slots[k][0] - 1 else None

        def failing(k: int) -> list[int] | None:
            """The blocks slot k's flush wrote that fail their CRC; None: the slot cannot describe the files."""
            seq, size, tail_crc, _ = slots[k]
            nb, part = divmod(size, BLOCK)
            if data_len < size or len(entries) < nb or any(entries[i][1] != BLOCK for i in range(nb)):
                return None
            prev = older(k)
            lo = min(prev[1] // BLOCK, nb) if prev else max(nb - 1, 0)    # what this slot's flush wrote
            bad = [i for i in range(lo, nb) if not check(i, BLOCK)]
            if part and not (_preadv_all(dat, [buf[:part]], nb * BLOCK) == part and crc32c(buf[:part]) == tail_crc):
                bad.append(nb)
            return bad

        def zero_sector(start: int, end: int) -> bool:
            """Some 512-byte sector's part in [start, end) of the data file reads as zeros: a write of the
            flush that never reached the disk (under one flush those pages held zeros written ahead)."""
            while start < end:
                n = min(BLOCK, end - start)
                got = _preadv_all(dat, [buf[:n]], start)
                chunk = bytes(buf[:got])
                edge = -start % 512 or 512
                pieces = [chunk[:edge]] + [chunk[j:j + 512] for j in range(edge, len(chunk), 512)]
                if got < n or any(not piece.strip(b"\0") for piece in pieces if piece):
                    return True
                start += n
            return False

        pick, bad = 0, failing(0)
        if bad and slots[0][3] & _SLOT_ONE_FLUSH and older(0) and zero_sector(older(0)[1], slots[0][1]):
            bad = None          # a one-flush cut short by a power cut: it was never acknowledged
        if bad is None and slots[0][3] & _SLOT_ONE_FLUSH and older(0):
            pick, bad = 1, failing(1)
        if bad is None or (pick and bad):
            log.warning("extent %d (%s): no tail slot describes the files: recovering by the CRC entries",
                        eid, self.root)
            return None
        # bad (pick 0): blocks of a flush that completed fail their CRC -- a damaged medium, not a torn
        # write (all its bytes are there, none of them a sector the write never reached): kept, reported
        seq, size, tail_crc, _ = slots[pick]
        nb, part = divmod(size, BLOCK)
        kept = entries[:nb] + ([(tail_crc, part)] if part else [])
        bad = set(bad) | {i for i in range(nb) if self.verify == "full" and not check(i, BLOCK)}
        changed = False
        if part and (len(entries) <= nb or entries[nb] != (tail_crc, part)):
            _pwrite_all(crcfd, _ENTRY.pack(tail_crc, part), nb * _ESZ)
            changed = True
        beyond = raw[len(kept) * _ESZ:_ENTRIES_END]
        if beyond.strip(b"\0"):                    # entries a torn flush wrote past the slot's end
            _pwrite_all(crcfd, bytes(len(beyond)), len(kept) * _ESZ)
            changed = True
        if pick:                                    # the unfinished flush's slot must never be read again
            _pwrite_all(crcfd, bytes(SLOT_SIZE), _slot_pos(slots[0][0]))
            changed = True
        if changed:
            os.fsync(crcfd)
        cut = data_len - size
        if cut:
            os.ftruncate(dat, size)
            os.fsync(dat)
        if pick or cut:
            log.log(logging.WARNING if pick else logging.INFO,
                    "extent %d (%s): %s: data %d -> %d bytes (%d bytes cut)", eid, self.root,
                    "an unfinished flush (never acknowledged) cut back to the slot before it" if pick else
                    "the tail past the last flushed append (zero-filled ahead, or never acknowledged) cut",
                    data_len, size, cut)
        if bad:
            log.error("extent %d (%s): %d block(s) fail their CRC and are kept (reads of them will fail): %s",
                      eid, self.root, len(bad), sorted(bad))
        ext = _Extent(eid, dat, crcfd, size, kept, bad)
        ext.slot_seq = seq
        return ext, cut

    # --------------------------------------------------------------------------------------- lookups
    def _get(self, extent_id: int) -> _Extent:
        with self._lock:
            if self._closed:
                raise StoreError("disk", f"store {self.root} is closed")
            ext = self._extents.get(extent_id)
        if ext is None:
            raise StoreError("not_found", f"extent {extent_id} does not exist")
        return ext

    # ------------------------------------------------------------------------------------ public API
    def create_extent(self, extent_id: int | None = None) -> int:
        with self._create_lock:
            with self._lock:
                if self._closed:
                    raise StoreError("disk", f"store {self.root} is closed")
                if extent_id is None:
                    eid = self._next_id
                else:
                    eid = int(extent_id)
                    if not 1 <= eid <= MAX_EXTENT_ID:
                        raise StoreError("out_of_range", f"extent id {eid} is not in 1..{MAX_EXTENT_ID}",
                                         MAX_EXTENT_ID)
                    if eid in self._extents:
                        raise StoreError("exists", f"extent {eid} already exists", eid)
                    if eid in self._tombstones:
                        raise StoreError("deleted", f"extent {eid} was deleted; ids are never reused")
                bump = eid >= self._next_id
            try:
                if bump:
                    self._persist_next_id(eid + 1)
                    with self._lock:
                        self._next_id = max(self._next_id, eid + 1)
                dat_p, crc_p, _ = self._paths(eid)
                crcfd = os.open(crc_p, os.O_RDWR | os.O_CREAT | os.O_EXCL | _O_CLOEXEC, 0o644)
                try:
                    dat = os.open(dat_p, os.O_RDWR | os.O_CREAT | os.O_EXCL | _O_CLOEXEC, 0o644)
                except BaseException:
                    os.close(crcfd)
                    crc_p.unlink(missing_ok=True)
                    raise
                if self._durable:
                    _fsync_dir(self._dir)
            except FileExistsError as e:
                raise StoreError("exists", f"extent {eid}: {e}", eid) from None
            except OSError as e:
                raise io_error(f"create extent {eid}", e) from e
            with self._lock:
                if self._closed:
                    os.close(dat)
                    os.close(crcfd)
                    raise StoreError("disk", f"store {self.root} is closed")
                self._extents[eid] = _Extent(eid, dat, crcfd, 0, [], set())
            return eid

    def _persist_next_id(self, value: int) -> None:
        tmp = self.root / (_NEXT_ID + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _O_CLOEXEC, 0o644)
        try:
            _pwrite_all(fd, f"{value}\n".encode(), 0)
            if self._durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.root / _NEXT_ID)
        if self._durable:
            _fsync_dir(self.root)

    def write(self, extent_id: int, offset: int, data, crc: int | None = None) -> int:
        """Append ``data`` at ``offset`` (the extent's end) and, under sync=always, make it durable before
        returning (``append`` + ``flush``).  Returns the extent's new size."""
        end = self.append(extent_id, offset, data, crc)
        if self._durable:
            self.flush([extent_id])
        return end

    def append(self, extent_id: int, offset: int, data, crc: int | None = None, pieces: list[int] | None = None,
               *, blocking: bool = True) -> int:
        """The first half of a write: checks, block CRCs, ``pwrite`` of the data; the extent's size moves at
        once (the next append may follow).  Under sync=always nothing is durable yet and the CRC entries stay
        in memory until ``flush`` (group commit: one flush makes every append before it durable); under
        sync=none the entries are written here.  ``blocking=False``: raise ``WouldBlock`` instead of waiting
        for the extent's mutation lock (the async caller then retries in a thread).  ``pieces``: the caller's
        ``piece_crcs(offset, data)`` (its CRC already checked): used instead of reading the bytes again.
        Returns the new size."""
        ext = self._get(extent_id)
        mv = _byte_view(data)
        n = len(mv)
        if not ext.wlock.acquire(blocking):
            raise WouldBlock(extent_id)
        try:
            if ext.dead:
                raise StoreError("not_found", f"extent {extent_id} does not exist")
            size = ext.size
            if offset != size:
                raise StoreError("wrong_offset", f"extent {extent_id}: append at {offset}, current size is {size}",
                                 size)
            if offset + n > MAX_EXTENT:
                raise StoreError("too_large", f"extent {extent_id}: {offset}+{n} exceeds {MAX_EXTENT}", MAX_EXTENT)
            if ext.broken:
                raise StoreError("disk", f"extent {extent_id} needs recovery (reopen): {ext.broken}")
            # per-block CRCs (and the whole-buffer CRC) in one pass over the bytes
            entries = ext.entries
            first = size // BLOCK
            new: list[tuple[int, int]] = []
            whole = 0
            pos = 0
            blk = first
            within = size % BLOCK
            if pieces is not None and len(pieces) != (-(-(within + n) // BLOCK) if n else 0):
                raise ValueError("pieces do not match this append")
            k = 0
            while pos < n:
                take = min(BLOCK - within, n - pos)
                piece = mv[pos:pos + take] if take != n else mv
                if pieces is not None:
                    c = pieces[k]
                    k += 1
                else:
                    c = crc32c(piece)
                if crc is not None:
                    whole = c if pos == 0 else _cat(whole, piece, c)
                if within:
                    old_c, old_cov = entries[blk]
                    new.append((_cat(old_c, piece, c), old_cov + take))
                else:
                    new.append((c, take))
                pos += take
                blk += 1
                within = 0
            if crc is not None and whole != (crc & 0xFFFFFFFF):
                raise StoreError("crc", f"extent {extent_id}: payload CRC {whole:#010x} != {crc & 0xFFFFFFFF:#010x}")
            if not n:
                return size
            stage = "pwrite data"
            try:
                if self._write_direct(ext, mv, offset):
                    ext.filled = max(ext.filled, offset + n)
                elif self._durable and n <= PREFILL:
                    ext.filled = _pwrite_ahead(ext.dat, mv, offset, ext.filled, PREFILL, MAX_EXTENT)
                else:
                    _pwrite_all(ext.dat, mv, offset)
                    ext.filled = max(ext.filled, offset + n)
                if not self._durable:
                    stage = "pwrite crc"
                    if ext.slot_seq is not None:     # slots of a sync=always past would outvote these entries
                        _pwrite_all(ext.crc, bytes(2 * SLOT_SIZE), _ENTRIES_END)
                        ext.slot_seq = ext.crc_synced = None
                    _pwrite_all(ext.crc, b"".join([_ENTRY.pack(*e) for e in new]), first * _ESZ)
            except OSError as e:
                self._rollback(ext, size, first, stage, e)
                raise io_error(f"extent {extent_id}: {stage}", e) from e
            with ext.mu:
                entries[first:] = new       # readers copy slices under mu, so in place is fine
                ext.size = size + n
                ext.gen += 1
                if self._durable:
                    if ext.dirty_from is None or first < ext.dirty_from:
                        ext.dirty_from = first
                else:
                    ext.durable = size + n
            return size + n
        finally:
            ext.wlock.release()

    def durable_size(self, extent_id: int) -> int:
        """Bytes of the extent known durable (under sync=none: written)."""
        return self._get(extent_id).durable

    def flush(self, extent_ids) -> dict[int, StoreError]:
        """Make every append to these extents that returned before this call durable: fdatasync the data,
        then write the CRC entries that describe it and fdatasync them (the write order of the module
        docstring, once for any number of appends).  Returns the extents that failed, with their error
        (the extent is then broken: its waiters must fail, and it refuses writes until reopened)."""
        failed: dict[int, StoreError] = {}
        for eid in extent_ids:
            try:
                ext = self._get(eid)
            except StoreError as e:
                failed[eid] = e
                continue
            with ext.flock:
                err = self._flush_locked(ext)
            if err is not None:
                failed[eid] = err
        return failed

    def _flush_locked(self, ext: _Extent) -> StoreError | None:
        """``flush`` of one extent; the caller holds ``ext.flock``."""
        if ext.dead:
            return StoreError("not_found", f"extent {ext.id} does not exist")
        if ext.broken:
            return StoreError("disk", f"extent {ext.id} needs recovery (reopen): {ext.broken}")
        with ext.mu:
            first, ext.dirty_from = ext.dirty_from, None
            if first is None:
                return None
            size = ext.size
            ents = ext.entries[first:]
        # one flush where a durable slot describes the state before it and the data file's length is already
        # durable (the appends overwrote zeros written ahead); or, where they grew the data file, one whose
        # entries and slot overwrite CRC-file blocks this process made durable ("One flush", a growing file):
        # it ends with the data file's fdatasync.  Else the data is synced first, as always.
        one = self._one_flush and ext.slot_seq is not None and size <= ext.synced
        grow = (not one and self._one_flush and ext.crc_synced is not None
                and (first + len(ents)) * _ESZ <= ext.crc_synced)
        filled = ext.filled
        seq = (ext.slot_seq or 0) + 1
        stage = "sync_file_range data"
        pos, n = first * BLOCK, size - first * BLOCK
        try:
            # every byte pwritten before the snapshot above on its way to the device
            if (one or grow) and not self._write_out(ext, pos, n):
                one = grow = False
            if not (one or grow):
                stage = "fdatasync data"
                _fdatasync(ext.dat)        # every byte pwritten before the snapshot above, durable
            slot = _pack_slot(seq, size, ents[-1][0] if size % BLOCK else 0,
                              _SLOT_ONE_FLUSH if one or grow else 0)
            stage = "pwrite crc"
            if ents:
                ext.crc_filled = _pwrite_ahead(ext.crc, memoryview(b"".join([_ENTRY.pack(*e) for e in ents])),
                                               first * _ESZ, ext.crc_filled, _CRC_PREFILL, _ENTRIES_END)
            _pwrite_all(ext.crc, slot, _slot_pos(seq))
            if grow:
                # the entries and the slot land first (they overwrite blocks the CRC file durably has: no
                # metadata of its own); then the data file's fdatasync writes what is left of the data,
                # commits its new length, and flushes the device's cache -- for the CRC pages too
                stage = "sync_file_range crc"
                _sync_range(ext.crc, 0, 0, SFR_START | SFR_WAIT)
                stage = "fdatasync data"
                _fdatasync(ext.dat)
            else:
                if one:
                    # the entries and the slot go to the device while the data is still on its way (both
                    # writes in flight together); the cache flush below must come after the data has landed
                    stage = "sync_file_range crc"
                    _sync_range(ext.crc, 0, 0, SFR_START)
                    stage = "sync_file_range data (wait)"
                    _sync_range(ext.dat, pos, n, SFR_WAIT)
                stage = "fdatasync crc"
                _fdatasync(ext.crc)        # (one flush: its cache flush makes the data durable too)
        except OSError as e:
            # the page cache state is unknown after a failed fsync: refuse writes until recovery
            ext.broken = f"{stage}: {e}"
            log.error("extent %d (%s): %s failed: %s -- extent marked broken", ext.id, self.root, stage, e)
            return io_error(f"extent {ext.id}: {stage}", e)
        ext.slot_seq = seq
        if one or grow:
            self.one_flushes += 1
        if not one:    # the data file's fdatasync: its length is durable
            ext.synced = max(ext.synced, min(filled, ext.filled))   # (a rollback may have cut it meanwhile)
        if not grow:   # the CRC file's fdatasync: its blocks, the slots' too, are durable
            ext.crc_synced = ext.crc_filled
        with ext.mu:
            if size > ext.durable:
                ext.durable = size
        return None

    def _write_out(self, ext: _Extent, pos: int, n: int) -> bool:
        """The one-flush path's first step (the data on its way to the device); False where the file system
        refuses sync_file_range (the caller then syncs the data first, and so does every later flush of this
        store)."""
        try:
            _sync_range(ext.dat, pos, n, SFR_START)
            return True
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ESPIPE):
                raise
            if self._one_flush:
                self._one_flush = False
                log.warning("%s: sync_file_range refused (%s): every flush syncs the data first instead", self.root, e)
            return False

    def _rollback(self, ext: _Extent, size: int, first: int, stage: str, err: OSError) -> None:
        """Put the files back to ``size`` after a failed append (best effort)."""
        try:
            os.ftruncate(ext.dat, size)
            ext.filled = size
            ext.synced = min(ext.synced, size)      # a shorter length, not yet durable
            if not self._durable and first < len(ext.entries):
                _pwrite_all(ext.crc, _ENTRY.pack(*ext.entries[first]), first * _ESZ)
            if not self._durable:
                os.ftruncate(ext.crc, len(ext.entries) * _ESZ)
                ext.crc_filled = len(ext.entries) * _ESZ
        except OSError as e2:
            ext.broken = f"{stage}: {err}; rollback failed: {e2}"
        else:
            if stage.startswith("fdatasync"):
                # after a failed fsync the page cache state is unknown: refuse writes until recovery
                ext.broken = f"{stage}: {err}"
        log.error("extent %d (%s): %s failed: %s%s", ext.id, self.root, stage, err,
                  f" -- extent marked broken ({ext.broken})" if ext.broken else "")

    def read_into(self, extent_id: int, offset: int, length: int, out: memoryview, *, nowait: bool = False) -> int:
        """Read ``[offset, +length)`` into ``out``, every block CRC-checked; returns the CRC32C of the range.
        ``nowait``: never block (a truncate/delete in progress, or bytes not in the page cache): raise
        ``WouldBlock`` instead, so an event loop can try here first and go to a thread only when needed."""
        ext = self._get(extent_id)
        if offset < 0 or length < 0:
            raise StoreError("out_of_range", f"extent {extent_id}: negative offset/length {offset}/{length}",
                             ext.size)
        out = _byte_view(out)
        if len(out) < length:
            raise ValueError(f"output buffer holds {len(out)} bytes, {length} requested")
        end = offset + length
        b0 = offset // BLOCK
        b1 = (end - 1) // BLOCK if length else b0
        size, ents = ext.begin_read(b0, b1, nowait)
        try:
            if end > size:
                raise StoreError("out_of_range", f"extent {extent_id}: range {offset}+{length} beyond size {size}",
                                 size)
            if not length:
                return 0
            head_buf, tail_buf = _scratch_bufs()
            bstart = b0 * BLOCK
            head = offset - bstart
            last_end = b1 * BLOCK + ents[-1][1]
            tail = last_end - end
            dst = out[:length]
            want = head + length + tail
            try:
                bufs = [head_buf[:head], dst, tail_buf[:tail]]
                # a blocking read of a range the page cache does not hold: O_DIRECT into the buffers
                got = 0 if nowait else self._read_direct(ext, bufs, bstart, want)
                if got < want:
                    if not nowait and want - got >= WILLNEED_MIN and _FADV_WILLNEED is not None:
                        # a read that may go to the disk: ask for the whole range at once (readahead of just
                        # this range, every page's I/O in flight together) rather than the file's readahead
                        # window at a time, which reads beside it with other reads of the file interleaved
                        # (1 MiB preads of a cold 512 MiB file by 8 threads: 237-804 MiB/s without, 1278-1382
                        # with, O_DIRECT 1270-1329; dnctl bench --cold, 1 MiB x depth 8, 3 replicas, median of
                        # 4 interleaved rounds: 165 -> 254 MiB/s)
                        try:
                            os.posix_fadvise(ext.dat, bstart + got, want - got, _FADV_WILLNEED)
                        except OSError:
                            pass            # only advice: the read below is what counts
                    got += _preadv_all(ext.dat, _advance(bufs, got), bstart + got, nowait)
            except OSError as e:
                raise StoreError("disk", f"extent {extent_id}: read: {e}") from e
            if got != want:
                self._fail_read(ext, dst, b0, f"data file is short ({got} of {want} bytes at {bstart})")
            rc = 0
            pos = 0  # position in dst
            for k, (ecrc, cov) in enumerate(ents):
                i = b0 + k
                in_len = min(BLOCK - (head if k == 0 else 0), length - pos)
                if k == len(ents) - 1:
                    in_len = length - pos
                piece = dst[pos:pos + in_len]
                c_in = crc32c(piece)
                bc = c_in
                if k == 0 and head:
                    bc = _cat(crc32c(head_buf[:head]), piece, c_in)
                if k == len(ents) - 1 and tail:
                    t = tail_buf[:tail]
                    bc = _cat(bc, t, crc32c(t))
                if bc != ecrc:
                    with ext.mu:
                        ext.bad.add(i)
                    self._fail_read(ext, dst, i, f"stored {ecrc:#010x}, computed {bc:#010x} over {cov} bytes")
                rc = c_in if pos == 0 else _cat(rc, piece, c_in)
                pos += in_len
            return rc
        finally:
            ext.end_read()

    @staticmethod
    def _read_direct(ext: _Extent, bufs: list[memoryview], pos: int, want: int) -> int:
        """A blocking read of ``want`` bytes at ``pos`` into ``bufs`` with O_DIRECT, if the page cache holds
        none of it and the buffers and range are aligned (see DIRECT_READS).  Returns the bytes read, 0 when
        it did not read; the caller reads whatever is left through the page cache."""
        if not DIRECT_READS or want < DIRECT_MIN or not _direct_ok(bufs, pos):
            return 0
        if cached_pages(ext.dat, pos, want) != 0:
            return 0                  # (partly) in the page cache, or we cannot tell: read through it
        fd = ext.direct_fd()
        if fd < 0:
            return 0
        try:
            return _preadv_all(fd, bufs, pos)
        except OSError as e:
            if e.errno == errno.EINVAL:   # an alignment this file system wants and we did not guess
                return 0
            raise

    def _write_direct(self, ext: _Extent, mv: memoryview, pos: int) -> bool:
        """Write ``mv`` at ``pos`` with O_DIRECT where it is big and aligned enough (see DIRECT_WRITES);
        False when it did not (the caller writes through the page cache)."""
        if not DIRECT_WRITES or len(mv) < DIRECT_MIN or not _direct_ok([mv], pos):
            return False
        fd = ext.direct_fd()
        if fd < 0:
            return False
        try:
            _pwrite_all(fd, mv, pos)
        except OSError as e:
            if e.errno == errno.EINVAL:   # an alignment this file system wants and we did not guess: the
                return False              # buffered write that follows writes every byte again
            raise
        self.direct_writes += 1
        return True

    def _fail_read(self, ext: _Extent, dst: memoryview, block: int, why: str):
        dst[:] = bytes(len(dst))     # never hand back unverified bytes
        log.error("extent %d (%s): block %d fails its CRC: %s", ext.id, self.root, block, why)
        raise StoreError("crc", f"extent {ext.id} block {block} (offset {block * BLOCK}): CRC mismatch: {why}")

    def size(self, extent_id: int) -> int:
        return self._get(extent_id).size

    def tombstones(self) -> set[int]:
        """Ids of the extents deleted from this store (never handed out again)."""
        with self._lock:
            return set(self._tombstones)

    def block_entries(self, extent_id: int) -> tuple[int, list[tuple[int, int]]]:
        """(size, [(crc, covered)] per block) of one extent, one consistent snapshot."""
        ext = self._get(extent_id)
        with ext.mu:
            return ext.size, list(ext.entries)

    def watermarks(self) -> dict[int, int]:
        with self._lock:
            exts = list(self._extents.values())
        return {e.id: e.size for e in exts}

    def digests(self) -> dict[int, tuple[int, int]]:
        """(size, digest) of every extent, each a consistent snapshot.  The digest is the CRC32C of the
        extent's block CRC entries (crc, covered), so two copies of the same size have the same digest exactly
        when every block holds the same bytes (up to CRC collisions): replicas compare it every heartbeat.
        Cached per extent until its next change (``gen``), so an idle extent costs nothing."""
        with self._lock:
            exts = list(self._extents.values())
        cache = self._digests
        out = {}
        for ext in exts:
            with ext.mu:
                gen, size = ext.gen, ext.size
                hit = cache.get(ext.id)
                entries = None if hit is not None and hit[0] is ext and hit[1] == gen else list(ext.entries)
            if entries is None:
                out[ext.id] = (size, hit[2])
                continue
            flat = [x for e in entries for x in e]
            digest = crc32c(struct.pack(f">{len(flat)}I", *flat)) if flat else 0
            cache[ext.id] = (ext, gen, digest)
            out[ext.id] = (size, digest)
        return out

    def block_crcs(self, extent_id: int) -> list[int]:
        ext = self._get(extent_id)
        with ext.mu:
            return [c for c, _ in ext.entries]

    def mark_delete(self, extent_id: int) -> None:
        with self._lock:
            if self._closed:
                raise StoreError("disk", f"store {self.root} is closed")
            ext = self._extents.pop(extent_id, None)
            self._digests.pop(extent_id, None)
            if ext is None:
                raise StoreError("not_found", f"extent {extent_id} does not exist")
            self._tombstones.add(extent_id)
        dat_p, crc_p, tomb_p = self._paths(extent_id)
        with ext.wlock, ext.flock:
            ext.begin_exclusive()
            try:
                with ext.mu:
                    ext.dead = True
                ext.close_fds()
                try:
                    os.replace(dat_p, tomb_p)    # atomic: from here on the extent is gone after a crash
                    free_in_steps(tomb_p)        # free the space, keep the name as the tombstone
                    crc_p.unlink(missing_ok=True)
                    if self._durable:
                        _fsync_dir(self._dir)
                except OSError as e:
                    raise io_error(f"delete extent {extent_id}", e) from e
            finally:
                ext.end_exclusive()
        log.info("extent %d (%s): deleted", extent_id, self.root)

    def truncate(self, extent_id: int, size: int) -> None:
        ext = self._get(extent_id)
        with ext.wlock, ext.flock:
            err = self._flush_locked(ext)   # no appended entry may land after the truncate
            if err is not None:
                raise err
            if ext.dead:
                raise StoreError("not_found", f"extent {extent_id} does not exist")
            cur = ext.size
            if size < 0 or size > cur:
                raise StoreError("out_of_range", f"extent {extent_id}: truncate to {size}, current size is {cur}",
                                 cur)
            if size == cur:
                return
            ext.begin_exclusive()
            try:
                keep = (size + BLOCK - 1) // BLOCK
                entries = ext.entries[:keep]
                within = size % BLOCK
                try:
                    if within:
                        # recompute the new partial last block's CRC, from verified bytes only
                        i = keep - 1
                        old_c, old_cov = entries[i]
                        buf = memoryview(bytearray(old_cov))
                        got = _preadv_all(ext.dat, [buf], i * BLOCK)
                        if got != old_cov or crc32c(buf) != old_c:
                            raise StoreError("crc", f"extent {extent_id}: block {i} fails its CRC; truncate to "
                                                    f"{i * BLOCK} (the block boundary) instead")
                        entries[i] = (crc32c(buf[:within]), within)
                        _pwrite_all(ext.crc, _ENTRY.pack(*entries[i]), i * _ESZ)
                    # entries first (crash here: recovery stops at the rewritten entry and cuts the data)
                    os.ftruncate(ext.crc, keep * _ESZ)      # (the slots go too: the next flush writes one)
                    ext.crc_filled = keep * _ESZ
                    ext.slot_seq = ext.crc_synced = None
                    if self._durable:
                        _fdatasync(ext.crc)
                    shrink_in_steps(ext.dat, size)          # (a repair may cut 128 MiB: see FREE_STEP)
                    ext.filled = size
                    if self._durable:
                        _fdatasync(ext.dat)
                        ext.synced = size
                except OSError as e:
                    ext.broken = f"truncate: {e}"
                    raise io_error(f"extent {extent_id}: truncate", e) from e
                with ext.mu:
                    ext.entries = entries
                    ext.size = size
                    ext.gen += 1
                    ext.durable = min(ext.durable, size)
                    ext.bad = {b for b in ext.bad if b < keep}
            finally:
                ext.end_exclusive()
        log.info("extent %d (%s): truncated %d -> %d", extent_id, self.root, cur, size)

    def stats(self) -> dict:
        with self._lock:
            exts = list(self._extents.values())
            next_id = self._next_id
            deleted = len(self._tombstones)
        return {
            "extents": len(exts),
            "bytes": sum(e.size for e in exts),
            "sync": self.sync,
            "verify": self.verify,
            "bad_blocks": sum(len(e.bad) for e in exts),
            "broken_extents": sum(1 for e in exts if e.broken),
            "deleted": deleted,
            "next_id": next_id,
        }

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            exts = list(self._extents.values())
            self._extents.clear()
        for ext in exts:
            with ext.wlock, ext.flock:
                if ext.dirty_from is not None:
                    self._flush_locked(ext)      # appends not yet acknowledged: keep them if we can
                ext.begin_exclusive()
                try:
                    with ext.mu:
                        ext.dead = True
                    self._trim(ext)
                    ext.close_fds()
                finally:
                    ext.end_exclusive()

    def _trim(self, ext: _Extent) -> None:
        """On a clean close, give back what zero-fill ahead wrote past the end (best effort, no fsync: if
        it is lost, recovery cuts the same bytes)."""
        if ext.broken:
            return
        try:
            if ext.filled > ext.size:
                os.ftruncate(ext.dat, ext.size)
            if (ext.crc_filled > len(ext.entries) * _ESZ or ext.slot_seq is not None) and ext.dirty_from is None:
                os.ftruncate(ext.crc, len(ext.entries) * _ESZ)     # the slots too: the entries say it all
        except OSError as e:
            log.info("extent %d (%s): zero-filled tail kept (%s): the next open cuts it", ext.id, self.root, e)

    def __enter__(self) -> "ExtentStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
