"""dnfs's write path: files' write-back buffers to the datanodes, and the slices they become to the metadata.

A ``write`` copies into the file's buffer (:mod:`client.fs.writeback`); a buffer that reaches ``chunk``
bytes is flushed in the background, one flush at a time per file: the writer fills the next chunk meanwhile
(the same background task writes it next) and waits, once that is full too, for the flush to end.  All
buffers together are held under ``budget`` bytes (the largest are flushed first).  A flush is one
``DataClient.write`` (pipelined appends, acknowledged by every replica) followed by one metadata commit of the
new slices (newer wins); ``durable`` (an fsync) also makes the metadata durable.  Flushes hold the
reclaimer's :class:`DataLock` shared, so no extent they write into is deleted under them.

Faults: a flush whose append fails (a replica died, a timeout, a stale epoch) writes the part not yet
acknowledged again from the buffer -- in a new extent, on another writable partition when there is one,
else once the map changed -- for ``write_retry_s`` before the file reports EIO (logged with the reason).
A full datanode disk is ENOSPC (also when a follower's full disk shows only as a replication failure: its
replicas are asked once every partition failed).

A flush that fails for good keeps what was stored: the bytes every replica acknowledged before the failure
are committed (a prefix of the flush), and the file lets go of every byte not stored -- the failed ones and
those buffered behind them -- so its size and contents are exactly what the cluster holds (``lost`` tells
the mount, whose kernel caches may still show them).  The error is reported once: by the write that
started that flush, else the file's next write, fsync or close.
"""
from __future__ import annotations

import errno
import logging
import os
import time
from typing import Callable

import trio

from client.fs.meta import Attr, Meta, MetaError, Slice
from client.fs.reclaim import DataLock
from client.fs.writeback import Budget, FileBuffer, Flush, Placement, acked_ranges, to_slices
from client.routing import AVOID_S
from client.sdk import ClientError, DataClient, Location
from wire.crc import crc32c
from wire.protocol import Op, Result

log = logging.getLogger(__name__)

RETRY_PAUSE = 1.0                  # a write that failed on every partition waits this long before the next try
BACKGROUND_FLUSHES = 16            # background flushes (a full chunk, a closed file's bytes) running at once
FULL_BELOW = 2 << 20               # a datanode with less free disk than this counts as full
DISK_ASK_S = 2.0                   # a datanode that does not report its disk within this is not counted as full
WRITABLE_STATES = ("writable", "degraded", "recovering")     # map states of a partition a flush may use


def data_errno(e: ClientError, what: str) -> int:
    """The errno a failed data request shows the application: ENOSPC for full datanodes, else EIO."""
    if e.result == Result.NO_SPACE:
        log.warning("%s: the datanodes are full: %s", what, e)
        return errno.ENOSPC
    log.error("%s: EIO: %s", what, e)
    return errno.EIO


class held:
    """``async with held(lock)``: a trio lock taken without a scheduler pass when it is free (trio's own
    ``acquire`` always makes one, and a flush per fsync takes its file's lock); waits for it only when held."""

    __slots__ = ("lock",)

    def __init__(self, lock: trio.Lock):
        self.lock = lock

    async def __aenter__(self) -> None:
        try:
            self.lock.acquire_nowait()
        except trio.WouldBlock:
            await self.lock.acquire()

    async def __aexit__(self, *exc) -> None:
        self.lock.release()


class FileWriter:
    """One file's write-back state: its size and mtime with the buffered bytes counted in, the buffer, the
    lock one flush at a time holds, and the error of a flush nobody waited for (reported once)."""

    def __init__(self, ino: int, size: int, budget: Budget):
        self.ino = ino
        self.opens = 0                    # handles open on it (a closed file's bytes are written behind it)
        self.size = size                  # including unflushed bytes
        self.mtime_ns = 0
        self.buf = FileBuffer(budget)
        self.flush_lock = trio.Lock()
        self.background = False           # a background flush of it is running or queued
        self.error: int | None = None     # errno of a failed background flush, reported once
        self._moved = trio.Event()        # set (and renewed) when a flush takes the buffer or ends

    def moved(self) -> None:
        """Wake the writers waiting for this file's flushes (:meth:`DataWriter.write`)."""
        self._moved.set()
        self._moved = trio.Event()

    async def until_moved(self) -> None:
        await self._moved.wait()

    @property
    def pending(self) -> bool:
        """Bytes written that are not yet in the metadata (buffered, or being flushed)."""
        return self.buf.pending

    def take_error(self) -> int | None:
        err, self.error = self.error, None
        return err

    def committed(self, attr: Attr, nslices: int) -> None:
        """A flush committed ``nslices`` new slices and the file's attributes are now ``attr`` (a hook: the
        mount's FileState drops what its reads cached)."""


