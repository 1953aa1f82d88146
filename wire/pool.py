"""Registered memory pool: one mmap'd arena managed by a buddy allocator.

The pool allocates ONE private anonymous arena at start-up, on huge pages
where the kernel gives them (``huge_pages``: asked for; a small client's pool
does without -- each first touch of a huge page may stall on the kernel's
compaction for milliseconds on a busy host, which its few pages do not repay).  Its real virtual address (``BuddyPool.base_addr``)
is obtained through cffi so that an
RDMA transport can register the whole arena as a single memory region; every
``Block`` then carries ``addr`` (= ``base_addr + offset``) for use in work
requests, and ``Block.view()`` gives a zero-copy writable ``memoryview`` into
the same memory for the TCP path / checksumming / disk I/O.

Allocator
---------
Classic binary buddy system.  Orders run from ``min_block`` (order 0) up to
``max_block`` (order ``max_order``); the arena starts out as
``arena_bytes // max_block`` free blocks of the top order.  Each order keeps
its free blocks in a dict keyed by offset (O(1) insert / remove / buddy
lookup), and a bit mask records which orders are non-empty, so ``alloc`` and
``free`` cost O(max_order) = O(log(max_block / min_block)) and never scan the
arena.  Blocks are aligned (relative to the arena start) to their own size;
the arena itself starts on a huge-page boundary (``HUGE_PAGE``).

Waiting
-------
``alloc()`` waits while the pool cannot satisfy the request.  Waiters are
served strictly FIFO: ``free()`` hands blocks directly to waiters at the head
of the queue for as long as the head's request fits, and stops at the first
one that does not (so a large request cannot be starved by a stream of small
ones).  While anybody is queued, new requests -- including ``try_alloc()`` --
do not jump the queue.  There is no polling: each waiter parks on its own
``trio.Event`` which ``free()`` sets after the block has already been handed
over, so a woken waiter never has to race for it.  A waiter that times out
or is cancelled leaves the queue (lazily, O(1)); if a block had already been
handed to it, the block is returned to the pool, so nothing leaks or gets
lost.

Threading
---------
A ``BuddyPool`` is NOT thread-safe.  Use it only from the trio thread that
runs the datanode (``try_alloc``/``free``/``stats`` are plain synchronous
calls and may also be used when no trio loop is running, e.g. in tests).
Code in worker threads must go through ``trio.from_thread.run_sync`` to
allocate or free.  Memoryviews obtained from ``Block.view()`` may of course
be read/written by worker threads (e.g. ``os.preadv`` in
``trio.to_thread``) while the owning task keeps the block alive.

Lifetime
--------
``close()`` unmaps the arena.  An RDMA transport must deregister its memory
region before that.  Memoryviews handed out earlier keep the mapping alive
(Python refuses to unmap an mmap with exported buffers), so a stray view can
never point at unmapped memory; the mapping is then released when the last
view is garbage collected.
"""

from __future__ import annotations

import math
import mmap
import operator
from collections import deque

import cffi
import trio

__all__ = ["BuddyPool", "Block", "PoolExhausted"]

_ffi = cffi.FFI()

# The arena is advised to live on transparent huge pages (2 MiB on x86-64): a block up to 2 MiB is then one
# piece of physical memory, which the disk takes as ONE segment of a request.  On 4 KiB pages an O_DIRECT read
# of 1 MiB into a pool block is 256 segments, and a device that takes fewer (virtio-blk here: max_segments
# 254) gets it as two requests, one of 1016 KiB and one of 8 KiB, at a large cost in throughput
# (``bench/direct_read_pages.py`` shows it).  Big O_DIRECT appends from the pool (the ``direct_writes`` key) gain
# the same way.
HUGE_PAGE = 2 << 20


