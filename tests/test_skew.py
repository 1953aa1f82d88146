"""Version skew: builds that speak different protocol versions in one cluster.

The pure half checks the hello's range and extensions and the choice of a connection's version.  The
process half runs two builds side by side: this tree, and a copy of it made here with the version bumped and
one new optional hello field (``zone``, as a next release would add one) -- a cluster of mixed nodes
replicates writes both ways and serves every replica's reads to both builds' clients.  A copy two versions
ahead, which no longer speaks ours, is refused in both directions with one line naming both ranges.
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import pathlib
import re
import shutil
import socket
import subprocess
import sys
import time

import pytest

from client.sdk import ClientError, DataClient
from datanode import config as config_mod
from tests.conftest import NODE_DEFAULTS, pattern, run
from tests.test_trust import secret  # noqa: F401 - the cluster secret fixture
from tools.cluster import NodeProc, free_port
from wire.protocol import (HELLO_SIZE, MIN_VERSION, SESSIONS_SINCE, VERSION, Header, Hello, Op, ProtocolError,
                           Result, Transport, decode, decode_extensions, decode_hello, negotiate, version_refusal)

REPO = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("wire", "datanode", "client", "manager", "tools")
ZONE = "rack-7"          # what the next build's new hello field says
ZONE_TAG = 250           # its extension tag: one this tree does not know


# ------------------------------------------------------------------------------------------ pure: the hello
def test_connection_uses_the_highest_version_both_speak():
    assert negotiate((5, 5), (5, 6)) == 5           # one behind, one ahead: the older one's
    assert negotiate((5, 6), (5, 6)) == 6
    assert negotiate((4, 7), (5, 6)) == 6
    assert negotiate((5, 5), (6, 7)) is None        # a too-new peer
    assert negotiate((6, 7), (5, 5)) is None        # a too-old one
    assert negotiate((MIN_VERSION, VERSION), (MIN_VERSION, VERSION)) == VERSION


def test_refusal_names_both_ranges_and_the_side_to_upgrade():
    assert version_refusal((3, 4), "this node speaks", (5, 6)) == (
        "it speaks protocol 3-4, this node speaks 5-6: no version in common (upgrade it)")
    assert version_refusal((7, 7), ours=(5, 6)) == (
        "it speaks protocol 7, we speak 5-6: no version in common (upgrade this side)")


def test_hello_carries_the_range_and_extensions():
    h = Hello(transport=Transport.TCP, has_device=False, slots=8, identity="10.0.0.1:17310",
              software="datanode 9.9")
    raw = h.encode()
    got = decode_hello(raw[:HELLO_SIZE])
    assert (got.min_version, got.version) == (MIN_VERSION, VERSION)
    tail = raw[HELLO_SIZE:]
    assert len(tail) == got.ident_len + got.ext_len
    decode_extensions(got, tail[got.ident_len:])
    assert got.software == "datanode 9.9"


def test_an_unknown_extension_is_skipped():
    """What an older build does with a field a newer one added: skips it, reads the ones it knows."""
    raw = bytearray(Hello(transport=Transport.TCP, has_device=False, slots=8, software="datanode 1").encode())
    newer = bytes((ZONE_TAG, len(ZONE))) + ZONE.encode()
    ext = newer + raw[HELLO_SIZE:] + newer            # before and after the known one
    raw = raw[:HELLO_SIZE]
    raw[11] = len(ext)                               # ext_len
    got = decode_hello(bytes(raw))
    decode_extensions(got, ext)
    assert got.software == "datanode 1"


@pytest.mark.parametrize("ext,reason", [
    (b"\x01\x05datan", None),
    (b"\x01\x09datan", "truncated"),                  # runs past the end
    (b"\x01", "truncated"),
    (b"\x01\x01a\x01\x01b", "field_range"),           # a known tag twice
    (b"\x01\x02\xff\xfe", "field_range"),             # not UTF-8
    (bytes((ZONE_TAG, 2)) + b"\xff\xfe", None),       # an unknown tag's bytes are not looked at
])
def test_malformed_extensions(ext, reason):
    h = Hello(transport=Transport.TCP, has_device=False, slots=8)
    if reason is None:
        decode_extensions(h, ext)
        return
    with pytest.raises(ProtocolError) as ei:
        decode_extensions(h, ext)
    assert ei.value.reason == reason


def test_a_hello_before_ranges_speaks_its_one_version():
    """Version 4's hello had zeros where the range's low end and the extensions' length now are."""
    raw = bytearray(Hello(transport=Transport.TCP, has_device=False, slots=8).encode())
    raw[4], raw[10], raw[11] = 4, 0, 0
    got = decode_hello(bytes(raw))
    assert (got.min_version, got.version, got.ext_len) == (4, 4, 0)
    assert negotiate((MIN_VERSION, VERSION), (got.min_version, got.version)) is None


