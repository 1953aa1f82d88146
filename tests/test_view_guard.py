"""Never the last copy: no map change, and no peer that is not the partition's leader, makes the replicas of a
partition lose acknowledged bytes.  Real nodes; the attacks are played by raw peers (lab/fuzz.py).

* forwarded TRUNCATE + PARTITION_UPDATE {replicas: [that follower], epoch + 1} -- from a peer that pretends
  to be the leader (a node without a secret), from an unauthenticated peer on another address, from a client
  key: 0 acknowledged bytes lost, every piece read back from every replica;
* a PARTITION_UPDATE whose leader cannot hold every acknowledged byte (a copy that was cut back, a node that
  does not answer, a new empty replica): refused (LAST_COPY) by every node, counted, data intact;
* the rule itself (datanode/viewguard.py), pure.
"""
from __future__ import annotations

import json

import pytest
import trio

from client import admin
from client.sdk import ClientError
from datanode import viewguard
from lab import fuzz
from tests.conftest import create_partition, open_client, pattern, run
from tests.test_trust import secret  # noqa: F401 - the fixture (a cluster secret file, mode 0600)
from wire.auth import Credentials, DialAuth
from wire.protocol import Flag, Header, Op, Result, Role

KiB = 1 << 10
PID = 5
PIECES = 4
FAST = {"heartbeat_s": 0.3, "repair_interval_s": 600.0}
OTHER_HOST = "192.0.2.2"       # this machine's address that is not loopback (tests that need it skip without)


def _other_host() -> str | None:
    import socket
    try:
        s = socket.socket()
        s.bind((OTHER_HOST, 0))
        s.close()
        return OTHER_HOST
    except OSError:
        return None


async def _write(dc, replicas: list[str]) -> tuple[list, list[bytes]]:
    await create_partition(dc, PID, replicas)
    locs, datas = [], []
    for i in range(PIECES):
        data = pattern(100 + i, (150 + 40 * i) * KiB)
        locs.append(await dc.write(PID, data))
        datas.append(data)
    return locs, datas


async def _read_everywhere(dc, replicas: list[str], locs, datas) -> dict[str, int]:
    """Acknowledged bytes read back, per replica (pieces that read back whole and equal)."""
    got = {}
    for r in replicas:
        n = 0
        for pl, data in zip(locs, datas):
            try:
                back = b"".join([await dc.read_location(loc, replica=r) for loc in pl])
            except ClientError:
                continue
            n += back == data
        got[r] = n
    return got


def _request(addr: str, h: Header, body: bytes = b"", auth: DialAuth | None = None, connect_to: str = "") -> Header:
    """One raw request (lab/fuzz.py), its body served from our side; ``connect_to``: dial this host instead."""
    host = connect_to or addr.rpartition(":")[0]
    return fuzz.request(f"{host}:{addr.rpartition(':')[2]}", h, body, auth=auth)


def _attack(replicas: list[str], extents: list[int], *, auth=None, connect_to: str = "") -> list[str]:
    """The pair: a forwarded TRUNCATE of every extent to 0 on the first follower, then PARTITION_UPDATE
    {replicas: [that follower], epoch 2} to every node; what each step got (a result name or the refusal)."""
    follower = replicas[1]
    out = []

    def one(addr, h, body=b""):
        try:
            r = _request(addr, h, body, auth=auth, connect_to=connect_to)
            out.append(Result(r.result).name)
        except (OSError, ConnectionError, fuzz.Refused) as e:
            out.append(f"refused: {e}")
    for e in extents:
        one(follower, Header(opcode=Op.TRUNCATE, partition=PID, extent=e, offset=0, epoch=1, req_id=1,
                             flags=Flag.FORWARDED | Flag.REPAIR))
    body = json.dumps({"replicas": [follower], "epoch": 2}).encode()
    for addr in replicas:
        one(addr, Header(opcode=Op.PARTITION_UPDATE, partition=PID, epoch=1, length=len(body), addr=0x10000,
                         rkey=7, rlen=len(body), req_id=2), body)
    return out


def _everywhere(nodes, n: int) -> list:
    """``n`` nodes without a secret listening on every address, named (and dialled by each other) 0.0.0.0."""
    from tests.conftest import NODE_DEFAULTS
    from tools.cluster import NodeProc, free_port
    out = []
    for _ in range(n):
        for attempt in range(3):              # (a free port can be taken before the node binds it)
            p = NodeProc(nodes.root / f"any{len(nodes.procs)}", f"0.0.0.0:{free_port()}", **{**NODE_DEFAULTS, **FAST})
            nodes.procs.append(p)
            try:
                out.append(p.start())
                break
            except RuntimeError:
                if attempt == 2:
                    raise
    return out


