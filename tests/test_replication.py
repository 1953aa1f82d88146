"""Three replicas, real processes: concurrent writers, dead and frozen followers, restarts, epochs, the
zero-copy forward, and per-extent ordering under a deep pipeline."""
from __future__ import annotations

import os
import random
import signal

import pytest
import trio

from client.sdk import ClientError, ReplicationError
from wire.crc import crc32c
from wire.protocol import INLINE_MAX, Flag, Header, Op, Result
from wire.protocol import MAX_EXTENT
from tests.conftest import REPLICA_TIMEOUT, SLACK, create_partition, pattern, run

KiB, MiB = 1 << 10, 1 << 20
P1, P2 = 1, 2


def fails_fast():
    """A failure caused by a follower must surface within the replica timeout, plus slack."""
    return trio.fail_after(REPLICA_TIMEOUT + SLACK)


async def read_locs(dc, locs, replica=None) -> bytes:
    return b"".join([await dc.read_location(loc, replica=replica) for loc in locs])


def expected_extents(writes) -> dict[tuple[int, int], bytearray]:
    """(partition, extent) -> the bytes the writes put there, from their returned locations."""
    out: dict[tuple[int, int], bytearray] = {}
    covered: dict[tuple[int, int], int] = {}
    for data, locs in writes:
        pos = 0
        for loc in locs:
            key = (loc.partition, loc.extent)
            buf = out.setdefault(key, bytearray())
            if len(buf) < loc.offset + loc.length:
                buf.extend(bytes(loc.offset + loc.length - len(buf)))
            buf[loc.offset:loc.offset + loc.length] = data[pos:pos + loc.length]
            covered[key] = covered.get(key, 0) + loc.length
            pos += loc.length
        assert pos == len(data)
    for key, buf in out.items():      # no overlaps, no holes: every byte of every extent was written once
        assert covered[key] == len(buf), key
    return out


# -------------------------------------------------------------------------------------------- writers
def test_concurrent_writers_leave_identical_replicas(nodes, client):
    a, b, c = nodes(3)
    replicas = {P1: [a.addr, b.addr, c.addr], P2: [b.addr, c.addr, a.addr]}    # two different leaders
    writers, per_writer = 4, 5
    edge = [1, 4095, 4096, 128 * KiB - 1, 128 * KiB + 1, MiB, MiB + 1]

    async def body():
        async with client([]) as dc:
            for pid, addrs in replicas.items():
                await create_partition(dc, pid, addrs)
        writes = []

        async def writer(i):
            rng = random.Random(100 + i)
            async with client([a.addr]) as dc:        # every writer its own client, connections and memory
                for j in range(per_writer):
                    size = rng.choice(edge + [rng.randrange(1, 3 * MiB)])
                    data = rng.randbytes(size)
                    pid = P1 if (i + j) % 2 == 0 else P2
                    locs = await dc.write(pid, data)
                    writes.append((data, locs))

        with trio.fail_after(120):
            async with trio.open_nursery() as n:
                for i in range(writers):
                    n.start_soon(writer, i)
        assert len(writes) == writers * per_writer
        expected = expected_extents(writes)

        async with client([a.addr]) as dc:
            for pid, addrs in replicas.items():
                marks = [await dc.watermarks(pid, addr) for addr in addrs]
                assert marks[0] == marks[1] == marks[2], f"partition {pid}: replicas disagree: {marks}"
                assert marks[0] == {e: len(buf) for (p, e), buf in expected.items() if p == pid}
                for eid, size in marks[0].items():
                    for addr in addrs:
                        got = await dc.read(pid, eid, 0, size, replica=addr)
                        assert got == expected[(pid, eid)], f"partition {pid} extent {eid} differs on {addr}"
            for data, locs in writes[:3]:
                assert await read_locs(dc, locs) == data
    run(body)


# ----------------------------------------------------------------------------------- failed followers
def _two_partitions(a, b, c):
    return {P1: [a.addr, b.addr, c.addr], P2: [a.addr, b.addr]}


