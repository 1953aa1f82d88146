"""A datanode's side of the cluster map in etcd (only when ``etcd`` is configured).

``EtcdAgent.run`` lives in the Node's nursery and does three things; none of them is on the data path, and
when etcd is unreachable the node keeps serving the map it has:

* **registration**: a lease of ``lease_ttl_s`` and the key ``nodes/<listen>`` attached to it (address, pid,
  transport, zone, capacity/free bytes of the data disk, the partitions held with their epochs); kept alive
  every TTL/3 and re-published when its partitions change.  A lost lease (the node was paused or cut off
  longer than the TTL) is replaced by a new one and the map is re-read before the node registers again.
* **watch** of ``parts/``: a view with a higher epoch than the local one is installed when it names this node
  (``Node.install_view``, the same path as ``PARTITION_UPDATE``) and the partition is dropped when it does
  not (this node was replaced while it was away: its copy is stale).  Partitions etcd does not know are left
  alone (a cluster run by hand, or not yet adopted by the manager).
* **resync**: the whole ``parts/`` range is re-read after (re)registering, after a watch reconnect and every
  ``RESYNC_S``, so a missed event costs at most that long.
* **self-fencing** (``fence``, asked by a leader before it takes a write): while etcd has told us our lease
  expired -- or while we re-register after losing it -- leader writes of replicated partitions are refused
  (``NOT_LEADER``) until the map is re-read and we are registered again; when the lease may have lapsed by
  the local clock, a leader write first waits (one keepalive round at most) for etcd's verdict.  No etcd
  member answering is no verdict: the node goes on serving.  Why: datanode/etcdmap.py, "Self-fencing".

The design of the map and why failover loses no acknowledged write: datanode/etcdmap.py.
"""
from __future__ import annotations

import json
import math
import logging
import os
import shutil

import trio

from .etcdmap import Etcd, EtcdError, Lease, PartView, open_channel

log = logging.getLogger(__name__)
RESYNC_S = 30.0           # a safety net under the watch (which delivers every change at once)
REPUBLISH_S = 10.0


