"""etcd behind its own lock, and nothing in the map trusted blindly: real etcd, real datanodes, a real manager.

The attacker can write to etcd -- it is given etcd's root user, so etcd's authentication is not what stops it
-- but lacks the cluster secret.  Each attack must move nothing: every acknowledged byte reads back from every
replica, the manager and the nodes stay up and serving, and the value is counted as invalid where it was
read (a node's /metrics, the manager's /metrics, the SDK's ``dc.metrics``).  The same checks hold without a
secret for what a MAC cannot cover there: malformed values, epochs out of range, replicas nobody registered.
Also: ``dnctl cluster up`` turns etcd's authentication on, with a role per component limited to its keys;
client TLS to etcd end to end; a token that expires is renewed.
"""
from __future__ import annotations

import concurrent.futures
import functools
import json
import os
import pathlib
import re
import shutil
import socket
import stat
import subprocess
import threading
import urllib.request

import pytest
import trio

from client.sdk import DataClient
from tests.conftest import NODE_DEFAULTS, create_partition, pattern, run
from tests.conftest import dnctl as conftest_dnctl
from tests.conftest import run_cli
from tests.test_etcd import _verify, wait_for
from tools.cluster import NodeProc, free_port, local_access
from tools.etcd_cluster import EtcdProc, ManagerProc, ServerTls, etcd_binary, setup_auth
from wire.auth import gen_secret
from wire.etcdmap import Etcd, EtcdAccess, EtcdError
from wire.protocol import Op

try:
    etcd_binary()
except FileNotFoundError as e:
    pytestmark = pytest.mark.skip(reason=str(e))

TTL = 2
NODE_CFG = {**NODE_DEFAULTS, "transport": "tcp", "lease_ttl_s": TTL, "heartbeat_s": 0.5}
BLOB = 96 << 10


def metric(addr: str, name: str) -> float:
    """The sum of a counter's series on ``addr``'s /metrics (0: none yet)."""
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


class Cluster:
    """etcd, three datanodes (each with /metrics), one manager (with /metrics), partition 1 on all nodes."""

    def __init__(self, root: pathlib.Path, secure: bool):
        self.root, self.secure = root, secure
        self.etcd = EtcdProc(root / "etcd").start()
        self.auth = setup_auth(self.etcd.url, root / "etcd-auth") if secure else {}
        self.secret = None
        if secure:
            self.secret = root / "cluster.secret"
            self.secret.write_text(gen_secret())
            self.secret.chmod(0o600)
        extra = {"secret_file": str(self.secret), "etcd_credentials": self.auth["datanode"]} if secure else {}
        self.nodes = [NodeProc(root / f"node{i}", f"127.0.0.1:{free_port()}", etcd=self.etcd.url,
                               metrics_listen=f"127.0.0.1:{free_port()}", **NODE_CFG, **extra) for i in range(3)]
        with concurrent.futures.ThreadPoolExecutor(3) as ex:
            list(ex.map(lambda n: n.start(), self.nodes))
        self.manager_metrics = f"127.0.0.1:{free_port()}"
        mopts = {"secret_file": str(self.secret), "etcd_credentials": self.auth["manager"]} if secure else {}
        self.manager = ManagerProc(root, self.etcd.url, "m1", lease_ttl_s=TTL, down_after_s=0.5, tick_s=0.2,
                                   min_writable=0, metrics_listen=self.manager_metrics, **mopts).start()
        # what the manager's side sees (the admin user: reads the whole map, checks MACs) ...
        self.admin = Etcd(self.etcd.url, access=self.access("admin"), admin_key=self.admin_key())
        # ... and what the attacker has: etcd's root user, no secret
        self.attacker = Etcd(self.etcd.url, access=self.access("root"))
        self.addrs = [n.addr for n in self.nodes]

        async def setup():
            async with self.client(etcd=False) as dc:
                await create_partition(dc, 1, self.addrs)
            await wait_for("partition 1 adopted and writable", self.writable)
        run(setup)

    def access(self, who: str) -> EtcdAccess | None:
        return EtcdAccess.load(self.auth[who]) if self.secure else None

    def admin_key(self, secure: bool | None = None):
        from wire.auth import Credentials
        from wire.protocol import Role
        return Credentials.load(self.secret).key(Role.ADMIN) if (self.secure if secure is None else secure) else None

    def client(self, etcd: bool = True, **kw):
        kw.setdefault("timeout", 10)
        return DataClient.open([] if etcd else self.addrs, transport="tcp", pool_mib=16,
                               secret=str(self.secret) if self.secret else None,
                               etcd=self.etcd.url if etcd else None, etcd_access=self.access("mount"), **kw)

    async def writable(self):
        v = await self.admin.part(1)
        return v if v is not None and v.state == "writable" and v.installed else None

    def invalid(self) -> list[float]:
        """Values ignored so far: each node's, then the manager's."""
        return ([metric(n.cfg["metrics_listen"], "datanode_etcd_invalid_values_total") for n in self.nodes]
                + [metric(self.manager_metrics, "dnmanager_etcd_invalid_values_total")])

    async def attack(self, body) -> object:
        """The attacker puts ``body`` to partition 1's key; returns once every node and the manager ignored it
        and the manager wrote the last valid view back (that view)."""
        before = self.invalid()
        await _put_raw(self.attacker, self.admin.part_key(1), body)
        await self.seen_by_all(before)
        return await wait_for("the valid view written back", self.writable)

    async def seen_by_all(self, before: list[float]) -> None:
        """Every node and the manager counted one more ignored value than ``before``."""
        await wait_for("every node and the manager to count the value as invalid",
                       lambda: _true(all(a > b for a, b in zip(self.invalid(), before))), timeout=20)

    async def unmoved(self, dc, epoch: int, acked: list) -> None:
        """Partition 1 still has its replicas at ``epoch`` on every node, each with every acknowledged byte, and
        takes writes."""
        for addr in self.addrs:
            rows = [p for p in await dc.admin(addr, Op.PARTITION_LIST) if p["id"] == 1]
            assert rows and rows[0]["epoch"] == epoch and rows[0]["replicas"] == self.addrs, (addr, rows)
        await _verify(dc, acked, self.addrs)
        data = pattern(99, BLOB)
        locs = await dc.write(1, data)
        await _verify(dc, [(99, BLOB, locs)], self.addrs)
        assert self.manager.alive() and all(n.alive() for n in self.nodes)

    def stop(self):
        self.manager.stop()
        for n in self.nodes:
            n.stop()
        self.etcd.stop()
        print("----- manager -----\n" + "\n".join(self.manager.log_path.read_text().splitlines()[-20:]))


