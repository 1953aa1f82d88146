"""dnfs's write-back, without a mount or a cluster: the buffered ranges, the budget's flush decisions, the
partition a retried write goes to, the slices appended bytes become (client/fs/writeback.py, pure), and the
writer (client/fs/writer.py) driving them against an in-memory cluster and metadata engine."""
from __future__ import annotations

import errno

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from client.fs.meta import Attr
from client.fs.reclaim import DataLock
from client.fs.writeback import Budget, DirtyMap, FileBuffer, Flush, Placement, to_slices
from client.fs.writer import AVOID_S, DataWriter, FileWriter
from client.sdk import ClientError, Location
from wire.crc import crc32c
from wire.protocol import Result


# -- which bytes are buffered ---------------------------------------------------------------------------

class BufferedWrites(RuleBasedStateMachine):
    """Writes, truncates and flushes of two files' buffers against a model of every byte (None: not
    buffered): a read sees the newest bytes, the flushing ones under the buffered ones, and the budget counts
    exactly the bytes held."""

    def __init__(self):
        super().__init__()
        self.budget = Budget(1 << 20, 1 << 16)
        self.files = [FileBuffer(self.budget), FileBuffer(self.budget)]
        self.model: list[dict[int, int]] = [{}, {}]          # offset -> byte, buffered or flushing
        self.dirty_model: list[dict[int, int]] = [{}, {}]    # offset -> byte, buffered only
        self.n = 0

    @rule(f=st.integers(0, 1), off=st.integers(0, 300), n=st.integers(1, 80))
    def write(self, f, off, n):
        self.n += 1
        data = bytes((self.n + i) % 251 + 1 for i in range(n))
        self.files[f].write(off, data)
        for i, b in enumerate(data):
            self.model[f][off + i] = b
            self.dirty_model[f][off + i] = b

    @rule(f=st.integers(0, 1), size=st.integers(0, 400))
    def truncate(self, f, size):
        self.files[f].truncate(size)
        for k in [k for k in self.dirty_model[f] if k >= size]:
            del self.dirty_model[f][k]
        self._remodel(f)

    @rule(f=st.integers(0, 1))
    def start_flush(self, f):
        if self.files[f].flushing is None and self.files[f].dirty:
            m = self.files[f].take()
            assert dict(_bytes_of(m)) == self.dirty_model[f]
            self.dirty_model[f] = {}

    @rule(f=st.integers(0, 1))
    def finish_flush(self, f):
        self.files[f].written()
        self._remodel(f)

    @rule(f=st.integers(0, 1))
    def drop(self, f):
        self.files[f].drop()
        self.dirty_model[f] = {}
        self._remodel(f)

    def _remodel(self, f):
        fl = self.files[f].flushing
        self.model[f] = {**(dict(_bytes_of(fl)) if fl else {}), **self.dirty_model[f]}

    @invariant()
    def reads_see_the_newest_bytes(self):
        for f, buf in enumerate(self.files):
            out = bytearray(420)
            buf.overlay(0, out)
            assert out == bytes(self.model[f].get(i, 0) for i in range(420))
            assert buf.pending == bool(self.model[f])

    @invariant()
    def buffered_ranges_are_sorted_and_apart(self):
        for buf in self.files:
            ranges = buf.dirty.ranges()
            for (a, x), (b, _y) in zip(ranges, ranges[1:]):
                assert a + len(x) < b          # touching ranges are one range: a flush sends each run once

    @invariant()
    def the_budget_counts_every_byte_held(self):
        assert self.budget.used == sum(b.nbytes for b in self.files)
        assert self.budget.used == sum(len(_held(b.dirty)) + len(_held(b.flushing)) for b in self.files)


def _bytes_of(m: DirtyMap):
    for off, buf in m.ranges():
        for i, b in enumerate(buf):
            yield off + i, b


def _held(m: DirtyMap | None) -> dict[int, int]:
    return dict(_bytes_of(m)) if m else {}


TestBufferedWrites = BufferedWrites.TestCase
TestBufferedWrites.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


# -- when a buffer goes to the cluster --------------------------------------------------------------------

@pytest.mark.parametrize("buffered, busy, then", [
    (4095, False, Flush.NONE),            # less than a chunk stays buffered
    (4096, False, Flush.BACKGROUND),      # a full chunk is written behind the writer
    (4095, True, Flush.NONE),             # the next chunk fills while one is being written
    (4096, True, Flush.WAIT),             # ... and once full, the writer waits for it to be taken
    (8192, False, Flush.BACKGROUND),
])
def test_a_write_flushes_a_full_chunk_behind_the_caller_and_waits_with_the_next_full(buffered, busy, then):
    assert Budget(1 << 20, 4096).after_write(buffered, busy) is then


