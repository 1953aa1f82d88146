"""Trust boundaries, against real daemons that hold a cluster secret, played by the SDK and by raw
peers (lab/fuzz.py): who may connect, what each role may do, whose forwards a follower takes, which memory
a peer can reach, per-connection limits, the trash and the audit log.
"""
from __future__ import annotations

import json
import os
import pathlib
import random
import socket
import subprocess
import sys
import time

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from client.sdk import ClientError
from wire.auth import Credentials, DialAuth, gen_secret
from wire.crc import crc32c
from wire.pool import BuddyPool
from wire.protocol import Flag, Header, Op, RemoteBuf as RemoteBufT, Result, Role, decode
from wire.transport.base import Access, RemoteAccessError, TransportError
from wire.transport.tcp import FRAME, READ_REQ, READ_RESP
from tests.conftest import SLACK, create_partition, open_client, pattern, run
from lab import fuzz

KiB, MiB = 1 << 10, 1 << 20
PID = 7
REPO = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture
def secret(tmp_path) -> pathlib.Path:
    p = tmp_path / "cluster.secret"
    p.write_text(gen_secret())
    p.chmod(0o600)
    return p


@pytest.fixture
def client_key(tmp_path, secret) -> pathlib.Path:
    out = subprocess.run([sys.executable, "-m", "datanode.cli", "derive-key", "--secret-file", str(secret),
                          "--role", "client"], capture_output=True, text=True, check=True, cwd=REPO).stdout
    p = tmp_path / "client.key"
    p.write_text(out)
    return p


def auth_as(secret, role: Role, identity: str = "") -> DialAuth:
    return DialAuth(Credentials.load(secret), role, identity)


def log_of(node) -> str:
    return node.log_path.read_text(errors="replace")


def wait_log(node, *texts: str, timeout: float = 10.0) -> str:
    """The node's log once it holds every one of ``texts`` (the node logs after it answers)."""
    deadline = time.monotonic() + timeout
    while True:
        text = log_of(node)
        if all(t in text for t in texts) or time.monotonic() > deadline:
            return text
        time.sleep(0.1)


# -- keys ----------------------------------------------------------------------------------------------------------
def test_role_keys_and_key_files(tmp_path, secret, client_key):
    from wire.auth import AuthConfigError, role_key
    master = Credentials.load(secret)
    ck = Credentials.load(client_key)
    assert set(master.keys) == set(Role) and set(ck.keys) == {Role.CLIENT}
    assert ck.key(Role.CLIENT) == master.key(Role.CLIENT) == role_key(secret.read_bytes().strip(), Role.CLIENT)
    assert len({master.key(r) for r in Role}) == 3                     # one key per role
    assert master.default_role() == Role.ADMIN and ck.default_role() == Role.CLIENT
    with pytest.raises(AuthConfigError, match="cannot make other keys"):
        ck.role_key_file(Role.ADMIN)
    bad = tmp_path / "bad.key"
    for text, why in (("datanode-role-key v1 root 00", "ROLE one of"), ("datanode-role-key v1 client zz", "not hex"),
                      ("datanode-role-key v1 client 00", "32 bytes"), ("short", "at least 16")):
        bad.write_text(text)
        with pytest.raises(AuthConfigError, match=why) as ei:
            Credentials.load(bad)
        assert str(bad) in str(ei.value)
    with pytest.raises(AuthConfigError, match="No such file"):
        Credentials.load(tmp_path / "missing")


def test_a_node_needs_the_cluster_secret_itself(tmp_path, client_key):
    cfg = tmp_path / "node.toml"
    for secret_file, why in ((client_key, "needs the cluster secret, not a role key file"),
                             (tmp_path / "missing", "no such file")):
        cfg.write_text(f'listen = "127.0.0.1:1"\ndata_dir = "{tmp_path / "d"}"\nsecret_file = "{secret_file}"\n')
        out = subprocess.run([sys.executable, "-m", "datanode.cli", "serve", "--config", str(cfg)],
                             capture_output=True, text=True, cwd=REPO, timeout=60)
        assert out.returncode != 0 and "secret_file" in out.stderr and why in out.stderr, out.stderr
        assert "Traceback" not in out.stderr


# -- who may connect -------------------------------------------------------------------------------------------
def test_without_the_secret_a_client_is_refused_at_the_hello(nodes, secret, tmp_path):
    [n] = nodes(1, secret_file=str(secret))
    other = tmp_path / "other.secret"
    other.write_text(gen_secret())

    async def body():
        with pytest.raises(ClientError, match="requires authentication"):
            async with open_client("tcp", [n.addr]):
                pass
        with pytest.raises(ClientError, match="failed to prove"):      # a node with another secret: not trusted
            async with open_client("tcp", [n.addr], secret=str(other)):
                pass
        async with open_client("tcp", [n.addr], secret=str(secret)) as dc:       # the right one
            assert (await dc.admin(n.addr, Op.NODE_STATUS))["auth"] == "on"
    run(body)
    # raw peers: no credentials, and a forged proof (wrong key) for the admin role
    s = fuzz.connect(n.addr, timeout=5)
    with pytest.raises(fuzz.Refused, match="authentication required"):
        fuzz.hello(s)
    fuzz.end(s, "fin")
    forged = DialAuth(Credentials.from_secret(b"x" * 32), Role.ADMIN)
    s = fuzz.connect(n.addr, timeout=5)
    with pytest.raises((fuzz.Refused, ConnectionError, OSError)):
        fuzz.hello(s, auth=forged)
        fuzz.send_ctrl(s, Header(opcode=Op.PING).encode())
        fuzz.recv_frame(s)
    fuzz.end(s, "fin")
    text = wait_log(n, "presents no credentials", "bad proof for role admin")
    assert "presents no credentials" in text and "bad proof for role admin" in text
    assert "AUTHENTICATION IS OFF" not in text


def test_auth_off_is_loud_and_works_as_before(nodes):
    [n] = nodes(1)

    async def body():
        async with open_client("tcp", []) as dc:
            st = await dc.admin(n.addr, Op.NODE_STATUS)
            assert st["auth"] == "off" and "rkey" in st["pool"]
            assert st["peers"] == "this host only, unauthenticated (no secret)" and st["insecure"] is False
            await create_partition(dc, PID, [n.addr])
            locs = await dc.write(PID, b"open house")
            assert await dc.read_location(locs[0]) == b"open house"
    run(body)
    assert "AUTHENTICATION IS OFF" in wait_log(n, "AUTHENTICATION IS OFF")


