"""Volumes: a volume key reaches its volume's partitions and nothing else.  Key derivation, names and the
scope check without sockets; then real datanodes holding a cluster secret, the SDK with volume key files, a
new replica that takes its partition's volume, and (where /dev/fuse exists) a dnfs mount with a volume key."""
from __future__ import annotations

import functools
import json
import os
import pathlib
import subprocess
import sys

import pytest

from client import admin
from client.sdk import ClientError
from datanode.ops.wrap import VOLUME_FREE, volume_refusal
from datanode.partition import PartitionTable
from wire.auth import AuthConfigError, Credentials, DialAuth, role_key, volume_key
from wire.protocol import BodyError, Op, ProtocolError, Result, Role, check_volume, decode_identity, decode_volume
from tests.conftest import REPO, pattern, run_cli, run
from tests.test_trust import secret, wait_log  # noqa: F401 - secret: the fixture (a cluster secret file)
from lab import fuzz

KiB = 1 << 10
FAST = {"heartbeat_s": 0.3, "repair_interval_s": 60.0, "repair_mib_s": 0.0, "scrub_interval_s": 0.0,
        "scrub_mib_s": 0.0}


def derive(secret: pathlib.Path, *args) -> str:
    return subprocess.run([sys.executable, "-m", "datanode.cli", "derive-key", "--secret-file", str(secret), *args],
                          capture_output=True, text=True, check=True, cwd=REPO).stdout


def key_file(tmp_path: pathlib.Path, secret: pathlib.Path, volume: str) -> pathlib.Path:
    p = tmp_path / f"{volume}.key"
    p.write_text(derive(secret, "--volume", volume))
    return p


# -- pure: keys, names, the scope check ------------------------------------------------------------------------
def test_volume_keys_are_derived_per_name_and_load_as_client_keys(tmp_path, secret):
    master = Credentials.load(secret)
    raw = secret.read_bytes().strip()
    ka = volume_key(role_key(raw, Role.ADMIN), "a")
    assert ka == volume_key(master.key(Role.ADMIN), "a") and len(ka) == 32
    assert len({ka, volume_key(master.key(Role.ADMIN), "b"), *master.keys.values()}) == 5   # none is another's
    fa = key_file(tmp_path, secret, "a")
    assert fa.read_text() == master.volume_key_file("a") and fa.read_text().startswith("datanode-volume-key v1 a ")
    ca = Credentials.load(fa)
    assert ca.volume == "a" and ca.keys == {Role.CLIENT: ka} and not ca.master
    assert DialAuth(ca).role == Role.CLIENT and DialAuth(ca).identity == "a"    # the name goes in the hello
    with pytest.raises(AuthConfigError, match="holds no key for role 'admin'"):
        DialAuth(ca, Role.ADMIN)
    # an admin key file may issue volume keys; a client or volume key may not
    admin_file = tmp_path / "admin.key"
    admin_file.write_text(master.role_key_file(Role.ADMIN))
    assert Credentials.load(admin_file).volume_key_file("a") == fa.read_text()
    client_file = tmp_path / "client.key"
    client_file.write_text(master.role_key_file(Role.CLIENT))
    for f in (client_file, fa):
        with pytest.raises(AuthConfigError, match="needs the cluster secret or an admin key"):
            Credentials.load(f).volume_key_file("b")
    with pytest.raises(AuthConfigError, match="not a volume name"):
        master.volume_key_file("a:b")
    bad = tmp_path / "bad.key"
    for text, why in ((f"datanode-volume-key v1 a/b {ka.hex()}", "not a volume name"),
                      ("datanode-volume-key v1 a zz", "not hex"), ("datanode-volume-key v1 a 00", "32 bytes"),
                      ("datanode-volume-key v2 a 00", "expected")):
        bad.write_text(text)
        with pytest.raises(AuthConfigError, match=why):
            Credentials.load(bad)
    r = subprocess.run([sys.executable, "-m", "datanode.cli", "derive-key", "--secret-file", str(secret)],
                       capture_output=True, text=True, cwd=REPO)
    assert r.returncode != 0 and "--role ROLE or --volume NAME" in r.stderr and "Traceback" not in r.stderr


