"""SDK clients that follow the cluster map through the datanodes (MAP_READ, datanode/mapcopy.py), not etcd.

The clients here are given an etcd URL where nothing listens: whatever they learn comes from the nodes.  A
secured cluster (etcd users, the secret) with a manager that fails over within seconds:

* an entry put into etcd without the manager's MAC reaches every node's copy and is served, and the client
  refuses it (counted), keeping the view it had;
* the leader the client follows the map through is killed -9: the client moves to another node, learns
  the manager's new view and writes to the new leader.
"""
from __future__ import annotations

import concurrent.futures
import json
import pathlib

import pytest
import trio

from client.sdk import ClientError, DataClient
from tests.conftest import NODE_DEFAULTS, create_partition
from tests.test_etcd import wait_for
from tools.cluster import NodeProc, free_port
from tools.etcd_cluster import EtcdProc, ManagerProc, etcd_binary, setup_auth
from wire.auth import Credentials, gen_secret
from wire.etcdmap import Etcd, EtcdAccess
from wire.protocol import Role

try:
    etcd_binary()
except FileNotFoundError as e:
    pytestmark = pytest.mark.skip(reason=str(e))

TTL = 2
NODE_CFG = {**NODE_DEFAULTS, "transport": "tcp", "lease_ttl_s": TTL, "heartbeat_s": 0.5}


class Cluster:
    def __init__(self, root: pathlib.Path):
        self.etcd = EtcdProc(root / "etcd").start()
        self.auth = setup_auth(self.etcd.url, root / "etcd-auth")
        self.secret = root / "cluster.secret"
        self.secret.write_text(gen_secret())
        self.secret.chmod(0o600)
        extra = {"secret_file": str(self.secret), "etcd_credentials": self.auth["datanode"]}
        self.nodes = [NodeProc(root / f"node{i}", f"127.0.0.1:{free_port()}", etcd=self.etcd.url, **NODE_CFG,
                               **extra) for i in range(3)]
        with concurrent.futures.ThreadPoolExecutor(3) as ex:
            list(ex.map(lambda n: n.start(), self.nodes))
        self.manager = ManagerProc(root, self.etcd.url, "m1", lease_ttl_s=TTL, down_after_s=0.5, tick_s=0.2,
                                   min_writable=0, secret_file=str(self.secret),
                                   etcd_credentials=self.auth["manager"]).start()
        key = Credentials.load(self.secret).key(Role.ADMIN)
        self.admin = Etcd(self.etcd.url, access=EtcdAccess.load(self.auth["admin"]), admin_key=key)
        self.attacker = Etcd(self.etcd.url, access=EtcdAccess.load(self.auth["root"]))     # no secret
        self.addrs = [n.addr for n in self.nodes]

        async def setup():
            async with self.client(etcd=None) as dc:
                await create_partition(dc, 1, self.addrs)
            await wait_for("partition 1 adopted and writable", self.writable)
        trio.run(setup)

    async def writable(self):
        v = await self.admin.part(1)
        return v if v is not None and v.state == "writable" and v.installed else None

    def client(self, nodes=None, *, etcd: str | None = "dead", **kw):
        """A client following the map through ``nodes`` (default: all), its etcd URL one where nothing
        listens (``etcd="dead"``) so it cannot have learnt anything from etcd."""
        if etcd == "dead":
            etcd = f"http://127.0.0.1:{free_port()}"
        kw.setdefault("timeout", 10)
        return DataClient.open(self.addrs if nodes is None else nodes, transport="tcp", pool_mib=16,
                               secret=str(self.secret), etcd=etcd, **({"map_via": "nodes"} if etcd else {}), **kw)

    def stop(self):
        self.manager.stop()
        for n in self.nodes:
            n.stop()
        self.etcd.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("mapvia"))
    yield c
    c.stop()


def test_an_unsealed_view_served_by_the_nodes_is_refused(cluster):
    c = cluster

    async def main():
        async with c.client() as dc:
            before = dc.partition(1)
            assert dc._routes.map_node and dc._routes.map_rev > 0
            invalid0 = sum(dc.map.invalid.values())
            forged = {"replicas": list(reversed(before.replicas)), "epoch": before.epoch + 1, "want": 3,
                      "synced": before.replicas, "state": "writable", "installed": True}
            await c.attacker.put(c.admin.part_key(1), json.dumps(forged))      # no MAC: no secret

            async def refused():
                return sum(dc.map.invalid.values()) > invalid0
            await wait_for("the client to refuse the unsealed view its node passed on", refused, timeout=20)
            await wait_for("the manager to write the valid view back", c.writable)
            after = dc.partition(1)
            assert (after.replicas, after.epoch) == (before.replicas, before.epoch), (before, after)
            await dc.write(1, b"x" * 4096)            # still the true leader
    trio.run(main)


def test_a_client_without_etcd_follows_a_failover_through_another_node(cluster):
    c = cluster

    async def main():
        v0 = await c.writable()
        leader = v0.replicas[0]
        async with c.client([leader]) as dc:      # follows the map through the leader to be killed
            assert dc._routes.map_node == leader
            await dc.write(1, b"a" * 8192)
            next(n for n in c.nodes if n.addr == leader).kill()

            async def moved():
                p = dc.partition(1)
                return p if p.epoch > v0.epoch and p.replicas[0] != leader else None
            p = await wait_for("the client to learn the new leader from a surviving node", moved, timeout=30)
            assert dc._routes.map_node != leader
            loc = await dc.write(1, b"b" * 8192)
            assert (await dc.read(1, loc[0].extent, loc[0].offset, 8192)) == b"b" * 8192
            assert p.replicas[0] in c.addrs
    trio.run(main)


def test_map_via_nodes_needs_the_key_that_checks_the_views(cluster):
    async def main():
        with pytest.raises(ClientError, match="MAC"):
            async with DataClient.open(cluster.addrs, transport="tcp", pool_mib=16, etcd="http://127.0.0.1:9",
                                       map_via="nodes"):
                pass
    trio.run(main)


def test_another_clusters_secret_is_refused_by_the_nodes_not_taken_to_etcd(cluster, tmp_path):
    other = tmp_path / "other.secret"
    other.write_text(gen_secret())
    other.chmod(0o600)

    async def main():
        with pytest.raises(ClientError) as e:
            async with DataClient.open(cluster.addrs, transport="tcp", pool_mib=16, secret=str(other),
                                       etcd=cluster.etcd.url, timeout=5):
                pass
        assert e.value.auth, e.value
    trio.run(main)
