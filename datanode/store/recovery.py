"""Opening a store: every extent's files checked and cut back to the end of its last completed append.

The decisions (``plan``) are pure: they see the CRC file's entries and slots, the data file's length, and ask
a ``Blocks`` reader whether a block's bytes match a CRC; ``recover`` reads the files and carries a plan out.

Recovery by the tail slots (see flush.py, "One flush"): the newest slot whose blocks (those its flush wrote,
and the partial last one by the slot's CRC) verify gives the size; a one-flush slot that does not verify,
with a sector of its range still reading as the zeros it overwrote, was cut short by a power cut (never
acknowledged) and the slot before it gives the size; a slot whose bytes are all there yet fail is a damaged
medium -- those blocks are kept and reported, as by rule 3 below.  Anything else (no slot, or none that
fits) falls back to the entry rules.  Slots are dropped by truncate and a clean close (the entries then say
it all); sync=none appends remove them (their entries would be outvoted by an old slot).

Entry rules.  Classify each complete 8-byte entry ``i`` (a trailing partial entry is ignored) as

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

``verify="full"`` CRC-checks every block at open so mid-extent damage is logged then; ``verify="tail"``
checks only what the rules need (partial entries, and backwards from the end to the last good block) -- the
same recovered sizes, about one block read per extent instead of every byte; damage is then found on read,
or by the scrub (the datanode opens with ``open_verify = tail`` by default and has its leader scrub soon
after start: datanode/repair.py).
"""
from __future__ import annotations

import logging
import os
import pathlib
import stat
from typing import Callable, NamedTuple, Protocol

from wire.crc import crc32c
from wire.protocol import MAX_EXTENT

from .crcfile import (BLOCK, ENTRIES_END, ENTRY, ENTRY_SIZE, SLOT_ONE_FLUSH, SLOT_SIZE, Entry, Slot, slot_pos,
                      unpack_entries, unpack_slots)
from .extent import Extent, extent_paths
from .files import O_CLOEXEC, ahead, free_in_steps, fsync_dir, preadv_all, pwrite_all
from .options import StoreOptions

log = logging.getLogger(__package__)


class Blocks(Protocol):
    """What recovery asks of an extent's data file."""
    data_len: int

    def crc_ok(self, i: int, covered: int, crc: int) -> bool:
        """Block ``i``'s first ``covered`` bytes are all there and their CRC32C is ``crc``."""

    def zero_sector(self, start: int, end: int) -> bool:
        """Some 512-byte sector's part in ``[start, end)`` reads as zeros (or lies past the end)."""


class Plan(NamedTuple):
    entries: list[Entry]         # the entries kept (each is a block of the recovered extent)
    bad: set[int]                # blocks kept although they fail their CRC
    fixed: list[int]             # entries whose covered length was set to a full block (the entry rules)
    slot: Slot | None            # the tail slot that gave the size (None: the entry rules did)
    unfinished: Slot | None      # a newer slot, of a flush a power cut interrupted: to be cleared

    @property
    def size(self) -> int:
        return 0 if not self.entries else (len(self.entries) - 1) * BLOCK + self.entries[-1][1]


def plan(entries: list[Entry], slots: list[Slot], blocks: Blocks, full: bool) -> Plan:
    """What to keep of one extent, by its newest usable slot, else by the entry rules (module docstring).
    ``full``: check every kept block (verify="full"), not only those the rules need."""
    by_slot = plan_by_slot(entries, slots, blocks, full) if slots else None
    return by_slot if by_slot is not None else plan_by_entries(entries, blocks, full)


