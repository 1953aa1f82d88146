"""Authenticated sessions against real nodes over TCP: a relayed hello is refused (an admin's, and a node's
made by a real datanode), and a frame injected into or replayed within a session closes the connection.

The attacker is a relay in this process (``Relay``): it takes connections meant for one address -- a crashed
node's port taken over, a name that resolves wrongly -- and pipes their bytes to a real node, recording them
and adding its own.
"""
from __future__ import annotations

import logging
import socket
import threading

import pytest
import trio

from client.sdk import ClientError
from tests.conftest import eventually, open_client, run
from tests.test_trust import auth_as, client_key, log_of, secret  # noqa: F401 - fixtures
from wire.protocol import Header, Op, Result, Role, decode
from wire.transport.base import ConnectionClosed, TransportError
from wire.transport.connect import dial, make_domain
from wire.transport.tcp import CTRL, FRAME

PID = 7


class Relay:
    """Listens on a port of its own and pipes each connection to ``target`` (HOST:PORT), both ways, keeping
    what each side sent; ``inject`` adds bytes of its own to the latest connection's stream."""

    def __init__(self, target: str, tamper=None):
        self.tamper = tamper or {}       # "to_node" / "to_caller" -> f(first chunk) -> the chunk passed on
        self._srv = socket.create_server(("127.0.0.1", 0))
        self.addr = "127.0.0.1:%d" % self._srv.getsockname()[1]
        self.target = target
        self.pairs: list[tuple[socket.socket, socket.socket]] = []
        self.sent: dict[str, list[bytes]] = {"to_node": [], "to_caller": []}   # the latest connection's chunks
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                caller, _ = self._srv.accept()
            except OSError:
                return
            host, _, port = self.target.rpartition(":")
            node = socket.create_connection((host, int(port)))
            with self._lock:
                self.pairs.append((caller, node))
                self.sent = {"to_node": [], "to_caller": []}
                sent = self.sent
            threading.Thread(target=self._pipe, args=(caller, node, sent["to_node"], self.tamper.get("to_node")),
                             daemon=True).start()
            threading.Thread(target=self._pipe, args=(node, caller, sent["to_caller"], self.tamper.get("to_caller")),
                             daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, record: list, tamper=None) -> None:
        try:
            while data := src.recv(1 << 16):
                if tamper is not None and not record:
                    data = tamper(data)
                with self._lock:
                    record.append(data)
                    dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def inject(self, data: bytes, to: str = "to_node") -> None:
        with self._lock:
            caller, node = self.pairs[-1]
            (node if to == "to_node" else caller).sendall(data)

    def last(self, to: str = "to_node") -> bytes:
        with self._lock:
            return self.sent[to][-1]

    def close(self) -> None:
        self._srv.close()
        for pair in self.pairs:
            for s in pair:
                s.close()


@pytest.fixture
def relay():
    made = []

    def make(target: str) -> Relay:
        made.append(Relay(target))
        return made[-1]
    yield make
    for r in made:
        r.close()


@pytest.fixture
def tampering_relay():
    made = []

    def make(target: str, **tamper) -> Relay:
        made.append(Relay(target, tamper))
        return made[-1]
    yield make
    for r in made:
        r.close()


def _refusals(node) -> list[str]:
    return [line for line in log_of(node).splitlines() if "(a relayed hello, or a wrong address)" in line]


def test_an_admins_hello_relayed_to_another_node_is_refused(nodes, secret, relay):
    """An admin dials an address the attacker holds, which relays to another real node: the node refuses the
    hello (it is not the one dialed) and the admin is told which node answered; nothing is served."""
    a, b = nodes(2, secret_file=str(secret))
    r = relay(b.addr)

    async def body():
        async with open_client("tcp", [], secret=str(secret)) as dc:
            assert (await dc.admin(b.addr, Op.TRASH_LIST)) == []          # b serves an admin dialing it
            with pytest.raises(ClientError) as ei:
                await dc.admin(r.addr, Op.TRASH_LIST)
            return str(ei.value)
    said = run(body)
    assert f"it is node {b.addr}, not {r.addr}" in said, said
    eventually(lambda: any(f"it dialed {r.addr}, this node is {b.addr}" in line for line in _refusals(b)))
    assert "TRASH_LIST" not in log_of(b).split(f"it dialed {r.addr}")[-1]


