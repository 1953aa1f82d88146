"""Scrub: a leader re-reads every block of a partition on every replica and fixes the bad ones (the module
docstring of datanode/repair.py, "Scrub", says how).  ``ScrubPasses`` is a part of ``PartitionWorker``."""
from __future__ import annotations

import logging
import time

import trio

from wire.crc import crc32c
from wire.protocol import Flag, Header, Op, Result
from .repairkit import MiB, RepairAbort, _name
from .store import BLOCK, StoreError

log = logging.getLogger("datanode.repair")      # (the name operators know these lines by)
SCRUB_RANGE = 4 * MiB


def scrub_range(part, extent: int, offset: int, length: int) -> dict:
    """Re-read the blocks of ``[offset, offset+length)`` of one extent and check each block's CRC
    (blocking; runs in a worker thread).  Returns {"size", "bad": [block indexes], "checked": bytes}."""
    store = part.store
    size = store.size(extent)
    end = min(size, offset + length)
    buf = memoryview(bytearray(BLOCK))
    bad, checked = [], 0
    b = offset // BLOCK
    while b * BLOCK < end:
        n = min(BLOCK, size - b * BLOCK)
        try:
            store.read_into(extent, b * BLOCK, n, buf)
        except StoreError as e:
            if e.code == "crc":
                bad.append(b)
            elif e.code != "out_of_range":    # truncated meanwhile: nothing left to check
                raise
        checked += n
        b += 1
    return {"size": size, "bad": bad, "checked": checked}


