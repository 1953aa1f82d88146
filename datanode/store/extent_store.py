"""``ExtentStore``: the extents of one data partition, and every operation on them (blocking code; the async
server calls it in worker threads, ``aio.Workers``).  What the files hold is crcfile.py's; how a write
becomes durable, flush.py's; what an open keeps, recovery.py's; how the bytes move, direct.py's."""
from __future__ import annotations

import logging
import os
import pathlib
import secrets
import threading
from typing import Callable

from wire.crc import crc32c
from wire.protocol import MAX_EXTENT

from ..config import SyncMode
from .crcfile import (BLOCK, ENTRIES_END, ENTRY, ENTRY_SIZE, SLOT_SIZE, BlockMismatch, append_entries, byte_view,
                      entries_digest, pack_entries, read_crc)
from .direct import read_range, scratch_bufs, write_direct
from .errors import StoreError, WouldBlock, io_error
from .extent import Extent, extent_paths
from .files import (O_CLOEXEC, O_DIRECT, fdatasync, free_in_steps, fsync_dir, preadv_all, pwrite_ahead, pwrite_all,
                    shrink_in_steps)
from .flush import Flusher
from .options import StoreOptions
from .recovery import open_extents

log = logging.getLogger(__package__)

_SYNC_MODES = tuple(SyncMode)
_VERIFY_MODES = ("full", "tail")
_NEXT_ID = "next_extent_id"
MAX_EXTENT_ID = (1 << 48) - 1     # ids stay far from the 64-bit wire field's end


