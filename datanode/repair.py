"""Replica health, repair and scrub: how a leader keeps its followers identical to itself.

Who does what
-------------
``Repairer`` runs inside the Node's nursery.  Every heartbeat it starts one ``PartitionWorker`` for each
partition this node *leads* (a worker ends by itself when the node stops leading it, e.g. after
``set-leader`` or when the partition is deleted).  A worker is two tasks in its own nursery:

* the **heartbeat** (every ``heartbeat_s``; driven per follower *node* by ``health.HealthProber``, which
  sends the worker's partition through the probe below only when its copies may differ: see there): asks
  each follower for its view (``REPLICA_STATE``: epoch,
  replica list, extent sizes, tombstones) and keeps a ``ReplicaHealth`` per follower: ``healthy``,
  ``lagging`` (differs from the leader), ``repairing`` or ``unreachable``, with the last contact and the
  bytes it is behind.  A follower at an older epoch is sent ``PARTITION_UPDATE`` (an old leader coming
  back learns the new list this way); one at a *newer* epoch means this node was deposed: it adopts that view (or drops the partition if it
  is no longer a member) and the worker ends.
* the **repair loop**: wakes when the heartbeat finds a difference, when a follower comes back, every
  ``repair_interval_s`` (a full pass that compares block CRCs too), on demand (``Op.REPAIR``) and for a
  scrub (``scrub_interval_s``, ``Op.SCRUB``; and, unless scrub_interval_s is 0, a few heartbeats after
  start for a partition opened with ``open_verify = tail``, whose blocks were not all CRC-checked at open).

Repair (the leader is authoritative)
------------------------------------
For each follower: extents deleted on the leader are deleted there (forwarded ``MARK_DELETE``); extents
only the follower has are created empty on the leader (ids stay in step) and so cut to nothing below;
missing extents are created (forwarded ``CREATE_EXTENT`` with the id).  Then per extent, in the extent's
lane turn on the leader (so no client append of this extent is half-way): compare the follower's block
CRCs with ours.  A follower longer than us is first cut back to our size (bytes beyond the leader's end
were never acknowledged); then the first block that still differs is where the follower is cut back
(forwarded ``TRUNCATE``).  A follower that is merely *behind* (its last partial block is a prefix of
ours) is never cut.  Then the missing tail is copied chunk by chunk: each chunk takes the
extent's lane turn, is read from our store into a pool block, and the follower is sent a forwarded
``WRITE`` naming that block (up to ``REPAIR_DEPTH`` chunks in flight, in order on the one link) --
exactly the replica-write path (it READs from our pool; no other copy).  The
follower accepts it only at its exact end, so a client append forwarded earlier on the same link always
wins and the repair write is then simply refused and skipped.  The turn is released before waiting for
the ack, so client appends are held for at most one read of one chunk.  ``repair_mib_s`` caps the rate.

Sealed extents stay sealed after a repair makes them identical (clients already moved to a new extent;
unsealing would need every replica to agree on the seal state, for no gain).  Repair writes carry
``Flag.REPAIR`` so a follower applies them to an extent it sealed itself.

Scrub
-----
A pass walks every extent of the leader in 4 MiB ranges and asks every replica (itself included) to
re-read those blocks and check their CRCs (``SCRUB_EXTENT``), paced by ``scrub_mib_s``.  A bad block on a
follower: the extent is sealed, the follower cut back to the start of the bad block and repaired from the
leader.  A bad block on the leader: a follower whose blocks from there on verify and match our CRC
entries is found, our extent is cut back and refilled from it (READ into a small landing region that
peers may WRITE -- the main pool stays read-only to peers).  Events are logged and counted.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from collections import deque

import trio

from wire.crc import crc32c
from wire.pool import BuddyPool, PoolExhausted
from wire.protocol import BodyError, Flag, Header, Op, Result, decode_view
from . import viewguard
from .health import HealthProber, leader_token
from .repairkit import JSON_ANSWER, JSON_FIRST, MiB, NotHosted, RateLimiter, Refused, RepairAbort, _name
from .scrub import ScrubPasses, scrub_range
from .statebatch import StateAsks
from .store import BLOCK, StoreError
from wire.transport.base import Access, TransportError

log = logging.getLogger(__name__)
REPAIR_DEPTH = 4          # repair chunks in flight to one follower
FIRST_SCRUB_HEARTBEATS = 3  # a partition opened without full verification is scrubbed this soon after start


@dataclasses.dataclass
class ReplicaHealth:
    addr: str
    state: str = "unknown"          # healthy | lagging | repairing | unreachable | unknown
    last_contact: float | None = None
    bytes_behind: int = 0
    extents_behind: int = 0
    epoch: int | None = None
    error: str = ""
    in_flight_bytes: int = 0        # differences on open extents that are still moving (appends in flight)
    came_back: bool = False         # was unreachable, answered again: wants a full pass
    marks: dict | None = None       # follower sizes at the previous probe (to tell "moving" from "stuck")
    repaired_bytes: int = 0         # bytes repair copied to it while this node led the partition (all passes)
    base: tuple | None = None       # (its token, ours) when a probe last found it healthy: unchanged since, it
                                    # still is (datanode/health.py)
    missing: float | None = None    # when it answered that it does not host the partition: probed again once
                                    # its NODE_HEALTH lists it, or MISSING_RECHECK_S later (datanode/health.py)

    def to_dict(self) -> dict:
        now = time.time()
        return {"addr": self.addr, "state": self.state, "last_contact": self.last_contact,
                "contact_age_s": round(now - self.last_contact, 2) if self.last_contact else None,
                "bytes_behind": self.bytes_behind, "extents_behind": self.extents_behind,
                "in_flight_bytes": self.in_flight_bytes, "repaired_bytes": self.repaired_bytes,
                "epoch": self.epoch, "error": self.error}


@dataclasses.dataclass
class Difference:
    """How a follower's extents differ from the leader's (``compare_marks``)."""
    behind: int = 0           # bytes of differences that need repair
    extents: int = 0          # extents with such a difference
    in_flight: int = 0        # bytes of differences that are appends in flight (open extents still moving)
    first: str = ""           # the first difference that needs repair, in words


def compare_marks(lmarks: dict[int, int], fmarks: dict[int, int], sealed: set[int], ldeleted: set[int],
                  prev: dict[int, int] | None, ldigests: dict[int, int] | None = None,
                  fdigests: dict[int, int] | None = None) -> Difference:
    """Compare a follower's extent sizes (``fmarks``) with the leader's (``lmarks``).  Pure.

    A difference needs repair when nothing can still close it by itself: the extent is sealed (no appends
    will come), the follower's size did not move since the previous probe (``prev``), the follower has an
    extent the leader deleted, or an extent appeared/vanished on one side and stayed so.  A difference on an
    open extent whose follower size is moving (or on the first look, ``prev`` None) is appends in flight.
    Same size but another digest (``ExtentStore.digests``, taken with those sizes) is different bytes: that
    always needs repair (appends in flight never leave two copies of one size different)."""
    d = Difference()

    def needs_repair(e: int, n: int, why: str) -> None:
        d.behind += n
        d.extents += 1
        d.first = d.first or f"extent {e}: {why}"

    for e, size in sorted(lmarks.items()):
        f = fmarks.get(e)
        if f == size:
            if ldigests is not None and fdigests is not None and e in fdigests and ldigests.get(e) != fdigests[e]:
                needs_repair(e, size, f"same size ({size} bytes), different bytes (digest)")
            continue
        gap = abs(size - (f or 0))
        why = f"leader {size} bytes, follower {'missing' if f is None else f'{f} bytes'}"
        moving = prev is None or prev.get(e) != f
        if e in sealed or not moving:
            needs_repair(e, gap, why + (" (sealed)" if e in sealed else ""))
        else:
            d.in_flight += gap
    for e, f in sorted(fmarks.items()):
        if e not in lmarks and (e in ldeleted or (prev is not None and e in prev)):
            needs_repair(e, f, "only on the follower" + (" (deleted on the leader)" if e in ldeleted else ""))
    return d


def follower_marks(st: dict) -> tuple[dict[int, int], dict[int, int] | None]:
    """(sizes, digests or None) from a REPLICA_STATE answer (a node without digests sends only sizes)."""
    marks = {int(k): v for k, v in st["marks"].items()}
    dig = st.get("digests")
    return marks, ({int(k): v for k, v in dig.items()} if isinstance(dig, dict) else None)


@dataclasses.dataclass
class RepairCounters:
    repair_passes: int = 0
    repair_bytes: int = 0
    repair_truncates: int = 0
    repair_creates: int = 0
    repair_deletes: int = 0
    repair_errors: int = 0
    scrub_passes: int = 0
    scrub_bytes: int = 0
    scrub_bad_blocks: int = 0
    scrub_repaired_blocks: int = 0
    health_beats: int = 0             # heartbeats of the node's prober (datanode/health.py)
    health_node_probes: int = 0       # NODE_HEALTH requests it sent (one per follower node per beat and page)
    health_partition_probes: int = 0  # partitions it sent through their own probe (changed, or not healthy)
    state_batches: int = 0            # REPLICA_STATES sent for view checks and new replicas' volumes
    state_singles: int = 0            # ... and REPLICA_STATE (an older peer; an answer too large for a batch)


class Repairer:
    """Runs the per-partition workers of one node; holds what they share (rate caps, landing region)."""

    def __init__(self, *, me: str, cfg, table, pool: BuddyPool, region, domain, replication, views):
        self.me = me                    # this node's address
        self.cfg = cfg
        self.table = table              # the partitions hosted here (datanode/partition.py)
        self.pool = pool                # the registered pool: forwarded repair writes name its blocks
        self.region = region            # ... registered as this region
        self.replication = replication  # links to followers, and sealing (datanode/replication.py)
        self.views = views              # installs a newer partition view or drops a partition (the node)
        self.counters = RepairCounters()
        self.chunk = min(cfg.repair_chunk_kib << 10, pool.max_block)
        self.limiter = RateLimiter(cfg.repair_mib_s)
        self.scrub_limiter = RateLimiter(cfg.scrub_mib_s)
        # Where JSON answers from peers and pulled repair data land: peers may WRITE here (only here).
        big = max(self.chunk, JSON_ANSWER)
        self.landing = BuddyPool(8 * big, big)
        self.landing_region = domain.register(self.landing.arena, self.landing.base_addr,
                                              Access.LOCAL_WRITE | Access.REMOTE_WRITE)
        self.workers: dict[int, PartitionWorker] = {}
        self._kick = trio.Event()
        self.prober = HealthProber(self)
        self.state_asks = StateAsks(self)   # the view checks' and new replicas' asks, together per node

    @property
    def links(self):
        return self.replication.links

    def kick(self) -> None:
        """Look at leadership now (after a partition create/update), not at the next heartbeat."""
        self._kick.set()
        self.prober.poke()

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.prober.run)
            while True:
                for part in self.table.all():
                    pid = part.pid
                    if part.leader == self.me and pid not in self.workers:
                        w = self.workers[pid] = PartitionWorker(self, pid)
                        nursery.start_soon(w.run)
                    elif pid in self.workers and part.leader != self.me:
                        self.workers[pid].wake.set()     # its repair loop ends now, not at the next beat
                with trio.move_on_after(self.cfg.heartbeat_s):
                    await self._kick.wait()
                self._kick = trio.Event()

    def health(self, pid: int) -> dict:
        part = self.table.get(pid)
        w = self.workers.get(pid)
        out = {"id": pid, "node": self.me, "epoch": part.epoch, "replicas": part.replicas,
               "leader": part.leader, "role": "leader" if part.leader == self.me else "follower",
               "sealed_extents": sorted(int(e) for e in part.sealed)}
        if w is None or part.leader != self.me:     # (a worker may still be winding down after a step-down)
            out["note"] = "replica health is kept by the leader; ask it"
            return out
        out.update(w.describe())
        return out

    def fill_summary(self) -> dict:
        """Each partition led here: its epoch, each follower's state and whether a repair pass is running
        ({"partitions": {id: [epoch, {addr: state}, running]}}: about 100 bytes each, within an admin
        answer at MAX_PARTITIONS_PER_NODE)."""
        out = {}
        for pid, w in list(self.workers.items()):
            part = w.part()
            if part is None:
                continue
            out[str(pid)] = [part.epoch, {a: w.replicas[a].state for a in part.replicas[1:] if a in w.replicas},
                             w.running == "repair"]
        return {"partitions": out}

    # -- talking to peers ------------------------------------------------------------------------------
    async def call(self, addr: str, h: Header, timeout: float | None = None) -> Header:
        try:
            link = await self.links.get(addr)
            return await link.call(h, timeout or self.cfg.replica_timeout)
        except (TransportError, OSError) as e:
            raise RepairAbort(f"{addr}: {e}") from None

    async def call_json(self, addr: str, h: Header, timeout: float | None = None, room: int = JSON_FIRST):
        """A request whose JSON answer the peer WRITEs into our landing region: into a block of ``room``
        bytes, and once more into one as large as it needs (at most ``JSON_ANSWER``) if that was too small.
        Most answers are a few hundred bytes: a block of ``JSON_ANSWER`` each would let only 8 requests of
        the node's repairs, probes and view checks be under way at once."""
        r = None
        while True:
            try:
                block = await self.landing.alloc(room, timeout=self.cfg.pool_wait)
            except PoolExhausted as e:
                raise RepairAbort(str(e)) from None
            try:
                h = dataclasses.replace(h, addr=block.addr, rkey=self.landing_region.rkey, rlen=room)
                r = await self.call(addr, h, timeout)
                if r.result == Result.SHORT_BUFFER and room < r.arg <= JSON_ANSWER:
                    room = r.arg
                    continue
                if r.result == Result.NOT_FOUND:
                    raise NotHosted(f"{addr}: {h.describe()} -> NOT_FOUND")
                if r.result != Result.OK:
                    raise Refused(f"{addr}: {h.describe()} -> {_name(r.result)}")
                try:
                    if not 0 < r.length <= room:
                        raise ValueError(f"{r.length} bytes")
                    body = json.loads(bytes(block.view(r.length)))
                    if not isinstance(body, dict):
                        raise ValueError(f"a JSON {type(body).__name__}, not an object")
                except ValueError as e:     # a peer's malformed answer fails this step, never the worker
                    raise RepairAbort(f"{addr}: {h.describe()} -> unreadable answer ({e})") from None
                return body
            finally:
                self.landing.free(block)

    async def replica_state(self, addr: str, pid: int) -> dict:
        """``addr``'s REPLICA_STATE of partition ``pid`` (any epoch): its view, extents, and whether its copy
        is known synced (a view's new leader is asked this: ops/partitions.py)."""
        return await self.state_asks.ask(addr, pid)

    async def scrub_local(self, part, extent: int, offset: int, length: int) -> dict:
        return await trio.to_thread.run_sync(scrub_range, part, extent, offset, length)


