"""A flood of reconnects from the callers' own host costs them no operation: a hello the node closes before
it completes (its pre-auth budget: ``preauth_per_host``, the random early drop) is dialed again, with backoff
and jitter, within the caller's deadline (wire/rpc.py ``Links``: the SDK, dnctl, the manager and the
datanodes' links to their peers all dial there); and the node makes room in that budget by closing the
flood's silent connections before a hello that is proving itself (datanode/ops/admission.py).  Real nodes,
real sockets; the flood and the legitimate callers share 127.0.0.1, as a caller's host under attack does."""
from __future__ import annotations

import multiprocessing
import socket
import threading
import time

import pytest
import trio

from tests.conftest import create_partition, open_client, pattern, run
from tests.test_trust import auth_as, secret  # noqa: F401 - secret: the fixture (a cluster secret file)
from wire.protocol import Header, Hello, Op, Result, Role, Transport
from wire.auth import Credentials, DialAuth
from wire.rpc import Links, Redial
from wire.transport.base import TransportOptions
from wire.transport.connect import AuthError, NotAdmitted, make_domain

KiB = 1 << 10
PID = 5
FLOOD_S = 12.0           # the flood's length: it stops by itself
THREADS = 6              # reconnecting threads (about 4,000 connections a second here)
HOLD = 4                 # connections each thread keeps open: the address's pre-auth budget stays full
PER_HOST = 3             # preauth_per_host: lower than the default, so every flood connection closes another


def _flood(addr: str, seconds: float, threads: int, counter) -> None:
    """The flooding process: ``threads`` threads reconnecting to ``addr`` for ``seconds``; each keeps its
    newest ``HOLD`` connections open (the node's pre-auth budget for this address fills up), one in four
    sending a hello without credentials (refused: the node requires them), the others silent."""
    host, _, port = addr.rpartition(":")
    target = (host, int(port))
    until = time.monotonic() + seconds
    hello = Hello(transport=Transport.TCP, has_device=False, slots=8, auth=False, role=0, nonce=bytes(32),
                  identity="").encode()

    def run() -> None:
        n = 0
        held: list[socket.socket] = []
        while time.monotonic() < until:
            s = socket.socket()
            try:
                s.settimeout(1.0)
                s.connect(target)
                if n % 4 == 0:
                    s.sendall(hello)
            except OSError:
                pass
            held.append(s)
            if len(held) > HOLD:
                held.pop(0).close()
            n += 1
        for s in held:
            s.close()
        with counter.get_lock():
            counter.value += n

    ts = [threading.Thread(target=run, daemon=True) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


class ReconnectFlood:
    """``_flood`` in a process of its own (a flooding host's CPU is not its victims'), bounded in time."""

    def __init__(self, addr: str, seconds: float = FLOOD_S, threads: int = THREADS):
        ctx = multiprocessing.get_context("spawn")
        self.counter = ctx.Value("q", 0)
        self.until = time.monotonic() + seconds
        self.proc = ctx.Process(target=_flood, args=(addr, seconds, threads, self.counter), daemon=True)

    @property
    def count(self) -> int:
        return self.counter.value

    def __enter__(self):
        self.proc.start()
        return self

    def __exit__(self, *exc):
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


def test_reconnect_flood_from_the_callers_host_fails_no_operation(nodes, secret):
    """While reconnections (silent, or with a keyless hello) flood the follower from 127.0.0.1, every round's
    legitimate operations -- each on a fresh connection, as a restarted caller's -- succeed: an admin's NODE_STATUS, a datanode's PING on a link
    as peers dial them (role node), and a client's discover, write (replicated to the flooded node) and read
    back from it."""
    leader, target = nodes(2, secret_file=str(secret), heartbeat_s=0.5, preauth_per_host=PER_HOST)
    node_auth = auth_as(secret, Role.NODE, leader.addr)
    failures: list[str] = []
    ops = 0

    async def body():
        nonlocal ops
        async with open_client("tcp", [], secret=str(secret)) as adm:
            await create_partition(adm, PID, [leader.addr, target.addr])
        domain = make_domain("tcp", TransportOptions())
        with ReconnectFlood(target.addr) as flood:
            rnd = 0
            while time.monotonic() < flood.until - 1.0:
                async def op(what, fn):
                    nonlocal ops
                    ops += 1
                    try:
                        await fn()
                    except Exception as e:  # noqa: BLE001 - counted, reported below
                        failures.append(f"round {rnd} {what}: {type(e).__name__}: {e}")

                async def admin():
                    async with open_client("tcp", [], secret=str(secret)) as adm:
                        assert (await adm.admin(target.addr, Op.NODE_STATUS))["auth"] == "on"

                async def node():
                    async with trio.open_nursery() as n:
                        links = Links(n, domain, transport="tcp", slots=8, connect_timeout=10.0, auth=node_auth)
                        req = await links.get(target.addr)
                        r = await req.call(Header(opcode=Op.PING), timeout=10.0)
                        assert r.result == Result.OK
                        n.cancel_scope.cancel()

                async def client():
                    async with open_client("tcp", [], secret=str(secret), role="client") as dc:
                        await dc.discover(target.addr)
                        data = pattern(rnd, 4 * KiB)
                        locs = await dc.write(PID, data)
                        back = b"".join([await dc.read_location(loc, replica=target.addr) for loc in locs])
                        assert back == data

                await op("admin", admin)
                await op("node", node)
                await op("client", client)
                rnd += 1
        return flood.count
    flooded = run(body)
    assert flooded > 2000, f"the flood made only {flooded} connections"
    assert ops >= 9 and not failures, (len(failures), ops, failures[:5])


def test_redial_pauses_grow_with_jitter_up_to_a_cap():
    """The pauses between dials: doubling from ``Redial.FIRST`` up to ``Redial.CAP``, each between half and
    all of its step (callers turned away together do not come back together)."""
    lo, hi = Redial(rand=lambda: 0.0), Redial(rand=lambda: 0.999999)
    steps = [Redial.FIRST * 2 ** i for i in range(10)]
    for step in steps:
        a, b = lo.next(), hi.next()
        cap = min(step, Redial.CAP)
        assert a == pytest.approx(cap / 2) and b == pytest.approx(cap, rel=1e-5)
    assert lo.tries == 11


def test_a_refused_credential_is_not_dialed_again(nodes, secret):
    """Only a hello the node closed or turned away for room is dialed again: a node that does not prove our
    secret (or refuses our proof) fails the dial at once, with the reason."""
    [n] = nodes(1, secret_file=str(secret))
    forged = DialAuth(Credentials.from_secret(b"x" * 32), Role.ADMIN)

    async def body():
        domain = make_domain("tcp", TransportOptions())
        async with trio.open_nursery() as nursery:
            links = Links(nursery, domain, transport="tcp", slots=8, connect_timeout=10.0, auth=forged)
            t0 = trio.current_time()
            with pytest.raises(AuthError, match="failed to prove") as err:
                await links.get(n.addr)
            assert not isinstance(err.value, NotAdmitted)
            assert trio.current_time() - t0 < 2.0
            nursery.cancel_scope.cancel()
    run(body)