def test_headers_carry_the_connections_version():
    h = Header(opcode=Op.READ, partition=1, extent=2, length=10, rlen=10)
    for v in range(MIN_VERSION, VERSION + 1):
        req = decode(h.encode(version=v))
        assert req.version == v
        assert decode(req.reply(Result.OK).encode(), request=False).version == v    # the answer: the same
    for v in (MIN_VERSION - 1, VERSION + 1):
        with pytest.raises(ProtocolError) as ei:
            decode(h.encode(version=v))
        assert ei.value.reason == "bad_version"


# --------------------------------------------------------------------------------- two builds side by side
def _patch(path: pathlib.Path, edits: list[tuple[str, str, int]]) -> None:
    """Apply regex substitutions, each expected ``count`` times: a patch that no longer applies fails here,
    not as a puzzling test result."""
    text = path.read_text()
    for pat, repl, count in edits:
        text, n = re.subn(pat, repl, text, flags=re.M)
        assert n == count, f"{path}: {pat!r} matched {n} times, expected {count}: update the test's patch"
    path.write_text(text)


def build(dest: pathlib.Path, version: int, min_version: int, zone: bool = False) -> pathlib.Path:
    """A copy of this tree's packages that speaks ``min_version..version``; ``zone``: with a new optional hello
    field, as a later release adds one (sent to every peer, shown per connection in node status)."""
    for pkg in PACKAGES:
        shutil.copytree(REPO / pkg, dest / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    _patch(dest / "wire/protocol.py", [(r"^VERSION = \d+", f"VERSION = {version}", 1),
                                       (r"^MIN_VERSION = \d+", f"MIN_VERSION = {min_version}", 1)])
    if zone:
        _patch(dest / "wire/protocol.py", [
            (r"^HELLO_EXTENSIONS = \{1: \"software\", ", f'HELLO_EXTENSIONS = {{{ZONE_TAG}: "zone", 1: "software", ',
             1),
            (r"^(    software: str = \"\".*)$", '\\1\n    zone: str = ""', 1)])
        _patch(dest / "wire/transport/connect.py", [
            (r"software=software\(\)", f"software=software(), zone={ZONE!r}", 2),
            (r"^(\s*)conn\.version, conn\.peer_software = version, (\w+)\.software$",
             "\\g<0>\n\\1conn.peer_zone = \\2.zone", 2)])
        _patch(dest / "wire/transport/base.py", [
            (r"^(\s*)peer_software: str = \"\".*$", '\\g<0>\n\\1peer_zone: str = ""', 1),
            (r"\"software\": self\.peer_software,", '\\g<0> "zone": self.peer_zone,', 1)])
    return dest


def _env(tree: pathlib.Path | None) -> list[str]:
    """The argv prefix that runs a Python module from ``tree`` (None: this tree) instead of the installed one."""
    return [] if tree is None else ["env", f"PYTHONPATH={tree}"]


def _start(nodes, trees: list[pathlib.Path | None], **cfg) -> list[NodeProc]:
    """One node per tree (None: this one), started together, stopped by the ``nodes`` fixture."""
    cfg = {**NODE_DEFAULTS, "transport": "tcp", **cfg}
    procs = []
    for tree in trees:
        p = NodeProc(nodes.root / f"node{len(nodes.procs) + 1}", f"127.0.0.1:{free_port()}", **cfg)
        p.argv_prefix = _env(tree)
        nodes.procs.append(p)
        procs.append(p)
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(procs)) as ex:
        for f in [ex.submit(p.start) for p in procs]:
            f.result()
    return procs


