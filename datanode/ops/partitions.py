"""The node's partitions as requests see them: a request's partition at its epoch, whether this node leads
it (a self-fenced leader leads nothing), and the changes of the partitions held here (a newer view
installed, a partition dropped), one at a time."""
from __future__ import annotations

import contextlib
import logging
from typing import Callable

import trio

from wire.protocol import Header, Result
from ..config import NodeConfig
from ..etcdagent import EtcdAgent
from ..partition import Partition, PartitionTable
from ..store import StoreError
from .. import viewguard
from .base import RequestCounters, Reply, store_call, store_reply

log = logging.getLogger(__name__)


class Partitions:
    def __init__(self, cfg: NodeConfig, me: str, table: PartitionTable, counters: RequestCounters,
                 agent: EtcdAgent | None, changed: Callable[[bool], None]):
        self.cfg = cfg
        self.me = me
        self.table = table
        self.counters = counters
        self.agent = agent         # the cluster map in etcd, when configured: leaders self-fence by it
        self.changed = changed     # (kick) the partitions held here changed: tell the agent, and repair if kick
        self.creating = 0                  # creates under way (each under its id's view lock): the per-node limit
        # a partition's view installs, drops and deletes one at a time; other partitions' go on meanwhile: each
        # saves its meta.json with fsyncs, and a failover moves hundreds of partitions at once -- one node-wide
        # lock made them wait for each other's fsyncs in a row
        self._view_locks: dict[int, trio.Lock] = {}
        self.peers = None          # asks another node its REPLICA_STATE (datanode/repair.py Repairer); set by the node
        self.refusals: dict[int, tuple[int, str]] = {}   # pid -> the refused (epoch, why) last logged

    # -- the request's partition --------------------------------------------------------------------------
    def hosted(self, h: Header) -> Partition:
        """The request's partition, or NOT_FOUND."""
        part = self.table.get(h.partition)
        if part is None:
            raise Reply(Result.NOT_FOUND, why=f"partition {h.partition} is not on this node")
        return part

    def at_epoch(self, h: Header) -> Partition:
        """The request's partition, at the request's epoch (else NOT_FOUND / STALE_EPOCH)."""
        part = self.hosted(h)
        if h.epoch != part.epoch:
            raise Reply(Result.STALE_EPOCH, arg=part.epoch,
                        why=f"epoch {h.epoch} but partition {part.pid} is at {part.epoch}")
        return part

    def leader_of(self, part: Partition) -> None:
        if part.leader != self.me:
            raise Reply(Result.NOT_LEADER, why=f"leader of partition {part.pid} is {part.leader}")

    async def lead(self, h: Header) -> Partition:
        """The request's partition, led here, at its epoch -- and this leader is not self-fenced: a leader of
        a replicated partition whose etcd lease expired acknowledges nothing until it has re-registered and
        re-read the map (NOT_LEADER; the rule and why: wire/etcdmap.py, "Self-fencing")."""
        part = self.at_epoch(h)
        self.leader_of(part)
        if self.agent is not None and len(part.replicas) > 1:
            why = await self.agent.fence()
            if why:
                self.counters.fenced += 1
                raise Reply(Result.NOT_LEADER, why=f"self-fenced: {why}")
            part = self.at_epoch(h)            # the map may have changed while we waited for etcd
            self.leader_of(part)
        return part

    def still_leading(self, part: Partition, h: Header) -> None:
        """After an await: the view may have changed meanwhile (a step-down).  A request may only go on (be
        forwarded) at the view of the epoch it carries, with this node still its leader."""
        if part.epoch != h.epoch:
            raise Reply(Result.STALE_EPOCH, arg=part.epoch,
                        why=f"partition {part.pid} moved to epoch {part.epoch} while handling epoch {h.epoch}")
        self.leader_of(part)

    @staticmethod
    def size(part: Partition, extent: int) -> int:
        try:
            return part.store.size(extent)
        except StoreError as e:
            raise store_reply(e) from None

    def view_lock(self, pid: int) -> trio.Lock:
        """The lock of partition ``pid``'s view changes (one per partition id ever seen: a few per node)."""
        return self._view_locks.setdefault(pid, trio.Lock())

    # -- changes ----------------------------------------------------------------------------------------------
    async def install_view(self, pid: int, replicas: list[str], epoch: int) -> bool:
        """Adopt a higher epoch and its replica list (False if ``epoch`` is not above ours).  ViewRefused when
        its leader is not known to hold every acknowledged byte (datanode/viewguard.py): nothing changes then.

        A view that does not name this node is never installed: our copy goes to the trash instead
        (``drop_partition``; True when it went).  Installed, it would be a copy no leader repairs, no view
        counts and no re-read of the map drops (its epoch is the map's), while the manager sees this node
        holding the partition and gives it no new replica of it: redundancy lost for good, silently."""
        part = self.table.get(pid)
        if part is None:
            return False
        if self.me not in replicas:
            return await self.drop_partition(pid, replicas, epoch, equal_ok=True)
        if epoch <= part.epoch:
            return False
        await self._check(part, replicas, epoch)
        async with self.view_lock(pid):
            part = self.table.get(pid)
            if part is None or epoch <= part.epoch:
                return False
            verdict, why = viewguard.local_verdict(self.me, part.replicas, part.epoch, part.synced, replicas, epoch)
            if verdict == "refuse":                 # our own copy changed while the leader was asked
                raise self._refused(part, replicas, epoch, why)
            part.synced = viewguard.stays_synced(self.me, part.replicas, part.epoch, part.synced, replicas, epoch)
            part.replicas, part.epoch = list(replicas), epoch
            part.acked.clear()                      # a leader's acknowledged ends are those of its own epoch
            await store_call(part.save)
        self.refusals.pop(pid, None)
        self.changed(True)                   # leadership may have moved here (or away)
        log.info("partition %d now epoch %d replicas %s", part.pid, epoch, ",".join(replicas))
        return True

    async def install_views(self, views: list[tuple[int, list[str], int]]) -> list[bool]:
        """``install_view`` for many partitions (PARTITION_UPDATE_MANY: a failover or a hand-off moves hundreds
        at once), with one durable sync for the batch instead of one per partition; every view is on disk
        before this returns.  Per view: True when it is installed (now, or was already: the same epoch and
        replicas).  False -- not here, older, refused (ViewRefused is logged and counted, not raised), or not
        naming this node (a drop is never batched) -- and the sender asks about it alone to learn why.
        A disk error saving the batch raises (the request fails; memory holds the new views, as a failed
        ``install_view`` leaves it)."""
        ok = [False] * len(views)
        todo: list[int] = []
        last = {pid: i for i, (pid, _, _) in enumerate(views)}     # (the wire refuses a partition twice)
        for i, (pid, replicas, epoch) in enumerate(views):
            part = self.table.get(pid)
            if part is None or self.me not in replicas or last[pid] != i:
                continue
            if epoch <= part.epoch:
                ok[i] = epoch == part.epoch and part.replicas == replicas
                continue
            todo.append(i)
        checked = await self._checked(views, todo)
        changed: list[tuple[int, Partition]] = []
        async with self._views_locked([views[i][0] for i in checked]):
            for i in checked:
                pid, replicas, epoch = views[i]
                part = self.table.get(pid)
                if part is None:
                    continue
                if epoch <= part.epoch:                 # installed meanwhile (the etcd agent saw it first)?
                    ok[i] = epoch == part.epoch and part.replicas == replicas
                    continue
                verdict, why = viewguard.local_verdict(self.me, part.replicas, part.epoch, part.synced, replicas,
                                                       epoch)
                if verdict == "refuse":             # our own copy changed while the leader was asked
                    self._refused(part, replicas, epoch, why)
                    continue
                part.synced = viewguard.stays_synced(self.me, part.replicas, part.epoch, part.synced, replicas,
                                                     epoch)
                part.replicas, part.epoch = list(replicas), epoch
                part.acked.clear()
                changed.append((i, part))
            if changed:
                await store_call(self.table.save_many, [part for _, part in changed])
        for i, part in changed:
            ok[i] = True
            self.refusals.pop(part.pid, None)
            log.info("partition %d now epoch %d replicas %s", part.pid, part.epoch, ",".join(part.replicas))
        if changed:
            self.changed(True)
        return ok

    async def drop_partition(self, pid: int, replicas: list[str], epoch: int, *, equal_ok: bool = False) -> bool:
        """A newer view (``replicas`` at ``epoch``) no longer names this node: move our copy to the trash --
        only when the view's leader is known to hold every acknowledged byte (else ViewRefused, nothing
        changes).  False: nothing to drop (not here, or not a newer epoch).

        ``equal_ok``: a view at our own epoch counts too, when neither it nor our copy's view names this node
        (a copy an earlier version kept for a view without it): no write of that epoch needed this copy, and
        the view's leader, checked as above, holds every one acknowledged before.  Our copy naming itself at
        the same epoch is another story (two views of one epoch): left alone."""
        part = self.table.get(pid)
        if part is None or self.me in replicas or not self._newer(part, epoch, equal_ok):
            return False
        await self._check(part, replicas, epoch)
        async with self.view_lock(pid):
            if self.table.get(pid) is not part or not self._newer(part, epoch, equal_ok):
                return False
            await store_call(self.table.delete, pid)
        self.refusals.pop(pid, None)
        log.info("partition %d dropped for epoch %d (replicas %s, which hold every acknowledged byte); our copy "
                 "is kept in the trash for %ss", pid, epoch, ",".join(replicas), self.cfg.trash_retention_s)
        self.changed(False)
        return True

    async def drop_partitions(self, views: list[tuple[int, list[str], int]]) -> list[bool]:
        """``drop_partition`` for many newer views that no longer name this node (a hand-off moves every
        partition off a stopping node), with one pair of directory fsyncs for the batch.  Per view: True when
        our copy went to the trash; False when there was nothing to drop or the drop was refused (ViewRefused
        is logged and counted, not raised)."""
        ok = [False] * len(views)
        last = {pid: i for i, (pid, _, _) in enumerate(views)}
        todo = [i for i, (pid, replicas, epoch) in enumerate(views)
                if last[pid] == i and self.me not in replicas
                and (part := self.table.get(pid)) is not None and self._newer(part, epoch, False)]
        checked = await self._checked(views, todo)
        gone: list[int] = []
        async with self._views_locked([views[i][0] for i in checked]):
            for i in checked:
                pid, _, epoch = views[i]
                part = self.table.get(pid)
                if part is not None and self._newer(part, epoch, False):
                    gone.append(i)
            if gone:
                await store_call(self.table.delete_many, [views[i][0] for i in gone])
        for i in gone:
            pid, replicas, epoch = views[i]
            ok[i] = True
            self.refusals.pop(pid, None)
            log.info("partition %d dropped for epoch %d (replicas %s, which hold every acknowledged byte); our "
                     "copy is kept in the trash for %ss", pid, epoch, ",".join(replicas), self.cfg.trash_retention_s)
        if gone:
            self.changed(False)
        return ok

    async def _checked(self, views: list[tuple[int, list[str], int]], todo: list[int]) -> list[int]:
        """Which of ``views[i]`` (``i`` in ``todo``) pass ``_check`` -- each may ask its new leader, all at
        once; a refusal is logged and counted there, not raised."""
        checked: list[int] = []

        async def check(i: int) -> None:
            pid, replicas, epoch = views[i]
            part = self.table.get(pid)
            if part is None:
                return
            try:
                await self._check(part, replicas, epoch)
            except ViewRefused:
                return
            checked.append(i)
        async with trio.open_nursery() as n:
            for i in todo:
                n.start_soon(check, i)
        return checked

    @contextlib.asynccontextmanager
    async def _views_locked(self, pids: list[int]):
        """Many partitions' view locks, taken in one order (by id): no two batches deadlock."""
        async with contextlib.AsyncExitStack() as locks:
            for pid in sorted(pids):
                await locks.enter_async_context(self.view_lock(pid))
            yield

    def _newer(self, part: Partition, epoch: int, equal_ok: bool) -> bool:
        return epoch > part.epoch or (equal_ok and epoch == part.epoch and self.me not in part.replicas)

    async def delete_partition(self, pid: int) -> None:
        """An admin's PARTITION_DELETE: the partition and its data go to the trash (idempotent)."""
        async with self.view_lock(pid):
            if self.table.get(pid) is None:
                return
            await store_call(self.table.delete, pid)
        log.info("partition %d deleted (its data is kept in the trash for %ss)", pid, self.cfg.trash_retention_s)
        self.changed(False)

    async def _check(self, part: Partition, replicas: list[str], epoch: int) -> None:
        """Raise ViewRefused unless the leader of ``replicas`` is known to hold every acknowledged byte."""
        verdict, arg = viewguard.local_verdict(self.me, part.replicas, part.epoch, part.synced, replicas, epoch)
        if verdict == "ok":
            return
        if verdict == "refuse":
            raise self._refused(part, replicas, epoch, arg)
        leader = arg
        try:
            st = await self.peers.replica_state(leader, part.pid)
        except Exception as e:  # noqa: BLE001 - unreachable, not hosting it, an unreadable answer: not known
            raise self._refused(part, replicas, epoch, f"the new leader {leader} cannot be asked: {e}") from None
        mine = await store_call(part.store.digests)
        why = viewguard.remote_verdict(part.replicas, part.epoch, leader, st, mine)
        if why:
            raise self._refused(part, replicas, epoch, why)

    def _refused(self, part: Partition, replicas: list[str], epoch: int, why: str) -> "ViewRefused":
        """Count and report a refused view (its log line once per partition, epoch and reason)."""
        self.counters.views_refused += 1
        text = (f"partition {part.pid}: refusing epoch {epoch} (replicas {','.join(replicas)}) over our epoch "
                f"{part.epoch}: {why}; our copy stays as it is")
        if self.refusals.get(part.pid) != (epoch, why):
            if len(self.refusals) > 4096:
                self.refusals.clear()
            self.refusals[part.pid] = (epoch, why)
            log.warning("%s", text)
        return ViewRefused(text)


class ViewRefused(Exception):
    """A view change refused: it would leave no copy known to hold every acknowledged byte (the message says
    why); answered LAST_COPY."""
