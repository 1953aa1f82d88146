"""etcd nobody reaches anonymously, and a registration only its node can end: a real `dnctl cluster up`
(a real etcd requiring client certificates, real datanodes, a real manager).

* Without a client certificate signed by the cluster's CA, etcd takes no connection: nobody lists the leases
  or keeps a dead leader's lease alive (which would stop its failover).
* Each datanode's etcd user writes only its own registration: another node's is refused by etcd (overwrite,
  delete, revoking its lease, a hand-off request in its name).
* The manager acts on a registration's end only when etcd ended the node's lease: a registration deleted
  (even by etcd's root user) while its lease lives, or put without a lease, moves nothing.
"""
from __future__ import annotations

import base64
import json
import os
import pathlib
import signal

import pytest
import trio

from tests.conftest import run
from tests.test_etcd import wait_for
from tests.test_etcd_trust import dnctl
from tools.etcd_cluster import etcd_binary
from wire.etcdmap import Etcd, EtcdAccess, EtcdError

try:
    etcd_binary()
except FileNotFoundError as e:
    pytestmark = pytest.mark.skip(reason=str(e))

REPO = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """`dnctl cluster up`: 3 nodes, partition 1 on all three (leader node1)."""
    root = tmp_path_factory.mktemp("mtls") / "c"
    dnctl("cluster", "up", "--nodes", 3, "--cluster", root, "--replica-timeout", 2)
    try:
        yield root
    finally:
        dnctl("cluster", "down", "--cluster", root, check=False)


def info(root: pathlib.Path) -> dict:
    return json.loads((root / "cluster.json").read_text())


def access(rec: dict, who: str) -> EtcdAccess:
    """``who``'s etcd user and, where etcd requires one, its certificate (as tools.cluster.local_access)."""
    pki = {k: str(pathlib.Path(rec["pki"]) / f) for k, f in (("ca", "ca.pem"), ("cert", f"{who}.pem"),
                                                             ("key", f"{who}.key"))} if rec.get("pki") else {}
    return EtcdAccess.load(str(pathlib.Path(rec["auth"]) / who), **pki)


def handle(root: pathlib.Path, who: str) -> Etcd:
    rec = info(root)["etcd"]
    return Etcd(rec["url"], access=access(rec, who))


def node_user(addr: str) -> str:
    return "node-" + addr.replace(":", "_")


async def _lease_of(et: Etcd, key: str) -> int:
    r = await et._post("/kv/range", {"key": base64.b64encode(key.encode()).decode()})
    return int(r["kvs"][0].get("lease", 0)) if r.get("kvs") else 0


async def _true(x):
    return x


async def _writable(et: Etcd):
    v = await et.part(1)
    return v if v is not None and v.state == "writable" and v.installed else None


def test_cluster_up_etcd_requires_a_client_certificate(cluster):
    """Anyone without a certificate of the cluster's CA -- no TLS, the CA but no certificate, a certificate of
    another CA -- is refused before etcd reads a byte: no lease list, no keepalive."""
    rec = info(cluster)["etcd"]
    plain = "http://" + rec["url"].split("://", 1)[1]

    async def attempts(anonymous: list[Etcd]):
        admin = handle(cluster, "admin")
        node1 = info(cluster)["nodes"][0]["addr"]
        lease = await _lease_of(admin, admin.node_key(node1))
        assert lease, "node1 registered under a lease"
        for et in anonymous:
            with pytest.raises(EtcdError):
                await et._post("/lease/leases", {})
            with pytest.raises(EtcdError):
                await et.keepalive(lease)
            with pytest.raises(EtcdError):
                await et.get_prefix(et.prefix + "/")
        # the cluster's own components get in
        assert await handle(cluster, "admin").nodes()
    run(attempts, [Etcd(plain), Etcd(rec["url"])])
    assert rec["url"].startswith("https://")
    pki = pathlib.Path(rec["pki"])
    for f in pki.glob("*.key"):
        assert oct(f.stat().st_mode & 0o777) == "0o600", f
    other = cluster.parent / "other-ca"
    from tools import etcd_pki
    etcd_pki.make_ca(other)
    cert, key = etcd_pki.issue(other, "intruder")
    run(attempts, [Etcd(rec["url"], access=EtcdAccess.load(ca=str(pki / "ca.pem"))),
                   Etcd(rec["url"], access=EtcdAccess.load(ca=str(pki / "ca.pem"), cert=cert, key=key))])
    p = dnctl("--etcd-ca", pki / "ca.pem", "partition", "list", "--etcd", rec["url"], check=False)
    assert p.returncode == 1 and "Traceback" not in p.stderr and "--etcd-cert" in p.stderr, p.stderr


