import itertools
import logging
import os
import random
import signal
import struct
import subprocess
import sys
import textwrap
import threading
import time

import crcmod.predefined
import pytest

from datanode.store import BLOCK, MAX_EXTENT, SLOT_SIZE, ExtentStore, StoreError, StoreOptions
from datanode.store.files import has_sync_file_range

ORACLE = crcmod.predefined.mkCrcFun("crc-32c")   # independent of wire.crc
MiB_ = 1 << 20
SLOTS_END = MAX_EXTENT // BLOCK * 8 + 2 * SLOT_SIZE    # the CRC file's tail slots end here
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------------------------- helpers
def append_random(store, eid, data, rng, with_crc=True):
    pos = store.size(eid)
    mv = memoryview(data)
    i = 0
    while i < len(data):
        n = min(len(data) - i, rng.choice([1, 3, 512, 4095, 4096, 10_000, BLOCK - 1, BLOCK, BLOCK + 1,
                                           rng.randrange(1, 400_000)]))
        chunk = mv[i:i + n]
        new = store.write(eid, pos, chunk, ORACLE(chunk) if with_crc and rng.random() < 0.7 else None)
        assert new == pos + n
        pos = new
        i += n
    return pos


def crash_copy(src, dst):
    """The store's files as they are now (the page cache: what a kill -9 leaves), copied to ``dst``."""
    subprocess.run(["cp", "-a", str(src), str(dst)], check=True)


def read(store, eid, off, n):
    out = bytearray(n + 3)   # a bigger buffer is fine
    c = store.read_into(eid, off, n, memoryview(out))
    assert c == ORACLE(bytes(out[:n]))
    assert out[n:] == b"\0\0\0"
    return bytes(out[:n])


def paths(root, eid):
    d = root / "extents"
    return d / f"{eid}.dat", d / f"{eid}.crc"


def entries(root, eid):
    raw = paths(root, eid)[1].read_bytes()
    return [struct.unpack_from(">II", raw, i) for i in range(0, len(raw) - len(raw) % 8, 8)]


def set_entry(root, eid, i, crc, cov):
    with open(paths(root, eid)[1], "r+b") as f:
        f.seek(i * 8)
        f.write(struct.pack(">II", crc, cov))


def flip(path, pos):
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0x10]))


def expect(code, fn, *a):
    with pytest.raises(StoreError) as ei:
        fn(*a)
    assert ei.value.code == code, ei.value
    return ei.value


@pytest.fixture
def rng():
    return random.Random(12345)


# ----------------------------------------------------------------------------------------------- basics
@pytest.mark.parametrize("size", [0, 1, 4095, 4096, BLOCK - 1, BLOCK, BLOCK + 1, 8 << 20, "random"])
def test_round_trip(tmp_path, rng, size):
    if size == "random":
        size = rng.randrange(1, 3 * BLOCK + 5000)
    data = rng.randbytes(size)
    s = ExtentStore(tmp_path, sync="none")
    eid = s.create_extent()
    assert append_random(s, eid, data, rng) == size
    assert s.size(eid) == size and s.watermarks() == {eid: size}
    assert read(s, eid, 0, size) == data
    for _ in range(60 if size else 1):
        off = rng.randrange(0, size + 1)
        n = rng.randrange(0, min(size - off, rng.choice([1, 100, 5000, BLOCK, 3 * BLOCK, size])) + 1)
        assert read(s, eid, off, n) == data[off:off + n]
    crcs = s.block_crcs(eid)
    assert crcs == [ORACLE(data[i:i + BLOCK]) for i in range(0, size, BLOCK)]
    assert entries(tmp_path, eid) == [(ORACLE(data[i:i + BLOCK]), len(data[i:i + BLOCK]))
                                      for i in range(0, size, BLOCK)]
    assert paths(tmp_path, eid)[0].stat().st_size == size
    s.close()
    s = ExtentStore(tmp_path)                         # clean reopen cuts nothing
    assert s.size(eid) == size and s.stats()["bad_blocks"] == 0
    assert read(s, eid, 0, size) == data
    s.close()


def test_sync_always_round_trip_and_continue_after_reopen(tmp_path, rng):
    data = rng.randbytes(3 * BLOCK + 777)
    s = ExtentStore(tmp_path / "new" / "root", sync="always")   # creates missing parents
    eid = s.create_extent()
    append_random(s, eid, data[:BLOCK + 100], rng)
    s.close()
    s = ExtentStore(tmp_path / "new" / "root", sync="always")
    append_random(s, eid, data[BLOCK + 100:], rng)                # continues a partial block
    assert read(s, eid, 0, len(data)) == data
    assert s.stats()["sync"] == "always"
    s.close()


def test_bad_sync_mode(tmp_path):
    with pytest.raises(ValueError):
        ExtentStore(tmp_path, sync="sometimes")


def test_bad_offset_and_errors(tmp_path, rng):
    s = ExtentStore(tmp_path, sync="none")
    eid = s.create_extent()
    s.write(eid, 0, b"x" * 1000)
    e = expect("wrong_offset", s.write, eid, 999, b"y")
    assert "1000" in e.message
    expect("wrong_offset", s.write, eid, 1001, b"y")
    expect("out_of_range", s.read_into, eid, 990, 11, memoryview(bytearray(11)))
    expect("out_of_range", s.read_into, eid, 1001, 0, memoryview(bytearray(1)))
    expect("out_of_range", s.read_into, eid, -1, 1, memoryview(bytearray(1)))
    assert s.read_into(eid, 1000, 0, memoryview(bytearray(0))) == 0
    with pytest.raises(ValueError):
        s.read_into(eid, 0, 10, memoryview(bytearray(5)))
    # wrong payload CRC: rejected, nothing written
    expect("crc", s.write, eid, 1000, b"abc", ORACLE(b"abd"))
    assert s.size(eid) == 1000 and paths(tmp_path, eid)[0].stat().st_size == 1000
    assert s.write(eid, 1000, b"abc", ORACLE(b"abc")) == 1003
    assert s.write(eid, 1003, b"") == 1003
    expect("not_found", s.write, 99, 0, b"a")
    expect("not_found", s.size, 99)
    expect("not_found", s.read_into, 99, 0, 0, memoryview(bytearray(0)))
    expect("exists", s.create_extent, eid)
    expect("out_of_range", s.create_extent, 0)
    expect("out_of_range", s.create_extent, 2**64 - 1)        # an id the wire could not carry past +1
    assert s.create_extent() == eid + 1                        # and the next id is still sane
    s.close()
    expect("disk", s.size, eid)


def test_too_large(tmp_path):
    s = ExtentStore(tmp_path, sync="none")
    eid = s.create_extent()
    expect("too_large", s.write, eid, 0, memoryview(bytes(MAX_EXTENT + 1)))   # calloc'd, cheap
    chunk = memoryview(os.urandom(1 << 20))
    pos = 0
    while pos < MAX_EXTENT:
        pos = s.write(eid, pos, chunk)
    assert pos == MAX_EXTENT
    expect("too_large", s.write, eid, pos, b"a")
    assert s.size(eid) == MAX_EXTENT
    assert len(s.block_crcs(eid)) == MAX_EXTENT // BLOCK
    s.close()


