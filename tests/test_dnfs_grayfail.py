"""A gray failure under a real mount: a partition's leader frozen (SIGSTOP -- it holds its sockets and answers
nothing) while an application writes and fsyncs files through `dnfs mount --cluster DIR`.

A real local cluster made by `dnctl cluster up` (etcd, the cluster manager, three datanodes, two partitions;
a cluster secret and etcd users, as it makes them), a real kernel FUSE mount.  The writer's longest stall is
bounded by seconds, it sees no error, every file it fsynced reads back intact from every replica afterwards,
and the woken node acknowledges nothing at the epoch it was frozen in."""
from __future__ import annotations

import functools
import json
import os
import pathlib
import signal
import sqlite3
import threading
import time

import pytest
import trio

from client.sdk import ClientError, DataClient
from tests.conftest import pattern, run_cli
from tools.cluster import local_access
from tools.etcd_cluster import etcd_binary
from wire.etcdmap import Etcd
from wire.protocol import Result

pytestmark = [pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="no /dev/fuse")]
try:
    etcd_binary()
except FileNotFoundError as e:
    pytestmark.append(pytest.mark.skip(reason=str(e)))

FREEZE_S = float(os.environ.get("DNFS_FREEZE_S", "20"))   # how long the leader stays frozen
STALL_MAX_S = 5.0           # the longest a single file's open+write+fsync+close may take meanwhile
FILE = 256 << 10


dnctl = functools.partial(run_cli, "tools.dnctl", check=True)
dnfs = functools.partial(run_cli, "client.fs.cli", check=True)


async def until(what: str, probe, timeout: float = 60.0):
    with trio.move_on_after(timeout):
        while True:
            got = await probe()
            if got:
                return got
            await trio.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


