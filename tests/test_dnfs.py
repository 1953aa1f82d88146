"""dnfs against a real kernel FUSE mount on a real 3-node local cluster (TCP).

One cluster serves the module; every test mounts it afresh (its own SQLite metadata, its own mount point)
through the real CLI (`dnfs mount` / `dnfs umount` / `dnfs fsck`)."""
from __future__ import annotations

import ctypes
import errno
import functools
import io
import json
import os
import pathlib
import signal
import sqlite3
import stat as stat_mod
import struct
import subprocess
import tarfile
import threading
import time
import types

import pytest
import trio
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from client.sdk import DataClient
from tests.conftest import NODE_DEFAULTS, create_partition, dirty_pages, eventually, pattern, run_cli
from tools.cluster import NodeProc, free_port

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="no /dev/fuse")


dnfs = functools.partial(run_cli, "client.fs.cli", check=True, timeout=120)


class Addrs(list):
    """The module cluster's datanode addresses, and (``procs``) their processes."""
    procs: list[NodeProc]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("dnfs-cluster")
    procs = [NodeProc(root / f"node{i}", f"127.0.0.1:{free_port()}", **NODE_DEFAULTS) for i in range(3)]
    try:
        for p in procs:
            p.start()
        addrs = Addrs(p.addr for p in procs)
        addrs.procs = procs

        async def mkpart():
            async with DataClient.open(timeout=10) as dc:
                await create_partition(dc, 1, addrs)
        trio.run(mkpart)
        yield addrs
    finally:
        for p in procs:
            p.stop()