@pytest.mark.parametrize("how", ["kill", "pause"])
def test_failed_follower(nodes, client, how):
    """A follower dies (SIGKILL) or freezes (SIGSTOP): writes that need it fail promptly with a
    ReplicationError naming it; nothing hangs; reads and partitions without it carry on."""
    a, b, c = nodes(3)
    before = pattern(1, 600 * KiB)

    async def body():
        async with client([]) as dc:
            for pid, addrs in _two_partitions(a, b, c).items():
                await create_partition(dc, pid, addrs)
            locs = await dc.write(P1, before)
            locs2 = await dc.write(P2, before)
            eid = locs[-1].extent
            end = locs[-1].offset + locs[-1].length

            c.kill(signal.SIGKILL if how == "kill" else signal.SIGSTOP)

            with fails_fast():
                with pytest.raises(ReplicationError) as ei:
                    await dc.append(P1, eid, end, b"x" * 5000)
            assert ei.value.replica == c.addr
            assert ei.value.result == Result.REPLICATION_FAILED
            assert c.addr in str(ei.value)

            # the client retries on a new extent; creating it needs the follower too (the leader may first
            # wait for a connect attempt to the follower already under way, e.g. by its heartbeat)
            with trio.fail_after(2 * REPLICA_TIMEOUT + SLACK):
                with pytest.raises(ReplicationError) as ei:
                    await dc.write(P1, pattern(2, 300 * KiB))
            assert ei.value.replica == c.addr

            with fails_fast():     # reads do not need the follower
                assert await read_locs(dc, locs) == before
                assert await read_locs(dc, locs, replica=a.addr) == before
                assert await read_locs(dc, locs, replica=b.addr) == before
            with fails_fast():     # a partition without the follower takes writes as before
                more = pattern(3, 1 * MiB + 17)
                locs3 = await dc.write(P2, more)
                assert await read_locs(dc, locs2 + locs3, replica=b.addr) == before + more
                assert await read_locs(dc, locs3, replica=a.addr) == more
        async with client([a.addr], timeout=1.0) as impatient:   # the follower itself does not answer
            with trio.fail_after(1.0 + SLACK):
                with pytest.raises(ClientError) as ei:
                    await impatient.read(P1, eid, 0, 10, replica=c.addr)
            assert ei.value.node == c.addr

    try:
        run(body)
    finally:
        if how == "pause":
            c.kill(signal.SIGCONT)


def test_a_create_or_delete_that_a_follower_fails_leaves_the_leaders_extents_as_they_were(nodes, client):
    """Creating and deleting an extent go to every replica: with a follower dead, a create is refused and the
    extent it made on the leader is taken back; a delete is refused before the leader deletes its copy (the
    extent stays readable there); and a client's TRUNCATE is refused (only a leader's repair cuts, and only
    on followers)."""
    a, b, c = nodes(3)
    data = pattern(4, 5000)

    async def body():
        async with client([]) as dc:
            await create_partition(dc, P1, [a.addr, b.addr, c.addr])
            eid = (await dc.write(P1, data))[0].extent
            before = await dc.watermarks(P1)
            c.kill(signal.SIGKILL)
            with trio.fail_after(2 * REPLICA_TIMEOUT + SLACK):
                with pytest.raises(ReplicationError) as ei:
                    await dc.create_extent(P1)
                assert ei.value.replica == c.addr
                assert await dc.watermarks(P1) == before
                with pytest.raises(ReplicationError) as ei:
                    await dc.delete_extent(P1, eid)
                assert ei.value.replica == c.addr
                assert await dc.watermarks(P1) == before
                assert await dc.read(P1, eid, 0, len(data), replica=a.addr) == data
            cut = Header(opcode=Op.TRUNCATE, partition=P1, extent=eid, offset=0, epoch=dc.partition(P1).epoch)
            resp, _ = await dc.request(a.addr, cut)
            assert resp.result == Result.WRONG_ROLE
            assert await dc.read(P1, eid, 0, len(data), replica=a.addr) == data
    run(body)