async def _follower(dc, addr: str) -> dict:
    [p] = [p for p in await admin.partition_list(dc, addr) if p["id"] == PID]
    return p


async def _settled(dc, leader: str, pid: int = PID, timeout: float = 30.0) -> dict:
    return await admin.wait_settled(dc, leader, pid, timeout=timeout)


def test_the_pair_from_a_peer_pretending_to_be_the_leader_loses_nothing(nodes):
    """Nodes without a secret (loopback): a local peer names the leader as itself in its hello, so its
    forwarded TRUNCATE cuts the follower -- which from then on knows its copy may lack acknowledged bytes.
    The PARTITION_UPDATE making that copy the only one is refused by every node (LAST_COPY); the leader's
    repair refills the follower; every piece reads back from every replica."""
    ns = nodes(3, **FAST)
    replicas = [n.addr for n in ns]

    async def body():
        async with open_client("tcp", []) as dc:
            locs, datas = await _write(dc, replicas)
            extents = sorted({loc.extent for pl in locs for loc in pl})
            await _settled(dc, replicas[0])
            # a local peer that does not name the leader: its forwarded TRUNCATE and WRITE are refused
            nobody = await trio.to_thread.run_sync(lambda: [Result(_request(replicas[1], h).result).name for h in (
                Header(opcode=Op.TRUNCATE, partition=PID, extent=extents[0], epoch=1, req_id=1,
                       flags=Flag.FORWARDED | Flag.REPAIR),
                Header(opcode=Op.WRITE, partition=PID, extent=extents[0], offset=0, length=4, epoch=1, req_id=2,
                       addr=0x10000, rkey=7, rlen=4, flags=Flag.FORWARDED))])
            assert nobody == ["FORBIDDEN", "FORBIDDEN"]
            got = await trio.to_thread.run_sync(lambda: _attack(
                replicas, extents, auth=DialAuth(None, Role.NODE, identity=replicas[0])))
            assert got[:len(extents)] == ["OK"] * len(extents)          # the cut went through (auth off)
            assert got[len(extents):] == ["LAST_COPY"] * 3, got
            with trio.fail_after(30):          # the leader refills the follower and confirms it again
                while not (await _follower(dc, replicas[1]))["synced"]:
                    await trio.sleep(0.1)
            await _settled(dc, replicas[0])
            assert await _read_everywhere(dc, replicas, locs, datas) == dict.fromkeys(replicas, PIECES)
            for n in ns:
                st = await admin.node_status(dc, n.addr)
                assert PID in st["partitions"]
            refused = [(await admin.node_status(dc, a))["counters"]["views_refused"] for a in replicas]
            assert all(refused), refused
            assert (await _follower(dc, replicas[1]))["epoch"] == 1
    run(body)


@pytest.mark.parametrize("who", ["unauthenticated, another address", "client key"])
def test_the_pair_from_an_outsider_is_refused(nodes, secret, who):
    """The same pair, from a peer holding no key on another address (nodes without a secret: they take only
    loopback peers, so listening on every address exposes nothing) and from a client-role key (nodes with
    the secret: the role table refuses both requests): nothing happens, every piece reads back everywhere."""
    if who == "client key":
        ns = nodes(3, secret_file=str(secret), **FAST)
        replicas, connect_to, kw = [n.addr for n in ns], "", {"secret": str(secret)}
        auth = DialAuth(Credentials.load(secret), Role.CLIENT)
    else:
        other = _other_host()
        if other is None:
            pytest.skip(f"no {OTHER_HOST} on this machine")
        ns = _everywhere(nodes, 3)
        replicas, auth, connect_to, kw = [n.addr for n in ns], None, other, {}

    async def body():
        async with open_client("tcp", [], **kw) as dc:
            locs, datas = await _write(dc, replicas)
            extents = sorted({loc.extent for pl in locs for loc in pl})
            await _settled(dc, replicas[0])
            got = await trio.to_thread.run_sync(lambda: _attack(replicas, extents, auth=auth,
                                                                connect_to=connect_to))
            if who == "client key":
                assert got == ["FORBIDDEN"] * len(got), got
            else:
                assert all(g.startswith("refused: ") and "own host only" in g for g in got), got
            await trio.sleep(3 * FAST["heartbeat_s"])
            assert await _read_everywhere(dc, replicas, locs, datas) == dict.fromkeys(replicas, PIECES)
            for a in replicas:
                [p] = [p for p in await admin.partition_list(dc, a) if p["id"] == PID]
                assert p["epoch"] == 1 and p["replicas"] == replicas
    run(body)


