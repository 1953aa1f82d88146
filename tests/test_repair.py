"""Replica health, repair, scrub and leader changes with real datanode processes.

Every test ends by checking that each extent is byte-identical on every replica (read back from each one
by itself) and that every acknowledged write reads back right from every replica.
"""
from __future__ import annotations

import functools
import json
import os
import pathlib

import trio

from client.sdk import ClientError, PartitionInfo
from wire.crc import crc32c
from wire.protocol import Flag, Header, Op, Result, Role
from datanode.store import BLOCK
from tests.conftest import create_partition, pattern, run
from tests.conftest import dnctl as conftest_dnctl
from client import admin as dr

KiB, MiB = 1 << 10, 1 << 20
PID = 1
# probe often, no background scrub, no scheduled full pass during a test (passes are asked for)
FAST = {"heartbeat_s": 0.3, "repair_interval_s": 60.0, "repair_mib_s": 0.0, "scrub_interval_s": 0.0,
        "scrub_mib_s": 0.0}


def extent_file(node, pid: int, eid: int) -> pathlib.Path:
    return pathlib.Path(node.cfg["data_dir"]) / "partitions" / str(pid) / "store" / "extents" / f"{eid}.dat"


def flip_byte(path: pathlib.Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))


dnctl = functools.partial(conftest_dnctl, check=True)


async def settle(dc, leader: str, pid: int = PID, timeout: float = 90, **kw) -> dict:
    """Ask the leader for a full repair pass and wait until every follower is healthy."""
    n = await dr.request_pass(dc, leader, pid, Op.REPAIR)
    return await dr.wait_settled(dc, leader, pid, repair_pass=n, timeout=timeout, **kw)


async def assert_identical(dc, addrs: list[str], pid: int = PID) -> dict[int, int]:
    """Every replica has the same extents with the same sizes, and each extent's bytes (read from that
    replica alone, CRC-checked) are the same everywhere.  Returns the sizes."""
    marks = {a: await dc.watermarks(pid, a) for a in addrs}
    first = marks[addrs[0]]
    for a in addrs[1:]:
        assert marks[a] == first, f"extent sizes differ: {addrs[0]} {first} vs {a} {marks[a]}"
    for e, size in sorted(first.items()):
        crcs = {a: crc32c(await dc.read(pid, e, 0, size, replica=a)) if size else 0 for a in addrs}
        assert len(set(crcs.values())) == 1, f"extent {e} differs across replicas: {crcs}"
    return first


async def assert_acked(dc, acked, addrs: list[str]) -> None:
    for locs, data in acked:
        for a in addrs:
            got = b"".join([await dc.read_location(loc, replica=a) for loc in locs])
            assert got == data, f"acknowledged write {locs[0]} reads back wrong from {a}"


def follower(h: dict, addr: str) -> dict:
    return next(f for f in h["followers"] if f["addr"] == addr)


# ------------------------------------------------------------------------------------------------ tests
def test_follower_killed_mid_stream_is_noticed_and_repaired(nodes, client):
    """A follower is SIGKILLed while a client streams writes: the leader's heartbeat marks it unreachable
    (no client write needed), writes go on on new extents once it is back, and after repair every extent
    is byte-identical on all three replicas."""
    a, b, c = nodes(3, **FAST)
    acked: list = []
    failures = []

    async def writer(dc, stop):
        i = 0
        while not stop.is_set():
            data = pattern(1000 + i, 200 * KiB + 7 * i)
            i += 1
            try:
                acked.append((await dc.write(PID, data), data))
            except ClientError as e:
                failures.append(e)
                await trio.sleep(0.05)

    async def body():
        async with client([]) as dc:
            await create_partition(dc, PID, [a.addr, b.addr, c.addr])
            stop = trio.Event()
            async with trio.open_nursery() as n:
                n.start_soon(writer, dc, stop)
                with trio.fail_after(30):     # some writes acknowledged first (a loaded VM's first takes a while)
                    while not acked:
                        await trio.sleep(0.05)
                await trio.sleep(0.5)
                before = len(acked)
                c.kill()
                with trio.fail_after(10):
                    while follower(await dr.health(dc, a.addr, PID), c.addr)["state"] != "unreachable":
                        await trio.sleep(0.1)
                await trio.to_thread.run_sync(c.start)
                t_back = len(acked)
                await trio.sleep(1.5)                 # writes continue (on new extents) with c back
                stop.set()
            assert before > 0 and len(acked) > t_back, (before, t_back, len(acked))
            assert failures, "writes needing the dead follower should have failed"
            h = await settle(dc, a.addr)
            assert all(f["state"] == "healthy" for f in h["followers"])
            marks = await assert_identical(dc, [a.addr, b.addr, c.addr])
            assert len(marks) >= 2
            await assert_acked(dc, acked, [a.addr, b.addr, c.addr])
            st = await dc.admin(a.addr, Op.NODE_STATUS)
            assert st["counters"]["repair_passes"] >= 1
    run(body)


