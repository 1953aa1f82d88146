"""A datanode's side of the cluster map in etcd (only when ``etcd`` is configured).

``EtcdAgent.run`` lives in the Node's nursery and does three things; none of them is on the data path, and
when etcd is unreachable the node keeps serving the map it has:

* **registration**: a lease of ``lease_ttl_s`` and the key ``nodes/<listen>`` attached to it (address, pid,
  transport, zone, capacity/free bytes of the data disk, the partitions held with their epochs); kept alive
  every TTL/3 and re-published when its partitions change.  A lost lease (the node was paused or cut off
  longer than the TTL) is replaced by a new one and the map is re-read before the node registers again.
* **watch** of ``parts/``: a view with a higher epoch than the local one is installed when it names this node
  (``Views.install_view``, the same path as ``PARTITION_UPDATE``) and the partition is dropped when it does
  not (this node was replaced while it was away: its copy is stale); so is a copy at etcd's own epoch when
  neither view names this node (no node keeps a copy for a view without itself: ops/partitions.py).
  Partitions etcd does not know are left alone (a cluster run by hand, or not yet adopted by the manager).
  The views of one watch event batch (or of a re-read) that this node takes are installed together, with one
  durable sync per ``MAX_VIEWS_PER_UPDATE`` (``Views.install_views``), and the copies they drop go to the
  trash together (``Views.drop_partitions``): a failover or a hand-off moves hundreds at once.
  Nothing read is obeyed unchecked (wire/mapcheck.py): a view must be well-formed, carry the manager's MAC
  when the node has a secret, move the epoch forward by a bounded step, and add only registered nodes;
  anything else is logged, counted (``datanode_etcd_invalid_values_total``) and ignored.
* **resync**: the whole ``parts/`` range is re-read after (re)registering, after a watch reconnect and every
  ``RESYNC_S``, so a missed event costs at most that long.
* **leaving** (a controlled shutdown, datanode/drain.py): ``request_handoff`` puts ``handoff/<listen>`` under
  the node's lease, asking the active manager to move every partition naming it to the other replicas
  (manager/tasks.py); on the way out the lease is revoked (``_leave``), so the registration and that request
  are gone at once instead of a lease TTL later.
* **self-fencing** (``fence``, asked by a leader before it takes a write): while etcd has told us our lease
  expired -- or while we re-register after losing it -- leader writes of replicated partitions are refused
  (``NOT_LEADER``) until the map is re-read and we are registered again; when the lease may have lapsed by
  the local clock, a leader write first waits (one keepalive round at most) for etcd's verdict.  No etcd
  member answering is no verdict: the node goes on serving.  Why: wire/etcdmap.py, "Self-fencing".

The design of the map and why failover loses no acknowledged write: wire/etcdmap.py.
"""
from __future__ import annotations

import json
import math
import logging
import os
import shutil
import time
from typing import TYPE_CHECKING

import trio

from wire.etcdmap import Etcd, EtcdError, Lease, PartView, open_channel
from wire.limits import MAX_VIEWS_PER_UPDATE
from wire.protocol import Role

from .config import ClusterConfig, etcd_access
from .mapcopy import MapCopy

if TYPE_CHECKING:
    from wire.auth import Credentials

    from .partition import PartitionTable, Views

log = logging.getLogger(__name__)
RESYNC_S = 30.0           # a safety net under the watch (which delivers every change at once)
LEAVE_S = 2.0             # a stopping node waits this long at most for etcd to revoke its lease
REPUBLISH_S = 10.0
# A registration lists every partition held, and each rewrite leaves its old version in etcd's history
# until compacted: bursts of changes (many partitions created or moved) are coalesced so that a node
# writes at most about this many bytes of registration a second -- one rewrite per change while it holds
# few partitions, fewer and later (by seconds at most) while it holds thousands.
REPUBLISH_BYTES_PER_S = 64 << 10


