"""The metadata engines -- SQLite on a real database file, etcd on a real etcd server -- through the same
rules: tree operations, slices (newer wins), the deletion queue, open-file sessions; SQLite's one-mount lock."""
from __future__ import annotations

import errno
import math
import os
import stat
import threading
import time

import pytest
import trio

from client.fs.meta import ROOT, MetaBusy, MetaError, Slice, coalesce
from client.fs.meta_sqlite import SqliteMeta
from wire.aio import InlinePause
from tests.conftest import dirty_pages

FILE = stat.S_IFREG | 0o644
DIR = stat.S_IFDIR | 0o755


def sl(off, length, extent, ext_off=0):
    return Slice(off, length, 1, extent, ext_off, ext_off, length, 0)


def test_reading_joins_pieces_that_follow_each_other_in_file_and_extent_into_one_request():
    # a file written 4 KiB + fsync at a time: a slice per write, back to back in one extent
    row = [sl(i * 4096, 4096, 7, 8192 + i * 4096) for i in range(300)]
    assert coalesce(row) == [Slice(0, 300 * 4096, 1, 7, 8192, 8192, 4096, 0)]
    # not neighbours: another extent, a gap in the extent, a gap in the file, an inline piece
    apart = [sl(0, 10, 1, 0), sl(10, 10, 2, 10), sl(20, 10, 2, 30), sl(40, 10, 2, 40),
             Slice(50, 10, 0, 0, 0, 0, 10, 0, b"x" * 10), Slice(60, 10, 0, 0, 0, 0, 10, 0, b"y" * 10)]
    assert coalesce(apart) == apart
    assert coalesce([]) == []


def sqlite_in_thread(path: str) -> SqliteMeta:
    """A SQLite engine whose transactions all go to its worker thread (as during the pause after a slow one)."""
    m = SqliteMeta(path)
    m.inline.hold()
    return m


@pytest.fixture(params=["sqlite", "sqlite-thread", "etcd"])
def engine(request, tmp_path):
    """A factory for a fresh engine of each kind (etcd: a real server, a volume of its own; SQLite with its
    transactions in the event loop, and all in its worker thread)."""
    if request.param.startswith("sqlite"):
        make = SqliteMeta if request.param == "sqlite" else sqlite_in_thread
        yield lambda: make(str(tmp_path / "m.db"))
        return
    from client.fs.meta_etcd import EtcdMeta
    from tools.etcd_cluster import EtcdProc, etcd_binary
    try:
        etcd_binary()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    p = EtcdProc(tmp_path / "etcd").start()
    try:
        yield lambda: EtcdMeta(p.url + "/t")
    finally:
        p.stop()


