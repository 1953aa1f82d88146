"""Many SDK clients opening at once against a default secured cluster (``dnctl cluster up``: the secret, etcd
with a user per component): none fails.

Through etcd (``map_via="etcd"``) and, as by default, through the datanodes: then etcd sees no login, no
watch and no connection of theirs.

Each client is its own process (bench/client_storm.py: all import first, then are released together), so
each logs in to etcd as the ``mount`` user at the same moment -- the storm that etcd's default bcrypt cost
turned into timeouts.  Also: an open waits for an etcd that does not answer only until its deadline, trying
again meanwhile, and says what it waited for; a refusal (a wrong password) is not retried.
"""
from __future__ import annotations

import functools
import json

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


def test_clients_following_the_nodes_cost_etcd_no_login_watch_or_connection(cluster):
    out = storm(cluster, CLIENTS, via="auto")           # the default: the nodes given, the secret held
    print(json.dumps(out))
    assert out["failed"] == 0, out
    assert out["etcd_authenticate"] == 0 and out["etcd_watch_streams"] == 0, out
    assert out["etcd_connections_open"] <= out["etcd_connections_before"] + 2, out


def test_an_open_waits_for_etcd_until_its_deadline_and_says_for_what(tmp_path):
    port = free_port()                                     # nothing listens: every attempt is refused

    async def main():
        t0 = trio.current_time()
        with pytest.raises(ClientError, match=r"did not answer the login and read of the map in .* attempts") as e:
            async with DataClient.open([], transport="tcp", pool_mib=1, etcd=f"http://127.0.0.1:{port}",
                                       timeout=1.5):
                pass
        took = trio.current_time() - t0
        assert 1.0 <= took <= 5.0, took
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