class EtcdAgent:
    """``cfg``: the node's cluster section; ``me``: its listen address; ``transport`` and ``data_dir``: what it
    registers (and whose disk); ``creds``: the cluster secret, with which entries' MACs are made and checked;
    ``table``: the partitions held; ``views``: how the views read are installed and dropped."""

    def __init__(self, cfg: ClusterConfig, *, me: str, transport: str, data_dir: str, creds: Credentials | None,
                 table: PartitionTable, views: Views):
        self.cfg, self.me, self.transport, self.data_dir = cfg, me, transport, data_dir
        self.table, self.views = table, views
        self.etcd = Etcd(cfg.etcd, cfg.etcd_prefix, timeout=max(1.0, cfg.lease_ttl_s / 2), access=etcd_access(cfg),
                         admin_key=creds.key(Role.ADMIN) if creds is not None else None)
        self.registered = False
        self._changed = trio.Event()
        self.lease: Lease | None = None      # the lease of our current (or last) registration
        self.fenced: str | None = None       # why leader writes are refused now (None: they are not)
        self.checked_at = -math.inf          # when etcd last gave a verdict on our lease (any outcome)
        self._verdict = trio.Event()
        self.left: str | None = None         # how the last registration ended (``_leave``), for the stop's log
        self.copy = MapCopy(lambda: self.registered)   # parts/ as read, raw, served to clients (MAP_READ)

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
        try:
            du = shutil.disk_usage(self.data_dir)
            cap, free = du.total, du.free
        except OSError:
            cap = free = 0
        parts = {str(p.pid): {"epoch": p.epoch, "replicas": list(p.replicas)} for p in self.table.all()}
        return {"addr": self.me, "pid": os.getpid(), "transport": self.transport, "zone": self.cfg.zone,
                "capacity_bytes": cap, "free_bytes": free, "partitions": parts}

    async def _register_loop(self) -> None:
        lease: Lease | None = None
        delay = 0.5                               # retry backoff while etcd cannot be reached
        try:
            while True:
                try:
                    new = Lease(self.etcd, self.cfg.lease_ttl_s, on_check=self._lease_checked)
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
                             self.etcd.node_key(self.me), lease.id, lease.ttl)
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
            await self._leave(lease)

    async def _leave(self, lease: Lease | None) -> None:
        """A clean stop: revoke the lease now (shielded, bounded), so the manager learns at once that the node
        is gone -- with its registration goes its hand-off request -- rather than a lease TTL later."""
        if lease is None or not lease.ok:
            self.left = "not registered in etcd"
            return
        why = f"no answer within {LEAVE_S:g}s"
        with trio.move_on_after(LEAVE_S) as scope:
            scope.shield = True
            try:
                await self.etcd.revoke(lease.id)
                self.left = f"left etcd (lease {lease.id:x} revoked)"
                return
            except EtcdError as e:
                why = str(e)
        self.left = (f"could not revoke lease {lease.id:x} ({why}): etcd forgets this node when it expires, "
                     f"within {lease.ttl}s")

    async def request_handoff(self) -> None:
        """Ask the active manager to move every partition naming this node to its other replicas (leadership
        to an in-sync follower, epoch + 1): key ``handoff/<listen>`` under our lease, so the request ends with
        our registration.  EtcdError when not registered or etcd refuses."""
        lease = self.lease
        if not self.registered or lease is None or not lease.ok:
            raise EtcdError("not registered in etcd")
        await self.etcd.put_entry(self.etcd.key("handoff", self.me),
                                  {"pid": os.getpid(), "since": time.time()}, lease.id)

    async def manager(self) -> str | None:
        """The active manager's id in etcd (None: no manager is active)."""
        got = await self.etcd.get(self.etcd.manager_key)
        return got[0].decode(errors="replace") if got else None

    # -- self-fencing (the rule and why: wire/etcdmap.py, "Self-fencing") ---------------------------
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
        await self.etcd.put_entry(self.etcd.node_key(self.me), rec, lease.id)
        return rec

    async def _republish(self, lease: Lease, last: dict) -> None:
        """Publish the registration again when its partitions changed, or its free bytes moved by more than
        1% of the disk (checked every ``REPUBLISH_S``): an idle node does not rewrite its key."""
        next_at = trio.current_time()            # the earliest the next rewrite may go (REPUBLISH_BYTES_PER_S)
        while True:
            self._changed = trio.Event()
            with trio.move_on_after(REPUBLISH_S):
                await self._changed.wait()
            await trio.sleep(0.05)               # let a burst of changes settle
            await trio.sleep_until(next_at)
            try:
                rec = self.record()
                if _differs(rec, last):
                    await self.etcd.put_entry(self.etcd.node_key(self.me), rec, lease.id)
                    last = rec
                    next_at = trio.current_time() + len(json.dumps(rec)) / REPUBLISH_BYTES_PER_S
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
                views = []
                for typ, key, value, rev in batch:
                    self.copy.event(typ, key, value, rev)
                    view = self.etcd.open(key, value, rev) if typ == "PUT" else None
                    if view is not None:
                        views.append(view)
                await self.apply_many(views)

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
        kvs, rev = await self.etcd.get_prefix(self.etcd.parts_prefix)
        self.copy.reload(kvs, rev)
        views = [self.etcd.open(key, value, mod) for key, value, mod in kvs]
        await self.apply_many([v for v in views if v is not None])

    async def apply_many(self, views: list[PartView]) -> None:
        """``apply`` each of ``views``; the plain installs among them (a newer view naming this node, checked
        here) go together, ``MAX_VIEWS_PER_UPDATE`` per durable sync."""
        installs: list[PartView] = []
        drops: list[PartView] = []
        views = list({v.id: v for v in views}.values())     # a partition changed twice in a batch: the last
        for view in views:
            part = self.table.get(view.id)
            if (part is None or view.epoch <= part.epoch
                    or any(r not in part.replicas for r in view.replicas) and self.etcd.mac_key is None):
                await self.apply(view)              # nothing, equal epochs, or a check that reads etcd: alone
            elif self.etcd.follows(part.epoch, part.replicas, view):
                (installs if self.me in view.replicas else drops).append(view)
        for at in range(0, len(installs), MAX_VIEWS_PER_UPDATE):
            chunk = installs[at:at + MAX_VIEWS_PER_UPDATE]
            try:
                await self.views.install_views([(v.id, v.replicas, v.epoch) for v in chunk])
            except Exception:  # noqa: BLE001 - e.g. a disk error saving them: the next resync tries again
                log.exception("partitions %s: installing etcd's views failed", ",".join(str(v.id) for v in chunk))
        for at in range(0, len(drops), MAX_VIEWS_PER_UPDATE):
            chunk = drops[at:at + MAX_VIEWS_PER_UPDATE]
            log.warning("partitions %s: etcd's views no longer name this node; dropping our copies",
                        ",".join(str(v.id) for v in chunk))
            try:
                await self.views.drop_partitions([(v.id, v.replicas, v.epoch) for v in chunk])
            except Exception:  # noqa: BLE001 - e.g. a disk error moving them: the next resync tries again
                log.exception("partitions %s: dropping our copies failed", ",".join(str(v.id) for v in chunk))
        if installs or drops:
            self.changed()

    async def apply(self, view: PartView) -> None:
        """Install ``view`` if it is newer than ours (or drop our stale copy if it no longer names us).
        A failure costs this view (the next resync tries again), never the node."""
        try:
            await self._apply(view)
        except EtcdError as e:
            log.warning("partition %d: etcd's epoch %d not installed now (checking its replicas: %s)", view.id,
                        view.epoch, e)
        except Exception:  # noqa: BLE001 - e.g. a disk error saving meta.json
            log.exception("partition %d: installing etcd's epoch %d failed", view.id, view.epoch)

    async def _apply(self, view: PartView) -> None:
        part = self.table.get(view.id)
        if part is None or view.epoch < part.epoch:
            return
        me = self.me
        if view.epoch == part.epoch:
            # our own epoch, and neither the map's view nor our copy's names this node: a copy kept for a view
            # without it (an earlier version installed such views).  Kept, nothing would ever drop or refill
            # it, and the manager would not re-replicate onto a node holding the partition: dropped (checked
            # like any drop: the view's leader must be known to hold every acknowledged byte).
            if await self.views.drop_partition(view.id, view.replicas, view.epoch, equal_ok=True):
                log.warning("partition %d: our copy was at etcd's epoch %d, whose replicas (%s) do not name this "
                            "node: dropped", view.id, view.epoch, ",".join(view.replicas))
                self.changed()
            return
        registered = await self.etcd.registered_for(part.replicas, view)
        if not self.etcd.follows(part.epoch, part.replicas, view, registered):
            return
        if me in view.replicas:
            await self.views.install_view(view.id, view.replicas, view.epoch)
        else:
            log.warning("partition %d: etcd's epoch %d (replicas %s) no longer names this node; dropping our "
                        "epoch-%d copy", view.id, view.epoch, ",".join(view.replicas), part.epoch)
            await self.views.drop_partition(view.id, view.replicas, view.epoch)
        self.changed()


def _differs(rec: dict, last: dict) -> bool:
    """Worth re-publishing: anything but the free bytes changed, or they moved by more than 1% of the disk."""
    strip = {k: v for k, v in rec.items() if k != "free_bytes"}
    if strip != {k: v for k, v in last.items() if k != "free_bytes"}:
        return True
    return abs(rec.get("free_bytes", 0) - last.get("free_bytes", 0)) > rec.get("capacity_bytes", 0) // 100
