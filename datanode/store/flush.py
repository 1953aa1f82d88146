"""The durable half of a write (sync=always): ``flush`` makes every append made before it durable.

Write order::

    pwrite(data)  ->  [sync=always: fdatasync(data)]  ->  pwrite(crc entries)  ->  [sync=always: fdatasync(crc)]

i.e. the data is made durable *before* the CRC entries that describe it are even written.  Under sync=always
a write is two halves (group commit): ``append`` pwrites the data and keeps the new entries in memory (the
extent's size moves, the next append may follow at once); a flush then does the fdatasync(data) ->
pwrite(crc entries) -> fdatasync(crc) above once for every append made before it, however many, and moves
the extent's ``durable``; a write is acknowledged only once its end is durable.  (Writing the CRC entries
before syncing the data would let the kernel write the new CRC page back before the data: a power cut could
then leave a durable entry for bytes that never reached the disk, and recovery would have to throw away the
acknowledged bytes of that block too.  Same number of fdatasyncs either way.)  Consequences:

* every durable entry describes durable bytes;
* an 8-byte entry rewrite is atomic (8-byte aligned, never straddles a sector), so after a crash each entry
  is either its old value (which still verifies: the bytes it covers were not touched) or its new value
  (which verifies: its bytes were synced first);
* an acknowledged write has its entries synced, so it survives.

With kill -9 (no power loss) the page cache survives, so the same holds for sync=none; after a power cut
sync=none promises nothing beyond "what is recovered is verified".

One flush
---------
Two fdatasyncs are two cache flushes of the device per flush, on every replica.  Where it is safe, a flush
takes one: ``sync_file_range`` sends the data pages to the device (no metadata, no cache flush), the entries
and the slot are written and sent after them while they are on their way, and once the data has landed one
``fdatasync`` of the CRC file flushes the device's cache for both files.  Until that cache flush, a power
cut may keep any of the flush's writes and lose any other -- a rewritten entry of the last partial block
without its bytes would make that block's *acknowledged* start unreadable.  So each flush writes a tail slot
(crcfile.py) into the slot that is *not* the newest: the state before the flush stays on disk, described,
until the flush is complete.

A flush takes one fdatasync only when a durable slot describes the state before it and its bytes overwrite
zeros already durable in the data file (zero-fill ahead, below: the file's length is not changing);
otherwise data first, as above (the first flush after open, create or truncate).  A flush whose appends grew
the data file (past the zeros written ahead: a big direct append always does) takes one fdatasync too, the
data file's, last: the entries and the slot are written and waited for first -- they overwrite blocks of the
CRC file this process made durable, so it has no metadata to commit -- and the data file's fdatasync then
writes what is left of the data, commits its new length (ext4, XFS: only once the bytes under it are
written) and flushes the device's cache, for both files.  A power cut before it ends leaves the old length
(the new slot does not fit the files: the one before it gives the size) or the new one with its bytes; the
first flush after open keeps to the order above.  Recovery by the slots: recovery.py.  The ``one_flush``
option turns the one-flush path off (slots are still written); a file system that refuses
``sync_file_range`` gets the two-fdatasync order (logged once).

Zero-fill ahead
---------------
fdatasync after an append that grows the file must commit the file system's journal (the new size, the new
blocks) besides writing the data, and the replicas' journal commits on one disk queue behind each other.  So
under sync=always a small append also writes zeros up to the next ``prefill_bytes`` boundary of the data file
(and a flush writes zero entries up to the next page of the CRC file): the following appends overwrite those
zeros and their flush is data only.  Zeros are never an extent's bytes -- size and entries say where it ends,
and recovery cuts everything past the last verified entry.  Not under sync=none: no fdatasync to save, and
after a power cut zeros would turn a short (cut) tail into a "present" block.
"""
from __future__ import annotations

import errno
import logging

from .crcfile import BLOCK, ENTRIES_END, ENTRY_SIZE, SLOT_ONE_FLUSH, pack_entries, pack_slot, slot_pos
from .errors import StoreError, io_error
from .extent import Extent
from .files import SFR_START, SFR_WAIT, fdatasync, has_sync_file_range, pwrite_all, pwrite_ahead, sync_range

log = logging.getLogger(__package__)

CRC_PREFILL = 4096              # the CRC file's entries are written a page ahead


class Flusher:
    """Flushes the extents of one store; knows whether this store may take the one-flush path."""

    def __init__(self, root, one_flush: bool):
        self.root = root                     # (for the log)
        self.one_flush = one_flush and has_sync_file_range()
        self.one_flushes = 0                 # flushes that took one fdatasync (approximate: not locked)

    def flush(self, ext: Extent) -> StoreError | None:
        """Make every append to ``ext`` before this call durable; the caller holds ``ext.flock``.  A failure
        is returned, and leaves the extent broken (its waiters must fail; it refuses writes until reopened)."""
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
        # entries and slot overwrite CRC-file blocks this process made durable: it ends with the data file's
        # fdatasync.  Else the data is synced first, as always.
        one = self.one_flush and ext.slot_seq is not None and size <= ext.synced
        grow = (not one and self.one_flush and ext.crc_synced is not None
                and (first + len(ents)) * ENTRY_SIZE <= ext.crc_synced)
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
                fdatasync(ext.dat)         # every byte pwritten before the snapshot above, durable
            slot = pack_slot(seq, size, ents[-1][0] if size % BLOCK else 0,
                             SLOT_ONE_FLUSH if one or grow else 0)
            stage = "pwrite crc"
            if ents:
                ext.crc_filled = pwrite_ahead(ext.crc, memoryview(pack_entries(ents)), first * ENTRY_SIZE,
                                              ext.crc_filled, CRC_PREFILL, ENTRIES_END)
            pwrite_all(ext.crc, slot, slot_pos(seq))
            if grow:
                # the entries and the slot land first (they overwrite blocks the CRC file durably has: no
                # metadata of its own); then the data file's fdatasync writes what is left of the data,
                # commits its new length, and flushes the device's cache -- for the CRC pages too
                stage = "sync_file_range crc"
                sync_range(ext.crc, 0, 0, SFR_START | SFR_WAIT)
                stage = "fdatasync data"
                fdatasync(ext.dat)
            else:
                if one:
                    # the entries and the slot go to the device while the data is still on its way (both
                    # writes in flight together); the cache flush below must come after the data has landed
                    stage = "sync_file_range crc"
                    sync_range(ext.crc, 0, 0, SFR_START)
                    stage = "sync_file_range data (wait)"
                    sync_range(ext.dat, pos, n, SFR_WAIT)
                stage = "fdatasync crc"
                fdatasync(ext.crc)         # (one flush: its cache flush makes the data durable too)
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

    def _write_out(self, ext: Extent, pos: int, n: int) -> bool:
        """The one-flush path's first step (the data on its way to the device); False where the file system
        refuses sync_file_range (the caller then syncs the data first, and so does every later flush of this
        store)."""
        try:
            sync_range(ext.dat, pos, n, SFR_START)
            return True
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ESPIPE):
                raise
            if self.one_flush:
                self.one_flush = False
                log.warning("%s: sync_file_range refused (%s): every flush syncs the data first instead", self.root, e)
            return False
