"""Several hosts with a real network between them: etcd, a manager, four datanodes and a dnfs mount, each in
its own network namespace, joined through tools/netns.py's router at 0.5 ms and at 5 ms round trip, with
jitter and 0.1% packet loss.  The test process (the SDK client) is a host on the same network.

At each round trip: writes through the SDK and through the mount (each fsync-ed), every byte read back from
every replica; then the partition's leader is killed and both go on writing after the manager fails it over,
nothing acknowledged is lost; the killed node comes back.  Needs root, ``ip netns`` and /dev/net/tun (skipped
with the reason otherwise), etcd and /dev/fuse.  The router's forwarding is checked first, on socket pairs.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import pathlib
import queue
import signal
import socket
import sqlite3
import struct
import subprocess
import sys
import threading
import time
import warnings
from contextlib import contextmanager

import pytest
import trio

from client.sdk import DataClient
from tests.conftest import NODE_DEFAULTS, create_partition, pattern, print_tails, run
from tests.test_etcd import ETCD_NODE, TTL, _true, _verify, _view_where, _writer, wait_for
from tools.cluster import NodeProc
from tools.etcd_cluster import EtcdProc, ManagerProc, etcd_binary
from tools.netns import VNET_HDR, Impairment, Network, frames, route, split, unavailable
from wire.auth import gen_secret
from wire.etcdmap import Etcd
from wire.protocol import Header, Op, Result

REPO = pathlib.Path(__file__).resolve().parent.parent
LOSS = 0.001
WAIT = 60.0              # a failover, re-replication or restart across the slow links, on two busy cores
HOSTS = ["etcd", "manager", "n1", "n2", "n3", "n4", "mount"]


def _skip_reason() -> str | None:
    why = unavailable()
    if why:
        return why
    try:
        etcd_binary()
    except FileNotFoundError as e:
        return str(e)
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse (the mount)"
    return None


needs_hosts = pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))


# --------------------------------------------------------------------------------------------- the router
def _packet(dst: str, body: bytes = b"", version: int = 4) -> bytes:
    """What a device hands the router: a virtio-net header, then an IP header to ``dst``."""
    ip = bytes([version << 4 | 5, 0]) + (20 + len(body)).to_bytes(2, "big") + bytes(8) + bytes([10, 0, 0, 9])
    return bytes(VNET_HDR) + ip + bytes(int(x) for x in dst.split(".")) + body


@contextmanager
def _router(hosts: dict[str, str], impair: Impairment):
    """``route`` in a thread between datagram socket pairs (one per host: the router's end, the host's)."""
    links, ends = {}, {}
    for name, ip in hosts.items():
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        mine.setblocking(False)
        theirs.settimeout(5)
        links[bytes(int(x) for x in ip.split("."))] = mine
        ends[name] = theirs
    r, w = os.pipe()
    with open(r) as control, open(w, "w") as commands:
        answers: queue.Queue = queue.Queue()
        t = threading.Thread(target=route, args=({k: v.fileno() for k, v in links.items()}, impair, control,
                                                 answers.put))
        t.start()

        def ask(line: str) -> str:
            commands.write(line + "\n")
            commands.flush()
            return answers.get(timeout=5)
        try:
            yield ends, ask
        finally:
            commands.close()
            t.join(10)
            for sock in [*links.values(), *ends.values()]:
                sock.close()


def test_router_delays_each_packet_and_keeps_a_paths_order():
    one_way, jitter = 0.010, 0.008
    with _router({"a": "10.0.0.1", "b": "10.0.0.2"}, Impairment(2000 * one_way, 1000 * jitter, seed=7)) as (ends, _):
        sent = []
        for i in range(40):
            sent.append(time.monotonic())
            ends["a"].send(_packet("10.0.0.2", i.to_bytes(4, "big")))
        got = []
        for _ in range(40):
            pkt = ends["b"].recv(65536)
            got.append((int.from_bytes(pkt[-4:], "big"), time.monotonic()))
    assert [i for i, _ in got] == list(range(40)), "jitter reordered a path's packets"
    assert all(at - sent[i] >= one_way - jitter for i, at in got), "a packet arrived before its delay"


def test_router_routes_by_destination_and_answers_commands():
    with _router({"a": "10.0.0.1", "b": "10.0.0.2"}, Impairment()) as (ends, ask):
        ends["b"].send(_packet("10.0.0.1", b"to a"))
        ends["b"].send(_packet("10.0.0.7", b"nobody"))
        ends["b"].send(_packet("10.0.0.1", b"v6", version=6))
        assert ends["a"].recv(65536).endswith(b"to a")
        assert json.loads(ask("stats")) == {"forwarded": 1, "lost": 0, "unroutable": 2, "queued": 0}
        assert ask("set 4 0.5 0.001") == "ok"
        assert ask("set 4 0.5 2").startswith("error: ")
        assert ask("jump").startswith("error: unknown command")
        ends["a"].settimeout(0.2)
        with pytest.raises(socket.timeout):
            ends["a"].recv(65536)             # neither the unroutable packet nor the v6 one came


def test_impairment_delays_within_the_jitter_and_loses_the_given_share_of_frames():
    imp = Impairment(rtt_ms=1.0, jitter_ms=0.2, loss=0.01, seed=1)
    assert all(100.0003 <= imp.due(100.0) <= 100.0007 for _ in range(1000))
    lost = [imp.losses(45) for _ in range(20_000)]                  # 900,000 frames
    assert 8100 < sum(map(len, lost)) < 9900
    assert all(0 <= i < 45 for frame in lost for i in frame) and all(frame == sorted(set(frame)) for frame in lost)
    assert Impairment(loss=0.0).losses(45) == []
    for bad in ({"rtt_ms": -1}, {"jitter_ms": -0.1}, {"loss": 1.0}):
        with pytest.raises(ValueError):
            Impairment(**bad)


def _inet_sum(data: bytes) -> int:
    data = data + b"\0" * (len(data) % 2)
    total = sum(int.from_bytes(data[i:i + 2], "big") for i in range(0, len(data), 2))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return total


def test_a_super_packet_splits_into_the_segments_a_nic_would_send():
    """What the router does to lose one frame of a super-packet: the rest must be valid TCP/IPv4 packets
    that carry exactly the same bytes."""
    payload = os.urandom(10_000)
    mss = 1448
    ip = bytearray(struct.pack(">BBHHHBBH4s4s", 0x45, 0, 20 + 32 + len(payload), 0x1234, 0x4000, 64, 6, 0,
                               bytes([10, 0, 0, 1]), bytes([10, 0, 0, 2])))
    tcp = bytearray(struct.pack(">HHIIBBHHH", 40000, 17310, 0xFFFFF000, 7, 8 << 4, 0x80 | 0x18 | 0x01, 500, 0, 0))
    tcp += bytes(12)                                                  # options: doff 8
    vnet = struct.pack("<BBHHHH", 1, 1, 52, mss, 20, 16)              # needs csum, TCPv4 GSO
    pkt = vnet + bytes(ip) + bytes(tcp) + payload
    assert frames(pkt) == 7 and frames(bytes(VNET_HDR) + bytes(ip[:20])) == 1
    parts = split(pkt)
    assert len(parts) == 7
    body = b""
    for k, part in enumerate(parts):
        assert part[:VNET_HDR] == bytes(VNET_HDR)                      # nothing left for the device to do
        h = part[VNET_HDR:]
        assert _inet_sum(h[:20]) == 0xFFFF, "IP header checksum"
        assert int.from_bytes(h[2:4], "big") == len(h) and int.from_bytes(h[4:6], "big") == 0x1234 + k
        seg = h[20:]
        assert _inet_sum(h[12:20] + struct.pack(">BBH", 0, 6, len(seg)) + seg) == 0xFFFF, "TCP checksum"
        assert int.from_bytes(seg[4:8], "big") == (0xFFFFF000 + len(body)) & 0xFFFFFFFF   # wraps
        flags = seg[13]
        assert bool(flags & 0x80) == (k == 0) and bool(flags & 0x09) == (k == 6)        # CWR first; PSH, FIN last
        body += seg[32:]
    assert body == payload
    assert split(bytes(VNET_HDR) + bytes(ip) + bytes(tcp)) == [bytes(VNET_HDR) + bytes(ip) + bytes(tcp)]


def _whole(v) -> bool:
    """Three replicas, every one of them in sync: writable, and every byte on each."""
    return v.state == "writable" and len(v.replicas) == 3 and v.installed and set(v.synced) == set(v.replicas)


class Hosts:
    """The running cluster: the network, its processes, the partition the test writes to."""

    def __init__(self, root: pathlib.Path, net: Network):
        self.root, self.net = root, net
        self.etcd: EtcdProc | None = None
        self.manager: ManagerProc | None = None
        self.nodes: dict[str, NodeProc] = {}          # address -> node
        self.mnt = root / "mnt"
        self.meta = root / "dnfs.db"
        self.secret = root / "cluster.secret"
        self.mount_pid: int | None = None

    def dnfs(self, *args, check=True, host: str | None = None):
        argv = [*(self.net.prefix(host) if host else []), sys.executable, "-P", "-m", "client.fs.cli",
                *map(str, args)]
        r = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=REPO)
        if check and r.returncode != 0:
            raise AssertionError(f"dnfs {' '.join(map(str, args))}: {r.stdout}{r.stderr}")
        return r

    def start(self) -> None:
        net = self.net
        self.etcd = EtcdProc(self.root / "etcd", host=net.addr("etcd"), client_port=2379, peer_port=2380)
        self.etcd.argv_prefix = net.prefix("etcd")
        self.etcd.start(timeout=60)
        # nodes on other hosts talk only with a secret (a node without one takes its own host's peers only)
        self.secret.write_text(gen_secret())
        self.secret.chmod(0o600)
        cfg = {**NODE_DEFAULTS, "transport": "tcp", "etcd": self.etcd.url, **ETCD_NODE,
               "secret_file": str(self.secret)}
        for h in ("n1", "n2", "n3", "n4"):
            p = NodeProc(self.root / h, f"{net.addr(h)}:17310", **cfg)
            p.argv_prefix = net.prefix(h)
            self.nodes[p.addr] = p
        with concurrent.futures.ThreadPoolExecutor(max_workers=4) as ex:
            for f in [ex.submit(p.start, 60) for p in self.nodes.values()]:
                f.result()
        addrs = list(self.nodes)

        async def create():
            async with DataClient.open(transport="tcp", timeout=30, pool_mib=4, secret=str(self.secret)) as dc:
                await create_partition(dc, 1, addrs[:3])          # the fourth node: a spare for re-replication
        run(create)
        self.manager = ManagerProc(self.root, self.etcd.url, "m1", lease_ttl_s=TTL, down_after_s=0.5, tick_s=0.2,
                                   min_writable=0, secret_file=str(self.secret))
        self.manager.argv_prefix = net.prefix("manager")
        self.manager.start()
        self.await_writable()
        self.mnt.mkdir()
        r = self.dnfs("mount", "--etcd", self.etcd.url, "--meta", f"sqlite:{self.meta}", "--partition", 1,
                      "--secret-file", self.secret, "--timeout", 30, "--json", "--log", self.root / "mount.log", self.mnt, host="mount")
        self.mount_pid = json.loads(r.stdout)["pid"]

    def await_writable(self):
        async def go():
            et = Etcd(self.etcd.url)
            return await wait_for("partition 1 writable on every replica", lambda: _view_where(et, 1, _whole),
                                  timeout=WAIT)
        return run(go)

    def dump_logs(self, lines: int = 30) -> None:
        """The end of every process's log (printed: pytest shows it with the failure)."""
        logs = [p.log_path for p in self.nodes.values()] + [self.root / "mount.log"]
        logs += [x.log_path for x in (self.manager, self.etcd) if x is not None]
        print_tails(logs, lines)

    def stop(self) -> list[str]:
        problems = []
        if self.mount_pid is not None:
            r = self.dnfs("umount", self.mnt, check=False)
            if r.returncode != 0:
                problems.append(f"umount: {r.stderr.strip()}")
                subprocess.run(["fusermount3", "-u", "-z", str(self.mnt)], capture_output=True)
        if self.manager is not None:
            self.manager.stop()
        for p in self.nodes.values():
            if p.stop(timeout=15) not in (0, None, -signal.SIGKILL):
                problems.append(f"datanode {p.addr} exited with {p.proc.returncode}")
        if self.etcd is not None:
            self.etcd.stop()
        return problems


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    root = tmp_path_factory.mktemp("multihost")
    net = Network(HOSTS, rtt_ms=0.5, jitter_ms=0.05, loss=LOSS)
    h = Hosts(root, net)
    problems = []
    try:
        h.start()
        yield h
    finally:
        try:
            problems += h.stop()
        finally:
            problems += net.close()
        for line in problems:
            warnings.warn(line)


