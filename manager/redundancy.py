"""Redundancy is never lost silently: the active manager's watch over partitions below their replica count,
and over copies that keep re-replication from refilling them.  Called once per manager pass
(``Manager.tick``), from the watched copy of the map: O(partitions), no etcd request.

* **The alarm** (``track``): a partition is *under-replicated* while fewer of its replicas than ``want`` are
  registered and ``synced`` (``PartView.under``): a replica lost and not yet replaced, one still being
  filled by repair, a member whose node is gone.  Each one is tracked from when this manager first saw it
  under; one under for longer than ``warn_after_s`` is logged once as a warning (and once more, at info,
  when it is back).  The count and the longest time are the metrics ``dnmanager_under_replicated_partitions``
  and ``dnmanager_under_replicated_oldest_seconds`` (manager/service.py ``ManagerMetrics``); ``dnctl cluster
  status`` computes the count from etcd's map itself.  Repair takes time, so being under for a moment is
  normal: the warning is for what does not heal.

* **Stale copies** (``drop_stale``): a registered node that reports a partition whose view in etcd does not
  name it, at an epoch no newer than etcd's.  Its agent drops such a copy by itself when it sees the view
  (datanode/etcdagent.py); one still reported after ``STALE_GRACE_S`` (a node that refused the drop, or of
  an earlier version) would block re-replication for good: the spare must not hold the partition already
  (manager/tasks.py ``spare``).  The manager then sends that node etcd's view (``PARTITION_UPDATE``): a node
  told a view without itself drops its copy to its trash -- and *only* if the view's leader is known to hold
  every acknowledged byte (datanode/viewguard.py; else it answers ``LAST_COPY`` and keeps it, and we say so
  once and leave it).  Why not make that node the spare instead, its stale copy brought up to date by
  repair: installing a view on it goes through the same check, and a refusal half-way through an install
  (followers first, leader last) leaves the followers at an epoch the leader has not reached -- every write
  of the partition stalls.  Asking the node to drop changes no view: nothing stalls, the copy is recoverable
  from the trash, and the one that may hold the last acknowledged bytes is never touched.
"""
from __future__ import annotations

import logging
import time

import trio

from client.sdk import ClientError
from wire.etcdmap import PartView
from wire.protocol import Op, Result

log = logging.getLogger("manager.service")
STALE_GRACE_S = 5.0      # a node's own agent drops a stale copy well within this (its watch): we act after it
STALE_RETRY_S = 10.0     # how often a node is asked again to drop a copy it still reports


