"""The datanode's request path, without sockets: which appends a run takes in and what each of them is
answered (ops/run.py), the append's drivers -- the WRITE handler's task, the follower's fast path in the
transport's delivery, and a client's lean append by its connection's thread (ops/lean.py) -- giving the
same answers and the same extent (ops/append.py), and the wrapper's admission, which all take
(ops/wrap.py)."""
from __future__ import annotations

import math
import pathlib
import tempfile

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from datanode.audit import AuditLog
from datanode.commit import GroupCommit
from datanode.config import Config
from datanode.metrics import NodeMetrics
from datanode.ops.append import Appends
from datanode.ops.base import Reply, Request, RequestCounters
from datanode.ops.buffers import Buffers
from datanode.ops import lean as lean_mod
from datanode.ops.lean import Lean
from datanode.ops.partitions import Partitions
from datanode.ops.run import AppendRun
from datanode.ops.stages import DURABLE, STARTED, WRITTEN
from datanode.ops.wrap import ConnState, Serving, Wrap
from datanode.partition import ExtentLane, PartitionTable
from datanode.replication import Replicator
from datanode.store import StoreCode, StoreError
from wire.aio import InlinePause
from wire.crc import crc32c
from wire.pool import BuddyPool
from wire.protocol import INLINE_MAX, Flag, Header, Op, Result, Role, decode, encode_message
from wire.transport.base import Access, Domain

from tests.conftest import pattern

PID, LEADER, ME = 7, "127.0.0.1:1", "127.0.0.1:2"
KiB, MiB = 1024, 1 << 20
INLINE = Flag.INLINE


def append(offset: int, data: bytes, *, extent: int = 1, flags: int = INLINE, crc: int | None = None,
           req_id: int = 0) -> Header:
    return Header(opcode=Op.WRITE, partition=PID, epoch=1, extent=extent, offset=offset, length=len(data),
                  crc=crc32c(data) if crc is None else crc, flags=flags, req_id=req_id)


# -- a run of appends ------------------------------------------------------------------------------------------
def test_a_run_takes_the_appends_that_follow_it_and_answers_each_as_if_alone():
    lane = ExtentLane()
    ticket = (lane, lane.ticket())
    datas = [pattern(i, 100 + i) for i in range(5)]
    offs = [sum(len(d) for d in datas[:i]) for i in range(5)]
    run = AppendRun(append(0, datas[0], req_id=1), datas[0], ticket)
    for i in range(1, 5):
        assert run.join(append(offs[i], datas[i], req_id=i + 1), datas[i], float(i))
    h, joined = run.start()
    assert bytes(joined) == b"".join(datas)
    assert (h.offset, h.length, h.crc, h.req_id) == (0, len(joined), crc32c(bytes(joined)), 1)
    ok = run.answers(h.reply(Result.OK, arg=len(joined), crc=h.crc), 0.0)
    assert [(r.req_id, r.result, r.arg, r.crc, t) for _h, t, r in ok] == [
        (i + 1, Result.OK, offs[i] + len(datas[i]), crc32c(datas[i]), float(i)) for i in range(5)]
    refused = run.answers(h.reply(Result.WRONG_OFFSET, arg=77), 0.0)
    assert {(r.result, r.arg) for _h, _t, r in refused} == {(Result.WRONG_OFFSET, 77)}
    assert run.answers(None, 0.0)[2][2] is None           # dropped: nobody is answered


@pytest.mark.parametrize("why", ["gap", "other extent", "other epoch", "other flags", "bad crc", "bad head",
                                 "another ticket", "too many bytes", "started"])
