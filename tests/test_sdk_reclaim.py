"""The SDK and deleted extents (what the mount's reclaim does): a client whose open extent is deleted -- by
itself or by another client -- goes on in a new extent.  A real 1-node cluster."""
from __future__ import annotations

from tests.conftest import create_partition, open_client, pattern, run


def test_deleting_the_extent_being_appended_to_opens_a_new_one(nodes):
    [n] = nodes(1)

    async def main():
        async with open_client("tcp") as dc:
            await create_partition(dc, 1, [n.addr])
            [first] = await dc.write(1, pattern(1, 4096))
            await dc.delete_extent(1, first.extent)
            [second] = await dc.write(1, pattern(2, 4096))
            assert second.extent != first.extent and second.offset == 0
            assert await dc.read_location(second) == pattern(2, 4096)
    run(main)


def test_an_extent_deleted_by_another_client_is_left_for_a_new_one(nodes):
    [n] = nodes(1)

    async def main():
        async with open_client("tcp") as writer, open_client("tcp") as reclaimer:
            await create_partition(writer, 1, [n.addr])
            await reclaimer.discover(n.addr)
            [first] = await writer.write(1, pattern(1, 4096))
            await reclaimer.delete_extent(1, first.extent)
            locs = await writer.write(1, pattern(2, 3 << 20))      # several appends: the first one is refused
            assert {loc.extent for loc in locs} != {first.extent}
            got = b"".join([await writer.read_location(loc) for loc in locs])
            assert got == pattern(2, 3 << 20)
    run(main)