def test_tree_slices_and_queue(engine):
    async def main():
        m = engine()
        d = await m.create(ROOT, b"d", DIR, 0, 0)
        f = await m.create(d.ino, b"f", FILE, 0, 0)
        assert (await m.lookup(d.ino, b"f")).ino == f.ino
        assert (await m.getattr(ROOT)).nlink == 3
        with pytest.raises(MetaError) as e:
            await m.create(d.ino, b"f", FILE, 0, 0)
        assert e.value.errno == errno.EEXIST
        with pytest.raises(MetaError) as e:
            await m.create(d.ino, b"x" * 256, FILE, 0, 0)
        assert e.value.errno == errno.ENAMETOOLONG
        with pytest.raises(MetaError) as e:
            await m.rmdir(ROOT, b"d")
        assert e.value.errno == errno.ENOTEMPTY

        await m.commit(f.ino, [sl(0, 100, 1)], 100, 1)
        await m.commit(f.ino, [sl(40, 20, 2)], 60, 2)      # overwrite the middle: 3 pieces
        got = await m.slices(f.ino)
        assert [(s.off, s.length, s.extent, s.ext_off) for s in got] == [(0, 40, 1, 0), (40, 20, 2, 0),
                                                                         (60, 40, 1, 60)]
        assert (await m.getattr(f.ino)).size == 100
        await m.commit(f.ino, [sl(0, 100, 3)], 100, 3)     # covers everything: extents 1, 2 unreferenced
        assert not await m.referenced(1, 1) and not await m.referenced(1, 2)
        assert {e for _, e in await m.queued(10)} >= {1, 2}
        await m.truncate(f.ino, 10, 4)
        assert [(s.off, s.length) for s in await m.slices(f.ino)] == [(0, 10)]
        await m.truncate(f.ino, 1000, 5)
        assert (await m.getattr(f.ino)).size == 1000

        g = await m.create(ROOT, b"g", FILE, 0, 0)
        assert await m.rename(d.ino, b"f", ROOT, b"g") is not None    # replaces g (now unlinked)
        assert (await m.getattr(g.ino)).nlink == 0
        await m.remove(g.ino)
        with pytest.raises(MetaError) as e:
            await m.rename(ROOT, b"g", ROOT, b"d", noreplace=True)
        assert e.value.errno == errno.EEXIST
        await m.opened(f.ino)                                  # open (on this mount) ...
        a, gone = await m.unlink(ROOT, b"g", held=lambda ino: False)     # ... when its last link goes
        assert a.nlink == 0 and not gone and await m.orphans() == []
        assert not await m.remove(f.ino)                       # still open: kept
        assert (await m.slices(f.ino))
        assert await m.closed(f.ino)                           # the last close removes it
        with pytest.raises(MetaError):
            await m.getattr(f.ino)
        h = await m.create(ROOT, b"h", FILE, 0, 0)            # unlinked while nobody has it open (a crash
        await m.unlink(ROOT, b"h")                             # before the remove): an orphan to sweep
        assert await m.orphans() == [h.ino]
        assert await m.remove(h.ino) and await m.orphans() == []
        k = await m.create(ROOT, b"k", FILE, 0, 0)            # closed, kept by nobody: gone with its link
        await m.link(k.ino, ROOT, b"k2")
        assert not (await m.unlink(ROOT, b"k", held=lambda ino: False))[1]      # another link is left
        assert not (await m.unlink(ROOT, b"k2", held=lambda ino: True))[1]      # this process keeps it
        assert await m.orphans() == [k.ino] and await m.remove(k.ino)
        j = await m.create(ROOT, b"j", FILE, 0, 0)
        a, gone = await m.unlink(ROOT, b"j", held=lambda ino: False)
        assert gone and a.nlink == 0 and await m.orphans() == []
        with pytest.raises(MetaError):
            await m.getattr(j.ino)
        assert not await m.referenced(1, 3)
        assert await m.check() == []
        await m.close()
    trio.run(main)


def test_listing_a_directory_costs_sqlite_work_in_proportion_to_its_entries(tmp_path):
    """readdir continues after the last entry's cookie (dentries_dir: the directory's entries in cookie
    order), rather than sorting the rest of the directory at every batch: four times the entries, about four
    times SQLite's work (counted in its VM steps, not timed), where it was quadratic."""
    async def main():
        m = SqliteMeta(str(tmp_path / "m.db"))
        steps = []
        for n in (1000, 4000):
            d = await m.create(ROOT, b"d%d" % n, DIR, 0, 0)
            for i in range(n):
                await m.create(d.ino, b"f%07d" % ((i * 7919) % n), FILE, 0, 0)
            count = [0]

            def tick():
                count[0] += 1
            m.db.set_progress_handler(tick, 100)
            after, seen = 0, 0
            while batch := await m.readdir(d.ino, after, 512):      # the mount's batches (DnFS.readdir)
                seen += len(batch)
                after = batch[-1][2]
            m.db.set_progress_handler(None, 0)
            assert seen == n
            steps.append(count[0])
        await m.close()
        assert steps[1] < 6 * steps[0], steps
    trio.run(main)


def test_second_open_is_refused(tmp_path):
    m = SqliteMeta(str(tmp_path / "m.db"))
    with pytest.raises(MetaBusy, match="in use"):
        SqliteMeta(str(tmp_path / "m.db"))
    trio.run(m.close)
    SqliteMeta(str(tmp_path / "m.db"))