def test_a_request_that_would_not_be_answered_the_same_goes_alone(why):
    lane = ExtentLane()
    ticket = (lane, lane.ticket())
    head = pattern(1, 1000)
    run = AppendRun(append(0, head, crc=0 if why == "bad head" else None), head, ticket)
    data = pattern(2, INLINE_MAX if why == "too many bytes" else 100)
    h = {"gap": append(1001, data), "other extent": append(1000, data, extent=2),
         "other epoch": append(1000, data).but(epoch=2), "other flags": append(1000, data, flags=INLINE | Flag.REPAIR),
         "bad crc": append(1000, data, crc=1)}.get(why, append(1000, data))
    if why == "another ticket":
        lane.ticket()                        # a request of the extent arrived in between: order stays
    if why == "started":
        run.start()
    assert not run.join(h, data, 1.0)
    assert run.more == [] and run.length == 1000


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 9000), st.sampled_from(["next", "gap", "bad crc"])), max_size=50))
def test_a_run_never_grows_past_its_limits_and_stays_one_contiguous_append(arrivals):
    lane = ExtentLane()
    ticket = (lane, lane.ticket())
    run = AppendRun(append(0, b"h"), b"h", ticket)
    for i, (n, kind) in enumerate(arrivals):
        data = pattern(i, n)
        h = append(run.end + (kind == "gap"), data, crc=1 if kind == "bad crc" else None, req_id=i + 2)
        fits = run.length + n <= INLINE_MAX and len(run.more) < AppendRun.MAX - 1
        assert run.join(h, data, 0.0) == (kind == "next" and fits)
    assert run.length <= INLINE_MAX and 1 + len(run.more) <= AppendRun.MAX
    ends = [0 + 1] + [m.offset + m.length for m, _t in run.more]
    assert all(m.offset == end for (m, _t), end in zip(run.more, ends))
    whole = run.start()
    if whole is not None:
        h, joined = whole
        assert h.length == len(joined) == run.length and h.crc == crc32c(bytes(joined))


# -- the append's two drivers ----------------------------------------------------------------------------------
class Conn:
    """What the request path uses of a connection (no socket): answers sent at once are kept."""

    def __init__(self, role=None, identity=""):
        self.role, self.identity, self.peer = role, identity, "127.0.0.1:9"
        self.volume = ""                  # no volume key: unscoped
        self.busy = self.pool_held = 0
        self.alive, self.misbehaved = True, ""
        self.sent: list[Header] = []

    def send_nowait(self, timeout, raw) -> bool:
        self.sent.append(decode(raw, request=False))
        return True

    async def send_within(self, timeout, raw) -> bool:
        return self.send_nowait(timeout, raw)

    def send_many_nowait(self, timeout, raws) -> bool:
        return all([self.send_nowait(timeout, raw) for raw in raws])

    async def send_many_within(self, timeout, raws) -> bool:
        return self.send_many_nowait(timeout, raws)


class Follower:
    """This node as a follower of partition PID (led by LEADER), with a running group commit."""

    def __init__(self, root: str, commit: GroupCommit):
        self.table = PartitionTable(pathlib.Path(root), "always")
        self.part = self.table.create(PID, [LEADER, ME], 1)
        self.eid = self.part.store.create_extent()
        self.counters = RequestCounters()
        self.commit = commit
        self.partitions = Partitions(Config(), ME, self.table, self.counters, None, lambda kick: None)
        pool = BuddyPool(MiB, MiB)
        region = Domain().register(pool.arena, pool.base_addr, Access.LOCAL_WRITE)
        self.appends = Appends(self.partitions, Buffers(Config(), pool, region), Replicator(1.0), commit,
                               self.counters)

    def request(self, h: Header, data: bytes) -> Request:
        lane = self.part.lane(h.extent)
        ticket = (lane, lane.ticket())
        return Request(Conn(Role.NODE, LEADER), h, ticket, memoryview(data), AppendRun(h, data, ticket), 0.0)

    async def drive(self, rq: Request, fast: bool) -> tuple[int, int]:
        """The answer (result, arg), by the fast path when ``fast`` (the task if it declines), as the wrapper
        drives them; the ticket ends after."""
        try:
            resp = self.appends.now(rq) if fast else None
            if resp is None:
                resp = await self.appends.write(rq)
            return resp.result, resp.arg
        except Reply as r:
            return r.result, r.arg
        finally:
            rq.ticket[0].done(rq.ticket[1])

    def extent(self) -> tuple[bytes, int]:
        n = self.part.store.size(self.eid)
        out = bytearray(n)
        self.part.store.read_into(self.eid, 0, n, memoryview(out))
        return bytes(out), self.part.store.durable_size(self.eid)


