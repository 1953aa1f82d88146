"""The cluster manager (`dnmanager --etcd URL[,URL...]`; run several, exactly one is active).

Watch, not poll: every instance follows the whole map (nodes, partitions, manager key) through **one etcd
watch** (``wire.etcdmap.MapCache``: read once, then changes pushed; a full re-read after a watch
reconnect and every ``MAP_RESYNC_S`` as a safety net).  At idle a manager sends etcd only its lease
keepalives (the active one) and that slow re-read (measure: ``python bench/etcd_traffic.py``).

Election: when the cached manager key is absent an instance grants itself a lease and creates the key with
a compare-and-swap (create revision 0).  The winner keeps its lease alive and is active while it does; the
others wait for the key's deletion to arrive by the watch (or ``STANDBY_RESYNC_S``) and take over when the
active one's lease lapses (it died, hung, or lost etcd).  Every partition change the active manager makes
is a CAS that also requires the manager key to still hold its id, so a deposed manager cannot change the map.

The active manager passes over the cached map whenever it changes (a node's lease lapsed, a view was
written), and every ``tick_s`` while something is under way (a replica gone but not yet ``down_after_s``,
an install to retry, a repair to follow) -- else every ``IDLE_LOOK_S``, which costs no etcd request.  A pass
costs what changed, not the cluster: it handles the partitions the watch changed (``MapCache.follow``),
those naming a node that came or went, and those it found unsettled last time; every ``FULL_SWEEP_S`` all
of them, a safety net under that bookkeeping (a settled one costs a look, no task).  Per partition (design
and the no-acknowledged-write-lost argument: wire/etcdmap.py):

* **adopt**: a partition a registered leader reports that etcd does not have yet is written to etcd as it
  is (its replica count becomes ``want``; its followers become ``synced`` once the leader reports them
  healthy); a higher epoch reported by its leader (an admin changed it by
  hand with dnctl) replaces etcd's.
* **leader failover**: its leader has no lease -> the first surviving, ``synced`` replica leads at epoch + 1
  with the surviving replicas; a partition with no synced survivor becomes ``read_only`` and is left alone.
* **follower loss**: a follower without a lease for ``down_after_s`` is removed (epoch + 1): the partition
  takes writes again with the rest and is ``degraded``.
* **re-replication**: a partition short of ``want`` replicas gets a spare node (live, not a member, another
  zone than its members where possible, the most free bytes) at epoch + 1; the leader's repair fills it
  (progress: ``dnctl partition health``; asked every pass, or at most every ``FILLED_LOOK_S`` while more
  than ``FILLING_EACH_PASS`` partitions are being filled); when the leader reports it ``healthy`` it joins
  ``synced`` and the partition is ``writable`` again.
* **redundancy** (manager/redundancy.py): every partition below its replica count is tracked from when it
  went under; one under for longer than ``--under-replicated-warn-s`` is logged (metrics: see
  ``ManagerMetrics``).  A node holding a copy that etcd's view does not name is told that view, so it drops
  the copy (its own never-the-last-copy check decides) and can be the spare that refills the partition.
* **install**: a new view is first written to etcd with ``installed = false``; then the datanodes' own
  ``PARTITION_CREATE`` (a new replica) / ``PARTITION_UPDATE`` (followers first, the new leader last) are
  sent, and the view is marked installed.  A member that does not answer is retried on the next tick.
  Installs run beside the passes (a pass does not wait for them: a follower lost in a failover is removed
  while the leaders' new views are still being installed), one at a time per partition, and the updates
  for one node are sent many in a request (manager/viewpush.py: one durable sync per batch on the node).

Nothing read from etcd is obeyed unchecked (wire/mapcheck.py): the map cache ignores -- logs and counts
(``dnmanager_etcd_invalid_values_total``, ``--metrics-listen``) -- a value that is malformed, lacks the MAC
of this cluster's secret, or moves an epoch back or too far; a partition key holding such a value gets its
last valid view written back (a CAS on the invalid value's revision), or, with none known, is adopted again
from its leader's registration.  Every entry the manager writes is sealed with that MAC.

The manager talks to datanodes with the SDK's admin requests (so this module sits at the admin level:
manager -> client/admin.py, client/sdk.py -> wire/).
"""
from __future__ import annotations

