"""A follower whose disk fills up: writes fail cleanly (NO_SPACE names the cause), the leader never calls the
follower healthy while their copies differ, and once space is back repair makes every replica identical --
sealed extents and unacknowledged tails included -- without losing an acknowledged byte.

Needs root (a small tmpfs is mounted as the follower's data_dir); skipped otherwise.
"""
from __future__ import annotations

import subprocess

import pytest
import trio

from client.sdk import ClientError
from wire.protocol import Op, Result
from tests.conftest import create_partition, open_client, pattern

PID = 7
MiB = 1 << 20


@pytest.fixture
def small_fs(tmp_path):
    mnt = tmp_path / "smallfs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12m", "tmpfs", str(mnt)], capture_output=True,
                       text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_disk_full_follower_is_lagging_then_repaired(nodes, small_fs):
    a, b = nodes(2)
    [c] = nodes(1, data_dir=str(small_fs / "data"))
    addrs = [a.addr, b.addr, c.addr]

    async def body():
        async with open_client("tcp", addrs) as dc:
            await create_partition(dc, PID, addrs)
            acked = []
            error = None
            for i in range(40):                       # 40 MiB: far more than the follower's 12 MiB
                data = pattern(i, MiB)
                try:
                    acked.append((await dc.write(PID, data), data))
                except ClientError as e:
                    error = e
                    break
            assert error is not None, "the follower's disk never filled up"
            assert "no space" in str(error) or error.result == Result.REPLICATION_FAILED, error
            # while the follower is full: its copies differ, and the leader must say so
            with trio.fail_after(30):
                while True:
                    h = await dc.admin(a.addr, Op.PARTITION_HEALTH, partition=PID)
                    states = {r["addr"]: (r["state"], r["bytes_behind"]) for r in h["followers"]}
                    assert states[c.addr][0] != "healthy" or states[c.addr][1] == 0, h
                    if states[c.addr][0] in ("lagging", "repairing") and states[c.addr][1] > 0:
                        break
                    await trio.sleep(0.3)
            # space comes back: repair makes every replica identical to the leader
            subprocess.run(["mount", "-o", "remount,size=512m", str(small_fs)], check=True)
            await dc.admin(a.addr, Op.REPAIR, partition=PID)
            with trio.fail_after(90):
                while True:
                    marks = [await dc.watermarks(PID, addr) for addr in addrs]
                    h = await dc.admin(a.addr, Op.PARTITION_HEALTH, partition=PID)
                    states = {r["addr"]: r["state"] for r in h["followers"]}
                    if marks[0] == marks[1] == marks[2] and all(s == "healthy" for s in states.values()):
                        break
                    await trio.sleep(0.5)
            # every acknowledged byte is on every replica, and every replica holds the same bytes
            for locs, data in acked:
                for addr in addrs:
                    got = b"".join([await dc.read(PID, loc.extent, loc.offset, loc.length, replica=addr)
                                    for loc in locs])
                    assert got == data, f"acknowledged data differs on {addr}"
            for e, size in marks[0].items():
                copies = {await dc.read(PID, e, 0, size, replica=addr) for addr in addrs}
                assert len(copies) == 1, f"extent {e} differs between replicas"
            # and writes work again
            data = pattern(99, 3 * MiB)
            locs = await dc.write(PID, data)
            assert b"".join([await dc.read_location(loc, replica=c.addr) for loc in locs]) == data

    trio.run(body)