class Writer(threading.Thread):
    """Writes file after file into ``dir``: open, write, fsync, close -- and records how long each took and
    what failed."""

    def __init__(self, dir):
        super().__init__(daemon=True)
        self.dir, self.stop = dir, threading.Event()
        self.done: list[tuple[str, float, float]] = []      # (name, started, seconds) of fsynced files
        self.errors: list[str] = []

    def run(self):
        i = 0
        while not self.stop.is_set():
            name = f"f{i:05d}"
            t0 = time.monotonic()
            try:
                fd = os.open(self.dir / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    view = memoryview(pattern(i, FILE))
                    while view:
                        view = view[os.write(fd, view):]
                    os.fsync(fd)
                finally:
                    os.close(fd)
                self.done.append((name, t0, time.monotonic() - t0))
            except OSError as e:
                self.errors.append(f"{name}: {e}")
            i += 1


def test_frozen_leader_costs_seconds_and_acks_nothing_at_its_old_epoch(tmp_path):
    root, mnt = tmp_path / "c", tmp_path / "mnt"
    mnt.mkdir()
    dnctl("cluster", "up", "--nodes", 3, "--cluster", root)
    info = json.loads((root / "cluster.json").read_text())
    addrs = [n["addr"] for n in info["nodes"]]
    pids = {n["addr"]: n["pid"] for n in info["nodes"]}
    secret = root / "cluster.secret"          # a cluster made by `cluster up` authenticates: so do we
    access = local_access(info["etcd"], "admin")
    et = Etcd(info["etcd"]["url"], access=access)
    frozen = None
    try:
        async def two_writable():
            parts = await et.parts()
            ok = [p for p in parts.values() if p.state == "writable" and p.installed]
            return parts if len(ok) >= 2 else None
        views = trio.run(until, "two writable partitions (the manager makes the second)", two_writable)
        leader = views[1].leader
        dnfs("mount", "--cluster", root, mnt)
        try:
            w = Writer(mnt)

            async def freeze():
                """Freeze the leader of partition 1 for FREEZE_S while the writer goes on.  A client whose map
                comes from the nodes (it never hears of etcd) sends an append at the old epoch just before the
                node wakes (it waits in the node's socket) and one right after: neither may be acknowledged."""
                nonlocal frozen
                answers = []
                async with DataClient.open(addrs, timeout=30, secret=str(secret)) as dc:
                    eid = await dc.create_extent(1)
                    await dc.append(1, eid, 0, b"a" * 4096)
                    assert dc.partition(1).replicas[0] == leader

                    async def append(off, data):
                        try:
                            answers.append(await dc.append(1, eid, off, data))
                        except ClientError as e:
                            answers.append(e)
                    w.start()
                    await trio.sleep(3)
                    assert w.done and not w.errors, w.errors
                    frozen = pids[leader]
                    os.kill(frozen, signal.SIGSTOP)
                    t_freeze = time.monotonic()
                    await trio.sleep(FREEZE_S - 0.5)
                    async with trio.open_nursery() as n:
                        n.start_soon(append, 4096, b"b" * 4096)
                        await trio.sleep(0.3)
                        os.kill(frozen, signal.SIGCONT)
                        frozen = None
                    await append(4096, b"c" * 4096)
                return eid, t_freeze, answers
            eid, t_freeze, answers = trio.run(freeze)
            woke = time.monotonic()
            time.sleep(5)
        finally:
            if frozen is not None:
                os.kill(frozen, signal.SIGCONT)
            w.stop.set()
            if w.is_alive() or w.ident is not None:
                w.join(60)
            dnfs("umount", mnt, check=False)
        assert not w.is_alive(), "the writer hangs"
        during = [d for d in w.done if t_freeze - 1 <= d[1] <= woke]
        stall = max(s for _n, _t, s in w.done)
        slowest = sorted(w.done, key=lambda d: -d[2])[:3]
        print(f"files fsynced: {len(w.done)} ({len(during)} during the freeze); longest stall {stall:.2f}s "
              f"(slowest: {', '.join(f'{s:.2f}s at {t - t_freeze:+.1f}s' for _n, t, s in slowest)}); "
              f"errors {len(w.errors)}; the woken node answered {answers}")
        assert not w.errors, w.errors
        assert len(during) > FREEZE_S, f"hardly any writes went through during the freeze: {len(during)}"
        assert stall <= STALL_MAX_S, sorted(s for _n, _t, s in w.done)[-5:]
        # both appends refused: by the node's self-fencing (its lease lapsed while it was frozen), or because
        # it has dropped the copy the new view no longer gives it -- and nothing of them landed (below)
        for a in answers:
            assert isinstance(a, ClientError) and a.result in (Result.NOT_LEADER, Result.NOT_FOUND), answers
        node_log = next(pathlib.Path(n["log"]) for n in info["nodes"] if n["addr"] == leader).read_text()
        assert "self-fencing: no write is acknowledged" in node_log
        mount_log = (root / "dnfs.db.log").read_text()
        assert "(from etcd)" in mount_log, mount_log[-2000:]     # --cluster DIR: the map followed by watch

        async def verify():
            async def healed():            # the woken node dropped its stale copy and was filled again
                ps = await et.parts()
                return ps if all(len(p.replicas) == 3 and p.state == "writable" for p in ps.values()) else None
            parts = await until("every partition back to three synced replicas", healed, 120)
            db = sqlite3.connect(f"file:{root / 'dnfs.db'}?mode=ro", uri=True)
            try:
                rows = db.execute("SELECT d.name, s.off, s.len, s.pid, s.extent, s.ext_off FROM dentries d "
                                  "JOIN slices s ON s.ino = d.ino WHERE d.parent = 1").fetchall()
            finally:
                db.close()
            files: dict[str, list] = {}
            for name, off, n, pid, extent, ext_off in rows:
                files.setdefault(name.decode(), []).append((off, n, pid, extent, ext_off))
            async with DataClient.open(etcd=info["etcd"]["url"], etcd_access=access, timeout=30,
                                       secret=str(secret)) as dc:
                for name, _t, _s in w.done:
                    want = pattern(int(name[1:]), FILE)
                    assert sum(n for _o, n, *_ in files[name]) == FILE, (name, files[name])
                    for off, n, pid, extent, ext_off in files[name]:
                        for addr in parts[pid].replicas:
                            got = await dc.read(pid, extent, ext_off, n, replica=addr)
                            assert got == want[off:off + n], f"{name} [{off}, +{n}) differs on {addr}"
                for addr in parts[1].replicas:     # the old epoch's appends left nothing on any replica
                    marks = await dc.watermarks(1, addr)
                    assert marks.get(eid, 4096) == 4096, (addr, marks)
        trio.run(verify)
    finally:
        if frozen is not None:
            os.kill(frozen, signal.SIGCONT)
        dnctl("cluster", "down", "--cluster", root, "--timeout", 10, check=False)
