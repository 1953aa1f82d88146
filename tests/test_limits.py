"""The cluster's size limits (wire/limits.py): one number each, one wording of the refusal everywhere, and a
local cluster of many nodes that works (real `dnctl` processes)."""
from __future__ import annotations

import json

import pytest

from manager.placement import PlacementError, place
from tests.test_cli import dnctl, refused
from tools.etcd_cluster import etcd_binary
from wire.limits import DEFAULT_REPLICAS, MAX_NODES, MAX_PARTITIONS_PER_NODE, MAX_REPLICAS
from wire.protocol import BodyError, decode_view


def test_one_wording_for_too_many_replicas():
    with pytest.raises(BodyError, match=f"1..{MAX_REPLICAS} replicas, not {MAX_REPLICAS + 1}"):
        decode_view({"replicas": [f"h:{i}" for i in range(1, MAX_REPLICAS + 2)], "epoch": 1})
    p = dnctl("partition", "create", "--replicas", MAX_REPLICAS + 1, "--etcd", "http://127.0.0.1:1")
    refused(p, f"1..{MAX_REPLICAS} replicas, not {MAX_REPLICAS + 1}")
    p = dnctl("cluster", "up", "--nodes", MAX_NODES + 1, "--cluster", "/nonexistent/never")
    refused(p, f"1<=x<={MAX_NODES}")


def test_placement_skips_full_nodes():
    nodes = {f"n{i}:1": {"free_bytes": 1 << 30} for i in range(4)}
    full = {"n0:1": MAX_PARTITIONS_PER_NODE}
    for reps in place(nodes, 10, 3, held=full):
        assert "n0:1" not in reps
    with pytest.raises(PlacementError, match="fewer than"):
        place(nodes, 1, 4, held=full)


@pytest.mark.skipif(not __import__("shutil").which("etcd"), reason="no etcd")
@pytest.mark.timeout(1200)
def test_cluster_up_32_nodes(tmp_path):
    """`cluster up --nodes 32` works: partition 1 on the default replica count, status shows every node, a
    put goes through; then `cluster down`."""
    etcd_binary()
    root = tmp_path / "c"
    try:
        dnctl("cluster", "up", "--nodes", 32, "--cluster", root, "--pool-mib", 8, "--min-writable", 0,
              "--start-timeout", 120, check=True, timeout=900)
        st = json.loads(dnctl("cluster", "status", "--cluster", root, "--json", check=True, timeout=300).stdout)
        assert len(st["nodes"]) == 32 and all(n["health"] == "up" for n in st["nodes"]), st["nodes"]
        parts = json.loads(dnctl("partition", "list", "--cluster", root, "--json", check=True).stdout)
        parts = parts["partitions"] if isinstance(parts, dict) else parts
        p1, = [p for p in parts if p["id"] == 1]
        assert len(p1["replicas"]) == DEFAULT_REPLICAS, p1
        src = tmp_path / "f.bin"
        src.write_bytes(b"x" * 100_000)
        put = json.loads(dnctl("put", "--cluster", root, "--partition", 1, src, "--json", check=True).stdout)
        assert put["size"] == 100_000, put
    finally:
        dnctl("cluster", "down", "--cluster", root, timeout=300)