async def _true(x):
    return x


async def _write_some(dc, n: int = 4, seed: int = 0) -> list:
    acked = []
    for i in range(n):
        data = pattern(seed + i, BLOB)
        acked.append((seed + i, BLOB, await dc.write(1, data)))
    return acked


def _put_raw(et: Etcd, key: str, body) -> None:
    """What the attacker puts (no MAC: it has no secret), as a blocking call from the test's trio run."""
    return et.put(key, body if isinstance(body, str) else json.dumps(body))


@pytest.fixture(scope="module")
def secure(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("secure"), secure=True)
    yield c
    c.stop()


@pytest.fixture(scope="module")
def insecure(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("insecure"), secure=False)
    yield c
    c.stop()


# -- an etcd writer without the secret -----------------------------------------------------------------------
def test_replicas_put_without_the_secret_move_no_data(secure):
    c = secure

    async def main():
        async with c.client() as dc:
            acked = await _write_some(dc)
            cur = await c.writable()
            restored = await c.attack({"id": 1, "replicas": ["127.0.0.1:1"], "epoch": cur.epoch + 1, "want": 3,
                                       "synced": ["127.0.0.1:1"], "state": "writable", "installed": True})
            assert restored.epoch == cur.epoch and restored.replicas == c.addrs
            await c.unmoved(dc, cur.epoch, acked)
    run(main)


