"""dnfs under cluster faults: a real FUSE mount, real datanodes registered in a real etcd, a real cluster
manager (manager/service.py) that shrinks a replica set when a member dies."""
from __future__ import annotations

import filecmp
import os
import signal
import subprocess
import threading
import time

import pytest
import trio

from tests.conftest import create_partition, open_client, pattern
from tests.test_dnfs import Mount
from tests.test_etcd import etcd, managed_partition, managers, wait_for  # noqa: F401 - fixtures

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="no /dev/fuse")
MiB = 1 << 20


def _size(path) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


@pytest.mark.parametrize("timeout", [15, 1])
def test_follower_killed_during_cp(nodes, etcd, managers, tmp_path, timeout):  # noqa: F811
    """kill -9 of a follower while `cp` writes a large file into the mount: cp succeeds, the copy is
    byte-identical (read back through a fresh mount), and fsck is clean.  With the default request timeout
    the SDK rides out the fault itself (it waits for the manager's shrunk view); with a 1 s timeout the SDK
    gives up first and the mount's own retry (``--write-retry``, from the write-back buffer) carries it.  (The
    view changes about 2 s after the kill here: a 2 s timeout once lost that race and never retried.)"""
    e, ns, et = managed_partition(nodes, etcd, managers)
    addrs = [n.addr for n in ns]

    src = tmp_path / "src.bin"
    with open(src, "wb") as f:
        for i in range(160):
            f.write(pattern(i, MiB))
    m = Mount(addrs, tmp_path).mount("--etcd", e.url, "--chunk-mib", "4", "--timeout", str(timeout))
    try:
        dst = m.path / "big.bin"
        result = {}

        def cp():
            result["r"] = subprocess.run(["cp", str(src), str(dst)], capture_output=True, text=True)
        t = threading.Thread(target=cp)
        t.start()
        deadline = time.monotonic() + 60
        while _size(dst) < 24 * MiB and t.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert t.is_alive(), "cp finished before the follower could be killed: make the file bigger"
        ns[2].kill(signal.SIGKILL)                          # a follower, mid-copy
        t.join(120)
        assert not t.is_alive(), "cp hung"
        r = result["r"]
        assert r.returncode == 0, f"cp failed: {r.stderr}"

        async def shrunk():
            v = await et.part(1)
            return v if v is not None and addrs[2] not in v.replicas else None
        trio.run(wait_for, "the replica set to shrink", shrunk)
        assert filecmp.cmp(src, dst, shallow=False)
        m.umount()
        m.mount("--etcd", e.url)                            # read back from the datanodes, not a cache
        assert subprocess.run(["cmp", str(src), str(dst)]).returncode == 0
        m.umount()
        log = (tmp_path / "mnt.log").read_text()
        assert "waiting for a new view" in log, log[-3000:]           # the fault did hit the writes
        if timeout == 1:
            assert "retrying" in log, log[-3000:]
    finally:
        m.cleanup()
    r = m.fsck("--etcd", e.url)
    assert "clean" in r.stdout, r.stdout


def test_dead_follower_moves_writes_to_another_partition(nodes, tmp_path):
    """Two partitions; a follower of one of them dies (no manager here: that set never shrinks).  Writes of
    files whose partition it was go on in the other partition, from the write-back buffer: every cp succeeds
    and every copy is byte-identical, read back through a fresh mount."""
    ns = nodes(4)
    a = [n.addr for n in ns]

    async def setup():
        async with open_client("tcp", a) as dc:
            await create_partition(dc, 1, [a[0], a[1], a[2]])
            await create_partition(dc, 2, [a[0], a[1], a[3]])
    trio.run(setup)
    m = Mount(a, tmp_path).mount("--timeout", "3", "--chunk-mib", "2")
    try:
        ns[2].kill(signal.SIGKILL)                           # a follower of partition 1 only
        srcs = []
        for i in range(4):                                   # files alternate between the partitions
            src = tmp_path / f"src{i}"
            src.write_bytes(pattern(10 + i, 6 * MiB + i))
            srcs.append(src)
            r = subprocess.run(["cp", str(src), str(m.path / src.name)], capture_output=True, text=True)
            assert r.returncode == 0, f"cp failed: {r.stderr}"
        m.umount()
        m.mount("--timeout", "3")
        for src in srcs:
            assert (m.path / src.name).read_bytes() == src.read_bytes(), src.name
        m.umount()
        log = (tmp_path / "mnt.log").read_text()
        assert "write went through on partition 2" in log, log[-3000:]
    finally:
        m.cleanup()