def test_restarted_follower_keeps_acked_data_and_diverged_extent_stays_sealed(nodes, client):
    a, b, c = nodes(3)
    acked = pattern(4, 2 * MiB + 3)

    async def part1():
        async with client([]) as dc:
            await create_partition(dc, P1, [a.addr, b.addr, c.addr])
            locs = await dc.write(P1, acked)
            eid = locs[0].extent
            assert {loc.extent for loc in locs} == {eid}
            c.kill(signal.SIGKILL)
            with fails_fast():
                with pytest.raises(ReplicationError) as ei:
                    await dc.append(P1, eid, len(acked), b"lost" * 1000)
            assert ei.value.replica == c.addr
            return eid

    eid = run(part1)
    c.start()

    async def check_sealed(dc):
        leader_size = (await dc.watermarks(P1, a.addr))[eid]
        with pytest.raises(ClientError) as ei:
            await dc.append(P1, eid, leader_size, b"more")
        assert ei.value.result == Result.DIVERGED, ei.value
        listed = [p for p in await dc.admin(a.addr, Op.PARTITION_LIST) if p["id"] == P1][0]
        assert listed["sealed_extents"] == [eid]

    async def part2():
        async with client([a.addr]) as dc:
            # what the follower acknowledged before it died is intact on it
            assert await dc.read(P1, eid, 0, len(acked), replica=c.addr) == acked
            assert (await dc.watermarks(P1, c.addr))[eid] >= len(acked)
            await check_sealed(dc)
    run(part2)

    a.stop()
    a.start()

    async def part3():
        async with client([a.addr]) as dc:
            await check_sealed(dc)                       # sealed durably, not just in the leader's memory
            for addr in (a.addr, b.addr, c.addr):
                assert await dc.read(P1, eid, 0, len(acked), replica=addr) == acked
            # new data goes to a new extent, and reaches all three replicas again
            fresh = pattern(5, 700 * KiB)
            locs = await dc.write(P1, fresh)
            assert all(loc.extent != eid for loc in locs)
            for addr in (a.addr, b.addr, c.addr):
                assert await read_locs(dc, locs, replica=addr) == fresh
    run(part3)


# ---------------------------------------------------------------------------------------------- epochs
def test_stale_epoch_is_refused_by_leader_and_followers(nodes, client):
    # a static view: no heartbeat may reconcile the epochs behind the test's back (repair adopts a newer one)
    a, b, c = nodes(3, heartbeat_s=600.0)
    addrs = [a.addr, b.addr, c.addr]
    data = pattern(6, 300 * KiB)

    async def body():
        async with client([]) as dc:
            await create_partition(dc, P1, addrs)
            locs = await dc.write(P1, data)
            eid, end = locs[0].extent, len(data)

            # a client with the wrong epoch is refused by the leader, for writes and reads
            dc.partitions[P1].epoch = 7
            with pytest.raises(ClientError) as ei:
                await dc.append(P1, eid, end, b"nope")
            assert (ei.value.result, ei.value.arg) == (Result.STALE_EPOCH, 1)
            resp, _ = await dc.request(a.addr, Header(opcode=Op.READ, partition=P1, extent=eid, length=10,
                                                      epoch=7), answer=10)
            assert (resp.result, resp.arg) == (Result.STALE_EPOCH, 1)
            # the SDK itself recovers: a stale read makes it reload the partition map and retry
            assert await dc.read(P1, eid, 0, end) == data          # nothing was appended
            assert dc.partitions[P1].epoch == 1

            # one follower moves on to epoch 2: the leader's forwards (epoch 1) are refused by it
            await dc.admin(b.addr, Op.PARTITION_UPDATE, partition=P1, body={"replicas": addrs, "epoch": 2})
            with pytest.raises(ClientError) as ei:       # epochs only go up
                await dc.admin(b.addr, Op.PARTITION_UPDATE, partition=P1, body={"replicas": addrs, "epoch": 2})
            assert ei.value.result == Result.STALE_EPOCH
            with fails_fast():
                with pytest.raises(ReplicationError) as ei:
                    await dc.write(P1, pattern(7, 5000))
            assert ei.value.replica == b.addr
            # and the follower refuses a direct request carrying the old epoch
            resp, _ = await dc.request(b.addr, Header(opcode=Op.READ, partition=P1, extent=eid, length=end,
                                                      epoch=1), answer=end)
            assert (resp.result, resp.arg) == (Result.STALE_EPOCH, 2)

            # once every replica is at epoch 2, a client that learns it writes again
            for addr in (c.addr, a.addr):                   # the leader last
                await dc.admin(addr, Op.PARTITION_UPDATE, partition=P1, body={"replicas": addrs, "epoch": 2})
            await dc.discover(a.addr)
            assert dc.partitions[P1].epoch == 2
            fresh = pattern(8, 200 * KiB)
            locs2 = await dc.write(P1, fresh)
            for addr in addrs:
                assert await read_locs(dc, locs2, replica=addr) == fresh
                assert await dc.read(P1, eid, 0, end, replica=addr) == data
    run(body)


# -------------------------------------------------------------------------------------------- zero copy
def verbs_inline() -> int:
    """The payload a verbs SEND carries after its header on the nodes (they take $DATANODE_VERBS_INLINE from
    the environment they share with this process)."""
    from datanode.config import load
    return load(None, os.environ).verbs_inline


