"""Releasing data on the datanodes: the deletion queue's worker.

The datanode is append-only and frees space a whole extent at a time (``MARK_DELETE``).  An extent goes
into the metadata's deletion queue whenever a slice into it is dropped or trimmed (overwrite, truncate,
unlink).  The reclaimer deletes it on the datanodes only if, at that moment, no slice references it and no
write can be about to commit one: flushes hold the :class:`DataLock` shared, the reclaimer exclusive while it
checks -- not while it deletes (``Reclaimer._pass``).  An extent still referenced just leaves the queue (it
comes back when its next slice goes).
"""
from __future__ import annotations

import logging

import trio

from client.sdk import ClientError, DataClient
from wire.protocol import Result

from client.fs.meta import Meta

log = logging.getLogger(__name__)

GATHER_S = 0.2    # a pass starts this long after the removal that asked for it, so the removals of an `rm -r`
                  # share a pass rather than each paying one (its queue query, the lock, the task switches)


class DataLock:
    """Many flushes at once, or one reclaim pass; a waiting reclaim pass stops new flushes from starting.
    Letting go never waits, so a cancelled flush or pass cannot leave it held (the unmount's last pass would
    wait forever); and a flush takes it without a scheduler pass when no pass wants it (nearly always)."""

    def __init__(self):
        self._shared = 0
        self._exclusive = False       # held, or waited for, by a reclaim pass
        self._lot = trio.lowlevel.ParkingLot()

    async def acquire_shared(self) -> None:
        while self._exclusive:
            await self._lot.park()
        self._shared += 1

    async def release_shared(self) -> None:
        self._shared -= 1
        if self._exclusive and not self._shared:
            self._lot.unpark_all()

    async def acquire_exclusive(self) -> None:
        while self._exclusive:
            await self._lot.park()
        self._exclusive = True
        try:
            while self._shared:
                await self._lot.park()
        except BaseException:             # cancelled while the flushes drained: let them go on
            await self.release_exclusive()
            raise

    async def release_exclusive(self) -> None:
        self._exclusive = False
        self._lot.unpark_all()


class Reclaimer:
    def __init__(self, meta: Meta, dc: DataClient, lock: DataLock | None = None, batch: int = 64):
        self.meta, self.dc, self.lock, self.batch = meta, dc, lock or DataLock(), batch
        self.deleted = 0
        self._kick = trio.Event()

    def kick(self) -> None:
        self._kick.set()

    async def run(self, interval: float = 1.0, gather: float = GATHER_S) -> None:
        while True:
            with trio.move_on_after(interval):
                await self._kick.wait()
            await trio.sleep(gather)
            self._kick = trio.Event()
            try:
                await self.drain()
            except ClientError as e:        # the cluster is unreachable: the queue is kept, try again later
                log.warning("deletion queue: %s", e)
            except Exception:               # noqa: BLE001 - never take the mount down; the queue is kept
                log.exception("deletion queue")

    async def drain(self) -> int:
        """Work through the queue; returns how many extents were deleted on the datanodes."""
        total = 0
        while True:
            batch = await self.meta.queued(self.batch)
            if not batch:
                return total
            n = await self._pass(batch)
            total += n
            if n == 0 and len(batch) < self.batch:
                return total

    async def _pass(self, batch) -> int:
        """Release what ``batch`` holds that no slice references.  Under the lock (exclusive) each extent is
        checked and, if nothing references it, the SDK is told never to append to it again; the deletions on
        the datanodes then run with the lock let go, so no file's flush waits for those round trips.  Nothing
        can reference such an extent meanwhile: only a flush adds a slice into a new place -- an extent it
        appended to -- and none appends to it any more."""
        unreferenced = []
        await self.lock.acquire_exclusive()
        try:
            for pid, extent in batch:
                if await self.meta.referenced(pid, extent):
                    await self.meta.dequeue(pid, extent)        # back in the queue when its next slice goes
                else:
                    self.dc.forget_extent(pid, extent)
                    unreferenced.append((pid, extent))
        finally:
            await self.lock.release_exclusive()
        deleted = 0
        for pid, extent in unreferenced:
            try:
                await self.dc.delete_extent(pid, extent)
                deleted += 1
                log.info("extent %d/%d released (no slice references it)", pid, extent)
            except ClientError as e:
                if e.result != Result.NOT_FOUND:
                    log.warning("delete extent %d/%d: %s (kept in the queue)", pid, extent, e)
                    continue
            await self.meta.dequeue(pid, extent)
        self.deleted += deleted
        return deleted
