"""Group commit (datanode/commit.py): concurrent appends share fdatasyncs, and ``sync = always`` keeps its
meaning -- every write acknowledged to a client is there, on every replica, after a kill -9 of all of them."""
from __future__ import annotations

import random

import trio

from client.sdk import ClientError
from wire.protocol import Op
from datanode.store import ExtentStore
from datanode.store.files import has_sync_file_range
from tests.conftest import TaskSteps, create_partition, open_client, pattern, run

KiB = 1 << 10
PID = 1


def test_acknowledged_appends_survive_kill9_of_every_replica(nodes, tmp_path):
    """Several writers keep many appends in flight on several extents (so flushes are shared); all three
    nodes are killed with SIGKILL mid-stream; after a restart every acknowledged append reads back
    byte-exact from every replica (a write that was not acknowledged may or may not be there)."""
    ns = nodes(3, sync="always")
    addrs = [n.addr for n in ns]
    acked: list[tuple[int, int, bytes]] = []
    rng = random.Random(12)

    async def body():
        async with open_client("tcp", timeout=10) as dc:
            await create_partition(dc, PID, addrs)
            part = dc.partition(PID)

            async def writer(w: int, started: trio.Event):
                extent = await dc.create_extent(PID)
                off = 0
                window = trio.Semaphore(8)
                async with trio.open_nursery() as n:
                    for k in range(100_000):
                        await window.acquire()
                        data = pattern(w * 100_000 + k, rng.choice([1, 4 * KiB, 9 * KiB + 7, 64 * KiB]))
                        try:
                            fut = await dc.submit_append(part, extent, off, data)
                        except ClientError:
                            return

                        async def finish(fut=fut, off=off, data=data):
                            try:
                                await fut
                                acked.append((extent, off, data))
                            except ClientError:
                                pass
                            finally:
                                window.release()
                        n.start_soon(finish)
                        off += len(data)
                        if k == 50:
                            started.set()

            with trio.move_on_after(60):
                async with trio.open_nursery() as n:
                    evs = [trio.Event() for _ in range(3)]
                    for w in range(3):
                        n.start_soon(writer, w, evs[w])
                    for e in evs:
                        await e.wait()
                    await trio.sleep(0.3)             # mid-stream
                    for node in ns:
                        node.kill()
                    n.cancel_scope.deadline = trio.current_time() + 15   # writers see their errors, then stop

    run(body)
    assert len(acked) > 150, len(acked)
    restart_and_check_every_replica(ns, acked)


def restart_and_check_every_replica(ns, acked: list[tuple[int, int, bytes]]) -> None:
    """Wait for the killed nodes, start them again, and read every acknowledged append from each."""
    addrs = [n.addr for n in ns]
    for node in ns:
        node.proc.wait(timeout=10)
        node.start()

    async def check():
        async with open_client("tcp", addrs, timeout=10) as dc:
            await dc.discover(addrs[0])
            for addr in addrs:
                for extent, off, data in acked:
                    got = await dc.read(PID, extent, off, len(data), replica=addr)
                    assert got == data, f"{addr}: extent {extent} at {off}: {len(data)} acknowledged bytes differ"
    run(check)


def test_lone_writes_flushed_in_the_event_loop_survive_kill9_of_every_replica(nodes):
    """One writer, one append at a time: each node has a single request in flight, so its flush runs right
    in the event loop (no thread hand-over; the node's counters say so), most of them with one fdatasync
    (the store's "One flush"), and a follower does the whole append where its forward arrives.  Killed with
    SIGKILL, every replica still has every acknowledged byte after a restart (recovered by the CRC files'
    tail slots)."""
    ns = nodes(3, sync="always")
    addrs = [n.addr for n in ns]
    rng = random.Random(5)
    acked: list[tuple[int, bytes]] = []

    async def body():
        async with open_client("tcp", timeout=10) as dc:
            await create_partition(dc, PID, addrs)
            eid = await dc.create_extent(PID)
            off = 0
            for k in range(60):
                data = pattern(k, rng.choice([1, 100, 4 * KiB, 33 * KiB + 5]))
                await dc.append(PID, eid, off, data)
                acked.append((off, data))
                off += len(data)
            counts = [(await dc.admin(a, Op.NODE_STATUS))["counters"] for a in addrs]
            return eid, counts

    eid, counts = run(body)
    for addr, c in zip(addrs, counts):   # (a slow inline flush on a busy disk sends the next
        assert 1 <= c["inline_flushes"] <= c["flushes"], (addr, c)     # second's flushes to the thread)
        assert c["slow_inline_flushes"] <= c["inline_flushes"], (addr, c)
        assert (c["one_flushes"] >= 1) == has_sync_file_range(), (addr, c)    # small appends over zeros: one fdatasync
    # the followers did their appends right where the forwards arrived, no task each (Appends.now)
    assert counts[0]["appends_now"] == 0
    assert all(1 <= c["appends_now"] <= c["replica_writes"] for c in counts[1:]), counts[1:]
    for node in ns:
        node.kill()
    restart_and_check_every_replica(ns, [(eid, off, data) for off, data in acked])


