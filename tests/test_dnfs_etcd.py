"""dnfs with the shared metadata engine: a real etcd server (Debian's etcd-server, free ports, a temp data
dir) and two real FUSE mounts of the same cluster and volume."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time
import urllib.request

import pytest

from tests.conftest import eventually, pattern
from tests.test_dnfs import Mount, cluster  # noqa: F401 - the module-scoped cluster fixture
from tools.cluster import free_port

ETCD = shutil.which("etcd") or "/usr/bin/etcd"
pytestmark = [pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="no /dev/fuse"),
              pytest.mark.skipif(not os.path.exists(ETCD), reason="no etcd binary (Debian: etcd-server)")]


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    d = tmp_path_factory.mktemp("etcd")
    cport, pport = free_port(), free_port()
    client, peer = f"http://127.0.0.1:{cport}", f"http://127.0.0.1:{pport}"
    log = open(d / "etcd.log", "wb")
    proc = subprocess.Popen([ETCD, "--name", "t", "--data-dir", str(d / "data"), "--listen-client-urls", client,
                             "--advertise-client-urls", client, "--listen-peer-urls", peer,
                             "--initial-advertise-peer-urls", peer, "--initial-cluster", f"t={peer}",
                             "--max-txn-ops", "10000"], stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(client + "/version", timeout=1).read()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"etcd did not start: {(d / 'etcd.log').read_text()[-2000:]}")
                time.sleep(0.1)
        yield f"127.0.0.1:{cport}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def test_two_mounts_on_one_etcd(cluster, etcd, tmp_path):  # noqa: F811
    url = f"etcd://{etcd}/v{free_port()}"
    a = Mount(cluster, tmp_path, url, "a").mount()
    b = Mount(cluster, tmp_path, url, "b")
    try:
        b.mount()
        (a.path / "d").mkdir()
        data = pattern(1, (3 << 20) + 17)
        (a.path / "d" / "f").write_bytes(data)                       # closed on A ...
        assert (b.path / "d" / "f").read_bytes() == data             # ... read whole on B after its open
        os.rename(b.path / "d" / "f", b.path / "d" / "g")
        eventually(lambda: not (a.path / "d" / "f").exists() and (a.path / "d" / "g").exists())
        (a.path / "d" / "g").write_bytes(pattern(2, len(data)))      # same size, new bytes: B's cache must go
        assert (b.path / "d" / "g").read_bytes() == pattern(2, len(data))
        os.unlink(a.path / "d" / "g")
        eventually(lambda: not (b.path / "d" / "g").exists())
        assert sorted(os.listdir(b.path / "d")) == []

        def appender(m, name, seed):                                 # concurrent appends, one file each
            with open(m.path / name, "ab") as f:
                for i in range(40):
                    f.write(pattern(seed + i, 50_000))
                    f.flush()
        ts = [threading.Thread(target=appender, args=(a, "a.log", 100)),
              threading.Thread(target=appender, args=(b, "b.log", 200))]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        for m, name, seed in ((b, "a.log", 100), (a, "b.log", 200)):
            assert (m.path / name).read_bytes() == b"".join(pattern(seed + i, 50_000) for i in range(40))
        for i in range(20):                                          # creates from both sides in one directory
            (a.path / "d" / f"a{i}").write_bytes(b"a")
            (b.path / "d" / f"b{i}").write_bytes(b"b")
        assert sorted(os.listdir(a.path / "d")) == sorted(os.listdir(b.path / "d"))
        assert len(os.listdir(a.path / "d")) == 40
    finally:
        for m in (a, b):
            m.cleanup()
    r = a.fsck()
    assert "clean" in r.stdout, r.stdout
    a.mount()                                                       # and after a remount
    try:
        assert (a.path / "a.log").stat().st_size == 40 * 50_000
    finally:
        a.cleanup()


def test_open_file_sessions_across_mounts(cluster, etcd, tmp_path):  # noqa: F811
    """A file unlinked on mount B while mount A has it open stays readable on A (B's orphan sweep leaves it
    alone) and is removed at A's last close; if A dies instead, its session expires and B removes the inode
    and releases its extents on the datanodes."""
    import etcd3gw

    from client.fs.meta_etcd import SESSION_TTL, u64
    from tests.test_dnfs import watermarks
    vol = f"v{free_port()}"
    url = f"etcd://{etcd}/{vol}"
    host, port = etcd.split(":")
    kv = etcd3gw.client(host=host, port=int(port))
    prefix = f"dnfs/{vol}/".encode()

    def inode_exists(ino):
        return bool(kv.get(prefix + b"i" + u64(ino)))

    def extents_of(ino):
        return {tuple(json.loads(v)[2:4]) for v, _ in kv.get_prefix(prefix + b"s" + u64(ino))}

    a = Mount(cluster, tmp_path, url, "a").mount()
    b = Mount(cluster, tmp_path, url, "b")
    try:
        b.mount()
        data = pattern(3, (2 << 20) + 5)
        (a.path / "f").write_bytes(data)
        ino = os.stat(a.path / "f").st_ino
        with open(a.path / "f", "rb") as f:                 # open on A ...
            os.unlink(b.path / "f")                          # ... unlinked on B
            time.sleep(SESSION_TTL / 2 + 1)                  # B's sweeps run meanwhile
            assert inode_exists(ino), "an inode open on another mount was removed"
            assert f.read() == data
        eventually(lambda: not inode_exists(ino))            # A's last close removed it
        # now A dies with an unlinked file open
        (a.path / "g").write_bytes(pattern(4, 3 << 20))
        ino = os.stat(a.path / "g").st_ino
        exts = extents_of(ino)
        assert exts
        fd = os.open(a.path / "g", os.O_RDONLY)
        os.unlink(b.path / "g")
        os.kill(a.pid, signal.SIGKILL)
        time.sleep(0.5)
        try:
            os.close(fd)
        except OSError:
            pass
        subprocess.run(["fusermount3", "-u", "-z", str(a.path)], capture_output=True)
        a.pid = None
        assert inode_exists(ino), "removed before A's session expired"
        eventually(lambda: not inode_exists(ino), timeout=SESSION_TTL + 20)   # B's sweep, after the lease
        eventually(lambda: not any(e in watermarks(cluster) for _, e in exts), timeout=20)  # extents released
    finally:
        for m in (a, b):
            m.cleanup()
    r = b.fsck()
    assert "clean" in r.stdout, r.stdout
