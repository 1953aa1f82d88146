"""The active manager's work beyond failover: placing new partitions, keeping ``min_writable`` writable
partitions, decommissioning nodes.  Called once per manager pass (``Manager.tick`` -> ``ManagerTasks.run``),
after the per-partition failover / re-replication handling; the decisions are manager/placement.py's.

Keys (under the cluster prefix, next to ``nodes/``, ``parts/`` and ``manager``; see wire/etcdmap.py):

* ``requests/<id>`` -- an admin's request, e.g. ``{"op": "create", "count": 4, "replicas": 3}`` (written by
  ``dnctl partition create --count N``).  The manager answers in the same key: ``"state": "done"`` with the
  partitions it made, or ``"state": "failed"`` with an ``error``; the requester reads and deletes it.
  While serving it, the manager records each partition it publishes in the key's ``made`` list (one etcd
  transaction with the partition's view), so a standby that takes over mid-request finishes it and never
  creates a partition twice.  ``made`` holds ids only (the views are in ``parts/``): the key is rewritten
  once per partition, and a list of whole views there made a request of N partitions write O(N^2) bytes
  into etcd's history.
* ``drain/<addr>``  -- the node is being decommissioned (``dnctl node decommission ADDR``).  No new replica
  goes there (placement, re-replication), and every partition naming it is moved, one membership change at
  a time, each through the CAS path every other change takes (``Manager.change``): first a spare is added
  (epoch + 1; the leader's repair fills it; it joins ``synced`` when the leader reports it healthy), then the
  draining node is removed (epoch + 1; a synced replica leads if it led).  Its agent sees the view that no
  longer names it and drops its copy.  The key stays after the node is empty (the node takes no new
  replicas) until ``dnctl node decommission ADDR --cancel``.

* ``handoff/<addr>`` -- the node is stopping (a controlled shutdown, datanode/drain.py; put by its agent
  under its lease, so it goes when the node leaves).  Every partition naming it moves off it at once, one
  change each (``hand_off``, ``handoff_plan``): where it leads, the first synced replica that stays leads
  (epoch + 1: the same fenced change as a failover); where it follows, it is removed (so no write waits for
  it while it is away).  The new views are installed beside the passes, many per request to each node
  (manager/viewpush.py).  It gets no new replica while the key lives; once back (a new lease), it is an
  ordinary spare again and re-replication refills the partitions it left.

A new partition is created on its nodes first (``PARTITION_CREATE``, all or nothing) and then published in
etcd with every replica synced (it is empty) and ``writable``; ids are one above any id etcd or a node knows.
A create cut short before the leader had it leaves empty copies on followers: ``drop_unfinished`` removes them.
"""
from __future__ import annotations

import functools
import logging

import trio

from client import admin
from client.sdk import ClientError
from wire.etcdmap import EtcdError, PartView
from wire.limits import DEFAULT_REPLICAS
from wire.protocol import Op
from manager.placement import PlacementError, eligible, pick_spare, place

log = logging.getLogger(__name__)
MiB = 1 << 20
# states in which a partition with an installed view takes writes (the SDK's put uses them): a partition
# that lost a replica for a moment is re-replicated, not replaced by a new one
TAKES_WRITES = ("writable", "degraded", "recovering")
CREATE_CHUNK = 32  # partitions created on their nodes at once, then published together (<= CREATE_TXN_MAX)
FORGET_S = 10.0    # a partition no replica holds any more is dropped from the map after this long
HOUSEKEEP_S = 2.0  # the looks for partitions no replica holds and for half-done creates, at most this often