class EtcdAgent:
    def __init__(self, node):
        self.node = node
        cfg = node.cfg
        self.etcd = Etcd(cfg.etcd, cfg.etcd_prefix, timeout=max(1.0, cfg.lease_ttl_s / 2))
        self.registered = False
        self._changed = trio.Event()
        self.lease: Lease | None = None      # the lease of our current (or last) registration
        self.fenced: str | None = None       # why leader writes are refused now (None: they are not)
        self.checked_at = -math.inf          # when etcd last gave a verdict on our lease (any outcome)
        self._verdict = trio.Event()

    def changed(self) -> None:
        """The partitions held here changed: publish the registration now."""
        self._changed.set()

    async def run(self) -> None:
        try:
            async with trio.open_nursery() as n:
                n.start_soon(self._watch_loop)
                n.start_soon(self._resync_loop)
                await self._register_loop()
        finally:
            self.registered = False

    # -- registration -------------------------------------------------------------------------------
    def record(self) -> dict:
        node, cfg = self.node, self.node.cfg
        try:
            du = shutil.disk_usage(cfg.data_dir)
            cap, free = du.total, du.free
        except OSError:
            cap = free = 0
        parts = {str(p.pid): {"epoch": p.epoch, "replicas": p.replicas} for p in node.table.parts.values()}
        return {"addr": node.me, "pid": os.getpid(), "transport": cfg.transport, "zone": cfg.zone,
                "capacity_bytes": cap, "free_bytes": free, "partitions": parts}

    async def _register_loop(self) -> None:
        lease: Lease | None = None
        delay = 0.5                               # retry backoff while etcd cannot be reached
        try:
            while True:
                try:
                    new = Lease(self.etcd, self.node.cfg.lease_ttl_s, on_check=self._lease_checked)
                    await new.grant()
                    if self.lease is not None and not self.fenced:
                        # etcd answers again, and the registration we had is gone (we could not keep it
                        # alive): until the map is re-read we may be leading partitions moved meanwhile
                        self._fence("re-registering after etcd was unreachable for longer than the lease")
                    lease = new
                    await self.resync()           # learn the current epochs before announcing ourselves
                    published = await self._publish(lease)
                    self.lease, self.registered = lease, True
                    if self.fenced:
                        log.warning("self-fencing lifted: re-registered (lease %x) and re-read the map",
                                    lease.id)
                    self.fenced = None
                    self._checked()
                    delay = 0.5
                    log.info("registered in etcd %s as %s (lease %x, ttl %ds)", self.etcd.urls,
                             self.etcd.node_key(self.node.me), lease.id, lease.ttl)
                    async with trio.open_nursery() as n:
                        n.start_soon(self._republish, lease, published)
                        await lease.keep_alive()
                        n.cancel_scope.cancel()
                    self.registered = False
                    if lease.expired:
                        self._fence(f"etcd says lease {lease.id:x} expired")
                except EtcdError as e:
                    self.registered = False
                    self._checked()               # a verdict too: no etcd member answered
                    (log.warning if delay == 0.5 else log.debug)("etcd registration: %s (retrying; the node "
                                                                "serves the map it has)", e)
                    delay = min(delay * 2, 5.0)
                await trio.sleep(delay)
        finally:
            await self.etcd.release(lease)          # a clean stop: leave the cluster at once

    # -- self-fencing (the rule and why: datanode/etcdmap.py, "Self-fencing") ---------------------------
    def _fence(self, why: str) -> None:
        if not self.fenced:
            log.warning("self-fencing: no write is acknowledged as a leader until this node has re-registered "
                        "and re-read the map (%s)", why)
        self.fenced = why
        self._checked()

    def _lease_checked(self, lease: Lease) -> None:
        if lease.expired:                         # fenced before any waiting write hears the verdict
            self._fence(f"etcd says lease {lease.id:x} expired")
        else:
            self._checked()

    def _checked(self) -> None:
        """An etcd verdict on our lease arrived (alive, expired, or no member answered)."""
        self.checked_at = trio.current_time()
        self._verdict.set()
        self._verdict = trio.Event()

    async def fence(self) -> str | None:
        """Why this node must not acknowledge a write as a leader now, or None when it may.

        Fenced when etcd has told us our lease expired (or we are re-registering after losing it) until the
        map is re-read.  When the lease may have lapsed by the local clock (no keepalive confirmed for a TTL:
        e.g. the process was paused), wait -- at most one keepalive round -- for etcd's verdict.  When no
        etcd member answers at all, the node keeps serving the map it has (the epoch fence covers it)."""
        lease = self.lease
        if self.fenced or lease is None:
            return self.fenced or None
        deadline = lease.confirmed + lease.ttl
        if trio.current_time() < deadline:
            return None
        with trio.move_on_after(lease.ttl / 3 + self.etcd.timeout + 0.5):
            while self.checked_at < deadline and not self.fenced and self.lease is lease:
                await self._verdict.wait()
        return self.fenced or None

    async def _publish(self, lease: Lease) -> dict:
        rec = self.record()
        await self.etcd.put(self.etcd.node_key(self.node.me), json.dumps(rec, sort_keys=True), lease.id)
        return rec

    async def _republish(self, lease: Lease, last: dict) -> None:
        """Publish the registration again when its partitions changed, or its free bytes moved by more than
        1% of the disk (checked every ``REPUBLISH_S``): an idle node does not rewrite its key."""
        while True:
            self._changed = trio.Event()
            with trio.move_on_after(REPUBLISH_S):
                await self._changed.wait()
            await trio.sleep(0.05)               # let a burst of changes settle
            try:
                rec = self.record()
                if _differs(rec, last):
                    await self.etcd.put(self.etcd.node_key(self.node.me), json.dumps(rec, sort_keys=True),
                                        lease.id)
                    last = rec
            except EtcdError as e:
                log.warning("etcd: publishing this node failed: %s", e)

    # -- the partition map --------------------------------------------------------------------------
    async def _watch_loop(self) -> None:
        send, recv = open_channel()
        async with trio.open_nursery() as n:
            n.start_soon(self.etcd.watch, self.etcd.parts_prefix, send)
            async for batch in recv:
                if batch is None:
                    await self._try_resync()
                    continue
                for typ, key, value, rev in batch:
                    if typ != "PUT":
                        continue
                    try:
                        view = PartView.decode(value, rev)
                    except (ValueError, TypeError):
                        log.warning("etcd key %s is not a partition view", key)
                        continue
                    await self.apply(view)

    async def _resync_loop(self) -> None:
        while True:
            await trio.sleep(RESYNC_S)
            await self._try_resync()

    async def _try_resync(self) -> None:
        try:
            await self.resync()
        except EtcdError as e:
            log.debug("etcd resync: %s", e)

    async def resync(self) -> None:
        for view in (await self.etcd.parts()).values():
            await self.apply(view)

    async def apply(self, view: PartView) -> None:
        """Install ``view`` if it is newer than ours (or drop our stale copy if it no longer names us).
        A failure costs this view (the next resync tries again), never the node."""
        try:
            await self._apply(view)
        except Exception:  # noqa: BLE001 - e.g. a disk error saving meta.json
            log.exception("partition %d: installing etcd's epoch %d failed", view.id, view.epoch)

    async def _apply(self, view: PartView) -> None:
        part = self.node.table.get(view.id)
        if part is None or view.epoch <= part.epoch:
            return
        if self.node.me in view.replicas:
            await self.node.install_view(view.id, view.replicas, view.epoch)
        else:
            log.warning("partition %d: etcd's epoch %d (replicas %s) no longer names this node; dropping our "
                        "epoch-%d copy", view.id, view.epoch, ",".join(view.replicas), part.epoch)
            await self.node.drop_partition(view.id)
        self.changed()


def _differs(rec: dict, last: dict) -> bool:
    """Worth re-publishing: anything but the free bytes changed, or they moved by more than 1% of the disk."""
    strip = {k: v for k, v in rec.items() if k != "free_bytes"}
    if strip != {k: v for k, v in last.items() if k != "free_bytes"}:
        return True
    return abs(rec.get("free_bytes", 0) - last.get("free_bytes", 0)) > rec.get("capacity_bytes", 0) // 100