def test_a_node_user_cannot_touch_another_nodes_registration(cluster):
    """node1's own etcd user (with its own certificate) writes its registration and nothing of node2's."""
    nodes = [n["addr"] for n in info(cluster)["nodes"]]
    a, b = nodes[0], nodes[1]
    own = (cluster / "etcd-auth" / node_user(a)).exists()

    async def main():
        mine = handle(cluster, node_user(a) if own else "datanode")
        admin = handle(cluster, "admin")
        before = await admin.get(admin.node_key(b))
        lease_b = await _lease_of(admin, admin.node_key(b))
        for attempt in (lambda: mine.put(mine.node_key(b), before[0].decode()),
                        lambda: mine.delete(mine.node_key(b)),
                        lambda: mine.revoke(lease_b),
                        lambda: mine.put(mine.key("handoff", b), "{}"),
                        lambda: mine.put(mine.part_key(1), "{}")):
            with pytest.raises(EtcdError, match="permission denied"):
                await attempt()
        after = await admin.get(admin.node_key(b))
        assert after == before and await admin.lease_ttl(lease_b) > 0
        # its own registration it may write (the node itself does, under its lease)
        got = await mine.get(mine.node_key(a))
        assert got is not None
    run(main)
    assert own and not (cluster / "etcd-auth" / "datanode").exists()


def test_the_manager_ignores_what_it_cannot_attribute_to_a_node(cluster):
    """Even etcd's root user deleting a live node's registration, or putting one without a lease, moves no
    partition: the manager keeps the registration while the node's lease lives.  A node that really dies
    (its lease expires) is still dropped from its partitions."""
    addrs = [n["addr"] for n in info(cluster)["nodes"]]
    follower = addrs[2]

    async def main():
        admin = handle(cluster, "admin")
        root = handle(cluster, "root")
        v0 = await wait_for("partition 1 writable", lambda: _writable(admin), timeout=30)
        assert follower in v0.replicas
        key = root.node_key(follower)
        reg = (await root.get(key))[0].decode()
        with trio.move_on_after(6):                   # several lease TTLs and down_after_s
            while True:
                await root.delete(key)
                await trio.sleep(0.3)
        await root.put(key, reg)                       # back, but attached to no lease: not the node's
        await trio.sleep(4)
        v1 = await admin.part(1)
        assert (v1.epoch, v1.replicas) == (v0.epoch, v0.replicas), (v0, v1)
        # the node dies for real: its lease expires and the manager drops it
        pid = next(n["pid"] for n in info(cluster)["nodes"] if n["addr"] == follower)
        os.kill(pid, signal.SIGKILL)                   # (the unleased copy stays: the lease is what counts)

        async def dropped():
            v = await admin.part(1)
            return v if follower not in v.replicas else None
        v2 = await wait_for("the dead follower dropped", dropped, timeout=30)
        assert v2.epoch > v0.epoch
    run(main)


