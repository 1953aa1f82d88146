"""Several hosts on one machine, with a network's latency between them (for tests and benchmarks; root only).

Each host is a network namespace (``ip netns``) with one interface, ``eth0``, on a private /24.  The
interfaces are TUN devices whose other ends are held by one *router* process (``python -m tools.netns
router``, started by ``Network``), which forwards each packet from one host to another after a one-way
delay of half the round trip, with jitter and random loss: what ``tc netem`` does on a link, without the
kernel's sch_netem, which some kernels are built without (VMs' minimal ones among them).  Jitter never
reorders a path's packets; the router runs at real-time priority so that it is not late for a packet behind
the processes it carries them for.  The devices offload segmentation (as a veth does), so a TCP stream crosses the router in
super-packets of up to 64 KiB on a 1500-byte MTU; loss is per 1500-byte frame, as on a wire: a super-packet
that loses some is cut into its segments and only those are dropped.

The calling process's own namespace is a host too (``Network.LOCAL``, unless ``local=False``): a test or a
benchmark reaches every host through the router, with the same delay as between them.  A command runs on a
host under ``Network.prefix(host)`` (``nsenter --net``: only the network is the host's own, so a FUSE mount
made there is visible to the caller).  ``close`` (or leaving ``with``) ends every process still in a
namespace, deletes the namespaces and stops the router, whose devices go with it; if the caller dies
instead, the router sees its stdin close and exits, taking every link down.
"""
from __future__ import annotations

import array
import ctypes
import fcntl
import heapq
import json
import math
import os
import random
import select
import shutil
import signal
import struct
import subprocess
import sys
import time

NETNS_DIR = "/run/netns"
VNET_HDR = 10                     # struct virtio_net_hdr, before each packet on a device with IFF_VNET_HDR
_TUNSETIFF, _TUNSETOFFLOAD = 0x400454CA, 0x400454D0
_IFF_TUN, _IFF_NO_PI, _IFF_VNET_HDR = 0x0001, 0x1000, 0x4000
_TUN_F_CSUM, _TUN_F_TSO4, _TUN_F_TSO6, _TUN_F_TSO_ECN = 0x01, 0x02, 0x04, 0x08
_PR_SET_TIMERSLACK = 29
_VNET = struct.Struct("<BBHHHH")  # flags, gso_type, hdr_len, gso_size, csum_start, csum_offset (little-endian)
_GSO_TCPV4 = 1
_FIN, _PSH, _CWR = 0x01, 0x08, 0x80


class NetnsUnavailable(RuntimeError):
    """This machine (or user) cannot make namespaces or TUN devices; the message says what failed."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip() or out.returncode}")
    return out


def unavailable() -> str | None:
    """Why ``Network`` cannot run here (a line for a skip), or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, TUN devices)"
    for tool in ("ip", "nsenter"):
        if shutil.which(tool) is None:
            return f"no {tool} command (Debian: iproute2, util-linux)"
    if not os.path.exists("/dev/net/tun"):
        return "no /dev/net/tun"
    probe = f"dnprobe{os.getpid()}"
    out = _ip("netns", "add", probe, check=False)
    if out.returncode != 0:
        return f"ip netns is not permitted here: {out.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


# -- the router (its own process: python -m tools.netns router) -----------------------------------------------
def open_tun(name: str) -> int:
    """A TUN device ``name`` with segmentation offload, its file descriptor non-blocking."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    try:
        fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH22x", name.encode(), _IFF_TUN | _IFF_NO_PI | _IFF_VNET_HDR))
        fcntl.ioctl(fd, _TUNSETOFFLOAD, _TUN_F_CSUM | _TUN_F_TSO4 | _TUN_F_TSO6 | _TUN_F_TSO_ECN)
    except OSError:
        os.close(fd)
        raise
    return fd


class Impairment:
    """What each packet meets on its way: a one-way delay, uniform jitter around it, and a loss probability
    for each frame (a 1500-byte packet on the wire: a super-packet is several)."""

    def __init__(self, rtt_ms: float = 0.0, jitter_ms: float = 0.0, loss: float = 0.0, seed: int | None = None):
        if rtt_ms < 0 or jitter_ms < 0 or not 0 <= loss < 1:
            raise ValueError(f"rtt {rtt_ms} ms, jitter {jitter_ms} ms, loss {loss}: want rtt, jitter >= 0, "
                             f"0 <= loss < 1")
        self.one_way, self.jitter, self.loss = rtt_ms / 2000, jitter_ms / 1000, loss
        self._log_kept = math.log1p(-loss)
        self.rng = random.Random(seed)

    def due(self, now: float) -> float:
        """When a packet sent ``now`` arrives."""
        jitter = self.rng.uniform(-self.jitter, self.jitter) if self.jitter else 0.0
        return now + max(0.0, self.one_way + jitter)

    def losses(self, frames: int) -> list[int]:
        """Which of a packet's ``frames`` are lost, each with probability ``loss`` (mostly none: one draw)."""
        if not self.loss:
            return []
        lost, i = [], -1
        while True:           # the gap to the next lost frame is geometric
            i += 1 + int(math.log(1.0 - self.rng.random()) / self._log_kept)
            if i >= frames:
                return lost
            lost.append(i)


