"""Reading: a range of an extent as block-sized READs, each checked against its CRC, failing over to another
replica (acknowledged bytes are on every replica)."""
from __future__ import annotations

import trio

from client.channel import Channel, ClientError, check
from client.routing import PartitionMap
from wire import aio, trace
from wire.crc import crc32c
from wire.protocol import Flag, Header, Op, Result


class Reader:
    """The client's reads: which replica to ask, the pieces of a long range, the retries."""

    def __init__(self, channel: Channel, routes: PartitionMap, *, block_size: int, depth: int, read_from: str):
        self.channel, self.routes = channel, routes
        self.block_size, self.depth = block_size, depth
        # "spread": each read request goes to the next replica in turn (acknowledged bytes are on every
        # replica), the others as fallbacks; "leader": the leader first
        self.read_from = read_from
        self._next_replica = 0

    async def read_into(self, pid: int, extent: int, offset: int, buf, *, replica: str | None = None) -> int:
        part = self.routes.partition(pid)
        order = [replica] if replica else self._usual(part.replicas)
        view = memoryview(buf).cast("B")
        length = len(view)
        if not length:
            return 0
        if length <= self.block_size:          # one request: no nursery
            if not replica and self.read_from == "spread" and len(order) > 1:
                order = self._spread(part)
            await self._read_one(part, order, extent, offset, view)
            return length
        pos = 0
        failed: list[ClientError] = []
        async with aio.nursery() as n:
            limit = trio.Semaphore(self.depth)
            while pos < length:
                k = min(self.block_size, length - pos)
                await limit.acquire()
                if failed:                # start no more; the pieces in flight finish (see _read_piece)
                    limit.release()
                    break
                if not replica and self.read_from == "spread" and len(order) > 1:
                    order = self._spread(part)
                n.start_soon(self._read_piece, part, order, extent, offset + pos, view[pos:pos + k], limit,
                             failed)
                pos += k
        if failed:
            raise failed[0]
        return length

    def _spread(self, part) -> list[str]:
        """The replicas in the order to try for the next read under ``read_from='spread'``."""
        i = self._next_replica % len(part.replicas)
        self._next_replica += 1
        return self._usual(list(part.replicas[i:]) + list(part.replicas[:i]))

    def _usual(self, replicas) -> list[str]:
        """``replicas`` with those that stopped answering (``Channel.suspect``) last: they are tried only when
        every other one failed."""
        return sorted(replicas, key=self.channel.suspect)

    async def _read_piece(self, part, order, extent, offset, dest, limit, failed):
        """One piece of a ``read_into``.  A failed piece does not cancel the others: cancelling a READ in
        flight revokes its landing buffer under the node's answer, and on verbs the node's refused RDMA
        WRITE resets the whole connection (every other request on it fails too)."""
        try:
            await self._read_one(part, order, extent, offset, dest)
        except ClientError as e:
            failed.append(e)
        finally:
            limit.release()

    async def _read_one(self, part, order, extent, offset, dest):
        """One READ request of ``len(dest)`` bytes into ``dest``, trying the replicas in ``order``."""
        length = len(dest)
        errors = []
        refreshed = redialed = False
        queue = list(order)
        while queue:
            addr = queue.pop(0)
            flags = Flag.ANY_REPLICA if addr != part.replicas[0] else Flag.NONE
            h = Header(opcode=Op.READ, partition=part.pid, extent=extent, offset=offset, length=length,
                       epoch=part.epoch, flags=flags)
            try:
                if trace.ON:
                    trace.mark("read.submit", extent, offset)
                resp, _ = await self.channel.request(addr, h, answer=max(length, 1), sink=dest)
                check(resp, addr, part)
                if resp.length != length or crc32c(dest) != resp.crc:
                    raise ClientError(f"{addr}: data arrived with a bad CRC", Result.CRC_MISMATCH, addr)
                if trace.ON:
                    trace.mark("read.answered", extent, offset)
            except ClientError as e:
                if e.result == Result.STALE_EPOCH and not refreshed:   # the map changed: reload, retry
                    refreshed = True
                    part = await self.routes.refresh(part.pid)
                    queue.insert(0, addr)
                    continue
                if e.conn_lost and not redialed:     # a READ is safe to repeat: once, on a new connection
                    redialed = True
                    queue.insert(0, addr)
                    continue
                errors.append(e)     # a replica being repaired may not have the range yet: next one
                continue
            return
        dest[:] = bytes(length)           # never leave unverified bytes in the caller's buffer
        if len(errors) == 1:
            raise errors[-1]
        reasons: dict[str, list[str]] = {}      # one reason, once, with the replicas that gave it
        for e in errors:
            text = str(e)
            node = e.node or ""
            reasons.setdefault(text[len(node) + 2:] if node and text.startswith(node + ": ") else text,
                               []).append(node or "?")
        raise ClientError("read failed on every replica: " + "; ".join(
            f"{', '.join(nodes)}: {why}" for why, nodes in reasons.items()), errors[-1].result,
            errors[-1].node, errors[-1].arg)