class Redundancy:
    """The under-replicated partitions (since when) and the stale copies of manager ``m``."""

    def __init__(self, m, *, warn_after_s: float = 30.0):
        self.m = m
        self.warn_after_s = warn_after_s
        self.since: dict[int, float] = {}          # pid -> time.monotonic() when first seen under
        self.warned: set[int] = set()
        self.stale: dict[tuple[str, int], float] = {}    # (node, pid) -> when first reported stale
        self.asked: dict[tuple[str, int], float] = {}    # (node, pid) -> when last asked to drop it
        self.refused: dict[tuple[str, int], str] = {}    # (node, pid) -> the refusal last logged

    def standby(self) -> None:
        """No longer active: what a standby reports is nothing (the active manager's metrics count)."""
        self.since.clear()
        self.warned.clear()
        self.stale.clear()
        self.asked.clear()

    # -- the alarm ----------------------------------------------------------------------------------------------
    def track(self, parts: dict[int, PartView], nodes: dict) -> None:
        now = time.monotonic()
        live = set(nodes)
        under = {pid: v for pid, v in parts.items() if v.under(live)}
        for pid in list(self.since):
            if pid not in under:
                if pid in self.warned:
                    log.info("partition %d: back at its replica count after %.0fs", pid, now - self.since[pid])
                    self.warned.discard(pid)
                del self.since[pid]
        for pid, v in under.items():
            since = self.since.setdefault(pid, now)
            if now - since >= self.warn_after_s and pid not in self.warned:
                self.warned.add(pid)
                ok = [r for r in v.replicas if r in live and r in v.synced]
                log.warning("partition %d under-replicated for %.0fs (over %gs): %d of %d replicas live and synced "
                            "(replicas %s, synced %s, epoch %d, %s)", pid, now - since, self.warn_after_s, len(ok),
                            v.want or len(v.replicas), ",".join(v.replicas), ",".join(v.synced) or "none",
                            v.epoch, v.state)

    def next_warning_s(self) -> float:
        """Seconds until a partition tracked now passes the bound unwarned (inf: none): the manager looks again
        then, so the warning is not an idle pass late."""
        now = time.monotonic()
        due = [t + self.warn_after_s - now for pid, t in self.since.items() if pid not in self.warned]
        return max(0.01, min(due)) if due else float("inf")

    def count(self) -> int:
        return len(self.since)

    def oldest_s(self) -> float:
        return time.monotonic() - min(self.since.values()) if self.since else 0.0

    def over_bound(self) -> int:
        now = time.monotonic()
        return sum(now - t >= self.warn_after_s for t in self.since.values())

    # -- stale copies -------------------------------------------------------------------------------------------
    async def drop_stale(self, parts, nodes: dict, only: set[str] | None = None) -> bool:
        """Ask nodes to drop copies of partitions whose view does not name them (see the module's docstring).
        ``parts``: the views by id (``get``); ``only``: look at these nodes' registrations alone (those that
        changed), None: at every one.  True while such a copy is reported (look again soon)."""
        now = time.monotonic()
        current = set()
        asks = []
        for addr, rec in nodes.items():
            if only is not None and addr not in only:
                continue
            for pid_s, pv in (rec.get("partitions") or {}).items():
                v = parts.get(int(pid_s))
                try:
                    epoch = int(pv.get("epoch", 0))
                except (TypeError, ValueError, AttributeError):
                    continue
                if v is None or addr in v.replicas or epoch > v.epoch or not v.installed or v.leader not in nodes:
                    continue           # not stale, newer than etcd (adopted from its leader), or a change under way
                key = (addr, v.id)
                current.add(key)
                if (now - self.stale.setdefault(key, now) >= STALE_GRACE_S
                        and now - self.asked.get(key, -1e9) >= STALE_RETRY_S):
                    self.asked[key] = now
                    asks.append((addr, v, epoch))
        async with trio.open_nursery() as n:     # (all at once: a node that does not answer holds up no other)
            for ask in asks:
                n.start_soon(self._ask_drop, *ask)
        for d in (self.stale, self.asked, self.refused):
            for key in list(d):
                if key not in current and (only is None or key[0] in only):
                    del d[key]
        return bool(self.stale)

    async def _ask_drop(self, addr: str, v: PartView, epoch: int) -> None:
        key = (addr, v.id)
        try:
            await self.m.dc.admin(addr, Op.PARTITION_UPDATE, partition=v.id,
                                  body={"replicas": v.replicas, "epoch": v.epoch})
        except ClientError as e:
            if e.result == Result.NOT_FOUND:
                return                 # dropped meanwhile
            why = f"{e}"
            if self.refused.get(key) != why:
                self.refused[key] = why
                what = ("it may hold acknowledged bytes the view's leader lacks: left alone"
                        if e.result == Result.LAST_COPY else "asked again later")
                log.warning("partition %d: %s still holds a copy (epoch %d) though etcd's epoch %d (replicas %s) "
                            "does not name it, and did not drop it: %s; %s", v.id, addr, epoch, v.epoch,
                            ",".join(v.replicas), why, what)
            return
        log.warning("partition %d: %s held a copy (epoch %d) that etcd's epoch %d (replicas %s) does not name; "
                    "told it that view: it dropped the copy to its trash and can take a new replica", v.id, addr,
                    epoch, v.epoch, ",".join(v.replicas))