def test_forwarded_payload_is_fetched_from_the_leaders_pool(nodes, client, transport):
    """A forward names the leader's pool block and each follower READs it from there -- except a small
    append (TCP: at most INLINE_MAX bytes; verbs: at most the verbs inline limit), which travels inline with
    its header (client -> leader -> followers) and is fetched by nobody."""
    # no background repair traffic: the counters must show the client's writes and nothing else
    a, b, c = nodes(3, heartbeat_s=600.0, repair_interval_s=600.0)
    rng = random.Random(9)
    sizes = [1, 4096, 128 * KiB + 1, 3 * MiB + 5, rng.randrange(1, 2 * MiB)]

    async def body():
        async with client([]) as dc:
            await create_partition(dc, P1, [a.addr, b.addr, c.addr])
            # the leader's first repair pass (on gaining the lead) must be over: run beside the first writes
            # it may copy an append still in flight -- correct (the follower refuses it, WRONG_OFFSET), but
            # its fetch would show in the counters
            with trio.fail_after(10 * SLACK):
                while (await dc.admin(a.addr, Op.NODE_STATUS))["counters"]["repair_passes"] < 1:
                    await trio.sleep(0.05)
            appends = 0
            lengths = []
            for i, size in enumerate(sizes):
                data = pattern(20 + i, size)
                locs = await dc.write(P1, data)
                appends += len(locs)
                lengths += [loc.length for loc in locs]
                assert await read_locs(dc, locs, replica=c.addr) == data
            total = sum(sizes)
            inline = INLINE_MAX if transport == "tcp" else verbs_inline()
            fetched = [n for n in lengths if n > inline]
            assert 0 < len(fetched) < len(lengths) or not inline      # both ways were taken
            for f in (b, c):
                counters = (await dc.admin(f.addr, Op.NODE_STATUS))["counters"]
                by_leader = counters["forward_fetch_bytes_by_leader"]      # one leader connection fetched from
                assert list(by_leader.values()) == [sum(fetched)], (f.addr, by_leader)
                assert counters["replica_writes"] == appends
            status = await dc.admin(a.addr, Op.NODE_STATUS)
            assert status["counters"]["forwarded"] == appends
            assert status["counters"]["write_bytes"] == total
            if transport == "tcp":
                # on TCP the leader's transport serves the followers' one-sided READs (on verbs the NIC does,
                # unseen by software): exactly the payload bytes, once per follower
                by_peer = {conn["peer"]: conn for conn in status["connections"]}
                for f in (b, c):
                    assert by_peer[f.addr]["served_read_bytes"] == sum(fetched), by_peer.get(f.addr)
                    assert by_peer[f.addr]["served_reads"] == len(fetched)
    run(body)


# ------------------------------------------------------------------------------------------------ order
def test_deep_pipeline_keeps_extent_order(nodes, client):
    a, b, c = nodes(3)
    data = pattern(30, MiB + 123)

    async def body():
        async with client([], block_size=4096, depth=16) as dc:
            await create_partition(dc, P1, [a.addr, b.addr, c.addr])
            with trio.fail_after(120):
                locs = await dc.write(P1, data)
            assert len(locs) == len(data) // 4096 + 1
            assert len({loc.extent for loc in locs}) == 1
            assert [loc.offset for loc in locs] == [i * 4096 for i in range(len(locs))]
            eid = locs[0].extent
            for addr in (a.addr, b.addr, c.addr):
                assert (await dc.watermarks(P1, addr)) == {eid: len(data)}
                assert await dc.read(P1, eid, 0, len(data), replica=addr) == data
    run(body)


