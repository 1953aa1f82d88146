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
from manager.fillwatch import FillWatch
from manager.viewpush import ViewPush
from tests.conftest import open_client, run
from tests.test_etcd import etcd  # noqa: F401 - a single-member etcd of the test's own
from tools.etcd_cluster import etcd_binary
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
            for bad in ([{"partition": p, "replicas": [a.addr], "epoch": 3}
                         for p in range(1, MAX_VIEWS_PER_UPDATE + 2)],
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
    assert OP_SINCE[Op.PARTITION_UPDATE_MANY] <= VERSION
    before = OP_SINCE[Op.PARTITION_UPDATE_MANY] - 1
    old_tree = build(tmp_path / "prev", before, before)
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
            assert (await dc.links.get(old.addr)).conn.version == before
            for node in (old, new):
                listed = await dc.admin(node.addr, Op.PARTITION_LIST)
                assert {p["id"]: p["epoch"] for p in listed} == {pid: 2 for pid in range(1, 41)}
            # the old node: 40 single updates; the new one: the first alone, the rest batched
            assert push.singles >= 40 and push.batches >= 1
            assert push.singles < 60, push.singles
    run(main)
    assert "PARTITION_UPDATE_MANY" not in old.log_path.read_text()


# ------------------------------------------------------------------ the manager's combiner (pure: no sockets)
def test_a_batch_of_new_leaders_is_checked_in_a_few_requests(nodes):
    """A failover's views on a surviving follower: 119 partitions whose new leader is another node.  Each view
    is installed only once that leader said its copy is synced (datanode/viewguard.py) -- asked in one
    REPLICA_STATES per window of ids, not one REPLICA_STATE per partition: the leader serves a handful of
    requests for 119 checks.  A partition the new leader does not hold is refused, as it is alone."""
    a, b, c = nodes(3)
    pids = list(range(1, 120))

    async def requests(dc, addr):
        return (await dc.admin(addr, Op.NODE_STATUS))["counters"]["requests"]

    async def main():
        async with open_client("tcp", timeout=10) as dc:
            body = {"replicas": [a.addr, b.addr, c.addr], "epoch": 1}

            async def make(addr, pid, body):
                await dc.admin(addr, Op.PARTITION_CREATE, partition=pid, body=body)
            async with trio.open_nursery() as n:
                for pid in pids:
                    for node in (a, b, c):
                        n.start_soon(make, node.addr, pid, body)
                # one more, which the new leader b does not hold
                for node in (a, c):
                    n.start_soon(make, node.addr, 120, {"replicas": [a.addr, c.addr], "epoch": 1})
            with trio.fail_after(30):   # the leader's first probe of each follower, done: b serves little
                before = await requests(dc, b.addr)
                while True:
                    await trio.sleep(1.0)
                    before, prev = await requests(dc, b.addr), before
                    if before - prev <= 5:
                        break
            views = [{"partition": pid, "replicas": [b.addr, c.addr], "epoch": 2} for pid in pids + [120]]
            answers = {}

            async def send(at):         # two batches at once, as the manager and the node's agent send them
                resp = await dc.admin(c.addr, Op.PARTITION_UPDATE_MANY, body={"views": views[at:at + 60]})
                answers[at] = resp.arg
            async with trio.open_nursery() as n:
                for at in (0, 60):
                    n.start_soon(send, at)
            asked = await requests(dc, b.addr) - before - 1
            assert answers == {0: 0, 60: 1 << 59}, answers      # every one but 120 (b does not hold it)
            listed = {p["id"]: p for p in await dc.admin(c.addr, Op.PARTITION_LIST)}
            assert all(listed[pid]["epoch"] == 2 and listed[pid]["replicas"] == [b.addr, c.addr] for pid in pids)
            assert listed[120]["epoch"] == 1
            st = (await dc.admin(c.addr, Op.NODE_STATUS))["counters"]
            print(f"requests served by the new leader for 119 view checks: {asked} (the asker sent "
                  f"{st['state_batches']} REPLICA_STATES, {st['state_singles']} REPLICA_STATE)")
            # a few per window of 64 ids when the checks arrive together, more when a busy machine spreads them;
            # and the heartbeats' probes meanwhile (one REPLICA_STATE each: 121)
            assert asked <= 60, asked
            assert st["state_singles"] == 0
    run(main)


def test_the_fill_of_many_partitions_is_asked_once_per_leader(nodes):
    """The manager following 80 partitions' new replicas being filled asks their leader one summary
    (PARTITION_HEALTH of partition 0) per round, not one request per partition; each partition's state in it
    is the one its own PARTITION_HEALTH reports, and a partition the node does not lead has none."""
    a, b = nodes(2)
    pids = list(range(1, 81))

    async def main():
        async with open_client("tcp", timeout=10) as dc:
            body = {"replicas": [a.addr, b.addr], "epoch": 1}

            async def make(addr, pid):
                await dc.admin(addr, Op.PARTITION_CREATE, partition=pid, body=body)
            async with trio.open_nursery() as n:
                for pid in pids:
                    for node in (b, a):
                        n.start_soon(make, node.addr, pid)
            fill = FillWatch(dc)
            got = {}

            async def one(pid):
                got[pid] = await fill.state(a.addr, pid)
            with trio.fail_after(30):
                while True:                 # until the leader's first probe of b found every copy healthy
                    async with trio.open_nursery() as n:
                        for pid in pids:
                            n.start_soon(one, pid)
                    if all(got[pid] == (1, {b.addr: "healthy"}, False) for pid in pids):
                        break
                    await trio.sleep(0.5)
            rounds = fill.summaries
            async with trio.open_nursery() as n:
                for pid in pids:
                    n.start_soon(one, pid)
            assert 1 <= fill.summaries - rounds <= 3, fill.summaries - rounds
            for pid in (1, 40, 80):
                h = await dc.admin(a.addr, Op.PARTITION_HEALTH, partition=pid)
                assert got[pid] == (h["epoch"], {f["addr"]: f["state"] for f in h["followers"]},
                                    h["repair"]["running"])
            assert await fill.state(b.addr, 1) is None          # b follows it
            assert await fill.state(a.addr, 999) is None        # nobody has it
    run(main)


def test_the_combiner_sends_what_waits_together_and_answers_each_caller():
    """The first item goes at once; what arrives while it is under way goes in the next request (at most
    max_batch); each caller gets its own result or exception; a cancelled sender strands nobody."""
    from manager.combine import Combiner
    sent: list[list] = []
    gate = trio.Event()

    async def send_many(dest, values):
        sent.append(list(values))
        await gate.wait()
        return [ValueError(v) if v % 7 == 0 else v * 10 for v in values]

    async def main():
        c = Combiner(send_many, max_batch=4, senders=1, cut_short=lambda d: RuntimeError(f"cut short {d}"))
        got: dict[int, object] = {}

        async def ask(v):
            try:
                got[v] = await c.submit("a", v)
            except ValueError as e:
                got[v] = e
        async with trio.open_nursery() as n:
            for v in range(1, 11):
                n.start_soon(ask, v)
            await trio.sleep(0.01)
            gate.set()
        assert [len(b) for b in sent] == [1, 4, 4, 1], sent
        assert sorted(v for b in sent for v in b) == list(range(1, 11))
        assert all(got[v] == v * 10 for v in range(1, 11) if v % 7), got
        assert isinstance(got[7], ValueError)
        # a sender cancelled mid-request: its batch's other callers get cut_short, later ones still go
        gate2 = trio.Event()
        sent.clear()

        async def slow(dest, values):
            sent.append(list(values))
            await gate2.wait()
            return list(values)
        c2 = Combiner(slow, max_batch=4, senders=1, cut_short=lambda d: RuntimeError("cut short"))
        out: dict[int, object] = {}

        async def ask2(v):
            try:
                out[v] = await c2.submit("a", v)
            except RuntimeError as e:
                out[v] = str(e)
        async with trio.open_nursery() as n:
            cancel = trio.CancelScope()

            async def first_caller():
                with cancel:
                    await c2.submit("a", 1)
            n.start_soon(first_caller)
            await trio.sleep(0.01)                       # 1 is under way alone
            for v in (2, 3):
                n.start_soon(ask2, v)
            await trio.sleep(0.01)
            cancel.cancel()                              # the sender of [1] goes; 2 and 3 are sent by one of them
            await trio.sleep(0.01)
            gate2.set()
        assert sent[0] == [1] and sorted(sent[1]) == [2, 3] and len(sent) == 2, sent
        assert out == {2: 2, 3: 3}, out
    run(main)


def _no_etcd() -> str:
    try:
        etcd_binary()
    except FileNotFoundError as e:
        return str(e)
    return ""


@pytest.mark.skipif(bool(_no_etcd()), reason=_no_etcd() or "-")
def test_etcd_cas_parts_writes_all_or_none(etcd):  # noqa: F811 - the fixture
    """Many views in one transaction: written only if every key is at its expected revision and the holder
    holds; one moved key refuses the whole batch and writes nothing."""
    from wire.etcdmap import Etcd, PartView
    e = etcd()

    async def main():
        et = Etcd(e.url, "/t")
        await et.put(et.key("manager"), "me")
        views = [PartView(pid, ["127.0.0.1:1"], 1, want=1, synced=["127.0.0.1:1"]) for pid in (1, 2, 3)]
        assert await et.cas_parts([(v, 0) for v in views], holder=(et.key("manager"), "me"))
        parts = await et.parts()
        assert sorted(parts) == [1, 2, 3] and {p.rev for p in parts.values()} == {views[0].rev}
        newer = [PartView(pid, ["127.0.0.1:1"], 2, want=1, synced=["127.0.0.1:1"]) for pid in (1, 2, 3)]
        stale = [(newer[0], parts[1].rev), (newer[1], parts[2].rev - 1), (newer[2], parts[3].rev)]
        assert not await et.cas_parts(stale, holder=(et.key("manager"), "me"))
        assert not await et.cas_parts([(v, parts[v.id].rev) for v in newer], holder=(et.key("manager"), "other"))
        assert {p.epoch for p in (await et.parts()).values()} == {1}
        assert await et.cas_parts([(v, parts[v.id].rev) for v in newer], holder=(et.key("manager"), "me"))
        assert {p.epoch for p in (await et.parts()).values()} == {2}
    run(main)
