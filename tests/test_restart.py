"""Restart: a node listens at once and answers "starting" (with progress) while it opens its partitions,
refuses data and admin requests with RETRY until then, and serves every byte it held afterwards; opening
checks only the tails (``open_verify = tail``), and the first scrub after start finds mid-extent damage."""
from __future__ import annotations

import errno
import json
import os
import pathlib
import shutil
import signal
import sys
import threading
import time

import pytest
import trio

from client.sdk import ClientError
from datanode import config as config_mod
from datanode.partition import PartitionTable
from wire.protocol import Header, Op, Result
from datanode.store import BLOCK
from tests.conftest import create_partition, open_client, pattern, run

KiB, MiB = 1 << 10, 1 << 20
PID = 1
HANG_GUARD = 60.0      # seconds: only so that a broken node fails the test instead of hanging it


def data_dir(node) -> pathlib.Path:
    return pathlib.Path(node.cfg["data_dir"])


def extent_data(eid: int) -> bytes:
    """Extent ``eid``'s bytes: sizes vary (a partial last block, exact blocks, several MiB)."""
    return pattern(1000 + eid, [3 * MiB + 777, 2 * BLOCK, 5 * KiB, 1][eid % 4] + (eid % 7) * 4099)


def fill_with_store(node, extents: int) -> dict[int, bytes]:
    """Partition PID on ``node`` (stopped) holding ``extents`` extents, written with the store API."""
    table = PartitionTable(data_dir(node), "none")
    part = table.create(PID, [node.addr], 1)
    want = {}
    try:
        for _ in range(extents):
            eid = part.store.create_extent()
            data = extent_data(eid)
            for off in range(0, len(data), MiB):
                part.store.write(eid, off, data[off:off + MiB])
            want[eid] = data
    finally:
        table.close()
    return want


async def status(dc, addr: str) -> dict:
    return await dc.admin(addr, Op.NODE_STATUS)


def hold_load(node) -> pathlib.Path:
    """Make the node's loading thread stop at a known point, without any hook in the node: partition 9's
    meta.json is a FIFO, whose read blocks until ``release`` writes it.  Partitions sorting before "9" are
    all open by then."""
    held = data_dir(node) / "partitions" / "9"
    held.mkdir()
    fifo = held / "meta.json"
    os.mkfifo(fifo)
    return fifo


def release(node, fifo: pathlib.Path) -> None:
    """Write partition 9's meta into the FIFO once the node's loader has opened it to read."""
    body = json.dumps({"id": 9, "replicas": [node.addr], "epoch": 1}).encode()
    deadline = time.monotonic() + HANG_GUARD
    while True:
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as e:                            # ENXIO: no reader (yet)
            if e.errno != errno.ENXIO or time.monotonic() > deadline or not node.alive():
                return
            time.sleep(0.01)
            continue
        try:
            os.write(fd, body)
        finally:
            os.close(fd)
        return


async def wait_opened(dc, node, extents: int) -> dict:
    """Poll NODE_STATUS until the node reports ``extents`` extents opened; returns that status."""
    with trio.fail_after(HANG_GUARD):
        while True:
            try:
                st = await status(dc, node.addr)
            except ClientError:                         # not listening yet
                await trio.sleep(0.02)
                continue
            if st["opening"]["extents"] == extents:
                return st
            assert st["state"] == "starting", st
            await trio.sleep(0.02)