def test_appends_that_queue_up_go_as_one_append_and_each_is_answered_as_if_alone(nodes, client):
    """Inline appends that queue up at the leader (here: sent while it is stopped) are appended as one run
    (datanode/ops/run.py, AppendRun): one forward to each follower, one append there; yet every request gets
    its own answer, and the bytes are the same on every replica.  A request whose payload does not match its
    CRC is refused alone, and the one behind it meets the extent's real end -- the answers each would have
    had alone."""
    a, b, c = nodes(3)
    n = 8
    eid = 0

    async def body():
        nonlocal eid
        async with client([]) as dc:
            await create_partition(dc, P1, [a.addr, b.addr, c.addr])
            eid = await dc.create_extent(P1)
            link = await dc.links.get(a.addr)

            def append(i: int, data: bytes, crc: int | None = None) -> Header:
                return Header(opcode=Op.WRITE, partition=P1, extent=eid, offset=i * 4 * KiB, length=len(data),
                              crc=crc32c(data) if crc is None else crc, epoch=1, flags=Flag.INLINE)

            async def queued(requests) -> list[Header]:
                """Send them all while the leader is stopped: they wait in its socket, one behind the other."""
                a.proc.send_signal(signal.SIGSTOP)
                try:
                    pending = [await link.submit(h, 30, data) for h, data in requests]
                finally:
                    a.proc.send_signal(signal.SIGCONT)
                with trio.fail_after(30):
                    return [await p.result() for p in pending]

            async def counters() -> list[dict]:
                return [(await dc.admin(x.addr, Op.NODE_STATUS))["counters"] for x in (a, b, c)]

            data = [pattern(i, 4 * KiB) for i in range(n + 3)]
            before = await counters()
            got = await queued([(append(i, data[i]), data[i]) for i in range(n)])
            assert [(r.result, r.arg, r.crc) for r in got] == \
                [(Result.OK, (i + 1) * 4 * KiB, crc32c(data[i])) for i in range(n)]
            after = await counters()
            assert after[0]["writes"] - before[0]["writes"] == n
            assert after[0]["joined_writes"] - before[0]["joined_writes"] == n - 1
            assert after[0]["forwarded"] - before[0]["forwarded"] == 1        # one append went to the followers
            for f in (1, 2):
                assert after[f]["replica_writes"] - before[f]["replica_writes"] == 1, after[f]

            # n, n+1 fine; n+2's payload does not match its CRC; n+3 starts where n+2 would have ended
            bad = append(n + 2, data[n + 2], crc=crc32c(data[n + 2]) ^ 1)
            got = await queued([(append(n, data[n]), data[n]), (append(n + 1, data[n + 1]), data[n + 1]),
                                (bad, data[n + 2]), (append(n + 3, data[0]), data[0])])
            end = (n + 2) * 4 * KiB
            assert [(r.result, r.arg) for r in got] == [(Result.OK, end - 4 * KiB), (Result.OK, end),
                                                        (Result.CRC_MISMATCH, 0), (Result.WRONG_OFFSET, end)]
            for x in (a, b, c):
                assert await dc.watermarks(P1, x.addr) == {eid: end}
                assert await dc.read(P1, eid, 0, end, replica=x.addr) == b"".join(data[:n + 2])

            # a run never crosses the extent's size limit: the two that fit are written, the next is refused
            # (and, refused in its turn, seals the extent: the last meets DIVERGED), as each would alone
            eid = await dc.create_extent(P1)
            filler = bytes(MiB)
            for i in range(MAX_EXTENT // MiB - 1):
                await dc.append(P1, eid, i * MiB, filler)
            await dc.append(P1, eid, MAX_EXTENT - MiB, filler[:MiB - 8 * KiB])
            first = (MAX_EXTENT - 8 * KiB) // (4 * KiB)
            got = await queued([(append(first + i, data[i]), data[i]) for i in range(4)])
            assert [(r.result, r.arg) for r in got] == [(Result.OK, MAX_EXTENT - 4 * KiB), (Result.OK, MAX_EXTENT),
                                                        (Result.TOO_LARGE, MAX_EXTENT),
                                                        (Result.DIVERGED, 0)]
    run(body)


def test_spread_reads_go_to_every_replica_and_return_the_written_bytes(nodes, client):
    """DataClient(read_from="spread") sends each read request to the next replica in turn: every replica
    serves some of them, and the bytes are the ones written."""
    a, b, c = nodes(3)
    data = pattern(41, 3 * MiB + 17)

    async def body():
        async with client([], block_size=256 * KiB, read_from="spread") as dc:
            await create_partition(dc, P1, [a.addr, b.addr, c.addr])
            locs = await dc.write(P1, data)
            before = {n.addr: (await dc.admin(n.addr, Op.NODE_STATUS))["counters"]["reads"] for n in (a, b, c)}
            assert await read_locs(dc, locs) == data
            after = {n.addr: (await dc.admin(n.addr, Op.NODE_STATUS))["counters"]["reads"] for n in (a, b, c)}
            served = {addr: after[addr] - before[addr] for addr in after}
            assert all(v >= 3 for v in served.values()), served
    run(body)
