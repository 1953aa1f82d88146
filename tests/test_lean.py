"""The lean append (datanode/ops/lean.py) in real datanode processes: appends a client pipelines are served by
the connection's data-plane thread -- a single-replica partition's on its node, a replicated one's forwards on
its followers --, read back as written; the config key switches it off, and print-config says which path
serves."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import trio

from wire.auth import gen_secret
from wire.protocol import Op

from tests.conftest import create_partition, open_client, pattern, run

REPO = pathlib.Path(__file__).resolve().parent.parent
KiB = 1024


async def _pipelined(dc, pid: int, writers: int, each: int) -> list[tuple[bytes, list]]:
    """``writers`` tasks of one client, each appending ``each`` 4 KiB payloads: several appends in flight."""
    out: list[tuple[bytes, list]] = []

    async def writer(i: int) -> None:
        for j in range(each):
            data = pattern(i * 1000 + j, 4 * KiB)
            out.append((data, await dc.write(pid, data)))
    async with trio.open_nursery() as n:
        for i in range(writers):
            n.start_soon(writer, i)
    return out


@pytest.mark.parametrize("lean", [True, False], ids=["lean on", "lean off"])
def test_a_nodes_pipelined_appends_go_lean_unless_switched_off(nodes, client, transport, lean):
    """On TCP; verbs appends always take the handler (their payload is fetched by RDMA READ)."""
    [node] = nodes(1, lean_appends=lean)
    lean = lean and transport == "tcp"

    async def body():
        async with client([]) as dc:
            await create_partition(dc, 7, [node.addr])
            written = await _pipelined(dc, 7, 8, 25)
            for data, locs in written:
                assert b"".join([await dc.read_location(loc) for loc in locs]) == data
            c = (await dc.admin(node.addr, Op.NODE_STATUS))["counters"]
            assert c["writes"] == 200
            assert (c["lean_writes"] > 0) == lean and c["lean_writes"] <= 200
            assert sum((await dc.watermarks(7)).values()) == 200 * 4 * KiB
    run(body)


def test_followers_take_a_leaders_pipelined_forwards_lean(nodes, client, transport):
    a, b, c = nodes(3)

    async def body():
        async with client([]) as dc:
            await create_partition(dc, 9, [a.addr, b.addr, c.addr])
            written = await _pipelined(dc, 9, 8, 25)
            for f in (b, c):
                for data, locs in written[:20]:
                    assert b"".join([await dc.read_location(loc, replica=f.addr) for loc in locs]) == data
            counts = [(await dc.admin(x.addr, Op.NODE_STATUS))["counters"] for x in (a, b, c)]
            assert counts[0]["lean_writes"] == 0 and counts[0]["writes"] == 200      # the leader: the handler
            for f in counts[1:]:
                assert f["replica_writes"] == counts[0]["forwarded"] and f["lean_writes"] <= f["replica_writes"]
                assert (f["lean_writes"] > 0) == (transport == "tcp"), f
    run(body)


def test_with_authentication_a_batch_of_lean_answers_carries_the_sessions_macs(nodes, tmp_path):
    """On an authenticated session every answer carries its MAC, also several sent in one ``sendmsg``: the
    client checks each, and a wrong one would end the connection (its writes would fail)."""
    secret = tmp_path / "cluster.secret"
    secret.write_text(gen_secret())
    secret.chmod(0o600)
    [node] = nodes(1, secret_file=str(secret))

    async def body():
        async with open_client("tcp", [], secret=str(secret)) as dc:
            await create_partition(dc, 7, [node.addr])
            written = await _pipelined(dc, 7, 16, 20)
            for data, locs in written[::10]:
                assert b"".join([await dc.read_location(loc) for loc in locs]) == data
            st = await dc.admin(node.addr, Op.NODE_STATUS)
            assert st["auth"] == "on" and st["counters"]["lean_writes"] > 0 and st["counters"]["writes"] == 320
    run(body)


def test_print_config_says_which_path_serves():
    env = {**os.environ, "PYTHONPATH": str(REPO), "DATANODE_LEAN_APPENDS": "0"}
    p = subprocess.run([sys.executable, "-m", "datanode.cli", "print-config"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("lean_appends"))
    assert line.startswith("lean_appends = false") and "(env DATANODE_LEAN_APPENDS)" in line
    assert "data-plane thread" in line