def test_write_accepts_buffers(tmp_path):
    import array
    s = ExtentStore(tmp_path, sync="none")
    eid = s.create_extent()
    a = array.array("I", range(100))
    s.write(eid, 0, a)
    s.write(eid, 400, bytearray(b"xy"))
    s.write(eid, 402, memoryview(b"..z..")[2:3])
    assert read(s, eid, 0, 403) == a.tobytes() + b"xyz"
    out = array.array("I", [0] * 100)
    assert s.read_into(eid, 0, 400, memoryview(out)) == ORACLE(a.tobytes())
    assert out == a
    s.close()


# ----------------------------------------------------------------------------------------------- corruption
def test_flipped_byte_raises_crc_and_never_returns_bytes(tmp_path, rng, caplog):
    data = rng.randbytes(5 * BLOCK + 1234)
    s = ExtentStore(tmp_path, sync="none")
    eid = s.create_extent()
    append_random(s, eid, data, rng)
    flip(paths(tmp_path, eid)[0], 2 * BLOCK + 777)
    out = bytearray(b"\xAA" * 100)
    expect("crc", s.read_into, eid, 2 * BLOCK + 700, 100, memoryview(out))
    assert out == bytes(100)                           # scrubbed, not the stored bytes
    expect("crc", s.read_into, eid, 2 * BLOCK - 10, 20, memoryview(bytearray(20)))   # straddles into it
    expect("crc", s.read_into, eid, 0, len(data), memoryview(bytearray(len(data))))
    expect("crc", s.read_into, eid, 2 * BLOCK, 1, memoryview(bytearray(1)))          # far from the flip
    assert read(s, eid, 0, 2 * BLOCK) == data[:2 * BLOCK]                            # other blocks fine
    assert read(s, eid, 3 * BLOCK, len(data) - 3 * BLOCK) == data[3 * BLOCK:]
    assert read(s, eid, BLOCK + 5, BLOCK - 5) == data[BLOCK + 5:2 * BLOCK]
    assert s.stats()["bad_blocks"] == 1
    s.close()
    # reopen: acked data must not be cut; the damage is logged and still reported on read
    for verify in ("full", "tail"):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="datanode.store"):
            s = ExtentStore(tmp_path, sync="none", verify=verify)
        assert s.size(eid) == len(data)
        if verify == "full":
            assert s.stats()["bad_blocks"] == 1
            assert any("fail their CRC" in r.getMessage() for r in caplog.records)
        assert not any("cut" in r.getMessage() for r in caplog.records)
        expect("crc", s.read_into, eid, 2 * BLOCK + 700, 100, memoryview(bytearray(100)))
        assert read(s, eid, 3 * BLOCK, 10) == data[3 * BLOCK:3 * BLOCK + 10]
        s.close()


@pytest.mark.parametrize("where", ["last_partial", "last_full", "first"])
def test_flip_in_tail_block_is_kept_not_cut(tmp_path, rng, where):
    size = 4 * BLOCK if where == "last_full" else 4 * BLOCK + 999
    data = rng.randbytes(size)
    s = ExtentStore(tmp_path, sync="none")
    eid = s.create_extent()
    append_random(s, eid, data, rng)
    s.close()
    pos = {"last_partial": 4 * BLOCK + 5, "last_full": 3 * BLOCK + 5, "first": 5}[where]
    flip(paths(tmp_path, eid)[0], pos)
    for verify in ("full", "tail"):
        s = ExtentStore(tmp_path, sync="none", verify=verify)
        assert s.size(eid) == size
        expect("crc", s.read_into, eid, pos, 1, memoryview(bytearray(1)))
        blk = pos // BLOCK
        ok_off = 0 if blk else BLOCK
        assert read(s, eid, ok_off, BLOCK) == data[ok_off:ok_off + BLOCK]
        s.close()


def test_corrupted_covered_length_mid_extent_is_repaired(tmp_path, rng):
    data = rng.randbytes(4 * BLOCK + 10)
    s = ExtentStore(tmp_path, sync="none")
    eid = s.create_extent()
    append_random(s, eid, data, rng)
    s.close()
    c, _ = entries(tmp_path, eid)[1]
    set_entry(tmp_path, eid, 1, c, 5)                    # a middle block claiming to be partial
    s = ExtentStore(tmp_path)
    assert s.size(eid) == len(data)
    assert read(s, eid, 0, len(data)) == data
    assert entries(tmp_path, eid)[1] == (c, BLOCK)
    s.close()
    set_entry(tmp_path, eid, 2, 0xDEADBEEF, 0)           # middle entry garbage -> kept as a bad block
    s = ExtentStore(tmp_path)
    assert s.size(eid) == len(data)
    expect("crc", s.read_into, eid, 2 * BLOCK, 1, memoryview(bytearray(1)))
    assert read(s, eid, 3 * BLOCK, BLOCK + 10) == data[3 * BLOCK:]
    s.close()


# ----------------------------------------------------------------------------------------------- torn tails
def _base(tmp_path, rng, size):
    data = rng.randbytes(size)
    s = ExtentStore(tmp_path, sync="always")
    eid = s.create_extent()
    append_random(s, eid, data, rng)
    s.close()
    return eid, data


