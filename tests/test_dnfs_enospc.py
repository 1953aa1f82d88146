"""A write-back that fails for good, through a real mount: the datanode's disk (a small tmpfs: needs root)
fills up under a writer.  The error reaches the writer by close at the latest, and afterwards the file's
size is exactly what reads back -- a prefix of what was written, byte for byte -- also through a fresh
mount."""
from __future__ import annotations

import errno
import os
import subprocess
import time

import pytest
import trio

from tests.conftest import create_partition, open_client, pattern
from tests.test_dnfs import Mount

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="no /dev/fuse")
MiB = 1 << 20
DISK_MIB = 24


@pytest.fixture
def full_soon(nodes, tmp_path):
    """A mounted 1-node cluster whose data directory is a DISK_MIB tmpfs."""
    disk = tmp_path / "disk"
    disk.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_MIB}m", "tmpfs", str(disk)],
                       capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        [n] = nodes(1, data_dir=str(disk / "data"))

        async def mk():
            async with open_client("tcp", [n.addr]) as dc:
                await create_partition(dc, 1, [n.addr])
        trio.run(mk)
        m = Mount([n.addr], tmp_path).mount("--write-retry", "3")
        try:
            yield m
        finally:
            m.cleanup()
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def _stream(path, total: int, piece: int) -> tuple[int, str, OSError | None, int | None, bytes]:
    """Write ``total`` bytes in ``piece``-sized writes, then fsync and close, stopping at the first error:
    (bytes the writes accepted, which call failed, the error, the size fstat said right then, everything
    written)."""
    data = pattern(7, total)
    ok, where, err, then = 0, "", None, None
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        while ok < total:
            ok += os.write(fd, data[ok:ok + piece])
        where = "fsync"
        os.fsync(fd)
    except OSError as e:
        where = where or "write"
        err, then = e, os.fstat(fd).st_size
    try:
        os.close(fd)
    except OSError as e:
        if err is None:
            where, err = "close", e
    return ok, where, err, then, data


def _exactly_what_is_stored(path, data: bytes) -> int:
    size = os.stat(path).st_size
    got = path.read_bytes()
    assert len(got) == size, (size, len(got))
    assert got == data[:size], "the file is not a prefix of what was written"
    return size


@pytest.mark.parametrize("piece", [MiB, 48 * MiB], ids=["streamed", "one-write"])
def test_enospc_reaches_the_writer_and_the_size_is_what_was_stored(full_soon, piece):
    """48 MiB into a 24 MiB disk, streamed 1 MiB at a time (as dd does) or in one write.  The failure of a
    flush behind the writer comes back on its next write or fsync.  The file then holds a prefix of the data
    -- every byte the datanode took, not just the flushes that went through whole -- and says so: its size,
    from the moment the error is reported, is the bytes that read back; a fresh mount sees the same."""
    m = full_soon
    f = m.path / "big"
    ok, where, err, then, data = _stream(f, 48 * MiB, piece)
    assert err is not None and err.errno == errno.ENOSPC, (where, err)
    assert where in ("write", "fsync"), (where, ok)         # (close finds it reported already)
    size = _exactly_what_is_stored(f, data)
    assert then == size and size <= ok
    assert (DISK_MIB - 3) * MiB <= size < DISK_MIB * MiB     # what the disk took is the file's
    m.umount()
    m.mount()
    assert _exactly_what_is_stored(f, data) == size
    os.unlink(f)                      # once the deletion queue gave the space back, writes go through again
    small = m.path / "small"
    deadline = time.monotonic() + 30
    while True:
        try:
            small.write_bytes(pattern(8, 64 << 10))
            break
        except OSError as e:
            assert e.errno == errno.ENOSPC and time.monotonic() < deadline, e
            time.sleep(0.5)
    assert small.read_bytes() == pattern(8, 64 << 10)
