"""The CRC file's format and the block-CRC arithmetic, as pure functions (no file is touched here).

``extents/<id>.crc`` holds one 8-byte entry per 128 KiB block of the data file, (crc32c u32, covered u32)
big-endian: entry ``i`` covers ``data[i*BLOCK : i*BLOCK + covered]``, and every block but the last is full.
An append that extends a partial last block continues its CRC (``crc32c(new_bytes, old_crc)``) and
rewrites that one entry; bytes below the extent's size are never rewritten, so neither are their entries.

Past the entries of a full extent (``ENTRIES_END``, 8 KiB) come two **tail slots**, ``SLOT_SIZE`` apart,
the newest by sequence number (the one-flush sequence writes them: datanode/store/flush.py)::

    magic "DNT1" | seq u32 | size u64 | CRC of the partial last block u32 | flags u32 | CRC32C of the rest u32

Slot ``seq`` lives at ``slot_pos(seq)``: consecutive flushes alternate between the two, so the slot that
describes the state before a flush stays intact while the flush writes the other.
"""
from __future__ import annotations

import struct
from typing import NamedTuple

from wire.crc import HARDWARE, crc32c, crc32c_combine
from wire.protocol import MAX_EXTENT

BLOCK = 128 * 1024              # one CRC32C per 128 KiB block
ENTRY = struct.Struct(">II")
ENTRY_SIZE = ENTRY.size         # 8
ENTRIES_END = MAX_EXTENT // BLOCK * ENTRY_SIZE   # where the entries of a full extent end: the slots follow
_SLOT = struct.Struct(">4sIQII")
_SLOT_MAGIC = b"DNT1"
SLOT_SIZE = 32
SLOT_ONE_FLUSH = 1              # flags: written by a one-flush (its data was not synced before it)

Entry = tuple[int, int]         # (crc, covered)


class Slot(NamedTuple):
    seq: int
    size: int                   # the extent's size when it was written
    tail_crc: int               # CRC of the partial last block (0: the size is a block boundary)
    flags: int