def plan_by_slot(entries: list[Entry], slots: list[Slot], blocks: Blocks, full: bool) -> Plan | None:
    """The extent as the newest slot that verifies describes it (a torn flush after it cut); None when no
    slot fits the files and the entry rules must decide."""
    data_len = blocks.data_len

    def older(k: int) -> Slot | None:
        return slots[k + 1] if k + 1 < len(slots) and slots[k + 1].seq == slots[k].seq - 1 else None

    def failing(k: int) -> list[int] | None:
        """The blocks slot k's flush wrote that fail their CRC; None: the slot cannot describe the files."""
        nb, part = divmod(slots[k].size, BLOCK)
        if data_len < slots[k].size or len(entries) < nb or any(entries[i][1] != BLOCK for i in range(nb)):
            return None
        prev = older(k)
        lo = min(prev.size // BLOCK, nb) if prev else max(nb - 1, 0)      # what this slot's flush wrote
        bad = [i for i in range(lo, nb) if not blocks.crc_ok(i, BLOCK, entries[i][0])]
        if part and not blocks.crc_ok(nb, part, slots[k].tail_crc):
            bad.append(nb)
        return bad

    pick, bad = 0, failing(0)
    one = slots[0].flags & SLOT_ONE_FLUSH and older(0)
    if bad and one and blocks.zero_sector(older(0).size, slots[0].size):
        bad = None          # a one-flush cut short by a power cut: it was never acknowledged
    if bad is None and one:
        pick, bad = 1, failing(1)
    if bad is None or (pick and bad):
        return None
    # bad (pick 0): blocks of a flush that completed fail their CRC -- a damaged medium, not a torn write
    # (all its bytes are there, none of them a sector the write never reached): kept, reported
    slot = slots[pick]
    nb, part = divmod(slot.size, BLOCK)
    kept = entries[:nb] + ([(slot.tail_crc, part)] if part else [])
    bad_set = set(bad) | {i for i in range(nb) if full and not blocks.crc_ok(i, BLOCK, entries[i][0])}
    return Plan(kept, bad_set, [], slot, slots[0] if pick else None)


def plan_by_entries(entries: list[Entry], blocks: Blocks, full: bool) -> Plan:
    """The extent by the entry rules 1-4 (module docstring)."""
    entries = list(entries)
    n = len(entries)
    data_len = blocks.data_len

    def valid(i: int) -> bool:
        return 0 < entries[i][1] <= BLOCK

    def present(i: int) -> bool:
        return data_len >= i * BLOCK + entries[i][1]

    def good(i: int) -> bool:
        return valid(i) and present(i) and blocks.crc_ok(i, entries[i][1], entries[i][0])

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
            if not blocks.crc_ok(i, BLOCK, c):
                bad.add(i)
        elif full and not blocks.crc_ok(i, BLOCK, c):
            bad.add(i)
    # 3. BAD-but-complete entries after the anchor are kept (bit flips in acked data)
    if not partial_end:
        while keep < n and valid(keep) and present(keep):
            bad.add(keep)
            keep += 1
            if entries[keep - 1][1] < BLOCK:
                break
    # 4. the rest is the torn tail
    return Plan(entries[:keep], bad, fixed, None, None)


class FileBlocks:
    """``Blocks`` of an open data file; each question read and answered once."""

    def __init__(self, fd: int):
        self.fd = fd
        self.data_len = os.fstat(fd).st_size
        self._buf = memoryview(bytearray(BLOCK))
        self._memo: dict[tuple[int, int, int], bool] = {}

    def crc_ok(self, i: int, covered: int, crc: int) -> bool:
        key = (i, covered, crc)
        r = self._memo.get(key)
        if r is None:
            buf = self._buf[:covered]
            r = self._memo[key] = preadv_all(self.fd, [buf], i * BLOCK) == covered and crc32c(buf) == crc
        return r

    def zero_sector(self, start: int, end: int) -> bool:
        buf = self._buf
        while start < end:
            n = min(BLOCK, end - start)
            got = preadv_all(self.fd, [buf[:n]], start)
            chunk = bytes(buf[:got])
            edge = -start % 512 or 512
            pieces = [chunk[:edge]] + [chunk[j:j + 512] for j in range(edge, len(chunk), 512)]
            if got < n or any(not piece.strip(b"\0") for piece in pieces if piece):
                return True
            start += n
        return False


def _log_bad(eid: int, root, bad: set[int]) -> None:
    if bad:
        log.error("extent %d (%s): %d block(s) fail their CRC and are kept (reads of them will fail): %s",
                  eid, root, len(bad), sorted(bad))


def recover(root: pathlib.Path, eid: int, dat: int, crcfd: int, verify: str, prefill: int) -> tuple[Extent, int]:
    """Check one extent's open files, cut them back as ``plan`` says (durably) and log what was done;
    returns the extent and the bytes cut from its data file.  ``root`` names the store in the log."""
    blocks = FileBlocks(dat)
    data_len = blocks.data_len
    crc_len = os.fstat(crcfd).st_size
    raw = os.pread(crcfd, crc_len, 0) if crc_len else b""
    crc_len = len(raw)
    entries, slots = unpack_entries(raw), unpack_slots(raw)
    p = plan(entries, slots, blocks, verify == "full")
    if slots and p.slot is None:
        log.warning("extent %d (%s): no tail slot describes the files: recovering by the CRC entries", eid, root)
    size, keep = p.size, len(p.entries)
    cut = data_len - size
    if p.slot is not None:
        changed = False
        nb, part = divmod(size, BLOCK)
        if part and (len(entries) <= nb or entries[nb] != p.entries[-1]):
            pwrite_all(crcfd, ENTRY.pack(*p.entries[-1]), nb * ENTRY_SIZE)
            changed = True
        beyond = raw[keep * ENTRY_SIZE:ENTRIES_END]
        if beyond.strip(b"\0"):                    # entries a torn flush wrote past the slot's end
            pwrite_all(crcfd, bytes(len(beyond)), keep * ENTRY_SIZE)
            changed = True
        if p.unfinished is not None:               # the unfinished flush's slot must never be read again
            pwrite_all(crcfd, bytes(SLOT_SIZE), slot_pos(p.unfinished.seq))
            changed = True
        if changed:
            os.fsync(crcfd)
        if cut:
            os.ftruncate(dat, size)
            os.fsync(dat)
        if p.unfinished is not None or cut:
            log.log(logging.WARNING if p.unfinished is not None else logging.INFO,
                    "extent %d (%s): %s: data %d -> %d bytes (%d bytes cut)", eid, root,
                    "an unfinished flush (never acknowledged) cut back to the slot before it"
                    if p.unfinished is not None else
                    "the tail past the last flushed append (zero-filled ahead, or never acknowledged) cut",
                    data_len, size, cut)
    else:
        for i in p.fixed:
            pwrite_all(crcfd, ENTRY.pack(*p.entries[i]), i * ENTRY_SIZE)
        if p.fixed:
            log.warning("extent %d (%s): rewrote covered length of mid-extent entries %s to a full block",
                        eid, root, p.fixed)
        # what zero-fill ahead leaves past the end is expected: dropped quietly (info)
        zeros_only = not raw[keep * ENTRY_SIZE:ENTRIES_END].strip(b"\0")
        if crc_len != keep * ENTRY_SIZE:
            os.ftruncate(crcfd, keep * ENTRY_SIZE)
            log.log(logging.INFO if zeros_only else logging.WARNING,
                    "extent %d (%s): dropped %d bytes of CRC entries beyond the last verified block "
                    "(%d entries kept of %d)", eid, root, crc_len - keep * ENTRY_SIZE, keep, len(entries))
        if cut:
            os.ftruncate(dat, size)
            was_ahead = zeros_only and prefill and data_len <= ahead(size, prefill, MAX_EXTENT)
            log.log(logging.INFO if was_ahead else logging.WARNING,
                    "extent %d (%s): cut %s: data %d -> %d bytes (%d bytes cut)", eid, root,
                    "the tail past the last verified block (zero-filled ahead, or an append never "
                    "acknowledged)" if was_ahead else "torn tail", data_len, size, cut)
        if p.fixed or crc_len != keep * ENTRY_SIZE:
            os.fsync(crcfd)
        if cut:
            os.fsync(dat)
    _log_bad(eid, root, p.bad)
    ext = Extent(eid, dat, crcfd, size, p.entries, p.bad)
    if p.slot is not None:
        ext.slot_seq = p.slot.seq
    return ext, cut


def _open_extent(root: pathlib.Path, eid: int, verify: str, prefill: int) -> tuple[Extent, int]:
    dat_p, crc_p, _ = extent_paths(root / "extents", eid)
    dat = os.open(dat_p, os.O_RDWR | O_CLOEXEC)
    try:
        crc = os.open(crc_p, os.O_RDWR | os.O_CREAT | O_CLOEXEC, 0o644)
    except BaseException:
        os.close(dat)
        raise
    try:
        return recover(root, eid, dat, crc, verify, prefill)
    except BaseException:
        os.close(dat)
        os.close(crc)
        raise


def _empty_deleted(d: pathlib.Path, p: pathlib.Path, eid: int, step: int) -> None:
    """A file of a deleted extent still holding data (a crash came while ``mark_delete`` freed it): free it
    now, in steps.  Only a regular file; a failure is logged, not raised -- a tombstone's name is what
    counts, its space can wait for the next open."""
    try:
        st = p.lstat()
        if stat.S_ISREG(st.st_mode) and st.st_size:
            log.warning("%s: %s of deleted extent %d still holds %d bytes, freeing them", d, p.name, eid,
                        st.st_size)
            free_in_steps(p, step)
    except OSError as e:
        log.warning("%s: could not free %s of deleted extent %d: %s", d, p.name, eid, e)


def open_extents(root: pathlib.Path, extents: dict[int, Extent], tombstones: set[int], next_id: int,
                 verify: str, options: StoreOptions, on_extent: Callable[[int], None] | None = None) -> int:
    """Open every extent of the store at ``root`` into ``extents`` (recovering each) and its tombstones into
    ``tombstones``, finishing what a crash interrupted (a create, a delete); returns the next free id (at
    least ``next_id``).  ``on_extent(size)`` is called after each extent opens and may raise to stop: what
    was opened is in ``extents`` for the caller to close."""
    d = root / "extents"
    dats, crcs = set(), set()
    for p in d.iterdir():
        stem, _, kind = p.name.partition(".")
        if not stem.isdigit():
            continue
        eid = int(stem)
        if kind == "dat":
            dats.add(eid)
        elif kind == "crc":
            crcs.add(eid)
        elif kind == "deleted":
            tombstones.add(eid)
            _empty_deleted(d, p, eid, options.free_step_bytes)
    dir_changed = False
    for eid in sorted(crcs - dats):          # crash inside create_extent / mark_delete
        log.warning("%s: removing orphan %s.crc (no data file)", d, eid)
        os.unlink(extent_paths(d, eid)[1])
        dir_changed = True
    for eid in sorted(dats & tombstones):
        log.warning("%s: extent %d has a tombstone, finishing its deletion", d, eid)
        dat_p, crc_p, _ = extent_paths(d, eid)
        _empty_deleted(d, dat_p, eid, options.free_step_bytes)     # (the data file: freed in steps, then gone)
        dat_p.unlink(missing_ok=True)
        crc_p.unlink(missing_ok=True)
        dats.discard(eid)
        dir_changed = True
    cut_total = bad_total = 0
    for eid in sorted(dats):
        ext, cut = _open_extent(root, eid, verify, options.prefill_bytes)
        extents[eid] = ext
        if on_extent is not None:
            on_extent(ext.size)
        cut_total += cut
        bad_total += len(ext.bad)
        dir_changed = dir_changed or eid not in crcs
    if dir_changed:
        fsync_dir(d)
    top = max([*extents, *tombstones], default=0)
    next_id = max(next_id, top + 1)
    log.info("%s: opened %d extents (%d bytes), cut %d torn-tail bytes, %d bad blocks, next id %d",
             root, len(extents), sum(e.size for e in extents.values()), cut_total, bad_total, next_id)
    return next_id
