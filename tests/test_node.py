"""One datanode, a real daemon process: data round trips, crash safety, corruption, hostile peers, shutdown
and configuration errors."""
from __future__ import annotations

import dataclasses

import json
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys

import pytest
import trio

from client.sdk import ClientError
from wire import rpc
from wire.crc import crc32c
from wire.pool import BuddyPool
from wire.protocol import (HEADER_SIZE, HELLO_SIZE, MAX_PAYLOAD, PROTOCOL_REASONS, Header, Hello, Op, Result,
                               Transport, decode, decode_hello)
from datanode.store import BLOCK
from wire.transport.base import Access, ConnectionClosed, RemoteAccessError
from wire.transport.connect import dial
from wire.transport.tcp import CTRL, FRAME, READ_REQ, READ_RESP, recv_exactly, send_all
from tests.conftest import REPO, client_domain, create_partition, dnctl, open_client, pattern, run
from tools.cluster import free_port

KiB, MiB = 1 << 10, 1 << 20
PID = 1


def host_port(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host, int(port)


def extent_file(node, pid: int, eid: int) -> pathlib.Path:
    return pathlib.Path(node.cfg["data_dir"]) / "partitions" / str(pid) / "store" / "extents" / f"{eid}.dat"


async def read_all(dc, pid, eid, **kw) -> bytes:
    size = (await dc.watermarks(pid, kw.get("replica")))[eid]
    return await dc.read(pid, eid, 0, size, **kw)


# ------------------------------------------------------------------------------------------ round trips
SIZES = [0, 1, 4095, 4096, 128 * KiB - 1, 128 * KiB, 128 * KiB + 1, 8 * MiB]


def test_round_trip_sizes(nodes, client):
    [node] = nodes(1)
    rng = random.Random(42)
    sizes = SIZES + [rng.randrange(1, 3 * MiB) for _ in range(6)]

    async def body():
        async with client([]) as dc:
            await create_partition(dc, PID, [node.addr])
            written = []
            for i, size in enumerate(sizes):
                data = pattern(i, size)
                locs = await dc.write(PID, data)
                assert sum(loc.length for loc in locs) == size
                if size == 0:
                    assert locs == []
                got = b"".join([await dc.read_location(loc) for loc in locs])
                assert got == data, f"size {size}: read back differs"
                assert all(loc.crc == crc32c(data[sum(x.length for x in locs[:k]):][:loc.length])
                           for k, loc in enumerate(locs))
                written.append((data, locs))
        # a second, fresh client sees the same bytes (nothing came from client-side state)
        async with client([node.addr]) as dc2:
            for data, locs in written:
                assert b"".join([await dc2.read_location(loc) for loc in locs]) == data
            # the extent holds exactly the writes, back to back
            marks = await dc2.watermarks(PID)
            total = sum(len(d) for d, _ in written)
            assert sum(marks.values()) == total
            # every pool block the answers used is back (on verbs a READ's block is freed when its posted
            # RDMA WRITE completes, after the response went out)
            with trio.fail_after(10):
                while (await dc2.admin(node.addr, Op.NODE_STATUS))["pool"]["in_use_bytes"]:
                    await trio.sleep(0.05)
    run(body)


def test_dnctl_put_get(nodes, tmp_path):
    [node] = nodes(1, transport="tcp")
    data = pattern(7, 3 * MiB + 12345)
    src, out = tmp_path / "in.bin", tmp_path / "out.bin"
    src.write_bytes(data)

    r = dnctl("partition", "create", "--id", str(PID), "--replicas", node.addr, "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["replicas"] == [node.addr]
    r = dnctl("put", "--node", node.addr, "--partition", str(PID), str(src), "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["size"] == len(data)
    locs = res["locations"]
    assert sum(loc["length"] for loc in locs) == len(data)
    assert len({loc["extent"] for loc in locs}) == 1
    assert [loc["offset"] for loc in locs] == [sum(x["length"] for x in locs[:i]) for i in range(len(locs))]
    eid = locs[0]["extent"]
    r = dnctl("get", "--node", node.addr, "--partition", str(PID), "--extent", str(eid), "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert out.read_bytes() == data
    # a range
    r = dnctl("get", "--node", node.addr, "--partition", str(PID), "--extent", str(eid), "--offset", "1000",
              "--length", "5000", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert out.read_bytes() == data[1000:6000]
    # an extent that does not exist: a clean error, not a traceback
    r = dnctl("get", "--node", node.addr, "--partition", str(PID), "--extent", "999", "--out", str(out))
    assert r.returncode != 0 and "Traceback" not in r.stderr and "999" in r.stderr


@pytest.mark.parametrize("how", ["removed", "replaced"])
def test_a_node_whose_data_directory_goes_away_refuses_writes_and_says_why(nodes, client, how):
    """The data directory of a running node is removed -- or moved aside with another put at its path, as when
    a disk is unmounted under the node: the files the node holds open are no longer the ones a restart finds,
    so a write acknowledged from then on would be lost at the next start.  Within seconds the node refuses
    writes (DISK_ERROR, saying why), NODE_STATUS and `dnctl node status` name the cause, and the bytes
    written before still read back."""
    [node] = nodes(1)
    data = pattern(1, 64 * KiB)
    d = pathlib.Path(node.cfg["data_dir"])

    async def body():
        async with client([]) as dc:
            await create_partition(dc, PID, [node.addr])
            eid = await dc.create_extent(PID)
            await dc.append(PID, eid, 0, data)
            if how == "removed":
                shutil.rmtree(d)
            else:
                d.rename(d.with_name("data.aside"))
                d.mkdir()
            with trio.fail_after(10):
                while not (lost := (await dc.admin(node.addr, Op.NODE_STATUS))["data_dir_lost"]):
                    await trio.sleep(0.1)
            assert f"data directory {d} was {how}" in lost
            for attempt in (lambda: dc.append(PID, eid, len(data), data), lambda: dc.create_extent(PID)):
                with pytest.raises(ClientError) as ei:
                    await attempt()
                assert ei.value.result == Result.DISK_ERROR
            assert await dc.read(PID, eid, 0, len(data)) == data

    run(body)
    r = dnctl("node", "status", node.addr)
    assert r.returncode == 0, r.stderr
    assert "DATA DIRECTORY LOST" in r.stdout and f"data directory {d} was {how}" in r.stdout


# ----------------------------------------------------------------------------------------------- crash
def test_kill9_during_appends_loses_nothing_acked(nodes, client):
    """A client appends continuously; the daemon is SIGKILLed mid-stream (twice).  After each restart on the
    same data dir every acknowledged append reads back intact, and the extent ends exactly at the end of
    some append that was sent (a torn tail is cut), with nothing but the sent bytes below it."""
    [node] = nodes(1)
    rng = random.Random(1234)
    stream = pattern(99, 96 * MiB)
    state = {"eid": None, "size": 0}

    async def one_round(round_no: int):
        acked_end = sent_ends = None
        async with client([node.addr]) as dc:
            if state["eid"] is None:
                await create_partition(dc, PID, [node.addr])
                state["eid"] = await dc.create_extent(PID)
            eid, off = state["eid"], state["size"]
            acked_end, sent_ends = off, {off}
            enough = trio.Event()
            target = rng.randrange(10, 30)
            acks = 0

            async def appender():
                nonlocal off, acked_end, acks
                while True:
                    n = rng.choice([1, 4095, 4096, BLOCK - 1, BLOCK, BLOCK + 1, rng.randrange(1, 900 * KiB)])
                    n = min(n, len(stream) - off)
                    if n == 0:           # (not reached with these sizes; never hang if it is)
                        enough.set()
                        return
                    sent_ends.add(off + n)
                    try:
                        loc = await dc.append(PID, eid, off, stream[off:off + n])
                    except ClientError:
                        return           # the daemon is gone
                    assert (loc.offset, loc.length) == (off, n)
                    off += n
                    acked_end = off
                    acks += 1
                    if acks >= target:
                        enough.set()

            async def killer():
                await enough.wait()
                await trio.sleep(rng.uniform(0, 0.02))      # land somewhere inside an append
                node.kill(signal.SIGKILL)

            with trio.fail_after(60):
                async with trio.open_nursery() as n:
                    n.start_soon(appender)
                    n.start_soon(killer)
        assert node.proc.returncode == -signal.SIGKILL
        node.start()
        async with client([node.addr]) as dc:
            size = (await dc.watermarks(PID))[eid]
            assert size >= acked_end, f"round {round_no}: acked up to {acked_end}, recovered only {size}"
            assert size in sent_ends, f"round {round_no}: recovered size {size} is not the end of any append"
            data = await dc.read(PID, eid, 0, size)       # every block verifies
            assert data == stream[:size], f"round {round_no}: recovered bytes differ from what was sent"
            state["size"] = size

    run(one_round, 1)
    run(one_round, 2)     # appends continue at the recovered end, then a second crash


# ---------------------------------------------------------------------------------------------- on disk
def test_flipped_byte_on_disk_is_a_crc_error(nodes, client):
    [node] = nodes(1)
    a_data = pattern(1, 3 * BLOCK + 1000)     # the flip goes into block 1 (a full block in the middle)
    b_data = pattern(2, 2 * BLOCK + 77)       # the flip goes into its partial last block
    c_data = pattern(3, 300 * KiB)            # untouched

    async def write_extents():
        async with client([]) as dc:
            await create_partition(dc, PID, [node.addr])
            eids = []
            for data in (a_data, b_data, c_data):
                eid = await dc.create_extent(PID)
                for off in range(0, len(data), 512 * KiB):
                    await dc.append(PID, eid, off, data[off:off + 512 * KiB])
                eids.append(eid)
            return eids

    a, b, c = run(write_extents)

    def flip(eid, pos):
        path = extent_file(node, PID, eid)
        raw = bytearray(path.read_bytes())
        raw[pos] ^= 0x40
        path.write_bytes(raw)

    flip(a, BLOCK + 5)
    flip(b, 2 * BLOCK + 10)

    async def check(after_restart: bool):
        async with client([node.addr]) as dc:
            marks = await dc.watermarks(PID)
            # acknowledged data is not dropped because one block went bad (not even the last block)
            assert marks == {a: len(a_data), b: len(b_data), c: len(c_data)}
            for eid, data in ((a, a_data), (b, b_data)):
                with pytest.raises(ClientError) as ei:
                    await dc.read(PID, eid, 0, len(data))
                assert ei.value.result == Result.CRC_MISMATCH, (after_restart, ei.value)
            with pytest.raises(ClientError) as ei:
                await dc.read(PID, a, BLOCK + 4, 3)           # just the damaged bytes' block
            assert ei.value.result == Result.CRC_MISMATCH
            # blocks that were not touched still read, in the damaged extents too
            assert await dc.read(PID, a, 0, BLOCK) == a_data[:BLOCK]
            assert await dc.read(PID, a, 2 * BLOCK, len(a_data) - 2 * BLOCK) == a_data[2 * BLOCK:]
            assert await dc.read(PID, b, 0, 2 * BLOCK) == b_data[:2 * BLOCK]
            assert await dc.read(PID, c, 0, len(c_data)) == c_data

    run(check, False)
    node.stop()
    node.start()          # recovery at open must keep (and report) the bad blocks, not hide them
    run(check, True)


def test_cold_read_through_the_node_returns_the_bytes_and_refuses_a_flipped_bit(nodes, client):
    """Reads whose bytes are not in the node's page cache (evicted: the node reads them with O_DIRECT into
    its pool block) return exactly what was written, through ``read`` and ``read_into`` (a caller's buffer,
    several requests in flight); a bit flipped on the disk is still refused with CRC_MISMATCH and leaves no
    unverified bytes in the caller's buffer, while the untouched blocks still read."""
    from tests.test_store import cached, evict
    [node] = nodes(1)
    data = pattern(7, 4 * MiB)

    async def write():
        async with client([]) as dc:
            await create_partition(dc, PID, [node.addr])
            eid = await dc.create_extent(PID)
            for off in range(0, len(data), MiB):
                await dc.append(PID, eid, off, data[off:off + MiB])
            return eid

    eid = run(write)
    path = extent_file(node, PID, eid)

    async def read_cold():
        async with client([node.addr], block_size=MiB) as dc:
            evict(path)
            assert await dc.read(PID, eid, MiB, MiB) == data[MiB:2 * MiB]
            if cached(path, MiB, MiB) is not None:
                assert cached(path, MiB, MiB) == 0         # the node read around its page cache
            evict(path)
            buf = bytearray(4 * MiB)
            assert await dc.read_into(PID, eid, 0, buf) == 4 * MiB     # four 1 MiB requests at once
            assert buf == data
            assert await dc.read_into(PID, eid, 0, bytearray()) == 0

    run(read_cold)
    with open(path, "r+b") as f:                    # one bit, in place, on the disk
        f.seek(2 * MiB + 5)
        b = f.read(1)
        f.seek(2 * MiB + 5)
        f.write(bytes([b[0] ^ 0x01]))
    evict(path)

    async def read_flipped():
        async with client([node.addr], block_size=MiB) as dc:
            buf = bytearray(b"\xaa" * 4 * MiB)
            with pytest.raises(ClientError) as ei:
                await dc.read_into(PID, eid, 0, buf)
            assert ei.value.result == Result.CRC_MISMATCH, ei.value
            assert buf[2 * MiB:3 * MiB] == bytes(MiB)            # nothing unverified where the bit flipped
            # the other pieces in flight were let finish, not cancelled under the node's answers (on verbs
            # a refused RDMA WRITE resets the connection, failing every other request on it)
            link = dc.links._links[node.addr]
            await trio.sleep(0.3)
            assert link.alive and dc.links._links[node.addr] is link
            evict(path)
            with pytest.raises(ClientError) as ei:
                await dc.read(PID, eid, 2 * MiB, MiB)
            assert ei.value.result == Result.CRC_MISMATCH, ei.value
            evict(path)
            assert await dc.read(PID, eid, 3 * MiB, MiB) == data[3 * MiB:]
            assert await dc.read(PID, eid, 0, 2 * MiB) == data[:2 * MiB]

    run(read_flipped)


def test_a_tcp_append_is_read_by_the_leader_from_the_callers_own_bytes(nodes, client):
    """Where every link is TCP, a big append's payload is not staged in the client's pool: the caller's
    buffer (``bytes`` too) is registered for that one append and the leader READs it from there; once the
    append is answered -- acknowledged or refused -- it is out of the client's domain again.  Every byte
    reads back from each replica."""
    ns = nodes(2)
    addrs = [n.addr for n in ns]
    one = pattern(11, MiB)                       # bytes: read-only
    more = bytearray(pattern(12, 3 * MiB))

    async def main():
        async with client([], block_size=MiB) as dc:
            if dc.domain.device is not None:
                pytest.skip("with an RDMA device appends are staged in the registered pool")
            await create_partition(dc, PID, addrs)
            regions = len(dc.domain._regions)
            allocs = dc.wpool.stats()["allocs"]
            eid = await dc.create_extent(PID)
            await dc.append(PID, eid, 0, one)
            locs = await dc.write(PID, more)                  # pipelined: several in flight at once
            assert dc.wpool.stats()["allocs"] == allocs       # no staging block
            assert len(dc.domain._regions) == regions         # every per-append registration dropped
            with pytest.raises(ClientError) as ei:             # refused (not at the extent's end)
                await dc.append(PID, eid, 5, one)
            assert ei.value.result != Result.OK
            assert len(dc.domain._regions) == regions
            assert await dc.read(PID, eid, 0, MiB, replica=addrs[1]) == one
            start = 0
            for loc in locs:
                for addr in addrs:
                    got = await dc.read(PID, loc.extent, loc.offset, loc.length, replica=addr)
                    assert got == bytes(more[start:start + loc.length])
                start += loc.length
            assert start == len(more)

    run(main)


async def _one_node_extent(dc, node, data) -> int:
    """Partition PID on ``node`` alone, one extent holding ``data`` (appended 1 MiB at a time): its id."""
    await create_partition(dc, PID, [node.addr])
    eid = await dc.create_extent(PID)
    for off in range(0, len(data), MiB):
        await dc.append(PID, eid, off, data[off:off + MiB])
    return eid


def test_a_read_in_flight_when_its_connection_dies_is_sent_again_on_a_new_one(nodes, client):
    """A node dies with a read in flight and is back by the time the client notices: the read is sent
    again, once, on a new connection -- the caller sees the bytes, not "connection closed".  (A READ is safe
    to repeat; a write is never sent again this way: it may have been applied.)"""
    [node] = nodes(1)
    data = pattern(9, 2 * MiB)

    async def body():
        # the client's loop is blocked while the node restarts (9-10 s in the Soft-RoCE VM): a request
        # timeout shorter than that turns the close it then sees into a timeout (seen once in CI)
        async with client([], block_size=MiB, timeout=60) as dc:
            eid = await _one_node_extent(dc, node, data)
            old = dc.links._links[node.addr]
            got = []
            node.proc.send_signal(signal.SIGSTOP)           # the node takes the request and does not answer

            async def reader():
                got.append(await dc.read(PID, eid, 0, len(data)))
            async with trio.open_nursery() as n:
                n.start_soon(reader)
                await trio.sleep(0.3)                         # both READs sent, waiting
                node.kill()              # blocking calls: the client notices the close only after the restart
                node.start()
            assert got == [data]
            assert dc.links._links[node.addr] is not old

    run(body)


def test_reads_their_caller_cancels_leave_the_connection_and_the_buffer_alone(nodes, client):
    """A caller cancels reads the node is serving: they wait (shielded, up to rpc.ABANDON_GRACE) for the
    node to finish with the buffer before revoking its grant -- on verbs a window revoked under the node's
    RDMA WRITE breaks the whole connection, every other request on it with it.  So the connection is still
    the same and works, and once the cancelled call has returned nothing lands in its buffer any more."""
    [node] = nodes(1)
    data = pattern(11, 4 * MiB)

    async def body():
        async with client([], block_size=MiB) as dc:
            eid = await _one_node_extent(dc, node, data)
            link = dc.links._links[node.addr]
            buf = bytearray(2 * MiB)
            scope = trio.CancelScope()

            async def reader():
                with scope:
                    await dc.read_into(PID, eid, MiB, buf)

            node.proc.send_signal(signal.SIGSTOP)           # the node takes the requests and does not answer
            try:
                async with trio.open_nursery() as n:
                    n.start_soon(reader)
                    await trio.sleep(0.3)                     # both READs sent, waiting
                    scope.cancel()                            # the caller gives up ...
                    await trio.sleep(0.1)
                    node.proc.send_signal(signal.SIGCONT)     # ... and the node goes on serving them
            finally:
                node.proc.send_signal(signal.SIGCONT)
            assert scope.cancelled_caught
            landed = bytes(buf)
            await trio.sleep(0.3)
            assert bytes(buf) == landed                       # nothing after the call returned
            assert link.alive and dc.links._links[node.addr] is link
            assert await dc.read(PID, eid, 0, len(data)) == data
            assert dc.links._links[node.addr] is link

    run(body)


def test_a_read_answer_that_comes_after_its_caller_gave_up_lands_nowhere_and_is_counted(nodes, client, transport):
    """The node answers a read only after the caller cancelled it and its grace (``rpc.ABANDON_GRACE``) is
    over, so the buffer's grant is revoked: the answer lands nowhere -- the caller has its memory back --,
    the next reads work, and the node counts the refused answer (NODE_STATUS ``answers_refused``, metric
    ``datanode_answers_refused_total``).  On verbs the revoked window makes the node's RDMA WRITE fail:
    that connection ends and the next read dials again; the buffer is untouched there too."""
    [node] = nodes(1)
    data = pattern(12, 2 * MiB)

    async def body():
        async with client([], block_size=MiB) as dc:
            eid = await _one_node_extent(dc, node, data)
            buf = bytearray(b"\x77" * MiB)
            scope = trio.CancelScope()

            async def reader():
                with scope:
                    await dc.read_into(PID, eid, 0, buf)

            node.proc.send_signal(signal.SIGSTOP)
            try:
                async with trio.open_nursery() as n:
                    n.start_soon(reader)
                    await trio.sleep(0.3)
                    scope.cancel()
                await trio.sleep(rpc.ABANDON_GRACE + 0.5)       # the grant is gone
            finally:
                node.proc.send_signal(signal.SIGCONT)
            assert scope.cancelled_caught
            assert await dc.read(PID, eid, MiB, MiB) == data[MiB:]
            await trio.sleep(0.3)
            assert bytes(buf) == b"\x77" * MiB
            if transport == "tcp":
                with trio.fail_after(10):
                    while not (await dc.admin(node.addr, Op.NODE_STATUS))["counters"]["answers_refused"]:
                        await trio.sleep(0.05)

    run(body)


# -------------------------------------------------------------------------------------- hostile peers
class Raw:
    """A raw protocol connection: crafted headers in, decoded responses out; memory the server may use."""

    def __init__(self, conn, domain):
        self.conn = conn
        self.pool = BuddyPool(MiB, MiB)
        self.region = domain.register(self.pool.arena, self.pool.base_addr,
                                      Access.LOCAL_WRITE | Access.REMOTE_READ | Access.REMOTE_WRITE)
        self.next_id = 1000

    async def send_raw(self, raw: bytes) -> Header:
        await self.conn.send(raw)
        with trio.fail_after(10):
            return decode(await self.conn.recv(), request=False)

    async def call(self, h: Header) -> Header:
        self.next_id += 1
        h = dataclasses.replace(h, req_id=self.next_id)
        resp = await self.send_raw(h.encode())
        assert resp.req_id == h.req_id
        return resp

    async def ping(self) -> Header:
        return await self.call(Header(opcode=Op.PING))

    def payload(self, data: bytes) -> tuple[int, int]:
        """Put ``data`` at the start of our region; returns (addr, rkey)."""
        self.region.view[:len(data)] = data
        return self.region.addr, self.region.rkey


def crafted(opcode=Op.READ, req_id=4242, **kw) -> bytearray:
    return bytearray(Header(opcode=opcode, req_id=req_id, partition=PID, **kw).encode())


def reseal(raw: bytearray) -> bytes:
    raw[84:88] = crc32c(bytes(raw[:84])).to_bytes(4, "big")
    return bytes(raw)


def malformed_cases():
    bad_magic = crafted()
    bad_magic[0:2] = b"\xbe\xef"
    bad_hcrc = crafted()
    bad_hcrc[20] ^= 0x01                           # a flip in the body, header CRC left as it was
    unknown_op = crafted()
    unknown_op[3] = 0x77
    absurd = crafted(opcode=Op.READ)
    absurd[32:36] = (MAX_PAYLOAD + 1).to_bytes(4, "big")
    return {"bad_magic": reseal(bad_magic), "bad_header_crc": bytes(bad_hcrc),
            "truncated": bytes(crafted()[:HEADER_SIZE - 1]), "absurd_length": reseal(absurd),
            "unknown_opcode": reseal(unknown_op)}


def test_malformed_headers_get_protocol_results(nodes, transport):
    [node] = nodes(1)
    host, port = host_port(node.addr)

    async def body():
        domain = client_domain(transport)
        async with dial(host, port, domain, transport=transport) as c1, \
                dial(host, port, domain, transport=transport) as c2:
            raw1, raw2 = Raw(c1, domain), Raw(c2, domain)
            pid = (await raw2.ping()).arg
            assert pid == node.pid
            for reason, raw in malformed_cases().items():
                resp = await raw1.send_raw(raw)
                assert resp.result == Result.PROTOCOL, reason
                assert PROTOCOL_REASONS[resp.arg] == reason, (reason, resp.result_text())
                assert reason in resp.result_text()
                assert resp.req_id == 4242, reason          # matched to the request that caused it
                # the same connection, and another one, are still served
                assert (await raw1.ping()).result == Result.OK
                assert (await raw2.ping()).result == Result.OK
        async with open_client(transport, [], domain=domain) as dc:
            status = await dc.admin(node.addr, Op.NODE_STATUS)
            assert status["counters"]["protocol_errors"] == len(malformed_cases())
            await create_partition(dc, PID, [node.addr])
            locs = await dc.write(PID, b"still serving")
            assert await dc.read_location(locs[0]) == b"still serving"
    run(body)
    assert node.alive()


def test_write_with_bad_descriptor_is_remote_access(nodes, transport):
    """A write whose descriptor names memory the client did not register (wrong rkey, outside the region)
    is refused with REMOTE_ACCESS; the extent is untouched and the server keeps serving."""
    [node] = nodes(1)
    host, port = host_port(node.addr)
    data = pattern(5, 8 * KiB)

    async def body():
        domain = client_domain(transport)
        async with open_client(transport, [], domain=domain) as dc:
            await create_partition(dc, PID, [node.addr])
            eid = await dc.create_extent(PID)
        async with dial(host, port, domain, transport=transport) as conn:
            raw = Raw(conn, domain)
            addr, rkey = raw.payload(data)
            base = dict(opcode=Op.WRITE, partition=PID, extent=eid, offset=0, length=len(data), crc=crc32c(data),
                        epoch=1, rlen=len(data))
            bad = {"wrong rkey": dict(addr=addr, rkey=rkey ^ 0x5A5A5A5A),
                   "past the end": dict(addr=raw.region.addr + raw.region.length - len(data) // 2, rkey=rkey),
                   "before the start": dict(addr=raw.region.addr - 4096, rkey=rkey)}
            for what, desc in bad.items():
                try:
                    resp = await raw.call(Header(**base, **desc))
                except ConnectionClosed:
                    # verbs: a one-sided error takes the queue pair down with it; the server lives on
                    assert transport == "verbs", what
                    break
                assert resp.result == Result.REMOTE_ACCESS, (what, resp.result_text())
            if transport == "tcp":
                resp = await raw.call(Header(**base, addr=addr, rkey=rkey))
                assert resp.result == Result.OK, resp.result_text()
        async with open_client(transport, [node.addr], domain=domain) as dc:
            if transport != "tcp":
                await dc.append(PID, eid, 0, data)
            assert (await dc.watermarks(PID))[eid] == len(data)    # no refused write left anything behind
            assert await dc.read(PID, eid, 0, len(data)) == data
    run(body)
    assert node.alive()


@pytest.mark.parametrize("size", [64 * KiB, MiB], ids=["64KiB", "1MiB"])
def test_write_whose_payload_does_not_match_its_crc_is_refused(nodes, transport, size):
    """A write whose payload (fetched with a one-sided READ) does not match the header's CRC32C is refused
    with CRC_MISMATCH and appends nothing, for a small and a block-sized payload; the same write with the
    right CRC then appends, and the bytes read back are the ones written."""
    [node] = nodes(1)
    host, port = host_port(node.addr)
    data = pattern(9, size)

    async def body():
        domain = client_domain(transport)
        async with open_client(transport, [], domain=domain) as dc:
            await create_partition(dc, PID, [node.addr])
            eid = await dc.create_extent(PID)
        async with dial(host, port, domain, transport=transport) as conn:
            raw = Raw(conn, domain)
            addr, rkey = raw.payload(data)
            base = dict(opcode=Op.WRITE, partition=PID, extent=eid, offset=0, length=len(data), epoch=1,
                        addr=addr, rkey=rkey, rlen=len(data))
            for bad in (crc32c(data) ^ 1, crc32c(data[:-1])):
                resp = await raw.call(Header(**base, crc=bad))
                assert resp.result == Result.CRC_MISMATCH, resp.result_text()
            resp = await raw.call(Header(**base, crc=crc32c(data)))
            assert resp.result == Result.OK, resp.result_text()
            assert resp.arg == len(data)
        async with open_client(transport, [node.addr], domain=domain) as dc:
            assert (await dc.watermarks(PID))[eid] == len(data)    # the refused writes left nothing behind
            assert await dc.read(PID, eid, 0, len(data)) == data
    run(body)
    assert node.alive()


def test_server_pool_cannot_be_written_by_a_peer(nodes, transport):
    [node] = nodes(1)
    host, port = host_port(node.addr)
    data = pattern(11, 3 * BLOCK)

    async def body():
        domain = client_domain(transport)
        async with open_client(transport, [], domain=domain) as dc:
            await create_partition(dc, PID, [node.addr])
            locs = await dc.write(PID, data)
            stats = await dc.admin(node.addr, Op.POOL_STATS)
            assert stats["remote_write"] is False
        async with dial(host, port, domain, transport=transport) as conn:
            raw = Raw(conn, domain)
            junk = b"\xee" * (256 * KiB)
            raw.region.view[:len(junk)] = junk
            for off in (0, 4 * MiB, stats["arena_bytes"] - len(junk)):
                target = Header(opcode=0, addr=stats["base_addr"] + off, rkey=stats["rkey"], rlen=len(junk)).remote
                with pytest.raises((RemoteAccessError, ConnectionClosed)) as ei:
                    with trio.fail_after(10):
                        await conn.write(raw.region.view[:len(junk)], raw.region, target)
                if transport == "tcp":
                    assert isinstance(ei.value, RemoteAccessError)
                    assert (await raw.ping()).result == Result.OK     # the connection survives the refusal
                else:
                    break
            if transport == "tcp":
                async with open_client(transport, [], domain=domain) as dc:
                    status = await dc.admin(node.addr, Op.NODE_STATUS)
                # the server saw (and refused) all three attempts on the raw connection, and served nothing
                assert sorted(c["refused"] for c in status["connections"])[-1] == 3
                assert sum(c["served_writes"] for c in status["connections"]) == 0
        async with open_client(transport, [node.addr], domain=domain) as dc:
            # data moving through the pool is still right (it was not overwritten with the junk)
            assert b"".join([await dc.read_location(loc) for loc in locs]) == data
            more = pattern(12, 2 * MiB)
            locs2 = await dc.write(PID, more)
            assert b"".join([await dc.read_location(loc) for loc in locs2]) == more
    run(body)
    assert node.alive()


# -------------------------------------------------------------------------------------------- shutdown
def test_sigterm_drains_in_flight_writes(nodes, client):
    """SIGTERM while several clients append: the daemon exits 0, and everything it acknowledged is there after
    a restart."""
    [node] = nodes(1)
    writers = 4

    async def body():
        acked: dict[int, list[tuple[int, bytes]]] = {}
        errors = []
        async with client([]) as dc:
            await create_partition(dc, PID, [node.addr])
            eids = [await dc.create_extent(PID) for _ in range(writers)]
        total = 0
        enough = trio.Event()

        async def writer(i, eid):
            nonlocal total
            rng = random.Random(i)
            off = 0
            acked[eid] = []
            async with client([node.addr]) as dc:
                while True:
                    data = rng.randbytes(rng.randrange(1, 400 * KiB))
                    try:
                        await dc.append(PID, eid, off, data)
                    except ClientError as e:
                        errors.append(e)
                        return
                    acked[eid].append((off, data))
                    off += len(data)
                    total += 1
                    if total >= 40:
                        enough.set()

        async def terminator():
            await enough.wait()
            node.proc.send_signal(signal.SIGTERM)

        with trio.fail_after(60):
            async with trio.open_nursery() as n:
                for i, eid in enumerate(eids):
                    n.start_soon(writer, i, eid)
                n.start_soon(terminator)
        return acked, errors

    acked, errors = run(body)
    assert node.proc.wait(timeout=30) == 0, "the daemon did not exit cleanly on SIGTERM"
    assert len(errors) == writers
    node.start()

    async def verify():
        async with client([node.addr]) as dc:
            marks = await dc.watermarks(PID)
            for eid, pieces in acked.items():
                end = pieces[-1][0] + len(pieces[-1][1]) if pieces else 0
                assert marks[eid] >= end
                got = await dc.read(PID, eid, 0, end)
                assert got == b"".join(d for _, d in pieces)
    run(verify)


async def _tcp_session(host: str, port: int):
    """A bare TCP-transport session: we play the client's transport layer by hand, so we decide when the
    server's one-sided READ of our payload is answered."""
    sock = trio.socket.socket()
    await sock.connect((host, port))
    await send_all(sock, Hello(transport=Transport.TCP, has_device=False, slots=8).encode())
    buf = bytearray(HELLO_SIZE)
    await recv_exactly(sock, memoryview(buf))
    answer = decode_hello(buf)
    assert answer.transport == Transport.TCP
    await recv_exactly(sock, memoryview(bytearray(answer.ident_len + answer.ext_len)))   # identity, extensions
    return sock


async def _recv_frame(sock):
    fb = bytearray(FRAME.size)
    await recv_exactly(sock, memoryview(fb))
    ftype, status, _pad, length, op, addr, rkey, _r = FRAME.unpack(fb)
    body = b""
    if ftype == CTRL:
        b = bytearray(length)
        await recv_exactly(sock, memoryview(b))
        body = bytes(b)
    return ftype, status, length, op, addr, rkey, body


def test_sigterm_answers_the_request_it_drains(nodes):
    """A write is deterministically in flight at SIGTERM (the server waits for our payload); once the daemon
    has stopped accepting, the payload is delivered: the write must still be acknowledged, exit is 0, and the
    write is on disk after a restart."""
    [node] = nodes(1, transport="tcp")
    host, port = host_port(node.addr)
    data = pattern(21, 100 * KiB)

    async def body():
        async with open_client("tcp", []) as dc:
            await create_partition(dc, PID, [node.addr])
            eid = await dc.create_extent(PID)
        sock = await _tcp_session(host, port)
        with sock, trio.fail_after(30):
            h = Header(opcode=Op.WRITE, partition=PID, extent=eid, offset=0, length=len(data), crc=crc32c(data),
                       req_id=77, epoch=1, addr=0x10000, rkey=0x1234, rlen=len(data))
            await send_all(sock, FRAME.pack(CTRL, 0, 0, HEADER_SIZE, 0, 0, 0, 0) + h.encode())
            ftype, _st, length, op, addr, rkey, _ = await _recv_frame(sock)
            assert (ftype, length, addr, rkey) == (READ_REQ, len(data), 0x10000, 0x1234)
            node.proc.send_signal(signal.SIGTERM)
            while True:            # wait until the daemon has stopped accepting: it is draining now
                try:
                    with trio.socket.socket() as probe:
                        await probe.connect((host, port))
                except OSError:
                    break
                await trio.sleep(0.02)
            await send_all(sock, FRAME.pack(READ_RESP, 0, 0, len(data), op, 0, 0, 0) + data)
            try:
                ftype, _st, _len, _op, _a, _r, raw = await _recv_frame(sock)
            except ConnectionClosed:
                pytest.fail("the daemon closed the connection without answering the request it was draining")
            assert ftype == CTRL
            resp = decode(raw, request=False)
            assert (resp.req_id, resp.result) == (77, Result.OK), resp.result_text()
        return eid

    eid = run(body)
    assert node.proc.wait(timeout=30) == 0
    node.start()

    async def verify():
        async with open_client("tcp", [node.addr]) as dc:
            assert await dc.read(PID, eid, 0, len(data)) == data
    run(verify)


# ------------------------------------------------------------------------------------------------ config
def test_every_thread_of_a_node_runs_under_its_cpu_sched_policy(nodes):
    """cpu_sched = batch (the default): the node and every thread it starts (group commit, workers) run
    under SCHED_BATCH, and still serve; cpu_sched = normal leaves them all under SCHED_OTHER."""
    batch, normal = nodes(1)[0], nodes(1, cpu_sched="normal")[0]

    async def work(node):         # a write and a read, so the node's worker threads exist
        async with open_client("tcp", [node.addr]) as dc:
            await create_partition(dc, PID, [node.addr])
            eid = await dc.create_extent(PID)
            data = pattern(3, 1 << 20)
            await dc.append(PID, eid, 0, data)
            assert await dc.read(PID, eid, 0, len(data)) == data

    for node, want in ((batch, os.SCHED_BATCH), (normal, os.SCHED_OTHER)):
        run(work, node)
        tids = [int(t) for t in os.listdir(f"/proc/{node.pid}/task")]
        assert len(tids) > 1
        assert {os.sched_getscheduler(t) for t in tids} == {want}, node.addr


BAD_CONFIGS = [
    ("pool_mib", "pool_mib = 0"),
    ("pool_mib", 'pool_mib = "64"'),
    ("max_block_kib", "max_block_kib = 3"),
    ("sync", 'sync = "sometimes"'),
    ("transport", 'transport = "carrier-pigeon"'),
    ("listen", 'listen = "no-port-here"'),
    ("replica_timeout", "replica_timeout = 0"),
    ("pool_wait", "pool_wait = -1.5"),
    ("slots", "slots = 0"),
    ("slots", "slots = true"),
    ("log_level", 'log_level = "loud"'),
    ("cpu_sched", 'cpu_sched = "realtime"'),
    ("data_dir", 'data_dir = ""'),
    ("pool_size", "pool_size = 64"),
]


@pytest.mark.parametrize("key,line", BAD_CONFIGS, ids=[f"{k}:{v.split('=')[1].strip()}" for k, v in BAD_CONFIGS])
def test_bad_config_names_the_key(tmp_path, key, line):
    port = free_port()
    base = {"listen": f'listen = "127.0.0.1:{port}"', "data_dir": f'data_dir = "{tmp_path / "data"}"'}
    lines = [v for k, v in base.items() if not line.startswith(k + " ")] + [line]
    cfg = tmp_path / "bad.toml"
    cfg.write_text("\n".join(lines) + "\n")
    r = subprocess.run([sys.executable, "-m", "datanode.cli", "serve", "--config", str(cfg)], cwd=REPO,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode != 0
    assert key in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr


def test_unparsable_config_names_the_file(tmp_path):
    cfg = tmp_path / "broken.toml"
    cfg.write_text("pool_mib = = 3\n")
    r = subprocess.run([sys.executable, "-m", "datanode.cli", "serve", "--config", str(cfg)], cwd=REPO,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode != 0 and str(cfg) in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.skipif(bool(os.environ.get("DATANODE_RDMA_DEVICE")), reason="an RDMA device is configured here")
def test_verbs_required_without_device_is_a_config_error(tmp_path):
    cfg = tmp_path / "verbs.toml"
    cfg.write_text(f'listen = "127.0.0.1:{free_port()}"\ndata_dir = "{tmp_path / "data"}"\n'
                   f'transport = "verbs"\nrdma_device = "nosuchdev0"\n')
    r = subprocess.run([sys.executable, "-m", "datanode.cli", "serve", "--config", str(cfg)], cwd=REPO,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode != 0 and "transport" in r.stderr and "Traceback" not in r.stderr, r.stderr
