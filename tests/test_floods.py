"""Floods of connections cannot lock anyone out (datanode/ops/admission.py, datanode/server.py).  Real
nodes, real sockets; the flooding peers come from addresses of their own on loopback (127.0.1.x, 127.0.2.x),
as they would from other hosts.

* 1,100 connections that never send a hello (kept open: one the node closes is opened again): an admin,
  a datanode and a client each get in and are served throughout;
* 2,000 idle connections that did send a hello: the node's memory stays bounded (the least recently active
  idle ones are closed) and a well-behaved client is served.
"""
from __future__ import annotations

import socket
import threading
import time

import trio

from lab import fuzz
from tests.conftest import create_partition, open_client, pattern, run
from tests.test_trust import auth_as, secret  # noqa: F401 - secret: the fixture (a cluster secret file)
from wire.auth import DialAuth
from wire.protocol import Header, Op, Result, Role

KiB, MiB = 1 << 10, 1 << 20
PID = 3
ROUNDS = 6


class Flood:
    """``n`` raw connections from ``sources`` (spread evenly) to ``addr``, each sending nothing (or, with
    ``hello``, its hello and then nothing); one the node closes or refuses is opened again every ``every``
    seconds, until ``stop``."""

    def __init__(self, addr: str, n: int, sources: list[str], *, hello: DialAuth | None = None, every=0.5):
        host, _, port = addr.rpartition(":")
        self.target = (host, int(port))
        self.n, self.sources, self.hello, self.every = n, sources, hello, every
        self.socks: list[socket.socket | None] = [None] * n
        self.opened = self.reopened = self.tried = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _open(self, i: int) -> socket.socket | None:
        self.tried += 1
        s = socket.socket()
        try:
            s.bind((self.sources[i % len(self.sources)], 0))
            if self.hello is not None:
                s.settimeout(5)
                s.connect(self.target)
                fuzz.hello(s, auth=self.hello)
            else:
                s.setblocking(False)
                s.connect_ex(self.target)
        except (OSError, ConnectionError, fuzz.Refused):
            s.close()
            return None
        s.setblocking(False)
        self.opened += 1
        return s

    def _run(self) -> None:
        for i in range(self.n):
            if self.stop.is_set():
                return
            self.socks[i] = self._open(i)
        while not self.stop.wait(self.every):
            for i, s in enumerate(self.socks):
                if s is not None:
                    try:
                        if s.recv(4096, socket.MSG_PEEK):
                            raise ConnectionError      # the node said something: a refusal
                        ended = True                    # b"": closed by the node
                    except BlockingIOError:
                        ended = False
                    except (OSError, ConnectionError):
                        ended = True
                    if not ended:
                        continue
                    s.close()
                self.socks[i] = self._open(i)
                self.reopened += 1

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(30)
        for s in self.socks:
            if s is not None:
                s.close()

    def live(self) -> int:
        return sum(s is not None for s in self.socks)


def _ping(addr: str, auth: DialAuth) -> Header:
    """PING on a fresh raw connection (a datanode's hello), with a patient socket (a loaded machine)."""
    s = fuzz.connect(addr, timeout=10)
    try:
        fuzz.hello(s, auth=auth)
        fuzz.send_ctrl(s, Header(opcode=Op.PING, req_id=1).encode())
        return fuzz.serve_until_answer(s, b"")
    finally:
        fuzz.end(s, "fin")


def _raise_nofile() -> None:
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 8192:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 8192), hard))


def test_connections_that_never_say_hello_lock_nobody_out(nodes, secret):
    """1,100 silent connections from 11 addresses, reopened whenever the node closes them: in each of
    ``ROUNDS`` rounds, half a second apart, an admin, a datanode (role node, a fresh connection) and a client
    each open a connection and are served; the datanode's replication link keeps working."""
    _raise_nofile()
    leader, target = nodes(2, secret_file=str(secret), heartbeat_s=0.5)
    as_node = auth_as(secret, Role.NODE, leader.addr)
    sources = [f"127.0.1.{i}" for i in range(1, 12)]
    rounds, failures, slowest = 0, [], 0.0

    async def body():
        nonlocal rounds, slowest
        async with open_client("tcp", [], secret=str(secret)) as adm:
            await create_partition(adm, PID, [leader.addr, target.addr])
        with Flood(target.addr, 1100, sources) as flood:
            with trio.fail_after(60):
                while flood.opened < 1100:
                    await trio.sleep(0.1)
            while rounds < ROUNDS:
                t0 = trio.current_time()
                try:
                    async with open_client("tcp", [], secret=str(secret)) as adm:          # an admin
                        st = await adm.admin(target.addr, Op.NODE_STATUS)
                        assert st["auth"] == "on"
                    r = await trio.to_thread.run_sync(_ping, target.addr, as_node)          # a datanode
                    assert r.result == Result.OK
                    async with open_client("tcp", [], secret=str(secret), role="client") as dc:   # a client
                        await dc.discover(leader.addr)
                        data = pattern(rounds, 64 * KiB)
                        locs = await dc.write(PID, data)                     # replicated to the target
                        back = b"".join([await dc.read_location(loc, replica=target.addr) for loc in locs])
                        assert back == data
                except Exception as e:  # noqa: BLE001 - counted, reported below
                    failures.append(f"round {rounds}: {type(e).__name__}: {e}")
                slowest = max(slowest, trio.current_time() - t0)
                rounds += 1
                await trio.sleep(0.5)
            async with open_client("tcp", [], secret=str(secret)) as adm:
                st = await adm.admin(target.addr, Op.NODE_STATUS)
            reopened = flood.reopened
        return st, reopened
    st, reopened = run(body)
    assert not failures, (failures, rounds, slowest)
    assert st["pending_connections"] <= 64 and st["refused_connections"] > 0 and reopened > 0


def test_idle_connections_that_said_hello_stay_bounded_in_memory(nodes):
    """2,000 connections that complete their hello and then say nothing (a node without a secret, as in the
    default), from 20 addresses: the node closes the least recently active idle ones beyond its limits, its
    resident memory grows by a bounded amount, and a well-behaved client's requests are all served."""
    _raise_nofile()
    [n] = nodes(1, insecure=True)
    sources = [f"127.0.2.{i}" for i in range(1, 21)]

    async def setup():
        async with open_client("tcp", []) as dc:
            await create_partition(dc, PID, [n.addr])
    run(setup)
    before = fuzz.rss_kib(n.pid)
    with Flood(n.addr, 2000, sources, hello=DialAuth(None), every=3600) as flood:
        deadline = time.monotonic() + 120
        while flood.thread.is_alive() and flood.tried < 2000 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert flood.tried == 2000
        grown_mib = (fuzz.rss_kib(n.pid) - before) / 1024

        async def client():
            served = 0
            for i in range(3):
                async with open_client("tcp", []) as dc:
                    await dc.discover(n.addr)
                    data = pattern(i, 100 * KiB)
                    locs = await dc.write(PID, data)
                    served += b"".join([await dc.read_location(loc) for loc in locs]) == data
            async with open_client("tcp", []) as dc:
                return served, await dc.admin(n.addr, Op.NODE_STATUS)
        served, st = run(client)
    assert served == 3 and flood.opened == 2000          # every one got in (and made room)
    assert st["idle_client_connections"] <= 128 + 1 and st["connections_closed_for_room"] >= 2000 - 128 - 1
    assert grown_mib < 64, f"node RSS grew {grown_mib:.0f} MiB for 2000 idle connections"