# -- what each role may do ---------------------------------------------------------------------------------------
def test_a_client_key_cannot_administer_nor_forward(nodes, secret, client_key):
    a, b = nodes(2, secret_file=str(secret))
    data = pattern(1, 300 * KiB)

    async def body():
        async with open_client("tcp", [], secret=str(secret)) as adm:          # the cluster secret: admin
            await create_partition(adm, PID, [a.addr, b.addr])
        with pytest.raises(ClientError, match="no key for role 'admin'"):
            async with open_client("tcp", [a.addr], secret=str(client_key), role="admin"):
                pass
        async with open_client("tcp", [a.addr], secret=str(client_key)) as dc:   # role client
            locs = await dc.write(PID, data)                                     # data ops: yes
            assert b"".join([await dc.read_location(loc) for loc in locs]) == data
            for addr in (a.addr, b.addr):
                assert b"".join([await dc.read_location(loc, replica=addr) for loc in locs]) == data
            for op, body_ in ((Op.PARTITION_CREATE, {"replicas": [a.addr], "epoch": 1}),
                              (Op.PARTITION_UPDATE, {"replicas": [a.addr], "epoch": 9}), (Op.PARTITION_DELETE, None),
                              (Op.REPAIR, None), (Op.SCRUB, None)):
                with pytest.raises(ClientError) as ei:
                    await dc.admin(a.addr, op, partition=PID if op != Op.PARTITION_CREATE else PID + 1, body=body_)
                assert ei.value.result == Result.FORBIDDEN, (op, ei.value)
                assert "forbidden" in str(ei.value)
            stats = await dc.admin(a.addr, Op.POOL_STATS)
            assert "rkey" not in stats and "base_addr" not in stats and stats["grants_required"]
            st = await dc.admin(a.addr, Op.NODE_STATUS)
            assert "rkey" not in st["pool"]
            # a forwarded write straight to the follower, by a client: refused, the follower's copy unchanged
            part = dc.partition(PID)
            marks = await dc.watermarks(PID, b.addr)
            e = locs[0].extent
            resp, _ = await dc.request(b.addr, Header(opcode=Op.WRITE, partition=PID, extent=e, offset=marks[e],
                                                      length=5, crc=crc32c(b"evil!"), epoch=part.epoch,
                                                      flags=Flag.FORWARDED), body=b"evil!")
            assert resp.result == Result.FORBIDDEN, resp.result_text()
            assert await dc.watermarks(PID, b.addr) == marks
        async with open_client("tcp", [], secret=str(secret)) as adm:
            assert "rkey" in await adm.admin(a.addr, Op.POOL_STATS)                 # an admin sees it
    run(body)
    assert "FORBIDDEN role client may not send PARTITION_DELETE" in wait_log(a, "may not send PARTITION_DELETE")


def test_a_follower_takes_forwards_only_from_the_current_leader(nodes, secret):
    a, b, c = nodes(3, secret_file=str(secret))

    async def body():
        async with open_client("tcp", [], secret=str(secret)) as adm:
            await create_partition(adm, PID, [a.addr, b.addr, c.addr])
            eid = await adm.create_extent(PID)
            await adm.append(PID, eid, 0, b"leader wrote this")
            epoch = adm.partition(PID).epoch
        size = len(b"leader wrote this")
        evil = b"injected"
        fwd = Header(opcode=Op.WRITE, partition=PID, extent=eid, offset=size, length=len(evil), crc=crc32c(evil),
                     epoch=epoch, addr=0x1000, rkey=5, rlen=len(evil), flags=Flag.FORWARDED | Flag.REPAIR)
        trunc = Header(opcode=Op.TRUNCATE, partition=PID, extent=eid, offset=0, epoch=epoch, flags=Flag.FORWARDED)
        # node c (a real node identity, proven with the node key) is not b's leader: refused
        for h in (fwd, trunc):
            r = fuzz.request(b.addr, h, evil, auth=auth_as(secret, Role.NODE, c.addr))
            assert r.result == Result.FORBIDDEN, r.result_text()
        # node c pushing a view in which it leads: refused (only a view's own leader may push it)
        view = json.dumps({"replicas": [c.addr, a.addr, b.addr], "epoch": epoch + 1}).encode()
        r = fuzz.request(b.addr, Header(opcode=Op.PARTITION_UPDATE, partition=PID, length=len(view), addr=0x2000,
                                        rkey=6, rlen=len(view)), view, auth=auth_as(secret, Role.NODE, a.addr))
        assert r.result == Result.FORBIDDEN, r.result_text()
        # the same forward from the leader's identity is taken (so the identity is what decides)
        r = fuzz.request(b.addr, fwd, evil, auth=auth_as(secret, Role.NODE, a.addr))
        assert r.result == Result.OK, r.result_text()
        async with open_client("tcp", [a.addr], secret=str(secret)) as adm:
            assert (await adm.watermarks(PID, c.addr))[eid] == size
            assert await adm.read(PID, eid, 0, size, replica=c.addr) == b"leader wrote this"
    run(body)
    assert "but the leader of partition 7 is" in wait_log(b, "but the leader of partition 7 is")


def test_creates_in_flight_across_a_step_down_are_never_forwarded_at_the_new_view(nodes, secret):
    """Extent creates in flight (their store create in a worker thread) while the leader is told it no longer
    leads: each answers OK (replicated at the view of its epoch) or a redirect (STALE_EPOCH / NOT_LEADER),
    never a replication failure from a forward sent at the new view (which names the old leader itself)."""
    a, b, c = nodes(3, secret_file=str(secret))
    view2 = json.dumps({"replicas": [b.addr, a.addr, c.addr], "epoch": 2}).encode()

    async def setup():
        async with open_client("tcp", [], secret=str(secret)) as adm:
            await create_partition(adm, PID, [a.addr, b.addr, c.addr])
    run(setup)
    s = fuzz.connect(a.addr, timeout=10)
    try:
        fuzz.hello(s, auth=auth_as(secret, Role.ADMIN))
        creates = 40
        for i in range(creates):
            fuzz.send_ctrl(s, Header(opcode=Op.CREATE_EXTENT, partition=PID, epoch=1, req_id=1 + i).encode())
        fuzz.send_ctrl(s, Header(opcode=Op.PARTITION_UPDATE, partition=PID, length=len(view2), addr=0x2000, rkey=6,
                                 rlen=len(view2), req_id=999).encode())
        answers = {}
        deadline = time.monotonic() + 30
        while len(answers) < creates + 1 and time.monotonic() < deadline:
            ftype, _st, length, op, _a, _r, payload = fuzz.recv_frame(s)
            if ftype == READ_REQ:
                s.sendall(FRAME.pack(READ_RESP, 0, 0, length, op, 0, 0, 0) + view2[:length])
            elif ftype == fuzz.CTRL:
                r = fuzz.decode(payload, request=False)
                answers[r.req_id] = r
    finally:
        fuzz.end(s, "fin")
    assert answers.pop(999).result == Result.OK
    results = {Result(r.result).name for r in answers.values()}
    assert len(answers) == creates and results <= {"OK", "STALE_EPOCH", "NOT_LEADER"}, \
        sorted((i, Result(r.result).name) for i, r in answers.items())
    made = {r.arg for r in answers.values() if r.result == Result.OK}

    async def check():                   # every create answered OK is on each replica of its view
        async with open_client("tcp", [], secret=str(secret)) as adm:
            await adm.discover(b.addr)
            for addr in (a.addr, b.addr, c.addr):
                assert made <= set(await adm.watermarks(PID, addr)), addr
    run(check)