def test_a_fake_leader_and_its_node_key_get_no_write(secure):
    c = secure
    fake = socket.socket()
    fake.bind(("127.0.0.1", 0))
    fake.listen(16)
    fake.settimeout(0.2)
    fake_addr = f"127.0.0.1:{fake.getsockname()[1]}"
    dialed = []
    done = threading.Event()

    def accept():
        while not done.is_set():
            try:
                s, peer = fake.accept()
            except OSError:
                continue
            dialed.append(peer)
            s.close()
    t = threading.Thread(target=accept)
    t.start()

    async def main():
        async with c.client() as dc:
            acked = await _write_some(dc, seed=100)
            cur = await c.writable()
            before = c.invalid()
            seen = dict(dc.metrics.etcd.invalid)
            lease = await c.attacker.grant(60)
            await c.attacker.put(c.admin.node_key(fake_addr), json.dumps({
                "addr": fake_addr, "zone": "default", "transport": "tcp", "free_bytes": 1 << 40,
                "capacity_bytes": 1 << 40, "partitions": {"1": {"epoch": cur.epoch + 1,
                                                                "replicas": [fake_addr, *c.addrs]}}}), lease)
            await _put_raw(c.attacker, c.admin.part_key(1), {
                "id": 1, "replicas": [fake_addr, *c.addrs], "epoch": cur.epoch + 1, "want": 4,
                "synced": [fake_addr, *c.addrs], "state": "writable", "installed": True})
            await c.seen_by_all(before)
            await wait_for("the SDK to ignore the view",
                           lambda: _true(sum(dc.metrics.etcd.invalid.values()) > sum(seen.values())))
            # writes go to the real leader and are on every real replica
            acked += await _write_some(dc, seed=200)
            await c.unmoved(dc, cur.epoch, acked)
            await c.attacker.revoke(lease)
    try:
        run(main)
    finally:
        done.set()
        t.join()
        fake.close()
    assert not dialed, f"the fake leader {fake_addr} was dialed by {dialed}"


def test_garbage_values_crash_nothing_and_are_counted(secure):
    c = secure

    async def main():
        async with c.client() as dc:
            acked = await _write_some(dc, seed=300)
            cur = await c.writable()
            await c.attack({"replicas": 7, "epoch": "x"})
            # garbage elsewhere: a node key, an admin's request, and a drain mark that would empty node 1
            before = c.invalid()
            await _put_raw(c.attacker, c.admin.node_key("127.0.0.1:9"), "{not json")
            await _put_raw(c.attacker, c.admin.key("requests", "x"), {"op": "create", "count": 500, "replicas": 3})
            await _put_raw(c.attacker, c.admin.key("drain", c.addrs[0]), {"since": 1.0})
            await wait_for("the manager to count them", lambda: _true(c.invalid()[-1] >= before[-1] + 3))
            await trio.sleep(2)                       # ticks of the manager: a drain would have started
            assert metric(c.manager_metrics, "dnmanager_active") == 1
            assert sorted(await c.admin.parts()) == [1]      # no partition created for the request
            await c.unmoved(dc, cur.epoch, acked)
            await c.attacker.delete(c.admin.key("drain", c.addrs[0]))
    run(main)


def test_an_epoch_near_2_to_the_63_is_ignored(secure):
    c = secure

    async def main():
        async with c.client() as dc:
            acked = await _write_some(dc, seed=400)
            cur = await c.writable()
            await c.attack({"id": 1, "replicas": c.addrs, "epoch": (1 << 63) - 2, "want": 3, "synced": c.addrs,
                            "state": "writable", "installed": True})
            await c.unmoved(dc, cur.epoch, acked)
        async with c.client() as dc:                  # a client that starts now writes too
            await c.unmoved(dc, cur.epoch, acked)
    run(main)


# -- without a secret: no MAC, but the checks that need none -------------------------------------------------
def test_without_a_secret_unregistered_replicas_garbage_and_huge_epochs_are_ignored(insecure):
    c = insecure

    async def main():
        async with c.client() as dc:
            acked = await _write_some(dc, seed=500)
            cur = await c.writable()
            base = {"id": 1, "want": 3, "state": "writable", "installed": True}
            for bad in ({**base, "replicas": ["127.0.0.1:1"], "synced": ["127.0.0.1:1"], "epoch": cur.epoch + 1},
                        {"replicas": 7, "epoch": "x"},
                        {**base, "replicas": c.addrs, "synced": c.addrs, "epoch": (1 << 63) - 2}):
                await c.attack(bad)
            await c.unmoved(dc, cur.epoch, acked)
    run(main)