def _mount_writer(d: pathlib.Path, stop: threading.Event, acked: list, errors: list, seed0: int) -> None:
    """Files written and fsync-ed one after another through the mount; each is acknowledged by its fsync."""
    i = 0
    while not stop.is_set():
        i += 1
        data = pattern(seed0 + i, 200_000 + i)
        path = d / f"f{seed0 + i}"
        try:
            with open(path, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            errors.append(f"{path.name}: {e}")
            time.sleep(0.1)
            continue
        acked.append((path, seed0 + i, len(data)))


def _file_slices(db: pathlib.Path, name: str) -> list[tuple]:
    """Where the mount put a file's bytes: (pid, extent, ext_off, len) in file order."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        ino = con.execute("SELECT ino FROM dentries WHERE name=?", (name.encode(),)).fetchone()[0]
        return con.execute("SELECT pid, extent, ext_off, len FROM slices WHERE ino=? ORDER BY off",
                           (ino,)).fetchall()
    finally:
        con.close()


async def _round_trip_ms(dc: DataClient, addr: str) -> float:
    best = float("inf")
    for _ in range(5):
        t = trio.current_time()
        resp, _ = await dc.request(addr, Header(opcode=Op.PING))
        assert resp.result == Result.OK, resp.result_text()
        best = min(best, trio.current_time() - t)
    return best * 1e3


@needs_hosts
@pytest.mark.parametrize("rtt_ms,jitter_ms", [(0.5, 0.05), (5.0, 0.5)], ids=["rtt0.5ms", "rtt5ms"])
def test_write_read_failover_across_hosts(hosts, rtt_ms, jitter_ms):
    hosts.net.set(rtt_ms, jitter_ms, LOSS)
    et = Etcd(hosts.etcd.url)
    mdir = hosts.mnt / f"rtt{rtt_ms}"
    mdir.mkdir()
    seed0 = int(rtt_ms * 10) * 100_000
    m_stop, m_acked, m_errors = threading.Event(), [], []
    writer = threading.Thread(target=_mount_writer, args=(mdir, m_stop, m_acked, m_errors, seed0), daemon=True)

    async def main():
        before = await _view_where(et, 1, lambda v: v.state == "writable")
        leader = hosts.nodes[before.leader]
        async with DataClient.open(etcd=hosts.etcd.url, transport="tcp", timeout=30, pool_mib=16,
                                   secret=str(hosts.secret)) as dc:
            # the links really are that slow (a floor: a loaded machine only adds to it)
            assert await _round_trip_ms(dc, leader.addr) >= 0.9 * rtt_ms
            stop, acked, errors = trio.Event(), [], []
            writer.start()
            try:
                async with trio.open_nursery() as n:
                    n.start_soon(_writer, dc, 1, stop, acked, errors)
                    await wait_for("writes before the kill", lambda: _true(len(acked) >= 5 and len(m_acked) >= 3),
                                   timeout=WAIT)
                    leader.kill(signal.SIGKILL)
                    sdk_before, mount_before = len(acked), len(m_acked)
                    new = await wait_for("a new leader", lambda: _view_where(
                        et, 1, lambda v: v.leader != leader.addr and v.installed), timeout=WAIT)
                    assert leader.addr not in new.replicas
                    await wait_for("writes after the failover", lambda: _true(
                        len(acked) >= sdk_before + 5 and len(m_acked) >= mount_before + 3), timeout=WAIT)
                    stop.set()
            finally:
                m_stop.set()
                await trio.to_thread.run_sync(writer.join)
            assert errors == [] and m_errors == [], (errors, m_errors)
            # every acknowledged byte, from every replica of the set made whole again (the spare filled by
            # repair): the SDK's writes, and the mount's (where its metadata says each file's bytes are)
            view = await wait_for("the spare filled", lambda: _view_where(et, 1, _whole), timeout=WAIT)
            await _verify(dc, acked, view.replicas)
            for path, seed, size in m_acked:
                want = pattern(seed, size)
                assert path.read_bytes() == want, f"{path} reads back other bytes through the mount"
                for addr in view.replicas:
                    got = b"".join([await dc.read(pid, extent, off, length, replica=addr)
                                    for pid, extent, off, length in _file_slices(hosts.meta, path.name)])
                    assert got == want, f"{path.name} differs on {addr}"
        return leader

    try:
        killed = run(main)
        killed.start(60)                   # back: the cluster is whole again for the next round trip
        hosts.await_writable()
    except BaseException:
        hosts.dump_logs()
        raise
    assert hosts.net.stats()["forwarded"] > 0