def test_the_budget_caps_the_chunk_and_flushes_down_to_half():
    b = Budget(10_000, 1 << 20)
    assert b.chunk == 10_000
    b.used = 10_001
    assert b.over() and not b.relieved()
    b.used = 5_001
    assert not b.over() and not b.relieved()
    b.used = 5_000
    assert b.relieved()


# -- how appended bytes become slices -----------------------------------------------------------------

@st.composite
def ranges_and_appends(draw):
    """Sorted, apart file ranges with their bytes, and the lengths the appends cut their payload into."""
    ranges, off = [], draw(st.integers(0, 50))
    for _ in range(draw(st.integers(1, 6))):
        n = draw(st.integers(1, 60))
        ranges.append((off, bytes(draw(st.integers(0, 255)) for _ in range(n))))
        off += n + draw(st.integers(1, 40))
    total = sum(len(b) for _o, b in ranges)
    cuts = sorted(set(draw(st.lists(st.integers(1, total - 1), max_size=8)))) if total > 1 else []
    lengths = [b - a for a, b in zip([0] + cuts, cuts + [total])]
    return ranges, lengths


@given(ranges_and_appends(), st.integers(0, 3))
@settings(max_examples=300, deadline=None)
def test_slices_say_where_each_buffered_byte_went(case, extents):
    """Payload = the ranges back to back, appended in pieces over several extents: each file byte's slice
    points at the extent byte that holds it, the slices tile the ranges in order, and each names its whole
    append (wpos, wlen, crc) so fsck can check it."""
    ranges, lengths = case
    payload = b"".join(b for _o, b in ranges)
    disk: dict[tuple[int, int, int], int] = {}       # (partition, extent, offset) -> byte
    locs, pos = [], 0
    for i, n in enumerate(lengths):
        pid, extent, off = 1 + i % 2, 10 + i % (extents + 1), 1000 * i
        piece = payload[pos:pos + n]
        for k, b in enumerate(piece):
            disk[(pid, extent, off + k)] = b
        locs.append(Location(pid, extent, off, n, crc32c(piece)))
        pos += n
    slices = to_slices([(o, len(b)) for o, b in ranges], locs)

    file_bytes = {o + i: b for o, buf in ranges for i, b in enumerate(buf)}
    covered = [s.off + i for s in slices for i in range(s.length)]
    assert covered == sorted(file_bytes)                          # every buffered byte once, in order
    for s in slices:
        assert s.length > 0
        for i in range(s.length):
            assert disk[(s.partition, s.extent, s.ext_off + i)] == file_bytes[s.off + i]
        whole = bytes(disk[(s.partition, s.extent, s.wpos + k)] for k in range(s.wlen))
        assert crc32c(whole) == s.crc and s.wpos <= s.ext_off and s.ext_off + s.length <= s.wpos + s.wlen


def test_appends_beyond_the_ranges_are_refused():
    with pytest.raises(ValueError):
        to_slices([(0, 4)], [Location(1, 1, 0, 8, 0)])


# -- which partition a write goes to ---------------------------------------------------------------------

def _up(pid: int) -> bool:
    return True


def test_a_write_starts_on_the_files_home_partition_and_passes_over_a_failed_one():
    avoid: dict[int, float] = {}
    p = Placement([1, 2, 3], 2, avoid, AVOID_S)
    assert p.next(0.0, _up) == 2
    assert not p.failed_on(2, 0.0, _up)
    assert p.next(0.0, _up) == 1
    # another flush (another file, home 2 too) prefers the others while the failure is fresh ...
    q = Placement([1, 2, 3], 2, avoid, AVOID_S)
    assert q.next(1.0, _up) == 1
    # ... and goes home again once it is not
    assert q.next(AVOID_S + 1.0, _up) == 2


def test_a_partition_the_map_says_cannot_take_writes_is_used_only_when_none_can():
    assert Placement([1, 2, 3], 1, {}, AVOID_S).next(0.0, lambda pid: pid == 3) == 3
    assert Placement([1, 2, 3], 1, {}, AVOID_S).next(0.0, lambda pid: False) == 1