def test_volume_names_and_the_hello_identity():
    for ok in ("a", "photos", "team-1.x_y", "A" * 64):
        assert check_volume(ok) == ok and decode_identity(ok.encode()) == ok
    for bad in ("", "a:1", "a/b", "a b", ".a", "-a", "A" * 65, "é", 5, None):
        with pytest.raises(BodyError):
            check_volume(bad)
    assert decode_identity(b"127.0.0.1:17310") == "127.0.0.1:17310" and decode_identity(b"") == ""
    for bad in (b"a b", b"host:", "é".encode()):
        with pytest.raises(ProtocolError):
            decode_identity(bad)
    assert decode_volume({"replicas": ["h:1"], "epoch": 1}) == "" and decode_volume({"volume": "v"}) == "v"
    with pytest.raises(BodyError):
        decode_volume({"volume": "a:b"})


def test_the_scope_check():
    # no volume key: unscoped; a volume key: its own partitions, and the node-wide ops, only
    assert volume_refusal("", Op.READ, 1, "b") == "" and volume_refusal("", Op.WRITE, 1, None) == ""
    for op in (Op.READ, Op.WRITE, Op.CREATE_EXTENT, Op.MARK_DELETE, Op.WATERMARKS, Op.PARTITION_HEALTH):
        assert volume_refusal("a", op, 1, "a") == ""
        assert "belongs to volume b" in volume_refusal("a", op, 1, "b")
        assert "belongs to no volume" in volume_refusal("a", op, 1, "")
        assert "is not on this node" in volume_refusal("a", op, 1, None)
    for op in VOLUME_FREE:
        assert volume_refusal("a", op, 0, None) == ""
    assert VOLUME_FREE == {Op.PING, Op.NODE_STATUS, Op.POOL_STATS, Op.PARTITION_LIST}


def test_a_partitions_volume_is_in_its_meta(tmp_path):
    table = PartitionTable(tmp_path, "none")
    table.create(1, ["127.0.0.1:1"], 1, volume="a")
    table.create(2, ["127.0.0.1:1"], 1)
    assert json.loads((tmp_path / "partitions" / "1" / "meta.json").read_text())["volume"] == "a"
    assert "volume" not in json.loads((tmp_path / "partitions" / "2" / "meta.json").read_text())    # as before volumes
    table.close()
    again = PartitionTable(tmp_path, "none")
    again.load()
    assert again.get(1).volume == "a" and again.get(2).volume == ""
    assert again.get(1).describe("127.0.0.1:1")["volume"] == "a"
    again.close()


# -- real nodes ----------------------------------------------------------------------------------------------
async def make(dc, pid: int, addrs: list[str], volume: str = "") -> None:
    await admin.create_partition(dc, pid, addrs, volume=volume)
    await dc.discover(addrs[0])


async def forbidden(call) -> None:
    with pytest.raises(ClientError) as ei:
        await call
    assert ei.value.result == Result.FORBIDDEN, ei.value