class ScrubPasses:
    """The scrub pass of one partition (mixed into ``PartitionWorker``: ``rep``, ``pid``, ``part()``,
    ``running``, ``last_scrub``, ``_forward`` and ``_repair_extent`` are its)."""

    async def _scrub_pass(self, part) -> None:
        self.running = "scrub"
        t0 = time.monotonic()
        stats = {"extents": 0, "bytes": 0, "bad_blocks": 0, "repaired": 0, "events": []}
        try:
            for e, size in sorted(part.store.watermarks().items()):
                if self.part() is None:
                    return
                stats["extents"] += 1
                bad: dict[str, list[int]] = {}
                for off in range(0, size, SCRUB_RANGE):
                    n = min(SCRUB_RANGE, size - off)
                    await self.rep.scrub_limiter.take(n)
                    res = await self._scrub_all(part, e, off, n)
                    for addr, r in res.items():
                        if r.get("bad"):
                            bad.setdefault(addr, []).extend(r["bad"])
                    stats["bytes"] += n
                    self.rep.counters.scrub_bytes += n
                if bad:
                    await self._scrub_fix(part, e, bad, stats)
        finally:
            self.running = None
            self.rep.counters.scrub_passes += 1
            stats["seconds"] = round(time.monotonic() - t0, 3)
            stats["finished"] = time.time()
            self.last_scrub = stats
        log.info("partition %d: scrub pass: %d extents, %d bytes, %d bad blocks, %d repaired in %.2fs",
                 self.pid, stats["extents"], stats["bytes"], stats["bad_blocks"], stats["repaired"],
                 stats["seconds"])

    async def _scrub_all(self, part, e: int, off: int, n: int) -> dict:
        out: dict[str, dict] = {}

        async def one(addr):
            try:
                if addr == self.rep.me:
                    out[addr] = await self.rep.scrub_local(part, e, off, n)
                else:
                    out[addr] = await self.rep.call_json(addr, Header(
                        opcode=Op.SCRUB_EXTENT, partition=self.pid, extent=e, offset=off, length=n,
                        epoch=part.epoch))
            except (RepairAbort, StoreError) as err:
                out[addr] = {"error": str(err)}

        async with trio.open_nursery() as nursery:
            for addr in part.replicas:
                nursery.start_soon(one, addr)
        return out

    async def _scrub_fix(self, part, e: int, bad: dict[str, list[int]], stats: dict) -> None:
        nbad = sum(len(v) for v in bad.values())
        stats["bad_blocks"] += nbad
        self.rep.counters.scrub_bad_blocks += nbad
        for addr, blocks in bad.items():
            log.error("partition %d: scrub: extent %d on %s: bad block(s) %s", self.pid, e, addr, blocks)
            stats["events"].append({"extent": e, "replica": addr, "blocks": blocks})
        lane = part.lane(e)
        if lane is None:
            return
        self.rep.replication.seal(part, e, lane, f"scrub found bad blocks on {', '.join(bad)}")
        me = self.rep.me
        if me in bad:
            try:
                await self._fix_leader(part, e, lane, min(bad[me]), [a for a in part.replicas[1:]
                                                                      if a not in bad])
                stats["repaired"] += len(bad[me])
                self.rep.counters.scrub_repaired_blocks += len(bad[me])
            except RepairAbort as err:
                log.error("partition %d: scrub: could not repair extent %d here: %s", self.pid, e, err)
                return
        for addr, blocks in bad.items():
            if addr == me:
                continue
            try:
                async with lane.turn():
                    await self._forward(part, addr, Header(opcode=Op.TRUNCATE, extent=e,
                                                           offset=min(blocks) * BLOCK))
                    self.rep.counters.repair_truncates += 1
                await self._repair_extent(part, addr, e)
                stats["repaired"] += len(blocks)
                self.rep.counters.scrub_repaired_blocks += len(blocks)
                log.warning("partition %d: scrub: extent %d on %s repaired from block %d", self.pid, e, addr,
                            min(blocks))
            except RepairAbort as err:
                log.error("partition %d: scrub: repairing extent %d on %s failed: %s", self.pid, e, addr, err)

    async def _fix_leader(self, part, e: int, lane, first_bad: int, candidates: list[str]) -> None:
        """Our block ``first_bad`` of extent ``e`` is bad: refill from a follower whose copy verifies."""
        lsize, lent = await trio.to_thread.run_sync(part.block_entries, e)
        source = None
        for addr in candidates:
            try:
                fst = await self.rep.call_json(addr, Header(opcode=Op.BLOCK_CRCS, partition=self.pid,
                                                            extent=e, epoch=part.epoch))
            except RepairAbort:
                continue
            if fst["size"] == lsize and [tuple(x) for x in fst["blocks"][first_bad:]] == \
                    [tuple(x) for x in lent[first_bad:]]:
                source = addr
                break
        if source is None:
            raise RepairAbort(f"no follower holds a verified copy of extent {e} from block {first_bad}")
        cut = first_bad * BLOCK
        try:
            async with lane.turn():
                await trio.to_thread.run_sync(part.store.truncate, e, cut)
                pos = cut
                while pos < lsize:
                    n = min(self.rep.chunk, lsize - pos)
                    await self.rep.limiter.take(n)
                    block = await self.rep.landing.alloc(n, timeout=self.rep.cfg.pool_wait)
                    try:
                        view = block.view(n)
                        r = await self.rep.call(source, Header(
                            opcode=Op.READ, partition=self.pid, extent=e, offset=pos, length=n, epoch=part.epoch,
                            addr=block.addr, rkey=self.rep.landing_region.rkey, rlen=n, flags=Flag.ANY_REPLICA))
                        if r.result != Result.OK or crc32c(view) != r.crc:
                            raise RepairAbort(f"reading extent {e} at {pos} from {source}: {_name(r.result)}")
                        await trio.to_thread.run_sync(part.store.write, e, pos, view, r.crc)
                    finally:
                        self.rep.landing.free(block)
                    pos += n
                    self.rep.counters.repair_bytes += n
        except StoreError as err:
            raise RepairAbort(f"extent {e} here: {err}") from None
        log.warning("partition %d: scrub: our extent %d refilled from %s from block %d (%d bytes)",
                    self.pid, e, source, first_bad, lsize - cut)