def test_a_nodes_hello_relayed_to_a_leader_is_refused(nodes, secret, relay):
    """A real datanode leading a partition whose follower's address the attacker holds: the leader's node hello
    (its heartbeat) is relayed to another real node, itself a leader.  That node refuses it at the hello, each
    time, so the attacker never holds a node session there (from which it could push a view)."""
    a, b = nodes(2, secret_file=str(secret))
    r = relay(b.addr)

    async def body():
        async with open_client("tcp", [], secret=str(secret)) as dc:
            await dc.admin(b.addr, Op.PARTITION_CREATE, partition=PID + 1, body={"replicas": [b.addr], "epoch": 1})
            await dc.admin(a.addr, Op.PARTITION_CREATE, partition=PID, body={"replicas": [a.addr, r.addr],
                                                                              "epoch": 1})
    run(body)
    eventually(lambda: any(f"it dialed {r.addr}, this node is {b.addr}" in line for line in _refusals(b)),
               timeout=15, what="the relayed node hello was not refused")
    # the leader's log says why its follower cannot be reached: the node there is another one
    eventually(lambda: f"it is node {b.addr}, not {r.addr}" in log_of(a), timeout=15)
    assert not [c for c in _status_conns(b, secret) if c["identity"] == a.addr], "a's identity got a session at b"


def _status_conns(node, secret) -> list[dict]:
    async def go():
        async with open_client("tcp", [], secret=str(secret)) as dc:
            return (await dc.admin(node.addr, Op.NODE_STATUS))["connections"]
    return run(go)


async def _ping(conn, req_id: int) -> Header:
    await conn.send(Header(opcode=Op.PING, req_id=req_id).encode(version=conn.version))
    with trio.fail_after(10):
        return decode(await conn.recv(), request=False)


def _forged(h: Header) -> bytes:
    """A control frame as an attacker without the session's keys makes it (no MAC: zero tag)."""
    raw = h.encode()
    return FRAME.pack(CTRL, 0, 0, len(raw), 0, 0, 0, 0) + raw


def test_a_frame_injected_or_replayed_in_a_session_is_refused(nodes, secret, relay, caplog):
    """An attacker on the path of an admin's authenticated session (the relay passes the hello through to the
    node the admin dialed): a frame it replays or injects is refused, the connection closed, and the node
    logs why; the forged request (a partition delete) is not carried out.  A forged answer injected towards
    the caller is refused by the caller the same way."""
    [a] = nodes(1, secret_file=str(secret))
    r = relay(a.addr)
    host, _, port = r.addr.rpartition(":")
    admin = auth_as(secret, Role.ADMIN)

    async def body():
        async with open_client("tcp", [], secret=str(secret)) as dc:
            await dc.admin(a.addr, Op.PARTITION_CREATE, partition=PID, body={"replicas": [a.addr], "epoch": 1})
        domain = make_domain("tcp")

        # replayed: the admin's PING frame, sent again by the relay
        async with dial(host, int(port), domain, transport="tcp", auth=admin, server=a.addr) as conn:
            assert conn.session is not None
            assert (await _ping(conn, 1)).result == Result.OK
            frame = r.last()
            assert frame[0] == CTRL and len(frame) == FRAME.size + 88, frame
            r.inject(frame)
            with pytest.raises(TransportError), trio.fail_after(10):
                await _ping(conn, 2)                 # no second answer to the replay: the node closed us
        # injected: a partition delete the attacker forged into the admin's session
        async with dial(host, int(port), domain, transport="tcp", auth=admin, server=a.addr) as conn:
            assert (await _ping(conn, 1)).result == Result.OK
            r.inject(_forged(Header(opcode=Op.PARTITION_DELETE, partition=PID, epoch=1, req_id=99)))
            with pytest.raises(TransportError), trio.fail_after(10):
                await _ping(conn, 2)
        # towards the caller: a forged answer
        with caplog.at_level(logging.WARNING, logger="wire.transport.tcp"):
            async with dial(host, int(port), domain, transport="tcp", auth=admin, server=a.addr) as conn:
                assert (await _ping(conn, 1)).result == Result.OK
                r.inject(_forged(Header(opcode=Op.PING, req_id=2).reply(Result.OK)), to="to_caller")
                with pytest.raises(ConnectionClosed), trio.fail_after(10):
                    await conn.recv()
                assert not conn.alive
        assert any("fails the session's MAC" in rec.getMessage() for rec in caplog.records), caplog.text
        async with open_client("tcp", [], secret=str(secret)) as dc:
            return [p["id"] for p in await dc.admin(a.addr, Op.PARTITION_LIST)]
    listed = run(body)
    assert PID in listed, "the forged delete was carried out"
    eventually(lambda: log_of(a).count("fails the session's MAC") >= 2, what="the node did not log the refusals")
    assert "control message #1 fails the session's MAC" in log_of(a)       # the replay: the second message