def test_when_every_partition_failed_the_write_pauses_and_starts_over():
    p = Placement([1, 2], 1, {}, AVOID_S)
    assert not p.failed_on(1, 0.0, _up)
    assert p.failed_on(p.next(0.0, _up), 0.0, _up)        # 2 failed too: pause
    assert not p.failed and p.next(0.0, _up) == 1         # then both are tried again, home first


def test_a_full_partition_is_not_tried_again_and_all_full_is_enospc():
    p = Placement([1, 2, 3], 1, {}, AVOID_S)
    assert not p.filled(1)
    assert p.next(0.0, _up) == 2
    assert not p.filled(2)
    p.failed_on(3, 0.0, _up)                               # failed, but not full: still a candidate
    assert p.next(0.0, _up) == 3
    assert p.filled(3)


# -- the writer, against an in-memory cluster and metadata engine -------------------------------------------

class FakeCluster:
    """``DataClient.write`` over dicts: ``fail`` -> ClientError (after acknowledging ``ack`` bytes) for the
    next write to a partition; ``gate``: writes wait for it."""

    def __init__(self, partitions=(1, 2), free=1 << 30):
        self.extents: dict[tuple[int, int], bytearray] = {}
        self.partitions = {p: type("P", (), {"replicas": [f"n{p}"]})() for p in partitions}
        self.views: dict = {}
        self.fail: dict[int, tuple[Result, int]] = {}
        self.free = free
        self.writes: list[int] = []
        self.gate: trio.Event | None = None
        self._next = 0

    async def write(self, pid, data, elsewhere=None):
        if self.gate is not None:
            await self.gate.wait()
        self.writes.append(pid)
        self._next += 1
        extent = self._next
        buf = self.extents.setdefault((pid, extent), bytearray())
        mv = bytes(data)
        res, ack = self.fail.pop(pid, (None, len(mv)))
        done = []
        for pos in range(0, ack, 7):                        # 7-byte appends: slices cross the file's ranges
            piece = mv[pos:min(pos + 7, ack)]
            done.append(Location(pid, extent, len(buf), len(piece), crc32c(piece)))
            buf += piece
        if res is not None:
            e = ClientError(f"partition {pid}: {res.name}", res, f"n{pid}")
            e.done = done
            raise e
        return done

    async def admin(self, addr, op, **kw):
        return {"disk": {"total": 1 << 40, "free": self.free}}

    def read(self, slices, size) -> bytes:
        out = bytearray(size)
        for s in slices:
            out[s.off:s.end] = self.extents[(s.partition, s.extent)][s.ext_off:s.ext_off + s.length]
        return bytes(out)


class FakeMeta:
    inline_max = 0          # every byte goes to the (fake) cluster

    def __init__(self):
        self.slices: dict[int, list] = {}
        self.size: dict[int, int] = {}

    async def commit(self, ino, slices, size, mtime_ns, durable=False):
        self.slices.setdefault(ino, []).extend(slices)         # (no overlap in these tests: newer appended)
        self.size[ino] = max(self.size.get(ino, 0), size)
        return await self.getattr(ino, mtime_ns)

    async def getattr(self, ino, mtime_ns=0):
        return Attr(ino, 0o100644, 1, 0, 0, size=self.size.get(ino, 0), mtime_ns=mtime_ns, ctime_ns=mtime_ns)


async def _writer(nursery, cluster, *, budget=1 << 20, chunk=1 << 20, retry_s=30.0):
    meta = FakeMeta()
    w = DataWriter(meta, cluster, sorted(cluster.partitions), nursery, DataLock(), budget=budget, chunk=chunk,
                   write_retry_s=retry_s, forgotten=lambda f: None)
    return w, meta


def _open(w: DataWriter, ino: int) -> FileWriter:
    f = w.files[ino] = FileWriter(ino, 0, w.budget)
    f.opens = 1
    return f


def test_a_flush_whose_append_fails_writes_the_rest_elsewhere_and_commits_slices_of_every_byte():
    async def main():
        cluster = FakeCluster()
        async with trio.open_nursery() as n:
            w, meta = await _writer(n, cluster)
            f = _open(w, 1)                                   # home partition: 1 % 2 -> partition 2
            await w.write(f, 0, b"a" * 30)
            await w.write(f, 100, b"b" * 30)                  # a hole: two ranges, one payload
            cluster.fail[2] = (Result.REPLICATION_FAILED, 14)
            assert await w.flush(f)
            assert cluster.writes == [2, 1]                   # the unacknowledged rest went to partition 1
            assert cluster.read(meta.slices[1], 130) == b"a" * 30 + bytes(70) + b"b" * 30
            assert meta.size[1] == 130 and f.error is None
            assert not f.pending and w.budget.used == 0 and w.unwritten() is None
    trio.run(main)


