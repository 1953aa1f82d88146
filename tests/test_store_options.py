"""The extent store's settings are node.toml keys (datanode/config.py) handed to every store the node opens
(``StoreOptions``), not environment variables."""
from __future__ import annotations

import dataclasses

import pytest

from datanode import config
from datanode.store import ExtentStore, StoreOptions
from wire.protocol import Op
from tests.conftest import create_partition, open_client, pattern, run

KiB = 1 << 10


def test_the_store_keys_default_to_the_stores_own_defaults_and_are_checked():
    assert StoreOptions.from_config(config.Config()) == StoreOptions()
    assert {f.name for f in dataclasses.fields(StoreOptions)} <= {f.name for f in dataclasses.fields(config.Config)}
    cfg = config.from_dict({"one_flush": False, "free_step_bytes": 0, "prefill_bytes": 64 * KiB,
                            "direct_reads": False, "direct_writes": False})
    assert StoreOptions.from_config(cfg) == StoreOptions(False, 0, 64 * KiB, False, False)
    for key, value in [("free_step_bytes", -1), ("prefill_bytes", -4096), ("one_flush", 1), ("direct_reads", "no")]:
        with pytest.raises(config.ConfigError, match=key):
            config.from_dict({key: value})


@pytest.mark.parametrize("prefill", [0, 64 * KiB])
def test_prefill_bytes_is_how_far_a_small_durable_append_zero_fills_ahead(tmp_path, prefill):
    s = ExtentStore(tmp_path, sync="always", options=StoreOptions(prefill_bytes=prefill))
    eid = s.create_extent()
    s.write(eid, 0, b"x" * 4096)
    assert (tmp_path / "extents" / f"{eid}.dat").stat().st_size == max(prefill, 4096)
    s.close()                                   # a clean close gives the zeros back
    assert (tmp_path / "extents" / f"{eid}.dat").stat().st_size == 4096


def test_a_nodes_store_keys_reach_its_stores(nodes):
    """A node started with ``one_flush = false`` and ``prefill_bytes = 0`` flushes small durable appends with
    two fdatasyncs each (NODE_STATUS one_flushes stays 0) and writes no zeros past an extent's end."""
    [node] = nodes(1, sync="always", one_flush=False, prefill_bytes=0)

    async def body():
        async with open_client("tcp", [node.addr]) as dc:
            await create_partition(dc, 1, [node.addr])
            eid = await dc.create_extent(1)
            for k in range(8):
                await dc.append(1, eid, k * 4 * KiB, pattern(k, 4 * KiB))
            return eid, (await dc.admin(node.addr, Op.NODE_STATUS))["counters"]

    eid, counters = run(body)
    assert counters["one_flushes"] == 0, counters
    dat = node.root / "data" / "partitions" / "1" / "store" / "extents" / f"{eid}.dat"
    assert dat.stat().st_size == 8 * 4 * KiB