def test_new_replica_is_filled_with_progress(nodes, client):
    """`dnctl replica add` on a partition holding ~130 MiB: the new replica is filled by repair at the
    configured cap, the command shows progress (bytes, rate, ETA) and returns when it is identical.
    Meanwhile reads that ask the new replica first (it lacks most ranges) fail over and return the right
    bytes."""
    a, b, c = nodes(3, **{**FAST, "sync": "none", "repair_mib_s": 80.0, "pool_mib": 128})
    total = 130 * MiB
    piece = 8 * MiB + 3
    written = []          # (locations, pattern seed, size)

    async def fill():
        async with client([], pool_mib=64) as dc:
            await create_partition(dc, PID, [a.addr, b.addr])
            done = 0
            while done < total:
                n = min(piece, total - done)
                written.append((await dc.write(PID, pattern(len(written), n)), len(written), n))
                done += n
    run(fill)

    async def add_while_reading():
        stats = {"reads": 0, "stale": 0, "errors": []}
        done = trio.Event()
        out = {}

        async def add():
            try:
                out["p"] = await trio.to_thread.run_sync(lambda: dnctl(
                    "replica", "add", "--id", str(PID), "--node", c.addr, "--via", a.addr, "--json", timeout=300))
            finally:
                done.set()

        async def reader(dc):
            k = 0
            while not done.is_set():
                await dc.discover(a.addr)
                cur = dc.partitions[PID]
                dc.partitions[PID] = PartitionInfo(PID, [c.addr] + [x for x in cur.replicas if x != c.addr],
                                                   cur.epoch)
                locs, seed, n = written[k % len(written)]
                k += 3
                try:
                    got = b"".join([await dc.read_location(loc) for loc in locs])
                except ClientError as e:
                    if e.result == Result.STALE_EPOCH:      # the map changed under us: read it again
                        stats["stale"] += 1
                        continue
                    stats["errors"].append(str(e))
                    continue
                assert got == pattern(seed, n), "a read during the fill returned wrong bytes"
                stats["reads"] += 1

        async with client([a.addr], pool_mib=64) as dc:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(add)
                nursery.start_soon(reader, dc)
        return out["p"], stats

    p, stats = run(add_while_reading)
    print("reads during the fill:", stats)
    assert stats["reads"] >= 3 and not stats["errors"], stats
    res = json.loads(p.stdout)
    assert res["new"]["replicas"] == [a.addr, b.addr, c.addr] and res["new"]["epoch"] == 2
    assert res["repair"]["state"] == "healthy"
    assert res["repair"]["bytes_copied"] >= total
    progress = [ln for ln in p.stderr.splitlines() if "repairing [" in ln]
    assert progress, p.stderr
    assert "MiB/s" in progress[0] and "ETA" in progress[0]
    assert res["repair"]["mib_s"] < 80 * 1.3, res["repair"]         # the cap holds

    async def check():
        async with client([a.addr], pool_mib=64) as dc:
            marks = await assert_identical(dc, [a.addr, b.addr, c.addr])
            assert sum(marks.values()) == total
            h = await dr.health(dc, a.addr, PID)
            assert follower(h, c.addr)["state"] == "healthy"
            for locs, seed, n in written[::4]:
                assert b"".join([await dc.read_location(loc, replica=c.addr) for loc in locs]) == pattern(seed, n)
    run(check)