async def _impostor(key: bytes, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """A node played by someone holding only the client role key: it answers a client's hello with the proof
    that key makes, at the newest protocol, for whatever node the caller names -- everything but the node's
    signature, which needs the node's own key."""
    from wire.auth import KeyShare, proof, session_nonce, session_transcript
    from wire.protocol import (HELLO_SIZE, MIN_VERSION, VERSION, AuthProof, AuthVerdict, Hello, NodeProof,
                               Transport, decode_extensions, decode_hello)
    from wire.transport.tcp import recv_exactly, send_all

    async def serve(stream):
        sock = stream.socket
        buf = bytearray(HELLO_SIZE)
        await recv_exactly(sock, memoryview(buf))
        hello = decode_hello(buf)
        tail = bytearray(hello.ident_len + hello.ext_len)
        await recv_exactly(sock, memoryview(tail))
        hello.identity = tail[:hello.ident_len].decode()
        decode_extensions(hello, bytes(tail[hello.ident_len:]))
        share = KeyShare()
        answer = Hello(transport=Transport.TCP, has_device=False, slots=8, auth=True, nonce=session_nonce(),
                       kx=share.public)
        text = session_transcript(hello.role, hello.nonce, answer.nonce, hello.identity, hello.server, hello.kx,
                                  share.public, (hello.min_version, hello.version), (MIN_VERSION, VERSION))
        answer.proof = proof(key, b"server", text)
        await send_all(sock, answer.encode())
        try:
            await recv_exactly(sock, memoryview(bytearray(AuthProof.SIZE)))
        except ConnectionClosed:
            return                                # the caller saw through it
        await send_all(sock, AuthVerdict.encode(0) + NodeProof.MAGIC + bytes(NodeProof.SIZE - 4))   # no key: none
        await trio.sleep_forever()

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.serve_listeners, serve, listeners)
        task_status.started(listeners[0].socket.getsockname()[1])


def test_a_client_key_holder_cannot_pass_for_a_node(client_key, tmp_path):
    """Another tenant's host holds the same client key, so it can make a node's proof with that key.  A client
    key file carries the node CA's public key: the client checks that the node it reached holds the
    certificate of the identity it dialed, and the impostor has none.  (A key file made before the field
    existed lacks it: its holder takes the impostor -- what the field buys.)"""
    from wire.auth import Credentials, DialAuth
    from wire.transport.connect import AuthError
    creds = Credentials.load(client_key)
    assert creds.node_ca, client_key.read_text()
    old = tmp_path / "old-client.key"
    old.write_text(" ".join(client_key.read_text().split()[:4]) + "\n")

    async def body():
        async with trio.open_nursery() as nursery:
            port = await nursery.start(_impostor, creds.key(Role.CLIENT))
            with pytest.raises(AuthError, match="failed to prove it is node 127.0.0.1:%d" % port):
                async with dial("127.0.0.1", port, make_domain("tcp"), transport="tcp", auth=DialAuth(creds)):
                    pass
            async with dial("127.0.0.1", port, make_domain("tcp"), transport="tcp",
                            auth=DialAuth(Credentials.load(old))) as conn:
                assert conn.session is not None
            nursery.cancel_scope.cancel()
    run(body)


def _older(hello: bytes) -> bytes:
    """A hello (the first bytes each side sends) whose newest protocol is lowered to the one before sessions."""
    from wire.protocol import HELLO_MAGIC, SESSIONS_SINCE
    assert hello[:4] == HELLO_MAGIC and hello[4] >= SESSIONS_SINCE, hello[:12]
    return hello[:4] + bytes([SESSIONS_SINCE - 1]) + hello[5:]


@pytest.mark.parametrize("side", ["to_node", "to_caller"])
def test_a_hello_lowered_to_the_protocol_before_sessions_is_refused(nodes, secret, tampering_relay, side):
    """An attacker on the path lowers the version range of the caller's hello (or of the node's answer) so that
    the two would meet at the protocol without sessions: the older hello's proofs cover the nonces, and a
    build that speaks sessions marks its nonce, so the side that gets the lowered message refuses it."""
    [a] = nodes(1, secret_file=str(secret))
    r = tampering_relay(a.addr, **{side: _older})
    host, _, port = r.addr.rpartition(":")

    async def body():
        from wire.transport.connect import AuthError
        with pytest.raises(AuthError) as ei:
            async with dial(host, int(port), make_domain("tcp"), transport="tcp", auth=auth_as(secret, Role.ADMIN),
                            server=a.addr):
                pass
        return str(ei.value)
    said = run(body)
    if side == "to_node":
        assert "altered on the way" in said, said
        eventually(lambda: "altered on the way (a downgrade)" in log_of(a))
    else:
        assert "answered at protocol" in said and "a downgrade" in said, said