def test_a_follower_copy_changed_behind_the_leaders_back_is_caught_by_the_heartbeat(nodes, secret):
    """The issue's probe: a forwarded TRUNCATE + WRITE (valid CRC, same size as before) injected into a
    follower with a node identity that passes as the leader's.  The leader's next heartbeat sees the copy
    differ (the per-extent digest), says so in partition health, and repair makes it identical again --
    long before the full repair pass (repair_interval_s) would have compared the blocks."""
    a, b = nodes(2, secret_file=str(secret), heartbeat_s=0.5, repair_interval_s=3600)
    data = pattern(12, 300 * KiB + 3)

    async def body():
        async with open_client("tcp", [], secret=str(secret)) as adm:
            await create_partition(adm, PID, [a.addr, b.addr])
            eid = await adm.create_extent(PID)
            await adm.append(PID, eid, 0, data)
            epoch = adm.partition(PID).epoch

            async def health():
                return await adm.admin(a.addr, Op.PARTITION_HEALTH, partition=PID)

            with trio.fail_after(10 + SLACK):
                while (await health())["followers"][0]["state"] != "healthy":
                    await trio.sleep(0.1)
            before = (await health())["repair"]["passes"]
            evil = b"EVIL!"
            cut = len(data) - len(evil)
            node_a = auth_as(secret, Role.NODE, a.addr)
            r = fuzz.request(b.addr, Header(opcode=Op.TRUNCATE, partition=PID, extent=eid, offset=cut, epoch=epoch,
                                            flags=Flag.FORWARDED), auth=node_a)
            assert r.result == Result.OK, r.result_text()
            r = fuzz.request(b.addr, Header(opcode=Op.WRITE, partition=PID, extent=eid, offset=cut, length=len(evil),
                                            crc=crc32c(evil), epoch=epoch, addr=0x1000, rkey=5, rlen=len(evil),
                                            flags=Flag.FORWARDED), evil, auth=node_a)
            assert r.result == Result.OK, r.result_text()
            t0 = time.monotonic()
            assert (await adm.watermarks(PID, b.addr))[eid] == len(data)          # same size: sizes alone miss it
            with trio.fail_after(4 * 0.5 + SLACK):      # caught within a heartbeat or two, then repaired
                while True:                             # (so fast that polling may never see it "lagging")
                    h = await health()
                    cut_back = (await adm.admin(a.addr, Op.NODE_STATUS))["counters"]["repair_truncates"]
                    if h["repair"]["passes"] > before and cut_back >= 1:
                        break
                    await trio.sleep(0.05)
            caught = time.monotonic() - t0
            with trio.fail_after(10 + SLACK):
                while (await health())["followers"][0]["state"] != "healthy":
                    await trio.sleep(0.1)
            assert await adm.read(PID, eid, 0, len(data), replica=b.addr) == data
            st = await adm.admin(a.addr, Op.NODE_STATUS)
            assert st["counters"]["repair_truncates"] >= 1
            return caught
    caught = run(body)
    print(f"divergence caught and repaired {caught:.2f}s after the injection (heartbeat 0.5s)")
    assert "different bytes (digest)" in wait_log(a, "different bytes (digest)")


# -- memory exposed only to whom a request names ------------------------------------------------------------------
def test_a_peer_cannot_read_pool_memory_not_granted_to_it(nodes, secret):
    a, b = nodes(2, secret_file=str(secret))
    data = pattern(3, 4 * MiB)

    async def body():
        async with open_client("tcp", [], secret=str(secret)) as adm:
            await create_partition(adm, PID, [a.addr, b.addr])
            pool = await adm.admin(a.addr, Op.POOL_STATS)         # an admin learns rkey and base: still no use
        s = fuzz.connect(a.addr, timeout=5)
        try:
            fuzz.hello(s, auth=auth_as(secret, Role.NODE, b.addr))     # even as a node (the follower's identity)

            async def writer():
                async with open_client("tcp", [a.addr], secret=str(secret)) as dc:
                    return await dc.write(PID, data)

            async with trio.open_nursery() as nursery:               # payloads pass through the pool meanwhile
                nursery.start_soon(writer)
                for off in range(0, pool["arena_bytes"], 4 * MiB):
                    await trio.to_thread.run_sync(s.sendall, FRAME.pack(READ_REQ, 0, 0, 64 * KiB, off + 1,
                                                                        pool["base_addr"] + off, pool["rkey"], 0))
                    ftype, status, length, *_ = await trio.to_thread.run_sync(
                        lambda: fuzz.recv_frame(s, body=False))
                    assert (ftype, length) == (READ_RESP, 0) and status == 5, "pool served to a stranger"
        finally:
            fuzz.end(s, "fin")
    run(body)
    assert "not granted to this connection" in wait_log(a, "not granted to this connection")


def test_grants_scope_one_sided_access_to_a_request_in_flight():
    """Transport level: a scoped region is reachable only inside a grant on that connection, with that right,
    through that grant's own rkey (never the region's), and not after the grant is dropped -- not even when
    a newer grant covers the same range (a late one-sided op of an ended request must not land in the
    buffer its owner has already given to the next request)."""
    from tests.test_transport import pair

    async def body():
        async with pair("tcp") as (cli, srv):
            pool = BuddyPool(MiB, MiB)
            scoped = cli.domain.register(pool.arena, pool.base_addr, Access.REMOTE_READ, scoped=True)
            scoped.view[:10] = b"0123456789"
            local = srv.dst.view[:4]
            with pytest.raises(RemoteAccessError, match="not granted"):
                await srv.conn.read(scoped.remote(2, 4), local, srv.dst)
            token, key = await cli.conn.grants.grant(scoped.addr + 2, scoped.rkey, 4, Access.REMOTE_READ)
            assert key != scoped.rkey
            with pytest.raises(RemoteAccessError, match="not granted"):  # the region's own rkey: never
                await srv.conn.read(scoped.remote(2, 4), local, srv.dst)
            await srv.conn.read(RemoteBufT(scoped.addr + 2, key, 4), local, srv.dst)
            assert bytes(local) == b"2345"
            with pytest.raises(RemoteAccessError):                      # one byte past the grant
                await srv.conn.read(RemoteBufT(scoped.addr + 2, key, 5), srv.dst.view[:5], srv.dst)
            cli.conn.grants.drop(token)
            with pytest.raises(RemoteAccessError):
                await srv.conn.read(RemoteBufT(scoped.addr + 2, key, 4), local, srv.dst)
            token2, key2 = await cli.conn.grants.grant(scoped.addr + 2, scoped.rkey, 4, Access.REMOTE_READ)
            assert key2 != key
            with pytest.raises(RemoteAccessError):                      # the dead grant's rkey stays dead
                await srv.conn.read(RemoteBufT(scoped.addr + 2, key, 4), local, srv.dst)
            await srv.conn.read(RemoteBufT(scoped.addr + 2, key2, 4), local, srv.dst)
            assert bytes(local) == b"2345"
            cli.conn.grants.drop(token2)
            cli.domain.deregister(scoped)
    run(body)