def test_scrub_finds_flipped_bytes_and_repairs_them(nodes, client):
    """A byte flipped in a follower's extent file and one in the leader's: a read landing on the bad block
    fails over and returns the right bytes; `dnctl partition scrub` finds both, refetches each from a
    replica whose copy verifies, logs and counts them; afterwards every replica is identical."""
    a, b, c = nodes(3, **FAST)
    data1, data2 = pattern(7, 3 * MiB + 11), pattern(8, 2 * MiB)

    async def body():
        async with client([]) as dc:
            await create_partition(dc, PID, [a.addr, b.addr, c.addr])
            locs1 = await dc.write(PID, data1)
            e1 = locs1[0].extent
            dc._idle.pop(PID, None)                    # the second write on its own extent
            locs2 = await dc.write(PID, data2)
            e2 = locs2[0].extent
            assert e1 != e2
            bad_off = 1 * MiB + 5
            flip_byte(extent_file(b, PID, e1), bad_off)           # a follower's copy
            flip_byte(extent_file(a, PID, e2), 5 * BLOCK + 100)   # the leader's own copy

            # reads landing on the bad blocks (that replica asked first) fail over to a good copy
            real = dc.partitions[PID]
            dc.partitions[PID] = PartitionInfo(PID, [b.addr, a.addr, c.addr], real.epoch)
            assert await dc.read(PID, e1, 0, len(data1)) == data1
            dc.partitions[PID] = real
            assert await dc.read(PID, e2, 0, len(data2)) == data2
            try:
                await dc.read(PID, e1, bad_off, 10, replica=b.addr)
                raise AssertionError("the bad block read back from the follower")
            except ClientError as e:
                assert e.result == Result.CRC_MISMATCH

            p = await trio.to_thread.run_sync(
                lambda: dnctl("partition", "scrub", "--id", str(PID), "--via", a.addr, "--json"))
            h = json.loads(p.stdout)
            last = h["scrub"]["last"]
            assert last["bad_blocks"] == 2 and last["repaired"] == 2, last
            assert {(ev["replica"], ev["extent"]) for ev in last["events"]} == {(b.addr, e1), (a.addr, e2)}
            await settle(dc, a.addr)
            await assert_identical(dc, [a.addr, b.addr, c.addr])
            for r in (a.addr, b.addr, c.addr):
                assert await dc.read(PID, e1, 0, len(data1), replica=r) == data1
                assert await dc.read(PID, e2, 0, len(data2), replica=r) == data2
            st = await dc.admin(a.addr, Op.NODE_STATUS)
            assert st["counters"]["scrub_bad_blocks"] == 2 and st["counters"]["scrub_repaired_blocks"] == 2
            # a second pass finds nothing
            n = await dr.request_pass(dc, a.addr, PID, Op.SCRUB)
            h = await dr.wait_settled(dc, a.addr, PID, scrub_pass=n, timeout=60)
            assert h["scrub"]["last"]["bad_blocks"] == 0
    run(body)
    assert "bad block" in a.log_path.read_text()


def test_racing_creates_of_one_extent_on_a_follower_both_succeed(nodes, client):
    """The leader's repair creates an extent a client's create is forwarding at the same moment (both
    forwards in flight on the follower at once): an empty extent of that id is the result either way, so
    both are answered OK -- the client's create must not fail (CI saw REPLICATION_FAILED from this race)."""
    a, b = nodes(2, **FAST)

    async def body():
        async with client([]) as dc, client([]) as as_a:
            await create_partition(dc, PID, [a.addr, b.addr])
            results = []
            as_a.auth.role, as_a.auth.identity = Role.NODE, a.addr     # forwards come from the leader

            async def create(e):
                r, _ = await as_a.request(b.addr, Header(opcode=Op.CREATE_EXTENT, partition=PID, extent=e,
                                                         epoch=1, flags=Flag.FORWARDED | Flag.REPAIR))
                results.append((e, Result(r.result).name))
            async with trio.open_nursery() as n:
                for e in range(100, 130):
                    n.start_soon(create, e)
                    n.start_soon(create, e)
            assert sorted(results) == sorted((e, "OK") for e in range(100, 130) for _ in (1, 2)), results
    run(body)