def _reopen_check(tmp_path, eid, data, want_size, verify):
    s = ExtentStore(tmp_path, verify=verify)
    assert s.size(eid) == want_size
    assert read(s, eid, 0, want_size) == data[:want_size]
    dat, crc = paths(tmp_path, eid)
    assert dat.stat().st_size == want_size
    assert crc.stat().st_size == 8 * ((want_size + BLOCK - 1) // BLOCK)
    assert s.stats()["bad_blocks"] == 0
    # the extent is writable again at the recovered size
    more = os.urandom(BLOCK + 3)
    s.write(eid, want_size, more)
    assert read(s, eid, 0, want_size + len(more)) == data[:want_size] + more
    s.close()


VERIFY = pytest.mark.parametrize("verify", ["full", "tail"])


@VERIFY
@pytest.mark.parametrize("size", [0, 1000, BLOCK, 2 * BLOCK + 1000])
def test_torn_data_longer_than_crc_coverage(tmp_path, rng, verify, size):
    eid, data = _base(tmp_path, rng, size)
    with open(paths(tmp_path, eid)[0], "ab") as f:
        f.write(os.urandom(rng.randrange(1, 3 * BLOCK)))          # data landed, entries did not
    _reopen_check(tmp_path, eid, data, size, verify)


@VERIFY
def test_torn_new_block_entry_but_data_short(tmp_path, rng, verify):
    size = 2 * BLOCK
    eid, data = _base(tmp_path, rng, size)
    intended = os.urandom(BLOCK)
    set_entry(tmp_path, eid, 2, ORACLE(intended), BLOCK)          # entry for block 2 landed ...
    with open(paths(tmp_path, eid)[0], "ab") as f:
        f.write(intended[:5000])                                  # ... its data only partly
    _reopen_check(tmp_path, eid, data, size, verify)


@VERIFY
def test_torn_partial_block_entry_rewritten_but_data_short(tmp_path, rng, verify):
    # extending a partial block: entry rewritten in place, data never fully landed. The old entry is
    # gone, so the whole partial block is unverifiable: the last verified point is the block start.
    size = BLOCK + 1000
    eid, data = _base(tmp_path, rng, size)
    extra = os.urandom(5000)
    set_entry(tmp_path, eid, 1, ORACLE(data[BLOCK:] + extra), 1000 + 5000)
    with open(paths(tmp_path, eid)[0], "ab") as f:
        f.write(extra[:2000])
    _reopen_check(tmp_path, eid, data, BLOCK, verify)


@VERIFY
def test_torn_partial_extension_data_landed_entry_old(tmp_path, rng, verify):
    size = BLOCK + 1000
    eid, data = _base(tmp_path, rng, size)
    with open(paths(tmp_path, eid)[0], "ab") as f:
        f.write(os.urandom(BLOCK + 70_000))                       # crosses into block 2
    intended_b2 = os.urandom(70_000)
    set_entry(tmp_path, eid, 2, ORACLE(intended_b2), 70_000)      # and even block 2's new entry landed
    _reopen_check(tmp_path, eid, data, size, verify)


@VERIFY
def test_completed_but_unacked_write_is_kept(tmp_path, rng, verify):
    size = BLOCK + 1000
    eid, data = _base(tmp_path, rng, size)
    extra = os.urandom(BLOCK)
    full = data + extra
    with open(paths(tmp_path, eid)[0], "ab") as f:
        f.write(extra)
    set_entry(tmp_path, eid, 1, ORACLE(full[BLOCK:2 * BLOCK]), BLOCK)
    set_entry(tmp_path, eid, 2, ORACLE(full[2 * BLOCK:]), 1000)
    _reopen_check(tmp_path, eid, full, len(full), verify)


@VERIFY
@pytest.mark.parametrize("garbage", [b"\x01\x02\x03", b"\0" * 8, b"\0" * 8 + b"\x07", b"\xff" * 16])
def test_torn_partial_or_garbage_crc_entry(tmp_path, rng, verify, garbage):
    size = 3 * BLOCK + 17
    eid, data = _base(tmp_path, rng, size)
    with open(paths(tmp_path, eid)[1], "ab") as f:
        f.write(garbage)
    with open(paths(tmp_path, eid)[0], "ab") as f:
        f.write(os.urandom(300))
    _reopen_check(tmp_path, eid, data, size, verify)


def test_data_without_crc_file_and_orphan_crc(tmp_path, rng):
    eid, data = _base(tmp_path, rng, 5000)
    paths(tmp_path, eid)[1].unlink()                               # crash inside create: .dat only
    (tmp_path / "extents" / "77.crc").write_bytes(b"\0" * 8)        # and an orphan .crc
    s = ExtentStore(tmp_path)
    assert s.size(eid) == 0
    assert not (tmp_path / "extents" / "77.crc").exists()
    assert s.create_extent() == eid + 1
    s.write(eid, 0, b"again")
    assert read(s, eid, 0, 5) == b"again"
    s.close()


# ----------------------------------------------------------------------------------------------- one flush
def _snapshot(root, eid) -> tuple[bytes, bytes]:
    """The extent's two files as they are now (the page cache: what a kill -9 would leave)."""
    dat, crc = paths(root, eid)
    return dat.read_bytes(), crc.read_bytes()


def _mix(old: bytes, new: bytes, ranges) -> bytes:
    """``old`` with the pages ``ranges`` [(start, end)] taken from ``new`` (a write that reached the disk)."""
    out = bytearray(old.ljust(len(new), b"\0"))
    for a, b in ranges:
        out[a:b] = new[a:b]
    return bytes(out)


ONE_FLUSH_CASES = {          # (bytes acknowledged before, appends of the flush a power cut interrupts)
    "within a block": (10_000, [4096]),
    "into the next block": (BLOCK - 1000, [3000, 4096]),
    "over whole blocks": (2 * BLOCK + 100, [BLOCK, 5000]),
    # appends past the zeros written ahead grow the data file: the flush ends with its fdatasync instead
    "growing the file": (10_000, [300_000]),
    "growing it over whole blocks": (2 * BLOCK + 100, [3 * BLOCK]),
}


@pytest.mark.parametrize("case", ONE_FLUSH_CASES)
def test_a_power_cut_during_a_one_flush_never_loses_an_acknowledged_byte(tmp_path, rng, case, caplog):
    """A flush that takes one fdatasync (sync_file_range of the data, then fdatasync of the CRC file; or, when
    its appends grew the data file, the CRC pages written out, then fdatasync of the data file) orders
    nothing between its writes before the device's cache flush: a power cut may leave any of them on disk
    and not the others -- data pages, the CRC entries' page, the tail slot's page, the data file's new
    length.  Every such mix recovers to the bytes acknowledged before that flush, or to those and the whole
    flush; every recovered byte reads back verified; the block the flush extended (acknowledged bytes at its
    start) is never lost."""
    acked_len, flush = ONE_FLUSH_CASES[case]
    live = tmp_path / "live"
    s = ExtentStore(live, sync="always", options=StoreOptions(one_flush=True))
    eid = s.create_extent()
    data = rng.randbytes(acked_len + sum(flush))
    pos = 0
    for n in [4096] * (acked_len // 4096) + [acked_len % 4096]:     # acknowledged: small appends, each flushed
        s.write(eid, pos, data[pos:pos + n])
        pos += n
    before = _snapshot(live, eid)
    ones = s.one_flushes
    for n in flush:                                 # the interrupted flush: appends, then one flush of them
        s.append(eid, pos, data[pos:pos + n])
        pos += n
    assert s.flush([eid]) == {}
    assert s.one_flushes == ones + 1, "the flush under test did not take the one-flush path"
    after = _snapshot(live, eid)
    s.close()
    pages = [(a, min(a + 4096, pos)) for a in range(acked_len // 4096 * 4096, pos, 4096)]
    slot = (MAX_EXTENT // BLOCK * 8, SLOTS_END)
    entry_pages = [(0, MAX_EXTENT // BLOCK * 8)]
    lengths = sorted({len(before[0]), len(after[0])})     # a grown file's new length may not have landed
    assert (len(lengths) == 2) == case.startswith("growing")
    outcomes, tries = set(), 0
    for data_pages, entries_landed, slot_landed, length in itertools.product(
            ([], pages[:len(pages) // 2], pages[len(pages) // 2:], pages), (False, True), (False, True), lengths):
        tries += 1
        root = tmp_path / f"cut{tries}"
        dat, crc = paths(root, eid)
        dat.parent.mkdir(parents=True)
        dat.write_bytes(_mix(before[0], after[0], data_pages)[:length])
        crc.write_bytes(_mix(before[1], after[1], (entry_pages if entries_landed else [])
                             + ([slot] if slot_landed else [])))
        with caplog.at_level(logging.INFO, logger="datanode.store"):
            r = ExtentStore(root, sync="always")
        got = r.size(eid)
        assert got in (acked_len, len(data)), (data_pages, entries_landed, slot_landed, length, got)
        assert read(r, eid, 0, got) == data[:got]
        assert r.stats()["bad_blocks"] == 0
        if data_pages != pages or length < len(after[0]):
            assert got == acked_len     # the flush's bytes are not all there: it never happened
        r.write(eid, got, b"next")      # writable at once, and the write survives a crash too
        crashed = tmp_path / f"{root.name}-again"
        crash_copy(root, crashed)
        r.close()
        r2 = ExtentStore(crashed, sync="always")
        assert read(r2, eid, 0, got + 4) == data[:got] + b"next"
        r2.close()
        outcomes.add(got)
    assert outcomes == {acked_len, len(data)}
    assert "fail their CRC" not in caplog.text


def test_a_growing_flush_takes_one_fdatasync_only_once_this_process_synced_the_crc_file(tmp_path, rng):
    """A flush that grows the data file ends with that file's fdatasync alone only where the CRC file's
    blocks it overwrites were made durable by this process: after a kill -9 the files a store opens may
    hold pages never synced (the page cache survived, a power cut would not), so its first flush syncs
    both files, as the first flush after create does; the next one takes one fdatasync again."""
    live = tmp_path / "live"
    s = ExtentStore(live, sync="always", options=StoreOptions(one_flush=True))
    eid = s.create_extent()
    data = rng.randbytes(4 * 300_000 + 4096)   # appends past the zeros written ahead grow the file
    for k in range(2):
        s.write(eid, k * 300_000, data[k * 300_000:(k + 1) * 300_000])
    assert s.one_flushes == 1                  # the first after create: two fdatasyncs; the second: one
    crashed = tmp_path / "crashed"
    crash_copy(live, crashed)                  # kill -9: the page cache, as it is
    s.close()
    r = ExtentStore(crashed, sync="always", options=StoreOptions(one_flush=True))
    size = 600_000                             # its last block partial: a small append rewrites only its entry
    # the first flush after open syncs both files; so does the next, whose entries reach past what the CRC
    # file had (its next page written ahead); the third takes one fdatasync
    for n, ones in [(4096, 0), (300_000, 0), (300_000, 1)]:
        r.write(eid, size, data[size:size + n])
        size += n
        assert r.one_flushes == ones, "the first flush after open must sync the CRC file too"
    assert read(r, eid, 0, size) == data[:size]
    r.close()


def test_a_file_system_without_sync_file_range_gets_two_flushes_not_errors(tmp_path, rng, monkeypatch, caplog):
    """Where sync_file_range is refused (EINVAL: a file system that does not do it), the flush syncs the
    data first instead -- this one and every later one -- and says so once; no write fails."""
    import ctypes
    import errno as errno_
    from datanode.store import files

    def refuse(fd, pos, n, flags):
        ctypes.set_errno(errno_.EINVAL)
        return -1
    monkeypatch.setattr(files, "_sync_file_range", refuse)
    s = ExtentStore(tmp_path / "live", sync="always", options=StoreOptions(one_flush=True))
    eid = s.create_extent()
    data = rng.randbytes(20 * 4096)
    with caplog.at_level(logging.WARNING, logger="datanode.store"):
        for off in range(0, len(data), 4096):
            s.write(eid, off, data[off:off + 4096])
    assert s.one_flushes == 0
    assert caplog.text.count("sync_file_range refused") == 1
    crash_copy(tmp_path / "live", tmp_path / "crashed")
    s.close()
    r = ExtentStore(tmp_path / "crashed", sync="always")
    assert read(r, eid, 0, len(data)) == data
    r.close()


def test_corruption_after_a_completed_flush_is_kept_and_reported_not_cut(tmp_path, rng):
    """The slots only ever set aside a flush that can have been cut short.  A bad block after a flush that
    completed (a bit flip on the medium) stays the extent's, reported as bad -- cutting it would drop
    acknowledged bytes that the other replicas still hold and repair can restore."""
    s = ExtentStore(tmp_path / "live", sync="always")
    eid = s.create_extent()
    data = rng.randbytes(3 * BLOCK + 500)
    pos = 0
    while pos < len(data):
        n = min(4096, len(data) - pos)
        s.write(eid, pos, data[pos:pos + n])
        pos += n
    crashed = tmp_path / "crashed"
    crash_copy(tmp_path / "live", crashed)
    s.close()
    flip(paths(crashed, eid)[0], 3 * BLOCK + 100)     # in the last flush's block
    r = ExtentStore(crashed, sync="always")
    assert r.size(eid) == len(data)
    assert r.stats()["bad_blocks"] == 1
    expect("crc", read, r, eid, 3 * BLOCK, 500)
    assert read(r, eid, 0, 3 * BLOCK) == data[:3 * BLOCK]
    r.close()


def test_sync_none_appends_after_sync_always_are_not_undone_by_its_slots(tmp_path, rng):
    """A store that ran sync=always leaves tail slots behind; reopened sync=none, its appends write CRC
    entries only, so the first of them removes the slots -- else the next open would believe the old slot
    and cut every later append, which a kill -9 under sync=none must keep."""
    s = ExtentStore(tmp_path / "a", sync="always")
    eid = s.create_extent()
    data = rng.randbytes(BLOCK + 9000)
    s.write(eid, 0, data[:5000])
    s.write(eid, 5000, data[5000:9000])
    crash_copy(tmp_path / "a", tmp_path / "b")     # as kill -9 leaves it
    s.close()
    r = ExtentStore(tmp_path / "b", sync="none")
    r.write(eid, 9000, data[9000:])
    crash_copy(tmp_path / "b", tmp_path / "c")
    r.close()
    r2 = ExtentStore(tmp_path / "c", sync="always")
    assert r2.size(eid) == len(data) and read(r2, eid, 0, len(data)) == data
    r2.close()


# ----------------------------------------------------------------------------------------------- real crash
CHILD = textwrap.dedent("""
    import os, random, sys
    from wire.crc import crc32c
    from datanode.store import ExtentStore
    root, seed, sync, total = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    stream = lambda e: random.Random(seed * 1000 + e).randbytes(total)
    s = ExtentStore(root, sync=sync)
    active = {e: stream(e) for e, size in s.watermarks().items() if size < total}
    rng = random.Random(os.getpid())
    print("ready", flush=True)
    while True:
        while len(active) < 2:                 # two extents being filled; a full one is replaced
            e = s.create_extent()
            print("created", e, flush=True)
            active[e] = stream(e)
        e = rng.choice(sorted(active))
        size = s.size(e)
        n = min(total - size, rng.choice([1, 100, 4096, 65536, 131072, 200000, 1 << 20, rng.randrange(1, 600000)]))
        chunk = memoryview(active[e])[size:size + n]
        s.write(e, size, chunk, rng.choice([None, crc32c(chunk)]))
        print("acked", e, size + n, flush=True)
        if size + n == total:
            del active[e]
""")


@pytest.mark.parametrize("sync", ["always", "none"])
def test_kill9_crash_recovery(tmp_path, sync):
    """SIGKILL a writer at a random moment; every acknowledged byte (and extent) must survive."""
    root = tmp_path / "store"
    seed, total = 7, 3 << 20
    done = set()
    rng = random.Random(99 if sync == "always" else 98)
    env = dict(os.environ, PYTHONPATH=REPO)
    acked: dict[int, int] = {}
    for _ in range(5):
        p = subprocess.Popen([sys.executable, "-c", CHILD, str(root), str(seed), sync, str(total)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=REPO)
        assert p.stdout.readline() == b"ready\n", p.stderr.read()
        time.sleep(rng.uniform(0.01, 0.4))
        p.send_signal(signal.SIGKILL)
        out, err = p.communicate(timeout=30)
        assert p.returncode == -signal.SIGKILL, err
        for line in out.split(b"\n")[:-1]:          # the last piece may be an unterminated line
            f = line.split()
            if f[:1] not in ([b"acked"], [b"created"]) or len(f) != (3 if f[0] == b"acked" else 2):
                continue                              # a line the kill cut (seen once in a loaded run)
            e = int(f[1])
            acked[e] = max(acked.get(e, 0), int(f[2]) if f[0] == b"acked" else 0)
        s = ExtentStore(root, sync=sync)
        marks = s.watermarks()
        assert set(acked) <= set(marks)
        for e, size in marks.items():
            assert size >= acked.get(e, 0), (e, size, acked.get(e))
            assert paths(root, e)[0].stat().st_size == size
            if e in done:                          # full and verified in an earlier round
                assert size == total
                continue
            want = random.Random(seed * 1000 + e).randbytes(total)
            assert read(s, e, 0, size) == want[:size]
            if size == total:
                done.add(e)
        assert s.stats()["bad_blocks"] == 0
        s.close()
    assert sum(acked.values()) > 0


def test_small_durable_appends_overwrite_zeros_written_ahead_and_a_crash_keeps_every_acked_byte(
        tmp_path, rng, caplog):
    """sync=always: a small append also writes zeros up to the next prefill_bytes boundary, so the appends that
    follow land inside the file and their fdatasync has no size to commit (the file does not grow per
    write).  A crash (the files as a SIGKILL leaves them) loses no acknowledged byte, the zeros past the
    end are cut at the next open without a torn-tail warning, and a clean close leaves no zeros behind."""
    prefill = StoreOptions().prefill_bytes
    root = tmp_path / "live"
    s = ExtentStore(root, sync="always")
    eid = s.create_extent()
    data = rng.randbytes(40 * 4096 + 123)
    s.write(eid, 0, data[:4096])
    dat, crc = paths(root, eid)
    assert dat.stat().st_size == prefill and crc.stat().st_size == SLOTS_END   # entries a page ahead, slots
    for off in range(4096, len(data), 4096):
        s.write(eid, off, data[off:off + 4096])
        assert dat.stat().st_size == prefill          # overwrote zeros: the file never grew
    assert s.one_flushes == (40 if has_sync_file_range() else 0)  # 41 flushes, all but the first: one fdatasync
    assert read(s, eid, 0, len(data)) == data
    crashed = tmp_path / "crashed"                    # the files as they are now, the store still open
    crash_copy(root, crashed)
    with caplog.at_level(logging.INFO, logger="datanode.store"):
        s2 = ExtentStore(crashed, sync="always")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert s2.size(eid) == len(data) and read(s2, eid, 0, len(data)) == data
    assert paths(crashed, eid)[0].stat().st_size == len(data)
    s2.write(eid, len(data), b"after")
    assert read(s2, eid, 0, len(data) + 5) == data + b"after"
    s2.close()
    s.close()                                         # a clean close gives the zeros back
    assert dat.stat().st_size == len(data) and crc.stat().st_size == 8 * (len(data) // BLOCK + 1)


def test_a_small_append_that_fits_is_taken_when_the_zeros_ahead_do_not(tmp_path, rng):
    """On a nearly full disk the zeros written ahead are given up, not the append."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True, text=True,
                       check=False)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        s = ExtentStore(mnt / "store", sync="always")
        eid = s.create_extent()
        st = os.statvfs(mnt)
        free = st.f_bavail * st.f_frsize
        with open(mnt / "filler", "wb") as f:         # leave 64 KiB: room for the data, not the zeros
            f.write(bytes(free - 64 * 1024))
        data = rng.randbytes(8192)
        assert 64 * 1024 < StoreOptions().prefill_bytes
        s.write(eid, 0, data)
        s.write(eid, 8192, data)
        assert read(s, eid, 0, 16384) == data + data
        s.close()
        s = ExtentStore(mnt / "store", sync="always")
        assert read(s, eid, 0, 16384) == data + data
        s.close()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


# ----------------------------------------------------------------------------------------------- lifecycle
def test_mark_delete(tmp_path, rng):
    s = ExtentStore(tmp_path)
    a, b = s.create_extent(), s.create_extent()
    s.write(a, 0, b"hello")
    s.write(b, 0, b"world")
    s.mark_delete(a)
    for fn, args in [(s.size, (a,)), (s.write, (a, 5, b"x")), (s.block_crcs, (a,)),
                     (s.read_into, (a, 0, 1, memoryview(bytearray(1)))), (s.mark_delete, (a,)),
                     (s.truncate, (a, 0))]:
        expect("not_found", fn, *args)
    assert s.watermarks() == {b: 5}
    assert not paths(tmp_path, a)[0].exists() and not paths(tmp_path, a)[1].exists()
    expect("deleted", s.create_extent, a)
    s.close()
    s = ExtentStore(tmp_path)
    assert s.watermarks() == {b: 5}
    expect("not_found", s.size, a)
    expect("deleted", s.create_extent, a)
    assert s.create_extent() == b + 1
    assert s.stats()["extents"] == 2
    s.close()


def _io_spy(monkeypatch):
    """Every ftruncate and fsync of the process, in order (they still happen: the spy only records them)."""
    seen = []
    real_trunc, real_fsync = os.ftruncate, os.fsync

    def ftruncate(fd, size):
        seen.append(("truncate", fd, size))
        return real_trunc(fd, size)

    def fsync(fd):
        seen.append(("fsync", fd))
        return real_fsync(fd)
    monkeypatch.setattr(os, "ftruncate", ftruncate)
    monkeypatch.setattr(os, "fsync", fsync)
    return seen


def _freed_in_steps(seen, start: int, step: int, end: int = 0) -> None:
    """The truncations in ``seen`` took a file of ``start`` bytes to ``end``, at most ``step`` bytes at a time,
    and each was made durable (fsync of the same file) before the next began."""
    runs, run = [], []            # each file's truncations, ending with the one to ``end``: the longest is ours
    for i, (what, fd, *rest) in enumerate(seen):          # (others: a small file, the CRC file, recovery's cut)
        if what == "truncate":
            run = (run if run and run[-1][1] == fd else []) + [(i, fd, rest[0])]
            if rest[0] == end:
                runs.append(run)
                run = []
    cuts = max(runs, key=len)
    assert [size for _, _, size in cuts] == list(range(start - step, end, -step)) + [end], cuts
    for (i, fd, _), nxt in zip(cuts, [c[0] for c in cuts[1:]] + [len(seen)]):
        assert ("fsync", fd) in seen[i + 1:nxt], f"truncation #{i} not made durable before the next"


def test_a_deleted_big_extent_is_freed_in_steps_each_made_durable(tmp_path, monkeypatch, rng):
    """A discard-mounted disk discards what a journal commit freed while every other writer's fdatasync waits
    (the store's free_step_bytes): an extent is freed at most a step per commit, and ends empty."""
    step = 256 << 10
    s = ExtentStore(tmp_path, sync="always", options=StoreOptions(free_step_bytes=step))
    a, b = s.create_extent(), s.create_extent()
    append_random(s, a, rng.randbytes(4 * step + 5000), rng)
    s.write(b, 0, b"small")
    start = paths(tmp_path, a)[0].stat().st_size       # (sync=always writes zeros ahead: a little more)
    assert start > 4 * step
    seen = _io_spy(monkeypatch)
    s.mark_delete(a)
    tomb = tmp_path / "extents" / f"{a}.deleted"
    assert tomb.stat().st_size == 0 and tomb.stat().st_blocks == 0
    _freed_in_steps(seen, start, step)
    expect("not_found", s.size, a)
    del seen[:]
    s.mark_delete(b)                              # a file of at most a step: one truncation, as before
    assert [e for e in seen if e[0] == "truncate"] == [("truncate", seen[0][1], 0)]
    assert s.watermarks() == {}
    s.close()


def test_a_tombstone_still_holding_data_is_emptied_at_open(tmp_path, monkeypatch, rng):
    """A crash while a delete freed the extent in steps leaves its tombstone holding the rest: the next open
    frees it (in steps too) instead of keeping the space for good."""
    step = 256 << 10
    s = ExtentStore(tmp_path, sync="always")
    a, b = s.create_extent(), s.create_extent()
    append_random(s, a, rng.randbytes(3 * step), rng)
    keep = rng.randbytes(1000)
    append_random(s, b, keep, rng)
    s.close()
    dat, crc = paths(tmp_path, a)
    tomb = tmp_path / "extents" / f"{a}.deleted"
    os.replace(dat, tomb)                         # mark_delete's first step, then the crash: two steps freed
    os.truncate(tomb, 2 * step)
    crc.unlink()
    seen = _io_spy(monkeypatch)
    s = ExtentStore(tmp_path, sync="always", options=StoreOptions(free_step_bytes=step))
    assert tomb.stat().st_size == 0 and tomb.stat().st_blocks == 0
    _freed_in_steps(seen, 2 * step, step)
    expect("not_found", s.size, a)
    expect("deleted", s.create_extent, a)
    assert read(s, b, 0, 1000) == keep
    s.close()


def test_a_tombstone_that_is_not_a_regular_file_is_left_alone_at_open(tmp_path, rng):
    """Only a regular file's data is freed at open: a tombstone someone replaced by a symlink is never
    followed (the file it names keeps its bytes), and the store still opens."""
    s = ExtentStore(tmp_path, sync="always")
    a, b = s.create_extent(), s.create_extent()
    keep = rng.randbytes(5000)
    append_random(s, b, keep, rng)
    s.mark_delete(a)
    s.close()
    outside = tmp_path / "precious"
    outside.write_bytes(b"y" * 70000)
    tomb = tmp_path / "extents" / f"{a}.deleted"
    tomb.unlink()
    tomb.symlink_to(outside)
    s = ExtentStore(tmp_path, sync="always")
    assert outside.read_bytes() == b"y" * 70000
    expect("deleted", s.create_extent, a)
    assert read(s, b, 0, 5000) == keep
    s.close()


def test_a_truncate_that_cuts_much_frees_it_in_steps(tmp_path, monkeypatch, rng):
    """A repair may cut a follower's extent back by up to 128 MiB (``truncate``): the data file loses at most
    a step per commit too, and what is kept reads back."""
    step = 256 << 10
    s = ExtentStore(tmp_path, sync="always", options=StoreOptions(free_step_bytes=step))
    a = s.create_extent()
    data = rng.randbytes(3 * step + 999)
    append_random(s, a, data, rng)
    start = paths(tmp_path, a)[0].stat().st_size
    seen = _io_spy(monkeypatch)
    s.truncate(a, 1000)
    _freed_in_steps(seen, start, step, end=1000)
    assert s.size(a) == 1000 and read(s, a, 0, 1000) == data[:1000]
    s.close()
    s = ExtentStore(tmp_path, sync="always")
    assert s.size(a) == 1000 and read(s, a, 0, 1000) == data[:1000]
    s.close()


def test_a_trash_purge_frees_big_files_in_steps_and_never_follows_a_link(tmp_path, monkeypatch, rng):
    """``partition.remove_tree`` (a trash entry's purge): the entry's big files are emptied in steps before
    the tree goes, and a symlink in it is removed, never followed (the file it names keeps its bytes)."""
    from datanode import partition
    step = 256 << 10
    entry = tmp_path / "trash" / "7.1700000000000000000"
    (entry / "store" / "extents").mkdir(parents=True)
    big = entry / "store" / "extents" / "3.dat"
    big.write_bytes(rng.randbytes(3 * step + 77))
    (entry / "meta.json").write_text("{}")
    outside = tmp_path / "precious"
    outside.write_bytes(b"x" * (2 * step))
    (entry / "store" / "extents" / "9.dat").symlink_to(outside)
    seen = _io_spy(monkeypatch)
    partition.remove_tree(entry, step)
    assert not entry.exists()
    _freed_in_steps(seen, 3 * step + 77, step)
    assert outside.read_bytes() == b"x" * (2 * step)


def test_create_ids_monotonic_after_reopen(tmp_path):
    s = ExtentStore(tmp_path)
    ids = [s.create_extent() for _ in range(3)]
    assert ids == [1, 2, 3]
    s.mark_delete(3)
    s.close()
    s = ExtentStore(tmp_path)
    assert s.create_extent() == 4
    s.mark_delete(4)
    assert s.create_extent(10) == 10
    expect("exists", s.create_extent, 10)
    assert s.create_extent(7) == 7                # explicit lower free id is allowed (leader-assigned)
    s.close()
    (tmp_path / "extents" / "10.dat").unlink()    # even if the highest extent vanished
    (tmp_path / "extents" / "10.crc").unlink()
    s = ExtentStore(tmp_path)
    assert s.create_extent() == 11                # ... the persisted counter keeps ids unique
    s.close()
    (tmp_path / "next_extent_id").unlink()        # and without the counter, tombstones/files still do
    s = ExtentStore(tmp_path)
    assert s.create_extent() == 12
    s.close()


def test_truncate(tmp_path, rng):
    data = rng.randbytes(3 * BLOCK + 500)
    s = ExtentStore(tmp_path)
    eid = s.create_extent()
    append_random(s, eid, data, rng)
    expect("out_of_range", s.truncate, eid, len(data) + 1)
    s.truncate(eid, len(data))
    s.truncate(eid, 2 * BLOCK + 100)
    assert s.size(eid) == 2 * BLOCK + 100
    expect("out_of_range", s.read_into, eid, 2 * BLOCK, 101, memoryview(bytearray(101)))
    assert read(s, eid, 0, 2 * BLOCK + 100) == data[:2 * BLOCK + 100]
    assert s.block_crcs(eid)[-1] == ORACLE(data[2 * BLOCK:2 * BLOCK + 100])
    s.truncate(eid, 2 * BLOCK)
    assert len(s.block_crcs(eid)) == 2
    more = rng.randbytes(BLOCK + 7)
    s.write(eid, 2 * BLOCK, more)
    s.close()
    s = ExtentStore(tmp_path)
    assert s.size(eid) == 3 * BLOCK + 7
    assert read(s, eid, 0, 3 * BLOCK + 7) == data[:2 * BLOCK] + more
    s.truncate(eid, 0)
    assert s.size(eid) == 0 and s.block_crcs(eid) == []
    s.close()
    s = ExtentStore(tmp_path)
    assert s.size(eid) == 0
    s.close()


def test_truncate_into_bad_block_refused(tmp_path, rng):
    data = rng.randbytes(2 * BLOCK)
    s = ExtentStore(tmp_path)
    eid = s.create_extent()
    s.write(eid, 0, data)
    flip(paths(tmp_path, eid)[0], BLOCK + 10)
    expect("crc", s.truncate, eid, BLOCK + 100)    # would launder the flipped byte into a fresh CRC
    assert s.size(eid) == 2 * BLOCK
    s.truncate(eid, BLOCK)
    assert read(s, eid, 0, BLOCK) == data[:BLOCK]
    s.close()


def test_concurrent_extents(tmp_path):
    s = ExtentStore(tmp_path, sync="none")
    ids = [s.create_extent() for _ in range(4)]
    datas = {e: os.urandom(2 << 20) for e in ids}
    errors = []

    def writer(e):
        try:
            r = random.Random(e)
            append_random(s, e, datas[e], r)
        except Exception as ex:  # pragma: no cover
            errors.append(ex)

    def reader(e):
        try:
            r = random.Random(e + 100)
            deadline = time.monotonic() + 0.5
            while time.monotonic() < deadline:
                size = s.size(e)
                if size:
                    off = r.randrange(size)
                    n = r.randrange(size - off + 1)
                    assert read(s, e, off, n) == datas[e][off:off + n]
        except Exception as ex:  # pragma: no cover
            errors.append(ex)

    ts = [threading.Thread(target=f, args=(e,)) for e in ids for f in (writer, reader)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors
    assert s.watermarks() == {e: 2 << 20 for e in ids}
    st = s.stats()
    assert st["extents"] == 4 and st["bytes"] == 4 * (2 << 20) and st["sync"] == "none"
    s.close()


def test_nowait_read_serves_cached_bytes_and_never_blocks(tmp_path):
    """``read_into(nowait=True)`` (the event loop's read) returns the same verified bytes as a normal read
    when they are in the page cache, and raises WouldBlock instead of waiting while a truncate holds the
    extent."""
    from datanode.store import WouldBlock
    st = ExtentStore(tmp_path / "p", "always")
    eid = st.create_extent()
    data = os.urandom(300 * 1024 + 5)
    st.write(eid, 0, data)
    for off, n in [(0, len(data)), (7, 4096), (128 * 1024 - 3, 10)]:
        a, b = bytearray(n), bytearray(n)
        assert st.read_into(eid, off, n, memoryview(a), nowait=True) == st.read_into(eid, off, n, memoryview(b))
        assert bytes(a) == bytes(b) == data[off:off + n]
    ext = st._get(eid)
    ext.begin_exclusive()            # what truncate/delete hold while they change the extent
    try:
        with pytest.raises(WouldBlock):
            st.read_into(eid, 0, 10, memoryview(bytearray(10)), nowait=True)
    finally:
        ext.end_exclusive()
    st.close()


@pytest.mark.parametrize("sync", ["none", "always"])
def test_append_with_the_callers_piece_crcs_stores_the_same_crcs(tmp_path, rng, sync):
    """The request path checks a payload's CRC with ``piece_crcs`` (one pass) and hands the pieces to
    ``append``: the CRC file and every read back are the same as when the store reads the bytes itself, also
    across reopen, for appends that start mid-block and cross block boundaries."""
    from datanode.store import piece_crcs
    sizes = [1, 4095, BLOCK - 1, BLOCK + 1, 3 * BLOCK + 5, 77, 2 * BLOCK]
    data = [rng.randbytes(n) for n in sizes]
    stores = {}
    for way in ("pieces", "plain"):
        s = ExtentStore(tmp_path / way, sync=sync)
        eid = s.create_extent()
        pos = 0
        for d in data:
            if way == "pieces":
                pieces, whole = piece_crcs(pos, d)
                assert whole == ORACLE(d)
                pos = s.append(eid, pos, d, None, pieces)
            else:
                pos = s.append(eid, pos, d, ORACLE(d))
        s.flush([eid])
        s.close()
        stores[way] = eid
    assert entries(tmp_path / "pieces", stores["pieces"]) == entries(tmp_path / "plain", stores["plain"])
    s = ExtentStore(tmp_path / "pieces", sync=sync)
    assert read(s, stores["pieces"], 0, sum(sizes)) == b"".join(data)
    # pieces cut for another offset do not fit this append: refused, nothing written
    end = s.size(stores["pieces"])
    with pytest.raises(ValueError):
        s.append(stores["pieces"], end, data[3], None, piece_crcs(end + 1, data[3])[0][:-1])
    assert s.size(stores["pieces"]) == end
    s.close()


# ----------------------------------------------------------------------------------- cold reads (O_DIRECT)
def evict(path):
    """Drop ``path``'s pages from the page cache (written back first): the next read goes to the disk.  Only
    this file's pages, so no root is needed and nobody else's cache is touched."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def cached(path, off, n):
    """Pages of ``path``'s range the page cache holds (cachestat), or None where the kernel cannot say."""
    from datanode.store import cached_pages
    fd = os.open(path, os.O_RDONLY)
    try:
        return cached_pages(fd, off, n)
    finally:
        os.close(fd)


def aligned(n):
    import mmap
    return memoryview(mmap.mmap(-1, n))       # page-aligned, like the node's pool blocks


def test_cold_read_returns_the_bytes_whichever_way_it_reads(tmp_path, rng):
    """A range not in the page cache is read around it (O_DIRECT into the caller's aligned buffer) and comes
    back byte for byte, CRC-checked; unaligned buffers, unaligned ranges, a partial last block and a range
    partly in the page cache take the page cache instead and return the same bytes."""
    s = ExtentStore(tmp_path, sync="none")
    eid = s.create_extent()
    data = rng.randbytes(2 * MiB_ + 1000)
    s.write(eid, 0, data)
    dat = paths(tmp_path, eid)[0]

    def check(off, n, buf):
        c = s.read_into(eid, off, n, buf)
        assert bytes(buf[:n]) == data[off:off + n]
        assert c == ORACLE(data[off:off + n])

    evict(dat)
    check(0, 2 * MiB_, aligned(2 * MiB_))                   # aligned: O_DIRECT ...
    if cached(dat, 0, 2 * MiB_) is not None:
        assert cached(dat, 0, 2 * MiB_) == 0                  # ... so the page cache still holds none of it
    check(BLOCK + 4096, 512 * 1024, aligned(512 * 1024))    # a block's head (4 KiB) goes to scratch, aligned too
    check(MiB_, MiB_ + 1000, aligned(2 * MiB_))             # reaches the partial last block: via the page cache
    evict(dat)
    raw = bytearray(MiB_ + 1)
    check(0, MiB_, memoryview(raw)[1:])                     # an unaligned buffer: via the page cache
    evict(dat)
    check(0, 64 * 1024, aligned(64 * 1024))                 # a small read: via the page cache ...
    check(0, MiB_, aligned(MiB_))                           # ... so this range is partly cached: the same
    s.close()


def test_cold_read_of_a_flipped_bit_is_a_crc_error(tmp_path, rng):
    """A bit flipped on the disk is refused on the O_DIRECT path as on the page-cache path, and the caller's
    buffer gets no unverified bytes; the untouched blocks of the same extent still read."""
    s = ExtentStore(tmp_path, sync="none")
    eid = s.create_extent()
    data = rng.randbytes(2 * MiB_)
    s.write(eid, 0, data)
    dat = paths(tmp_path, eid)[0]
    evict(dat)
    flip(dat, MiB_ + 5)                                     # block 8
    evict(dat)
    buf = aligned(MiB_)
    buf[:] = b"\xaa" * MiB_
    e = expect("crc", s.read_into, eid, MiB_, MiB_, buf)
    assert f"block {MiB_ // BLOCK}" in str(e)
    assert bytes(buf) == bytes(MiB_)
    evict(dat)
    assert s.read_into(eid, 0, MiB_, buf) == ORACLE(data[:MiB_]) and bytes(buf) == data[:MiB_]
    s.close()


@pytest.mark.parametrize("sync", ["always", "none"])
def test_big_aligned_appends_go_around_the_page_cache_and_keep_every_byte(tmp_path, rng, sync):
    """A big append from an aligned buffer (the node's pool) at an aligned offset is written with O_DIRECT:
    none of it lands in the page cache.  Mixed with small buffered appends -- under sync=always one that
    wrote zeros ahead into the range the direct write then covers -- every byte reads back, after a reopen
    and after a crash (the files as a kill -9 leaves them) too, with no bad block."""
    root = tmp_path / "store"
    s = ExtentStore(root, sync=sync)
    eid = s.create_extent()
    big = aligned(MiB_)
    big[:] = rng.randbytes(MiB_)
    parts = [rng.randbytes(4096), bytes(big), rng.randbytes(1000), bytes(big)]
    off = 0
    for i, p in enumerate(parts):
        s.write(eid, off, big if i == 1 else p)      # the 1 MiB at 4096: aligned; the last one at 4096+1 MiB+1000: not
        off += len(p)
    data = b"".join(parts)
    assert s.direct_writes == 1
    dat = paths(root, eid)[0]
    if cached(dat, 4096, MiB_) is not None:
        assert cached(dat, 4096, MiB_) == 0
    assert read(s, eid, 0, len(data)) == data
    crash_copy(root, tmp_path / "crash")
    s.close()
    for where in (tmp_path / "crash", root):
        t = ExtentStore(where, sync=sync)
        assert t.size(eid) == len(data)
        assert read(t, eid, 0, len(data)) == data
        assert t.stats()["bad_blocks"] == 0
        t.close()


def test_direct_writes_off_write_through_the_page_cache(tmp_path, rng):
    """direct_writes = false: a big aligned append lands in the page cache."""
    s = ExtentStore(tmp_path, sync="none", options=StoreOptions(direct_writes=False))
    eid = s.create_extent()
    big = aligned(MiB_)
    big[:] = rng.randbytes(MiB_)
    s.write(eid, 0, big)
    assert s.direct_writes == 0
    n = cached(paths(tmp_path, eid)[0], 0, MiB_)
    if n is not None:
        assert n == MiB_ // 4096
    assert read(s, eid, 0, MiB_) == bytes(big)
    s.close()


def test_direct_reads_off_reads_through_the_page_cache(tmp_path, rng):
    """direct_reads = false: a cold read fills the page cache, as before."""
    s = ExtentStore(tmp_path, sync="none", options=StoreOptions(direct_reads=False))
    eid = s.create_extent()
    data = rng.randbytes(MiB_)
    s.write(eid, 0, data)
    dat = paths(tmp_path, eid)[0]
    evict(dat)
    buf = aligned(MiB_)
    s.read_into(eid, 0, MiB_, buf)
    assert bytes(buf) == data
    if cached(dat, 0, MiB_) is not None:
        assert cached(dat, 0, MiB_) == MiB_ // 4096
    s.close()


def test_page_cache_probe_is_safe_from_many_threads_on_a_kernel_without_cachestat(tmp_path, monkeypatch):
    """The node's reader threads all probe the page cache; on a kernel without cachestat(2) (before 6.5, as
    in the Soft-RoCE VM) the first to learn so turns the probe off -- and no other thread, mid-probe, fails
    for it (a READ once got ERROR so: one thread saw the probe turned off under it)."""
    from datanode.store import direct as store
    monkeypatch.setattr(store, "_NR_CACHESTAT", 1023)        # no such syscall: ENOSYS, as on an older kernel
    real_range = store._CachestatRange

    def slow_range(*a):                  # widen the window between the probe's checks and its syscall
        time.sleep(0.0005)
        return real_range(*a)
    monkeypatch.setattr(store, "_CachestatRange", slow_range)
    path = tmp_path / "f"
    path.write_bytes(bytes(65536))
    fd = os.open(path, os.O_RDONLY)
    errors = []
    try:
        for _ in range(20):
            monkeypatch.setattr(store, "_libc", None)         # a fresh process: nobody knows yet
            go = threading.Barrier(8)

            def probe():
                go.wait()
                try:
                    for _ in range(4):
                        assert store.cached_pages(fd, 0, 65536) is None
                except Exception as e:               # noqa: BLE001 -- any failure is the test's finding
                    errors.append(e)

            threads = [threading.Thread(target=probe) for _ in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    finally:
        os.close(fd)
    assert not errors, errors[:3]
    assert store._libc is False