def test_a_volume_key_reaches_its_partitions_only(nodes, secret, tmp_path):
    a, b = nodes(2, secret_file=str(secret))
    addrs = [a.addr, b.addr]
    key_a, key_b = key_file(tmp_path, secret, "a"), key_file(tmp_path, secret, "b")
    theirs = {2: pattern(2, 300 * KiB), 3: pattern(3, 100 * KiB)}

    async def body():
        from tests.conftest import open_client
        async with open_client("tcp", [a.addr], secret=str(secret)) as adm:
            await make(adm, 1, addrs, "a")
            await make(adm, 2, addrs, "b")
            await make(adm, 3, addrs)                       # in no volume
            placed = {pid: await adm.write(pid, data) for pid, data in theirs.items()}
            listed = {p["id"]: p.get("volume") for p in await adm.admin(a.addr, Op.PARTITION_LIST)}
            assert listed == {1: "a", 2: "b", 3: None}
        async with open_client("tcp", addrs, secret=str(key_a)) as dc:
            assert dc.volume == "a" and dc.volume_partitions() == [1]
            mine = await dc.write(1, pattern(1, 200 * KiB))
            assert {loc.partition for loc in mine} == {1}
            assert await dc.read(1, mine[0].extent, 0, 200 * KiB) == pattern(1, 200 * KiB)
            for r in addrs:                                 # every replica answers it, and says who it is
                assert await dc.read(1, mine[0].extent, 0, 10, replica=r) == pattern(1, 200 * KiB)[:10]
            st = await dc.admin(a.addr, Op.NODE_STATUS)
            assert st["volumes"] == {"a": [1], "b": [2]}
            conns = st["connections"]
            for pid, locs in placed.items():                # another volume's partition, and one of none
                ext = locs[0].extent
                await forbidden(dc.read(pid, ext, 0, 10, replica=a.addr))
                await forbidden(dc.append(pid, ext, len(theirs[pid]), b"garbage"))
                await forbidden(dc.create_extent(pid))
                await forbidden(dc.delete_extent(pid, ext))
                await forbidden(dc.write(pid, b"more garbage"))
        async with open_client("tcp", [a.addr], secret=str(key_b)) as dc:
            assert dc.volume_partitions() == [2]
            await forbidden(dc.read(1, mine[0].extent, 0, 10, replica=a.addr))
            assert await dc.read(2, placed[2][0].extent, 0, 10, replica=b.addr) == theirs[2][:10]
        async with open_client("tcp", [a.addr], secret=str(secret)) as adm:   # the others' bytes, unchanged
            for pid, locs in placed.items():
                for r in addrs:
                    got = await adm.read(pid, locs[0].extent, 0, len(theirs[pid]), replica=r)
                    assert got == theirs[pid]
                    marks = await adm.watermarks(pid, r)
                    assert marks == {locs[0].extent: len(theirs[pid])}, marks
        return conns
    conns = run(body)
    assert any(c.get("volume") == "a" and c.get("role") == "client" for c in conns), conns
    text = wait_log(a, "on partition 2", "on partition 3")
    assert "volume a's key may not send READ on partition 2: it belongs to volume b" in text
    assert "volume a's key may not send CREATE_EXTENT on partition 3: it belongs to no volume" in text


def test_a_volume_key_cannot_claim_another_volume(nodes, secret, tmp_path):
    [n] = nodes(1, secret_file=str(secret))
    key_a = key_file(tmp_path, secret, "a")
    forged = tmp_path / "forged.key"                    # a's key under b's name
    forged.write_text(key_a.read_text().replace(" a ", " b "))
    assert Credentials.load(forged).volume == "b"

    async def body():
        from tests.conftest import open_client
        # the node proves itself with b's key, which the forger's client cannot check: it gives up first
        with pytest.raises(ClientError, match="failed to prove") as ei:
            async with open_client("tcp", [n.addr], secret=str(forged)):
                pass
        assert ei.value.auth
        async with open_client("tcp", [n.addr], secret=str(key_a)) as dc:     # the real one gets in
            await dc.admin(n.addr, Op.PING)
    run(body)
    # a raw peer that sends its proof anyway (a's key over a transcript naming b) is refused by the node
    s = fuzz.connect(n.addr, timeout=5)
    with pytest.raises(fuzz.Refused, match="bad proof"):
        fuzz.hello(s, auth=DialAuth(Credentials.load(forged)))
    fuzz.end(s, "fin")
    assert "bad proof for role client" in wait_log(n, "bad proof for role client")


def test_a_new_replica_takes_the_volume_and_enforces_it(nodes, secret, tmp_path):
    a, b, c = nodes(3, secret_file=str(secret), **FAST)
    key_a, key_b = key_file(tmp_path, secret, "a"), key_file(tmp_path, secret, "b")

    async def body():
        from tests.conftest import open_client
        async with open_client("tcp", [a.addr], secret=str(secret)) as adm:
            await make(adm, 1, [a.addr, b.addr], "a")
        async with open_client("tcp", [a.addr], secret=str(key_a)) as dc:
            locs = await dc.write(1, pattern(7, 500 * KiB))
        async with open_client("tcp", [a.addr], secret=str(secret)) as adm:
            # the body of PARTITION_CREATE it sends names no volume: the new copy asks the others
            res = await admin.add_replica(adm, 1, c.addr, [a.addr], timeout=60)
            assert c.addr in res["new"]["replicas"], res
            view = await admin.node_view(adm, c.addr, 1)
            assert view.volume == "a"
        async with open_client("tcp", [c.addr], secret=str(key_a)) as dc:
            assert await dc.read(1, locs[0].extent, 0, 500 * KiB, replica=c.addr) == pattern(7, 500 * KiB)
        async with open_client("tcp", [c.addr], secret=str(key_b)) as dc:
            await forbidden(dc.read(1, locs[0].extent, 0, 10, replica=c.addr))
    run(body)
    meta = json.loads((pathlib.Path(c.cfg["data_dir"]) / "partitions" / "1" / "meta.json").read_text())
    assert meta["volume"] == "a" and meta["epoch"] == 2