def test_a_map_written_without_a_secret_is_sealed_once_the_cluster_has_one(tmp_path):
    """An insecure cluster given a secret: its views and registrations in etcd carry no MAC, so those who now
    hold the secret ignore them until rewritten -- the nodes re-register at restart and the manager re-adopts
    each partition from its leader's registration, sealed; the data stays where it was."""
    c = Cluster(tmp_path, secure=False)
    try:
        async def before():
            async with c.client() as dc:
                return await _write_some(dc, seed=600)
        acked = run(before)
        c.manager.stop()
        c.secret = tmp_path / "cluster.secret"
        c.secret.write_text(gen_secret())
        c.secret.chmod(0o600)
        for n in c.nodes:
            n.stop()
            n.cfg["secret_file"] = str(c.secret)
            n.start()
        c.manager = ManagerProc(tmp_path, c.etcd.url, "m2", lease_ttl_s=TTL, down_after_s=0.5, tick_s=0.2,
                                min_writable=0, secret_file=str(c.secret)).start()
        c.admin = Etcd(c.etcd.url, admin_key=c.admin_key(secure=True))

        async def after():
            v = await wait_for("partition 1 sealed again and writable", c.writable)
            assert v.replicas == c.addrs
            async with c.client() as dc:
                await c.unmoved(dc, v.epoch, acked)
        run(after)
    finally:
        c.stop()


# -- etcd's own lock ---------------------------------------------------------------------------------------
dnctl = functools.partial(conftest_dnctl, check=True)


def test_cluster_up_locks_etcd_with_a_role_per_component(tmp_path):
    root = tmp_path / "c"
    dnctl("cluster", "up", "--nodes", 2, "--cluster", root, "--replica-timeout", 2)
    try:
        info = json.loads((root / "cluster.json").read_text())
        url = info["etcd"]["url"]
        for f in [root / "cluster.secret", *(root / "etcd-auth").iterdir()]:
            assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
        assert stat.S_IMODE((root / "etcd-auth").stat().st_mode) == 0o700

        async def main():
            rec = info["etcd"]
            pki = pathlib.Path(rec["pki"])
            anyone = Etcd(url, access=EtcdAccess.load(ca=str(pki / "ca.pem")))
            with pytest.raises(EtcdError, match="client certificate"):
                await anyone.get_prefix(anyone.prefix + "/")
            # a certificate without a user: connected, and refused by etcd's authentication
            anyone = Etcd(url, access=EtcdAccess.load(ca=str(pki / "ca.pem"), cert=str(pki / "mount.pem"),
                                                      key=str(pki / "mount.key")))
            with pytest.raises(EtcdError, match="authentication"):
                await anyone.put(anyone.part_key(1), "{}")
            with pytest.raises(EtcdError, match="authentication"):
                await anyone.get_prefix(anyone.prefix + "/")
            node = "node-" + info["nodes"][0]["addr"].replace(":", "_")
            et = {who: Etcd(url, access=local_access(rec, node if who == "datanode" else who))
                  for who in ("datanode", "manager", "admin", "mount")}
            e = et["admin"]
            keys = {"parts": e.part_key(1), "nodes": e.node_key("127.0.0.1:9"), "manager": e.manager_key,
                    "requests": e.key("requests", "r"), "drain": e.key("drain", "127.0.0.1:9"),
                    "outside": "/elsewhere/x", "dnfs": "dnfs/v/x"}
            may_write = {"datanode": {"nodes"}, "manager": {"parts", "manager", "requests"},
                         "admin": {"requests", "drain"}, "mount": {"dnfs"}}
            for who, handle in et.items():
                for what, key in keys.items():
                    if what in may_write[who]:
                        continue                       # not written: the cluster is live
                    with pytest.raises(EtcdError, match="permission denied"):
                        await handle.put(key, "{}")
            with pytest.raises(EtcdError, match="permission denied"):
                await et["datanode"].get(e.key("requests", "r"))
            await et["datanode"].get(e.node_key(info["nodes"][1]["addr"]))   # reads the others' registrations   # a node reads views, registrations, hand-offs
            with trio.fail_after(15):       # ... and whether a manager is active (it may still be campaigning)
                while not await et["datanode"].get(e.manager_key):
                    await trio.sleep(0.2)
            await et["mount"].put("dnfs/v/x", "1")          # dnfs's etcd metadata
        run(main)
        # every --cluster DIR command finds what it needs there
        assert json.loads(dnctl("partition", "list", "--cluster", root, "--json").stdout)[0]["id"] == 1
        src = tmp_path / "f"
        src.write_bytes(os.urandom(5000))
        put = json.loads(dnctl("put", "--cluster", root, src, "--json").stdout)
        assert put["locations"]
        assert dnctl("cluster", "status", "--cluster", root, "--json", check=False).returncode == 0
        # without the admin user, dnctl is told what is missing, in one line
        pki = pathlib.Path(info["etcd"]["pki"])         # (the certificate gets it in; the user is missing)
        p = dnctl("--etcd-ca", pki / "ca.pem", "--etcd-cert", pki / "admin.pem", "--etcd-key", pki / "admin.key",
                  "partition", "list", "--etcd", url, check=False)
        assert p.returncode == 1 and "Traceback" not in p.stderr and "--etcd-credentials" in p.stderr, p.stderr
        # a dnfs mount with --cluster DIR follows the map as the mount user, its metadata in the same etcd
        if shutil.which("fusermount3") and os.path.exists("/dev/fuse"):
            _dnfs_round_trip(root, url, tmp_path)
    finally:
        dnctl("cluster", "down", "--cluster", root, check=False)


