"""The data path besides appends (ops/append.py): READ, CREATE_EXTENT, MARK_DELETE, WATERMARKS, PING.
Creating and deleting an extent are replicated: their steps, for the pipeline (ops/pipeline.py), are
``CreateExtent`` and ``MarkDelete``."""
from __future__ import annotations

import dataclasses
import os

from typing import NoReturn

from wire.protocol import Flag, Header, Op, Result
from ..replication import Replicator, replica_names
from .base import Handler, Reply, Request, RequestCounters, read_into, store_call
from .buffers import Buffers
from .partitions import Partitions
from .pipeline import Forwardable, Order, Pipeline, Replicated
from .stages import READ_DISK, READ_SENT, STARTED


class DataOps:
    def __init__(self, partitions: Partitions, buffers: Buffers, replication: Replicator,
                 counters: RequestCounters):
        self.partitions = partitions
        self.buffers = buffers
        self.replication = replication
        self.counters = counters
        self.pipeline = Pipeline(partitions, replication)
        self._create = CreateExtent(partitions)
        self._delete = MarkDelete()

    def handlers(self) -> dict[Op, Handler]:
        return {Op.PING: self.ping, Op.READ: self.read, Op.CREATE_EXTENT: self.create_extent,
                Op.MARK_DELETE: self.mark_delete, Op.WATERMARKS: self.watermarks}

    async def ping(self, rq: Request) -> Header:
        return rq.h.reply(Result.OK, arg=os.getpid())

    async def read(self, rq: Request) -> Header:
        conn, h, buffers = rq.conn, rq.h, self.buffers
        part = self.partitions.at_epoch(h)        # the buffer holds h.length bytes: checked by decode
        if not h.flags & Flag.ANY_REPLICA:
            self.partitions.leader_of(part)
        taken = await buffers.answer_budget(conn, h.length)     # before the disk: see buffers.ByteBudget
        block = None

        def release() -> None:          # the answer's block and budget, once the transport is done with them
            if block is not None:
                buffers.free(block, conn)
            conn.answers.give(taken)

        handed = False
        try:
            block = await buffers.alloc(h.length, conn)
            view = block.view(h.length)
            rq.stages.mark(STARTED)
            crc = await read_into(part.store, h.extent, h.offset, h.length, view)
            rq.stages.mark(READ_DISK)
            if h.length:
                # one-sided WRITE, posted: our response follows it on the connection, and the client checks
                # the bytes against the CRC in it.  The transport hands the block back (``release``) once it
                # no longer reads it: on TCP before the call returns, on verbs when the WRITE completes --
                # after our response is on its way behind it
                await buffers.write_remote(conn, view, h.remote.slice(0, h.length), posted=True, release=release)
                handed = True
                rq.stages.mark(READ_SENT)
        finally:
            if not handed:
                release()
        self.counters.reads += 1
        self.counters.read_bytes += h.length
        return h.reply(Result.OK, length=h.length, crc=crc, arg=self.partitions.size(part, h.extent))

    async def create_extent(self, rq: Request) -> Header:
        return await self.pipeline.run(self._create, rq)

    async def mark_delete(self, rq: Request) -> Header:
        return await self.pipeline.run(self._delete, rq)

    async def watermarks(self, rq: Request) -> Header:
        part = self.partitions.hosted(rq.h)
        return await self.buffers.push_json(rq.conn, rq.h, {str(k): v for k, v in part.store.watermarks().items()})


class CreateExtent(Forwardable):
    """The leader creates the extent (the store picks its id) and forwards that id; a follower creates it."""

    ORDER = Order.LOCAL_FORWARD          # the forward names the extent the local step made
    WHAT = "create"

    def __init__(self, partitions: Partitions):
        self.partitions = partitions

    async def local(self, x: Replicated) -> None:
        h, part = x.h, x.part
        if not x.leader:
            # The leader's repair and a client's create may race (both forwards may even be creating here at
            # once, in worker threads): an empty extent of that id is the same result either way.
            try:
                x.outcome = await store_call(part.store.create_extent, h.extent)
            except Reply as e:
                if not (e.result == Result.EXISTS and part.lane(h.extent) is not None
                        and self.partitions.size(part, h.extent) == 0):
                    raise
                x.outcome = h.extent
            return
        x.outcome = await store_call(part.store.create_extent, None)
        try:
            self.partitions.still_leading(part, h)   # stepped down during the create: take it back, redirect
        except Reply:
            await self._take_back(x)
            raise

    def forward(self, x: Replicated) -> tuple[Header, object]:
        return x.h.forwarded(extent=x.outcome), None

    async def replicas_failed(self, x: Replicated, failed: int) -> NoReturn:
        # not on every replica: take it back (its tombstone makes repair delete it where it did land), so a
        # client retrying against a dead follower does not leave an empty extent per try
        await self._take_back(x)
        raise Reply(Result.REPLICATION_FAILED, arg=failed,
                    why=f"replica {replica_names(x.fan.replicas, failed)} failed create (extent {x.outcome} "
                        f"taken back)")

    def answer(self, x: Replicated) -> Header:
        resp = x.h.reply(Result.OK, arg=x.outcome)
        return dataclasses.replace(resp, extent=x.outcome) if x.leader else resp

    @staticmethod
    async def _take_back(x: Replicated) -> None:
        await store_call(x.part.store.mark_delete, x.outcome)
        x.part.lanes.pop(x.outcome, None)


class MarkDelete(Forwardable):
    """Every replica marks the extent deleted: the leader only once every follower did."""

    ORDER = Order.ACKS_LOCAL             # a follower that failed leaves the extent in place here
    WHAT = "delete"

    async def local(self, x: Replicated) -> None:
        await store_call(x.part.store.mark_delete, x.h.extent)
        x.part.lanes.pop(x.h.extent, None)

    def answer(self, x: Replicated) -> Header:
        return x.h.reply(Result.OK)