class _FakeFollower:
    """A follower played by the test over verbs (the product's own ``accept``, with the cluster secret): it
    answers every forwarded create and write OK (anything else NOT_FOUND) after READing the leader's block as a real follower does, and keeps what it saw
    (the window rkeys, addresses and bytes) for the hostile reads the test makes with them."""

    def __init__(self, secret, domain):
        from wire.transport.connect import ServerAuth
        self.auth = ServerAuth(Credentials.load(secret))
        self.domain = domain
        self.pool = BuddyPool(4 * MiB, 4 * MiB)
        self.region = domain.register(self.pool.arena, self.pool.base_addr, Access.LOCAL_WRITE, scoped=False)
        self.seen: list[tuple[object, Header, bytes]] = []      # (connection, forward, bytes READ)
        self.conns = []
        self.hook = None              # async (conn, header) -> None, run before the answer of the next forward
        self.addr = ""

    async def serve(self, nursery):
        from wire.transport.connect import accept
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.addr = f"127.0.0.1:{listeners[0].socket.getsockname()[1]}"

        async def handler(stream):
            async with accept(stream.socket, "leader", self.domain, transport="verbs", slots=16,
                              auth=self.auth) as conn:
                self.conns.append(conn)
                while True:
                    try:
                        h = decode(await conn.recv(), request=True)
                    except TransportError:
                        return
                    if h.opcode == Op.WRITE and h.rlen:
                        local = self.region.view[:h.rlen]
                        await conn.read(h.remote, local, self.region)
                        self.seen.append((conn, h, bytes(local)))
                        hook, self.hook = self.hook, None
                        if hook is not None:
                            await hook(conn, h)
                    ok = h.opcode in (Op.WRITE, Op.CREATE_EXTENT)     # heartbeats, repair: "no such partition"
                    await conn.send(h.reply(Result.OK if ok else Result.NOT_FOUND, crc=h.crc).encode())
        nursery.start_soon(trio.serve_listeners, handler, listeners)


@pytest.mark.parametrize("transport", [pytest.param("verbs", marks=pytest.mark.verbs)], indirect=True)
def test_verbs_peer_reaches_only_the_window_a_request_bound_for_it(nodes, secret, transport):
    """The verbs twin of the test above: a peer with an established queue pair to the leader READs the
    leader's pool with the pool MR's rkey, with a window another connection's request was given, and with a
    window after its request was answered: each is refused by the NIC (remote access error, the hostile
    connection torn down), while the window its own request names works; and the node keeps serving."""
    from tests.conftest import client_domain
    a, = nodes(1, secret_file=str(secret))
    domain = client_domain("verbs")
    fol = _FakeFollower(secret, domain)
    d1, d2, d3 = pattern(1, 96 * KiB), pattern(2, 80 * KiB), pattern(3, 64 * KiB)

    async def hostile_read(addr, rkey, n=4 * KiB):
        """A read from the test's own queue pair to the leader, dialed as a node (the follower's identity)."""
        from wire.transport.connect import dial
        host, port = a.addr.rsplit(":", 1)
        async with dial(host, int(port), domain, transport="verbs",
                        auth=auth_as(secret, Role.NODE, fol.addr)) as conn:
            assert conn.transport == "verbs" and conn.session is not None     # its messages are MAC'd
            with pytest.raises(RemoteAccessError):
                await conn.read(RemoteBufT(addr, rkey, n), fol.region.view[:n], fol.region)
            assert not conn.alive                   # torn down

    async def body():
        async with trio.open_nursery() as nursery:
            await fol.serve(nursery)
            async with open_client("verbs", [], secret=str(secret)) as dc:
                st = await dc.admin(a.addr, Op.NODE_STATUS)
                assert st["rdma_windows"] == "on", st["rdma_windows"]
                await dc.admin(a.addr, Op.PARTITION_CREATE, partition=PID,
                               body={"replicas": [a.addr, fol.addr], "epoch": 1})
                await dc.discover(a.addr)
                pool = await dc.admin(a.addr, Op.POOL_STATS)        # an admin learns the MR's rkey and base

                locs = await dc.write(PID, d1)
                assert b"".join(seen for _, _, seen in fol.seen) == d1      # its own window serves it
                conn1, h1, _ = fol.seen[-1]
                assert h1.rkey != pool["rkey"]

                async def cross(conn, h):          # the window of this in-flight request, from another QP
                    await hostile_read(h.addr, h.rkey, h.rlen)
                fol.hook = cross
                locs += await dc.write(PID, d2)
                assert fol.hook is None and fol.seen[-1][2] == d2[-len(fol.seen[-1][2]):]
                conn2, h2, _ = fol.seen[-1]
                assert conn2 is conn1 and conn1.alive        # the follower's own link is untouched
                assert h2.rkey != h1.rkey                    # a fresh key per bind, even for a reused window

                await hostile_read(pool["base_addr"], pool["rkey"])            # the pool MR's own rkey
                await hostile_read(pool["base_addr"] + pool["arena_bytes"] - 4 * KiB, pool["rkey"])

                # the follower's own window after its request was answered: refused, its link torn down
                with pytest.raises(RemoteAccessError):
                    await conn1.read(RemoteBufT(h2.addr, h2.rkey, h2.rlen), fol.region.view[:h2.rlen],
                                     fol.region)
                assert not conn1.alive

                # the node keeps serving: a new write (the leader dials the follower again) and every byte back
                locs += await dc.write(PID, d3)
                assert fol.seen[-1][0] is not conn1
                got = b"".join([await dc.read_location(loc) for loc in locs])
                assert got == d1 + d2 + d3
            nursery.cancel_scope.cancel()
    run(body)


@pytest.mark.parametrize("transport", [pytest.param("verbs", marks=pytest.mark.verbs)], indirect=True)
def test_verbs_without_windows_keeps_mr_wide_rkeys(nodes, secret, transport, monkeypatch):
    """The fallback (a device without type-2 windows; forced here with rdma_windows = false, given to the nodes
    as DATANODE_RDMA_WINDOWS=0): regions are registered with remote rights on the MR, data moves as before,
    and status says windows are off."""
    from wire.transport.connect import dial
    from tests.conftest import client_domain
    monkeypatch.setenv("DATANODE_RDMA_WINDOWS", "0")
    a, b = nodes(2, secret_file=str(secret))
    domain = client_domain("verbs")
    monkeypatch.setattr(domain.device, "windows", False)
    monkeypatch.setattr(domain.device, "windows_state", "off (rdma_windows = false)")
    data = pattern(4, 300 * KiB)

    async def body():
        async with open_client("verbs", [], secret=str(secret), domain=domain) as dc:
            await create_partition(dc, PID, [a.addr, b.addr])
            st = await dc.admin(a.addr, Op.NODE_STATUS)
            assert st["rdma_windows"] == "off (rdma_windows = false)"
            locs = await dc.write(PID, data)
            for addr in (a.addr, b.addr):
                assert b"".join([await dc.read_location(loc, replica=addr) for loc in locs]) == data
            # the documented limit of this mode: the pool MR's rkey reaches the pool from any node's QP
            pool = await dc.admin(a.addr, Op.POOL_STATS)
            host, port = a.addr.rsplit(":", 1)
            async with dial(host, int(port), domain, transport="verbs",
                            auth=auth_as(secret, Role.NODE, b.addr)) as conn:
                pool_local = BuddyPool(MiB, MiB)
                reg = domain.register(pool_local.arena, pool_local.base_addr, Access.LOCAL_WRITE, scoped=False)
                try:
                    await conn.read(RemoteBufT(pool["base_addr"], pool["rkey"], 4 * KiB), reg.view[:4 * KiB], reg)
                finally:
                    domain.deregister(reg)
    run(body)
    assert "memory windows off" in log_of(a)


