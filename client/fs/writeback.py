"""The write-back state of dnfs as plain data: which bytes are buffered, when they go to the cluster, which
partition a flush tries next, and the slices the appended bytes become.  No I/O: client/fs/writer.py drives
these with trio, the metadata engine and the SDK.

A file's buffer (:class:`DirtyMap`) is sorted non-overlapping ranges; a write that touches or overlaps
buffered ranges is merged with them (the newest bytes win), so a flush sends each contiguous run once and the
common case -- sequential writes -- just extends the last range.
"""
from __future__ import annotations

import bisect
import enum
from typing import Callable, Iterable, Protocol

from client.fs.meta import Slice

BUDGET = 256 << 20      # bytes all files of a mount together may hold unwritten
CHUNK = 8 << 20         # a file's buffer is flushed at this size; a writer ahead of the cluster waits up to
                        # one chunk's flush, so it bounds a buffered write's latency (and larger ones gain little)
WRITE_RETRY_S = 30.0    # a failed write is tried again elsewhere this long before its file reports EIO: long
                        # enough for the cluster manager to move a partition off a dead node


class DirtyMap:
    def __init__(self):
        self.starts: list[int] = []
        self.bufs: list[bytearray] = []
        self.nbytes = 0

    def __bool__(self) -> bool:
        return bool(self.starts)

    @property
    def end(self) -> int:
        return self.starts[-1] + len(self.bufs[-1]) if self.starts else 0

    def write(self, off: int, data) -> None:
        n = len(data)
        if not n:
            return
        if self.starts and off == self.end:               # sequential: extend the last range
            self.bufs[-1] += data
            self.nbytes += n
            return
        end = off + n
        # ranges [i, j) touch [off, end]
        i = bisect.bisect_left(self.starts, off)
        if i > 0 and self.starts[i - 1] + len(self.bufs[i - 1]) >= off:
            i -= 1
        j = bisect.bisect_right(self.starts, end)
        if i == j:
            self.starts.insert(i, off)
            self.bufs.insert(i, bytearray(data))
            self.nbytes += n
            return
        lo = min(off, self.starts[i])
        hi = max(end, self.starts[j - 1] + len(self.bufs[j - 1]))
        merged = bytearray(hi - lo)
        for k in range(i, j):
            s = self.starts[k] - lo
            merged[s:s + len(self.bufs[k])] = self.bufs[k]
            self.nbytes -= len(self.bufs[k])
        merged[off - lo:end - lo] = data
        self.starts[i:j] = [lo]
        self.bufs[i:j] = [merged]
        self.nbytes += len(merged)

    def truncate(self, size: int) -> None:
        while self.starts and self.starts[-1] >= size:
            self.starts.pop()
            self.nbytes -= len(self.bufs.pop())
        if self.starts and self.end > size:
            cut = self.end - size
            del self.bufs[-1][len(self.bufs[-1]) - cut:]
            self.nbytes -= cut

    def ranges(self) -> list[tuple[int, bytearray]]:
        return list(zip(self.starts, self.bufs))

    def overlay(self, off: int, out: bytearray) -> None:
        """Copy the buffered bytes that fall in [off, off+len(out)) over ``out``."""
        end = off + len(out)
        i = max(bisect.bisect_right(self.starts, off) - 1, 0)
        for k in range(i, len(self.starts)):
            s = self.starts[k]
            if s >= end:
                break
            b = self.bufs[k]
            lo, hi = max(s, off), min(s + len(b), end)
            if lo < hi:
                out[lo - off:hi - off] = b[lo - s:hi - s]


class Flush(enum.Enum):
    """What a write starts (:meth:`Budget.after_write`)."""
    NONE = "none"                   # nothing: the bytes stay buffered
    BACKGROUND = "background"       # a flush of the file behind the caller
    WAIT = "wait"                   # the caller waits until the flush under way takes its buffer


class Budget:
    """The bytes every file of the mount holds unwritten, against ``limit``; a file's buffer goes to the
    cluster once it holds ``chunk`` bytes."""

    def __init__(self, limit: int, chunk: int):
        self.limit = limit
        self.chunk = min(chunk, limit)
        self.used = 0

    def over(self) -> bool:
        """Too much is buffered: the writer flushes the largest buffers ..."""
        return self.used > self.limit

    def relieved(self) -> bool:
        """... until this much room is free again (so it does not stall at every write near the limit)."""
        return self.used <= self.limit // 2

    def after_write(self, buffered: int, busy: bool) -> Flush:
        """What a write that left ``buffered`` bytes in its file's buffer starts; ``busy``: a flush of that
        file is under way.  A full chunk is written behind the caller; while one is being written the writer
        fills the next, and once that is full too, waits until the flush ends and the next one takes it
        (double buffering: the wait is what is left of one flush, the chunk's size bounds it)."""
        if buffered < self.chunk:
            return Flush.NONE
        return Flush.WAIT if busy else Flush.BACKGROUND