def test_a_view_whose_leader_cannot_hold_the_data_is_refused_everywhere(nodes):
    """Views naming as leader a node that does not answer, and a new replica still empty: every member
    refuses them (LAST_COPY, with why), nothing moves, no copy goes to the trash; a view led by a synced
    follower is taken."""
    ns = nodes(4, **FAST)
    replicas, spare = [n.addr for n in ns[:3]], ns[3].addr

    async def body():
        async with open_client("tcp", []) as dc:
            locs, datas = await _write(dc, replicas)
            await _settled(dc, replicas[0])
            for view in ({"replicas": ["127.0.0.1:1"], "epoch": 2},                  # nobody there
                         {"replicas": ["127.0.0.1:1", *replicas], "epoch": 2}):
                for a in replicas:
                    with pytest.raises(ClientError) as ei:
                        await dc.admin(a, Op.PARTITION_UPDATE, partition=PID, body=view)
                    assert ei.value.result == Result.LAST_COPY, ei.value
            # a new replica, created empty at epoch 2, as the leader: refused by the old members
            new = {"replicas": [spare, *replicas], "epoch": 2}
            await dc.admin(spare, Op.PARTITION_CREATE, partition=PID, body=new)
            for a in replicas:
                with pytest.raises(ClientError) as ei:
                    await dc.admin(a, Op.PARTITION_UPDATE, partition=PID, body=new)
                assert ei.value.result == Result.LAST_COPY
            for a in replicas:
                assert await admin.trash_list(dc, a) == []
                [p] = [p for p in await admin.partition_list(dc, a) if p["id"] == PID]
                assert p["epoch"] == 1
            assert await _read_everywhere(dc, replicas, locs, datas) == dict.fromkeys(replicas, PIECES)
            # the ordinary change: a synced follower leads (set-leader), and the data is all there
            await admin.set_leader(dc, PID, replicas[1], replicas)
            await dc.refresh(PID)
            moved = [replicas[1], replicas[0], replicas[2]]
            assert dc.partition(PID).replicas == moved
            assert await _read_everywhere(dc, moved, locs, datas) == dict.fromkeys(moved, PIECES)
    run(body)


# -- the rule, pure ---------------------------------------------------------------------------------------
A, B, C, D = "a:1", "b:1", "c:1", "d:1"


def test_rule_this_node_may_lead_only_a_synced_copy_that_missed_no_epoch():
    lv = viewguard.local_verdict
    assert lv(B, [A, B, C], 4, True, [B, C], 5) == ("ok", "")
    assert lv(B, [A, B, C], 4, False, [B, C], 5)[0] == "refuse"          # cut back / not confirmed
    assert lv(B, [A, B, C], 4, True, [B, C], 6)[0] == "refuse"           # missed epoch 5
    assert lv(D, [A, B, C], 4, True, [D, A], 5)[0] == "refuse"           # not a member of its own view
    assert lv(B, [A, B, C], 4, False, [A, C], 5) == ("ok", "")           # the current leader stays
    assert lv(C, [A, B, C], 4, True, [B, C], 5) == ("ask", B)
    assert lv(C, [A, B, C], 4, True, [D], 9) == ("ask", D)


def test_rule_another_leader_must_say_it_is_synced_and_share_or_cover_this_copy():
    rv = viewguard.remote_verdict
    mine = {1: (100, 7), 2: (50, 9), 3: (0, 0)}
    same = {"synced": True, "epoch": 4, "replicas": [A, B, C]}
    assert rv([A, B, C], 4, B, same, mine) == ""
    assert "not known" in rv([A, B, C], 4, B, {**same, "synced": False}, mine)
    assert "behind" in rv([A, B, C], 4, B, {**same, "epoch": 3}, mine)
    assert "was not a replica" in rv([A, B, C], 4, D, {**same, "replicas": [D]}, mine)
    ahead = {"synced": True, "epoch": 7, "replicas": [D, A], "marks": {"1": 100, "2": 60},
             "digests": {"1": 7, "2": 1}, "deleted": []}
    assert rv([A, B, C], 4, D, ahead, mine) == ""                         # holds all of ours (and more)
    assert "extent 2" in rv([A, B, C], 4, D, {**ahead, "marks": {"1": 100, "2": 40}}, mine)
    assert "other bytes" in rv([A, B, C], 4, D, {**ahead, "digests": {"1": 8, "2": 1}}, mine)
    assert rv([A, B, C], 4, D, {**ahead, "marks": {"1": 100}, "deleted": [2]}, mine) == ""   # deleted there
    assert rv([A, B, C], 4, B, {**ahead, "replicas": [B, D], "marks": {}}, mine) == ""   # ours, gone on
    assert "own view" in rv([A, B, C], 4, D, {**ahead, "replicas": [A]}, mine)
    assert "unreadable" in rv([A, B, C], 4, D, {**ahead, "marks": {"x": 1}}, mine)