def test_a_durable_commit_is_on_the_disk_when_it_returns(tmp_path):
    """SQLite: ``commit(durable=True)`` (an fsync's commit) returns only once the WAL holding it has been
    written out and synced -- in one trip to the worker thread, or right in the event loop when the mount has
    nothing else in flight (``quiet``); a plain commit leaves it in the page cache (``synchronous=NORMAL``)
    until a later sync."""
    async def main():
        m = SqliteMeta(str(tmp_path / "m.db"))
        m.inline.slow = float("inf")       # a loaded machine's slow fsync must not send the next ones away
        wal = str(tmp_path / "m.db-wal")
        f = await m.create(ROOT, b"f", FILE, 0, 0)
        await m.commit(f.ino, [sl(0, 4096, 1)], 4096, 1)
        plain = dirty_pages(wal)
        if plain is None:
            pytest.skip("no cachestat system call on this kernel: the page cache's dirty state is not visible")
        threads = m.thread_txs
        a = await m.commit(f.ino, [sl(4096, 4096, 2)], 8192, 2, durable=True)   # in the worker thread
        durable = dirty_pages(wal)
        assert a.size == 8192 and [s.extent for s in await m.slices(f.ino)] == [1, 2]
        assert plain > 0 and durable == 0, (plain, durable)
        assert m.thread_txs == threads + 1
        # the mount has nothing else in flight: the same, right in the event loop
        m.quiet = lambda: True
        await m.commit(f.ino, [sl(8192, 4096, 3)], 12288, 3)
        assert dirty_pages(wal) > 0
        await m.commit(f.ino, [sl(12288, 4096, 4)], 16384, 4, durable=True)
        assert dirty_pages(wal) == 0 and m.thread_txs == threads + 1
        await m.commit(f.ino, [sl(16384, 4096, 5)], 20480, 5)
        await m.sync()
        assert dirty_pages(wal) == 0 and m.thread_txs == threads + 1
        await m.close()
    trio.run(main)


def test_concurrent_durable_commits_share_wal_fsyncs_and_each_returns_with_the_earlier_ones_on_the_disk(tmp_path):
    """SQLite: eight files' fsyncs at once (durable commits) share the WAL's fsyncs -- one out at a time, the
    commits that arrive meanwhile covered together by the next (group commit) -- instead of one fsync each in
    a row.  Each still returns only once every commit made before it started is on the device (the WAL's
    pages below where it stood), and after the last, the whole WAL is."""
    async def main():
        m = SqliteMeta(str(tmp_path / "m.db"))
        wal = str(tmp_path / "m.db-wal")
        files = [await m.create(ROOT, b"f%d" % i, FILE, 0, 0) for i in range(8)]
        if dirty_pages(wal) is None:
            pytest.skip("no cachestat system call on this kernel: the page cache's dirty state is not visible")
        fsyncs = 0
        real = m._fsync_wal

        def counted():
            nonlocal fsyncs
            fsyncs += 1
            real()
        m._fsync_wal = counted
        rounds, late = 10, []

        async def writer(f):
            for r in range(rounds):
                before = os.path.getsize(wal)       # every commit made so far ends below this
                a = await m.commit(f.ino, [sl(r * 4096, 4096, 100 * f.ino + r)], (r + 1) * 4096, r, durable=True)
                assert a.size == (r + 1) * 4096
                if dirty_pages(wal, before):
                    late.append((f.ino, r))
                await trio.lowlevel.checkpoint()
        async with trio.open_nursery() as n:
            for f in files:
                n.start_soon(writer, f)
        assert not late, late
        assert dirty_pages(wal) == 0
        commits = len(files) * rounds
        assert fsyncs < commits / 2, (fsyncs, commits)
        assert [len(await m.slices(f.ino)) for f in files] == [rounds] * len(files)
        await m.close()
    trio.run(main)


def test_a_slow_transaction_in_the_event_loop_sends_the_next_ones_to_the_worker_thread(tmp_path):
    """SQLite runs a transaction right in the event loop while its connection is free; a slow one (a WAL
    checkpoint, a slow disk) sends the next ones to the worker thread for a while (``InlinePause``), so a slow
    disk does not stall the loop on every metadata call.  Both ways give the same answers."""
    async def main():
        m = SqliteMeta(str(tmp_path / "m.db"))
        f = await m.create(ROOT, b"f", FILE, 0, 0)
        assert (m.inline_txs, m.thread_txs) == (1, 0)
        m.inline.slow = 0.0                       # every transaction in the loop that waits counts as slow,
        m.inline.share = 1e-6                     # and keeps the next ones out of the loop for long
        m.db.create_function("disk", 0, lambda: time.sleep(0.002))     # this one waits, as for a slow disk
        m.db.execute("CREATE TEMP TRIGGER slow AFTER INSERT ON slices BEGIN SELECT disk(); END")
        await m.commit(f.ino, [sl(0, 10, 1)], 10, 1)
        assert (m.inline_txs, m.thread_txs) == (2, 0)
        for i in range(3):
            assert (await m.getattr(f.ino)).size == 10
        assert (m.inline_txs, m.thread_txs) == (2, 3)
        await m.close()
    trio.run(main)