# -- dnfs and dnctl with a volume key -------------------------------------------------------------------------
ENV = {k: v for k, v in os.environ.items() if k not in ("DATANODE_SECRET_FILE", "DATANODE_TLS_CA")}
ENV["PYTHONPATH"] = str(REPO)


cli = functools.partial(run_cli, check=True, env=ENV)


@pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="no /dev/fuse")
def test_dnfs_and_dnctl_with_a_volume_key_write_to_its_partitions(tmp_path):
    root = tmp_path / "c"
    cli("tools.dnctl", "cluster", "up", "--nodes", 1, "--cluster", root)
    try:
        made = json.loads(cli("tools.dnctl", "partition", "create", "--count", 2, "--replicas", 1,
                              "--volume", "photos", "--cluster", root, "--json").stdout)
        vol = sorted(p["id"] for p in made["partitions"])
        assert made["volume"] == "photos" and len(vol) == 2
        key = tmp_path / "photos.key"
        out = json.loads(cli("tools.dnctl", "volume", "key", "photos", "--cluster", root, "--out", key,
                             "--json").stdout)
        assert out["out"] == str(key) and key.stat().st_mode & 0o777 == 0o600
        listed = json.loads(cli("tools.dnctl", "volume", "list", "--cluster", root, "--json").stdout)
        assert listed["volumes"] == {"photos": vol} and 1 in listed["no_volume"]
        addr = json.loads((root / "cluster.json").read_text())["nodes"][0]["addr"]

        def extents() -> dict[int, int]:
            parts = json.loads(cli("tools.dnctl", "--secret-file", root / "cluster.secret", "partition", "list",
                                   addr, "--json").stdout)
            return {p["id"]: p["extents"] for p in parts}
        before = extents()
        mnt = tmp_path / "mnt"
        mnt.mkdir()
        cli("client.fs.cli", "mount", "--cluster", root, "--secret-file", key, mnt, "--json")
        try:
            for i in range(6):
                (mnt / f"f{i}").write_bytes(pattern(i, (i + 1) * 200 * KiB))
            assert (mnt / "f3").read_bytes() == pattern(3, 800 * KiB)
        finally:
            cli("client.fs.cli", "umount", mnt)
        after = extents()
        grew = {p for p in after if after[p] > before.get(p, 0)}
        assert grew and grew <= set(vol), (before, after)
        assert after[1] == before[1]                    # the partition of no volume got nothing
        # dnctl put / get with the key: its volume's partitions, FORBIDDEN elsewhere in one line
        src = tmp_path / "blob"
        src.write_bytes(pattern(9, 100 * KiB))
        put = json.loads(cli("tools.dnctl", "--secret-file", key, "put", "--cluster", root, src, "--json").stdout)
        assert set(put["partitions"]) <= set(vol)
        loc = put["locations"][0]
        got = tmp_path / "got"
        cli("tools.dnctl", "--secret-file", key, "get", "--cluster", root, "--partition", loc["partition"],
            "--extent", loc["extent"], "--out", got)
        assert got.read_bytes() == pattern(9, 100 * KiB)
        r = cli("tools.dnctl", "--secret-file", key, "put", "--cluster", root, "--partition", 1, src, check=False)
        assert r.returncode == 1 and "forbidden" in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    finally:
        cli("tools.dnctl", "cluster", "down", "--cluster", root, "--timeout", 10, check=False)