@pytest.mark.parametrize("transport", [pytest.param("verbs", marks=pytest.mark.verbs)], indirect=True)
def test_verbs_windows_scope_one_sided_access_to_a_request_in_flight(transport):
    """Transport level, the verbs twin of the grants test: a request naming a scoped buffer gives the peer a
    window rkey (never the region's key) that works for that request, with that right, through that queue
    pair, until the answer; every bind takes a new key.  Each refused access tears the connection down."""
    from wire.rpc import Requester
    from tests.test_transport import pair

    async def attempt(fn):
        """fn(cli, srv, region, requester) in a fresh connection pair with a scoped region on the client."""
        async with pair("verbs") as (cli, srv):
            pool = BuddyPool(MiB, MiB)
            region = cli.domain.register(pool.arena, pool.base_addr, Access.LOCAL_WRITE | Access.REMOTE_READ,
                                         scoped=True)
            region.view[:256] = bytes(range(256))
            assert region.windows
            req = Requester(cli.conn)
            async with trio.open_nursery() as n:
                await n.start(req.run)
                await fn(cli, srv, region, req)
                n.cancel_scope.cancel()
        cli.domain.deregister(region)            # after the connection (and its windows) are gone

    async def ask(srv, region, req, off=16, n=64):
        p = await req.submit(Header(opcode=Op.WRITE, partition=1, addr=region.addr + off, rkey=region.rkey,
                                    rlen=n, length=n), 5)
        return p, decode(await srv.conn.recv(), request=True)

    async def answer(srv, p, h):
        await srv.conn.send(h.reply(Result.OK).encode())
        await p.result()

    async def own_window_then_stale(cli, srv, region, req):
        keys = []
        for i in range(3):                                  # the same window, reused: a new key each time
            p, h = await ask(srv, region, req)
            assert h.rkey != region.rkey
            keys.append(h.rkey)
            await srv.conn.read(h.remote, srv.dst.view[:64], srv.dst)
            assert bytes(srv.dst.view[:64]) == bytes(range(16, 80))
            await answer(srv, p, h)
        assert len(set(keys)) == 3 and cli.conn.info()["windows_allocated"] == 1
        with pytest.raises(RemoteAccessError):               # the last window, after its answer
            await srv.conn.read(h.remote, srv.dst.view[:64], srv.dst)
        with trio.fail_after(5):
            while cli.conn.alive:
                await trio.sleep(0.01)

    async def region_key(cli, srv, region, req):
        p, h = await ask(srv, region, req)
        with pytest.raises(RemoteAccessError):               # the region's own key, while a window is live
            await srv.conn.read(RemoteBufT(region.addr + 16, region.rkey, 64), srv.dst.view[:64], srv.dst)

    async def wrong_right(cli, srv, region, req):
        p, h = await ask(srv, region, req)
        with pytest.raises(RemoteAccessError):               # a WRITE through a read window
            await srv.conn.write(srv.src.view[:64], srv.src, h.remote)
        assert bytes(region.view[16:80]) == bytes(range(16, 80))

    async def bounds(cli, srv, region, req):
        """Not asserted: rxe (kernel 6.1) bounds a window's accesses by its MR; recorded for the report."""
        p, h = await ask(srv, region, req)
        try:
            await srv.conn.read(RemoteBufT(h.addr + h.rlen, h.rkey, 64), srv.dst.view[:64], srv.dst)
            print("device serves bytes past a window's end (bounds by the MR only)")
        except RemoteAccessError:
            print("device refuses bytes past a window's end")

    async def body():
        for fn in (own_window_then_stale, region_key, wrong_right, bounds):
            await attempt(fn)
    run(body)


# -- per-connection limits -----------------------------------------------------------------------------------------
def test_hello_deadline_idle_timeout_and_max_connections(nodes, secret):
    [n] = nodes(1, secret_file=str(secret), hello_timeout=1.0, idle_timeout_s=2.0, max_connections=4)
    cl = auth_as(secret, Role.CLIENT)
    # a connection that never says hello is dropped
    s = fuzz.connect(n.addr, timeout=1.0 + SLACK)
    assert s.recv(16) == b""
    s.close()
    # so is an authenticated one that goes idle
    s = fuzz.connect(n.addr, timeout=2.0 + SLACK)
    fuzz.hello(s, auth=cl)
    assert s.recv(16) == b""
    s.close()
    # at most max_connections at once, of which clients may take all but reserved_connections (here 2 of 4):
    # a client beyond that takes the place of the least recently active idle client; an admin and a datanode
    # get in; beyond max_connections they too take idle clients' places, and with none left nobody gets in
    held = []
    for _ in range(3):
        h = fuzz.connect(n.addr, timeout=5)
        fuzz.hello(h, auth=cl)
        held.append(h)
    assert held[0].recv(16) == b""                    # closed to make room
    for auth in (auth_as(secret, Role.ADMIN), auth_as(secret, Role.NODE, "127.0.0.1:1"), auth_as(secret, Role.ADMIN),
                 auth_as(secret, Role.ADMIN)):
        h = fuzz.connect(n.addr, timeout=5)
        fuzz.hello(h, auth=auth)
        held.append(h)
    assert held[1].recv(16) == b"" and held[2].recv(16) == b""
    s = fuzz.connect(n.addr, timeout=5)
    with pytest.raises(fuzz.Refused, match="too many connections"):
        fuzz.hello(s, auth=auth_as(secret, Role.ADMIN))
    s.close()
    for h in held:
        fuzz.end(h, "fin")

    async def body():                   # the slots are free again
        with trio.fail_after(10 + SLACK):
            while True:
                try:
                    async with open_client("tcp", [], secret=str(secret)) as dc:
                        return await dc.admin(n.addr, Op.NODE_STATUS)
                except ClientError as e:
                    assert "too many connections" in str(e)
                    await trio.sleep(0.2)
    assert run(body)["auth"] == "on"
    text = wait_log(n, "idle for", "(max_connections), no client connection idle")
    assert "idle for" in text and "(max_connections), no client connection idle" in text


def test_clients_cannot_lock_nodes_and_admins_out(nodes, secret):
    """Idle client connections up to the clients' share: the next client takes the place of the least
    recently active idle one (a well-behaved client is served), while a datanode replicates and an admin runs
    commands as before; per host likewise."""
    a, b = nodes(2, secret_file=str(secret), max_connections=24, reserved_connections=8,
                 max_connections_per_host=0, idle_max=0, idle_per_host=0)
    cl = auth_as(secret, Role.CLIENT)

    async def setup():
        async with open_client("tcp", [], secret=str(secret)) as adm:
            await create_partition(adm, PID, [a.addr, b.addr])
    run(setup)
    held = []
    try:
        for _ in range(20):                  # more than the clients' share of the leader (16 of 24)
            s = fuzz.connect(a.addr, timeout=5)
            fuzz.hello(s, auth=cl)
            held.append(s)
        for s in held[:4]:                   # the four least recently active made room
            assert s.recv(16) == b""

        async def body():
            async with open_client("tcp", [a.addr], secret=str(secret), role="client") as dc:
                await dc.write(PID, b"x")
            async with open_client("tcp", [a.addr], secret=str(secret)) as adm:    # an admin gets in
                st = await adm.admin(a.addr, Op.NODE_STATUS)
                assert st["client_connections"] <= 16 and st["connections_closed_for_room"] >= 5
                data = pattern(31, 200 * KiB)         # and the leader's link to its follower is made and used
                locs = await adm.write(PID, data)
                assert b"".join([await adm.read_location(loc, replica=b.addr) for loc in locs]) == data
        run(body)
    finally:
        for s in held:
            fuzz.end(s, "fin")