class ManagerTasks:
    """The work of ``m`` (a manager.service.Manager: its etcd handle, DataClient, CAS and ``change``)."""

    def __init__(self, m, *, min_writable: int = 2, replicas: int = DEFAULT_REPLICAS, min_free_mib: int = 256,
                 settle_s: float = 2.0, unfinished_after_s: float = 30.0):
        self.m = m
        self.min_writable = min_writable
        self.replicas = replicas
        self.min_free = min_free_mib * MiB
        self.settle_s = settle_s           # after becoming active: let every live node register first
        self.draining: set[str] = set()
        self.leaving: set[str] = set()     # nodes stopping (``handoff/``): moved off at once, given nothing
        self._handoff_warned: dict[int, str] = {}
        self._active_since: float | None = None
        self._warned = ""
        self._missing: dict[int, float] = {}
        self._seen: set[str] = set()     # nodes registered at some point while this manager was active
        self.unfinished_after_s = unfinished_after_s
        self._unfinished: dict[tuple[str, int], float] = {}   # (node, partition) -> since when (see below)
        self._warned_unfinished: set[tuple[str, int]] = set()
        self._verbs_only_warned: set[str] = set()
        self._housekept = float("-inf")
        self._changed_nodes: set[str] = set()

    # -- keys ---------------------------------------------------------------------------------------
    @property
    def requests_prefix(self) -> str:
        return self.m.etcd.key("requests") + "/"

    @property
    def drain_prefix(self) -> str:
        return self.m.etcd.key("drain") + "/"

    @property
    def handoff_prefix(self) -> str:
        return self.m.etcd.key("handoff") + "/"

    @property
    def away(self) -> set[str]:
        """Nodes that get no new replica: being decommissioned or stopping."""
        return self.draining | self.leaving

    # -- one pass -----------------------------------------------------------------------------------
    def registrations_changed(self, addrs: set[str]) -> None:
        """These nodes' registrations changed (the manager's pass says so): the next looks for leftovers
        look at them."""
        self._changed_nodes |= addrs

    async def run(self, nodes: dict, full: bool = True) -> bool:
        """One pass (hook: the end of ``Manager.tick``).  It reads the manager's watched copy of the map
        (``m.cache``: no etcd request at idle) and etcd itself only before it changes something.  True while
        work is under way (a node draining, a manager not yet settled): look again soon.  The looks for
        leftovers (``forget_deleted``, ``drop_unfinished``: each waits seconds before it acts) go over every
        partition and registration on ``full`` passes; in between, at most every ``HOUSEKEEP_S``, over the
        registrations that changed since (``registrations_changed``) and what they already track."""
        now = trio.current_time()
        if self._active_since is None:
            self._active_since = now
        self.draining = {k[len(self.drain_prefix):] for k, _v in self.m.cache.under(self.drain_prefix)}
        self.leaving = {k[len(self.handoff_prefix):] for k, _v in self.m.cache.under(self.handoff_prefix)}
        await self.hand_off(nodes)
        self.warn_unreachable_transport(nodes)
        await self.serve_requests(nodes)
        if full or now - self._housekept >= HOUSEKEEP_S:
            only = None if full else self._changed_nodes
            self._housekept, self._changed_nodes = now, set()
            await self.forget_deleted(nodes, now, only)
            await self.drop_unfinished(nodes, now, only)
        await self.decommission(nodes)
        settled = now - self._active_since >= self.settle_s
        if settled:
            await self.keep_min_writable(nodes)
        return bool(self.draining) or bool(self.leaving) or not settled

    def standby(self) -> None:
        self._active_since = None
        self._seen.clear()

    # -- placement ----------------------------------------------------------------------------------
    def _load(self, parts: dict[int, PartView]) -> tuple[dict, dict]:
        held: dict[str, int] = {}
        leading: dict[str, int] = {}
        for v in parts.values():
            for a in v.replicas:
                held[a] = held.get(a, 0) + 1
            leading[v.leader] = leading.get(v.leader, 0) + 1
        return held, leading

    def spare(self, view: PartView, nodes: dict, parts: dict[int, PartView] | None = None,
              held: dict[str, int] | None = None) -> str | None:
        """A node for one more replica of ``view`` (not draining or stopping, not holding it, enough free space);
        ``held``: the replicas each node has (else counted from ``parts``)."""
        ok = {a: r for a, r in eligible(nodes, exclude=self.away, min_free_bytes=self.min_free).items()
              if str(view.id) not in (r.get("partitions") or {})}
        if held is None:
            held, _ = self._load(parts or {})
        return pick_spare(ok, view.replicas, held=held)

    async def create(self, nodes: dict, count: int, replicas: int,
                     request: tuple[str, dict] | None = None, volume: str = "") -> list[dict]:
        """Place and create ``count`` new partitions; returns their views (as dicts).  PlacementError when
        there are not enough eligible nodes; a partition that fails to be created ends the batch.

        ``request=(key, body)``: an admin's request being served.  Each partition is published together with
        the request's progress (``body["made"]``, in the same etcd transaction), so a manager that takes
        over a half-served request creates only what is still missing."""
        parts = await self.m.etcd.parts()
        ok = eligible(nodes, exclude=self.away, min_free_bytes=self.min_free)
        held, leading = self._load(parts)
        # (O(count x replicas x nodes): seconds for a thousand partitions on hundreds of nodes, in a thread so
        # that the event loop keeps this manager's lease alive meanwhile)
        layout = await trio.to_thread.run_sync(functools.partial(place, ok, count, replicas, held=held,
                                                                 leading=leading))
        known = set(parts) | {int(p) for r in nodes.values() for p in (r.get("partitions") or {})}
        known |= await self._held_now({a for reps in layout for a in reps})
        first = max(known, default=0) + 1
        todo = [(first + i, reps) for i, reps in enumerate(layout)]
        out = []
        # a chunk is created on its nodes concurrently, then published in one etcd transaction: a batch costs
        # a round trip per chunk, not per partition.  A failed create ends the batch after its chunk's
        # successes are published (an unpublished copy is dropped later: drop_unfinished).
        for at in range(0, len(todo), CREATE_CHUNK):
            chunk = todo[at:at + CREATE_CHUNK]
            made: dict[int, PartView] = {}
            failed: list[str] = []

            async def one(pid: int, reps: list[str]) -> None:
                try:
                    await admin.create_partition(self.m.dc, pid, reps, volume=volume, fresh=True)
                except ClientError as e:
                    failed.append(str(e))
                    return
                made[pid] = PartView(pid, reps, 1, want=replicas, synced=list(reps), state="writable",
                                     installed=True)
            async with trio.open_nursery() as n:
                for pid, reps in chunk:
                    n.start_soon(one, pid, reps)
            views = [made[pid] for pid, _ in chunk if pid in made]
            if views:
                also = None
                if request is not None:
                    key, body = request
                    body["made"] = body.get("made", []) + [v.id for v in views]
                    also = (key, body)
                if not await self.m.etcd.create_parts(views, holder=(self.m.etcd.manager_key, self.m.ident),
                                                      also=also):
                    raise ClientError(f"partitions {views[0].id}-{views[-1].id}: etcd already has one of them "
                                      f"(created concurrently?), or this manager is no longer the active one")
                for v in views:
                    log.info("partition %d created: replicas %s (leader %s)", v.id, ",".join(v.replicas),
                             v.replicas[0])
                log.warning("created partitions %s (%d)", _ids([v.id for v in views]), len(views))
                out += [v.to_dict() for v in views]
            if failed:
                raise ClientError(failed[0] + (f" (and {len(failed) - 1} more in the same batch)"
                                               if len(failed) > 1 else ""))
        return out

    async def _held_now(self, addrs: set[str]) -> set[int]:
        """The partitions these nodes hold, asked of them: a registration (and so the watched map) lags a
        partition created on a node directly, as `dnctl cluster up` does, and an id taken from it alone
        could be one the node already has."""
        held: set[int] = set()

        async def ask(addr: str) -> None:
            try:
                held.update(p["id"] for p in await admin.partition_list(self.m.dc, addr))
            except ClientError:
                pass                # unreachable: create_partition says so, naming it
        async with trio.open_nursery() as n:
            for addr in addrs:
                n.start_soon(ask, addr)
        return held

    async def keep_min_writable(self, nodes: dict) -> None:
        """Create a partition when fewer than ``min_writable`` take writes (``TAKES_WRITES``) with
        room on every replica (one on a draining node counts: it takes writes until it has moved)."""
        self._seen |= set(nodes)
        if self.min_writable <= 0 or not nodes:
            return

        def ok(v) -> bool:
            return (v.state in TAKES_WRITES      # a view being installed (a change under way) counts too
                    and all(int((nodes.get(a) or {}).get("free_bytes") or 0) >= self.min_free for a in v.replicas))
        enough = 0
        for _key, v in self.m.cache.under(self.m.etcd.parts_prefix):     # (stops at min_writable: no copies)
            enough += ok(v)
            if enough >= self.min_writable:
                self._warned = ""
                return
        good = [v for v in (await self.m.etcd.parts()).values() if ok(v)]   # the watched copy may lag: ask etcd
        if len(good) >= self.min_writable:
            return
        ok = eligible(nodes, exclude=self.away, min_free_bytes=self.min_free)
        n = min(self.replicas, len(ok))
        if n < self.replicas and len(self._seen - self.draining) > len(ok):
            self._warn(f"only {len(good)} writable partition(s), fewer than min_writable {self.min_writable}; "
                       f"not creating one with {n} of {self.replicas} replicas while node(s) "
                       f"{', '.join(sorted(self._seen - self.draining - set(ok)))} are away or full")
            return
        if n < 1:
            self._warn(f"only {len(good)} writable partition(s), fewer than min_writable {self.min_writable}, "
                       f"and no node has {self.min_free // MiB} MiB free to place another")
            return
        try:
            made = await self.create(nodes, 1, n)
        except (PlacementError, ClientError) as e:
            self._warn(f"keeping min_writable {self.min_writable}: {e}")
            return
        log.warning("min_writable %d: %d writable partition(s) had room; created partition %d",
                    self.min_writable, len(good), made[0]["id"])

    def _warn(self, text: str) -> None:
        if text != self._warned:
            log.warning("%s", text)
            self._warned = text

    def warn_unreachable_transport(self, nodes: dict) -> None:
        """A node that takes only verbs connections cannot be managed from a host without an RDMA device:
        say so once per node, in the manager's log, rather than let every request to it fail."""
        if getattr(self.m.dc.domain, "device", None) is not None:
            return
        for addr, rec in nodes.items():
            if rec.get("transport") == "verbs" and addr not in self._verbs_only_warned:
                self._verbs_only_warned.add(addr)
                log.warning("node %s takes only RDMA verbs connections (transport = \"verbs\") and this "
                            "manager has no RDMA device: it cannot reach it; run the manager on a host with "
                            "one, or set the node's transport to auto", addr)

    async def forget_deleted(self, nodes: dict, now: float, only: set[str] | None = None) -> None:
        """A partition etcd has but none of its replicas holds any more, all of them alive and registered
        (deleted by an admin: `dnctl partition delete`, a benchmark's scratch partition), is removed from
        the map after FORGET_S, so clients stop picking it and min_writable stops counting it (the delete
        is a CAS on the partition's revision: a stale copy of the map cannot remove a newer view).  ``only``:
        the partitions naming these nodes (whose registrations changed) and those already missing."""
        if only is None:
            parts = self.m.cache.parts()
        else:
            pids = set(self._missing).union(*(self.m.cache.pids_of(a) for a in only))
            parts = {pid: v for pid in pids if (v := self.m.cache.part(pid)) is not None}
        for pid in list(self._missing):
            if self.m.cache.peek(pid) is None:
                del self._missing[pid]
        for pid, v in parts.items():
            gone = bool(v.replicas) and all(a in nodes and str(pid) not in (nodes[a].get("partitions") or {})
                                            for a in v.replicas)
            if not gone:
                self._missing.pop(pid, None)
                continue
            since = self._missing.setdefault(pid, now)
            if now - since >= FORGET_S and await self.m.etcd.cas_delete_part(
                    pid, expect_rev=v.rev, holder=(self.m.etcd.manager_key, self.m.ident)):
                log.warning("partition %d: no replica (%s) holds it any more: removed from the map", pid,
                            ",".join(v.replicas))
                del self._missing[pid]

    async def drop_unfinished(self, nodes: dict, now: float, only: set[str] | None = None) -> None:
        """A create that died half-way -- a manager killed after creating a partition on some followers but
        before its leader (``admin.create_partition`` creates the leader last) -- leaves copies that no map
        names and nobody adopts (the manager adopts a partition from its leader's report only).  Once the
        leader has been registered without the partition for ``unfinished_after_s`` (far longer than a
        create takes), each such copy still at epoch 1 and empty, asked of its node, is deleted there (to
        the node's trash: kept ``trash_retention_s``).  One holding data is left alone, with a warning.
        ``only``: the registrations of these nodes (changed) and of those holding such a copy already."""
        current = set()
        look = None if only is None else only | {a for a, _ in self._unfinished}
        for addr, rec in nodes.items():
            if look is not None and addr not in look:
                continue
            for pid_s, pv in (rec.get("partitions") or {}).items():
                pid, reps = int(pid_s), list(pv.get("replicas") or [])
                if self.m.cache.peek(pid) is not None or not reps or reps[0] == addr or int(pv.get("epoch", 0)) != 1:
                    continue
                leader = nodes.get(reps[0])
                if leader is None or pid_s in (leader.get("partitions") or {}):
                    continue           # its leader is down (it may hold it) or holds it (then it is adopted)
                key = (addr, pid)
                current.add(key)
                if now - self._unfinished.setdefault(key, now) >= self.unfinished_after_s:
                    await self._drop_unfinished_copy(addr, pid, reps[0])
        for key in list(self._unfinished):
            if key not in current and (look is None or key[0] in look):
                del self._unfinished[key]

    async def _drop_unfinished_copy(self, addr: str, pid: int, leader: str) -> None:
        try:
            row = next((r for r in await self.m.dc.admin(addr, Op.PARTITION_LIST) if r["id"] == pid), None)
            if row is None or row["epoch"] != 1 or pid in await self.m.etcd.parts():
                return                             # gone, changed, or published meanwhile
            if row.get("extents") or row.get("bytes"):
                if (addr, pid) not in self._warned_unfinished:
                    self._warned_unfinished.add((addr, pid))
                    log.warning("partition %d on %s: no map names it and its leader %s does not hold it, but "
                                "it holds data (%d extents, %d bytes): left alone", pid, addr, leader,
                                row.get("extents", 0), row.get("bytes", 0))
                return
            await self.m.dc.admin(addr, Op.PARTITION_DELETE, partition=pid)
        except (ClientError, EtcdError) as e:
            log.info("partition %d on %s: removing the copy a half-done create left: %s", pid, addr, e)
            return
        log.warning("partition %d: removed from %s, an empty copy a create that died half-way left (no map "
                    "names it, its leader %s does not hold it); it is in that node's trash", pid, addr, leader)

    # -- requests from admins -----------------------------------------------------------------------
    async def serve_requests(self, nodes: dict) -> None:
        # requests are checked entries (wire/mapcheck.py): well-formed and, with a secret, MAC'd by an admin
        def pending(req) -> dict | None:
            return req if req is not None and req.get("state", "pending") == "pending" else None
        for key, req in self.m.cache.under(self.requests_prefix):
            if pending(req) is None:
                continue
            req = pending(await self.m.etcd.get_entry(key))     # the watched copy may not show our answer yet
            if req is None:
                continue
            try:
                if req.get("op") != "create":
                    raise ValueError(f"unknown request {req.get('op')!r}")
                count, replicas = int(req["count"]), int(req["replicas"])
                made = list(req.get("made", []))     # published by a manager before us that did not finish
                new = []
                if count > len(made):
                    new = await self.create(nodes, count - len(made), replicas, request=(key, req),
                                            volume=req.get("volume") or "")
                req.update(state="done", partitions=await self._views(made) + new, manager=self.m.ident)
            except (PlacementError, ClientError, ValueError, KeyError) as e:
                req.update(state="failed", error=str(e), manager=self.m.ident)
                log.warning("request %s failed: %s", key, e)
            await self.m.etcd.put_entry(key, req)

    async def _views(self, made: list) -> list[dict]:
        """The views of the partitions a request's ``made`` names: ids (their views read from etcd now), or
        whole views as a manager of an earlier version wrote them."""
        parts = await self.m.etcd.parts() if any(not isinstance(m, dict) for m in made) else {}
        return [m if isinstance(m, dict) else parts[int(m)].to_dict() if int(m) in parts else {"id": int(m)}
                for m in made]

    # -- a stopping node's hand-off ------------------------------------------------------------------------
    async def hand_off(self, nodes: dict) -> None:
        """Move every partition naming a stopping node off it (``handoff_plan``), all at once: the node waits
        for this before it stops taking writes.  A partition that cannot move now is said once (and looked at
        again next pass); the node stops anyway after its drain_timeout_s."""
        if not self.leaving:
            self._handoff_warned.clear()
            return
        live = set(nodes)

        async def move(view: PartView, new: list[str]) -> None:
            gone = [a for a in view.replicas if a in self.leaving]
            why = (f"{','.join(gone)} stopping: {new[0]} leads" if view.leader in gone else
                   f"{','.join(gone)} stopping: removed until it is back")
            try:
                await self.m.change(view, new, why, background=True)
            except (EtcdError, ClientError) as e:
                log.warning("hand-off: partition %d: %s", view.id, e)

        async with trio.open_nursery() as n:
            for view in self.m.cache.parts().values():
                if view.id in self.m.installing:
                    continue                        # its new view is being installed: looked at after
                new, why = handoff_plan(view, self.leaving, live)
                if new is not None:
                    self._handoff_warned.pop(view.id, None)
                    n.start_soon(move, view, new)
                elif why and self._handoff_warned.get(view.id) != why:
                    self._handoff_warned[view.id] = why
                    log.warning("hand-off: partition %d cannot move now: %s", view.id, why)

    # -- decommission -------------------------------------------------------------------------------
    async def decommission(self, nodes: dict) -> None:
        if not self.draining:
            return
        parts = await self.m.etcd.parts()
        for view in parts.values():
            leaving = [a for a in view.replicas if a in self.draining]
            if not leaving:
                continue
            try:
                await self._move(view, leaving, nodes, parts)
            except (EtcdError, ClientError) as e:
                log.warning("decommission: partition %d: %s", view.id, e)

    async def _move(self, view: PartView, leaving: list[str], nodes: dict, parts: dict[int, PartView]) -> None:
        live = set(nodes)
        if (not view.installed or view.state == "read_only"
                or any(a not in live for a in view.replicas if a not in self.draining)):
            return                               # failover / shrink first (Manager.handle)
        if any(a not in view.synced for a in view.replicas):
            return                               # a replica is still being filled
        staying = [a for a in view.replicas if a not in self.draining]
        want = view.want or len(view.replicas)
        if len(staying) < want:
            spare = self.spare(view, nodes, parts)
            if spare is None:
                self._warn(f"decommission: partition {view.id} has no spare node to move to "
                           f"(replicas {','.join(view.replicas)}); waiting")
                return
            await self.m.change(view, view.replicas + [spare],
                                f"decommissioning {','.join(leaving)}: adding {spare}")
            return
        await self.m.change(view, staying, f"decommissioning {','.join(leaving)}: removed (its replacement is filled)")