def test_an_anonymous_keepalive_cannot_hold_a_dead_leaders_lease(cluster):
    """The attack on etcd's lease API: while a client without a certificate keeps trying to keep a killed
    leader's lease alive, the lease expires and the partition gets a new leader."""
    rec = info(cluster)["etcd"]
    plain = "http://" + rec["url"].split("://", 1)[1]
    pki = pathlib.Path(rec["pki"]) if rec.get("pki") else None
    held, refused = [], []

    async def main():
        admin = handle(cluster, "admin")
        async def settled():        # (a node killed by the test before: 2 replicas, degraded, is fine)
            v = await admin.part(1)
            return v if v is not None and v.installed and len(v.replicas) >= 2 else None
        v0 = await wait_for("partition 1 settled", settled, timeout=30)
        leader = v0.replicas[0]
        lease = await _lease_of(admin, admin.node_key(leader))
        anonymous = [Etcd(rec["url"]), Etcd(plain)]
        if pki is not None:
            anonymous.append(Etcd(rec["url"], access=EtcdAccess.load(ca=str(pki / "ca.pem"))))

        async def attacker():
            while True:
                for et in anonymous:
                    try:
                        if await et.keepalive(lease) > 0:
                            held.append(et.urls)
                    except EtcdError:
                        refused.append(et.urls)
                await trio.sleep(0.2)

        async with trio.open_nursery() as n:
            n.start_soon(attacker)
            pid = next(x["pid"] for x in info(cluster)["nodes"] if x["addr"] == leader)
            os.kill(pid, signal.SIGKILL)

            async def moved():
                v = await admin.part(1)
                return v if v is not None and v.replicas[0] != leader and v.epoch > v0.epoch else None
            await wait_for("a new leader for partition 1", moved, timeout=20)
            n.cancel_scope.cancel()
    run(main)
    assert refused and not held, (len(refused), held[:3])