def test_transactions_in_the_event_loop_let_the_other_tasks_run_once_a_turn_not_after_each_one():
    """A transaction run in the event loop used to end with a scheduler pass of its own, so every FUSE
    request paid one more pass than it needed (dnfs ``utime`` in a loop: 11% more mount CPU per op).  Now the
    engine lets the other tasks run once ``turn`` seconds of loop time have passed since it last did
    (``InlinePause.yield_due``): a transaction between other awaits costs no pass, and a run of them back to
    back -- a sweep of many orphans -- still cannot hold the loop for longer than about a turn."""
    p = InlinePause(turn=0.001)
    assert p.yield_due(10.0)                  # the first one yields
    assert not p.yield_due(10.0005)           # within the turn: no pass
    assert p.yield_due(10.0011)               # the turn is up
    assert not p.yield_due(10.0012)


def test_a_long_run_of_transactions_in_the_event_loop_does_not_starve_the_other_tasks(tmp_path):
    """Metadata reads back to back, each right in the event loop: another task still runs between them,
    again and again, while the reads go on.  (Fewer reads than CHECKPOINT_COMMITS: a WAL checkpoint goes to
    the worker thread, and that wait alone would let the other task run.)"""
    async def main():
        m = SqliteMeta(str(tmp_path / "m.db"))
        # many turns within the run, however fast the reads here; a loaded box's slow read must not send the
        # rest to the worker thread (where they would not count)
        m.inline = InlinePause(slow=math.inf, turn=0.00005)
        f = await m.create(ROOT, b"f", FILE, 0, 0)
        ran = []
        done = False

        async def other():
            while not done:
                ran.append(m.inline_txs)          # how far the reads had got each time this task ran
                await trio.lowlevel.checkpoint()

        async with trio.open_nursery() as n:
            n.start_soon(other)
            start, reads = m.inline_txs, SqliteMeta.CHECKPOINT_COMMITS - 2
            for _ in range(reads):
                assert (await m.getattr(f.ino)).ino == f.ino
            done = True
        during = [k for k in ran if start < k < start + reads]
        assert len(set(during)) >= 2, (m.inline_txs, m.thread_txs, ran[:20])
        await m.close()
    trio.run(main)


def test_the_wal_is_checkpointed_in_the_worker_thread_never_inside_a_commit(tmp_path):
    """SQLite's automatic checkpoint ran inside a commit: in the event loop, a 4 MiB copy and two fsyncs
    (16-26 ms here), and -- slow -- each sent the next second's transactions to the worker thread: under a
    burst of changes nearly all of them.  The engine turns it off and checkpoints in the worker thread every
    CHECKPOINT_COMMITS commits: none runs in the event loop's thread, the WAL stays small, and every change is
    there after a reopen."""
    path = tmp_path / "m.db"
    n = 3000
    where = []

    async def burst():
        m = SqliteMeta(str(path))
        loop_thread = threading.get_ident()
        m.db.set_trace_callback(lambda sql: where.append(threading.get_ident() == loop_thread)
                                if "wal_checkpoint" in sql else None)
        for i in range(n):
            await m.create(ROOT, b"f%d" % i, FILE, 0, 0)
        auto = m.db.execute("PRAGMA wal_autocheckpoint").fetchone()[0]
        wal = os.path.getsize(f"{path}-wal")
        await m.close()
        return auto, wal

    async def count():
        m = SqliteMeta(str(path))
        names = await m.readdir(ROOT, 0, 10 * n)
        await m.close()
        return len(names)

    auto, wal = trio.run(burst)
    assert auto == 0                      # SQLite never checkpoints inside a commit; we do, in the thread
    assert len(where) >= n // SqliteMeta.CHECKPOINT_COMMITS and not any(where), where
    assert wal < 8 << 20, wal             # (SQLite restarts a checkpointed WAL from its beginning)
    assert trio.run(count) == n