async def followers(n: int, roots: list[str], nursery) -> list[Follower]:
    commit = GroupCommit(quiet=lambda: True)
    commit.inline = InlinePause(slow=math.inf)        # a loaded test box's slow flush must not send it away
    await nursery.start(commit.run)
    return [Follower(root, commit) for root in roots[:n]]


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(1, 6000), st.sampled_from(["ok", "ok", "bad crc", "wrong offset"])),
                min_size=1, max_size=8))
def test_the_fast_path_and_the_handler_answer_alike_and_leave_the_same_extent(steps):
    """One follower takes every append by the fast path (in the transport's delivery), the other by the
    WRITE handler's task: the same answers, the same bytes, durable."""
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        async def main():
            async with trio.open_nursery() as n:
                fast, task = await followers(2, [a, b], n)
                end = 0
                for i, (size, kind) in enumerate(steps):
                    data = pattern(i, size)
                    h = append(end + (kind == "wrong offset"), data, extent=fast.eid, flags=INLINE | Flag.FORWARDED,
                               crc=crc32c(data) ^ 1 if kind == "bad crc" else None)
                    got = [await f.drive(f.request(h, data), f is fast) for f in (fast, task)]
                    want = ((Result.OK, end + size) if kind == "ok" else (Result.CRC_MISMATCH, 0)
                            if kind == "bad crc" else (Result.WRONG_OFFSET, end))
                    assert got == [want, want]
                    end += size if kind == "ok" else 0
                assert fast.extent() == task.extent() and fast.extent()[1] == end
                oks = sum(kind == "ok" for _s, kind in steps)
                assert fast.counters.appends_now == oks and task.counters.appends_now == 0
                assert fast.counters.replica_writes == task.counters.replica_writes == oks
                n.cancel_scope.cancel()
        trio.run(main)


@pytest.mark.parametrize("fast", [True, False], ids=["fast path", "handler"])
@pytest.mark.parametrize("stage", ["write", "flush"])
def test_a_failed_local_append_seals_the_extent_on_either_path(tmp_path, monkeypatch, fast, stage):
    async def main():
        async with trio.open_nursery() as n:
            (f,) = await followers(1, [str(tmp_path)], n)
            store = f.part.store
            if stage == "write":
                def boom(*a, **kw):
                    raise StoreError(StoreCode.DISK, "disk gone")
                monkeypatch.setattr(store, "append", boom)
            else:
                monkeypatch.setattr(store, "flush", lambda ids: {i: StoreError(StoreCode.DISK, "disk gone") for i in ids})
            data = pattern(1, 4 * KiB)
            h = append(0, data, extent=f.eid, flags=INLINE | Flag.FORWARDED)
            assert await f.drive(f.request(h, data), fast) == (Result.DISK_ERROR, 0)
            assert f.part.sealed[str(f.eid)].startswith(f"local {stage} failed: ")
            monkeypatch.undo()
            again = append(4 * KiB if stage == "flush" else 0, data, extent=f.eid, flags=INLINE | Flag.FORWARDED)
            assert (await f.drive(f.request(again, data), fast))[0] == Result.DIVERGED
            n.cancel_scope.cancel()
    trio.run(main)