def handoff_plan(view: PartView, leaving: set[str], live: set[str]) -> tuple[list[str] | None, str]:
    """The replica list partition ``view`` moves to so that it names no node of ``leaving`` (stopping nodes):
    (the list, "") or (None, why it cannot move now; "" when it names none of them).  A leaving leader hands
    over to the first replica that stays, is live and is ``synced`` (it holds every acknowledged write), as a
    failover picks one; leaving followers are dropped in the same change.  Not while another change is being
    installed or a replica that stays is down (failover goes first), never to an empty or leaderless list."""
    gone = [a for a in view.replicas if a in leaving]
    if not gone:
        return None, ""
    if not view.installed:
        return None, f"epoch {view.epoch} is still being installed"
    if view.state == "read_only":
        return None, "it is read_only (no synced replica survived an earlier failure)"
    staying = [a for a in view.replicas if a not in leaving]
    if not staying:
        return None, f"every replica ({','.join(view.replicas)}) is stopping"
    down = [a for a in staying if a not in live]
    if down:
        return None, f"replica(s) {','.join(down)} are down: failover first"
    if view.leader not in leaving:
        return staying, ""
    cands = [a for a in staying if a in view.synced]
    if not cands:
        return None, (f"no replica that stays is in sync to take the lead (synced: "
                      f"{','.join(view.synced) or 'none'})")
    return [cands[0]] + [a for a in staying if a != cands[0]], ""


def _ids(pids: list[int]) -> str:
    """``[3, 4, 5, 9]`` -> ``"3-5,9"``: a batch's ids in one short log line."""
    runs: list[list[int]] = []
    for p in sorted(pids):
        if runs and p == runs[-1][1] + 1:
            runs[-1][1] = p
        else:
            runs.append([p, p])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)