def test_rule_a_leader_confirms_what_is_acknowledged_not_what_is_in_flight():
    ours = {1: (100, 7), 2: (50, 9)}
    need = viewguard.acknowledged(ours, {1: 60})          # extent 1: 40 bytes in flight beyond 60
    assert need == {1: (60, None), 2: (50, 9)}
    st = {"marks": {"1": 70, "2": 50}, "digests": {"1": 3, "2": 9}, "deleted": []}
    assert viewguard.covers(need, st) == ""
    assert "extent 1" in viewguard.covers(need, {**st, "marks": {"1": 59, "2": 50}})
    assert "extent 1" in viewguard.covers(ours, st)        # the whole copy would wait for the appends in flight


def test_rule_a_copy_stays_synced_only_through_consecutive_epochs_as_a_member():
    ss = viewguard.stays_synced
    assert ss(B, [A, B], 4, True, [A, B, C], 5)
    assert not ss(B, [A, B], 4, True, [A, B, C], 6)
    assert not ss(B, [A, B], 4, False, [A, B], 5)
    assert not ss(B, [A, C], 4, True, [A, B], 5)


def test_a_put_to_etcd_naming_nobody_moves_no_copy_to_the_trash(nodes, secret, tmp_path):
    """With the cluster secret on, a view in etcd that passes the map's checks (sealed with the secret, as a
    faulty manager would write it, naming a registered node where nothing listens): every replica's agent
    sees a newer view that no longer names it -- and keeps its copy, because that view's leader cannot be
    asked (LAST_COPY, counted); every piece reads back from every replica."""
    from tools.etcd_cluster import EtcdProc, etcd_binary
    from wire.etcdmap import Etcd, PartView
    try:
        etcd_binary()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    e = EtcdProc(tmp_path / "etcd").start()
    try:
        ns = nodes(3, secret_file=str(secret), etcd=e.url, lease_ttl_s=2, **FAST)
        replicas = [n.addr for n in ns]

        async def body():
            async with open_client("tcp", [], secret=str(secret)) as dc:
                locs, datas = await _write(dc, replicas)
                await _settled(dc, replicas[0])
                et = Etcd(e.url, admin_key=Credentials.load(str(secret)).key(Role.ADMIN))
                await et.put_entry(et.node_key("127.0.0.1:1"), {"addr": "127.0.0.1:1", "partitions": {}})
                nobody = PartView(PID, ["127.0.0.1:1"], 2, want=1, synced=["127.0.0.1:1"])
                await et.put_entry(et.part_key(PID), nobody.body())
                with trio.fail_after(30):
                    while not all([(await admin.node_status(dc, a))["counters"]["views_refused"]
                                   for a in replicas]):
                        await trio.sleep(0.2)
                for a in replicas:
                    assert PID in (await admin.node_status(dc, a))["partitions"]
                    assert await admin.trash_list(dc, a) == []
                assert await _read_everywhere(dc, replicas, locs, datas) == dict.fromkeys(replicas, PIECES)
        run(body)
    finally:
        e.stop()


def test_a_new_replica_is_confirmed_synced_while_writes_go_on_and_may_then_lead(nodes):
    """A replica added to a partition with data is not synced (it cannot lead: LAST_COPY) until its leader
    filled it and confirmed it -- also while a client keeps appending; then it may lead, with every byte."""
    a, b = nodes(2, **FAST)

    async def body():
        async with open_client("tcp", []) as dc:
            locs, datas = await _write(dc, [a.addr])
            old = await admin.current_view(dc, PID, [a.addr])
            await admin.change_replicas(dc, old, [a.addr, b.addr])
            assert (await _follower(dc, b.addr))["synced"] is False
            with pytest.raises(ClientError) as ei:        # not filled yet: it may not lead
                await dc.admin(b.addr, Op.PARTITION_UPDATE, partition=PID,
                               body={"replicas": [b.addr, a.addr], "epoch": 3})
            assert ei.value.result == Result.LAST_COPY
            await dc.refresh(PID)
            stop = trio.Event()
            more = []

            async def writer():
                i = 0
                while not stop.is_set():
                    data = pattern(500 + i, 64 * KiB)
                    more.append((await dc.write(PID, data), data))
                    i += 1
            async with trio.open_nursery() as n:
                n.start_soon(writer)
                with trio.fail_after(60):
                    while not (await _follower(dc, b.addr))["synced"]:
                        await trio.sleep(0.2)
                stop.set()
            await admin.set_leader(dc, PID, b.addr, [a.addr, b.addr])
            await dc.refresh(PID)
            for pl, data in [*zip(locs, datas), *more]:
                assert b"".join([await dc.read_location(loc, replica=b.addr) for loc in pl]) == data
            assert len(more) >= 2
    run(body)