def test_the_fast_path_leaves_what_it_cannot_do_now_untouched(tmp_path):
    """Not its turn yet (an earlier append of the extent is out), or a request to refuse: nothing done, no
    step noted -- the handler's task does it (or refuses it, with its reasons)."""
    async def main():
        async with trio.open_nursery() as n:
            (f,) = await followers(1, [str(tmp_path)], n)
            data = pattern(1, 4 * KiB)
            h = append(0, data, extent=f.eid, flags=INLINE | Flag.FORWARDED)
            first, second = f.request(h, data), f.request(h, data)
            assert f.appends.now(second) is None                      # the first one's turn comes first
            wrong = f.request(h.but(offset=5), data)
            assert f.appends.now(first) is not None
            at = first.stages.at
            assert 0 < at[STARTED] <= at[WRITTEN] <= at[DURABLE]
            first.ticket[0].done(first.ticket[1])
            second.ticket[0].done(second.ticket[1])
            assert f.appends.now(wrong) is None and wrong.stages.at == [0.0] * 9
            assert f.extent() == (data, 4 * KiB)
            n.cancel_scope.cancel()
    trio.run(main)


# -- the wrapper -------------------------------------------------------------------------------------------------
def wrapper(table: PartitionTable, serving: Serving, appends: Appends | None = None, tmp=".") -> Wrap:
    async def handler(rq):
        return rq.h.reply(Result.OK)
    return Wrap(cfg=Config(), serving=serving, table=table, counters=RequestCounters(), metrics=NodeMetrics(None),
                audit=AuditLog(f"{tmp}/audit.log", ME), handlers={op: handler for op in Op},
                now=appends.now if appends else (lambda rq: None))


@pytest.mark.parametrize("state, op, result", [
    (Serving(draining=True), Op.WRITE, Result.RETRY), (Serving(draining=True), Op.PING, None),
    (Serving(), Op.READ, Result.RETRY), (Serving(), Op.NODE_STATUS, None),
    (Serving("serving", data_dir_lost="gone"), Op.WRITE, Result.DISK_ERROR),
    (Serving("serving", data_dir_lost="gone"), Op.READ, None)])
def test_admission_by_the_nodes_state(tmp_path, state, op, result):
    w = wrapper(PartitionTable(tmp_path, "always"), state)
    try:
        w.admit(Conn(), Header(opcode=op, partition=PID))
        assert result is None
    except Reply as r:
        assert r.result == result


def test_a_lone_forward_from_a_node_that_does_not_lead_is_refused_once_where_it_arrives(tmp_path):
    """The fast path takes the same admission as the task: FORBIDDEN, counted once, answered at once; the
    leader's forward right after is done there too."""
    async def main():
        async with trio.open_nursery() as n:
            (f,) = await followers(1, [str(tmp_path)], n)
            w = wrapper(f.table, Serving("serving"), f.appends, str(tmp_path))
            data = pattern(3, 4 * KiB)
            raw = encode_message(append(0, data, extent=f.eid, flags=INLINE | Flag.FORWARDED, req_id=5), data)
            stranger, leader = Conn(Role.NODE, "127.0.0.1:3"), Conn(Role.NODE, LEADER)
            w._dispatch(n, stranger, ConnState(), raw, 0.0)
            assert [(r.req_id, r.result) for r in stranger.sent] == [(5, Result.FORBIDDEN)]
            assert w.counters.forbidden == 1 and w.inflight == 0 and stranger.busy == 0
            w._dispatch(n, leader, ConnState(), raw, 0.0)
            assert [(r.req_id, r.result, r.arg) for r in leader.sent] == [(5, Result.OK, 4 * KiB)]
            assert f.counters.appends_now == 1 and w.inflight == 0
            at = w.metrics.write_stages.follower
            assert at[0] == 1 and all(x >= 0 for x in at[1:5])
            n.cancel_scope.cancel()
    trio.run(main)