def unpack_entries(raw: bytes) -> list[Entry]:
    """The complete entries in a CRC file's bytes (a trailing partial entry is ignored, and so is what lies
    past the entries of a full extent)."""
    n = min(len(raw) // ENTRY_SIZE, MAX_EXTENT // BLOCK)
    return [ENTRY.unpack_from(raw, i * ENTRY_SIZE) for i in range(n)]


def pack_entries(entries: list[Entry]) -> bytes:
    return b"".join([ENTRY.pack(*e) for e in entries])


def slot_pos(seq: int) -> int:
    return ENTRIES_END + (seq & 1) * SLOT_SIZE


def pack_slot(seq: int, size: int, tail_crc: int, flags: int) -> bytes:
    body = _SLOT.pack(_SLOT_MAGIC, seq, size, tail_crc, flags)
    return body + struct.pack(">I", crc32c(body)) + bytes(SLOT_SIZE - _SLOT.size - 4)


def unpack_slots(raw: bytes) -> list[Slot]:
    """The valid tail slots in a CRC file's bytes, newest first."""
    out = []
    for k in range(2):
        pos = ENTRIES_END + k * SLOT_SIZE
        rec = raw[pos:pos + _SLOT.size + 4]
        if len(rec) < _SLOT.size + 4 or rec[:4] != _SLOT_MAGIC:
            continue
        magic, seq, size, tail_crc, flags = _SLOT.unpack_from(rec)
        if (struct.unpack_from(">I", rec, _SLOT.size)[0] != crc32c(rec[:_SLOT.size]) or (seq & 1) != k
                or size > MAX_EXTENT):
            continue
        out.append(Slot(seq, size, tail_crc, flags))
    return sorted(out, reverse=True)


def entries_digest(entries: list[Entry]) -> int:
    """CRC32C of the entries as (crc, covered) u32 pairs: equal for two copies of an extent exactly when every
    block holds the same bytes (up to CRC collisions)."""
    flat = [x for e in entries for x in e]
    return crc32c(struct.pack(f">{len(flat)}I", *flat)) if flat else 0


def byte_view(buf) -> memoryview:
    mv = buf if isinstance(buf, memoryview) else memoryview(buf)
    if mv.ndim != 1 or mv.format != "B":
        mv = mv.cast("B")
    return mv


def crc_cat(crc_a: int, piece, crc_piece: int) -> int:
    """crc32c(a + piece) given crc32c(a), the piece and crc32c(piece): combine when that is cheaper."""
    n = len(piece)
    if n == BLOCK or not HARDWARE or n > 64 * 1024:
        return crc32c_combine(crc_a, crc_piece, n)
    return crc32c(piece, crc_a)


def _pieces(offset: int, mv: memoryview):
    """``mv`` cut where an append at ``offset`` crosses a block boundary."""
    n = len(mv)
    pos = 0
    within = offset % BLOCK
    while pos < n:
        take = min(BLOCK - within, n - pos)
        yield mv[pos:pos + take] if take != n else mv
        pos += take
        within = 0


def piece_crcs(offset: int, data) -> tuple[list[int], int]:
    """The CRC32C of each piece of ``data`` cut where an append at ``offset`` crosses a block boundary, and
    of all of it: one pass over the bytes.  A caller that must check the payload's CRC before it appends
    (the request path: before it forwards to the followers) passes the pieces on to ``append``, which then
    does not read the bytes a second time."""
    out: list[int] = []
    whole = 0
    for piece in _pieces(offset, byte_view(data)):
        c = crc32c(piece)
        whole = c if not out else crc_cat(whole, piece, c)
        out.append(c)
    return out, whole


def append_entries(entries: list[Entry], size: int, mv: memoryview, pieces: list[int] | None = None,
                   whole: bool = False) -> tuple[list[Entry], int]:
    """The entries an append of ``mv`` at ``size`` (the extent's end) gives, from the first block it touches
    on (that block's entry continued when it is partial), and -- with ``whole`` -- the CRC32C of all of
    ``mv`` (else 0).  ``pieces``: the caller's ``piece_crcs(size, mv)``, used instead of reading the bytes;
    ValueError when they do not fit this append."""
    n = len(mv)
    within = size % BLOCK
    if pieces is not None and len(pieces) != (-(-(within + n) // BLOCK) if n else 0):
        raise ValueError("pieces do not match this append")
    new: list[Entry] = []
    crc_all = 0
    for k, piece in enumerate(_pieces(size, mv)):
        c = pieces[k] if pieces is not None else crc32c(piece)
        if whole:
            crc_all = c if k == 0 else crc_cat(crc_all, piece, c)
        if k == 0 and within:
            old_c, old_cov = entries[size // BLOCK]
            new.append((crc_cat(old_c, piece, c), old_cov + len(piece)))
        else:
            new.append((c, len(piece)))
    return new, crc_all


class BlockMismatch(Exception):
    """A block of a read does not match its entry: ``index`` counts from the read's first block."""

    def __init__(self, index: int, computed: int):
        super().__init__(index, computed)
        self.index = index
        self.computed = computed


def read_crc(entries: list[Entry], head, dst: memoryview, tail) -> int:
    """Check a read against its blocks' entries and return the CRC32C of ``dst``.  ``entries`` are those of
    the blocks the read touches; ``head`` the bytes of the first block before ``dst``, ``tail`` those of the
    last block after it (each read only to be checked).  BlockMismatch names the first block that fails."""
    length = len(dst)
    rc = pos = 0
    last = len(entries) - 1
    for k, (ecrc, _cov) in enumerate(entries):
        in_len = length - pos if k == last else min(BLOCK - (len(head) if k == 0 else 0), length - pos)
        piece = dst[pos:pos + in_len]
        c_in = crc32c(piece)
        bc = c_in
        if k == 0 and len(head):
            bc = crc_cat(crc32c(head), piece, c_in)
        if k == last and len(tail):
            bc = crc_cat(bc, tail, crc32c(tail))
        if bc != ecrc:
            raise BlockMismatch(k, bc)
        rc = c_in if pos == 0 else crc_cat(rc, piece, c_in)
        pos += in_len
    return rc