def test_max_connections_per_host(nodes, secret):
    [n] = nodes(1, secret_file=str(secret), max_connections_per_host=3)
    cl = auth_as(secret, Role.CLIENT)
    held = []
    try:
        for _ in range(4):                           # the fourth takes the place of the first (idle)
            s = fuzz.connect(n.addr, timeout=5)
            fuzz.hello(s, auth=cl)
            held.append(s)
        assert held[0].recv(16) == b""
        s = fuzz.connect(n.addr, timeout=5)              # an admin of the same host is not a client
        fuzz.hello(s, auth=auth_as(secret, Role.ADMIN))
        held.append(s)

        async def status():
            async with open_client("tcp", [], secret=str(secret)) as adm:
                return await adm.admin(n.addr, Op.NODE_STATUS)
        st = run(status)
        assert st["client_connections"] == 3 and st["connections_closed_for_room"] == 1
    finally:
        for s in held:
            fuzz.end(s, "fin")


def test_one_connection_cannot_hold_the_whole_pool(nodes, secret):
    [n] = nodes(1, secret_file=str(secret), pool_mib=8, max_block_kib=1024, conn_pool_share=0.25,
                peer_timeout=30.0)

    async def body():
        async with open_client("tcp", [], secret=str(secret)) as adm:
            await create_partition(adm, PID, [n.addr])
            extents = [await adm.create_extent(PID) for _ in range(4)]
            epoch = adm.partition(PID).epoch
        s = fuzz.connect(n.addr, timeout=10)
        try:
            fuzz.hello(s, auth=auth_as(secret, Role.CLIENT))
            for i, e in enumerate(extents):      # 1 MiB writes whose payload we never serve
                fuzz.send_ctrl(s, Header(opcode=Op.WRITE, partition=PID, extent=e, length=MiB, crc=0, epoch=epoch,
                                         addr=0x100000, rkey=9, rlen=MiB, req_id=100 + i).encode())
            answers = {}
            for _ in range(10):
                ftype, _st, length, _op, _a, _r, payload = fuzz.recv_frame(s)
                if ftype == fuzz.CTRL:
                    r = fuzz.decode(payload, request=False)
                    answers[r.req_id] = r
                if len(answers) == 2:
                    break
            # share: 2 MiB of 8 -> the first two hold it, the next two are told BUSY at once
            assert {r.result for r in answers.values()} == {Result.BUSY}, [r.result_text() for r in answers.values()]
            # meanwhile everybody else writes (a pipeline within the share: 2 x 1 MiB)
            async with open_client("tcp", [n.addr], secret=str(secret), depth=2) as dc:
                data = pattern(5, 3 * MiB)
                locs = await dc.write(PID, data)
                assert b"".join([await dc.read_location(loc) for loc in locs]) == data
        finally:
            fuzz.end(s, "rst")
    run(body)


def test_requests_beyond_max_inflight_are_answered_busy(nodes, secret):
    """A connection with max_inflight requests in flight gets BUSY (arg: the limit) for each extra one at once,
    while its first ones keep waiting and everybody else is served; a peer that floods requests and reads no
    answers is dropped instead of growing the node."""
    [n] = nodes(1, secret_file=str(secret), max_inflight=4, peer_timeout=3.0)
    cl = auth_as(secret, Role.CLIENT)

    async def body():
        async with open_client("tcp", [], secret=str(secret)) as adm:
            await create_partition(adm, PID, [n.addr])
            eid = await adm.create_extent(PID)
            epoch = adm.partition(PID).epoch
        s = fuzz.connect(n.addr, timeout=10)
        try:
            fuzz.hello(s, auth=cl)
            for i in range(12):                     # 1-byte appends whose payload we never serve
                fuzz.send_ctrl(s, Header(opcode=Op.WRITE, partition=PID, extent=eid, length=1, crc=0, epoch=epoch,
                                         addr=0x1000, rkey=9, rlen=1, req_id=100 + i).encode())
            busy, fetches = [], 0
            while len(busy) < 8:
                ftype, _st, _len, _op, _a, _r, payload = fuzz.recv_frame(s)
                if ftype == fuzz.CTRL:
                    busy.append(fuzz.decode(payload, request=False))
                elif ftype == READ_REQ:
                    fetches += 1
            assert all(r.result == Result.BUSY and r.arg == 4 for r in busy), [r.result_text() for r in busy]
            assert sorted(r.req_id for r in busy) == list(range(104, 112))   # the first four are the ones held
            async with open_client("tcp", [n.addr], secret=str(secret)) as dc:
                data = pattern(4, 300 * KiB)
                locs = await dc.write(PID, data)
                assert b"".join([await dc.read_location(loc) for loc in locs]) == data
                st = await dc.admin(n.addr, Op.NODE_STATUS)
                assert st["counters"]["busy_inflight"] == 8
                assert max(c["inflight"] for c in st["connections"]) == 4
        finally:
            fuzz.end(s, "rst")
    run(body)
    assert "max_inflight 4" in wait_log(n, "max_inflight 4")

    # a flood of PINGs whose answers are never read: the node stops reading us (TCP backpressure) and drops us
    s = fuzz.connect(n.addr, timeout=1.0)
    fuzz.hello(s, auth=cl)
    raw = Header(opcode=Op.PING, req_id=1).encode()
    dropped = False
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            s.sendall(b"".join(fuzz.ctrl_frame(s, raw) for _ in range(1024)))     # (each with its session MAC)
        except socket.timeout:
            continue                                 # our send buffer is full: the node reads no more
        except OSError:
            dropped = True                           # reset by the node
            break
    s.close()
    assert dropped, "the node kept a connection that reads none of its answers"
    text = wait_log(n, "127.0.0.1")
    assert "has not read its answers" in text or "more control messages than we have slots" in text
    # and its host's next connections wait a little (penalty_max_s): reconnecting at once to abuse again is slowed
    assert "its new connections wait" in wait_log(n, "its new connections wait")

    async def still_serves():
        async with open_client("tcp", [n.addr], secret=str(secret)) as dc:
            data = pattern(6, 100 * KiB)
            locs = await dc.write(PID, data)
            assert b"".join([await dc.read_location(loc) for loc in locs]) == data
    run(still_serves)