def test_with_tracing_on_each_step_of_an_append_is_noted_under_its_name(tmp_path, monkeypatch):
    """``DATANODE_TRACE`` (wire/trace.py): a follower's append done where it arrived notes the steps
    bench/write_timeline.py reads -- arrived, started, written, durable, replied -- in the order reached."""
    from wire import trace
    steps: list = []
    monkeypatch.setattr(trace, "ON", True)
    monkeypatch.setattr(trace, "_steps", steps)

    async def main():
        async with trio.open_nursery() as n:
            (f,) = await followers(1, [str(tmp_path)], n)
            w = wrapper(f.table, Serving("serving"), f.appends, str(tmp_path))
            data = pattern(4, 4 * KiB)
            w._dispatch(n, Conn(Role.NODE, LEADER), ConnState(), encode_message(
                append(0, data, extent=f.eid, flags=INLINE | Flag.FORWARDED, req_id=6), data), 0.0)
            n.cancel_scope.cancel()
    trio.run(main)
    named = sorted(steps, key=lambda s: s[3])
    assert [s[0] for s in named] == ["arrived.F", "started.F", "written.F", "durable.F", "replied.F"]
    assert len({(s[1], s[2]) for s in steps}) == 1 and steps[0][2] == 0       # one append's, at offset 0


# -- the lean append (ops/lean.py): the common case, by the connection's data-plane thread -----------------------
class Alone:
    """This node as the only replica of partition PID, behind a wrapper with the WRITE handler -- and with the
    lean path when ``lean`` -- as the node composes them (datanode/server.py)."""

    def __init__(self, root: str, commit: GroupCommit, lean: bool, replicas=(ME,)):
        self.table = PartitionTable(pathlib.Path(root), "always")
        self.part = self.table.create(PID, list(replicas), 1)
        self.eid = self.part.store.create_extent()
        self.counters = RequestCounters()
        partitions = Partitions(Config(), ME, self.table, self.counters, None, lambda kick: None)
        pool = BuddyPool(MiB, MiB)
        region = Domain().register(pool.arena, pool.base_addr, Access.LOCAL_WRITE)
        replication = Replicator(1.0)
        appends = Appends(partitions, Buffers(Config(), pool, region), replication, commit, self.counters)

        async def other(rq):
            return rq.h.reply(Result.OK)
        self.lean = Lean(ME, self.table, replication, self.counters, True, commit.here) if lean else None
        self.states: dict[int, ConnState] = {}
        self.wrap = Wrap(cfg=Config(), serving=Serving("serving"), table=self.table, counters=self.counters,
                         metrics=NodeMetrics(None), audit=AuditLog(f"{root}/audit.log", ME),
                         handlers={**{op: other for op in Op}, Op.WRITE: appends.write}, now=appends.now,
                         lean=self.lean)

    async def send(self, nursery, conn, h: Header, data: bytes) -> None:
        cs = self.states.setdefault(id(conn), ConnState())     # the connection's state: its run, as served
        self.wrap._dispatch(nursery, conn, cs, encode_message(h, data), trio.current_time())

    async def answers(self, conn, n: int) -> list[tuple[int, int, int]]:
        """The first ``n`` answers on ``conn`` (req_id, result, arg), in the order sent, once all are in."""
        with trio.fail_after(10):
            while len(conn.sent) < n or self.wrap.inflight:
                await trio.sleep(0.002)
        return [(r.req_id, r.result, r.arg) for r in conn.sent]

    def extent(self) -> tuple[bytes, int]:
        n = self.part.store.size(self.eid)
        out = bytearray(n)
        self.part.store.read_into(self.eid, 0, n, memoryview(out))
        return bytes(out), self.part.store.durable_size(self.eid)


def client_conn() -> Conn:
    c = Conn(Role.CLIENT)
    c.transport = "tcp"
    return c


async def alone(roots: list[str], nursery, replicas=(ME,)) -> list[Alone]:
    commit = GroupCommit(quiet=lambda: False)
    await nursery.start(commit.run)
    return [Alone(root, commit, lean, replicas) for root, lean in zip(roots, (True, False))]