_dnfs = functools.partial(run_cli, "client.fs.cli", timeout=120)


def _dnfs_round_trip(root: pathlib.Path, url: str, tmp_path: pathlib.Path) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    meta = "etcd://" + url.split("://", 1)[1] + "/v1"
    data = pattern(8, 300_000)
    for step in ("write", "read"):
        r = _dnfs("mount", "--cluster", root, "--secret-file", root / "cluster.secret", "--meta", meta,
                  "--timeout", 15, mnt)
        assert r.returncode == 0, r.stdout + r.stderr
        try:
            if step == "write":
                (mnt / "f").write_bytes(data)
            else:
                assert (mnt / "f").read_bytes() == data
        finally:
            r = _dnfs("umount", mnt)
            assert r.returncode == 0, r.stdout + r.stderr


def test_cluster_up_insecure_has_no_secret_and_an_open_etcd(tmp_path):
    root = tmp_path / "c"
    dnctl("cluster", "up", "--nodes", 1, "--cluster", root, "--insecure", "--replica-timeout", 2)
    try:
        assert not (root / "cluster.secret").exists() and not (root / "etcd-auth").exists()

        async def main():
            e = Etcd(json.loads((root / "cluster.json").read_text())["etcd"]["url"])
            await e.put(e.key("x"), "1")
        run(main)
    finally:
        dnctl("cluster", "down", "--cluster", root, check=False)