# -- the upgrade: password users over plain HTTP -> client certificates and a user per node, while serving --
def test_a_running_cluster_moves_to_certificates_and_node_users_while_it_serves(tmp_path):
    """The path of docs/operations.md, on a live cluster made the earlier way (etcd over plain HTTP, password
    users, one user shared by every node): certificates, etcd serving HTTPS beside HTTP, a user per node, each
    node and the manager restarted onto HTTPS one at a time, the shared node role locked, HTTP closed.  A
    writer keeps writing throughout: nothing it was told was written is lost, and at the end anonymous
    clients and the shared node user are refused."""
    from client.sdk import ClientError, DataClient
    from tests.conftest import NODE_DEFAULTS, create_partition, pattern
    from tools import etcd_pki
    from tools.cluster import NodeProc, free_port
    from tools.etcd_cluster import (EtcdProc, ManagerProc, ServerTls, add_node_user, lock_shared_node_role,
                                    node_user as user_of, setup_auth)
    from wire.auth import gen_secret

    secret = tmp_path / "cluster.secret"
    secret.write_text(gen_secret())
    secret.chmod(0o600)
    cfg = {**NODE_DEFAULTS, "transport": "tcp", "lease_ttl_s": 2, "heartbeat_s": 0.5, "secret_file": str(secret)}
    e = EtcdProc(tmp_path / "etcd").start()
    auth = setup_auth(e.url, tmp_path / "auth")
    nodes = [NodeProc(tmp_path / f"n{i}", f"127.0.0.1:{free_port()}", etcd=e.url,
                      etcd_credentials=auth["datanode"], **cfg) for i in range(3)]
    addrs = [n.addr for n in nodes]
    mopts = {"lease_ttl_s": 2, "down_after_s": 1, "tick_s": 0.2, "min_writable": 0, "secret_file": str(secret)}
    mgr = ManagerProc(tmp_path, e.url, "m1", etcd_credentials=auth["manager"], **mopts)
    pki = tmp_path / "pki"
    procs = [e, mgr, *nodes]
    try:
        for n in nodes:
            n.start()
        mgr.start()
        acked: list[tuple[int, object]] = []
        old_http = ""
        failed: list[tuple[str, str]] = []      # (phase, why) of every attempt that failed
        lost: list[int] = []                    # writes that did not succeed within 10 s
        phase = ["etcd"]

        async def main():
            nonlocal e, mgr
            async with DataClient.open(addrs, transport="tcp", pool_mib=16, secret=str(secret), timeout=10) as dc:
                await create_partition(dc, 1, addrs)
                admin_old = Etcd(e.url, access=EtcdAccess.load(auth["admin"]))
                await wait_for("partition 1 adopted", lambda: _writable(admin_old), timeout=30)
                stop = trio.Event()

                async def writer():
                    """As an application writes: a write that fails is tried again, for 10 s at most."""
                    i = 0
                    while not stop.is_set():
                        i += 1
                        with trio.move_on_after(10):
                            while True:
                                try:
                                    acked.append((i, await dc.write(1, pattern(i, 8192))))
                                    break
                                except ClientError as ex:
                                    failed.append((phase[0], f"{ex}"))
                                await trio.sleep(0.1)
                        if not acked or acked[-1][0] != i:
                            lost.append(i)
                        await trio.sleep(0.05)

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(writer)
                    # 1. certificates: the CA, the member's, one per component and node
                    etcd_pki.make_ca(pki)
                    etcd_pki.issue(pki, "server", hosts=("127.0.0.1",))
                    for who in ("root", "manager", "admin", *map(user_of, addrs)):
                        etcd_pki.issue(pki, who)

                    def tls_of(who):
                        return {"ca": str(pki / "ca.pem"), "cert": str(pki / f"{who}.pem"),
                                "key": str(pki / f"{who}.key")}
                    server = ServerTls(str(pki / "server.pem"), str(pki / "server.key"), str(pki / "ca.pem"),
                                       client_ca=str(pki / "ca.pem"), client_cert=str(pki / "root.pem"),
                                       client_key=str(pki / "root.key"))
                    # 2. the member serves HTTPS (certificates required) beside its HTTP port
                    nonlocal old_http
                    old_http = e.url
                    e.stop()
                    e = EtcdProc(tmp_path / "etcd", client_port=free_port(), peer_port=e.peer_port,
                                 plain_port=e.client_port, tls=server)
                    procs[0] = e
                    await trio.to_thread.run_sync(e.start)
                    root = EtcdAccess.load(auth["root"], **tls_of("root"))
                    # 3. a user per node
                    users = {a: await trio.to_thread.run_sync(
                        lambda a=a: add_node_user(e.url, tmp_path / "auth", a, access=root)) for a in addrs}
                    # 4. each node, then the manager, onto HTTPS with its own user and certificate
                    for i in (2, 1, 0):
                        phase[0] = "node restart"
                        n = nodes[i]
                        await trio.to_thread.run_sync(n.stop)
                        tls = {f"etcd_{k}": v for k, v in tls_of(user_of(n.addr)).items()}
                        nodes[i] = NodeProc(n.root, n.addr, etcd=e.url, etcd_credentials=users[n.addr], **tls, **cfg)
                        procs[2 + i] = nodes[i]
                        await trio.to_thread.run_sync(nodes[i].start)
                        admin = Etcd(e.url, access=EtcdAccess.load(auth["admin"], **tls_of("admin")))

                        async def back(addr=n.addr):
                            v = await _writable(admin)
                            return v if v is not None and addr in v.replicas and len(v.replicas) == 3 else None
                        await wait_for(f"{n.addr} back in partition 1", back, timeout=60)
                        phase[0] = "etcd"
                        done = len(acked)
                        await wait_for("writes going on", lambda: _true(len(acked) > done + 3), timeout=30)
                    mgr.stop()
                    mgr = ManagerProc(tmp_path, e.url, "m2", etcd_credentials=auth["manager"],
                                      **{f"etcd_{k}": v for k, v in tls_of("manager").items()}, **mopts)
                    procs[1] = mgr
                    mgr.start()
                    # 5. the shared node role only reads; 6. HTTP closed
                    await trio.to_thread.run_sync(lambda: lock_shared_node_role(e.url, access=root))
                    e.stop()
                    e = EtcdProc(tmp_path / "etcd", client_port=e.client_port, peer_port=e.peer_port, tls=server)
                    procs[0] = e
                    await trio.to_thread.run_sync(e.start)
                    await trio.sleep(2)
                    stop.set()
                # every write the writer was told succeeded reads back
                for i, locs in acked:
                    assert b"".join([await dc.read_location(loc) for loc in locs]) == pattern(i, 8192)
            shared = Etcd(e.url, access=EtcdAccess.load(auth["datanode"], **tls_of("admin")))
            with pytest.raises(EtcdError, match="permission denied"):
                await shared.delete(shared.node_key(addrs[0]))
            with pytest.raises(EtcdError):                 # the old HTTP port is closed
                await Etcd(old_http)._post("/lease/leases", {})
            await wait_for("a manager active again", lambda: admin.get(admin.manager_key), timeout=30)
        run(main)
        # no write lost; the etcd steps cost no attempt at all (a node's own restart fails some attempts to the
        # partition it leads, which the writer tries again: a rolling restart's cost, as without the upgrade)
        assert len(acked) > 20 and not lost, (len(acked), lost)
        assert not [f for f in failed if f[0] == "etcd"], failed[:5]
    finally:
        for p in procs:
            p.stop()