class ExtentStore:
    """``verify`` is how extents are checked at open ("full" or "tail": recovery.py); ``on_extent(size)``, if
    given, is called after each extent is opened (progress for a node that is starting) and may raise to stop
    opening: the extents opened so far are closed again and the exception propagates."""

    def __init__(self, root: pathlib.Path, sync: str = SyncMode.ALWAYS, *, verify: str = "full",
                 on_extent: Callable[[int], None] | None = None, options: StoreOptions | None = None):
        if sync not in _SYNC_MODES:
            raise ValueError(f"sync must be one of {_SYNC_MODES}, not {sync!r}")
        if verify not in _VERIFY_MODES:
            raise ValueError(f"verify must be one of {_VERIFY_MODES}, not {verify!r}")
        self.root = pathlib.Path(root)
        self.sync = sync
        self.verify = verify
        self.options = options = options or StoreOptions()
        self._dir = self.root / "extents"
        self._lock = threading.Lock()       # guards _extents, _tombstones, _next_id, _closed (short holds)
        self._create_lock = threading.Lock()  # serialises create_extent (held across its fsyncs)
        self._digests: dict[int, tuple] = {}   # extent id -> (its Extent, gen, digest): see digests()
        self._extents: dict[int, Extent] = {}
        self._tombstones: set[int] = set()
        self._closed = False
        self._flusher = Flusher(self.root, options.one_flush)
        self._direct_reads = options.direct_reads and bool(O_DIRECT)
        self._direct_writes = options.direct_writes and bool(O_DIRECT)
        self.direct_writes = 0              # appends written with O_DIRECT (approximate: not locked)
        # Bumped by every change of an extent's bytes or of the set of extents (append, truncate, create,
        # delete): a leader's health probe skips comparing a partition whose counters did not move since its
        # copies last matched (datanode/health.py).  It starts at a random value, so a reopened store never
        # repeats an earlier one.  Bumped from several threads without a lock: a lost increment still moves it.
        self.changes = secrets.randbelow(1 << 48)
        created = not self._dir.exists()
        self._dir.mkdir(parents=True, exist_ok=True)
        if created and self._durable:
            fsync_dir(self._dir)
            fsync_dir(self.root)
            if self.root.parent != self.root:
                fsync_dir(self.root.parent)
        next_id = 1
        try:
            next_id = max(1, int((self.root / _NEXT_ID).read_text().strip() or 1))
        except FileNotFoundError:
            pass
        except ValueError:
            log.warning("%s: unreadable %s, recomputing from the extents present", self.root, _NEXT_ID)
        try:
            self._next_id = open_extents(self.root, self._extents, self._tombstones, next_id, verify, options,
                                         on_extent)
        except BaseException:
            self.close()
            raise

    @property
    def _durable(self) -> bool:
        return self.sync == SyncMode.ALWAYS

    @property
    def one_flushes(self) -> int:
        """Flushes that took one fdatasync (flush.py, "One flush"; approximate)."""
        return self._flusher.one_flushes

    def _get(self, extent_id: int) -> Extent:
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
                dat_p, crc_p, _ = extent_paths(self._dir, eid)
                crcfd = os.open(crc_p, os.O_RDWR | os.O_CREAT | os.O_EXCL | O_CLOEXEC, 0o644)
                try:
                    dat = os.open(dat_p, os.O_RDWR | os.O_CREAT | os.O_EXCL | O_CLOEXEC, 0o644)
                except BaseException:
                    os.close(crcfd)
                    crc_p.unlink(missing_ok=True)
                    raise
                if self._durable:
                    fsync_dir(self._dir)
            except FileExistsError as e:
                raise StoreError("exists", f"extent {eid}: {e}", eid) from None
            except OSError as e:
                raise io_error(f"create extent {eid}", e) from e
            with self._lock:
                if self._closed:
                    os.close(dat)
                    os.close(crcfd)
                    raise StoreError("disk", f"store {self.root} is closed")
                self._extents[eid] = Extent(eid, dat, crcfd, 0, [], set())
                self.changes += 1
            return eid

    def _persist_next_id(self, value: int) -> None:
        tmp = self.root / (_NEXT_ID + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | O_CLOEXEC, 0o644)
        try:
            pwrite_all(fd, f"{value}\n".encode(), 0)
            if self._durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.root / _NEXT_ID)
        if self._durable:
            fsync_dir(self.root)

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
        mv = byte_view(data)
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
            new, whole = append_entries(entries, size, mv, pieces, crc is not None)
            if crc is not None and whole != (crc & 0xFFFFFFFF):
                raise StoreError("crc", f"extent {extent_id}: payload CRC {whole:#010x} != {crc & 0xFFFFFFFF:#010x}")
            if not n:
                return size
            stage = "pwrite data"
            try:
                prefill = self.options.prefill_bytes
                if self._direct_writes and write_direct(ext, mv, offset):
                    self.direct_writes += 1
                    ext.filled = max(ext.filled, offset + n)
                elif self._durable and n <= prefill:
                    ext.filled = pwrite_ahead(ext.dat, mv, offset, ext.filled, prefill, MAX_EXTENT)
                else:
                    pwrite_all(ext.dat, mv, offset)
                    ext.filled = max(ext.filled, offset + n)
                if not self._durable:
                    stage = "pwrite crc"
                    if ext.slot_seq is not None:     # slots of a sync=always past would outvote these entries
                        pwrite_all(ext.crc, bytes(2 * SLOT_SIZE), ENTRIES_END)
                        ext.slot_seq = ext.crc_synced = None
                    pwrite_all(ext.crc, pack_entries(new), first * ENTRY_SIZE)
            except OSError as e:
                self._rollback(ext, size, first, stage, e)
                raise io_error(f"extent {extent_id}: {stage}", e) from e
            with ext.mu:
                entries[first:] = new       # readers copy slices under mu, so in place is fine
                ext.size = size + n
                ext.gen += 1
                self.changes += 1
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
        """Make every append to these extents that returned before this call durable (flush.py: the write
        order, once for any number of appends).  Returns the extents that failed, with their error (the
        extent is then broken: its waiters must fail, and it refuses writes until reopened)."""
        failed: dict[int, StoreError] = {}
        for eid in extent_ids:
            try:
                ext = self._get(eid)
            except StoreError as e:
                failed[eid] = e
                continue
            with ext.flock:
                err = self._flusher.flush(ext)
            if err is not None:
                failed[eid] = err
        return failed

    def _rollback(self, ext: Extent, size: int, first: int, stage: str, err: OSError) -> None:
        """Put the files back to ``size`` after a failed append (best effort)."""
        try:
            os.ftruncate(ext.dat, size)
            ext.filled = size
            ext.synced = min(ext.synced, size)      # a shorter length, not yet durable
            if not self._durable and first < len(ext.entries):
                pwrite_all(ext.crc, ENTRY.pack(*ext.entries[first]), first * ENTRY_SIZE)
            if not self._durable:
                os.ftruncate(ext.crc, len(ext.entries) * ENTRY_SIZE)
                ext.crc_filled = len(ext.entries) * ENTRY_SIZE
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
        out = byte_view(out)
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
            head_buf, tail_buf = scratch_bufs()
            bstart = b0 * BLOCK
            head = head_buf[:offset - bstart]
            tail = tail_buf[:b1 * BLOCK + ents[-1][1] - end]
            dst = out[:length]
            want = len(head) + length + len(tail)
            try:
                got = read_range(ext, [head, dst, tail], bstart, want, nowait, self._direct_reads)
            except OSError as e:
                raise StoreError("disk", f"extent {extent_id}: read: {e}") from e
            if got != want:
                self._fail_read(ext, dst, b0, f"data file is short ({got} of {want} bytes at {bstart})")
            try:
                return read_crc(ents, head, dst, tail)
            except BlockMismatch as e:
                i = b0 + e.index
                ecrc, cov = ents[e.index]
                with ext.mu:
                    ext.bad.add(i)
                self._fail_read(ext, dst, i, f"stored {ecrc:#010x}, computed {e.computed:#010x} over {cov} bytes")
        finally:
            ext.end_read()

    def _fail_read(self, ext: Extent, dst: memoryview, block: int, why: str):
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
            digest = entries_digest(entries)
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
            self.changes += 1
        dat_p, crc_p, tomb_p = extent_paths(self._dir, extent_id)
        with ext.wlock, ext.flock:
            ext.begin_exclusive()
            try:
                with ext.mu:
                    ext.dead = True
                ext.close_fds()
                try:
                    os.replace(dat_p, tomb_p)    # atomic: from here on the extent is gone after a crash
                    free_in_steps(tomb_p, self.options.free_step_bytes)   # keep the name as the tombstone
                    crc_p.unlink(missing_ok=True)
                    if self._durable:
                        fsync_dir(self._dir)
                except OSError as e:
                    raise io_error(f"delete extent {extent_id}", e) from e
            finally:
                ext.end_exclusive()
        log.info("extent %d (%s): deleted", extent_id, self.root)

    def truncate(self, extent_id: int, size: int) -> None:
        ext = self._get(extent_id)
        with ext.wlock, ext.flock:
            err = self._flusher.flush(ext)   # no appended entry may land after the truncate
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
                        got = preadv_all(ext.dat, [buf], i * BLOCK)
                        if got != old_cov or crc32c(buf) != old_c:
                            raise StoreError("crc", f"extent {extent_id}: block {i} fails its CRC; truncate to "
                                                    f"{i * BLOCK} (the block boundary) instead")
                        entries[i] = (crc32c(buf[:within]), within)
                        pwrite_all(ext.crc, ENTRY.pack(*entries[i]), i * ENTRY_SIZE)
                    # entries first (crash here: recovery stops at the rewritten entry and cuts the data)
                    os.ftruncate(ext.crc, keep * ENTRY_SIZE)      # (the slots go too: the next flush writes one)
                    ext.crc_filled = keep * ENTRY_SIZE
                    ext.slot_seq = ext.crc_synced = None
                    if self._durable:
                        fdatasync(ext.crc)
                    shrink_in_steps(ext.dat, size, self.options.free_step_bytes)   # (a repair may cut much)
                    ext.filled = size
                    if self._durable:
                        fdatasync(ext.dat)
                        ext.synced = size
                except OSError as e:
                    ext.broken = f"truncate: {e}"
                    raise io_error(f"extent {extent_id}: truncate", e) from e
                with ext.mu:
                    ext.entries = entries
                    ext.size = size
                    ext.gen += 1
                    self.changes += 1
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
                    self._flusher.flush(ext)      # appends not yet acknowledged: keep them if we can
                ext.begin_exclusive()
                try:
                    with ext.mu:
                        ext.dead = True
                    self._trim(ext)
                    ext.close_fds()
                finally:
                    ext.end_exclusive()

    def _trim(self, ext: Extent) -> None:
        """On a clean close, give back what zero-fill ahead wrote past the end (best effort, no fsync: if
        it is lost, recovery cuts the same bytes)."""
        if ext.broken:
            return
        try:
            if ext.filled > ext.size:
                os.ftruncate(ext.dat, ext.size)
            if (ext.crc_filled > len(ext.entries) * ENTRY_SIZE or ext.slot_seq is not None) and ext.dirty_from is None:
                os.ftruncate(ext.crc, len(ext.entries) * ENTRY_SIZE)     # the slots too: the entries say it all
        except OSError as e:
            log.info("extent %d (%s): zero-filled tail kept (%s): the next open cuts it", ext.id, self.root, e)

    def __enter__(self) -> "ExtentStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
