"""The extent store's pure parts, without files: the CRC file's format and block-CRC arithmetic
(datanode/store/crcfile.py) and what recovery keeps of an extent after a crash (datanode/store/recovery.py,
driven by an in-memory data file)."""
from __future__ import annotations

import crcmod.predefined
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from datanode.store.crcfile import (BLOCK, ENTRIES_END, ENTRY_SIZE, SLOT_ONE_FLUSH, SLOT_SIZE, BlockMismatch, Slot,
                                    append_entries, pack_entries, pack_slot, piece_crcs, read_crc, slot_pos,
                                    unpack_entries, unpack_slots)
from datanode.store.recovery import plan

ORACLE = crcmod.predefined.mkCrcFun("crc-32c")   # independent of wire.crc
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
sizes = st.one_of(st.integers(0, 3 * BLOCK), st.sampled_from([1, 4096, BLOCK - 1, BLOCK, BLOCK + 1]))


def entries_of(data: bytes) -> list[tuple[int, int]]:
    """The entries an extent holding ``data`` has, straight from their definition."""
    return [(ORACLE(data[i:i + BLOCK]), len(data[i:i + BLOCK])) for i in range(0, len(data), BLOCK)]


def noise(n: int, seed: int) -> bytes:
    """``n`` bytes with no run of zeros a sector long (a never-written sector reads as zeros)."""
    import random
    return random.Random(seed).randbytes(n).replace(b"\0", b"\1")