def frames(pkt: bytes) -> int:
    """How many wire frames a packet from a device stands for: a TCP/IPv4 super-packet one per segment."""
    _flags, gso_type, hdr_len, gso_size, _start, _off = _VNET.unpack_from(pkt)
    if gso_type & 0x7F != _GSO_TCPV4 or not gso_size:
        return 1
    return max(1, -(-(len(pkt) - VNET_HDR - hdr_len) // gso_size))


def split(pkt: bytes) -> list[bytes]:
    """A TCP/IPv4 super-packet cut into the segments a NIC would have sent, with full checksums and no
    offload left to do (any other packet: itself), so one of them can be lost alone."""
    _flags, gso_type, _hdr_len, mss, _start, _off = _VNET.unpack_from(pkt)
    if gso_type & 0x7F != _GSO_TCPV4 or not mss:
        return [pkt]
    ip = memoryview(pkt)[VNET_HDR:]
    ihl = (ip[0] & 0x0F) * 4
    hl = ihl + (ip[ihl + 12] >> 4) * 4
    ident, = struct.unpack_from(">H", ip, 4)
    seq, = struct.unpack_from(">I", ip, ihl + 4)
    tcp_flags, payload = ip[ihl + 13], ip[hl:]
    out = []
    for k, at in enumerate(range(0, len(payload), mss)):
        body = payload[at:at + mss]
        iph, tcph = bytearray(ip[:ihl]), bytearray(ip[ihl:hl])
        struct.pack_into(">HH", iph, 2, hl + len(body), (ident + k) & 0xFFFF)
        iph[10:12] = b"\0\0"
        iph[10:12] = _checksum(iph)
        struct.pack_into(">I", tcph, 4, (seq + at) & 0xFFFFFFFF)
        flags = tcp_flags if at + mss >= len(payload) else tcp_flags & ~(_FIN | _PSH)   # FIN, PSH: the last one
        tcph[13] = flags & ~_CWR if k else flags                                       # CWR: the first one
        tcph[16:18] = b"\0\0"
        pseudo = bytes(ip[12:20]) + struct.pack(">BBH", 0, 6, len(tcph) + len(body))
        tcph[16:18] = _checksum(pseudo + tcph + body)
        out.append(bytes(VNET_HDR) + iph + tcph + body)
    return out


def _checksum(data) -> bytes:
    """The Internet checksum of ``data``, as the two bytes to store (RFC 1071: summing little-endian words
    gives the byte-swapped sum, which stored little-endian is the right bytes)."""
    data = bytes(data)
    if len(data) % 2:
        data += b"\0"
    total = sum(array.array("H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return struct.pack("<H", ~total & 0xFFFF)


def route(links: dict[bytes, int], impair: Impairment, control, answer) -> None:
    """Forward packets between the devices of ``links`` (IPv4 address -> device fd) until ``control`` (a
    text stream of commands: "set RTT_MS JITTER_MS LOSS", "stats") reaches its end; ``answer(line)`` replies
    to each command."""
    fds = list(links.values())
    heap: list = []               # (due, seq, fd, packet)
    last: dict = {}               # (from, to) -> due of that path's latest packet: jitter does not reorder
    seq = 0
    counts = {"forwarded": 0, "lost": 0, "unroutable": 0}
    ctl = control.fileno()
    while True:
        timeout = max(0.0, heap[0][0] - time.monotonic()) if heap else None
        ready, _, _ = select.select([*fds, ctl], [], [], timeout)     # select: microseconds, not poll's ms
        now = time.monotonic()
        for fd in ready:             # the links first: a command applies to what comes after it
            if fd == ctl:
                line = control.readline()
                if not line:
                    return
                words = line.split()
                if words[:1] == ["set"] and len(words) == 4:
                    try:
                        impair = Impairment(float(words[1]), float(words[2]), float(words[3]))
                        reply = "ok"
                    except ValueError as e:
                        reply = f"error: {e}"
                elif words == ["stats"]:
                    reply = json.dumps({**counts, "queued": len(heap)})
                else:
                    reply = f"error: unknown command {line.strip()!r} (set RTT_MS JITTER_MS LOSS | stats)"
                answer(reply)
                continue
            for _ in range(64):              # what the device holds now, a bounded batch
                try:
                    pkt = os.read(fd, 65536 + VNET_HDR)
                except BlockingIOError:
                    break
                except OSError:              # the device went away (its namespace was deleted)
                    break
                to = links.get(pkt[VNET_HDR + 16:VNET_HDR + 20]) if len(pkt) > VNET_HDR + 20 and \
                    pkt[VNET_HDR] >> 4 == 4 else None
                if to is None:               # IPv6 chatter, or no such host
                    counts["unroutable"] += 1
                    continue
                lost = impair.losses(frames(pkt))
                if lost:                     # only those frames: the rest of a super-packet goes on
                    counts["lost"] += len(lost)
                    parts = [part for i, part in enumerate(split(pkt)) if i not in lost]
                else:
                    parts = [pkt]
                if not parts:
                    continue
                due = max(impair.due(now), last.get((fd, to), 0.0))
                last[(fd, to)] = due
                for part in parts:
                    seq += 1
                    heapq.heappush(heap, (due, seq, to, part))
        now = time.monotonic()
        while heap and heap[0][0] <= now:
            _, _, to, pkt = heapq.heappop(heap)
            try:
                os.write(to, pkt)
                counts["forwarded"] += 1
            except OSError:                  # the receiving device is down or gone: the packet is lost
                counts["lost"] += 1


def router_main(argv: list[str]) -> int:
    """``router RTT_MS JITTER_MS LOSS NAME=IPV4...``: open the devices, say "ready", forward until stdin ends."""
    rtt, jitter, loss, *pairs = argv
    if sys.byteorder != "little":
        sys.exit("tools.netns router: the TUN offload header is read little-endian; this machine is not")
    links = {}
    for pair in pairs:
        name, _, ip = pair.partition("=")
        links[bytes(int(x) for x in ip.split("."))] = open_tun(name)
    signal.signal(signal.SIGINT, signal.SIG_IGN)       # a ^C in the caller's terminal: the caller cleans up
    try:                     # wake when a packet is due, not up to 50 us later (the default timer slack)
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_TIMERSLACK, 1000, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    try:                     # the wire does not queue behind the processes it carries packets for (it sleeps
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))      # in select between packets)
    except (OSError, AttributeError):
        pass
    print("ready", flush=True)
    route(links, Impairment(float(rtt), float(jitter), float(loss)), sys.stdin,
          lambda line: print(line, flush=True))
    return 0


# -- the network -------------------------------------------------------------------------------------------------
def _free_subnet() -> str:
    """A 10.x.y (/24) that no interface or route of this namespace uses (tests of other checkouts may run)."""
    used = _ip("-4", "-o", "addr", "show").stdout + _ip("-4", "route", "show", "table", "all").stdout
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(1000):
        net = f"10.{rng.randrange(160, 250)}.{rng.randrange(0, 256)}"
        if f"{net}." not in used:
            return net
    raise RuntimeError("no free 10.x.y.0/24 for the test network")


class Network:
    """Hosts in namespaces joined by the router (module docstring).  ``with Network(["etcd", "n1"], rtt_ms=0.5)
    as net: subprocess.Popen([*net.prefix("n1"), ...])``; ``net.addr("n1")`` is the host's IPv4 address."""

    LOCAL = "local"

    def __init__(self, hosts: list[str], rtt_ms: float = 0.0, jitter_ms: float = 0.0, loss: float = 0.0, *,
                 local: bool = True):
        Impairment(rtt_ms, jitter_ms, loss)          # validate before making anything
        if len(set(hosts)) != len(hosts) or self.LOCAL in hosts or len(hosts) > 200:
            raise ValueError(f"hosts must be distinct, at most 200, none called {self.LOCAL!r}: {hosts}")
        why = unavailable()
        if why:
            raise NetnsUnavailable(why)
        tag = f"{os.getpid() % 100000}{random.randrange(100):02d}"
        self.hosts = list(hosts) + ([self.LOCAL] if local else [])
        self.subnet = _free_subnet()
        self.ns = {h: f"dn{tag}-{h}" for h in hosts}
        self.dev = {h: f"dn{tag}t{i}" for i, h in enumerate(self.hosts)}
        self.ips = {h: f"{self.subnet}.{i + 1}" for i, h in enumerate(hosts)}
        if local:
            self.ips[self.LOCAL] = f"{self.subnet}.254"
        self.router: subprocess.Popen | None = None
        self._made: list[str] = []
        try:
            self._build(rtt_ms, jitter_ms, loss)
        except BaseException:
            self.close()
            raise

    def _build(self, rtt_ms: float, jitter_ms: float, loss: float) -> None:
        self.router = subprocess.Popen(
            [sys.executable, "-P", "-m", "tools.netns", "router", str(rtt_ms), str(jitter_ms), str(loss),
             *(f"{self.dev[h]}={self.ips[h]}" for h in self.hosts)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        ready = self.router.stdout.readline().strip()
        if ready != "ready":
            self.router.wait(timeout=10)
            raise NetnsUnavailable(f"the router did not start: {self.router.stderr.read().strip()[-500:]}")
        for h, ns in self.ns.items():
            _ip("netns", "add", ns)
            self._made.append(ns)
            _ip("link", "set", "dev", self.dev[h], "netns", ns)
            _ip("-n", ns, "link", "set", "dev", self.dev[h], "name", "eth0")
            _ip("-n", ns, "addr", "add", f"{self.ips[h]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "dev", "eth0", "txqueuelen", "4096", "up")    # a NIC's ring, not 500
            _ip("-n", ns, "link", "set", "dev", "lo", "up")
        if self.LOCAL in self.ips:
            _ip("addr", "add", f"{self.ips[self.LOCAL]}/24", "dev", self.dev[self.LOCAL])
            _ip("link", "set", "dev", self.dev[self.LOCAL], "txqueuelen", "4096", "up")

    def addr(self, host: str) -> str:
        return self.ips[host]

    def prefix(self, host: str) -> list[str]:
        """The argv prefix that runs a command on ``host`` (nothing for ``LOCAL``)."""
        if host == self.LOCAL:
            return []
        return ["nsenter", f"--net={NETNS_DIR}/{self.ns[host]}", "--"]

    def _ask(self, line: str) -> str:
        if self.router is None or self.router.poll() is not None:
            raise RuntimeError("the router is not running")
        self.router.stdin.write(line + "\n")
        self.router.stdin.flush()
        return self.router.stdout.readline().strip()

    def set(self, rtt_ms: float, jitter_ms: float = 0.0, loss: float = 0.0) -> None:
        """Change every link's round trip, jitter and loss (packets already on their way keep theirs)."""
        Impairment(rtt_ms, jitter_ms, loss)
        reply = self._ask(f"set {rtt_ms} {jitter_ms} {loss}")
        if reply != "ok":
            raise RuntimeError(f"router: {reply}")

    def stats(self) -> dict:
        """Packets forwarded, lost (the loss probability, or a host gone) and unroutable, since the start."""
        return json.loads(self._ask("stats"))

    def pids(self, host: str) -> list[int]:
        """The processes running on ``host`` now."""
        out = _ip("netns", "pids", self.ns[host], check=False)
        return [int(p) for p in out.stdout.split()] if out.returncode == 0 else []

    def close(self) -> list[str]:
        """End every process still on a host (SIGTERM, then SIGKILL after 10 s), delete the namespaces, stop
        the router.  Returns what had to be killed (for a warning)."""
        killed = []
        live = {pid: h for h in self.ns if self.ns[h] in self._made for pid in self.pids(h)}
        for pid in live:
            _signal(pid, signal.SIGCONT)
            _signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for pid, h in live.items():
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if _alive(pid):
                _signal(pid, signal.SIGKILL)
                killed.append(f"pid {pid} on {h} did not stop within 10 s of SIGTERM: killed")
        if self.router is not None and self.router.poll() is None:
            self.router.stdin.close()                 # its end of input: it exits, its devices go with it
            try:
                self.router.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.router.kill()
                self.router.wait()
        for ns in self._made:
            _ip("netns", "del", ns, check=False)
        self._made = []
        return killed

    def __enter__(self) -> "Network":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


if __name__ == "__main__":
    if sys.argv[1:2] == ["router"] and len(sys.argv) >= 6:
        sys.exit(router_main(sys.argv[2:]))
    sys.exit("usage: python -m tools.netns router RTT_MS JITTER_MS LOSS NAME=IPV4... (started by tools.netns.Network)")
