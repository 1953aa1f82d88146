"""A file's write-back buffer: the bytes written but not yet in extents, as sorted non-overlapping ranges.

A write that touches or overlaps buffered ranges is merged with them (the newest bytes win), so a flush
sends each contiguous run once and the common case — sequential writes — just extends the last range.
Pure data structure: no I/O.
"""
from __future__ import annotations

import bisect


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
