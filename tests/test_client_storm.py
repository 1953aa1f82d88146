"""Many SDK clients opening at once against a default secured cluster (``dnctl cluster up``: the secret, etcd
with a user per component): none fails.

Through etcd (``map_via="etcd"``) and, as by default, through the datanodes: then etcd sees no login, no
watch and no connection of theirs, however many clients open (each from its own loopback address, as
clients of many hosts would: a datanode bounds the hellos in progress per address).

Each client is its own process (bench/client_storm.py: all import first, then are released together), so
each logs in to etcd as the ``mount`` user at the same moment -- the storm that etcd's default bcrypt cost
turned into timeouts.  Also: an open waits for an etcd that does not answer only until its deadline, trying
again meanwhile, and says what it waited for; a refusal (a wrong password) is not retried.
"""
from __future__ import annotations

import functools
import json
import subprocess

import pytest
import trio

from bench.client_storm import storm
from tests.conftest import dnctl as conftest_dnctl
from client.sdk import ClientError, DataClient
from tools.cluster import free_port, local_access_files
from tools.etcd_cluster import etcd_binary
from wire.etcdmap import EtcdAccess

try:
    etcd_binary()
except FileNotFoundError as e:
    pytestmark = pytest.mark.skip(reason=str(e))

CLIENTS = 100
SMALL = 40          # clients of the smaller storm through the nodes (the larger has four times as many)


dnctl = functools.partial(conftest_dnctl, check=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("storm") / "c"
    dnctl("cluster", "up", "--nodes", 3, "--cluster", root)
    yield root
    dnctl("cluster", "down", "--cluster", root, check=False)


def test_a_hundred_client_processes_open_at_once_and_none_fails(cluster):
    info = json.loads((cluster / "cluster.json").read_text())
    assert info["etcd"].get("auth") and info["config"].get("secret_file"), "not a secured cluster"
    out = storm(cluster, CLIENTS)
    print(json.dumps(out))
    assert out["failed"] == 0, out
    assert out["etcd_authenticate"] >= CLIENTS, out        # each did log in: the storm happened


def test_clients_following_the_nodes_cost_etcd_nothing_however_many(cluster):
    """The default (the nodes given, the secret held): each client from its own address, as clients of many
    hosts are, none fails, and etcd sees no login, no watch and no connection of theirs -- 4x the clients,
    the same etcd connections."""
    outs = []
    for clients in (SMALL, 4 * SMALL):
        out = storm(cluster, clients, per_process=clients // 4, timeout=60, via="auto")
        print(json.dumps(out))
        assert out["failed"] == 0, out
        assert out["addresses"] == clients and out["partitions_seen"] and 0 not in out["partitions_seen"], out
        assert out["etcd_authenticate"] == 0 and out["etcd_watch_streams"] == 0, out
        assert out["etcd_connections_peak"] <= out["etcd_connections_before"] + 2, out
        outs.append(out)
    assert outs[1]["etcd_connections_peak"] <= outs[0]["etcd_connections_peak"] + 2, outs


def test_a_client_connects_from_the_source_address_it_is_given(cluster):
    info = json.loads((cluster / "cluster.json").read_text())
    node = info["nodes"][0]["addr"]

    async def main():
        async with DataClient.open([node], transport="tcp", pool_mib=4, etcd=info["etcd"]["url"],
                                   etcd_access=EtcdAccess.load(**local_access_files(info["etcd"], "mount")),
                                   secret=info["config"]["secret_file"], source_address="127.9.8.7") as dc:
            assert dc.partitions
            port = node.rpartition(":")[2]
            seen = subprocess.run(["ss", "-Htn", "state", "established", f"( dport = :{port} )"],
                                  capture_output=True, text=True).stdout
            assert "127.9.8.7:" in seen, seen
    trio.run(main)


def test_an_open_waits_for_etcd_until_its_deadline_and_says_for_what(tmp_path):
    port = free_port()                                     # nothing listens: every attempt is refused

    async def main():
        t0 = trio.current_time()
        with pytest.raises(ClientError, match=r"did not answer the login and read of the map in .* attempts") as e:
            async with DataClient.open([], transport="tcp", pool_mib=1, etcd=f"http://127.0.0.1:{port}",
                                       timeout=1.5):
                pass
        took = trio.current_time() - t0
        assert 0.5 <= took <= 5.0, took    # (it stops when the next jittered wait would pass the deadline)
        assert "(1 attempts" not in str(e.value), e.value  # tried again before giving up
    trio.run(main)


def test_a_refused_login_is_not_retried(cluster, tmp_path):
    info = json.loads((cluster / "cluster.json").read_text())
    bad = tmp_path / "bad"
    bad.write_text("mount:not-its-password\n")

    async def main():
        t0 = trio.current_time()
        with pytest.raises(ClientError, match="authenticating"):
            files = {k: v for k, v in local_access_files(info["etcd"], "mount").items() if k != "credentials"}
            async with DataClient.open([], transport="tcp", pool_mib=1, etcd=info["etcd"]["url"],
                                       etcd_access=EtcdAccess.load(bad, **files), timeout=10):
                pass
        assert trio.current_time() - t0 < 5.0
    trio.run(main)
