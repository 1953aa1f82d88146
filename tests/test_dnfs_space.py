"""dnfs and the datanodes' disks: statfs reports what the datanodes report, a full cluster is ENOSPC.

Each datanode's data_dir is its own small tmpfs (needs root; skipped otherwise), so the figures are exact
and the disks fill quickly."""
from __future__ import annotations

import errno
import os
import subprocess

import pytest
import trio

from tests.conftest import create_partition, eventually, open_client, pattern
from tests.test_dnfs import Mount

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="no /dev/fuse")
MiB = 1 << 20
DISK_MIB = 40


@pytest.fixture
def small_disks(request, tmp_path):
    """Three tmpfs, DISK_MIB each (or the sizes the test names with indirect parametrization)."""
    sizes = getattr(request, "param", (DISK_MIB,) * 3)
    mnts = []
    for i, size in enumerate(sizes):
        m = tmp_path / f"disk{i}"
        m.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}m", "tmpfs", str(m)],
                           capture_output=True, text=True)
        if r.returncode:
            for x in mnts:
                subprocess.run(["umount", "-l", str(x)], check=False)
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
        mnts.append(m)
    yield mnts
    for m in mnts:
        subprocess.run(["umount", "-l", str(m)], check=False)


@pytest.fixture
def small_cluster(nodes, small_disks, tmp_path):
    ns = [nodes(1, data_dir=str(d / "data"))[0] for d in small_disks]
    addrs = [n.addr for n in ns]

    async def mk():
        async with open_client("tcp", addrs) as dc:
            await create_partition(dc, 1, addrs)
    trio.run(mk)
    m = Mount(addrs, tmp_path).mount("--write-retry", "5")
    yield m, small_disks
    m.cleanup()


def _free(path) -> int:
    v = os.statvfs(path)
    return v.f_bavail * v.f_frsize


def _used(path) -> int:
    v = os.statvfs(path)
    return (v.f_blocks - v.f_bfree) * v.f_frsize


def test_statfs_tracks_the_datanodes_disks(small_cluster):
    m, disks = small_cluster
    v = os.statvfs(m.path)
    assert abs(v.f_blocks * v.f_frsize - DISK_MIB * MiB) <= MiB      # size: a disk's (each byte stored thrice)
    assert abs(_free(m.path) - min(_free(d) for d in disks)) <= 3 * MiB
    assert _used(m.path) + _free(m.path) == v.f_blocks * v.f_frsize
    before, used = _free(m.path), _used(m.path)
    data = pattern(1, 12 * MiB)
    with open(m.path / "f", "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    eventually(lambda: before - _free(m.path) >= 12 * MiB, 15)       # refreshed in the background
    assert before - _free(m.path) <= 14 * MiB
    assert _used(m.path) - used >= 12 * MiB
    # what else fills the nodes' disks is used too: disks full of something else are not an empty df
    before, used = _free(m.path), _used(m.path)
    for disk in disks:
        with open(disk / "ballast", "wb") as f:
            f.write(b"\0" * (9 * MiB))
    eventually(lambda: _used(m.path) - used >= 9 * MiB - 64 * 1024, 15)
    assert before - _free(m.path) >= 9 * MiB - 64 * 1024
    for disk in disks:
        os.unlink(disk / "ballast")
    os.unlink(m.path / "f")
    eventually(lambda: _free(m.path) >= before + 9 * MiB, 15)        # the deletion queue gave it back


def _fill(path) -> OSError:
    """Write until the filesystem says no; returns the error (from write, fsync or close)."""
    i = 0
    while True:
        try:
            with open(path / f"fill{i}", "wb") as f:
                for k in range(8):
                    f.write(pattern(i * 8 + k, MiB))
                os.fsync(f.fileno())
        except OSError as e:
            return e
        i += 1
        assert i < 100, "the disks never filled up"


@pytest.mark.parametrize("small_disks", [(DISK_MIB,) * 3, (DISK_MIB, DISK_MIB, DISK_MIB // 2)],
                         ids=["all-full", "follower-full"], indirect=True)
def test_full_datanodes_are_enospc(small_cluster):
    """Full disks are ENOSPC, from write, fsync or close -- whether the leader says so (NO_SPACE) or a
    follower's full disk reaches the client only as a replication failure."""
    m, _ = small_cluster
    e = _fill(m.path)
    assert e.errno == errno.ENOSPC, e
    with pytest.raises(OSError) as again:                 # and a fresh file meets the same answer
        with open(m.path / "more", "wb") as f:
            f.write(pattern(7, 4 * MiB))
            os.fsync(f.fileno())
    assert again.value.errno == errno.ENOSPC
    v = os.statvfs(m.path)
    assert v.f_bavail * v.f_frsize < 8 * MiB
