"""The active manager's view installs to one node, coalesced: a failover or a hand-off changes hundreds of
partitions at once, and one ``PARTITION_UPDATE`` each costs the node a request and two fsyncs per partition
(its meta.json), the manager a request per partition.  ``ViewPush.update`` is ``PARTITION_UPDATE``'s
drop-in: the updates waiting for the same node go together in one ``PARTITION_UPDATE_MANY`` (at most
``MAX_VIEWS_PER_UPDATE``), which the node installs with one durable sync for the batch and answers only
once every view in it is on disk.

The updates that wait for the same node while earlier ones are under way go together (manager/combine.py:
no timer, ``SENDERS`` requests at most under way per node).

An entry the node did not install (the answer's bitmask: not hosted, an older or refused view, ...) is sent
again alone as ``PARTITION_UPDATE``, whose result code says why -- the caller sees exactly what a plain
``PARTITION_UPDATE`` would have told it.  So does every update to a node whose protocol version predates
the batch (``OP_SINCE``), and every entry of a batch the node refused as a whole.  A batch the node did not
answer (unreachable, timed out) fails each of its updates with that error: retried on the next pass, not
sent again one by one to a node that is already slow.
"""
from __future__ import annotations

import logging

import trio

from client.sdk import ClientError
from wire.limits import MAX_VIEWS_PER_UPDATE
from wire.protocol import OP_SINCE, Op
from manager.combine import Combiner

log = logging.getLogger("manager.service")
SENDERS = 2            # batches under way to one node at once


class ViewPush:
    """Coalesced ``PARTITION_UPDATE``s through ``dc`` (a client.sdk.DataClient with admin credentials)."""

    def __init__(self, dc):
        self.dc = dc
        self._combine = Combiner(self._send, max_batch=MAX_VIEWS_PER_UPDATE, senders=SENDERS,
                                 cut_short=lambda addr: ClientError(f"installing views on {addr} was cut short",
                                                                    node=addr))
        self.batches = 0                            # PARTITION_UPDATE_MANY requests sent (tests, logs)
        self.singles = 0                            # PARTITION_UPDATEs sent (old nodes, entries not installed)

    async def update(self, addr: str, pid: int, body: dict) -> None:
        """Install view ``body`` ({"replicas", "epoch"}) of partition ``pid`` on ``addr``; raises ClientError
        as ``PARTITION_UPDATE`` would (STALE_EPOCH, NOT_FOUND, LAST_COPY, unreachable...)."""
        if not await self._batches(addr):
            await self._single(addr, pid, body)
            return
        await self._combine.submit(addr, (pid, body))

    async def _batches(self, addr: str) -> bool:
        """Whether ``addr`` takes PARTITION_UPDATE_MANY (its connection's protocol version)."""
        try:
            link = await self.dc.links.get(addr)
        except Exception:  # noqa: BLE001 - unreachable: the single request says so, as before
            return False
        return link.conn.version >= OP_SINCE[Op.PARTITION_UPDATE_MANY]

    async def _single(self, addr: str, pid: int, body: dict) -> None:
        self.singles += 1
        await self.dc.admin(addr, Op.PARTITION_UPDATE, partition=pid, body=body)

    async def _send(self, addr: str, batch: list[tuple[int, dict]]) -> list:
        """One batch: None per view installed, else the ClientError its PARTITION_UPDATE alone answered."""
        again = list(range(len(batch)))
        if len(batch) > 1:
            self.batches += 1
            try:
                resp = await self.dc.admin(addr, Op.PARTITION_UPDATE_MANY,
                                           body={"views": [{"partition": pid, **body} for pid, body in batch]})
                again = [i for i in again if resp.arg >> i & 1]
            except ClientError as e:
                if e.result is None:                # no answer (unreachable, timed out): none is any better
                    return [e] * len(batch)
                log.info("%s: %d views in one request refused (%s): sending them one at a time", addr,
                         len(batch), e)
        out: list = [None] * len(batch)

        async def alone(i: int) -> None:
            try:
                await self._single(addr, *batch[i])
            except ClientError as e:
                out[i] = e
        async with trio.open_nursery() as n:
            for i in again:
                n.start_soon(alone, i)
        return out