class DataWriter:
    """The mount's write-back: the files it holds (open, or with bytes not yet written), their buffers under
    one budget, their flushes, and the retries of a failed write."""

    def __init__(self, meta: Meta, dc: DataClient, partitions: list[int], nursery: trio.Nursery, lock: DataLock, *,
                 budget: int, chunk: int, write_retry_s: float, forgotten: Callable[[FileWriter], None],
                 lost: Callable[[FileWriter], None] = lambda f: None):
        self.meta, self.dc, self.partitions, self.nursery, self.lock = meta, dc, partitions, nursery, lock
        self.budget = Budget(budget, chunk)
        self.write_retry_s = write_retry_s
        self.files: dict[int, FileWriter] = {}
        self._forgotten = forgotten            # called with a file ``settle`` let go of
        self._lost = lost                      # called with a file that let go of bytes not stored (``_failed``)
        self._background = trio.Semaphore(BACKGROUND_FLUSHES)
        self._avoid: dict[int, float] = {}     # partition -> until when writes prefer the others (a failure)

    @property
    def background_flushes(self) -> int:
        """Background flushes running now."""
        return BACKGROUND_FLUSHES - self._background.value

    def unwritten(self) -> tuple[int, int] | None:
        """(bytes, files) buffered and not yet written, if any."""
        held = [f for f in self.files.values() if f.pending]
        if not held:
            return None
        return sum(f.buf.nbytes for f in held), len(held)

    async def write(self, f: FileWriter, off: int, data) -> None:
        """Buffer ``data`` at ``off``; flushes what the budget says (:meth:`Budget.after_write`, and the
        largest buffers when all of them hold too much)."""
        if not self.write_now(f, off, data):
            await self.write_rest(f)

    def write_now(self, f: FileWriter, off: int, data) -> bool:
        """The part of :meth:`write` that never waits: buffer ``data`` (starting a full chunk's background
        flush).  False if the write must still wait (backpressure, the budget): then :meth:`write_rest`."""
        f.buf.write(off, data)
        end = off + len(data)
        if end > f.size:
            f.size = end
        f.mtime_ns = time.time_ns()
        then = self.budget.after_write(f.buf.dirty.nbytes, f.background or f.flush_lock.locked())
        if then is Flush.WAIT or self.budget.over():
            return False
        if then is Flush.BACKGROUND:
            f.background = True
            self.nursery.start_soon(self._background_flush, f)
        return True

    async def write_rest(self, f: FileWriter) -> None:
        """What a buffered write waits for: its file's flush under way (one chunk written, one filled), and
        the largest buffers written when all of them hold more than the budget."""
        while (then := self.budget.after_write(f.buf.dirty.nbytes, f.background or f.flush_lock.locked())) \
                is Flush.WAIT:
            if f.background:
                await f.until_moved()               # backpressure: one chunk written, one filled, per file
            else:
                async with f.flush_lock:            # held by a flush, a truncate, a removal: it ends first
                    pass
            err = f.take_error()
            if err is not None:                     # this write's bytes were let go behind the failed flush
                raise OSError(err, os.strerror(err))
        if then is Flush.BACKGROUND:
            f.background = True
            self.nursery.start_soon(self._background_flush, f)
        if self.budget.over():
            for other in sorted(self.files.values(), key=lambda s: -s.buf.dirty.nbytes):
                if self.budget.relieved():
                    break
                await self.flush(other)

    async def flush(self, f: FileWriter, *, durable: bool = False) -> bool:
        """Write the file's buffered bytes and commit their slices; ``durable`` (an fsync): the commit, and every
        one before it, durable on return.  Returns whether it committed (errors: ``f.error``)."""
        async with held(f.flush_lock):
            if not f.buf.dirty or f.error is not None:     # (after a failure: nothing until it is reported)
                return False
            m = f.buf.take()
            f.moved()
            try:
                ranges = m.ranges()
                payload = ranges[0][1] if len(ranges) == 1 else b"".join(b for _, b in ranges)
                a, n = await self.store(f.ino, [(off, len(b)) for off, b in ranges], payload, m.end,
                                        f.mtime_ns or None, durable=durable, whole=f.size)
                f.committed(a, n)
                return True
            except (ClientError, MetaError) as e:
                f.error = e.errno if isinstance(e, MetaError) else data_errno(e, "flush")
                log.error("flush of inode %d (%d bytes) failed: %s", f.ino, m.nbytes, e)
                await self._failed(f, getattr(e, "stored", None))
                return False
            finally:
                f.buf.written()
                f.moved()

    async def _failed(self, f: FileWriter, stored: Attr | None) -> None:
        """A flush of ``f`` failed for good (``f.error`` set): it lets go of every byte the cluster does not
        hold, and its size is the stored one (``stored``: the attributes after committing the acknowledged
        part, if any)."""
        if stored is None:
            try:
                stored = await self.meta.getattr(f.ino)
            except MetaError as e:
                log.warning("inode %d: its stored size is unknown after a failed flush: %s", f.ino, e)
        lost = f.buf.dirty.nbytes
        f.buf.drop()
        if stored is not None:
            f.size = stored.size
        log.warning("inode %d: %d buffered byte(s) behind the failed flush let go; its size is %d, as stored",
                    f.ino, lost, f.size)
        self._lost(f)

    async def store(self, ino: int, ranges: list[tuple[int, int]], payload, size: int, mtime_ns: int | None, *,
                    durable: bool = False, whole: int | None = None) -> tuple[Attr, int]:
        """Write ``payload`` (the bytes of file ranges ``[(offset, length)]``, back to back) to the cluster and
        commit them as slices of inode ``ino`` (size ``size``, mtime ``mtime_ns`` or now); returns the new
        attributes and the number of slices.  Holds the data lock shared: no extent is reclaimed under it.
        A file of ``whole`` bytes at most the engine's ``inline_max`` keeps them in its slices instead (the
        commit is all there is to it)."""
        if self.meta.inline_max and whole is not None and max(whole, size) <= self.meta.inline_max:
            mv = memoryview(payload).cast("B")
            slices, pos = [], 0
            for off, n in ranges:
                data = bytes(mv[pos:pos + n])
                slices.append(Slice(off, n, 0, 0, 0, 0, n, crc32c(data), data))
                pos += n
            a = await self.meta.commit(ino, slices, size, time.time_ns() if mtime_ns is None else mtime_ns,
                                       durable=durable)
            return a, len(slices)
        await self.lock.acquire_shared()
        try:
            try:
                locs = await self.write_data(ino, payload)
            except ClientError as e:
                done = getattr(e, "done", None)
                if done:                   # every replica holds these: they are the file's, the rest is not
                    part = acked_ranges(ranges, sum(loc.length for loc in done))
                    e.stored = await self.meta.commit(ino, to_slices(part, done), part[-1][0] + part[-1][1],
                                                      time.time_ns() if mtime_ns is None else mtime_ns,
                                                      durable=durable)
                raise
            slices = to_slices(ranges, locs)
            a = await self.meta.commit(ino, slices, size, time.time_ns() if mtime_ns is None else mtime_ns,
                                       durable=durable)
        finally:
            await self.lock.release_shared()
        return a, len(slices)

    def flush_soon(self, f: FileWriter) -> None:
        """Start a background flush of the file's buffered bytes (unless one is running)."""
        if f.buf.dirty and not f.background:
            f.background = True
            self.nursery.start_soon(self._background_flush, f)

    async def _background_flush(self, f: FileWriter) -> None:
        try:
            async with self._background:
                await self.flush(f)
                while f.opens and f.error is None and f.buf.dirty.nbytes >= self.budget.chunk:
                    await self.flush(f)             # the writer filled the next chunk meanwhile
        except Exception:        # noqa: BLE001 - a task must not take the mount down; the file reports EIO
            log.exception("background flush of inode %d", f.ino)
            f.error = errno.EIO
            await self._failed(f, None)
        finally:
            f.background = False
            f.moved()
        if f.opens == 0:        # closed meanwhile (write-back): more to write, or nothing left to keep
            if f.buf.dirty and f.error is None:
                self.flush_soon(f)
            else:
                self.settle(f)

    def settle(self, f: FileWriter) -> None:
        """Forget a closed file whose bytes are all written (its last failure, if any, is kept for the next
        open to report)."""
        if (f.opens == 0 and not f.pending and not f.background and f.error is None
                and self.files.get(f.ino) is f):
            self.files.pop(f.ino)
            self._forgotten(f)

    async def flush_all(self) -> list[int]:
        """Write every file's buffered bytes; returns the inodes whose bytes could not be (EIO at their next
        close or fsync here)."""
        failed = []
        for f in list(self.files.values()):
            await self.flush(f)
            if f.error is not None:
                failed.append(f.ino)
            self.settle(f)
        return failed

    # -- the cluster
    def _writable(self, pid: int) -> bool:
        """Can partition ``pid`` take writes, as far as the map says (without an etcd map: assume so): its
        view is installed on its replicas, and each of them acknowledges writes (fewer than it wants, after a
        failover, is fine: every byte is still on every replica it has)."""
        v = self.dc.views.get(pid)
        return v is None or (v.installed and v.state in WRITABLE_STATES)

    def _whole(self, pid: int) -> bool:
        v = self.dc.views.get(pid)
        return v is None or v.state == "writable"

    def _elsewhere(self, pid: int) -> Callable[[str], bool]:
        """For ``DataClient.write``: does another partition take writes now without ``node`` (which failed a
        write to ``pid``)?  Then the rest goes there instead of waiting for ``pid``'s new view."""
        def other(node: str) -> bool:
            return any(q != pid and self._writable(q) and q in self.dc.views
                       and node not in self.dc.partitions[q].replicas for q in self.partitions)
        return other

    async def write_data(self, ino: int, payload) -> list[Location]:
        """Write ``payload`` into extents, acknowledged by every replica; returns its locations in order.

        A failed append (a replica died, a timeout, a lost connection, a stale epoch) is not the
        application's problem while the write-back buffer still holds the bytes: the part not yet
        acknowledged is written again, in a new extent, on another writable partition when there is one,
        else on the same one once the map has had time to change (the cluster manager shrinks a replica set
        within seconds; the SDK follows etcd).  Only after ``write_retry_s`` does the error reach the caller
        (EIO, logged with the reason).  A full disk (NO_SPACE) is reported at once (ENOSPC)."""
        mv = memoryview(payload).cast("B")
        out: list[Location] = []
        pos = 0
        where = Placement(self.partitions, self.partitions[ino % len(self.partitions)], self._avoid, AVOID_S)
        deadline = trio.current_time() + self.write_retry_s
        tried: list[int] = []               # partitions that failed this round, not known to be full
        while True:
            pid = where.next(trio.current_time(), self._writable, self._whole)
            try:
                out += await self.dc.write(pid, mv[pos:], elsewhere=self._elsewhere(pid))
                if where.failed:
                    log.info("inode %d: write went through on partition %d after retrying", ino, pid)
                return out
            except ClientError as e:
                done = getattr(e, "done", [])
                out += done
                pos += sum(loc.length for loc in done)
                e.done = out                         # what is stored of the payload, if this is the end
                if e.result == Result.FORBIDDEN:
                    raise
                if e.result == Result.NO_SPACE:      # another partition may have room; else ENOSPC at once
                    if where.filled(pid):
                        raise e
                    log.warning("inode %d: partition %d is full; writing to another one", ino, pid)
                    continue
                tried.append(pid)
                every = where.failed_on(pid, trio.current_time(), self._writable)
                left = deadline - trio.current_time()
                if every or left <= 0:
                    # a follower's full disk shows only as a replication failure: asked once every partition
                    # failed, not after each failure (a hung replica, which answers nothing, must not hold up
                    # the next try)
                    for p in await self._full(tried):
                        full = ClientError(f"partition {p}: a replica's disk is full ({e})", Result.NO_SPACE, e.node)
                        full.done = out
                        if where.filled(p):
                            raise full
                    tried.clear()
                if left <= 0:
                    log.error("inode %d: giving up on a write of %d bytes after %.0fs of retries: %s", ino,
                              len(mv) - pos, self.write_retry_s, e)
                    raise
                log.warning("inode %d: write to partition %d failed (%s); %d bytes unacknowledged, retrying "
                            "for %.0fs more", ino, pid, e, len(mv) - pos, left)
                if every:
                    await trio.sleep(min(RETRY_PAUSE, left))     # every partition failed: wait for the map

    async def _full(self, pids: list[int]) -> list[int]:
        """Those of partitions ``pids`` one of whose replicas reports a full disk (a follower's NO_SPACE
        reaches us only as a replication failure); every replica is asked at once, for ``DISK_ASK_S``."""
        full: set[int] = set()

        async def ask(addr: str, of: list[int]) -> None:
            with trio.move_on_after(DISK_ASK_S):
                try:
                    d = (await self.dc.admin(addr, Op.NODE_STATUS)).get("disk") or {}
                except ClientError:
                    return
                if "free" in d and d["free"] < FULL_BELOW:
                    log.warning("partitions %s: %s reports a full disk (%d bytes free)", of, addr, d["free"])
                    full.update(of)

        holders: dict[str, list[int]] = {}
        for pid in dict.fromkeys(pids):
            part = self.dc.partitions.get(pid)
            for addr in part.replicas if part is not None else ():
                holders.setdefault(addr, []).append(pid)
        async with trio.open_nursery() as n:
            for addr, of in holders.items():
                n.start_soon(ask, addr, of)
        return [p for p in dict.fromkeys(pids) if p in full]