def test_node_answers_starting_with_progress_then_serves_every_byte(nodes):
    """While its loading thread is held (see ``hold_load``) after partition 1 (many extents) is open, the
    node answers NODE_STATUS "starting" with exactly that progress, PING, and RETRY to everything else;
    NodeProc.start (dnctl cluster up) has not returned.  Released, it serves every byte it held."""
    [node] = nodes(1)
    node.stop()
    want = fill_with_store(node, 120)
    fifo = hold_load(node)
    started = threading.Thread(target=node.start)      # NodeProc.start returns once the node serves

    async def check_starting():
        async with open_client("tcp", [], timeout=10) as dc:
            st = await wait_opened(dc, node, len(want))
            assert st["state"] == "starting"
            o = st["opening"]
            assert (o["verify"], o["partitions"], o["partitions_total"]) == ("tail", 1, 2)
            assert o["extents_total"] == len(want)
            assert o["bytes"] == o["bytes_total"] == sum(map(len, want.values()))
            assert st["partitions"] == []               # nothing is served before everything is open
            assert started.is_alive(), "NodeProc.start returned before the node serves"
            resp, _ = await dc.request(node.addr, Header(opcode=Op.PING))
            assert resp.result == Result.OK and resp.arg == st["pid"]
            for op, kw in ((Op.PARTITION_LIST, {}), (Op.WATERMARKS, {"partition": PID})):
                with pytest.raises(ClientError) as ei:
                    await dc.admin(node.addr, op, **kw)
                assert ei.value.result == Result.RETRY, (op, ei.value)
            with pytest.raises(ClientError) as ei:
                await dc.admin(node.addr, Op.PARTITION_CREATE, partition=5,
                               body={"replicas": [node.addr], "epoch": 1})
            assert ei.value.result == Result.RETRY
            # and an operator sees it in plain text
            out = await trio.run_process([sys.executable, "-m", "tools.dnctl", "node", "status", node.addr],
                                         capture_stdout=True, capture_stderr=True,
                                         cwd=pathlib.Path(__file__).resolve().parent.parent)
            text = out.stdout.decode()
            assert ", starting;" in text and "opening (tail check): partitions 1/2" in text, text

    started.start()
    try:
        run(check_starting)
    finally:
        release(node, fifo)
        started.join(HANG_GUARD)
    assert not started.is_alive()

    async def check_serving():
        async with open_client("tcp", [node.addr]) as dc:
            st = await status(dc, node.addr)
            assert st["state"] == "serving" and st["partitions"] == [PID, 9]
            assert st["opening"]["partitions"] == 2
            marks = await dc.watermarks(PID)
            assert marks == {e: len(d) for e, d in want.items()}
            for eid, data in want.items():
                assert await dc.read(PID, eid, 0, len(data)) == data, f"extent {eid} reads back different"
            eid = await dc.create_extent(PID)           # and it takes writes again
            await dc.append(PID, eid, 0, b"after restart")
            assert await dc.read(PID, eid, 0, 13) == b"after restart"

    run(check_serving)


def test_sigterm_while_starting_stops_and_keeps_the_data(nodes):
    """A node told to stop while it opens its partitions exits cleanly (status 0) without serving; started
    again, it serves everything it held."""
    [node] = nodes(1)
    node.stop()
    want = fill_with_store(node, 12)
    fifo = hold_load(node)
    outcome: list = []

    def start():
        try:
            node.start()
            outcome.append("serving")
        except RuntimeError as e:                       # "exited with status 0 while starting"
            outcome.append(str(e))

    started = threading.Thread(target=start)

    async def wait():
        async with open_client("tcp", [], timeout=10) as dc:
            await wait_opened(dc, node, len(want))

    started.start()
    try:
        run(wait)
        node.proc.send_signal(signal.SIGTERM)
    finally:
        release(node, fifo)                             # the loader finishes reading; it stops at its next look
        started.join(HANG_GUARD)
    assert node.proc.wait(timeout=HANG_GUARD) == 0
    assert outcome and "exited with status 0 while starting" in outcome[0], outcome
    log = node.log_path.read_text()
    assert "stopped" in log.splitlines()[-1]
    assert "serving:" not in log.split("opening partitions")[-1]
    shutil.rmtree(fifo.parent)                          # (its meta would hold the next start again)
    node.start()

    async def check():
        async with open_client("tcp", [node.addr]) as dc:
            assert (await status(dc, node.addr))["partitions"] == [PID]
            for eid, data in want.items():
                assert await dc.read(PID, eid, 0, len(data)) == data

    run(check)


