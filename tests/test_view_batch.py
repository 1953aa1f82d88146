"""Many view changes in one request (PARTITION_UPDATE_MANY), as the manager sends a failover's or a hand-off's:
each view is durable before the node answers, a kill -9 in the middle of a stream of batches loses nothing
acknowledged and leaves no partition with a view nobody sent, and a node of an older protocol version still
gets its views one PARTITION_UPDATE at a time (manager/viewpush.py)."""
from __future__ import annotations

import json
import random

import pytest
import trio

from client.sdk import ClientError
from manager.viewpush import ViewPush
from tests.conftest import open_client, run
from tests.test_skew import _start, build
from wire.limits import MAX_VIEWS_PER_UPDATE
from wire.protocol import OP_SINCE, VERSION, Op, Result


async def _create(dc, addr: str, pids) -> None:
    async def one(pid):
        await dc.admin(addr, Op.PARTITION_CREATE, partition=pid, body={"replicas": [addr], "epoch": 1})
    async with trio.open_nursery() as n:
        for pid in pids:
            n.start_soon(one, pid)


def _on_disk(node, pid: int) -> dict:
    return json.loads((node.root / "data" / "partitions" / str(pid) / "meta.json").read_text())


def test_a_batch_installs_what_it_can_and_names_the_rest(nodes):
    """One request, many views: each installed one is on disk when the answer comes; the answer's bitmask
    names the entries not installed (not hosted, not newer), which PARTITION_UPDATE then explains."""
    (a,) = nodes(1)

    async def main():
        async with open_client("tcp") as dc:
            await _create(dc, a.addr, range(1, 11))
            views = [{"partition": pid, "replicas": [a.addr], "epoch": 2} for pid in range(1, 11)]
            for epoch in (2, 3):
                await dc.admin(a.addr, Op.PARTITION_UPDATE, partition=4, body={"replicas": [a.addr], "epoch": epoch})
            views.append({"partition": 99, "replicas": [a.addr], "epoch": 2})    # not hosted here
            resp = await dc.admin(a.addr, Op.PARTITION_UPDATE_MANY, body={"views": views})
            assert resp.arg == (1 << 3) | (1 << 10)
            for pid in range(1, 11):
                assert _on_disk(a, pid)["epoch"] == (3 if pid == 4 else 2)   # (4: not newer)
            # the same batch again: a view held already counts as installed
            again = await dc.admin(a.addr, Op.PARTITION_UPDATE_MANY, body={"views": views})
            assert again.arg == (1 << 3) | (1 << 10)
            # more than the limit, or a partition twice: refused as a whole, nothing changes
            for bad in ([{"partition": p, "replicas": [a.addr], "epoch": 3} for p in range(1, MAX_VIEWS_PER_UPDATE + 2)],
                        [{"partition": 1, "replicas": [a.addr], "epoch": 3}] * 2):
                with pytest.raises(ClientError) as ei:
                    await dc.admin(a.addr, Op.PARTITION_UPDATE_MANY, body={"views": bad})
                assert ei.value.result == Result.BAD_BODY
            assert _on_disk(a, 1)["epoch"] == 2
            # what the manager does with the entries not installed: asks about each alone
            push = ViewPush(dc)
            with pytest.raises(ClientError) as ei:
                await push.update(a.addr, 99, {"replicas": [a.addr], "epoch": 5})
            assert ei.value.result == Result.NOT_FOUND
    run(main)


def test_kill_9_amid_batches_loses_no_acknowledged_view(nodes):
    """Streams of batches raise the epochs of 256 partitions while the node is killed -9 at a random moment.
    After the restart every partition's view is one that was sent -- the last acknowledged one or one sent
    after it -- never older than what was acknowledged, and every meta.json is whole."""
    (a,) = nodes(1, sync="always")
    pids = list(range(1, 257))
    acked = {pid: 1 for pid in pids}
    sent = {pid: 1 for pid in pids}
    rng = random.Random(7)

    async def main():
        async with open_client("tcp", timeout=5) as dc:
            await _create(dc, a.addr, pids)

            async def stream(mine: list[int]) -> None:
                epoch = 1
                while True:
                    epoch += 1
                    for at in range(0, len(mine), MAX_VIEWS_PER_UPDATE):
                        chunk = mine[at:at + MAX_VIEWS_PER_UPDATE]
                        for pid in chunk:
                            sent[pid] = epoch
                        try:
                            resp = await dc.admin(a.addr, Op.PARTITION_UPDATE_MANY, body={"views": [
                                {"partition": pid, "replicas": [a.addr], "epoch": epoch} for pid in chunk]})
                        except ClientError:
                            return                      # the node is gone
                        assert resp.arg == 0
                        for pid in chunk:
                            acked[pid] = epoch
            async with trio.open_nursery() as n:
                n.start_soon(stream, pids[:128])
                n.start_soon(stream, pids[128:])
                await trio.sleep(1.0 + rng.random())
                a.kill()
        assert min(acked.values()) >= 3, "the streams should have run a while before the kill"
    run(main)
    a.start()

    async def check():
        async with open_client("tcp") as dc:
            listed = {p["id"]: p for p in await dc.admin(a.addr, Op.PARTITION_LIST)}
        assert sorted(listed) == pids, "a partition was lost (an unusable meta.json is not loaded)"
        for pid in pids:
            got = listed[pid]["epoch"]
            assert acked[pid] <= got <= sent[pid], (pid, acked[pid], got, sent[pid])
            assert listed[pid]["replicas"] == [a.addr]
    run(check)


def test_a_node_of_the_previous_version_gets_one_update_per_partition(nodes, tmp_path):
    """A node that predates PARTITION_UPDATE_MANY is sent PARTITION_UPDATE per partition; a current one is
    sent batches -- and both end up with every view installed."""
    assert OP_SINCE[Op.PARTITION_UPDATE_MANY] == VERSION
    old_tree = build(tmp_path / "prev", VERSION - 1, VERSION - 1)
    old, new = _start(nodes, [old_tree, None])

    async def main():
        async with open_client("tcp") as dc:
            for node in (old, new):
                await _create(dc, node.addr, range(1, 41))
            push = ViewPush(dc)

            async def one(addr, pid):
                await push.update(addr, pid, {"replicas": [addr], "epoch": 2})
            async with trio.open_nursery() as n:
                for node in (old, new):
                    for pid in range(1, 41):
                        n.start_soon(one, node.addr, pid)
            assert (await dc.links.get(old.addr)).conn.version == VERSION - 1
            for node in (old, new):
                listed = await dc.admin(node.addr, Op.PARTITION_LIST)
                assert {p["id"]: p["epoch"] for p in listed} == {pid: 2 for pid in range(1, 41)}
            # the old node: 40 single updates; the new one: the first alone, the rest batched
            assert push.singles >= 40 and push.batches >= 1
            assert push.singles < 60, push.singles
    run(main)
    assert "PARTITION_UPDATE_MANY" not in old.log_path.read_text()