def test_a_followers_forwards_by_the_lean_path_and_by_the_handler_leave_the_same_extent(tmp_path):
    """A leader's pipelined inline forwards: the same answers and the same durable extent on a follower taking
    them by the lean path as on one taking them by the WRITE handler's task; a forward from a node that does
    not lead is refused by the same admission."""
    async def main():
        async with trio.open_nursery() as n:
            nodes = await alone([str(tmp_path / "a"), str(tmp_path / "b")], n, replicas=(LEADER, ME))
            conns = [Conn(Role.NODE, LEADER), Conn(Role.NODE, LEADER)]
            for c in conns:
                c.transport = "tcp"
            end = 0
            for i in range(30):
                data = pattern(i, 100 + 37 * i)
                for node, conn in zip(nodes, conns):
                    await node.send(n, conn, append(end, data, extent=nodes[0].eid, flags=INLINE | Flag.FORWARDED,
                                                    req_id=i + 1), data)
                end += len(data)
            got = [sorted(await node.answers(conn, 30)) for node, conn in zip(nodes, conns)]
            assert got[0] == got[1] and {r for _i, r, _a in got[0]} == {Result.OK}
            assert nodes[0].extent() == nodes[1].extent() and nodes[0].extent()[1] == end
            assert nodes[0].counters.lean_writes == nodes[0].counters.replica_writes == 30
            assert nodes[1].counters.lean_writes == 0 and nodes[1].counters.replica_writes == 30
            stranger = Conn(Role.NODE, "127.0.0.1:3")
            stranger.transport = "tcp"
            data = pattern(99, 10)
            await nodes[0].send(n, stranger, append(end, data, extent=nodes[0].eid, flags=INLINE | Flag.FORWARDED,
                                                    req_id=99), data)
            assert await nodes[0].answers(stranger, 1) == [(99, Result.FORBIDDEN, 0)]
            n.cancel_scope.cancel()
    trio.run(main)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(1, 6000), st.sampled_from(["ok", "ok", "ok", "bad crc", "wrong offset"])),
                min_size=1, max_size=12), st.booleans())
def test_the_lean_path_and_the_handler_answer_alike_and_leave_the_same_extent(steps, pipelined):
    """One node takes a client's appends by the lean path, the other by the WRITE handler's task, one at a
    time or all sent at once (pipelined): the same answers, the same bytes, durable."""
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        async def main():
            async with trio.open_nursery() as n:
                nodes = await alone([a, b], n)
                conns = [client_conn(), client_conn()]
                end, want = 0, []
                for i, (size, kind) in enumerate(steps):
                    data = pattern(i, size)
                    h = append(end + (kind == "wrong offset"), data, extent=nodes[0].eid, req_id=i + 1,
                               crc=crc32c(data) ^ 1 if kind == "bad crc" else None)
                    for node, conn in zip(nodes, conns):
                        await node.send(n, conn, h, data)
                        if not pipelined:
                            await node.answers(conn, i + 1)
                    want.append((i + 1, *((Result.OK, end + size) if kind == "ok" else (Result.CRC_MISMATCH, 0)
                                          if kind == "bad crc" else (Result.WRONG_OFFSET, end))))
                    end += size if kind == "ok" else 0
                got = [sorted(await node.answers(conn, len(steps))) for node, conn in zip(nodes, conns)]
                assert got[0] == got[1] == want
                assert nodes[0].extent() == nodes[1].extent()
                assert nodes[0].extent()[1] == len(nodes[0].extent()[0])        # all of it durable
                oks = sum(r == Result.OK for _i, r, _a in got[0])
                assert nodes[0].counters.lean_writes == nodes[0].counters.writes == oks
                assert nodes[1].counters.lean_writes == 0 and nodes[1].counters.writes == oks
                assert nodes[0].wrap.metrics.write_stages.leader[0] == oks
                n.cancel_scope.cancel()
        trio.run(main)