import logging
import os
import socket

import trio

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily

from client.sdk import ClientError, DataClient
from wire.aio import each
from wire.etcdmap import CREATE_TXN_MAX, Etcd, EtcdAccess, EtcdError, Lease, MapCache, PartView
from wire.limits import DEFAULT_REPLICAS, nodes_error
from wire.metrics import etcd_invalid_family
from wire.protocol import Op, Result, Role
from manager.combine import Combiner
from manager.fillwatch import FillWatch
from manager.etcdcare import EtcdCare
from manager.redundancy import Redundancy
from manager.tasks import ManagerTasks
from manager.viewpush import ViewPush

log = logging.getLogger(__name__)
STANDBY_POLL_S = 0.25     # first retry after etcd refused (doubling up to 5 s)
STANDBY_RESYNC_S = 10.0   # a standby looks at the manager key at least this often (else: on its deletion)
IDLE_LOOK_S = 5.0         # the active manager passes over a settled map this often (no etcd request)
MAP_RESYNC_S = 30.0       # full re-read of the map, a safety net under the watch
# a pass looks at the partitions that changed (the watch says which), those of a node that came or went, and
# those not settled at the last pass -- an event costs O(what it changed), not O(cluster) -- and at every
# partition this often, a safety net under that bookkeeping
FULL_SWEEP_S = 30.0
STALE_LOOK_S = 1.0        # copies etcd's views do not name: looked for at most this often (grace: 5 s)
# partitions whose new replica is being filled: their leaders are asked how far (PARTITION_HEALTH) every pass
# while at most FILLING_EACH_PASS are; with more, each at most every FILLED_LOOK_S -- a refill of a thousand
# partitions must not cost a thousand requests every tick_s
FILLING_EACH_PASS = 64
FILLED_LOOK_S = 1.0
# the manager's client pool: one MiB per admin request under way (client/channel.py ADMIN_ANSWER), so this
# many at once; the rest wait their turn there (a hand-off or a failover moves hundreds of partitions at once,
# two or three installs each: with 16 at once a failover of a third of 1,000 partitions waited on this bound)
ADMIN_POOL_MIB = 64