def test_one_flush_covers_every_append_before_it(tmp_path):
    """Store level: appends are readable at once, durable only after ``flush``; one flush of several
    extents makes all of them durable, and a reopen (recovery) keeps exactly the flushed bytes."""
    store = ExtentStore(tmp_path / "p", "always")
    a, b = store.create_extent(), store.create_extent()
    data = {a: pattern(1, 200 * KiB + 3), b: pattern(2, 5 * KiB)}
    for eid, d in data.items():
        store.append(eid, 0, d[:100], None)
        store.append(eid, 100, d[100:], None)
        assert store.durable_size(eid) == 0 and store.size(eid) == len(d)
        out = bytearray(len(d))
        store.read_into(eid, 0, len(d), memoryview(out))
        assert bytes(out) == d
    assert store.flush([a, b]) == {}
    assert store.durable_size(a) == len(data[a]) and store.durable_size(b) == len(data[b])
    store.append(a, len(data[a]), b"never flushed", None)
    del store          # a crash: never closed, so never flushed (ExtentStore has no finalizer)
    again = ExtentStore(tmp_path / "p", "always")
    for eid, d in data.items():
        out = bytearray(len(d))
        again.read_into(eid, 0, len(d), memoryview(out))
        assert bytes(out) == d and again.size(eid) == len(d)
    again.close()


def test_a_batchs_extents_are_flushed_side_by_side_not_one_after_another(tmp_path):
    """Eight writers append to eight extents; their batch's flushes run at once in the flusher's pool (each
    ends in a cache flush of the device, and concurrent ones share it -- in a row each paid its own, and every
    writer waited for all of them).  Here every extent's flush waits, in its thread, until all of them have
    started: flushed one after another they would never get there.  Each is durable afterwards."""
    import threading
    from concurrent.futures import ThreadPoolExecutor
    from datanode.commit import FLUSH_THREADS, _flush_all
    store = ExtentStore(tmp_path / "p", "always")
    extents = [store.create_extent() for _ in range(8)]
    for k, eid in enumerate(extents):
        store.append(eid, 0, pattern(k, 4 * KiB), None)
    all_in = threading.Barrier(len(extents), timeout=10)
    real = store.flush

    def flush(ids):
        all_in.wait()                     # BrokenBarrierError (a failed flush) unless they run together
        return real(ids)
    store.flush = flush
    with ThreadPoolExecutor(FLUSH_THREADS) as pool:
        assert _flush_all({store: set(extents)}, pool) == {}
    assert [store.durable_size(eid) for eid in extents] == [4 * KiB] * len(extents)
    store.close()


def test_the_lone_requests_flush_in_the_event_loop_is_durable_and_takes_no_scheduler_pass(tmp_path):
    """``GroupCommit.durable`` for the only request in flight flushes right in the event loop: the append is
    durable when it returns, and the handler goes straight on to its answer -- no pass of the loop in
    between (it was one per write on every replica, on a follower's path to its ack)."""
    from datanode.commit import GroupCommit
    store = ExtentStore(tmp_path / "p", "always")
    eid = store.create_extent()
    gc = GroupCommit(quiet=lambda: True)
    gc.inline.slow = float("inf")          # a loaded machine's slow fsync must not send the flushes away

    async def main():
        steps = TaskSteps(trio.lowlevel.current_task())
        trio.lowlevel.add_instrument(steps)
        async with trio.open_nursery() as n:
            await n.start(gc.run)
            for k in range(3):
                store.append(eid, k * 4 * KiB, pattern(k, 4 * KiB), None)
                before = steps.n
                await gc.durable(store, eid, (k + 1) * 4 * KiB)
                assert store.durable_size(eid) == (k + 1) * 4 * KiB
                assert steps.n == before         # this task never left the CPU: no scheduler pass
            assert gc.counters.inline_flushes == 3 and gc.counters.flushes == 3
            n.cancel_scope.cancel()

    run(main)
    store.close()


def test_the_store_counters_a_node_reports_do_not_go_down_when_a_partition_is_deleted(tmp_path):
    """NODE_STATUS ``one_flushes`` / ``direct_writes`` count the node's lifetime, as its other counters do: a
    deleted partition (a bench's scratch one, deleted at its end) keeps its counts there."""
    import mmap

    from datanode.partition import PartitionTable
    table = PartitionTable(tmp_path, "always")
    try:
        store = table.create(7, ["127.0.0.1:1"], 1).store
        eid = store.create_extent()
        big = memoryview(mmap.mmap(-1, 1 << 20))      # page-aligned: an O_DIRECT append where the fs takes one
        big[:] = random.Random(7).randbytes(1 << 20)
        off = 0
        for data in (b"a" * 4096, b"b" * 4096, big):   # the second over zeros written ahead: one fdatasync
            store.write(eid, off, data)
            off += len(data)
        before = table.store_counts()
        assert before["one_flushes"] >= has_sync_file_range() and before["direct_writes"] == store.direct_writes, before
        table.delete(7)
        assert table.store_counts() == before
        assert table.create(8, ["127.0.0.1:1"], 1) and table.store_counts() == before
    finally:
        table.close()
