"""dnfs keeps small files' bytes inline in its SQLite metadata (``--inline-kib``): what a user sees is the same
as with every byte in extents -- contents, crashes of the mount, fsync, overwrites, truncates, growth past the
limit, fsck -- and no extent is written or reclaimed for such files."""
from __future__ import annotations

import io
import json
import os
import signal
import sqlite3
import subprocess
import tarfile
import time

import pytest

from tests.conftest import pattern
from tests.test_dnfs import Mount, assert_reclaimed, cluster  # noqa: F401 - the module's cluster fixture

INLINE = 64 << 10
SIZES = [0, 1, 100, 4095, 4096, 30000, INLINE - 1, INLINE, INLINE + 1, 200 << 10, (1 << 20) + 7]


def rows(m: Mount, path: str) -> list[tuple]:
    """(off, len, pid, extent, inline?) of a file's slices, straight from the database."""
    db = sqlite3.connect(f"file:{m.db}?mode=ro", uri=True)
    try:
        ino = 1
        for part in path.split("/"):
            ino = db.execute("SELECT ino FROM dentries WHERE parent=? AND name=?", (ino, part.encode())).fetchone()[0]
        return db.execute("SELECT off, len, pid, extent, data IS NOT NULL FROM slices WHERE ino=? ORDER BY off",
                          (ino,)).fetchall()
    finally:
        db.close()


def delq(m: Mount) -> list[tuple]:
    db = sqlite3.connect(f"file:{m.db}?mode=ro", uri=True)
    try:
        return db.execute("SELECT pid, extent FROM delq").fetchall()
    finally:
        db.close()


@pytest.fixture
def mnt(cluster, tmp_path):  # noqa: F811
    m = Mount(cluster, tmp_path).mount()
    yield m
    m.cleanup()


def test_an_untarred_tree_of_small_files_survives_a_killed_mount_and_takes_no_extents(mnt, tmp_path):
    files = {f"tree/d{i % 7}/f{i:03d}": pattern(i, SIZES[i % len(SIZES)]) for i in range(60)}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o640, 1_000_000_000
            t.addfile(info, io.BytesIO(data))
    (tmp_path / "t.tar").write_bytes(buf.getvalue())
    subprocess.run(["tar", "xf", str(tmp_path / "t.tar"), "-C", str(mnt.path)], check=True)
    for name, data in files.items():
        r = rows(mnt, name)
        assert all(inline for *_, inline in r) == (len(data) <= INLINE), (name, len(data), r)
        assert all(pid == 0 for pid, *_ in (x[2:] for x in r if x[4])), r
    os.kill(mnt.pid, signal.SIGKILL)              # every close returned: nothing may be lost
    time.sleep(0.5)
    mnt.umount()                                  # clears the dead mount
    r = mnt.fsck()
    assert "clean" in r.stdout, r.stdout
    mnt.mount()
    for name, data in files.items():
        p = mnt.path / name
        assert p.read_bytes() == data, name
        st = p.stat()
        assert st.st_size == len(data) and st.st_mode & 0o777 == 0o640 and st.st_mtime == 1_000_000_000


def test_an_inline_file_overwritten_truncated_and_grown_past_the_limit_reads_as_written(mnt):
    p = mnt.path / "f"
    model = bytearray(pattern(1, 10_000))
    p.write_bytes(model)
    assert [x[4] for x in rows(mnt, "f")] == [1]
    with open(p, "r+b") as f:                     # overwrite the middle, durably
        f.seek(3000)
        f.write(pattern(2, 500))
        f.flush()
        os.fsync(f.fileno())
    model[3000:3500] = pattern(2, 500)
    assert p.read_bytes() == model
    os.truncate(p, 2000)                          # cut (an inline slice cut keeps only its bytes)
    del model[2000:]
    assert p.read_bytes() == model
    os.truncate(p, 5000)                          # a hole reads as zeros
    model += bytes(3000)
    assert p.read_bytes() == model
    with open(p, "ab") as f:                      # past the limit: the new bytes go to the datanodes
        f.write(pattern(3, 300 << 10))
    model += pattern(3, 300 << 10)
    r = rows(mnt, "f")
    assert any(x[4] for x in r) and any(not x[4] for x in r), r
    assert p.read_bytes() == model
    with open(p, "rb") as f:                      # a read across the inline part and the extent
        f.seek(4000)
        assert f.read(10_000) == model[4000:14_000]
    mnt.umount()
    r = mnt.fsck()
    assert "clean" in r.stdout, r.stdout
    mnt.mount()
    assert p.read_bytes() == model
    assert (0, 0) not in delq(mnt)                # inline slices never queue an extent


def test_removing_small_files_frees_their_rows_and_queues_no_extent(mnt):
    for i in range(20):
        (mnt.path / f"s{i}").write_bytes(pattern(i, 100 * i))
    big = pattern(99, 2 << 20)
    (mnt.path / "big").write_bytes(big)
    extents = {(pid, e) for _, _, pid, e, inline in rows(mnt, "big") if not inline}
    for i in range(20):
        os.unlink(mnt.path / f"s{i}")
    os.unlink(mnt.path / "big")
    assert (0, 0) not in delq(mnt)
    assert_reclaimed(mnt, extents)                # the big file's extents are reclaimed as before
    mnt.umount()
    report = json.loads(mnt.fsck("--json").stdout)
    assert report["problems"] == [] and report["slices"] == 0, report
    mnt.mount()


def test_fsync_of_an_inline_file_leaves_it_on_the_disk(mnt):
    from tests.conftest import dirty_pages
    wal = str(mnt.db) + "-wal"
    with open(mnt.path / "s", "wb") as f:
        f.write(pattern(7, 3000))
        f.flush()
        os.fsync(f.fileno())
        if dirty_pages(wal) is None:
            pytest.skip("no cachestat system call on this kernel: the page cache's dirty state is not visible")
        assert dirty_pages(wal) == 0
    assert rows(mnt, "s")[0][4] == 1


def test_inline_kib_0_keeps_every_byte_in_extents(cluster, tmp_path):  # noqa: F811
    m = Mount(cluster, tmp_path).mount("--inline-kib", "0")
    try:
        (m.path / "tiny").write_bytes(b"hello")
        r = rows(m, "tiny")
        assert len(r) == 1 and not r[0][4] and r[0][2] != 0, r
        assert (m.path / "tiny").read_bytes() == b"hello"
    finally:
        m.cleanup()


def test_a_database_from_before_inline_slices_is_upgraded(cluster, tmp_path):  # noqa: F811
    m = Mount(cluster, tmp_path)
    db = sqlite3.connect(m.db)
    db.execute("CREATE TABLE slices (ino INT, off INT, len INT, pid INT, extent INT, ext_off INT, wpos INT, "
               "wlen INT, crc INT, PRIMARY KEY (ino, off)) WITHOUT ROWID")
    db.close()
    m.mount()
    try:
        (m.path / "small").write_bytes(b"x" * 1000)
        (m.path / "large").write_bytes(pattern(5, 100 << 10))
        m.umount()
        m.mount()
        assert (m.path / "small").read_bytes() == b"x" * 1000
        assert (m.path / "large").read_bytes() == pattern(5, 100 << 10)
    finally:
        m.cleanup()