class Mount:
    def __init__(self, addrs, tmp: pathlib.Path, meta: str | None = None, name: str = "mnt"):
        self.addrs, self.tmp = addrs, tmp
        self.path = tmp / name
        self.path.mkdir()
        self.db = tmp / "meta.db"
        self.meta = meta or f"sqlite:{self.db}"
        self.pid = None

    @property
    def node_args(self):
        return [a for addr in self.addrs for a in ("--node", addr)]

    def mount(self, *extra):
        r = dnfs("mount", *self.node_args, "--meta", self.meta, "--json", "--timeout", "15", "--log",
                 self.tmp / f"{self.path.name}.log", *extra, self.path)
        import json
        self.pid = json.loads(r.stdout)["pid"]
        return self

    def umount(self):
        dnfs("umount", self.path)
        self.pid = None

    def fsck(self, *extra, check=True):
        return dnfs("fsck", *self.node_args, "--meta", self.meta, *extra, check=check)

    def cleanup(self):
        if self.pid is not None:
            r = dnfs("umount", self.path, check=False)
            if r.returncode != 0:
                subprocess.run(["fusermount3", "-u", "-z", str(self.path)], capture_output=True)
                try:
                    os.kill(self.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                raise AssertionError(f"umount failed: {r.stderr}")

    def file_extents(self, name: str) -> set[tuple[int, int]]:
        db = sqlite3.connect(f"file:{self.db}?mode=ro", uri=True)
        try:
            ino = db.execute("SELECT ino FROM dentries WHERE parent=1 AND name=?", (name.encode(),)).fetchone()[0]
            return {tuple(r) for r in db.execute("SELECT pid, extent FROM slices WHERE ino=?", (ino,))}
        finally:
            db.close()


@pytest.fixture
def mnt(cluster, tmp_path):
    m = Mount(cluster, tmp_path).mount()
    yield m
    m.cleanup()


def watermarks(addrs) -> dict[int, int]:
    async def go():
        async with DataClient.open(addrs, timeout=10) as dc:
            return await dc.watermarks(1)
    return trio.run(go)


# ------------------------------------------------------------------------------------------- data
SIZES = [0, 1, 4095, 4096, 131071, 131072, 131073, (1 << 20) + 1, 33 << 20]


def test_round_trips_cp_and_python(mnt, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for n in SIZES:
        data = pattern(n, n)
        (src / f"f{n}").write_bytes(data)
        subprocess.run(["cp", str(src / f"f{n}"), str(mnt.path / f"cp{n}")], check=True)
        subprocess.run(["cmp", str(src / f"f{n}"), str(mnt.path / f"cp{n}")], check=True)
        with open(mnt.path / f"py{n}", "wb") as f:
            f.write(data)
        assert (mnt.path / f"py{n}").read_bytes() == data
        assert os.stat(mnt.path / f"py{n}").st_size == n
    mnt.umount()                                  # and after a remount, from the metadata and the datanodes
    mnt.mount()
    for n in SIZES:
        assert (mnt.path / f"cp{n}").read_bytes() == pattern(n, n), n
    names = sorted(os.listdir(mnt.path))
    assert names == sorted([f"cp{n}" for n in SIZES] + [f"py{n}" for n in SIZES])


def test_large_file_100mib(mnt, tmp_path):
    data = pattern(7, 100 << 20)
    (tmp_path / "big").write_bytes(data)
    subprocess.run(["cp", str(tmp_path / "big"), str(mnt.path / "big")], check=True)
    subprocess.run(["sync", "-f", str(mnt.path / "big")], check=True)
    mnt.umount()
    mnt.mount()
    subprocess.run(["cmp", str(tmp_path / "big"), str(mnt.path / "big")], check=True)


def test_a_cold_sequential_read_is_large_reads_of_bytes_fetched_once(mnt):
    """A large file read from a fresh mount (nothing cached): the bytes are the ones written, the kernel asks
    in readahead-sized READs rather than page by page (1 MiB when root mounts: it raises the mount's
    readahead), and the mount fetches each byte from the cluster once -- the kernel's READs of one reader
    arrive several at once and share the fetch under way."""
    data = pattern(11, 48 << 20)
    (mnt.path / "big").write_bytes(data)
    mnt.umount()
    mnt.mount()
    with open(mnt.path / "big", "rb", buffering=0) as f:
        got = b"".join(iter(lambda: f.read(1 << 20), b""))
    assert got == data
    st = json.loads(dnfs("stats", mnt.path, "--json").stdout)
    reads = st["requests"]["read"]["count"]
    assert st["fuse"]["read_bytes"] == len(data)
    assert len(data) / reads >= (768 << 10 if os.getuid() == 0 else 64 << 10), reads
    assert st["read_fetched_bytes"] <= len(data) * 1.1, st["read_fetched_bytes"] / len(data)


def test_overwrite_append_truncate_holes(mnt):
    p = mnt.path / "f"
    base = pattern(1, 3 << 20)
    p.write_bytes(base)
    with open(p, "r+b") as f:                     # overwrite in the middle, across a block boundary
        f.seek((1 << 20) - 10)
        f.write(b"M" * 100)
    model = bytearray(base)
    model[(1 << 20) - 10:(1 << 20) + 90] = b"M" * 100
    assert p.read_bytes() == model
    with open(p, "ab") as f:                      # append after the overwrite
        f.write(b"tail")
    model += b"tail"
    assert p.read_bytes() == model
    os.truncate(p, 1000)                          # down ...
    assert p.read_bytes() == model[:1000]
    os.truncate(p, 5000)                          # ... and up: the new bytes are zeros
    assert p.read_bytes() == model[:1000] + bytes(4000)
    with open(p, "r+b") as f:                     # a write past EOF leaves a hole
        f.seek(10 << 20)
        f.write(b"after the hole")
    got = p.read_bytes()
    assert len(got) == (10 << 20) + 14
    assert got[:5000] == model[:1000] + bytes(4000) and got[5000:10 << 20] == bytes((10 << 20) - 5000)
    assert got[10 << 20:] == b"after the hole"
    mnt.umount()
    mnt.mount()
    assert p.read_bytes() == got
    mnt.umount()
    assert "clean" in mnt.fsck().stdout
    mnt.mount()


class RandomWrites(RuleBasedStateMachine):
    """Random writes, truncates, reopens and fsyncs on one file in the mount vs. a bytearray."""
    path: pathlib.Path

    @initialize()
    def start(self):
        self.model = bytearray()
        self.f = open(self.path, "w+b", buffering=0)

    @rule(off=st.integers(0, 600_000), n=st.integers(1, 200_000), seed=st.integers(0, 1 << 16))
    def write(self, off, n, seed):
        data = pattern(seed, n)
        self.f.seek(off)
        self.f.write(data)
        if off > len(self.model):
            self.model += bytes(off - len(self.model))
        self.model[off:off + n] = data

    @rule(size=st.integers(0, 700_000))
    def truncate(self, size):
        self.f.truncate(size)
        if size < len(self.model):
            del self.model[size:]
        else:
            self.model += bytes(size - len(self.model))

    @rule()
    def fsync(self):
        os.fsync(self.f.fileno())

    @rule()
    def reopen(self):
        self.f.close()
        self.f = open(self.path, "r+b", buffering=0)

    @precondition(lambda self: len(self.model) > 0)
    @rule(data=st.data())
    def read_range(self, data):
        off = data.draw(st.integers(0, len(self.model) - 1))
        n = data.draw(st.integers(1, 300_000))
        self.f.seek(off)
        assert self.f.read(n) == bytes(self.model[off:off + n])

    @invariant()
    def size(self):
        if hasattr(self, "f"):
            assert os.fstat(self.f.fileno()).st_size == len(self.model)

    def teardown(self):
        if hasattr(self, "f"):
            self.f.close()
            assert self.path.read_bytes() == bytes(self.model)


def test_random_writes_against_a_model(mnt):
    RandomWrites.path = mnt.path / "random"
    RandomWrites.TestCase.settings = settings(max_examples=12, stateful_step_count=25, deadline=None,
                                              suppress_health_check=list(HealthCheck))
    RandomWrites.TestCase().runTest()
    mnt.umount()
    assert "clean" in mnt.fsck().stdout
    mnt.mount()


# ------------------------------------------------------------------------------------------- names
def renameat2(src, dst, flags):
    libc = ctypes.CDLL(None, use_errno=True)
    AT_FDCWD = -100
    if libc.renameat2(AT_FDCWD, os.fsencode(src), AT_FDCWD, os.fsencode(dst), flags) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def test_directories_and_renames(mnt):
    m = mnt.path
    (m / "a" / "b" / "c").mkdir(parents=True)
    (m / "a" / "b" / "c" / "f").write_bytes(b"one")
    with pytest.raises(OSError) as e:
        os.rmdir(m / "a" / "b")
    assert e.value.errno == errno.ENOTEMPTY
    (m / "a" / "g").write_bytes(b"two")
    os.rename(m / "a" / "b" / "c" / "f", m / "a" / "g")            # over an existing file
    assert (m / "a" / "g").read_bytes() == b"one" and not (m / "a" / "b" / "c" / "f").exists()
    os.rename(m / "a" / "g", m / "top")                             # across directories
    assert (m / "top").read_bytes() == b"one"
    (m / "other").write_bytes(b"three")
    with pytest.raises(OSError) as e:
        renameat2(m / "other", m / "top", 1)                        # RENAME_NOREPLACE
    assert e.value.errno == errno.EEXIST
    renameat2(m / "other", m / "top", 2)                            # RENAME_EXCHANGE
    assert (m / "top").read_bytes() == b"three" and (m / "other").read_bytes() == b"one"
    os.rename(m / "a" / "b", m / "moved")                           # a directory to another parent
    assert (m / "moved" / "c").is_dir() and os.stat(m / "a").st_nlink == 2
    os.rmdir(m / "moved" / "c")
    os.rmdir(m / "moved")
    with pytest.raises(OSError) as e:
        (m / ("x" * 256)).write_bytes(b"")
    assert e.value.errno == errno.ENAMETOOLONG
    os.link(m / "top", m / "hard")
    assert os.stat(m / "top").st_nlink == 2 and (m / "hard").read_bytes() == b"three"
    os.symlink("top", m / "sym")
    assert os.readlink(m / "sym") == "top" and (m / "sym").read_bytes() == b"three"
    os.chmod(m / "top", 0o600)
    os.utime(m / "top", ns=(1_000_000_000, 2_000_000_000))
    s = os.stat(m / "top")
    assert s.st_mode & 0o777 == 0o600 and s.st_mtime_ns == 2_000_000_000
    os.setxattr(m / "top", "user.k", b"v")
    assert os.getxattr(m / "top", "user.k") == b"v" and "user.k" in os.listxattr(m / "top")
    assert os.statvfs(m).f_bavail > 0
    mnt.umount()
    assert "clean" in mnt.fsck().stdout
    mnt.mount()
    assert (m / "hard").read_bytes() == b"three" and os.readlink(m / "sym") == "top"


# VFS_CAP_REVISION_2, effective, permitted cap_net_raw: a valid security.capability value
CAPS = struct.pack("<5I", 0x02000001, 1 << 13, 0, 0, 0)


def _caps(path) -> bytes | None:
    try:
        return os.getxattr(path, "security.capability")
    except OSError as e:
        assert e.errno == errno.ENODATA, e
        return None


def test_a_write_strips_file_capabilities_as_on_a_local_disk(mnt, tmp_path):
    """A file given capabilities loses them when written (the kernel asks for security.capability before
    each write and removes it): through the mount as on a local file system -- also when they were given
    while the file was open and already written, when the mount keeps its answer to that question."""
    seen = {}
    for where in (tmp_path / "local", mnt.path):
        where.mkdir(exist_ok=True)
        f = where / "tool"
        fd = os.open(f, os.O_CREAT | os.O_RDWR, 0o755)
        try:
            os.pwrite(fd, b"x" * 100, 0)                    # asked, and answered "none", while open
            os.setxattr(f, "security.capability", CAPS)     # given while open
            given = _caps(f)
            os.pwrite(fd, b"y", 1)                          # the write takes them away
            after_write = _caps(f)
            os.setxattr(f, "security.capability", CAPS)     # given again ...
            os.fsync(fd)
        finally:
            os.close(fd)
        again = _caps(f)
        fd = os.open(f, os.O_WRONLY)                        # ... and written at the next open
        try:
            os.pwrite(fd, b"z", 2)
        finally:
            os.close(fd)
        seen[where == mnt.path] = (given, after_write, again, _caps(f), f.read_bytes())
    assert seen[False] == (CAPS, None, CAPS, None, b"xyz" + b"x" * 97)     # what the kernel does, locally
    assert seen[True] == seen[False]


def test_the_capability_question_before_each_write_is_answered_from_memory_while_the_file_is_open(tmp_path):
    """The kernel's security.capability lookup before every write reaches the metadata engine once per open
    file, not once per write (and not at all for a file the mount created); this mount's own changes of it
    (set, removed) are what it answers after."""
    from client.fs.fs import DnFS
    from client.fs.fs_common import CAPS as NAME
    from client.fs.meta import ROOT
    from client.fs.fuse_types import FUSEError
    from client.fs.meta_sqlite import SqliteMeta

    async def main():
        meta = SqliteMeta(str(tmp_path / "m.db"))
        asked = []
        real = meta.getxattr

        async def counted(ino, name):
            asked.append(name)
            return await real(ino, name)
        meta.getxattr = counted

        async def caps(ino):
            try:
                return await fs.getxattr(ino, NAME, None)
            except FUSEError as e:
                assert e.errno == errno.ENODATA
                return None

        async with DataClient.open(timeout=5) as dc, trio.open_nursery() as n:
            fs = DnFS(meta, dc, [1], n)
            a = await meta.create(ROOT, b"f", stat_mod.S_IFREG | 0o644, 0, 0)
            assert await caps(a.ino) is None                 # not open: asked every time
            assert await caps(a.ino) is None and len(asked) == 2
            fi = await fs.open(a.ino, os.O_WRONLY, None)
            assert [await caps(a.ino) for _ in range(5)] == [None] * 5 and len(asked) == 3
            await fs.setxattr(a.ino, NAME, CAPS, None)
            assert await caps(a.ino) == CAPS and len(asked) == 3
            await fs.removexattr(a.ino, NAME, None)
            assert await caps(a.ino) is None and len(asked) == 3
            await fs.release(fi.fh)
            assert await caps(a.ino) is None and len(asked) == 4
            fi, e = await fs.create(ROOT, b"new", 0o644, os.O_WRONLY, types.SimpleNamespace(uid=0, gid=0))
            assert await caps(e.st_ino) is None and len(asked) == 4     # a file it created has none
            await fs.release(fi.fh)
            n.cancel_scope.cancel()
        await meta.close()
    trio.run(main)


def _requests(m) -> dict[str, int]:
    return {k: v["count"] for k, v in json.loads(dnfs("stats", m.path, "--json").stdout)["requests"].items()}


def test_writes_cost_one_request_each_and_a_small_tree_few_per_file(mnt, tmp_path):
    """The mount handles the set-ID and capability clearing of writes itself (FUSE_HANDLE_KILLPRIV_V2), so
    the kernel asks for a file's security.capability at most once per change of its attributes, not before
    each write(2); untarring a tree of small files costs few requests per file (``dnfs stats`` counts them)."""
    f = mnt.path / "w"
    f.write_bytes(b"")
    before = _requests(mnt)
    fd = os.open(f, os.O_WRONLY)
    try:
        for i in range(50):
            os.pwrite(fd, b"x" * 100, i * 100)
    finally:
        os.close(fd)
    after = _requests(mnt)
    grew = {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) != before.get(k, 0)}
    assert grew.get("getxattr", 0) <= 1 and sum(grew.values()) <= 50 + 8, grew     # 50 writes, open, close...
    assert f.read_bytes() == b"x" * 5000
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for d in range(5):
            for i in range(40):
                data = pattern(d * 100 + i, 100 + 37 * i)
                info = tarfile.TarInfo(f"t/d{d}/f{i}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    (tmp_path / "t.tar").write_bytes(buf.getvalue())
    before = _requests(mnt)
    subprocess.run(["tar", "-xf", tmp_path / "t.tar", "-C", mnt.path], check=True)
    after = _requests(mnt)
    per_file = sum(after.values()) - sum(before.values())
    assert per_file / 200 <= 12, {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert (mnt.path / "t/d3/f7").read_bytes() == pattern(307, 100 + 37 * 7)


def test_requests_that_need_no_io_are_answered_as_they_are_read_and_still_counted(mnt):
    """A write that only buffers, a lookup the metadata answers at once and a close with nothing left to write
    are answered by the session loop itself (``dnfs stats``: fuse.inline) -- no task each -- and are counted
    as requests like the others; the bytes are there."""
    f = mnt.path / "inline"
    f.write_bytes(b"")
    before = json.loads(dnfs("stats", mnt.path, "--json").stdout)
    fd = os.open(f, os.O_WRONLY)
    try:
        for i in range(50):
            os.pwrite(fd, b"y" * 100, i * 100)
    finally:
        os.close(fd)
    for i in range(20):
        assert not (mnt.path / f"absent{i}").exists()
    with open(f, "rb") as r:
        assert r.read() == b"y" * 5000
    after = json.loads(dnfs("stats", mnt.path, "--json").stdout)
    grew = {k: after["requests"][k]["count"] - before["requests"].get(k, {"count": 0})["count"]
            for k in ("write", "lookup", "flush")}
    assert grew["write"] >= 50 and grew["lookup"] >= 20 and grew["flush"] >= 2, grew
    assert after["fuse"]["inline"] - before["fuse"]["inline"] >= 50 + 20 + 1, (before["fuse"], after["fuse"])


def test_with_the_kernel_cache_a_file_replaced_by_a_symlink_syncs_without_error(cluster, tmp_path):
    """tar puts a placeholder file where a symlink goes and replaces it at the end.  With the kernel's
    write-back cache the kernel writes the unlinked placeholder's times back right after the unlink, when the
    mount has removed the inode: that succeeds, and ``sync -f`` reports no error."""
    m = Mount(cluster, tmp_path).mount("--kernel-cache")
    try:
        for i in range(20):
            p = m.path / f"f{i}"
            fd = os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
            os.write(fd, b"x" * 100)
            os.close(fd)
            os.utime(p, ns=(10**18, 10**18))
        for i in range(20):
            os.unlink(m.path / f"f{i}")
            os.symlink(f"target{i}", m.path / f"f{i}")
        subprocess.run(["sync", "-f", str(m.path)], check=True, capture_output=True)
        assert sorted(os.readlink(m.path / f"f{i}") for i in range(20)) == sorted(f"target{i}" for i in range(20))
        assert sum(r[1]["failed"] for r in json.loads(dnfs("stats", m.path, "--json").stdout)["requests"].items()
                   if r[0] != "getxattr") == 0
    finally:
        m.cleanup()
    db = sqlite3.connect(f"file:{m.db}?mode=ro", uri=True)      # and the placeholders are gone
    try:
        assert db.execute("SELECT COUNT(*) FROM inodes WHERE nlink = 0").fetchone()[0] == 0
    finally:
        db.close()


def test_sigterm_unmounts_after_writing_what_is_buffered(cluster, tmp_path):
    """SIGTERM to the mount process ends it like an unmount: the buffered bytes (--writeback: closed files'
    too) are written, the mount point is let go, the process exits; the files are whole at the next mount."""
    m = Mount(cluster, tmp_path).mount("--writeback")
    try:
        files = {f"f{i}": pattern(i, 5000 + 1000 * i) for i in range(10)}
        for name, data in files.items():
            (m.path / name).write_bytes(data)
        os.kill(m.pid, signal.SIGTERM)
        for _ in range(300):
            if not os.path.exists(f"/proc/{m.pid}"):
                break
            time.sleep(0.1)
        assert not os.path.exists(f"/proc/{m.pid}"), "the mount process did not exit"
        assert str(m.path) not in open("/proc/mounts").read()
        m.pid = None
        m.mount()
        assert {n: (m.path / n).read_bytes() for n in files} == files
    finally:
        m.cleanup()


def test_readdir_many_entries(mnt):
    n = 10_000
    d = mnt.path / "many"
    d.mkdir()
    for i in range(n):
        os.close(os.open(d / f"entry-{i:05d}", os.O_CREAT | os.O_WRONLY, 0o644))
    assert sorted(os.listdir(d)) == [f"entry-{i:05d}" for i in range(n)]


def assert_reclaimed(mnt, extents: set[tuple[int, int]], within: float = 30) -> None:
    """Every one of ``extents`` is deleted from the datanodes within ``within`` seconds (the mount's reclaimer)."""
    eventually(lambda: not any(e in watermarks(mnt.addrs) for _, e in extents), within,
               f"extents {extents} still on the datanodes", interval=0.5)


def test_unlink_open_file_then_extents_freed(mnt):
    p = mnt.path / "doomed"
    data = pattern(3, 20 << 20)
    p.write_bytes(data)
    extents = mnt.file_extents("doomed")
    assert extents
    with open(p, "rb") as f:
        os.unlink(p)
        assert not p.exists()
        assert f.read() == data                   # still readable through its handle
    assert_reclaimed(mnt, extents)
    mnt.umount()
    assert "clean" in mnt.fsck().stdout
    mnt.mount()


def test_unlink_closed_files_frees_their_extents_and_keeps_other_links(mnt):
    """`rm` of a closed file: it goes with its last link (its inode removed in the unlink's transaction) and
    its extents are reclaimed; a file with another name left stays whole."""
    (mnt.path / "a").write_bytes(pattern(5, 6 << 20))
    gone = mnt.file_extents("a")
    assert gone
    os.unlink(mnt.path / "a")
    assert not (mnt.path / "a").exists()
    assert_reclaimed(mnt, gone)
    (mnt.path / "b").write_bytes(pattern(6, 6 << 20))
    os.link(mnt.path / "b", mnt.path / "b2")
    os.unlink(mnt.path / "b")
    assert os.stat(mnt.path / "b2").st_nlink == 1
    mnt.umount()
    assert "clean" in mnt.fsck().stdout
    mnt.mount()
    assert (mnt.path / "b2").read_bytes() == pattern(6, 6 << 20)


def test_a_mount_authenticates_with_the_secret_file_it_is_given(tmp_path):
    """dnfs mount --secret-file: the background mount process authenticates with it (so does fsck); without it,
    a node that holds a secret refuses the mount."""
    from wire.auth import gen_secret
    secret = tmp_path / "secret"
    secret.write_text(gen_secret())
    node = NodeProc(tmp_path / "node", f"127.0.0.1:{free_port()}", **NODE_DEFAULTS, secret_file=str(secret)).start()
    try:
        async def mkpart():
            async with DataClient.open(timeout=10, secret=str(secret)) as dc:
                await create_partition(dc, 1, [node.addr])
        trio.run(mkpart)
        m = Mount([node.addr], tmp_path)
        r = dnfs("mount", *m.node_args, "--meta", m.meta, "--timeout", "5", m.path, check=False)
        assert r.returncode != 0 and "requires authentication" in r.stderr, r.stderr
        m.mount("--secret-file", secret)
        try:
            data = pattern(31, 300 << 10)
            (m.path / "f").write_bytes(data)
            assert (m.path / "f").read_bytes() == data
        finally:
            m.cleanup()
        assert json.loads(m.fsck("--secret-file", secret, "--json").stdout)["problems"] == []
    finally:
        node.stop()


def test_second_mount_on_same_metadata_is_refused(mnt, tmp_path):
    other = tmp_path / "mnt2"
    other.mkdir()
    r = dnfs("mount", *mnt.node_args, "--meta", f"sqlite:{mnt.db}", other, check=False)
    assert r.returncode != 0 and "in use" in r.stderr and "Traceback" not in r.stderr



def test_a_failed_mount_leaves_no_database_behind(cluster, mnt, tmp_path):
    """A mount that fails once its metadata is opened (here: a partition the cluster does not have) removes
    the SQLite files it created -- and never a database that was there before it."""
    base = tmp_path / "failed"
    base.mkdir()
    (base / "mnt").mkdir()
    db = base / "new.db"
    r = dnfs("mount", *mnt.node_args, "--meta", f"sqlite:{db}", "--partition", "99", base / "mnt", check=False)
    assert r.returncode != 0 and "unknown to the cluster" in r.stderr and "Traceback" not in r.stderr
    assert sorted(p.name for p in base.iterdir() if p.name.startswith("new.db") and p.suffix != ".log") == []
    (mnt.path / "kept").write_bytes(b"kept")
    mnt.umount()
    r = dnfs("mount", *mnt.node_args, "--meta", f"sqlite:{mnt.db}", "--partition", "99", base / "mnt",
             check=False)
    assert r.returncode != 0 and "unknown to the cluster" in r.stderr
    mnt.mount()
    assert (mnt.path / "kept").read_bytes() == b"kept"


def test_umount_says_what_is_wrong_with_the_path(tmp_path):
    r = dnfs("umount", tmp_path / "nonexistent", check=False)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "no such file or directory" in r.stderr and "not a dnfs mount" not in r.stderr, r.stderr
    r = dnfs("umount", tmp_path, check=False)
    assert r.returncode != 0 and "is not a dnfs mount" in r.stderr, r.stderr

# ------------------------------------------------------------------------------------------- crashes
def test_fsync_returns_with_the_files_metadata_on_the_disk(mnt):
    """``fsync`` returns only once the file's metadata (its slices and size, in the SQLite WAL) has gone to
    the device: for a file with bytes to flush (their commit is made durable in the same step) and for one
    whose bytes an earlier close already committed (nothing to flush: the WAL is synced all the same)."""
    wal = str(mnt.db) + "-wal"
    p = mnt.path / "synced"
    with open(p, "wb") as f:
        f.write(pattern(3, 4096))
        f.flush()
        os.fsync(f.fileno())
        if dirty_pages(wal) is None:
            pytest.skip("no cachestat system call on this kernel: the page cache's dirty state is not visible")
        assert dirty_pages(wal) == 0
        f.write(pattern(4, 4096))                  # committed by the close, not durable yet
    with open(p, "rb") as f:
        os.fsync(f.fileno())                       # nothing to flush here
        assert dirty_pages(wal) == 0
    assert p.read_bytes() == pattern(3, 4096) + pattern(4, 4096)


def test_concurrent_fsyncs_share_wal_syncs_and_all_survive_a_killed_mount(mnt):
    """Eight files written and fsynced at once, 4 KiB at a time (fio's w4k_dsync_j8 in small): the fsyncs
    share the metadata WAL's fsyncs (fewer WAL syncs than fsyncs, ``dnfs stats``), yet once every fsync has
    returned nothing of the WAL is left unwritten on the device, and after a kill -9 of the mount every
    fsynced byte of every file is there."""
    wal = str(mnt.db) + "-wal"
    if dirty_pages(wal) is None:
        pytest.skip("no cachestat system call on this kernel: the page cache's dirty state is not visible")
    files, rounds = 8, 24            # 96 KiB each: past the inline limit, so the datanodes hold most of it
    before = json.loads(dnfs("stats", mnt.path, "--json").stdout)["meta"]
    fds = [os.open(mnt.path / f"w{i}", os.O_CREAT | os.O_WRONLY, 0o644) for i in range(files)]
    start = threading.Barrier(files)
    errors = []

    def writer(i):
        try:
            start.wait()
            for r in range(rounds):
                os.write(fds[i], pattern(100 * i + r, 4096))
                os.fdatasync(fds[i])
        except BaseException as e:       # noqa: BLE001 - reported by the test
            errors.append(e)
    threads = [threading.Thread(target=writer, args=(i,)) for i in range(files)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and not any(t.is_alive() for t in threads), errors
    after = json.loads(dnfs("stats", mnt.path, "--json").stdout)["meta"]
    assert dirty_pages(wal) == 0                   # every fsynced commit is on the device
    fsyncs = after["durable_waits"] - before["durable_waits"]
    syncs = after["wal_syncs"] - before["wal_syncs"]
    assert fsyncs == files * rounds and syncs < fsyncs, (syncs, fsyncs)
    os.kill(mnt.pid, signal.SIGKILL)
    time.sleep(0.5)
    for fd in fds:
        try:
            os.close(fd)                           # the mount is gone
        except OSError:
            pass
    mnt.umount()                                   # clears the dead mount
    mnt.mount()
    for i in range(files):
        assert (mnt.path / f"w{i}").read_bytes() == b"".join(pattern(100 * i + r, 4096) for r in range(rounds)), i


def test_kill9_mid_write_then_remount(mnt):
    p = mnt.path / "log"
    synced = pattern(5, 6 << 20)
    tmp = os.open(mnt.path / "tmpfile", os.O_CREAT | os.O_RDWR, 0o644)   # unlinked but open at the crash
    os.write(tmp, pattern(9, 2 << 20))
    os.fsync(tmp)
    os.unlink(mnt.path / "tmpfile")
    fd = os.open(p, os.O_CREAT | os.O_WRONLY, 0o644)
    os.write(fd, synced)
    os.fsync(fd)
    for i in range(24):                           # not fsynced (background flushes in flight): may be lost,
        os.write(fd, pattern(6 + i, 1 << 20))     # must not corrupt what was
    os.kill(mnt.pid, signal.SIGKILL)
    time.sleep(0.5)
    for f in (fd, tmp):
        try:
            os.close(f)                           # the mount is gone
        except OSError:
            pass
    mnt.umount()                                  # clears the dead mount
    r = mnt.fsck("--no-crc", check=False)         # the inode unlinked while open is left over ...
    assert r.returncode == 1 and "orphan_inode" in r.stdout, r.stdout
    r = mnt.fsck("--repair")                      # ... and removed by --repair
    assert "repaired: kind=orphan_inode" in r.stdout and "clean" in r.stdout.splitlines()[-1], r.stdout
    mnt.mount()
    got = p.read_bytes()
    assert got[:len(synced)] == synced
    mnt.umount()
    r = mnt.fsck()
    assert "clean" in r.stdout, r.stdout
    mnt.mount()


def test_with_writeback_a_close_returns_before_the_cluster_has_the_bytes_and_unmount_writes_them(cluster,
                                                                                                 tmp_path):
    """``--writeback``: closing a file does not wait for the datanodes (here: all of them stopped) -- the
    bytes are read back from the mount's buffer meanwhile, and ``dnfs stats`` counts them as unwritten --;
    ``dnfs sync`` returns once they are written (the nodes running again); an fsync waits for them; after an
    unmount every file is whole."""
    m = Mount(cluster, tmp_path).mount("--writeback", "--inline-kib", "0")     # every byte for the datanodes
    try:
        files = {f"f{i:02d}": pattern(i, 1000 + 997 * i) for i in range(40)}
        closed = threading.Event()

        def write_all():
            for name, data in files.items():
                (m.path / name).write_bytes(data)
            closed.set()
        for p in cluster.procs:
            p.proc.send_signal(signal.SIGSTOP)
        try:
            threading.Thread(target=write_all, daemon=True).start()
            assert closed.wait(20), "a close waited for the (stopped) datanodes"
            assert {n: (m.path / n).read_bytes() for n in files} == files
            held = json.loads(dnfs("stats", m.path, "--json").stdout)      # the mount says what it holds
            assert (held["unwritten_files"], held["unwritten_bytes"]) == (len(files), sum(map(len, files.values())))
            syncing = []
            threading.Thread(target=lambda: syncing.append(dnfs("sync", m.path, "--json", check=False)),
                             daemon=True).start()
            time.sleep(2)
            assert not syncing, "dnfs sync returned while the datanodes were stopped"
        finally:
            for p in cluster.procs:
                p.proc.send_signal(signal.SIGCONT)
        for _ in range(600):                                               # it returns once all is written
            if syncing:
                break
            time.sleep(0.1)
        assert syncing and syncing[0].returncode == 0, syncing
        synced = json.loads(syncing[0].stdout)
        assert synced["failed_inodes"] == [] and synced["bytes"] == held["unwritten_bytes"]
        after = dnfs("stats", m.path).stdout
        assert "unwritten: 0 B in 0 file(s)" in after and "files with an unreported write failure: 0" in after
        r = dnfs("stats", tmp_path, check=False)
        assert r.returncode != 0 and "is not a dnfs mount" in r.stderr and "Traceback" not in r.stderr
        fd = os.open(m.path / "f07", os.O_RDONLY)
        try:
            os.fsync(fd)                    # waits for its background write, then makes it durable
        finally:
            os.close(fd)
        os.unlink(m.path / "f08")           # closed, maybe not yet written: it need not be
        del files["f08"]
        m.umount()
        m.mount()
        assert {n: (m.path / n).read_bytes() for n in files} == files
        assert sorted(os.listdir(m.path)) == sorted(files)
        m.umount()
        assert "clean" in m.fsck().stdout
        assert " ERROR " not in (tmp_path / "mnt.log").read_text()     # no write failed, none was lost
        m.mount()
    finally:
        m.cleanup()


def test_fragmented_file_is_compacted_and_stays_intact(mnt):
    p = mnt.path / "frag"
    model = bytearray(pattern(12, 2 << 20))
    p.write_bytes(model)
    fd = os.open(p, os.O_RDWR)
    for i in range(300):                          # 300 small overwrites, each its own slice
        off = (i * 6151) % (len(model) - 100)
        os.pwrite(fd, pattern(1000 + i, 100), off)
        model[off:off + 100] = pattern(1000 + i, 100)
        os.fsync(fd)
    assert len(slice_rows(mnt, "frag")) > 256
    os.close(fd)
    eventually(lambda: len(slice_rows(mnt, "frag")) <= 8, 20)     # compaction: at the last close, in the background
    assert p.read_bytes() == model
    mnt.umount()
    assert "clean" in mnt.fsck().stdout
    mnt.mount()
    assert p.read_bytes() == model


def slice_rows(mnt, name):
    db = sqlite3.connect(f"file:{mnt.db}?mode=ro", uri=True)
    try:
        ino = db.execute("SELECT ino FROM dentries WHERE parent=1 AND name=?", (name.encode(),)).fetchone()[0]
        return db.execute("SELECT off, len FROM slices WHERE ino=?", (ino,)).fetchall()
    finally:
        db.close()


def test_fsck_reports_data_lost_on_the_datanodes(mnt):
    (mnt.path / "victim").write_bytes(pattern(11, 3 << 20))
    (mnt.path / "bystander").write_bytes(b"")
    extents = mnt.file_extents("victim")
    mnt.umount()
    assert "clean" in mnt.fsck().stdout

    async def drop():
        async with DataClient.open(mnt.addrs, timeout=10) as dc:
            for pid, extent in extents:
                await dc.delete_extent(pid, extent)
    trio.run(drop)
    for extra in ((), ("--repair",)):             # reported, never silently dropped (not even by --repair)
        r = mnt.fsck(*extra, check=False)
        assert r.returncode == 1 and "missing_extent" in r.stdout and "Traceback" not in r.stderr, r.stdout
    mnt.mount()
    with pytest.raises(OSError) as e:             # reading it is an I/O error, not zeros
        (mnt.path / "victim").read_bytes()
    assert e.value.errno == errno.EIO


# ------------------------------------------------------------------------------------------- tools
@pytest.mark.slow
def test_tar_and_git_inside_the_mount(mnt, tmp_path):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        for i in range(2000):
            data = pattern(i, i % 3000)
            info = tarfile.TarInfo(f"tree/d{i % 40:02d}/f{i:04d}.txt")
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    (tmp_path / "t.tar").write_bytes(buf.getvalue())
    subprocess.run(["tar", "xf", str(tmp_path / "t.tar"), "-C", str(mnt.path)], check=True)
    for i in range(0, 2000, 97):
        assert (mnt.path / f"tree/d{i % 40:02d}/f{i:04d}.txt").read_bytes() == pattern(i, i % 3000)
    assert sum(len(os.listdir(mnt.path / "tree" / d)) for d in os.listdir(mnt.path / "tree")) == 2000
    repo = mnt.path / "repo"
    repo.mkdir()
    for i in range(50):
        (repo / f"file{i}.txt").write_text(f"line {i}\n" * (i + 1))
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.com"}
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-q", "-m", "in the mount"],
                ["git", "fsck", "--no-progress"]):
        subprocess.run(cmd, cwd=repo, check=True, env=env, capture_output=True)
    r = subprocess.run(["git", "log", "--oneline"], cwd=repo, check=True, env=env, capture_output=True, text=True)
    assert "in the mount" in r.stdout