class Manager:
    def __init__(self, etcd: str, *, prefix: str = "/datanode", name: str = "manager", lease_ttl_s: int = 3,
                 down_after_s: float = 1.0, tick_s: float = 0.25, transport: str = "auto",
                 rpc_timeout: float = 3.0, min_writable: int = 2, replicas: int = DEFAULT_REPLICAS,
                 min_free_mib: int = 256, unfinished_after_s: float = 30.0, under_replicated_warn_s: float = 30.0,
                 secret=None, tls=None,
                 etcd_access: EtcdAccess | None = None, etcd_care: dict | None = None):
        # the MACs of the map's entries are made and checked with the secret's (or admin key file's) admin key
        self.etcd = Etcd(etcd, prefix, timeout=max(1.0, lease_ttl_s / 2), access=etcd_access,
                         admin_key=secret.key(Role.ADMIN) if secret is not None else None)
        self.ident = f"{name}@{socket.gethostname()}:{os.getpid()}"
        self.lease_ttl_s = lease_ttl_s
        self.down_after_s = down_after_s
        self.tick_s = tick_s
        self.transport = transport
        self.rpc_timeout = rpc_timeout
        self.login = {"secret": secret, "tls_ca": tls}    # Credentials and ssl.SSLContext for the nodes
        self.active = False
        self.down_since: dict[str, float] = {}
        self.cache = MapCache(self.etcd, resync_s=MAP_RESYNC_S)
        self.care = EtcdCare(self.etcd, **(etcd_care or {}))      # etcd's files defragmented (etcdcare.py)
        self.ticks = 0
        self.dc: DataClient | None = None
        self.push: ViewPush | None = None       # view installs, many per request to a node (viewpush.py)
        self.fill: FillWatch | None = None      # leaders' fill progress, one request per node (fillwatch.py)
        self.installing: set[int] = set()       # partitions whose install runs beside the passes
        self.filled_asked: dict[int, float] = {}   # pid -> when its leader was last asked how far a fill is
        self.nodes_seen: dict[str, dict] = {}      # the registrations as the last pass saw them
        self.filling = self.filling_before = 0     # partitions being filled, this pass and the last
        self.changes = self.cache.follow()         # what the watch changed since the last pass
        self.unsettled: set[int] = set()           # partitions a pass found not settled: looked at every pass
        self.reports_pending: set[str] = set()     # registrations changed that no pass has adopted from yet
        self.tasks_full = False                    # the tasks' next run looks over everything
        self.swept_at = float("-inf")              # the last pass over every partition
        self.stale_nodes: set[str] = set()         # registrations changed since copies were last looked for
        self.stale_at = float("-inf")
        self.stale_full = False                    # the next look for stale copies looks at every registration
        self.visited = 0                           # partitions handled, over every pass (tests, logs)
        self.spares_given: dict[str, int] = {}     # new replicas placed on each node this pass
        self._bg: trio.Nursery | None = None
        # the partitions' CASes that wait together go in one etcd transaction (all or none; on a refusal each
        # is tried alone, to learn which moved)
        self._cases = Combiner(self._cas_many, max_batch=CREATE_TXN_MAX,
                               cut_short=lambda _: EtcdError("the view's write to etcd was cut short"))
        # placement, min_writable, decommission, admins' requests (manager/tasks.py)
        self.tasks = ManagerTasks(self, min_writable=min_writable, replicas=replicas, min_free_mib=min_free_mib,
                                  settle_s=max(2.0, 2 * tick_s), unfinished_after_s=unfinished_after_s)
        # partitions below their replica count (the alarm), copies blocking their refill (manager/redundancy.py)
        self.redundancy = Redundancy(self, warn_after_s=under_replicated_warn_s)

    # -- election ---------------------------------------------------------------------------------------
    async def run(self) -> None:
        async with DataClient.from_env(transport=self.transport, timeout=self.rpc_timeout, pool_mib=ADMIN_POOL_MIB,
                                   **self.login) as dc, \
                trio.open_nursery() as n:
            self.dc = dc
            self.push = ViewPush(dc)
            self.fill = FillWatch(dc)
            log.info("manager %s: standing by (etcd %s, prefix %s)", self.ident, self.etcd.urls, self.etcd.prefix)
            await n.start(self.cache.run)           # the map, followed by one watch (etcdmap.MapCache)
            delay = STANDBY_POLL_S
            while True:
                seen = self.cache.seq
                try:
                    await self._campaign_once()
                    delay = STANDBY_RESYNC_S
                except EtcdError as e:
                    (log.warning if delay >= STANDBY_RESYNC_S else log.debug)("manager %s: %s", self.ident, e)
                    delay = min(max(delay, STANDBY_POLL_S) * 2, 5.0)
                with trio.move_on_after(delay):     # the manager key's deletion arrives by the watch
                    await self.cache.wait(seen)

    async def _campaign_once(self) -> None:
        if self.cache.get(self.etcd.manager_key) is not None:
            return
        lease = Lease(self.etcd, self.lease_ttl_s)
        await lease.grant()
        if not await self.etcd.campaign(self.etcd.manager_key, self.ident, lease.id):
            await self.etcd.revoke(lease.id)
            return
        log.info("manager %s: ACTIVE (lease %x, ttl %ds)", self.ident, lease.id, lease.ttl)
        self.active = True
        self.down_since.clear()
        self.filled_asked.clear()
        self.swept_at = float("-inf")               # a new term starts with a pass over everything
        try:
            async with trio.open_nursery() as n:
                n.start_soon(self._active_loop)
                n.start_soon(self.care.run)
                await lease.keep_alive()            # returns when the lease is lost
                n.cancel_scope.cancel()
            log.warning("manager %s: lost the manager lease: standing by", self.ident)
        finally:
            self.active = False
            self.tasks.standby()
            self.redundancy.standby()
            await self.etcd.release(lease)          # a clean stop hands over at once

    async def _active_loop(self) -> None:
        """React to the map's changes (pushed by the watch); while something is under way (a replica down
        but not yet ``down_after_s``, an install to retry, a repair to follow) look again every ``tick_s``."""
        async with trio.open_nursery() as self._bg:
            await self._react()

    async def _react(self) -> None:
        while True:
            seen = self.cache.seq
            try:
                busy = await self.tick()
            except (EtcdError, ClientError) as e:
                log.warning("manager tick: %s", e)
                busy = True
            self.ticks += 1
            with trio.move_on_after(min(self.tick_s if busy else IDLE_LOOK_S, self.redundancy.next_warning_s())):
                await self.cache.wait(seen)

    # -- one pass over the map ----------------------------------------------------------------------
    async def tick(self) -> bool:
        """One pass over the cached map; True while some partition is not settled (look again soon).  It
        handles the partitions that changed since the last pass, those naming a node that came or went and
        those not settled last time; every ``FULL_SWEEP_S`` all of them."""
        nodes = self.cache.nodes()
        if nodes_error(len(nodes)) and len(nodes) != len(self.nodes_seen):
            log.warning("%d datanodes registered: %s (wire/limits.py): more than this manager is sized and "
                        "measured for", len(nodes), nodes_error(len(nodes)))
        before, self.nodes_seen = self.nodes_seen, nodes
        self.spares_given = {}
        self.filling_before, self.filling = self.filling, 0
        now = trio.current_time()
        for addr in list(self.down_since):
            if addr in nodes:
                del self.down_since[addr]
        changed, registered, other = self.changes.take()
        registered |= self.reports_pending          # (a pass cut short by an etcd error left these unread)
        self.reports_pending = registered
        full = now - self.swept_at >= FULL_SWEEP_S
        if full:
            self.swept_at = now
            todo = set(self.cache.part_ids())
        else:
            todo = changed | self.unsettled
            for addr in nodes.keys() ^ before.keys():          # a node came or went: the partitions naming it
                todo |= self.cache.pids_of(addr)
            if registered or other:     # a node back, one with room again, a drain ended: a spare for those short
                todo |= self.redundancy.since.keys()
        self.stale_nodes |= registered
        self.tasks.registrations_changed(registered)
        self.tasks_full |= full                     # (a pass that writes views returns before the tasks run)
        self.stale_full |= full
        restore, unknown = self.cache.invalid_parts()
        views = {pid: v for pid in todo if (v := self.cache.part(pid)) is not None}
        self.unsettled &= views.keys()
        self.unsettled |= views.keys()              # until this pass has found each settled (an error: next pass)
        self.redundancy.track({**{pid: v for pid in self.redundancy.since if pid not in views
                                  and (v := self.cache.part(pid)) is not None}, **views}, nodes)
        reporting = nodes if full or unknown else {a: nodes[a] for a in registered if a in nodes}
        wrote = await self._restore(restore) | await self._adopt(reporting, unknown, set(nodes))
        self.reports_pending = set()
        if wrote:
            return True                             # (looked at again once the views written arrive)
        busy = [await self._drop_stale(nodes, now)]

        async def one(view):
            b = await self._handle_safely(view, nodes, now)
            (self.unsettled.add if b else self.unsettled.discard)(view.id)
            busy.append(b)
        live = nodes.keys()
        async with trio.open_nursery() as n:
            for view in views.values():
                if view.id not in self.installing and _settled(view, live):
                    self.unsettled.discard(view.id)      # nothing to do: no task for it
                    self.filled_asked.pop(view.id, None)
                    continue
                self.visited += 1
                n.start_soon(one, view)
        full, self.tasks_full = self.tasks_full, False
        busy.append(await self.tasks.run(nodes, full=full))     # placement, min_writable, decommission, requests
        return any(busy)

    async def _drop_stale(self, nodes: dict, now: float) -> bool:
        """Copies etcd's views do not name (manager/redundancy.py), looked for among the registrations that
        changed (and those that held one), at most every STALE_LOOK_S; among all of them on a full pass."""
        full = self.stale_full
        if not full and (now - self.stale_at < STALE_LOOK_S or not (self.stale_nodes or self.redundancy.stale)):
            return bool(self.redundancy.stale)
        only = None if full else self.stale_nodes | {a for a, _ in self.redundancy.stale}
        self.stale_nodes, self.stale_at, self.stale_full = set(), now, False
        return await self.redundancy.drop_stale(_Peek(self.cache), nodes, only=only)

    async def _restore(self, views: list[PartView]) -> bool:
        """Write back the last valid view of partitions whose key now holds an invalid value."""
        changed = False
        for v in views:
            if await self._cas(v, v.rev):
                log.warning("partition %d: etcd held an invalid value (see above); wrote back its last valid "
                            "view (epoch %d, replicas %s)", v.id, v.epoch, ",".join(v.replicas))
                changed = True
        return changed

    async def _adopt(self, nodes: dict, invalid: dict[int, int], live: set[str]) -> bool:
        """Partitions the leaders among ``nodes`` (registrations) report and etcd has not (or has only as an
        invalid value: ``invalid`` maps them to its revision), or has at a lower epoch; ``live``: every node
        registered."""
        changed = False
        for addr, rec in nodes.items():
            for pid_s, pv in (rec.get("partitions") or {}).items():
                pid, replicas, epoch = int(pid_s), list(pv["replicas"]), int(pv["epoch"])
                if not replicas or replicas[0] != addr:
                    continue                        # only a leader's own view is adopted
                cur = self.cache.part(pid)
                if cur is None:
                    # only the leader is known to hold every acknowledged write; followers join
                    # ``synced`` when the leader reports them healthy (``_check_filled``)
                    view = PartView(pid, replicas, epoch, want=len(replicas), synced=replicas[:1])
                    view.state = _state(view)
                    if await self._cas(view, invalid.get(pid, 0)):
                        log.info("partition %d adopted: replicas %s epoch %d", pid, ",".join(replicas), epoch)
                        changed = True
                elif epoch > cur.epoch:
                    view = PartView(pid, replicas, epoch, want=max(cur.want, 1),
                                    synced=[r for r in replicas if r in cur.synced] or replicas[:1])
                    view.state = _state(view)
                    if not self.etcd.follows(cur.epoch, cur.replicas, view, live):
                        continue
                    if await self._cas(view, cur.rev):
                        log.info("partition %d: leader %s reports epoch %d (etcd had %d): adopted", pid, addr,
                                 epoch, cur.epoch)
                        changed = True
        return changed

    async def _handle_safely(self, view: PartView, nodes: dict, now: float) -> bool:
        try:
            return await self.handle(view, nodes, now)
        except (EtcdError, ClientError) as e:
            log.warning("partition %d: %s", view.id, e)
            return True

    async def handle(self, view: PartView, nodes: dict, now: float) -> bool:
        """Act on one partition; True while it is not settled (something to look at again soon)."""
        if view.id in self.installing:
            return True                             # its new view is being installed (``install_soon``)
        live = set(nodes)
        dead = [r for r in view.replicas if r not in live]
        for r in dead:
            self.down_since.setdefault(r, now)
        if view.leader in dead:
            cands = [r for r in view.replicas if r in live and r in view.synced]
            if not cands:
                if view.state != "read_only":
                    log.error("partition %d: leader %s is gone and no synced replica survives (%s): read_only",
                              view.id, view.leader, ",".join(view.replicas))
                    await self._set(view, state="read_only")
                return False                        # until one of its replicas registers again
            survivors = [cands[0]] + [r for r in view.replicas if r in live and r != cands[0]]
            await self.change(view, survivors, f"leader {view.leader} lost its lease; {cands[0]} leads",
                              background=True)
            return True
        gone = [r for r in dead if now - self.down_since[r] >= self.down_after_s]
        if gone:
            await self.change(view, [r for r in view.replicas if r not in gone],
                              f"follower(s) {','.join(gone)} lost their lease", background=True)
            return True
        if dead:
            return True                             # wait down_after_s before shrinking
        if not view.installed:
            await self.install_soon(view)
            return True
        unsynced = [r for r in view.replicas if r not in view.synced]
        if unsynced:
            self.filling += 1
            every = FILLED_LOOK_S if self.filling_before > FILLING_EACH_PASS else 0.0
            if now - self.filled_asked.get(view.id, float("-inf")) >= every:
                self.filled_asked[view.id] = now
                await self._check_filled(view, unsynced)
            return True
        self.filled_asked.pop(view.id, None)
        if len(view.replicas) < view.want:
            spare = self.pick_spare(view, nodes)
            if spare is not None:
                await self.change(view, view.replicas + [spare], f"re-replicating onto {spare}", background=True)
                return True
        if view.state != _state(view):
            await self._set(view, state=_state(view))
            return True
        return False

    def pick_spare(self, view: PartView, nodes: dict) -> str | None:
        """manager/placement.py decides (draining nodes excluded), by the replicas each node holds -- its
        registration's, and those given to it this pass: a failover's refills spread, not all on the
        freest node."""
        held = {a: len(r.get("partitions") or {}) + self.spares_given.get(a, 0) for a, r in nodes.items()}
        spare = self.tasks.spare(view, nodes, held=held)
        if spare is not None:
            self.spares_given[spare] = self.spares_given.get(spare, 0) + 1
        return spare

    # -- changes ------------------------------------------------------------------------------------
    async def _cas(self, view: PartView, rev: int, also: tuple[str, str] | None = None) -> bool:
        if also is not None:
            return await self.etcd.cas_part(view, expect_rev=rev, holder=(self.etcd.manager_key, self.ident),
                                            also=also)
        return await self._cases.submit("parts", (view, rev))

    async def _cas_many(self, _dest, items: list[tuple[PartView, int]]) -> list:
        """Many partitions' CASes: one transaction; refused (some key moved), each alone.  Per item: True
        (written), False (its key moved: the view changed under us) or the EtcdError it met."""
        holder = (self.etcd.manager_key, self.ident)
        if len(items) > 1 and len({v.id for v, _ in items}) == len(items):     # (etcd refuses a key twice)
            try:
                if await self.etcd.cas_parts(items, holder=holder):
                    return [True] * len(items)
            except EtcdError as e:
                log.info("%d views in one etcd transaction: %s; writing them one at a time", len(items), e)
        return await each(lambda item: self.etcd.cas_part(item[0], expect_rev=item[1], holder=holder), items,
                          EtcdError)

    async def _set(self, view: PartView, **changes) -> bool:
        new = PartView(**{**{k: getattr(view, k) for k in ("id", "replicas", "epoch", "want", "synced",
                                                           "state", "installed")}, **changes})
        if await self._cas(new, view.rev):
            view.__dict__.update(new.__dict__)
            return True
        return False

    async def change(self, view: PartView, replicas: list[str], why: str, background: bool = False) -> None:
        """Move ``view`` to ``replicas`` at epoch + 1 (a CAS in etcd), then install it on its members: before
        returning, or -- ``background`` -- beside the passes (``install_soon``)."""
        new = PartView(view.id, replicas, view.epoch + 1, want=view.want,
                       synced=[r for r in view.synced if r in replicas], state="recovering", installed=False)
        if not await self._cas(new, view.rev):
            log.info("partition %d: the view changed under us; next tick", view.id)
            return
        log.warning("partition %d: epoch %d -> %d, replicas %s -> %s (%s)", view.id, view.epoch, new.epoch,
                    ",".join(view.replicas), ",".join(replicas), why)
        if background:
            await self.install_soon(new)
        else:
            await self.install(new)

    async def install_soon(self, view: PartView) -> None:
        """Install ``view`` beside the passes; until it is done, the passes leave its partition alone.  (A
        pass run on its own, outside ``run``, installs before returning.)"""
        if self._bg is None:
            await self.install(view)
            return
        if view.id in self.installing:
            return
        self.installing.add(view.id)

        async def run() -> None:
            try:
                await self.install(view)
            except (EtcdError, ClientError) as e:
                log.warning("partition %d: installing epoch %d: %s (retrying next tick)", view.id, view.epoch, e)
            finally:
                self.installing.discard(view.id)    # (a pass is due: tick_s, while this one was busy)
        self._bg.start_soon(run)

    async def install(self, view: PartView) -> None:
        """Deliver ``view`` to its members (followers first, the leader last), then mark it installed."""
        body = {"replicas": view.replicas, "epoch": view.epoch}
        for addr in view.replicas[1:] + view.replicas[:1]:
            if addr not in view.synced and str(view.id) not in (self.nodes_seen.get(addr) or {}).get("partitions", {}):
                # a new replica (its registration lists no copy): created at once, not first updated in vain
                try:
                    await self.dc.admin(addr, Op.PARTITION_CREATE, partition=view.id, body=body)
                    log.info("partition %d: created on new replica %s (epoch %d)", view.id, addr, view.epoch)
                    continue
                except ClientError as e:
                    if e.result != Result.EXISTS:   # (it has a copy after all: updated below)
                        log.warning("partition %d: creating epoch %d on %s failed: %s (retrying next tick)",
                                    view.id, view.epoch, addr, e)
                        return
            try:
                await self.push.update(addr, view.id, body)
            except ClientError as e:
                if e.result == Result.STALE_EPOCH and e.arg >= view.epoch:
                    continue                        # it has it already (its agent saw etcd first)
                if e.result == Result.NOT_FOUND and addr not in view.synced:
                    await self.dc.admin(addr, Op.PARTITION_CREATE, partition=view.id, body=body)
                    log.info("partition %d: created on new replica %s (epoch %d)", view.id, addr, view.epoch)
                    continue
                log.warning("partition %d: installing epoch %d on %s failed: %s (retrying next tick)",
                            view.id, view.epoch, addr, e)
                return
        if await self._set(view, installed=True, state=_state(view, installed=True)):
            log.info("partition %d: epoch %d installed on %s (%s)", view.id, view.epoch,
                     ",".join(view.replicas), view.state)
        if any(r not in view.synced for r in view.replicas):
            try:
                await self.dc.admin(view.leader, Op.REPAIR, partition=view.id)
            except ClientError:
                pass                                # its heartbeat starts the repair anyway

    async def _check_filled(self, view: PartView, unsynced: list[str]) -> None:
        """A replica being filled by repair joins ``synced`` once the leader reports it healthy."""
        st = await self.fill.state(view.leader, view.id)    # (one request per leader node: fillwatch.py)
        if st is None or st[0] != view.epoch:
            return                                  # not (yet) led there at this epoch: next pass
        healthy = {a for a, state in st[1].items() if state == "healthy"}
        running = st[2]
        done = [r for r in unsynced if r in healthy]
        if done and not running:
            synced = view.synced + done
            new_state = _state(PartView(view.id, view.replicas, view.epoch, view.want, synced))
            if await self._set(view, synced=synced, state=new_state):
                log.info("partition %d: %s filled by repair; %s", view.id, ",".join(done), new_state)


