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
import subprocess
import sys

import pytest
import trio

from tests.conftest import run
from tests.test_etcd import wait_for
from tools.etcd_cluster import etcd_binary
from wire.etcdmap import Etcd, EtcdAccess, EtcdError

try:
    etcd_binary()
except FileNotFoundError as e:
    pytestmark = pytest.mark.skip(reason=str(e))

REPO = pathlib.Path(__file__).resolve().parent.parent


def dnctl(*args, check=True):
    p = subprocess.run([sys.executable, "-m", "tools.dnctl", *map(str, args)], cwd=REPO, capture_output=True,
                       text=True, timeout=180, env={**os.environ, "PYTHONPATH": str(REPO)})
    if check and p.returncode != 0:
        raise AssertionError(f"dnctl {args} -> {p.returncode}\n{p.stdout}\n{p.stderr}")
    return p


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