# -- no data dies on one message: the trash -------------------------------------------------------------------------
def test_a_deleted_partition_goes_to_the_trash_and_can_be_restored(nodes, secret):
    [n] = nodes(1, secret_file=str(secret))
    data = pattern(9, 500 * KiB)

    async def write():
        async with open_client("tcp", [], secret=str(secret)) as adm:
            await create_partition(adm, PID, [n.addr])
            locs = await adm.write(PID, data)
            await adm.admin(n.addr, Op.PARTITION_DELETE, partition=PID)
            assert PID not in (await adm.admin(n.addr, Op.NODE_STATUS))["partitions"]
            return locs
    locs = run(write)
    cfg = str(n.root / "node.toml")
    listing = json.loads(subprocess.run([sys.executable, "-m", "datanode.cli", "trash", "list", "--config", cfg,
                                         "--json"], capture_output=True, text=True, check=True, cwd=REPO).stdout)
    assert [e["partition"] for e in listing] == [PID] and listing[0]["bytes"] >= len(data)
    n.stop()
    out = subprocess.run([sys.executable, "-m", "datanode.cli", "trash", "restore", listing[0]["name"], "--config",
                          cfg], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr
    n.start()

    async def read():
        async with open_client("tcp", [n.addr], secret=str(secret)) as dc:
            return b"".join([await dc.read_location(loc) for loc in locs])
    assert run(read) == data


def test_the_trash_is_purged_after_its_retention(nodes, secret):
    [n] = nodes(1, secret_file=str(secret), trash_retention_s=1.0)

    async def body():
        async with open_client("tcp", [], secret=str(secret)) as adm:
            await create_partition(adm, PID, [n.addr])
            await adm.write(PID, b"short-lived")
            await adm.admin(n.addr, Op.PARTITION_DELETE, partition=PID)
    run(body)
    trash = pathlib.Path(n.cfg["data_dir"]) / "trash"
    deadline = time.monotonic() + 10 + SLACK
    while any(trash.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(trash.iterdir()), list(trash.iterdir())
    assert "trash: purged" in log_of(n)


# -- the audit log ------------------------------------------------------------------------------------------------
def test_admin_actions_are_audited(nodes, secret, client_key):
    [n] = nodes(1, secret_file=str(secret))

    async def body():
        async with open_client("tcp", [], secret=str(secret)) as adm:
            await create_partition(adm, PID, [n.addr])
            await adm.admin(n.addr, Op.PARTITION_UPDATE, partition=PID, body={"replicas": [n.addr], "epoch": 2})
        async with open_client("tcp", [], secret=str(client_key)) as dc:
            with pytest.raises(ClientError):
                await dc.admin(n.addr, Op.PARTITION_DELETE, partition=PID)
        async with open_client("tcp", [], secret=str(secret)) as adm:
            await adm.admin(n.addr, Op.PARTITION_DELETE, partition=PID)
    run(body)
    audit = pathlib.Path(n.cfg["data_dir"]) / "audit.log"   # each line is on file before its answer is sent,
    lines = [json.loads(x) for x in audit.read_text().splitlines()]
    got = [(x["op"], x["role"], x["partition"], x["result"]) for x in lines]
    assert got == [("PARTITION_CREATE", "admin", PID, "OK"), ("PARTITION_UPDATE", "admin", PID, "OK"),
                   ("PARTITION_DELETE", "client", PID, "FORBIDDEN"), ("PARTITION_DELETE", "admin", PID, "OK")]
    assert all(x["node"] == n.addr and x["peer"].startswith("127.0.0.1:") and x["time"] for x in lines)
    assert "may not send PARTITION_DELETE" in lines[2]["detail"]


# -- replication and repair between authenticated nodes --------------------------------------------------------------
def test_replication_and_repair_work_between_authenticated_nodes(nodes, secret):
    a, b, c = nodes(3, secret_file=str(secret), heartbeat_s=0.3)
    data = pattern(11, 3 * MiB + 17)

    async def body():
        async with open_client("tcp", [], secret=str(secret)) as adm:
            await create_partition(adm, PID, [a.addr, b.addr, c.addr])
            locs = await adm.write(PID, data)
            for addr in (a.addr, b.addr, c.addr):
                assert b"".join([await adm.read_location(loc, replica=addr) for loc in locs]) == data
            wanted = (await adm.admin(a.addr, Op.REPAIR, partition=PID)).arg     # the leader's repair pass
            with trio.fail_after(20 + SLACK):
                while True:
                    h = await adm.admin(a.addr, Op.PARTITION_HEALTH, partition=PID)
                    states = [f["state"] for f in h["followers"]]
                    if h["repair"]["passes"] >= wanted and states == ["healthy", "healthy"]:
                        break
                    await trio.sleep(0.3)
    run(body)
    for n in (a, b, c):
        assert "FORBIDDEN" not in log_of(n), log_of(n)[-3000:]


# -- the wire fuzz, authenticated as a client (one case in ten without credentials) --------------------------------
def test_wire_fuzz_authenticated(nodes, secret):
    [n] = nodes(1, transport="tcp", peer_timeout=2.0, secret_file=str(secret), penalty_max_s=0.0)
    checker = fuzz.Checker(n.addr, secret=str(secret))
    target = checker.setup()
    cl = auth_as(secret, Role.CLIENT)

    @settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", "150")), deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.sampled_from(fuzz.KINDS), st.sampled_from(fuzz.ENDINGS), st.integers(0, 2**32))
    def case(kind, ending, seed):
        fuzz.play(n.addr, fuzz.RandomDice(random.Random(seed)), target, kind, ending, auth=cl)

    case()
    assert n.alive()
    checker.check()
    text = log_of(n)
    assert "Traceback" not in text, text[text.index("Traceback") - 300:][:3000]



# -- dnctl: a local cluster with a secret, --secret-file, and the trash ---------------------------------------------
def test_dnctl_secret_cluster_and_trash(tmp_path):
    from tests.test_cli import dnctl, refused
    env_secret = os.environ.pop("DATANODE_SECRET_FILE", None)
    d = tmp_path / "cl"
    try:
        up = json.loads(dnctl("cluster", "up", "--nodes", "2", "--secret", "--no-etcd", "--cluster", d, "--json", check=True).stdout)
        secret = d / "cluster.secret"
        assert secret.stat().st_mode & 0o777 == 0o600
        a, b = (n["addr"] for n in up["nodes"])
        assert "authentication on" in (d / "node1" / "node.log").read_text()
        f = tmp_path / "f"
        f.write_bytes(pattern(21, 70 * KiB))
        dnctl("put", "--cluster", d, "--partition", "1", f, check=True)      # --cluster DIR: its secret is used
        p = dnctl("partition", "delete", "--id", "1", "--replicas", f"{a},{b}")      # no secret: per replica, refused
        assert p.returncode != 0 and p.stdout.count("requires authentication") == 2, p.stdout + p.stderr
        refused(dnctl("--secret-file", tmp_path / "nope", "partition", "list", "--via", a), "secret file")
        dnctl("--secret-file", secret, "partition", "delete", "--id", "1", "--replicas", f"{a},{b}", check=True)
        rows = json.loads(dnctl("trash", "list", "--cluster", d, "--json", check=True).stdout)
        assert sorted(r["node"] for r in rows) == sorted([a, b]) and {r["partition"] for r in rows} == {1}
        assert {r["via"] for r in rows} == {"node"}                  # both run: asked over the wire
        mine = next(r["name"] for r in rows if r["node"] == a)
        theirs = next(r["name"] for r in rows if r["node"] == b)
        got = json.loads(dnctl("trash", "restore", mine, "--cluster", d, "--node", a, "--json", check=True).stdout)
        assert got == {"node": a, "name": mine, "partition": 1, "via": "node"}     # running: served at once
        out = dnctl("get", "--cluster", d, "--partition", "1", "--extent", "1", "--replica", a, "--out", "-",
                    check=True, binary=True)
        assert out.stdout == f.read_bytes()
        dnctl("cluster", "stop-node", b, "--cluster", d, check=True)     # down: its disk, from this host
        rows = json.loads(dnctl("trash", "list", "--cluster", d, "--json", check=True).stdout)
        assert [(r["node"], r["name"], r["via"]) for r in rows] == [(b, theirs, "disk")]
        got = json.loads(dnctl("trash", "restore", theirs, "--cluster", d, "--json", check=True).stdout)
        assert got == {"node": b, "name": theirs, "partition": 1, "via": "disk"}
        dnctl("cluster", "start-node", b, "--cluster", d, check=True)
        out = dnctl("get", "--cluster", d, "--partition", "1", "--extent", "1", "--replica", b, "--out", "-",
                    check=True, binary=True)
        assert out.stdout == f.read_bytes()
        dnctl("--secret-file", secret, "partition", "delete", "--id", "1", "--replicas", b, check=True)
        gone = json.loads(dnctl("trash", "purge", "--all", "--cluster", d, "--node", b, "--yes", "--json",
                                check=True).stdout)
        assert [g["node"] for g in gone] == [b]
        assert json.loads(dnctl("trash", "list", "--cluster", d, "--json", check=True).stdout) == []
        refused(dnctl("trash", "purge", "7.1", "--cluster", d), "no trash entry 7.1")
        refused(dnctl("trash", "purge", "nosuch", "--cluster", d), "not a trash entry name")
        refused(dnctl("trash", "list"), "--config", "--cluster")
    finally:
        dnctl("cluster", "down", "--cluster", d)
        if env_secret is not None:
            os.environ["DATANODE_SECRET_FILE"] = env_secret


# -- TLS on the TCP stream ---------------------------------------------------------------------------------------
def make_ca(d: pathlib.Path, name: str = "ca") -> tuple[pathlib.Path, pathlib.Path, pathlib.Path]:
    """A throwaway CA and a node certificate for 127.0.0.1 signed by it (the openssl CLI): (ca, cert, key)."""
    d.mkdir(parents=True, exist_ok=True)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def ossl(*args):
        subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True, cwd=d)
    ossl("req", "-x509", *ec, "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "1", "-subj", f"/CN={name}")
    ossl("req", *ec, "-keyout", "node.key", "-out", "node.csr", "-subj", "/CN=127.0.0.1")
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    ossl("x509", "-req", "-in", "node.csr", "-CA", f"{name}.pem", "-CAkey", f"{name}.key", "-CAcreateserial",
         "-out", "node.pem", "-days", "1", "-extfile", "san.ext")
    return d / f"{name}.pem", d / "node.pem", d / "node.key"


def test_tls_on_the_tcp_stream(nodes, secret, tmp_path):
    ca, cert, key = make_ca(tmp_path / "pki")
    other_ca, _, _ = make_ca(tmp_path / "other", "otherca")
    tls = dict(tls_cert=str(cert), tls_key=str(key), tls_ca=str(ca))
    a, b = nodes(2, secret_file=str(secret), tls_required=True, **tls)
    [c] = nodes(1, secret_file=str(secret), **tls)                 # offers TLS, takes plaintext too
    data = pattern(13, 3 * MiB + 5)

    async def body():
        async with open_client("tcp", [], secret=str(secret), tls_ca=str(ca)) as dc:
            await create_partition(dc, PID, [a.addr, b.addr])
            locs = await dc.write(PID, data)                         # client -> a and a -> b over TLS
            for addr in (a.addr, b.addr):
                assert b"".join([await dc.read_location(loc, replica=addr) for loc in locs]) == data
            st = await dc.admin(a.addr, Op.NODE_STATUS)
            assert st["tls"] == "required"
            assert st["connections"] and all(x["tls"] for x in st["connections"])
            st_b = await dc.admin(b.addr, Op.NODE_STATUS)
            assert any(x["role"] == "node" and x["tls"] for x in st_b["connections"])   # the leader's link
        with pytest.raises(ClientError, match="requires TLS"):
            async with open_client("tcp", [a.addr], secret=str(secret)):
                pass
        with pytest.raises(ClientError, match="certificate verify failed"):   # a node we cannot verify
            async with open_client("tcp", [a.addr], secret=str(secret), tls_ca=str(other_ca)):
                pass
        for ca_file in (None, str(ca)):                               # c: either way
            async with open_client("tcp", [], secret=str(secret), tls_ca=ca_file) as dc:
                st = await dc.admin(c.addr, Op.NODE_STATUS)
                assert st["tls"] == "offered"
                assert [x["tls"] for x in st["connections"]] == [ca_file is not None]
    run(body)
    assert "requires TLS" in wait_log(a, "requires TLS")


# -- the reconnect penalty is per host and role (a node: its identity), paid after the hello ------------------------
def test_a_client_abusers_penalty_does_not_slow_nodes_or_admins_of_its_host(nodes, secret):
    """Eight client-role peers from 127.0.0.1 never serve their payloads and are dropped: client-role connections
    from that host then wait (penalty), while a datanode's link (role node, its identity) and an admin's
    connection from the same host are served at once -- on loopback every local peer shares the host."""
    [n] = nodes(1, transport="tcp", peer_timeout=0.5, payload_timeout=0.5, secret_file=str(secret),
                penalty_max_s=30.0)

    async def setup():
        async with open_client("tcp", [], secret=str(secret)) as adm:
            await create_partition(adm, PID, [n.addr])
            return await adm.create_extent(PID)
    extent = run(setup)
    cl = auth_as(secret, Role.CLIENT)
    abusers = []
    for i in range(8):                                  # all at once: eight offences, the penalty doubles to 6.4s
        s = fuzz.connect(n.addr, timeout=5.0)
        fuzz.hello(s, auth=cl)
        fuzz.send_ctrl(s, Header(opcode=Op.WRITE, partition=PID, extent=extent, length=MiB, crc=0, epoch=1,
                                 addr=0x100000, rkey=9, rlen=MiB, req_id=i + 1).encode())
        abusers.append(s)
    for s in abusers:                                   # the node drops each after payload_timeout
        s.settimeout(10.0)
        try:
            while s.recv(1 << 16):
                pass
        except OSError:
            pass
        s.close()
    text = wait_log(n, "peer from 127.0.0.1 client dropped")
    assert "peer from 127.0.0.1 client dropped" in text

    def ping(auth, timeout):
        s = fuzz.connect(n.addr, timeout=1.0)
        try:
            fuzz.hello(s, auth=auth)
            fuzz.send_ctrl(s, Header(opcode=Op.PING, req_id=77).encode())
            return fuzz.serve_until_answer(s, b"", timeout=timeout).result
        finally:
            fuzz.end(s, "fin")
    assert ping(auth_as(secret, Role.NODE, "127.0.0.1:1"), 5.0) == Result.OK       # a node of this host
    assert ping(auth_as(secret, Role.ADMIN), 5.0) == Result.OK                      # an admin of this host
    with pytest.raises(TimeoutError):                                               # a client of this host waits
        ping(cl, 1.5)
