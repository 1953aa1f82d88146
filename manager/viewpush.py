"""The active manager's view installs to one node, coalesced: a failover or a hand-off changes hundreds of
partitions at once, and one ``PARTITION_UPDATE`` each costs the node a request and two fsyncs per partition
(its meta.json), the manager a request per partition.  ``ViewPush.update`` is ``PARTITION_UPDATE``'s
drop-in: the updates waiting for the same node go together in one ``PARTITION_UPDATE_MANY`` (at most
``MAX_VIEWS_PER_UPDATE``), which the node installs with one durable sync for the batch and answers only
once every view in it is on disk.

No caller waits for a timer: the first update for a node is sent at once (alone), and the ones that arrive
while it is under way (``SENDERS`` batches at most per node) go in the next batch.  The callers take turns
sending: each sends batches (its own and others') until its own is answered, so no task outlives them.

An entry the node did not install (the answer's bitmask: not hosted, an older or refused view, ...) is sent
again alone as ``PARTITION_UPDATE``, whose result code says why -- the caller sees exactly what a plain
``PARTITION_UPDATE`` would have told it.  So does every update to a node whose protocol version predates
the batch (``OP_SINCE``), and every entry of a batch the node refused as a whole.
"""
from __future__ import annotations

import logging

import trio

from client.sdk import ClientError
from wire.limits import MAX_VIEWS_PER_UPDATE
from wire.protocol import OP_SINCE, Op

log = logging.getLogger("manager.service")
SENDERS = 2            # batches under way to one node at once


class _Update:
    __slots__ = ("pid", "body", "done", "error")

    def __init__(self, pid: int, body: dict):
        self.pid, self.body = pid, body
        self.done = trio.Event()
        self.error: BaseException | None = None


class ViewPush:
    """Coalesced ``PARTITION_UPDATE``s through ``dc`` (a client.sdk.DataClient with admin credentials)."""

    def __init__(self, dc):
        self.dc = dc
        self._queue: dict[str, list[_Update]] = {}
        self._sending: dict[str, int] = {}
        self._moved: dict[str, trio.Event] = {}    # per node: a batch was answered (a turn to send is free)
        self.batches = 0                            # PARTITION_UPDATE_MANY requests sent (tests, logs)
        self.singles = 0                            # PARTITION_UPDATEs sent (old nodes, entries not installed)

    async def update(self, addr: str, pid: int, body: dict):
        """Install view ``body`` ({"replicas", "epoch"}) of partition ``pid`` on ``addr``; raises ClientError
        as ``PARTITION_UPDATE`` would (STALE_EPOCH, NOT_FOUND, LAST_COPY, unreachable...)."""
        if not await self._batches(addr):
            return await self._single(addr, pid, body)
        u = _Update(pid, body)
        self._queue.setdefault(addr, []).append(u)
        while not u.done.is_set():
            queue = self._queue.get(addr) or []
            if queue and self._sending.get(addr, 0) < SENDERS:
                batch = queue[:MAX_VIEWS_PER_UPDATE]
                del queue[:MAX_VIEWS_PER_UPDATE]
                self._sending[addr] = self._sending.get(addr, 0) + 1
                try:
                    await self._send(addr, batch)
                finally:
                    self._sending[addr] -= 1
                    self._moved.pop(addr, trio.Event()).set()
            else:
                await self._moved.setdefault(addr, trio.Event()).wait()
        if u.error is not None:
            raise u.error
        return None

    async def _batches(self, addr: str) -> bool:
        """Whether ``addr`` takes PARTITION_UPDATE_MANY (its connection's protocol version)."""
        try:
            link = await self.dc.links.get(addr)
        except Exception:  # noqa: BLE001 - unreachable: the single request says so, as before
            return False
        return link.conn.version >= OP_SINCE[Op.PARTITION_UPDATE_MANY]

    async def _single(self, addr: str, pid: int, body: dict):
        self.singles += 1
        return await self.dc.admin(addr, Op.PARTITION_UPDATE, partition=pid, body=body)

    async def _send(self, addr: str, batch: list[_Update]) -> None:
        """One batch; every entry ends done (with its error, if any), also when we are cancelled."""
        again = batch
        try:
            if len(batch) > 1:
                self.batches += 1
                try:
                    resp = await self.dc.admin(addr, Op.PARTITION_UPDATE_MANY,
                                               body={"views": [{"partition": u.pid, **u.body} for u in batch]})
                    again = [u for i, u in enumerate(batch) if resp.arg >> i & 1]
                except ClientError as e:
                    log.info("%s: %d views in one request failed (%s): sending them one at a time", addr,
                             len(batch), e)

            async def alone(u: _Update) -> None:
                try:
                    await self._single(addr, u.pid, u.body)
                except ClientError as e:
                    u.error = e
            async with trio.open_nursery() as n:
                for u in again:
                    n.start_soon(alone, u)
        except BaseException as e:
            for u in batch:
                if not u.done.is_set() and u.error is None:
                    u.error = ClientError(f"partition {u.pid}: installing on {addr} was cut short ({e!r})")
            raise
        finally:
            for u in batch:
                u.done.set()