def test_a_flush_to_full_datanodes_reports_enospc_once_and_lets_the_bytes_go():
    async def main():
        cluster = FakeCluster(free=1 << 10)
        async with trio.open_nursery() as n:
            w, meta = await _writer(n, cluster)
            f = _open(w, 1)
            await w.write(f, 0, b"x" * 100)
            cluster.fail[1] = cluster.fail[2] = (Result.REPLICATION_FAILED, 0)     # a follower's full disk
            assert not await w.flush(f)
            assert f.take_error() == errno.ENOSPC and f.take_error() is None
            assert cluster.writes == [2, 1] and 1 not in meta.slices
            assert w.budget.used == 0 and not f.pending
    trio.run(main)


def test_a_failed_write_is_retried_until_write_retry_s_then_reported_eio():
    async def main():
        cluster = FakeCluster()
        cluster.fail = type("Always", (dict,), {"pop": lambda self, pid, d: (Result.NOT_LEADER, 0)})()
        async with trio.open_nursery() as n:
            w, meta = await _writer(n, cluster, retry_s=5.0)
            f = _open(w, 1)
            await w.write(f, 0, b"x" * 10)
            t0 = trio.current_time()
            assert not await w.flush(f)
            assert f.error == errno.EIO and 5.0 <= trio.current_time() - t0 < 7.0
            assert set(cluster.writes) == {1, 2} and len(cluster.writes) > 4
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_full_chunk_is_written_in_the_background_and_the_next_full_one_waits_for_it():
    async def main():
        cluster = FakeCluster()
        cluster.gate = trio.Event()
        async with trio.open_nursery() as n:
            w, meta = await _writer(n, cluster, chunk=4096)
            f = _open(w, 1)
            await w.write(f, 0, b"a" * 4096)                  # a chunk: flushed behind the caller
            await trio.testing.wait_all_tasks_blocked()
            assert f.background and f.buf.flushing is not None and not f.buf.dirty
            await w.write(f, 4096, b"b" * 4095)               # the next chunk fills behind it: no wait
            returned = trio.Event()

            async def next_chunk():
                await w.write(f, 8191, b"c")                  # the next chunk full: the writer waits
                returned.set()
            n.start_soon(next_chunk)
            await trio.testing.wait_all_tasks_blocked()
            assert not returned.is_set()
            cluster.gate.set()                                # the first flush ends, the next takes the chunk
            await returned.wait()
            await trio.testing.wait_all_tasks_blocked()
            assert cluster.read(meta.slices[1], 8192) == b"a" * 4096 + b"b" * 4095 + b"c"
            assert w.budget.used == 0 and not f.background
    trio.run(main)


def test_a_full_chunk_waits_for_a_truncate_holding_the_file_and_is_written_after_it():
    async def main():
        cluster = FakeCluster()
        async with trio.open_nursery() as n:
            w, meta = await _writer(n, cluster, chunk=4096)
            f = _open(w, 1)
            returned = trio.Event()
            await f.flush_lock.acquire()                      # what a truncate of the file holds

            async def a_chunk():
                await w.write(f, 0, b"a" * 4096)
                returned.set()
            n.start_soon(a_chunk)
            await trio.testing.wait_all_tasks_blocked()
            assert not returned.is_set()
            f.flush_lock.release()
            with trio.fail_after(5):
                await returned.wait()
            await trio.testing.wait_all_tasks_blocked()
            assert cluster.read(meta.slices[1], 4096) == b"a" * 4096 and w.budget.used == 0
    trio.run(main)


def test_over_budget_the_largest_buffers_are_written_first_until_half_is_free():
    async def main():
        cluster = FakeCluster()
        async with trio.open_nursery() as n:
            w, meta = await _writer(n, cluster, budget=1000, chunk=1 << 20)
            small, big, other = _open(w, 1), _open(w, 2), _open(w, 3)
            await w.write(small, 0, b"s" * 200)
            await w.write(big, 0, b"b" * 600)
            await w.write(other, 0, b"o" * 201)                # 1001 > 1000: the 600 go, 401 < 500 is enough
            assert sorted(meta.slices) == [2]
            assert w.budget.used == 401 and small.pending and other.pending and not big.pending
    trio.run(main)