class FileBuffer:
    """A file's bytes not yet in the metadata: the ones buffered (``dirty``) and the ones a flush is writing
    (``flushing``, readable until committed), counted against the mount's :class:`Budget`."""

    def __init__(self, budget: Budget):
        self.budget = budget
        self.dirty = DirtyMap()
        self.flushing: DirtyMap | None = None

    @property
    def pending(self) -> bool:
        return bool(self.dirty) or bool(self.flushing)

    @property
    def nbytes(self) -> int:
        return self.dirty.nbytes + (self.flushing.nbytes if self.flushing else 0)

    def write(self, off: int, data) -> None:
        before = self.dirty.nbytes
        self.dirty.write(off, data)
        self.budget.used += self.dirty.nbytes - before

    def truncate(self, size: int) -> None:
        before = self.dirty.nbytes
        self.dirty.truncate(size)
        self.budget.used += self.dirty.nbytes - before

    def take(self) -> DirtyMap:
        """A flush starts: the buffered bytes become the ones being written; new writes buffer anew."""
        m, self.dirty = self.dirty, DirtyMap()
        self.flushing = m
        return m

    def written(self) -> None:
        """The flush ended (committed, or failed and reported): its bytes leave the buffer."""
        if self.flushing is not None:
            self.budget.used -= self.flushing.nbytes
            self.flushing = None

    def drop(self) -> None:
        """Forget the buffered bytes (the file is gone: nobody can read them)."""
        if self.dirty:
            self.budget.used -= self.dirty.nbytes
            self.dirty = DirtyMap()

    def overlay(self, off: int, out: bytearray) -> None:
        """Lay the unwritten bytes in [off, off+len(out)) over ``out`` (the newest last)."""
        if self.flushing:
            self.flushing.overlay(off, out)
        if self.dirty:
            self.dirty.overlay(off, out)


class Appended(Protocol):
    """Where one append put its bytes (the SDK's ``Location``)."""
    partition: int
    extent: int
    offset: int
    length: int
    crc: int


def to_slices(ranges: Iterable[tuple[int, int]], locs: Iterable[Appended]) -> list[Slice]:
    """The slices that say where file ranges ``[(offset, length)]`` went, their bytes having been written back
    to back as the appends ``locs`` (in order).  An append that spans two ranges becomes two slices, each a
    window onto it (``wpos``/``wlen``/``crc`` keep naming the whole append, for fsck)."""
    slices: list[Slice] = []
    it = iter(ranges)
    roff, rlen = next(it, (0, 0))
    rpos = 0        # payload position where the current range starts
    q = 0           # payload position of the current location
    for loc in locs:
        x = q
        while x < q + loc.length:
            if x >= rpos + rlen:
                rpos += rlen
                try:
                    roff, rlen = next(it)
                except StopIteration:
                    raise ValueError("the appends hold more bytes than the ranges") from None
                continue
            y = min(q + loc.length, rpos + rlen)
            slices.append(Slice(roff + x - rpos, y - x, loc.partition, loc.extent, loc.offset + x - q, loc.offset,
                                loc.length, loc.crc))
            x = y
        q += loc.length
    return slices


def acked_ranges(ranges: Iterable[tuple[int, int]], n: int) -> list[tuple[int, int]]:
    """The file ranges ``[(offset, length)]`` whose bytes are the first ``n`` of their payload (written back
    to back): what a flush that failed after ``n`` acknowledged bytes did store."""
    out = []
    for off, length in ranges:
        if n <= 0:
            break
        out.append((off, min(length, n)))
        n -= length
    return out


class Placement:
    """Which partition a flush writes to next.  The file's home partition first, then the others in order;
    one a write just failed on is passed over for ``avoid_s`` (``avoid`` is shared by the mount's flushes)
    while another can take the write, one this flush found full is not tried again, and when every
    partition failed the flush pauses and starts over (the map may have changed meanwhile)."""

    def __init__(self, partitions: list[int], home: int, avoid: dict[int, float], avoid_s: float):
        self.partitions = partitions
        self.order = [home] + [p for p in partitions if p != home]
        self.avoid, self.avoid_s = avoid, avoid_s
        self.failed: set[int] = set()
        self.full: set[int] = set()

    def next(self, now: float, writable: Callable[[int], bool], whole: Callable[[int], bool] = lambda p: True) -> int:
        """The partition to write to now; ``writable``: whether the map says a partition takes writes,
        ``whole``: whether it has every replica it wants (those go first: a failover leaves fewer copies)."""
        order = [p for p in self.order if p not in self.full]
        cands = [p for p in order if p not in self.failed and writable(p)]
        cands = [p for p in cands if self.avoid.get(p, 0) <= now] or cands
        cands = [p for p in cands if whole(p)] or cands
        return cands[0] if cands else order[0]

    def filled(self, pid: int) -> bool:
        """``pid`` has no room; True when no partition has (the write fails with ENOSPC)."""
        self.full.add(pid)
        return all(p in self.full for p in self.partitions)

    def failed_on(self, pid: int, now: float, writable: Callable[[int], bool]) -> bool:
        """A write to ``pid`` failed; True when every partition has failed (pause, then start over)."""
        self.failed.add(pid)
        self.avoid[pid] = now + self.avoid_s
        if not [p for p in self.partitions if p not in self.failed and writable(p)]:
            self.failed.clear()
            return True
        return False
