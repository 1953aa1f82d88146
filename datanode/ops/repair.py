"""The follower's side of the leader's repair and scrub (the work itself is in datanode/repair.py)."""
from __future__ import annotations

import json

import trio

from wire.protocol import STATES_WINDOW, Header, Op, Result, Role
from ..health import follower_token, tokens_page
from ..repair import RepairCounters, scrub_range
from .base import Handler, Reply, Request, store_call
from .buffers import Buffers
from .partitions import Partitions
from .pipeline import Forwardable, Pipeline, Replicated


def state_of(part, token: int, dig: dict) -> dict:
    """A copy's REPLICA_STATE answer: its view, whether it is known synced, its extents' sizes and digests
    (``dig``: ``ExtentStore.digests``), and its change token taken before them."""
    return {"token": token, "epoch": part.epoch, "replicas": part.replicas, "synced": part.synced, "cuts": part.cuts,
            "marks": {str(k): v[0] for k, v in dig.items()},
            "digests": {str(k): v[1] for k, v in dig.items()},
            "deleted": sorted(part.deleted_extents()), "sealed": sorted(int(e) for e in part.sealed),
            **({"volume": part.volume} if part.volume else {})}    # a new replica takes it (ops/admin.py)


class RepairOps:
    def __init__(self, partitions: Partitions, buffers: Buffers, counters: RepairCounters):
        self.partitions = partitions
        self.buffers = buffers
        self.counters = counters
        self.pipeline = Pipeline(partitions, None)
        self._truncate = Truncate(partitions)

    def handlers(self) -> dict[Op, Handler]:
        return {Op.REPLICA_STATE: self.replica_state, Op.BLOCK_CRCS: self.block_crcs,
                Op.SCRUB_EXTENT: self.scrub_extent, Op.TRUNCATE: self.truncate, Op.NODE_HEALTH: self.node_health,
                Op.REPLICA_STATES: self.replica_states}

    async def node_health(self, rq: Request) -> Header:
        """A leader's one probe of this node per heartbeat: a change token for each partition held here that
        it leads (datanode/health.py), a page from the partition id in ``arg``."""
        asker = rq.conn.identity if rq.conn.role != Role.ADMIN else ""
        return await self.buffers.push_json(rq.conn, rq.h, tokens_page(self.partitions.table, asker, rq.h.arg))

    async def replica_state(self, rq: Request) -> Header:
        """Our view and extents, and whether our copy is known synced (``cuts``: what a confirmation must
        name).  With ``arg`` = cuts + 1 it is our leader's confirmation that this copy, as it answered last,
        holds every acknowledged byte (only from the leader, at our epoch: checked on admission, ops/admit.py);
        one sent before a cut since is void."""
        h = rq.h
        part = self.partitions.hosted(h)
        if h.arg and h.epoch == part.epoch and part.leader != self.partitions.me and h.arg - 1 == part.cuts:
            if not part.synced:
                part.synced = True
                await store_call(part.save)
                self.partitions.counters.synced_confirms += 1
        token = follower_token(part)     # (before the snapshot: a change after it moves the token)
        dig = await trio.to_thread.run_sync(part.store.digests)     # sizes and digests: one snapshot per extent
        return await self.buffers.push_json(rq.conn, h, state_of(part, token, dig))

    async def replica_states(self, rq: Request) -> Header:
        """REPLICA_STATE of the partitions a window names (``partition`` + each bit of ``arg``), as many as
        the requester's buffer holds: one request where a failover's view checks would send hundreds."""
        h = rq.h
        pids = [h.partition + i for i in range(STATES_WINDOW) if h.arg >> i & 1]
        parts = [p for p in map(self.partitions.table.get, pids) if p is not None]
        tokens = [follower_token(p) for p in parts]
        digs = await trio.to_thread.run_sync(lambda: [p.store.digests() for p in parts])   # one thread hop
        states, left, size = {}, [], 64
        for part, token, dig in zip(parts, tokens, digs):
            st = state_of(part, token, dig)
            n = len(json.dumps(st)) + 16
            if size + n + 8 * len(pids) > h.rlen:
                left.append(part.pid)       # (the requester asks again, alone if need be)
                continue
            states[str(part.pid)] = st
            size += n
        held = {p.pid for p in parts}
        return await self.buffers.push_json(rq.conn, h, {
            "states": states, "absent": [pid for pid in pids if pid not in held], "left": left})

    async def block_crcs(self, rq: Request) -> Header:
        size, entries = await store_call(self.partitions.hosted(rq.h).block_entries, rq.h.extent)
        return await self.buffers.push_json(rq.conn, rq.h, {"size": size, "blocks": entries})

    async def scrub_extent(self, rq: Request) -> Header:
        h = rq.h
        res = await store_call(scrub_range, self.partitions.hosted(h), h.extent, h.offset, h.length)
        self.counters.scrub_bytes += res["checked"]
        return await self.buffers.push_json(rq.conn, h, res)

    async def truncate(self, rq: Request) -> Header:
        """Leader's repair -> follower: cut an extent back to ``offset`` bytes (in the extent's turn)."""
        return await self.pipeline.run(self._truncate, rq)


class Truncate(Forwardable):
    """A leader's repair cuts a follower's extent back to ``offset`` bytes: only ever a forward (a leader
    truncates its own copy never), in the extent's turn, after every write of it handed to the disk."""

    FOLLOWERS_ONLY = "only a leader's repair truncates, and only on followers"
    WHAT = "truncate"

    def __init__(self, partitions: Partitions):
        self.partitions = partitions

    async def prepare(self, x: Replicated) -> None:
        if x.rq.ticket is None:
            raise Reply(Result.NOT_FOUND, why=f"extent {x.h.extent} does not exist")

    def turn(self, x: Replicated):
        lane, t = x.rq.ticket
        return lane.turn(t)

    async def local(self, x: Replicated) -> None:
        # cut back at a block boundary, the copy may miss acknowledged bytes until the leader refills it and
        # confirms it again: until then it may not lead (datanode/viewguard.py)
        part, h = x.part, x.h
        part.cuts += 1
        if part.synced:
            part.synced = False
            await store_call(part.save)
        await store_call(part.store.truncate, h.extent, h.offset)

    def answer(self, x: Replicated) -> Header:
        return x.h.reply(Result.OK, arg=x.h.offset)