class _Peek:
    """The cached views by partition id, read in place (no copy): for a look over every registration."""

    def __init__(self, cache: MapCache):
        self.cache = cache

    def get(self, pid: int) -> PartView | None:
        return self.cache.peek(pid)


def _settled(view: PartView, live) -> bool:
    """Nothing for ``handle`` to do (its checks, in short): installed, every replica live and synced, at
    its replica count, in the state that says so."""
    return (view.installed and len(view.replicas) >= view.want and view.state == "writable"
            and all(r in live and r in view.synced for r in view.replicas))


def _state(view: PartView, installed: bool | None = None) -> str:
    installed = view.installed if installed is None else installed
    if not installed or any(r not in view.synced for r in view.replicas):
        return "recovering" if len(view.replicas) >= view.want else "degraded"
    return "degraded" if len(view.replicas) < view.want else "writable"


class ManagerMetrics:
    """The manager's Prometheus families (``dnmanager --metrics-listen``), read at scrape time."""

    def __init__(self, m: Manager):
        self.m = m
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(self)

    def describe(self):
        return []

    def collect(self):
        yield GaugeMetricFamily("dnmanager_active", "1 while this manager is the active one", value=int(self.m.active))
        yield etcd_invalid_family("dnmanager", self.m.etcd.invalid)
        r = self.m.redundancy          # (all 0 on a standby: the active manager's count is the cluster's)
        yield GaugeMetricFamily("dnmanager_under_replicated_partitions",
                                "Partitions with fewer live, synced replicas than their replica count (want)",
                                value=r.count())
        yield GaugeMetricFamily("dnmanager_under_replicated_oldest_seconds",
                                "How long the partition under-replicated longest has been so (since this "
                                "manager saw it; 0: none)", value=round(r.oldest_s(), 3))
        yield GaugeMetricFamily("dnmanager_under_replicated_over_bound_partitions",
                                "Under-replicated partitions past --under-replicated-warn-s (logged as warnings)",
                                value=r.over_bound())

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