def test_a_lean_lease_keeps_arrival_order_with_other_connections_and_paths(tmp_path):
    """A connection's lean appends hold the extent's turn; another connection's append arriving meanwhile
    waits behind them (the handler's task), and the first connection's next append, arriving after it, goes
    after it: every append lands in arrival order."""
    async def main():
        async with trio.open_nursery() as n:
            (node,) = await alone([str(tmp_path)], n)
            first, second = client_conn(), client_conn()
            datas, end = [], 0
            for i, conn in enumerate([first] * 20 + [second] + [first] * 3):
                data = pattern(i, 3000 + i)
                await node.send(n, conn, append(end, data, extent=node.eid, req_id=i + 1), data)
                datas.append(data)
                end += len(data)
            got = await node.answers(first, 23) + await node.answers(second, 1)
            assert sorted(got) == [(i + 1, Result.OK, sum(map(len, datas[:i + 1]))) for i in range(24)]
            assert node.extent() == (b"".join(datas), end)
            assert node.counters.lean_writes == 20 and node.counters.writes == 24
            assert not node.lean.leases and node.part.lanes[node.eid].issued == node.part.lanes[node.eid].serving
            n.cancel_scope.cancel()
    trio.run(main)


@pytest.mark.parametrize("stage", ["write", "flush"])
def test_a_failed_lean_append_seals_the_extent_as_the_handler_would(tmp_path, monkeypatch, stage):
    async def main():
        async with trio.open_nursery() as n:
            (node,) = await alone([str(tmp_path)], n)
            store, conn = node.part.store, client_conn()
            if stage == "write":
                def boom(*a, **kw):
                    raise StoreError(StoreCode.DISK, "disk gone")
                monkeypatch.setattr(store, "append", boom)
            else:
                monkeypatch.setattr(store, "flush", lambda ids: {i: StoreError(StoreCode.DISK, "disk gone") for i in ids})
            data = pattern(1, 4 * KiB)
            await node.send(n, conn, append(0, data, extent=node.eid, req_id=1), data)
            assert await node.answers(conn, 1) == [(1, Result.DISK_ERROR, 0)]
            assert node.part.sealed[str(node.eid)].startswith(f"local {stage} failed: ")
            monkeypatch.undo()
            await node.send(n, conn, append(4 * KiB if stage == "flush" else 0, data, extent=node.eid, req_id=2), data)
            assert (await node.answers(conn, 2))[1][:2] == (2, Result.DIVERGED)
            assert node.counters.lean_writes == 0
            n.cancel_scope.cancel()
    trio.run(main)


def test_what_the_lean_path_does_not_take_goes_the_usual_way(tmp_path, monkeypatch):
    """A replicated partition, another epoch, a flag besides INLINE, a connection past the planes' limit, a
    refused admission: not lean (the handler answers it, with its reasons)."""
    async def main():
        async with trio.open_nursery() as n:
            (node,) = await alone([str(tmp_path)], n)
            conn, data = client_conn(), pattern(1, 100)
            h = append(0, data, extent=node.eid)
            assert node.lean.take(conn, h.but(epoch=2), data, 0.0, n) is None
            assert node.lean.take(conn, h.but(flags=INLINE | Flag.REPAIR), data, 0.0, n) is None
            node.part.replicas = [ME, LEADER]
            assert node.lean.take(conn, h, data, 0.0, n) is None
            node.part.replicas = [ME]
            monkeypatch.setattr(lean_mod, "MAX_PLANES", 1)     # one connection has a thread: a second has none
            await node.send(n, conn, h, data)
            assert await node.answers(conn, 1) == [(0, Result.OK, 100)]
            assert node.lean.take(client_conn(), h.but(offset=100), data, 0.0, n) is None
            assert list(node.lean.planes) == [conn] and node.counters.lean_writes == 1
            node.wrap.admit.serving.draining = True
            with pytest.raises(Reply):
                node.lean.take(conn, h.but(offset=100), data, 0.0, n)
            assert not node.lean.leases
            n.cancel_scope.cancel()
    trio.run(main)
