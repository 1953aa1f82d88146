"""A write-back flush that fails for good (client/fs/writer.py), without a mount: what the cluster acknowledged
is committed, every other byte is let go, the size is the stored one, and the error is reported once -- by
the write that waited for the flush, else the file's next write, fsync or close.  The in-memory cluster and
metadata of tests/test_dnfs_writer.py."""
from __future__ import annotations

import errno

import pytest
import trio
import trio.testing

from client.fs.writeback import acked_ranges
from tests.test_dnfs_writer import FakeCluster, _open, _writer
from wire.protocol import Result


def test_acked_ranges_are_the_payloads_first_bytes():
    ranges = [(0, 30), (100, 30), (200, 5)]
    assert acked_ranges(ranges, 0) == []
    assert acked_ranges(ranges, 10) == [(0, 10)]
    assert acked_ranges(ranges, 30) == [(0, 30)]
    assert acked_ranges(ranges, 45) == [(0, 30), (100, 15)]
    assert acked_ranges(ranges, 65) == ranges
    assert acked_ranges(ranges, 99) == ranges


def test_a_failed_flush_keeps_what_was_acknowledged_and_lets_the_rest_go():
    async def main():
        cluster = FakeCluster(partitions=(1,), free=1 << 10)
        async with trio.open_nursery() as n:
            w, meta = await _writer(n, cluster)
            lost = []
            w._lost = lost.append
            f = _open(w, 1)
            await w.write(f, 0, b"a" * 30)
            await w.write(f, 100, b"b" * 30)
            cluster.fail[1] = (Result.NO_SPACE, 45)         # the datanode took 45 bytes, then its disk was full
            assert not await w.flush(f)
            assert cluster.read(meta.slices[1], 115) == b"a" * 30 + bytes(70) + b"b" * 15
            assert meta.size[1] == 115 and f.size == 115    # the size claims no byte that was not stored
            assert lost == [f] and not f.pending and w.budget.used == 0
            assert f.take_error() == errno.ENOSPC and f.take_error() is None
    trio.run(main)


def test_bytes_buffered_behind_a_failed_flush_go_with_it_and_nothing_is_flushed_until_it_is_reported():
    async def main():
        cluster = FakeCluster(partitions=(1,), free=1 << 10)
        cluster.gate = trio.Event()
        async with trio.open_nursery() as n:
            w, meta = await _writer(n, cluster, chunk=4096)
            f = _open(w, 1)
            await w.write(f, 0, b"a" * 4096)                # a chunk: flushed behind the writer
            await trio.testing.wait_all_tasks_blocked()
            await w.write(f, 4096, b"b" * 1000)             # buffered behind it
            cluster.fail[1] = (Result.NO_SPACE, 0)
            cluster.gate.set()
            await trio.testing.wait_all_tasks_blocked()
            assert f.error == errno.ENOSPC and not f.pending and f.size == 0
            assert not await w.flush(f)                     # nothing is written until the error is reported
            assert cluster.writes == [1] and 1 not in meta.slices
            assert f.take_error() == errno.ENOSPC
            await w.write(f, 0, b"c" * 10)                  # reported: the file takes writes again
            assert await w.flush(f)
            assert cluster.read(meta.slices[1], 10) == b"c" * 10 and f.size == 10
    trio.run(main)


@pytest.mark.parametrize("result, err", [(Result.NO_SPACE, errno.ENOSPC), (Result.DISK_ERROR, errno.EIO)])
def test_the_write_waiting_behind_a_failed_flush_reports_it(result, err):
    """The write that a full buffer makes wait for the failing flush returns its error -- its own bytes are
    let go with the rest -- and the error is not reported a second time."""
    async def main():
        cluster = FakeCluster(partitions=(1,), free=1 << 10 if result == Result.NO_SPACE else 1 << 30)
        cluster.gate = trio.Event()
        async with trio.open_nursery() as n:
            w, meta = await _writer(n, cluster, chunk=4096, retry_s=2.0)
            f = _open(w, 1)
            await w.write(f, 0, b"a" * 4096)
            await trio.testing.wait_all_tasks_blocked()
            await w.write(f, 4096, b"b" * 4095)
            cluster.fail = type("Always", (dict,), {"pop": lambda self, pid, d: (result, 0)})()
            got = []

            async def waits():
                try:
                    await w.write(f, 8191, b"c")            # the next chunk full: this write waits
                    got.append(None)
                except OSError as e:
                    got.append(e.errno)
            n.start_soon(waits)
            await trio.testing.wait_all_tasks_blocked()
            assert not got
            cluster.gate.set()
            with trio.fail_after(30):
                while not got:
                    await trio.sleep(0.1)
            assert got == [err] and f.error is None and not f.pending and f.size == 0
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