# A client of another build: writes its data (one piece per [pid, seed, size], random.Random(seed) bytes), then
# reads the given ranges, each from the given replica.  Prints {"written": [[pid, seed, [[extent, offset,
# length]...]]...], "read": [sha256...], "error": one line or null}.
CLIENT = r"""
import hashlib, json, random, sys, trio
from client.sdk import ClientError, DataClient
job = json.loads(sys.argv[1])

async def main():
    out = {"written": [], "read": [], "error": None}
    try:
        async with DataClient.open(job["discover"], secret=job["secret"], transport="tcp", timeout=10,
                                   pool_mib=8) as dc:
            for pid, seed, size in job["writes"]:
                locs = await dc.write(pid, random.Random(seed).randbytes(size))
                out["written"].append([pid, seed, [[l.extent, l.offset, l.length] for l in locs]])
            for pid, extent, offset, length, replica in job["reads"]:
                data = await dc.read(pid, extent, offset, length, replica=replica)
                out["read"].append(hashlib.sha256(data).hexdigest())
    except ClientError as e:
        out["error"] = str(e)
    print(json.dumps(out))

trio.run(main)
"""


def other_client(tree: pathlib.Path, job: dict) -> dict:
    out = subprocess.run([*_env(tree), sys.executable, "-P", "-c", CLIENT, json.dumps(job)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _ranges(written, parts: dict[int, list[str]]):
    """Every (pid, extent, offset, length, replica) to read back, with the bytes expected there."""
    for pid, seed, locs in written:
        data, at = pattern(seed, sum(length for _, _, length in locs)), 0
        for extent, offset, length in locs:
            for replica in parts[pid]:
                yield (pid, extent, offset, length, replica), data[at:at + length]
            at += length


def _status(addr: str, secret) -> dict:
    async def go():
        async with DataClient.open(secret=str(secret), transport="tcp", timeout=10, pool_mib=2) as dc:
            return await dc.admin(addr, Op.NODE_STATUS)
    return run(go)


WRITES = [(1, 11, 3 << 20), (1, 12, 100_000), (2, 13, 2 << 20), (2, 14, 5000), (3, 15, 1 << 20)]


def test_mixed_versions_replicate_and_serve_both_ways(nodes, tmp_path, secret):
    """Nodes of this build and of the next (one version ahead, with a new optional hello field) in one
    cluster: a partition led by each build replicates to followers of both; clients of both builds write to
    both partitions and read every byte back from every replica."""
    nxt = build(tmp_path / "next", VERSION + 1, VERSION, zone=True)
    cur1, next1, cur2, next2 = _start(nodes, [None, nxt, None, nxt], secret_file=str(secret))
    parts = {1: [cur1.addr, next1.addr, cur2.addr],         # led by this build, a follower of the next
             2: [next1.addr, cur2.addr, next2.addr],        # led by the next build, a follower of this one
             3: [next2.addr, next1.addr, cur1.addr]}        # the next build's nodes between themselves

    async def ours(written_by_them):
        async with DataClient.open(secret=str(secret), transport="tcp", timeout=10, pool_mib=16) as dc:
            if written_by_them is None:
                for pid, addrs in parts.items():
                    for addr in addrs:
                        await dc.admin(addr, Op.PARTITION_CREATE, partition=pid,
                                       body={"replicas": addrs, "epoch": 1})
            for pid, addrs in parts.items():
                await dc.discover(addrs[0])
            if written_by_them is not None:            # every byte the next build's client wrote, every replica
                return [(_sha(await dc.read(*where[:4], replica=where[4])), _sha(want))
                        for where, want in _ranges(written_by_them, parts)]
            written = []
            for pid, seed, size in WRITES:
                locs = await dc.write(pid, pattern(seed, size))
                written.append([pid, seed, [[loc.extent, loc.offset, loc.length] for loc in locs]])
            return written

    written_by_us = run(ours, None)
    expected = list(_ranges(written_by_us, parts))
    theirs = other_client(nxt, {"discover": [addrs[0] for addrs in parts.values()], "secret": str(secret),
                                "writes": [(pid, seed + 100, size) for pid, seed, size in WRITES],
                                "reads": [where for where, _ in expected]})
    assert theirs["error"] is None, theirs["error"]
    assert theirs["read"] == [_sha(want) for _, want in expected], "the next build read other bytes back"
    got = run(ours, theirs["written"])
    assert len(got) == len(expected) > 0
    assert all(a == b for a, b in got), "this build read other bytes back than the next build's client wrote"

    # Each connection uses the highest version both ends speak.  The next build's new field reaches a node of
    # its own build, which works without it from this build's nodes; this build skips it.
    conns = {c["identity"]: c for c in _status(next1.addr, secret)["connections"] if c["identity"]}
    assert (conns[next2.addr]["version"], conns[next2.addr]["zone"]) == (VERSION + 1, ZONE), conns
    assert (conns[cur1.addr]["version"], conns[cur1.addr]["zone"]) == (VERSION, ""), conns
    conns = {c["identity"]: c for c in _status(cur2.addr, secret)["connections"] if c["identity"]}
    assert conns[next1.addr]["version"] == VERSION and "zone" not in conns[next1.addr], conns
    assert conns[next1.addr]["software"].startswith("datanode"), conns


def _start_unreachable(nodes, tree: pathlib.Path, **cfg) -> NodeProc:
    """A node of ``tree`` that this build cannot talk to: started without asking it whether it serves (our
    client cannot); it listens, and the ``nodes`` fixture stops it."""
    p = NodeProc(nodes.root / f"node{len(nodes.procs) + 1}", f"127.0.0.1:{free_port()}",
                 **{**NODE_DEFAULTS, "transport": "tcp", **cfg})
    p.root.mkdir(parents=True)
    (p.root / "node.toml").write_text(config_mod.to_toml(config_mod.from_dict(p.cfg)))
    with open(p.log_path, "ab") as log:
        p.proc = subprocess.Popen([*_env(tree), sys.executable, "-P", "-m", "datanode.cli", "serve", "--config",
                                   str(p.root / "node.toml")], stdout=log, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, start_new_session=True)
    nodes.procs.append(p)
    host, _, port = p.addr.rpartition(":")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and p.alive():
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            return p
        except OSError:
            time.sleep(0.05)
    raise AssertionError(f"the node of {tree} did not listen: {p.log_path.read_text()[-2000:]}")


def _log_says(p: NodeProc, text: str, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in p.log_path.read_text(errors="replace"):
            return True
        time.sleep(0.05)
    return False


def test_no_common_version_is_refused_with_one_clear_line(nodes, tmp_path, secret):
    """A build two versions ahead that no longer speaks ours: either side dialing the other gets one line
    naming both ranges and whom to upgrade, and the refusing node's log says the same."""
    ours, future = (MIN_VERSION, VERSION), (VERSION + 1, VERSION + 2)
    tree = build(tmp_path / "future", future[1], future[0])
    [cur] = _start(nodes, [None], secret_file=str(secret))
    fut = _start_unreachable(nodes, tree, secret_file=str(secret))

    # this build dials the newer node (it is the too-old peer there)
    async def ask():
        async with DataClient.open(secret=str(secret), transport="tcp", timeout=10, pool_mib=2) as dc:
            with pytest.raises(ClientError) as ei:
                await dc.admin(fut.addr, Op.NODE_STATUS)
            return str(ei.value)
    said = run(ask)
    assert f"{fut.addr} refused the connection: {version_refusal(future)}" in said, said
    assert _log_says(fut, "refused: " + version_refusal(ours, "this node speaks", future)), fut.log_path.read_text()
    cli = subprocess.run([sys.executable, "-P", "-m", "tools.dnctl", "node", "status", fut.addr], text=True,
                         capture_output=True, timeout=60, env={**os.environ, "DATANODE_SECRET_FILE": str(secret)})
    assert cli.returncode == 1 and version_refusal(future) in cli.stderr, cli.stderr
    assert len(cli.stderr.strip().splitlines()) == 1 and "Traceback" not in cli.stderr, cli.stderr

    # the newer build dials this node (this node is the too-old one)
    theirs = other_client(tree, {"discover": [cur.addr], "secret": str(secret), "writes": [], "reads": []})
    assert theirs["error"] and version_refusal(ours, ours=future) in theirs["error"], theirs
    assert _log_says(cur, "refused: " + version_refusal(future, "this node speaks")), cur.log_path.read_text()


def test_a_rolling_upgrade_to_authenticated_sessions(nodes, tmp_path, secret):
    """Three nodes of the build before authenticated sessions (its protocol: no node dialed in the hello, no
    frame MACs), upgraded to this one a node at a time (stopped, started on the same data with the new build)
    while clients of both builds write and read: at every step each byte is read back from every replica, old
    and new peers meet at the older protocol, and once every node is upgraded they meet in sessions."""
    old = build(tmp_path / "old", SESSIONS_SINCE - 1, MIN_VERSION)
    procs = _start(nodes, [old, old, old], secret_file=str(secret))
    a, b, c = (p.addr for p in procs)
    parts = {1: [a, b, c], 2: [b, c, a], 3: [c, a, b]}        # each node leads one: node-to-node both ways

    async def ours(step: int, written: list, write: bool):
        """Write a piece to each partition (``write``), or read back every piece written so far from every
        replica: [(sha read, sha written)]."""
        async with DataClient.open(secret=str(secret), transport="tcp", timeout=10, pool_mib=16) as dc:
            if step == 0 and write:
                for pid, addrs in parts.items():
                    for addr in addrs:
                        await dc.admin(addr, Op.PARTITION_CREATE, partition=pid, body={"replicas": addrs, "epoch": 1})
            for addrs in parts.values():
                await dc.discover(addrs[0])
            if write:
                for pid in parts:
                    seed = 1000 + 10 * step + pid
                    locs = await dc.write(pid, pattern(seed, 300_000))
                    written.append([pid, seed, [[loc.extent, loc.offset, loc.length] for loc in locs]])
                return []
            return [(_sha(await dc.read(*where[:4], replica=where[4])), _sha(want))
                    for where, want in _ranges(written, parts)]

    written: list = []
    for step in range(len(procs) + 1):
        if step:                                          # upgrade one more node
            p = procs[step - 1]
            assert p.stop() == 0, p.log_path.read_text()[-2000:]
            p.argv_prefix = []
            p.start()
        run(ours, step, written, True)
        theirs = other_client(old, {"discover": [addrs[0] for addrs in parts.values()], "secret": str(secret),
                                    "writes": [(pid, 2000 + 10 * step + pid, 200_000) for pid in parts],
                                    "reads": []})
        assert theirs["error"] is None, f"step {step}: {theirs['error']}"
        written += theirs["written"]
        got = run(ours, step, written, False)
        assert got and all(x == y for x, y in got), f"step {step}: other bytes read back"
        if step == 1:                                     # the new node meets the old ones at their protocol
            conns = {x["identity"]: x for x in _status(a, secret)["connections"] if x["identity"]}
            for peer in (b, c):
                assert (conns[peer]["version"], conns[peer]["session"]) == (SESSIONS_SINCE - 1, False), conns
    for p in procs:                                       # all upgraded: sessions between every two nodes
        conns = {x["identity"]: x for x in _status(p.addr, secret)["connections"] if x["identity"]}
        others = [q.addr for q in procs if q is not p]
        assert all((conns[q]["version"], conns[q]["session"]) == (VERSION, True) for q in others), conns