def test_old_leader_is_fenced_then_repaired(nodes, client):
    """The leader dies; `dnctl partition set-leader` promotes a follower (epoch + 1) although the old
    leader does not answer.  When the old leader returns, requests at its stale epoch are refused, it
    learns the new epoch and list from the new leader, and is repaired as a follower."""
    a, b, c = nodes(3, **FAST)
    d1 = pattern(21, 3 * MiB + 1)

    async def body():
        async with client([]) as dc:
            await create_partition(dc, PID, [a.addr, b.addr, c.addr])
            acked = [(await dc.write(PID, d1), d1)]
            a.kill()
            p = await trio.to_thread.run_sync(
                lambda: dnctl("partition", "set-leader", "--id", str(PID), b.addr, "--via", c.addr, "--json"))
            res = json.loads(p.stdout)
            assert res["new"]["replicas"][0] == b.addr and res["new"]["epoch"] == 2 and res["forced"]
            # a forward at the old epoch (what the old leader would send) is refused by the new members
            for addr in (b.addr, c.addr):
                r, _ = await dc.request(addr, Header(opcode=Op.CREATE_EXTENT, partition=PID, extent=99,
                                                     epoch=1, flags=Flag.FORWARDED))
                assert r.result == Result.STALE_EPOCH and r.arg == 2
            await trio.to_thread.run_sync(a.start)
            # a client that still has the old map writes to the old leader: never acknowledged at epoch 1
            # (refused, or -- the SDK reloads a stale map -- acknowledged by the new leader at epoch 2)
            async with client([]) as stale:
                stale.partitions[PID] = PartitionInfo(PID, [a.addr, b.addr, c.addr], 1)
                data = pattern(23, 5000)
                try:
                    acked.append((await stale.write(PID, data), data))
                    assert stale.partitions[PID].epoch == 2 and stale.partitions[PID].replicas[0] == b.addr
                except ClientError as e:
                    assert e.result in (Result.REPLICATION_FAILED, Result.STALE_EPOCH), e
            with trio.fail_after(15):             # the new leader pushes epoch 2 to the returning old leader
                while True:
                    parts = {p["id"]: p for p in await dc.admin(a.addr, Op.PARTITION_LIST)}
                    if parts[PID]["epoch"] == 2:
                        break
                    await trio.sleep(0.1)
            assert parts[PID]["replicas"][0] == b.addr and parts[PID]["role"] == "follower"
            await dc.discover(b.addr)
            await settle(dc, b.addr)
            d2 = pattern(22, 2 * MiB + 5)
            acked.append((await dc.write(PID, d2), d2))
            await settle(dc, b.addr)
            await assert_identical(dc, [b.addr, a.addr, c.addr])
            await assert_acked(dc, acked, [a.addr, b.addr, c.addr])
    run(body)


def test_follower_longer_than_leader_is_cut_back(nodes, client):
    """Bytes a follower has beyond the leader's end (an append the leader never completed) are cut off,
    and a follower whose block differs at the same size is cut back to that block and refilled."""
    a, b = nodes(2, **FAST)
    data = pattern(31, 1 * MiB + 100)

    async def body():
        async with client([]) as dc:
            await create_partition(dc, PID, [a.addr, b.addr])
            locs = await dc.write(PID, data)
            e = locs[0].extent
        b.kill()
        # make b longer than the leader: append a whole block of junk plus its CRC entry
        # (it is b's store opened offline, as a crashed leader's forward would have left it)
        from datanode.store import ExtentStore
        st = ExtentStore(pathlib.Path(b.cfg["data_dir"]) / "partitions" / str(PID) / "store")
        st.write(e, len(data), os.urandom(300 * KiB))
        st.close()
        await trio.to_thread.run_sync(b.start)
        async with client([a.addr]) as dc:
            await settle(dc, a.addr)
            await assert_identical(dc, [a.addr, b.addr])
            assert await dc.read(PID, e, 0, len(data), replica=b.addr) == data
            st = await dc.admin(a.addr, Op.NODE_STATUS)
            assert st["counters"]["repair_truncates"] >= 1
    run(body)