def test_a_closed_files_background_flush_lets_it_go_once_its_bytes_are_written():
    async def main():
        cluster = FakeCluster()
        let_go = []
        async with trio.open_nursery() as n:
            w = DataWriter(FakeMeta(), cluster, [1, 2], n, DataLock(), budget=1 << 20, chunk=1 << 20,
                           write_retry_s=5.0, forgotten=let_go.append)
            f = _open(w, 7)
            await w.write(f, 0, b"z" * 10)
            f.opens = 0                                       # closed, with write-back: the flush is behind it
            w.flush_soon(f)
            assert 7 in w.files
            await trio.testing.wait_all_tasks_blocked()
            assert let_go == [f] and 7 not in w.files
    trio.run(main)


def test_a_reclaim_pass_waits_for_the_flushes_under_way_and_holds_new_ones_back():
    """No extent is released while a flush could still commit a slice into it (client/fs/reclaim.py)."""
    async def main():
        lock, seen = DataLock(), []

        async def flush(name, hold):
            await lock.acquire_shared()
            seen.append(f"{name} in")
            await trio.sleep(hold)
            seen.append(f"{name} out")
            await lock.release_shared()

        async def reclaim():
            await lock.acquire_exclusive()
            seen.append("reclaim in")
            await trio.sleep(1)
            seen.append("reclaim out")
            await lock.release_exclusive()

        async with trio.open_nursery() as n:
            n.start_soon(flush, "a", 2)
            await trio.sleep(0.5)
            n.start_soon(reclaim)
            await trio.sleep(0.5)
            n.start_soon(flush, "b", 1)          # arrives while the pass waits for a: after the pass
        assert seen == ["a in", "a out", "reclaim in", "reclaim out", "b in", "b out"]
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_reclaim_pass_lets_flushes_go_on_while_the_datanodes_delete(tmp_path):
    """The reclaimer holds the data lock only while it checks which queued extents nothing references (and
    tells the SDK never to append to them), not across the deletions on the datanodes: a file's flush starts
    while a deletion still waits for its datanode, and the extent is released and dequeued once it answers."""
    from client.fs.meta import ROOT, Slice
    from client.fs.meta_sqlite import SqliteMeta
    from client.fs.reclaim import Reclaimer

    class SlowDeletes:
        def __init__(self):
            self.forgotten, self.deleted = [], []
            self.asked, self.answer = trio.Event(), trio.Event()

        def forget_extent(self, pid, extent):
            self.forgotten.append((pid, extent))

        async def delete_extent(self, pid, extent):
            self.asked.set()
            await self.answer.wait()           # a datanode slow to answer
            self.deleted.append((pid, extent))

    async def main():
        meta = SqliteMeta(str(tmp_path / "m.db"))
        f = await meta.create(ROOT, b"f", 0o100644, 0, 0)
        await meta.commit(f.ino, [Slice(0, 4096, 1, 5, 0, 0, 4096, 0)], 4096, 1)
        await meta.truncate(f.ino, 0, 2)       # extent 1/5 goes to the deletion queue
        assert await meta.queued(10) == [(1, 5)]
        dc, lock = SlowDeletes(), DataLock()
        r = Reclaimer(meta, dc, lock)
        async with trio.open_nursery() as n:
            n.start_soon(r.drain)
            await dc.asked.wait()
            assert dc.forgotten == [(1, 5)]
            with trio.fail_after(5):
                await lock.acquire_shared()    # a flush, while the deletion is out
            await lock.release_shared()
            dc.answer.set()
        assert dc.deleted == [(1, 5)] and r.deleted == 1 and await meta.queued(10) == []
        await meta.close()
    trio.run(main)


def test_a_reclaim_pass_cancelled_while_it_waits_lets_flushes_start():
    async def main():
        lock = DataLock()
        await lock.acquire_shared()
        with trio.move_on_after(1):
            await lock.acquire_exclusive()           # a flush holds it: the pass waits, then gives up
        with trio.fail_after(1):
            await lock.acquire_shared()              # a new flush is not held back by the pass that left
        await lock.release_shared()
        await lock.release_shared()
        with trio.fail_after(1):
            await lock.acquire_exclusive()
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_flush_cancelled_while_it_writes_still_lets_the_reclaim_pass_in():
    async def main():
        lock = DataLock()
        with trio.CancelScope() as cs:           # a flush cancelled mid-write (the mount stopping)
            await lock.acquire_shared()
            cs.cancel()
            try:
                await trio.sleep(1)
            finally:
                await lock.release_shared()
        with trio.fail_after(1):
            await lock.acquire_exclusive()       # the unmount's last pass
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