def test_dnctl_etcd_issue_add_node_and_lock_node_role(tmp_path):
    """The commands an operator runs on a cluster of several hosts: certificates from the CA (without openssl),
    a node's own user, the shared node role locked; bad input gets one line, no traceback."""
    from tools.etcd_cluster import EtcdProc, ServerTls
    pki = tmp_path / "pki"
    out = json.loads(dnctl("etcd", "issue", "--pki", pki, "--new-ca", "--server", "127.0.0.1", "server",
                           "--json").stdout)
    assert pathlib.Path(out["cert"]).exists() and oct(pathlib.Path(out["key"]).stat().st_mode & 0o777) == "0o600"
    for who in ("root", "admin"):
        dnctl("etcd", "issue", "--pki", pki, who)
    tls = ["--etcd-ca", pki / "ca.pem", "--etcd-cert", pki / "root.pem", "--etcd-key", pki / "root.key"]
    e = EtcdProc(tmp_path / "etcd", tls=ServerTls(str(pki / "server.pem"), str(pki / "server.key"),
                                                   str(pki / "ca.pem"), client_ca=str(pki / "ca.pem"),
                                                   client_cert=str(pki / "root.pem"),
                                                   client_key=str(pki / "root.key"))).start()
    try:
        auth = json.loads(dnctl(*tls, "etcd", "setup-auth", "--etcd", e.url, "--out", tmp_path / "auth",
                                "--json").stdout)
        root = ["--etcd-credentials", auth["root"], *tls]
        node = json.loads(dnctl(*root, "etcd", "add-node", "127.0.0.1:9", "--etcd", e.url, "--out",
                                tmp_path / "auth", "--json").stdout)
        assert node["user"] == "node-127.0.0.1_9"
        p = dnctl(*root, "etcd", "add-node", "nohost", "--etcd", e.url, "--out", tmp_path / "auth", check=False)
        assert p.returncode == 2 and "Traceback" not in p.stderr and "HOST:PORT" in p.stderr, p.stderr
        p = dnctl("etcd", "issue", "--pki", tmp_path / "nothing", "x", check=False)
        assert p.returncode == 1 and "Traceback" not in p.stderr and "ca.pem" in p.stderr, p.stderr

        def as_user(path):
            return Etcd(e.url, access=EtcdAccess.load(path, ca=str(pki / "ca.pem"), cert=str(pki / "admin.pem"),
                                                      key=str(pki / "admin.key")))

        async def main(locked: bool):
            mine, shared = as_user(node["credentials"]), as_user(auth["datanode"])
            await mine.put(mine.node_key("127.0.0.1:9"), "{}")
            with pytest.raises(EtcdError, match="permission denied"):
                await mine.put(mine.node_key("127.0.0.1:8"), "{}")
            if locked:
                with pytest.raises(EtcdError, match="permission denied"):
                    await shared.put(shared.node_key("127.0.0.1:8"), "{}")
                assert await shared.get(shared.node_key("127.0.0.1:9")) is not None     # still reads
            else:
                await shared.put(shared.node_key("127.0.0.1:8"), "{}")
        run(main, False)
        dnctl(*root, "etcd", "lock-node-role", "--etcd", e.url)
        run(main, True)
    finally:
        e.stop()