class PartitionWorker(ScrubPasses):
    """The repair brain of one partition this node leads."""

    def __init__(self, rep: Repairer, pid: int):
        self.rep = rep
        self.pid = pid
        self.replicas: dict[str, ReplicaHealth] = {}
        self.wake = trio.Event()
        self.full_wanted = True           # first pass after (re)gaining the lead compares CRCs too
        self.repair_requested = self.repair_started = self.repair_done = 0   # pass numbers
        self.scrub_requested = self.scrub_started = self.scrub_done = 0
        self.running: str | None = None   # "repair" | "scrub" | None
        self.progress: dict | None = None  # the replica being filled now
        self.last_repair: dict | None = None
        self.last_scrub: dict | None = None
        self.suspended: str | None = None   # why repair and scrub wait (this leader's copy is not synced)
        self.started = False              # its own first probe is done: the node's prober takes over

    # -- lifecycle --------------------------------------------------------------------------------------
    def part(self):
        p = self.rep.table.get(self.pid)
        return p if p is not None and p.leader == self.rep.me else None

    async def run(self) -> None:
        log.info("partition %d: leading; heartbeat every %gs, repair cap %g MiB/s", self.pid,
                 self.rep.cfg.heartbeat_s, self.rep.cfg.repair_mib_s)
        try:
            async with trio.open_nursery() as n:
                n.start_soon(self._heartbeat)
                await self._repair_loop()
                n.cancel_scope.cancel()
        except Exception:       # a bug (or a partition deleted under our feet) must not take the node down
            log.exception("partition %d: repair worker failed; restarting it at the next heartbeat", self.pid)
            self.rep.counters.repair_errors += 1
            await trio.sleep(self.rep.cfg.heartbeat_s)
        finally:
            self.rep.workers.pop(self.pid, None)
            p = self.rep.table.get(self.pid)
            if p is not None:
                p.health = {}
            if self.part() is None:
                log.info("partition %d: no longer leading here; repair worker stopped", self.pid)

    def request_repair(self) -> int:
        self.repair_requested = max(self.repair_requested, self.repair_started) + 1  # a pass not begun yet
        self.full_wanted = True
        self.wake.set()
        return self.repair_requested

    def request_scrub(self) -> int:
        self.scrub_requested = max(self.scrub_requested, self.scrub_started) + 1
        self.wake.set()
        return self.scrub_requested

    def describe(self) -> dict:
        prog = None
        if self.progress:
            p = self.progress
            el = max(time.monotonic() - p["t0"], 1e-6)
            rate = p["copied"] / el
            left = max(p["total"] - p["copied"], 0)
            prog = {"addr": p["addr"], "copied": p["copied"], "total": p["total"],
                    "rate_mib_s": round(rate / MiB, 2), "eta_s": round(left / rate, 1) if rate > 0 else None}
        part = self.rep.table.get(self.pid)
        order = part.replicas[1:] if part is not None else list(self.replicas)
        return {"followers": [self.replicas[a].to_dict() for a in order if a in self.replicas],
                "synced": part.synced if part is not None else None, "suspended": self.suspended,
                "repair": {"running": self.running == "repair", "passes": self.repair_done,
                           "requested": self.repair_requested, "current": prog, "last": self.last_repair,
                           "cap_mib_s": self.rep.cfg.repair_mib_s},
                "scrub": {"running": self.running == "scrub", "passes": self.scrub_done,
                          "requested": self.scrub_requested, "last": self.last_scrub,
                          "cap_mib_s": self.rep.cfg.scrub_mib_s}}

    def _summarize(self, part) -> None:
        states = {a: self.replicas[a].state for a in part.replicas[1:] if a in self.replicas}
        worst = ("healthy" if all(s == "healthy" for s in states.values()) else
                 "repairing" if any(s == "repairing" for s in states.values()) else "degraded")
        part.health = {"state": worst, "followers": states,
                       "bytes_behind": sum(self.replicas[a].bytes_behind for a in states)}

    # -- heartbeat --------------------------------------------------------------------------------------
    async def _heartbeat(self) -> None:
        """The first heartbeat, at once; the later ones come from the node's ``HealthProber``."""
        try:
            if (part := self.part()) is not None:
                async with trio.open_nursery() as n:
                    for addr in part.replicas[1:]:
                        n.start_soon(self.probe, part, addr)
                if self.part() is not None:
                    self.after_beat(part)
        finally:
            self.started = True
            self.wake.set()          # the repair loop looks at once (and notices if we no longer lead)

    def after_beat(self, part) -> None:
        """A heartbeat's end: forget replicas no longer in the view, sum up, wake repair if one is behind."""
        followers = part.replicas[1:]
        if len(self.replicas) != len(followers):
            for addr in list(self.replicas):
                if addr not in followers:
                    del self.replicas[addr]
        self._summarize(part)
        if any(h.state == "lagging" or h.came_back for h in self.replicas.values()):
            self.wake.set()

    def unreachable(self, addr: str, e: Exception) -> None:
        h = self.replicas.setdefault(addr, ReplicaHealth(addr))
        if h.state != "unreachable":
            log.warning("partition %d: follower %s unreachable: %s", self.pid, addr, e)
        h.state, h.error, h.came_back = "unreachable", str(e), False
        h.marks = h.base = None

    async def probe(self, part, addr: str) -> None:
        """Compare one follower's copy with ours (and confirm it synced): its ``ReplicaHealth``."""
        h = self.replicas.setdefault(addr, ReplicaHealth(addr))
        h.base = None
        ours = leader_token(part)        # (before our digests are taken: a change after them moves it)
        try:
            st = await self.rep.call_json(addr, Header(opcode=Op.REPLICA_STATE, partition=self.pid,
                                                       epoch=part.epoch))
        except NotHosted:      # being created right now, or lost: `dnctl partition sync` creates it
            h.state, h.error, h.came_back, h.missing = ("lagging", "does not host the partition", True,
                                                        time.monotonic())
            return
        except RepairAbort as e:
            self.unreachable(addr, e)
            return
        h.missing = None
        was_down = h.state in ("unreachable", "unknown")
        h.last_contact, h.epoch, h.error = time.time(), st["epoch"], ""
        if st["epoch"] > part.epoch:
            await self._deposed(part, addr, st)
            return
        if st["epoch"] < part.epoch:
            await self._push_view(part, addr, Op.PARTITION_UPDATE)
            h.state, h.error, h.came_back = "lagging", f"was at epoch {st['epoch']}: updated", True
            return
        if was_down:
            h.came_back = True
            if h.state == "unreachable":
                log.info("partition %d: follower %s is reachable again", self.pid, addr)
        fmarks = {int(k): v for k, v in st["marks"].items()}
        d = await self._compare(part, st, h.marks)
        h.marks = fmarks
        h.bytes_behind, h.extents_behind, h.in_flight_bytes = d.behind, d.extents, d.in_flight
        if self.running == "repair" and self.progress and self.progress["addr"] == addr:
            h.state = "repairing"
        elif d.extents or h.came_back:
            if d.extents and h.state != "lagging":
                log.warning("partition %d: follower %s differs from this leader: %s (%d extents)", self.pid, addr,
                            d.first, d.extents)
            h.state = "lagging"          # any difference that is not appends in flight: never "healthy"
        elif await self._confirm(part, addr, st):
            h.state = "healthy"
            if not d.in_flight and st.get("synced") is not False and isinstance(st.get("token"), int):
                h.base = (st["token"], ours)
        else:
            h.state, h.error = "lagging", "complete, but not confirmed synced yet"

    async def _confirm(self, part, addr: str, st: dict) -> bool:
        """A follower whose REPLICA_STATE answer ``st`` shows nothing missing but appends in flight: make sure
        it knows its copy holds every acknowledged byte.  Not on ``st`` -- appends in flight are told from a
        gap only by the next probe -- but on a fresh look: our extents first (each up to its acknowledged
        end), then the follower's; holding at least that before it answered, it holds every byte
        acknowledged by then, and every later one reached it (a write is acknowledged only once every
        replica has it).  Then tell it, naming the cut count it answered, so a confirmation that crosses a cut
        is void.  Only a synced leader confirms; a follower counts as healthy (so, for the manager, as synced)
        only once it is confirmed."""
        if st.get("synced") is not False:
            return True                  # (a node without the field predates it)
        if not part.synced:
            return False
        try:
            acked = dict(part.acked)           # (before the sizes: an end acknowledged meanwhile is in them)
            ours = viewguard.acknowledged(await trio.to_thread.run_sync(part.store.digests), acked)
            st = await self.rep.call_json(addr, Header(opcode=Op.REPLICA_STATE, partition=self.pid,
                                                       epoch=part.epoch))
            cuts = st.get("cuts")
            if (st.get("epoch") != part.epoch or not isinstance(cuts, int) or not 0 <= cuts < 1 << 62
                    or viewguard.covers(ours, st)):
                return False
            got = await self.rep.call_json(addr, Header(opcode=Op.REPLICA_STATE, partition=self.pid,
                                                        epoch=part.epoch, arg=cuts + 1))
        except RepairAbort as e:
            log.info("partition %d: confirming %s synced failed: %s", self.pid, addr, e)
            return False
        if got.get("synced") is True:
            log.info("partition %d: %s holds every acknowledged byte (confirmed)", self.pid, addr)
            return True
        return False

    async def _compare(self, part, st: dict, prev: dict | None) -> "Difference":
        """A follower's REPLICA_STATE answer ``st`` against our copy: sizes, and digests where sizes match."""
        fmarks, fdig = follower_marks(st)
        ours = await trio.to_thread.run_sync(part.store.digests)
        return compare_marks({e: v[0] for e, v in ours.items()}, fmarks, {int(e) for e in part.sealed},
                             part.deleted_extents(), prev, {e: v[1] for e, v in ours.items()}, fdig)

    async def _push_view(self, part, addr: str, op: Op) -> None:
        body = json.dumps({"replicas": part.replicas, "epoch": part.epoch}).encode()
        block = await self.rep.pool.alloc(len(body), timeout=self.rep.cfg.pool_wait)
        try:
            block.view(len(body))[:] = body
            r = await self.rep.call(addr, Header(opcode=op, partition=self.pid, epoch=part.epoch,
                                                 addr=block.addr, rkey=self.rep.region.rkey,
                                                 rlen=len(body), length=len(body)))
        except RepairAbort as e:
            log.warning("partition %d: telling %s about epoch %d failed: %s", self.pid, addr, part.epoch, e)
            return
        finally:
            self.rep.pool.free(block)
        log.info("partition %d: %s %s (epoch %d, replicas %s) -> %s", self.pid, op.name, addr, part.epoch,
                 ",".join(part.replicas), _name(r.result))

    async def _deposed(self, part, addr: str, st: dict) -> None:
        """A follower is at a newer epoch: someone else leads now.  Learn its view and step down."""
        try:
            replicas, epoch = decode_view(st)
        except BodyError as e:
            log.warning("partition %d: %s answered an unusable view (%s): ignored", self.pid, addr, e)
            return
        if self.part() is None or epoch <= part.epoch:
            return
        # (refused -- the new leader is not known to hold every acknowledged byte -- it is logged and counted
        # there; we go on as we were, and ask again at the next heartbeat)
        was = part.epoch
        if self.rep.me in replicas:
            took = await self.rep.views.install_view(self.pid, replicas, epoch)
        else:
            took = await self.rep.views.drop_partition(self.pid, replicas, epoch)
        if took:
            log.warning("partition %d: %s is at epoch %d (we were at %d): stepped down; replicas now %s%s",
                        self.pid, addr, epoch, was, ",".join(replicas),
                        "" if self.rep.me in replicas else " (no longer one: our copy went to the trash)")

    # -- the repair loop --------------------------------------------------------------------------------
    async def _repair_loop(self) -> None:
        cfg = self.rep.cfg
        next_full = trio.current_time() + cfg.repair_interval_s
        next_scrub = trio.current_time() + cfg.scrub_interval_s if cfg.scrub_interval_s else math.inf
        part = self.part()
        if cfg.scrub_interval_s and part is not None and part.unverified:
            # opened with open_verify = tail: scrub soon (a few heartbeats in: the first repair pass goes first)
            next_scrub = min(next_scrub, trio.current_time() + FIRST_SCRUB_HEARTBEATS * cfg.heartbeat_s)
        while self.part() is not None:
            with trio.move_on_at(min(next_full, next_scrub)):
                await self.wake.wait()
            self.wake = trio.Event()
            part = self.part()
            if part is None:
                return
            if not part.synced:
                # repair and scrub cut followers back to this copy, which may lack acknowledged bytes
                if self.suspended is None:
                    self.suspended = ("this leader's copy is not known to hold every acknowledged byte: repair "
                                      "and scrub wait (they would cut its followers back to it)")
                    log.error("partition %d: %s", self.pid, self.suspended)
                await trio.sleep(self.rep.cfg.heartbeat_s)
                continue
            self.suspended = None
            now = trio.current_time()
            if self.scrub_requested > self.scrub_done or now >= next_scrub:
                want = self.scrub_started = max(self.scrub_requested, self.scrub_done + 1)
                await self._scrub_pass(part)
                self.scrub_done = want
                if self.part() is not None:
                    part.unverified = False      # every block of our copy has been re-read since open
                if cfg.scrub_interval_s:
                    next_scrub = trio.current_time() + cfg.scrub_interval_s
            asked = self.full_wanted or self.repair_requested > self.repair_done
            full = asked or now >= next_full
            needed = full or any(h.state == "lagging" or h.came_back for h in self.replicas.values())
            if needed and self.part() is not None:
                want = self.repair_started = max(self.repair_requested, self.repair_done + 1)
                self.full_wanted = False
                ok = await self._repair_pass(part, full, periodic=not asked)
                self.repair_done = want
                if full:
                    next_full = trio.current_time() + cfg.repair_interval_s
                if not ok:
                    await trio.sleep(cfg.heartbeat_s)   # do not spin on a follower that keeps failing

    async def _repair_pass(self, part, full: bool, periodic: bool = False) -> bool:
        """``periodic``: the pass of every ``repair_interval_s``, not asked for: it skips a follower found
        healthy whose copy and ours did not change since (its block CRCs are what the digests compared)."""
        self.running = "repair"
        t0 = time.monotonic()
        copied0 = self.rep.counters.repair_bytes
        results = {}
        try:
            for addr in list(part.replicas[1:]):
                h = self.replicas.setdefault(addr, ReplicaHealth(addr))
                if h.state == "unreachable":
                    results[addr] = "unreachable"
                    continue
                if not (full or h.state == "lagging" or h.came_back):
                    results[addr] = "skipped (healthy)"
                    continue
                if (periodic and h.state == "healthy" and not h.came_back and h.base is not None
                        and h.base[1] == leader_token(part)):
                    results[addr] = "skipped (unchanged since found healthy)"
                    continue
                try:
                    await self._repair_replica(part, addr, full or h.came_back)
                    h.came_back = False
                    results[addr] = "ok"
                except NotHosted as e:
                    h.state, h.error = "lagging", f"does not host the partition ({e})"
                    h.missing = time.monotonic()
                    results[addr] = "not hosting the partition"
                except RepairAbort as e:
                    self.rep.counters.repair_errors += 1
                    log.warning("partition %d: repair of %s stopped: %s", self.pid, addr, e)
                    h.state, h.error = "lagging", f"repair: {e}"
                    results[addr] = f"failed: {e}"
                if self.part() is None:
                    break
        finally:
            self.running = None
            self.progress = None
            self.rep.counters.repair_passes += 1
            copied = self.rep.counters.repair_bytes - copied0
            el = time.monotonic() - t0
            self.last_repair = {"finished": time.time(), "full": full, "seconds": round(el, 3),
                                "bytes_copied": copied, "mib_s": round(copied / MiB / max(el, 1e-6), 2),
                                "replicas": results}
            if self.part() is not None:
                self._summarize(part)
        if copied or any(r != "ok" and not r.startswith("skipped") for r in results.values()):
            log.info("partition %d: repair pass (%s): %s; %d bytes copied in %.2fs", self.pid,
                     "full" if full else "quick", results, copied, el)
        return all(r == "ok" or r.startswith("skipped") or r == "unreachable" for r in results.values())

    async def _repair_replica(self, part, addr: str, full: bool) -> None:
        h = self.replicas[addr]
        st = await self.rep.call_json(addr, Header(opcode=Op.REPLICA_STATE, partition=self.pid,
                                                   epoch=part.epoch))
        if st["epoch"] != part.epoch:
            raise RepairAbort(f"follower is at epoch {st['epoch']}, we are at {part.epoch}")
        fmarks = {int(k): v for k, v in st["marks"].items()}
        fdeleted = set(st["deleted"])
        ldeleted = part.deleted_extents()
        # 1. extents deleted here go there too; extents only the follower has are created here (empty)
        for e in sorted(fmarks):
            if e in ldeleted:
                await self._forward(part, addr, Header(opcode=Op.MARK_DELETE, extent=e))
                self.rep.counters.repair_deletes += 1
                log.info("partition %d: repair: deleted extent %d on %s", self.pid, e, addr)
                del fmarks[e]
            elif part.store.watermarks().get(e) is None:
                try:
                    await trio.to_thread.run_sync(part.store.create_extent, e)
                    log.info("partition %d: repair: extent %d exists only on %s: created it here (empty)",
                             self.pid, e, addr)
                except StoreError as err:
                    log.warning("partition %d: extent %d on %s: %s", self.pid, e, addr, err)
        ldig = await trio.to_thread.run_sync(part.store.digests)
        lmarks = {e: v[0] for e, v in ldig.items()}
        _, fdig = follower_marks(st)
        todo = [e for e in sorted(lmarks) if full or fmarks.get(e) != lmarks[e]
                or (fdig is not None and e in fdig and fdig[e] != ldig[e][1])]
        total = sum(max(lmarks[e] - fmarks.get(e, 0), 0) for e in todo)
        h.state = "repairing"
        self.progress = {"addr": addr, "copied": 0, "total": total, "t0": time.monotonic()}
        for e in todo:
            if e not in fmarks:
                if e in fdeleted:
                    log.error("partition %d: extent %d is deleted on %s but not here: left alone",
                              self.pid, e, addr)
                    continue
                r = await self._forward(part, addr, Header(opcode=Op.CREATE_EXTENT, extent=e), ok_if_exists=True)
                if r.result == Result.OK:
                    self.rep.counters.repair_creates += 1
            await self._repair_extent(part, addr, e)
            if self.part() is None:
                raise RepairAbort("lost the lead")
        # healthy only if it now is: every difference left must be appends in flight on an open extent
        st = await self.rep.call_json(addr, Header(opcode=Op.REPLICA_STATE, partition=self.pid,
                                                   epoch=part.epoch))
        d = await self._compare(part, st, None)
        h.bytes_behind, h.extents_behind, h.in_flight_bytes = d.behind, d.extents, d.in_flight
        if d.extents:
            raise RepairAbort(f"{d.extents} extent(s) still differ after the pass ({d.behind} bytes): "
                              f"{d.first}")
        if not await self._confirm(part, addr, st):
            raise RepairAbort("complete, but it did not take the confirmation that it is synced")
        h.state = "healthy"

    async def _forward(self, part, addr: str, h: Header, *, ok_if_exists: bool = False) -> Header:
        h = dataclasses.replace(h, partition=self.pid, epoch=part.epoch, flags=Flag.FORWARDED | Flag.REPAIR)
        r = await self.rep.call(addr, h)
        if r.result != Result.OK and not (ok_if_exists and r.result == Result.EXISTS):
            raise RepairAbort(f"{h.describe()} -> {_name(r.result)}")
        return r

    async def _repair_extent(self, part, addr: str, e: int) -> None:
        """Make ``addr``'s copy of extent ``e`` identical to ours (see the module docstring)."""
        lane = part.lane(e)
        if lane is None:
            return                                          # deleted meanwhile
        # compare, and cut the follower back if it diverged, in our lane turn (no append half-way)
        async with lane.turn():
            try:
                lsize, lent = await trio.to_thread.run_sync(part.block_entries, e)
            except StoreError:
                return                                      # deleted meanwhile
            try:
                fst = await self.rep.call_json(addr, Header(opcode=Op.BLOCK_CRCS, partition=self.pid,
                                                            extent=e, epoch=part.epoch))
            except NotHosted:
                raise RepairAbort(f"extent {e} is missing on {addr}") from None
            fsize, fent = fst["size"], [tuple(x) for x in fst["blocks"]]
            if fsize > lsize:
                # bytes beyond our end were never acknowledged: cut those first, then compare what is left
                fsize, fent = await self._cut_to(part, addr, e, lsize, fsize)
            cut = await self._first_difference(part, e, lent, fent)
            if cut is not None and cut < fsize:
                await self._forward(part, addr, Header(opcode=Op.TRUNCATE, extent=e, offset=cut))
                self.rep.counters.repair_truncates += 1
                log.warning("partition %d: repair: extent %d on %s differs from byte %d: cut %d -> %d",
                            self.pid, e, addr, cut, fsize, cut)
                fsize = cut
        # copy what is missing, up to our end as it was in the turn above: every append that made our copy
        # longer since was forwarded to the follower by its own handler (in its turn, before our append), so
        # chasing our moving end would only race those forwards (WRONG_OFFSET, resync) for as long as a
        # client keeps appending -- a write stream would keep the pass going, and double its work, forever.
        # Each chunk is read and sent in its own lane turn, REPAIR_DEPTH in flight.
        end = lsize
        pos = fsize                 # next offset to send
        resync = None               # the follower's end, when a client append got somewhere first
        q: deque = deque()          # (offset, length, pool block, pending ack), in send order
        try:
            while True:
                while resync is None and len(q) < REPAIR_DEPTH:
                    item = await self._send_chunk(part, addr, e, lane, pos, end)
                    if item is None:
                        break                               # caught up with our end (or deleted)
                    q.append(item)
                    pos += item[1]
                if not q:
                    if resync is None:
                        return
                    pos, resync = resync, None
                    continue
                off, n, block, pending = q.popleft()
                try:
                    r = await pending.result()
                except TransportError as err:
                    raise RepairAbort(f"{addr}: {err}") from None
                finally:
                    self.rep.pool.free(block)
                if r.result == Result.OK:
                    self.rep.counters.repair_bytes += n
                    self.replicas[addr].repaired_bytes += n
                    if self.progress is not None and self.progress["addr"] == addr:
                        self.progress["copied"] += n
                    if resync is not None:
                        resync = max(resync, off + n)
                elif r.result == Result.WRONG_OFFSET and (r.arg > off or resync is not None):
                    resync = max(resync or 0, r.arg)        # a client append forwarded earlier got there first
                else:
                    raise RepairAbort(f"write of extent {e} at {off} on {addr} -> {_name(r.result)}")
        except RepairAbort:
            with trio.move_on_after(self.rep.cfg.replica_timeout):   # let the follower finish with our blocks
                for _, _, _, pending in q:
                    try:
                        await pending.result()
                    except TransportError:
                        pass
            raise
        finally:
            for _, _, block, _ in q:
                self.rep.pool.free(block)

    async def _send_chunk(self, part, addr: str, e: int, lane, pos: int, end: int):
        """In the extent's lane turn: read ``[pos, pos+chunk)`` of our copy (below ``end``) into a pool block
        and send the follower a forwarded WRITE naming it.  Returns (pos, length, block, pending) or None at
        ``end`` (or our end)."""
        await self.rep.limiter.take(self.rep.chunk)         # outside the turn: never hold appends up
        block = pending = None
        try:
            async with lane.turn():   # released once sent: client appends go on while the follower fetches
                try:
                    lsize = part.store.size(e)
                except StoreError:
                    return None                             # deleted meanwhile
                lsize = min(lsize, end)
                if pos >= lsize:
                    return None
                n = min(self.rep.chunk, lsize - pos)
                block = await self.rep.pool.alloc(n, timeout=self.rep.cfg.pool_wait)
                view = block.view(n)
                try:
                    crc = await trio.to_thread.run_sync(part.store.read_into, e, pos, n, view)
                except StoreError as err:
                    raise RepairAbort(f"reading extent {e} here: {err} (scrub repairs our copy)") from None
                fwd = Header(opcode=Op.WRITE, partition=self.pid, extent=e, offset=pos, length=n, crc=crc,
                             epoch=part.epoch, addr=block.addr, rkey=self.rep.region.rkey, rlen=n,
                             flags=Flag.FORWARDED | Flag.REPAIR)
                link = await self.rep.links.get(addr)
                pending = await link.submit(fwd, self.rep.cfg.replica_timeout)
                return pos, n, block, pending
        except (TransportError, OSError, PoolExhausted) as err:
            raise RepairAbort(f"{addr}: {err}") from None
        finally:
            if block is not None and pending is None:
                self.rep.pool.free(block)

    async def _cut_to(self, part, addr: str, e: int, lsize: int, fsize: int):
        """Cut the follower's extent back to our size (to the block start if its last block does not
        verify there); returns its new (size, block entries)."""
        h = Header(opcode=Op.TRUNCATE, extent=e, offset=lsize)
        try:
            await self._forward(part, addr, h)
        except RepairAbort:
            await self._forward(part, addr, Header(opcode=Op.TRUNCATE, extent=e, offset=lsize // BLOCK * BLOCK))
        self.rep.counters.repair_truncates += 1
        log.warning("partition %d: repair: extent %d on %s was longer than ours: cut %d -> %d", self.pid, e,
                    addr, fsize, lsize)
        fst = await self.rep.call_json(addr, Header(opcode=Op.BLOCK_CRCS, partition=self.pid, extent=e,
                                                    epoch=part.epoch))
        return fst["size"], [tuple(x) for x in fst["blocks"]]

    async def _first_difference(self, part, e: int, lent, fent) -> int | None:
        """Byte offset (a block start) from which the follower's blocks differ from ours, or None if the
        follower's copy is a prefix of ours."""
        for i in range(min(len(lent), len(fent))):
            if tuple(lent[i]) == tuple(fent[i]):
                continue
            (_, lcov), (fc, fcov) = lent[i], fent[i]
            if fcov < lcov and i == len(fent) - 1:
                buf = memoryview(bytearray(fcov))
                try:
                    await trio.to_thread.run_sync(part.store.read_into, e, i * BLOCK, fcov, buf)
                except StoreError:
                    return None             # our own block is bad: not decidable here; scrub handles it
                if crc32c(buf) == fc:
                    return None             # merely behind: its last block is a prefix of ours
            return i * BLOCK
        return None