class MemBlocks:
    """A data file's bytes in memory, answering recovery's questions (recovery.Blocks)."""

    def __init__(self, data: bytes):
        self.data = data
        self.data_len = len(data)

    def crc_ok(self, i: int, covered: int, crc: int) -> bool:
        b = self.data[i * BLOCK:i * BLOCK + covered]
        return len(b) == covered and ORACLE(b) == crc

    def zero_sector(self, start: int, end: int) -> bool:
        if end > len(self.data):
            return True
        return any(not self.data[max(s, start):min(s + 512, end)].strip(b"\0")
                   for s in range(start // 512 * 512, end, 512))


# ------------------------------------------------------------------------------------- the CRC file format
def test_entries_decode_only_complete_entries_below_the_slots():
    ents = entries_of(noise(3 * BLOCK + 5, 1))
    raw = pack_entries(ents)
    assert unpack_entries(raw + b"\1\2\3") == ents            # a trailing partial entry is ignored
    full = bytes(ENTRIES_END) + pack_slot(1, 5, 7, 0)
    assert len(unpack_entries(full)) == ENTRIES_END // ENTRY_SIZE   # the slots are never read as entries


def test_slots_newest_first_and_a_damaged_or_misplaced_slot_is_not_read():
    raw = bytearray(ENTRIES_END + 2 * SLOT_SIZE)
    for seq, size in ((6, 1000), (7, 5000)):
        raw[slot_pos(seq):slot_pos(seq) + SLOT_SIZE] = pack_slot(seq, size, 0xABC, SLOT_ONE_FLUSH)
    assert unpack_slots(bytes(raw)) == [Slot(7, 5000, 0xABC, SLOT_ONE_FLUSH), Slot(6, 1000, 0xABC, SLOT_ONE_FLUSH)]
    for k in range(28):                                     # any flipped bit of the newer slot: only the older
        bad = bytearray(raw)
        bad[slot_pos(7) + k] ^= 0x04
        assert [s.seq for s in unpack_slots(bytes(bad))] == [6]
    moved = bytearray(raw)
    moved[slot_pos(7):slot_pos(7) + SLOT_SIZE] = pack_slot(8, 1, 0, 0)   # an even seq in the odd slot's place
    assert [s.seq for s in unpack_slots(bytes(moved))] == [6]


@SETTINGS
@given(st.lists(sizes, min_size=1, max_size=6), st.integers(0, 2**31), st.booleans())
def test_append_entries_give_the_entries_of_the_whole_extent(appends, seed, callers_pieces):
    """Entries kept up append by append (a partial last block continued, not re-read) are those of the whole
    extent, also when the caller hands in the pieces' CRCs (``piece_crcs``); the whole-append CRC is the
    payload's."""
    data = noise(sum(appends), seed)
    ents: list = []
    pos = 0
    for n in appends:
        chunk = memoryview(data)[pos:pos + n]
        pieces, whole = piece_crcs(pos, chunk)
        assert whole == ORACLE(chunk)
        new, crc = append_entries(ents, pos, chunk, pieces if callers_pieces else None, whole=True)
        assert crc == ORACLE(chunk)
        if n:                                   # (an empty append changes nothing: the store returns first)
            ents[pos // BLOCK:] = new
        pos += n
    assert ents == entries_of(data)


def test_append_entries_refuse_pieces_cut_for_another_offset():
    chunk = memoryview(noise(BLOCK + 10, 2))
    with pytest.raises(ValueError):
        append_entries(entries_of(b"x" * 100), 100, chunk, piece_crcs(101, chunk)[0][:-1])


@SETTINGS
@given(st.integers(1, 3 * BLOCK), st.data())
def test_a_read_is_checked_against_every_block_it_touches(size, draw):
    """``read_crc`` returns the CRC of the bytes read when every block they touch (with its bytes before and
    after the range) matches its entry, and names the first block that does not."""
    data = noise(size, size)
    off = draw.draw(st.integers(0, size - 1))
    n = draw.draw(st.integers(1, size - off))
    b0, b1 = off // BLOCK, (off + n - 1) // BLOCK
    ents = entries_of(data)[b0:b1 + 1]
    head = data[b0 * BLOCK:off]
    tail = data[off + n:b1 * BLOCK + ents[-1][1]]
    assert read_crc(ents, head, memoryview(data)[off:off + n], tail) == ORACLE(data[off:off + n])
    flip = draw.draw(st.integers(b0 * BLOCK, b1 * BLOCK + ents[-1][1] - 1))
    bad = bytearray(data)
    bad[flip] ^= 0x10
    head, tail = bytes(bad[b0 * BLOCK:off]), bytes(bad[off + n:b1 * BLOCK + ents[-1][1]])
    with pytest.raises(BlockMismatch) as ei:
        read_crc(ents, head, memoryview(bytes(bad))[off:off + n], tail)
    assert ei.value.index == flip // BLOCK - b0


# ---------------------------------------------------------------------------------------------- recovery
@SETTINGS
@given(st.lists(sizes, max_size=4), st.integers(1, 2 * BLOCK + 7), st.data())
def test_a_torn_append_never_costs_an_acknowledged_byte(acked, torn, draw):
    """The entry rules, after a crash in an append (no tail slots: sync=none, or files from before them): the
    append's bytes may have landed in part, its entries only once all its bytes had (the write order) and in
    order, except that the rewrite of a partial last block's entry may be lost while the next ones landed;
    zeros may follow (written ahead).  Recovery keeps every acknowledged byte, never more than was written,
    no bad block, and entries that are exactly those of the bytes kept."""
    old = noise(sum(acked), len(acked))
    new = noise(torn, torn + 1)
    a, full = len(old), len(old) + torn
    k = torn if draw.draw(st.booleans()) else draw.draw(st.integers(0, torn - 1))   # the append's bytes landed
    after = entries_of(old + new)
    fresh = list(range(a // BLOCK, len(after)))              # the entries the append writes, in file order
    how = draw.draw(st.sampled_from(["all", "all but the rewrite", "a prefix"])) if k == torn else "none"
    landed = {"all": fresh, "none": [], "a prefix": fresh[:draw.draw(st.integers(0, len(fresh)))],
              "all but the rewrite": fresh[1:] if a % BLOCK else fresh}[how]    # (of a partial last block)
    crc = entries_of(old)
    for i in landed:
        crc += [(0, 0)] * (i + 1 - len(crc))
        crc[i] = after[i]
    crc += [(0, 0)] * draw.draw(st.integers(0, 3))           # entries written ahead (zeros)
    data = old + new[:k] + bytes(draw.draw(st.integers(0, BLOCK)))
    p = plan(crc, [], MemBlocks(data), full=draw.draw(st.booleans()))
    assert a <= p.size <= a + k
    assert p.bad == set() and p.fixed == []
    assert p.entries == entries_of((old + new)[:p.size])
    if k == torn and landed == fresh:
        assert p.size == full


@SETTINGS
@given(st.integers(1, 3 * BLOCK), st.integers(1, 3 * BLOCK), st.booleans(), st.data())
def test_a_power_cut_in_a_one_flush_keeps_the_state_before_it_or_after_it(acked, flushed, grow, draw):
    """The slot rules, after a power cut in a flush that took one fdatasync: any of its writes may have
    reached the disk and any other not -- each data page, the entries, the new tail slot, and (a growing
    flush) the data file's new length.  Recovery keeps exactly the bytes acknowledged before the flush, or
    those and the whole flush; never a bad block; the flush only when all of its bytes are there."""
    old, new = noise(acked, acked), noise(flushed, flushed + 1)
    a, b = acked, acked + flushed
    before_len = a if grow else -(-b // (256 << 10)) * (256 << 10)      # else: zeros written ahead cover it
    before = old + bytes(before_len - a)
    after = (old + new).ljust(max(before_len, b), b"\0")
    pages = list(range(a // 4096 * 4096, b, 4096))
    landed_pages = draw.draw(st.sets(st.sampled_from(pages)) | st.just(set(pages)))
    data = bytearray(before.ljust(len(after), b"\0"))
    for pg in landed_pages:
        data[pg:pg + 4096] = after[pg:pg + 4096]
    length = draw.draw(st.sampled_from([before_len, len(after)]))
    data = bytes(data[:length])
    entries = entries_of(old + new) if draw.draw(st.booleans()) else entries_of(old)
    tail = entries_of(old)[-1][0] if a % BLOCK else 0
    slots = [Slot(2, a, tail, 0)]
    if draw.draw(st.booleans()):
        slots.insert(0, Slot(3, b, entries_of(old + new)[-1][0] if b % BLOCK else 0, SLOT_ONE_FLUSH))
    p = plan(entries, slots, MemBlocks(data), full=draw.draw(st.booleans()))
    assert p.size in (a, b)
    assert p.bad == set()
    assert p.entries == entries_of((old + new)[:p.size])
    if landed_pages != set(pages) or length < b:
        assert p.size == a
    if p.size == b:
        assert p.slot is not None and p.slot.seq == 3


@SETTINGS
@given(st.integers(1, 4 * BLOCK), st.data())
def test_a_flipped_bit_in_acknowledged_data_is_kept_and_reported_not_cut(size, draw):
    """A bit flip on the medium in bytes a completed write left (no crash in between, with or without the
    tail slots of the flushes that wrote them) is not a torn tail: the extent keeps its size and entries,
    and the block is reported bad -- always when every block is checked at open, else when recovery read it
    (repair restores it from a replica)."""
    orig = noise(size, size)
    data = bytearray(orig)
    ents = entries_of(orig)
    flip = draw.draw(st.integers(0, size - 1))
    data[flip] ^= 0x08
    slots = []
    if draw.draw(st.booleans()):
        prev = draw.draw(st.integers(0, size - 1))            # what the flush before the last one left
        slots = [Slot(9, size, ents[-1][0] if size % BLOCK else 0, draw.draw(st.sampled_from([0, SLOT_ONE_FLUSH]))),
                 Slot(8, prev, ORACLE(orig[prev // BLOCK * BLOCK:prev]) if prev % BLOCK else 0, 0)]
    full = draw.draw(st.booleans())
    p = plan(ents, slots, MemBlocks(bytes(data)), full)
    assert p.size == size and p.entries == ents
    assert p.bad <= {flip // BLOCK}
    if full:
        assert p.bad == {flip // BLOCK}