def _advise_huge(mm: mmap.mmap, start: int, length: int) -> bool:
    """MADV_HUGEPAGE on ``[start, +length)`` of ``mm``; False where the kernel or Python lacks it (the
    arena then works on small pages, as before)."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or not length:
        return False
    try:
        mm.madvise(advice, start, length)
    except OSError:
        return False
    return True


class PoolExhausted(Exception):
    """``BuddyPool.alloc()`` could not get memory before its timeout."""

    def __init__(self, length: int, size: int, timeout: float):
        self.length = length
        self.size = size
        self.timeout = timeout
        super().__init__(
            f"memory pool exhausted: could not allocate {length} bytes "
            f"(a {size}-byte block) within timeout {timeout}s"
        )


class Block:
    """A live allocation from a :class:`BuddyPool`.

    Attributes: ``offset`` within the arena, ``size`` (the power-of-two
    block size actually reserved), ``length`` (the requested length,
    ``<= size``) and ``addr`` (virtual address, ``pool.base_addr + offset``).
    """

    __slots__ = ("offset", "size", "length", "addr", "_order", "_pool", "_live")

    def __init__(self, pool: BuddyPool, offset: int, order: int, length: int):
        self._pool = pool
        self._order = order
        self._live = True
        self.offset = offset
        self.size = pool.min_block << order
        self.length = length
        self.addr = pool.base_addr + offset

    def view(self, n: int | None = None) -> memoryview:
        """Writable, zero-copy memoryview of the first ``n`` bytes.

        ``n`` defaults to ``length`` and may be anything up to ``size``.
        """
        if not self._live:
            raise ValueError("block has been freed (or its pool closed)")
        if n is None:
            n = self.length
        elif not 0 <= n <= self.size:
            raise ValueError(f"n={n!r} outside 0..{self.size}")
        return self._pool.arena[self.offset:self.offset + n]

    @property
    def live(self) -> bool:
        """False once the block has been freed (or the pool closed)."""
        return self._live

    def __repr__(self) -> str:
        state = "" if self._live else " freed"
        return (f"<Block offset={self.offset:#x} size={self.size} "
                f"length={self.length}{state}>")


class _Waiter:
    __slots__ = ("order", "length", "event", "block", "done")

    def __init__(self, order: int, length: int):
        self.order = order
        self.length = length
        self.event = trio.Event()
        self.block: Block | None = None
        self.done = False        # served, abandoned, or failed by close()


def _int_param(name: str, value) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


def _is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


class BuddyPool:
    """One registered arena carved up by a buddy allocator.

    Only for use from the trio thread (see module docstring).
    """

    def __init__(self, arena_bytes: int = 256 << 20, max_block: int = 4 << 20,
                 min_block: int = 4096, huge_pages: bool = True):
        arena_bytes = _int_param("arena_bytes", arena_bytes)
        max_block = _int_param("max_block", max_block)
        min_block = _int_param("min_block", min_block)
        if not _is_pow2(min_block):
            raise ValueError(f"min_block must be a positive power of two, got {min_block}")
        if not _is_pow2(max_block):
            raise ValueError(f"max_block must be a positive power of two, got {max_block}")
        if max_block < min_block:
            raise ValueError(f"max_block ({max_block}) must be >= min_block ({min_block})")
        if arena_bytes <= 0 or arena_bytes % max_block:
            raise ValueError(
                f"arena_bytes must be a positive multiple of max_block ({max_block}), "
                f"got {arena_bytes}")

        self.arena_bytes = arena_bytes
        self.max_block = max_block
        self.min_block = min_block
        self._min_shift = min_block.bit_length() - 1
        self.max_order = max_block.bit_length() - min_block.bit_length()

        # Private anonymous memory (a plain mmap(-1) is MAP_SHARED: shmem, which the kernel backs with huge
        # pages only where the admin turned shmem THP on), one huge page more than asked for so that the
        # arena can start on a huge-page boundary, advised MADV_HUGEPAGE (see HUGE_PAGE).
        self._mm = mmap.mmap(-1, arena_bytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        # Keep the cdata alive: it pins the buffer export that backs base_addr.
        self._cdata = _ffi.from_buffer(self._mm)
        start = int(_ffi.cast("uintptr_t", self._cdata))
        if start % mmap.PAGESIZE:
            raise RuntimeError("anonymous mmap is not page aligned")
        skip = -start % HUGE_PAGE
        self.base_addr = start + skip
        self.huge_pages = huge_pages and _advise_huge(self._mm, skip, arena_bytes)
        self._whole = memoryview(self._mm)
        self.arena = self._whole[skip:skip + arena_bytes]

        # free[k]: offsets of free blocks of size min_block << k (dicts are
        # used as ordered sets; popitem() gives LIFO reuse = warm memory).
        self._free: list[dict[int, None]] = [{} for _ in range(self.max_order + 1)]
        self._free[self.max_order] = dict.fromkeys(range(0, arena_bytes, max_block))
        self._mask = 1 << self.max_order          # bit k set <=> free[k] non-empty
        self._live: dict[int, Block] = {}
        self._waiters: deque[_Waiter] = deque()
        self._n_waiting = 0
        self._closed = False

        self._in_use = 0
        self._high_water = 0
        self._allocs = 0
        self._frees = 0
        self._waits = 0
        self._timeouts = 0
        self._cancellations = 0

    # -- internals ------------------------------------------------------

    def _order_for(self, length) -> int:
        length = _int_param("length", length)
        if length < 0:
            raise ValueError(f"length must be >= 0, got {length}")
        if length > self.max_block:
            raise ValueError(f"length {length} exceeds max_block {self.max_block}")
        if length <= self.min_block:
            return 0
        return (length - 1).bit_length() - self._min_shift

    def _take(self, order: int, length: int) -> Block | None:
        """Split/pop a free block of ``order``; None if nothing fits."""
        m = self._mask >> order
        if not m:
            return None
        j = order + (m & -m).bit_length() - 1
        free = self._free
        fl = free[j]
        offset = fl.popitem()[0]
        if not fl:
            self._mask &= ~(1 << j)
        # Split down, putting the upper halves on the free lists.
        while j > order:
            j -= 1
            free[j][offset + (self.min_block << j)] = None
            self._mask |= 1 << j
        block = Block(self, offset, order, length)
        self._live[offset] = block
        self._in_use += block.size
        if self._in_use > self._high_water:
            self._high_water = self._in_use
        self._allocs += 1
        return block

    def _serve_waiters(self) -> None:
        q = self._waiters
        while q:
            w = q[0]
            if w.done:                      # abandoned (timed out / cancelled)
                q.popleft()
                continue
            block = self._take(w.order, w.length)
            if block is None:               # strict FIFO: head doesn't fit, stop
                return
            q.popleft()
            w.block = block
            w.done = True
            self._n_waiting -= 1
            w.event.set()

    def _abandon(self, w: _Waiter) -> None:
        """A waiter gives up (timeout / cancellation / error)."""
        if w.block is not None:
            # Handed a block after cancellation was already delivered:
            # give it back rather than leak it.
            block, w.block = w.block, None
            self.free(block)
        elif not w.done:
            w.done = True                   # lazily removed from the deque
            self._n_waiting -= 1
            if not self._closed:
                self._serve_waiters()       # it may have been blocking the head
        while self._waiters and self._waiters[0].done:
            self._waiters.popleft()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("memory pool is closed")

    # -- public API ----------------------------------------------------

    def try_alloc(self, length: int) -> Block | None:
        """Allocate without waiting; None if the pool can't satisfy it now.

        ``length`` 0 gets a ``min_block`` block; ``length > max_block``
        raises ValueError.  Returns None while other tasks are queued in
        ``alloc()`` (no queue jumping), even if memory is free.
        """
        order = self._order_for(length)
        self._check_open()
        if self._n_waiting:
            return None
        return self._take(order, length)

    async def alloc(self, length: int, timeout: float = 10.0) -> Block:
        """Allocate, waiting (FIFO) up to ``timeout`` seconds for memory.

        Raises PoolExhausted on timeout.  Cancellation while waiting neither
        leaks nor loses a block.  A cancellation point always, but a schedule
        point only when it has to wait: a block taken at once costs no task
        step (one per request on every node and client: 2 of a leader's 19
        steps per 1 MiB written and read back, dnctl bench --mode read).
        """
        order = self._order_for(length)
        length = operator.index(length)
        try:
            timeout = float(timeout)
        except (TypeError, ValueError):
            raise ValueError(f"timeout must be a number, got {timeout!r}") from None
        if math.isnan(timeout) or timeout < 0:
            raise ValueError(f"timeout must be >= 0, got {timeout!r}")
        self._check_open()

        await trio.lowlevel.checkpoint_if_cancelled()
        if not self._n_waiting:
            block = self._take(order, length)
            if block is not None:
                return block

        w = _Waiter(order, length)
        self._waiters.append(w)
        self._n_waiting += 1
        self._waits += 1
        try:
            with trio.move_on_after(timeout):
                await w.event.wait()
        except BaseException:
            self._cancellations += 1
            self._abandon(w)
            raise
        if w.block is not None:
            # Served -- possibly at the very moment the timeout fired; a
            # block we were handed is ours either way.
            return w.block
        self._abandon(w)
        if self._closed:
            raise RuntimeError("memory pool was closed while waiting")
        self._timeouts += 1
        raise PoolExhausted(length, self.min_block << order, timeout)

    def free(self, block: Block) -> None:
        """Return ``block`` to the pool, coalesce buddies, wake waiters.

        ValueError for a double free or a block from another pool.  After
        ``close()`` freeing a block of this pool is a no-op.
        """
        if not isinstance(block, Block):
            raise ValueError(f"not a Block: {block!r}")
        if block._pool is not self:
            raise ValueError(f"{block!r} does not belong to this pool")
        if self._closed:
            return
        if self._live.get(block.offset) is not block:
            raise ValueError(f"double free of {block!r}")
        del self._live[block.offset]
        block._live = False
        self._in_use -= block.size
        self._frees += 1

        offset = block.offset
        order = block._order
        size = block.size
        free = self._free
        top = self.max_order
        while order < top:
            fl = free[order]
            buddy = offset ^ size
            if buddy not in fl:
                break
            del fl[buddy]
            if not fl:
                self._mask &= ~(1 << order)
            offset &= ~size
            size <<= 1
            order += 1
        free[order][offset] = None
        self._mask |= 1 << order

        if self._n_waiting:
            self._serve_waiters()

    def stats(self) -> dict:
        """JSON-serialisable counters and free-list occupancy."""
        return {
            "arena_bytes": self.arena_bytes,
            "max_block": self.max_block,
            "min_block": self.min_block,
            "in_use_bytes": self._in_use,
            "high_water_bytes": self._high_water,
            "live_blocks": len(self._live),
            "free_blocks_per_order": {
                str(self.min_block << k): len(fl) for k, fl in enumerate(self._free)
            },
            "allocs": self._allocs,
            "frees": self._frees,
            "waits": self._waits,
            "timeouts": self._timeouts,
            # extras
            "waiting": self._n_waiting,
            "cancelled_waits": self._cancellations,
            "closed": self._closed,
            "huge_pages": self.huge_pages,
        }

    def close(self, force: bool = False) -> None:
        """Release the arena.

        Refuses (RuntimeError) while blocks are live unless ``force``; with
        ``force`` the live blocks are invalidated.  Tasks still waiting in
        ``alloc()`` get RuntimeError.  Idempotent.
        """
        if self._closed:
            return
        if self._live and not force:
            raise RuntimeError(
                f"cannot close memory pool: {len(self._live)} live blocks "
                f"({self._in_use} bytes); use close(force=True)")
        self._closed = True
        for block in self._live.values():
            block._live = False
        self._live.clear()
        self._in_use = 0
        for fl in self._free:
            fl.clear()
        self._mask = 0
        while self._waiters:
            w = self._waiters.popleft()
            if not w.done:
                w.done = True
                self._n_waiting -= 1
                w.event.set()
        for view in (self.arena, self._whole):
            try:
                view.release()
            except BufferError:
                pass                  # someone re-exported the arena view itself
        _ffi.release(self._cdata)
        try:
            self._mm.close()
        except BufferError:
            # Views handed out earlier still reference the mapping; it is
            # unmapped when the last of them is garbage collected.
            pass
        self._mm = None

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def in_use(self) -> int:
        """Bytes of the arena in live blocks."""
        return self._in_use

    def __enter__(self) -> BuddyPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"<BuddyPool arena={self.arena_bytes} max_block={self.max_block} "
                f"min_block={self.min_block} in_use={self._in_use} "
                f"live={len(self._live)} waiting={self._n_waiting}>")
