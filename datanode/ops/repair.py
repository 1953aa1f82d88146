"""The follower's side of the leader's repair and scrub (the work itself is in datanode/repair.py)."""
from __future__ import annotations

import trio

from ..protocol import Flag, Header, Result
from ..repair import scrub_range
from .base import Handlers, Reply


class RepairOps(Handlers):
    async def op_replica_state(self, conn, h: Header, _t) -> Header:
        part = self._hosted(h)
        dig = await trio.to_thread.run_sync(part.store.digests)     # sizes and digests: one snapshot per extent
        return await self._push_json(conn, h, {
            "epoch": part.epoch, "replicas": part.replicas,
            "marks": {str(k): v[0] for k, v in dig.items()},
            "digests": {str(k): v[1] for k, v in dig.items()},
            "deleted": sorted(part.deleted_extents()), "sealed": sorted(int(e) for e in part.sealed)})

    async def op_block_crcs(self, conn, h: Header, _t) -> Header:
        size, entries = await self._store(self._hosted(h).block_entries, h.extent)
        return await self._push_json(conn, h, {"size": size, "blocks": entries})

    async def op_scrub_extent(self, conn, h: Header, _t) -> Header:
        res = await self._store(scrub_range, self._hosted(h), h.extent, h.offset, h.length)
        self.repair.counters.scrub_bytes += res["checked"]
        return await self._push_json(conn, h, res)

    async def op_truncate(self, conn, h: Header, ticket) -> Header:
        """Leader's repair -> follower: cut an extent back to ``offset`` bytes (in the extent's turn)."""
        part = self._partition(h)
        if not h.flags & Flag.FORWARDED or part.leader == self.me:
            raise Reply(Result.WRONG_ROLE, why="only a leader's repair truncates, and only on followers")
        if ticket is None:
            raise Reply(Result.NOT_FOUND, why=f"extent {h.extent} does not exist")
        lane, t = ticket
        async with lane.turn(t):
            await self._store(part.store.truncate, h.extent, h.offset)
        return h.reply(Result.OK, arg=h.offset)

    HANDLERS = {"REPLICA_STATE": op_replica_state, "BLOCK_CRCS": op_block_crcs,
                "SCRUB_EXTENT": op_scrub_extent, "TRUNCATE": op_truncate}
