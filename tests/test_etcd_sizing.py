"""etcd kept bounded and its clients sized: real etcd members, a real manager (manager/etcdcare.py,
wire/etcdmap.py, tools/etcd_cluster.py).

* many etcd calls at once through one ``Etcd`` reuse its connections (no "Connection pool is full");
* the members ``tools/etcd_cluster.py`` starts compact their history on their own and have a quota;
* the active manager defragments a member whose file is much larger than its use, also under etcd's
  authentication (defragment is an admin RPC there: the manager's maintenance user).
"""
from __future__ import annotations

import logging

import pytest
import trio

from tests.conftest import run
from tools.etcd_cluster import EtcdProc, etcd_binary

try:
    etcd_binary()
except FileNotFoundError as e:
    pytestmark = pytest.mark.skip(reason=str(e))


def test_concurrent_calls_reuse_connections(tmp_path, caplog):
    e = EtcdProc(tmp_path / "etcd").start()
    try:
        from wire.etcdmap import Etcd
        et = Etcd(e.url, timeout=10)
        caplog.set_level(logging.WARNING, logger="urllib3.connectionpool")

        async def go():
            await et.put(et.key("x"), "v" * 4096)
            async with trio.open_nursery() as n:     # trio's thread limiter: 40 under way at once
                for _ in range(400):
                    n.start_soon(et.get, et.key("x"))
        run(go)
        full = [r.getMessage() for r in caplog.records if "pool is full" in r.getMessage()]
        assert not full, f"{len(full)} connections thrown away, e.g. {full[0]}"
    finally:
        e.stop()


def test_admin_requests_beyond_the_pool_wait_their_turn(nodes):
    """Far more admin requests at once than the client's pool has answers for (the manager moving many
    partitions): they queue for it, none fails for memory."""
    from tests.conftest import open_client
    from wire.protocol import Op
    node, = nodes(1)
    failed = []

    async def go():
        async with open_client("tcp", pool_mib=2, timeout=0.5) as dc:
            async def one():
                try:
                    await dc.admin(node.addr, Op.NODE_STATUS)
                except Exception as e:               # noqa: BLE001 -- counted, shown below
                    failed.append(str(e))
            async with trio.open_nursery() as n:
                for _ in range(1500):
                    n.start_soon(one)
    run(go)
    assert not failed, f"{len(failed)} of 1500 failed, e.g. {failed[0]}"