def test_torn_tail_is_cut_when_a_node_opens_with_open_verify_tail(nodes):
    """Bytes of an append that never completed (its data landed, its CRC entries did not, and half an
    entry at the end of the CRC file) are cut when the node opens its partitions with open_verify = tail;
    every acknowledged byte stays, and the extent takes appends at the recovered end."""
    [node] = nodes(1)
    data = pattern(5, 3 * BLOCK + 999)

    async def write():
        async with open_client("tcp", []) as dc:
            await create_partition(dc, PID, [node.addr])
            eid = await dc.create_extent(PID)
            await dc.append(PID, eid, 0, data)
            return eid

    eid = run(write)
    node.stop()
    ext = data_dir(node) / "partitions" / str(PID) / "store" / "extents"
    with open(ext / f"{eid}.dat", "ab") as f:
        f.write(os.urandom(2 * BLOCK + 5))
    with open(ext / f"{eid}.crc", "ab") as f:
        f.write(b"\x01\x02\x03")
    node.start()

    async def check():
        async with open_client("tcp", [node.addr]) as dc:
            assert (await status(dc, node.addr))["opening"]["verify"] == "tail"
            assert await dc.watermarks(PID) == {eid: len(data)}
            assert await dc.read(PID, eid, 0, len(data)) == data
            await dc.append(PID, eid, len(data), b"more")
            assert await dc.read(PID, eid, 0, len(data) + 4) == data + b"more"

    run(check)
    on_disk = (ext / f"{eid}.dat").read_bytes()      # the cut garbage is gone; past the end only zeros
    assert on_disk[:len(data) + 4] == data + b"more"  # (zero-fill ahead of the small append: PREFILL)
    assert not on_disk[len(data) + 4:].strip(b"\0")


def test_first_scrub_after_start_finds_and_repairs_a_mid_extent_bad_block(nodes):
    """Opening with open_verify = tail does not read the middle of an extent; the leader's first scrub,
    a few heartbeats after start (no one asks for it), finds the flipped block and refills it from the
    follower, so the bytes read back are the ones written."""
    cfg = {"heartbeat_s": 0.3, "repair_mib_s": 0.0, "scrub_mib_s": 0.0, "scrub_interval_s": 3600.0}
    leader, fol = nodes(2, **cfg)
    data = pattern(7, 6 * BLOCK + 4321)

    async def write():
        async with open_client("tcp", []) as dc:
            await create_partition(dc, PID, [leader.addr, fol.addr])
            eid = await dc.create_extent(PID)
            for off in range(0, len(data), 512 * KiB):
                await dc.append(PID, eid, off, data[off:off + 512 * KiB])
            return eid

    eid = run(write)
    leader.stop()
    path = data_dir(leader) / "partitions" / str(PID) / "store" / "extents" / f"{eid}.dat"
    with open(path, "r+b") as f:                        # block 2 of 7: the middle of the extent
        f.seek(2 * BLOCK + 100)
        b = f.read(1)
        f.seek(2 * BLOCK + 100)
        f.write(bytes([b[0] ^ 0x20]))
    leader.start()

    async def check():
        async with open_client("tcp", [leader.addr]) as dc:
            st = await status(dc, leader.addr)
            assert st["opening"]["verify"] == "tail"
            with trio.fail_after(HANG_GUARD):
                while True:
                    h = await dc.admin(leader.addr, Op.PARTITION_HEALTH, partition=PID)
                    if h["scrub"]["passes"] >= 1:
                        break
                    await trio.sleep(0.1)
            last = h["scrub"]["last"]
            assert last["bad_blocks"] == 1 and last["repaired"] == 1, last
            assert last["events"] == [{"extent": eid, "replica": leader.addr, "blocks": [2]}]
            assert h["scrub"]["requested"] == 0                 # nobody asked: it was scheduled by the start
            assert await dc.read(PID, eid, 0, len(data)) == data
            assert await dc.read(PID, eid, 0, len(data), replica=fol.addr) == data

    run(check)


def test_store_reports_each_extent_and_a_stop_closes_what_it_opened(tmp_path):
    """The progress hook sees every extent; raising from it stops the open and closes the files."""
    from datanode.store import ExtentStore
    with ExtentStore(tmp_path, sync="none") as s:
        for _ in range(5):
            s.write(s.create_extent(), 0, b"x" * 1000)
    seen = []
    with ExtentStore(tmp_path, sync="none", verify="tail", on_extent=seen.append) as s:
        assert seen == [1000] * 5 and s.stats()["extents"] == 5

    class Stop(Exception):
        pass

    def stop_at_third(size):
        seen.append(size)
        if len(seen) == 3:
            raise Stop

    fds_before = len(os.listdir("/proc/self/fd"))
    seen.clear()
    with pytest.raises(Stop):
        ExtentStore(tmp_path, sync="none", verify="tail", on_extent=stop_at_third)
    assert len(os.listdir("/proc/self/fd")) == fds_before     # nothing left open


def test_open_verify_is_checked():
    assert config_mod.Config().open_verify == "tail"
    assert config_mod.from_dict({"open_verify": "full"}).open_verify == "full"
    with pytest.raises(config_mod.ConfigError, match="open_verify"):
        config_mod.from_dict({"open_verify": "sometimes"})