def test_set_leader_moves_health_and_repair_to_the_new_leader(nodes, client):
    """With the leader alive, `set-leader` is dnctl's ordinary membership change: the new leader starts
    probing and repairing (the old one stops), and writes through it end up identical everywhere."""
    a, b, c = nodes(3, **FAST)

    async def body():
        async with client([]) as dc:
            await create_partition(dc, PID, [a.addr, b.addr, c.addr])
            acked = [(await dc.write(PID, pattern(41, 1 * MiB + 9)), pattern(41, 1 * MiB + 9))]
            await trio.to_thread.run_sync(
                lambda: dnctl("partition", "set-leader", "--id", str(PID), c.addr, "--via", a.addr))
            await dc.discover(c.addr)
            assert dc.partitions[PID].replicas[0] == c.addr and dc.partitions[PID].epoch == 2
            h = await settle(dc, c.addr)
            assert h["role"] == "leader" and {f["addr"] for f in h["followers"]} == {a.addr, b.addr}
            old = await dr.health(dc, a.addr, PID)
            assert old["role"] == "follower" and "followers" not in old
            acked.append((await dc.write(PID, pattern(42, 3 * MiB)), pattern(42, 3 * MiB)))
            await settle(dc, c.addr)
            await assert_identical(dc, [c.addr, a.addr, b.addr])
            await assert_acked(dc, acked, [a.addr, b.addr, c.addr])
    run(body)


def test_a_repair_pass_ends_while_a_client_keeps_appending(nodes, client):
    """A repair pass asked for while a client streams small appends to one extent (4 in flight) finishes
    while the stream goes on: it copies up to the leader's end as of its compare and leaves the appends after
    that to their own forwards (a pass that chased the moving end raced every forward and did not end while
    the stream ran).  Every acknowledged append then reads back from every replica."""
    a, b, c = nodes(3, **{**FAST, "repair_mib_s": 1.0})     # a capped pass, as in production
    acked: list = []

    async def writer(dc, stop):
        part = dc.partition(PID)
        eid, off, i = await dc.create_extent(PID), 0, 0
        window = trio.Semaphore(4)

        async def finish(fut, data):
            try:
                acked.append(([await fut], data))
            finally:
                window.release()

        async with trio.open_nursery() as n:
            while not stop.is_set():
                await window.acquire()
                data = pattern(7000 + i, 4 * KiB + i % 5)
                i += 1
                fut = await dc.submit_append(part, eid, off, data)
                off += len(data)
                n.start_soon(finish, fut, data)

    async def body():
        async with client([]) as dc:
            await create_partition(dc, PID, [a.addr, b.addr, c.addr])
            stop = trio.Event()
            async with trio.open_nursery() as n:
                n.start_soon(writer, dc, stop)
                with trio.fail_after(30):        # the stream is flowing
                    while len(acked) < 8:
                        await trio.sleep(0.05)
                n_pass = await dr.request_pass(dc, a.addr, PID, Op.REPAIR)
                before = len(acked)
                with trio.fail_after(30):        # the stream goes on all along
                    while (await dr.health(dc, a.addr, PID))["repair"]["passes"] < n_pass:
                        await trio.sleep(0.2)
                    while len(acked) <= before:  # ... and was still flowing when the pass ended
                        await trio.sleep(0.05)
                stop.set()
            await settle(dc, a.addr)
            await assert_identical(dc, [a.addr, b.addr, c.addr])
            await assert_acked(dc, acked, [a.addr, b.addr, c.addr])
    run(body)