def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_certs(d: pathlib.Path) -> dict:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, made with openssl."""
    d.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
             "-subj", "/CN=test etcd CA", cwd=d)
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n")
    for name in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN={name}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "2", "-extfile", "san.ext", cwd=d)
    return {k: str(d / v) for k, v in (("ca", "ca.pem"), ("cert", "client.pem"), ("key", "client.key"),
                                        ("server_cert", "server.pem"), ("server_key", "server.key"))}


@pytest.mark.parametrize("mode", ["client-certificates", "users"])
def test_client_tls_to_etcd_end_to_end(tmp_path, mode):
    """etcd serves only TLS -- requiring client certificates, or (its JSON gateway takes no client certificate
    once users are on) with its users: nodes (config keys), the manager and dnctl (options) and the SDK
    (EtcdAccess) reach it; a client without the CA is refused, in one line."""
    pki = make_certs(tmp_path / "pki")
    certs = mode == "client-certificates"
    e = EtcdProc(tmp_path / "etcd", tls=ServerTls(pki["server_cert"], pki["server_key"], pki["ca"],
                                                  **({"client_ca": pki["ca"], "client_cert": pki["cert"],
                                                      "client_key": pki["key"]} if certs else {}))).start()
    assert e.url.startswith("https://")
    tls = {"etcd_ca": pki["ca"], **({"etcd_cert": pki["cert"], "etcd_key": pki["key"]} if certs else {})}
    auth = {} if certs else setup_auth(e.url, tmp_path / "auth", access=EtcdAccess.load(ca=pki["ca"]))

    def user(who):
        return {} if certs else {"etcd_credentials": auth[who]}
    nodes = [NodeProc(tmp_path / f"n{i}", f"127.0.0.1:{free_port()}", etcd=e.url, **NODE_CFG, **tls,
                      **user("datanode")) for i in range(2)]
    mgr = None
    try:
        for n in nodes:
            n.start()
        mgr = ManagerProc(tmp_path, e.url, "m1", lease_ttl_s=TTL, tick_s=0.2, min_writable=1, replicas=2,
                          **tls, **user("manager")).start()

        def access(who):
            return EtcdAccess.load(**{k[len("etcd_"):]: v for k, v in {**tls, **user(who)}.items()})

        async def main():
            et = Etcd(e.url, access=access("admin"))
            await wait_for("both nodes registered", lambda: _registered(et, 2))
            await wait_for("a writable partition", lambda: _any_writable(et))
            async with DataClient.open(transport="tcp", etcd=e.url, etcd_access=access("mount"), timeout=10,
                                       pool_mib=16) as dc:
                data = pattern(7, 50_000)
                locs = await dc.put(data)
                assert b"".join([await dc.read_location(loc) for loc in locs]) == data
            with pytest.raises(EtcdError, match="not trusted"):
                await Etcd(e.url).get_prefix("/")              # no CA
        run(main)
        opts = [a for k, v in {**tls, **user("admin")}.items() for a in ("--" + k.replace("_", "-"), v)]
        p = dnctl(*opts, "partition", "list", "--etcd", e.url, "--json")
        assert json.loads(p.stdout)[0]["state"] == "writable"
        p = dnctl("partition", "list", "--etcd", e.url, check=False)
        assert p.returncode == 1 and "Traceback" not in p.stderr and "--etcd-ca" in p.stderr, p.stderr
    finally:
        if mgr is not None:
            mgr.stop()
        for n in nodes:
            n.stop()
        e.stop()


async def _registered(et, n):
    return len(await et.nodes()) >= n


async def _any_writable(et):
    return any(v.state == "writable" and v.installed for v in (await et.parts()).values())


def test_an_expired_token_is_renewed_and_a_watch_outlives_an_etcd_restart(tmp_path):
    e = EtcdProc(tmp_path / "etcd", args=("--auth-token-ttl", "2")).start()
    try:
        auth = setup_auth(e.url, tmp_path / "auth")
        et = Etcd(e.url, access=EtcdAccess.load(auth["manager"]))

        async def main():
            await et.put(et.part_key(1), "{}")
            await trio.sleep(3.5)                     # longer than the token lives
            await et.put(et.part_key(2), "{}")
            send, recv = trio.open_memory_channel(100)
            async with trio.open_nursery() as n:
                await n.start(et.watch, et.parts_prefix, send)
                e.stop()                              # every token dies with the member
                e.start()
                with trio.fail_after(20):
                    assert await recv.receive() is None      # watching again (events may be missed: re-read)
                    await et.put(et.part_key(3), "{}")
                    async for batch in recv:
                        if batch and any(k == et.part_key(3) for _t, k, _v, _r in batch):
                            break
                n.cancel_scope.cancel()
        run(main)
    finally:
        e.stop()


def test_setup_auth_for_two_clusters_on_one_etcd(tmp_path):
    """`dnctl etcd setup-auth` locks an existing etcd for one cluster; a second cluster (another prefix) gets
    users of its own through the root user, and neither cluster's users reach the other's keys."""
    e = EtcdProc(tmp_path / "etcd").start()
    try:
        one = json.loads(dnctl("etcd", "setup-auth", "--etcd", e.url, "--out", tmp_path / "one", "--json").stdout)
        assert set(one) == {"datanode", "manager", "admin", "mount", "root"}
        p = dnctl("etcd", "setup-auth", "--etcd", e.url, "--out", tmp_path / "x", check=False)
        assert p.returncode == 1 and "root user" in p.stderr and "Traceback" not in p.stderr, p.stderr
        two = json.loads(dnctl("--etcd-credentials", one["root"], "etcd", "setup-auth", "--etcd", e.url,
                               "--prefix", "/prod", "--out", tmp_path / "two", "--json").stdout)
        assert "root" not in two and pathlib.Path(two["manager"]).read_text().startswith("prod-manager:")

        async def main():
            mine = Etcd(e.url, "/prod", access=EtcdAccess.load(two["manager"]))
            await mine.put(mine.part_key(1), "{}")
            theirs = Etcd(e.url, access=EtcdAccess.load(two["manager"]))
            with pytest.raises(EtcdError, match="permission denied"):
                await theirs.put(theirs.part_key(1), "{}")
        run(main)
    finally:
        e.stop()
