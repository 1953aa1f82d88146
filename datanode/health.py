"""Replica health per node pair: one probe per follower node per heartbeat, whatever the partitions.

A leader must notice within a heartbeat when a follower's copy of a partition it leads stops matching its
own, or the follower stops answering.  Probing each partition on each follower (``REPLICA_STATE``, a
comparison of sizes and digests: datanode/repair.py ``PartitionWorker.probe``) costs the same every
heartbeat whether or not anything happened, so a node's idle CPU would grow with the partitions it leads.
Instead ``HealthProber`` sends each follower node one ``NODE_HEALTH`` per heartbeat (paged), and the follower
answers one *change token* per partition it holds that the asker leads (``follower_token``: its epoch, its
store's change counter, its cut count, whether it is synced).  A partition whose follower was last found
healthy, whose follower token is the one it answered then and whose leader copy did not change since
(``leader_token``) is still healthy: it costs a dictionary lookup.  Any other one -- changed on either side,
never confirmed, lagging, at another epoch, missing from the answer -- goes through the partition's own
probe, compare and confirm as before.  A follower node that does not answer makes every partition it shares
with us unreachable at once, as each partition's own probe would have.  A follower speaking an older protocol
(no ``NODE_HEALTH``) is probed per partition.

Each ``PartitionWorker`` probes its followers itself once when it starts (so a new leader knows them at
once); from then on this prober drives its heartbeats (``PartitionWorker.after_beat``).
"""
from __future__ import annotations

import logging
import time

import trio

from wire.protocol import OP_SINCE, Header, Op
from wire.transport.base import TransportError
from .repairkit import JSON_ANSWER, RepairAbort

log = logging.getLogger(__name__)
PAGE = 16384            # partitions per NODE_HEALTH answer: under 0.75 MiB of JSON, within JSON_ANSWER
PROBE_CONCURRENCY = 32  # per-partition probes in flight to one follower node (after a change, a restart)
MISSING_RECHECK_S = 5.0  # a follower that lacks the partition and does not list it: probed this often


def follower_token(part) -> int:
    """What a follower answers for its copy: it changes when the copy's epoch, extents, bytes, cut count or
    synced state do (the store's counter starts anew at random when the store is reopened)."""
    return hash((part.epoch, part.store.changes, part.cuts, part.synced)) & ((1 << 63) - 1)


def leader_token(part) -> tuple:
    """The same for the leader's own copy, kept locally: its view, extents, bytes, seals and synced state."""
    return part.epoch, tuple(part.replicas), part.store.changes, len(part.sealed), part.synced


def tokens_page(table, asker: str, start: int) -> dict:
    """The NODE_HEALTH answer: the tokens of the partitions held here that ``asker`` leads (in our view;
    every partition if ``asker`` is "": an admin's look), ids from ``start`` up, at most ``PAGE``."""
    pids = sorted(p.pid for p in table.all() if p.pid >= start)
    out, nxt = [], None
    for pid in pids:
        part = table.get(pid)
        if part is None or (asker and part.leader != asker):
            continue
        if len(out) == PAGE:
            nxt = pid
            break
        out.append([pid, follower_token(part)])
    return {"tokens": out, "next": nxt}


class HealthProber:
    """One per node: a loop per node that follows a partition led here, each heartbeat one NODE_HEALTH
    exchange with it, then the per-partition probe only where something differs.  The loops are apart so
    that a node slow to answer delays only the partitions it holds."""

    def __init__(self, rep):
        self.rep = rep                  # the Repairer: its workers, links, config
        self._poke = trio.Event()
        self._nodes: set[str] = set()   # follower nodes whose loop runs
        self.counters = rep.counters    # health_beats, health_node_probes, health_partition_probes

    def poke(self) -> None:
        """Beat now (a view changed), not at the next heartbeat."""
        self._poke.set()
        self._poke = trio.Event()

    async def _until_next(self, t0: float) -> None:
        poked = self._poke
        with trio.move_on_at(t0 + self.rep.cfg.heartbeat_s):
            await poked.wait()

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            while True:
                t0 = trio.current_time()
                for w in list(self.rep.workers.values()):
                    part = w.part()
                    if part is None:
                        w.wake.set()            # its repair loop notices at once that we no longer lead
                    elif w.started:
                        if len(part.replicas) == 1:
                            w.after_beat(part)  # (no follower loop sums it up)
                        for addr in part.replicas[1:]:
                            if addr not in self._nodes:
                                self._nodes.add(addr)
                                nursery.start_soon(self._node_loop, addr)
                self.counters.health_beats += 1
                await self._until_next(t0)

    def _shared(self, addr: str) -> list:
        """(worker, partition) of each partition led here that ``addr`` follows (its worker's own first
        probe done)."""
        out = []
        for w in list(self.rep.workers.values()):
            part = w.part()
            if part is not None and w.started and addr in part.replicas and addr != part.leader:
                out.append((w, part))
        return out

    async def _node_loop(self, addr: str) -> None:
        try:
            while items := self._shared(addr):
                t0 = trio.current_time()
                try:
                    await self._beat_node(addr, items)
                except Exception:       # a bug must cost a beat, not every partition's health
                    log.exception("health probe of %s failed", addr)
                    self.rep.counters.repair_errors += 1
                await self._until_next(t0)
        finally:
            self._nodes.discard(addr)

    async def _beat_node(self, addr: str, items: list) -> None:
        listed = True                   # the answer lists every partition it holds that we lead
        try:
            tokens = await self._tokens(addr)
        except Unsupported:
            tokens, listed = {}, False  # an older node: every partition is probed on its own
        except RepairAbort as e:        # unreachable, or an unreadable answer
            for w, part in items:
                w.unreachable(addr, e)
                w.after_beat(part)
            return
        now = time.time()
        todo = []
        for w, part in items:
            h = w.replicas.get(addr)
            base = h.base if h is not None else None
            if (base is not None and h.state == "healthy" and not h.came_back
                    and tokens.get(part.pid) == base[0] and leader_token(part) == base[1]):
                h.last_contact = now    # answered, and nothing changed on either side since it was healthy
            elif (h is not None and h.missing is not None and listed and part.pid not in tokens
                    and time.monotonic() - h.missing < MISSING_RECHECK_S):
                h.last_contact = now    # it still does not hold the partition (a new replica whose create has
                                        # not come yet): probing it, and repairing it, would only hear so again
                                        # (now and then it is, in case its copy names another leader)
            else:
                todo.append((w, part))
        if not todo:
            return
        self.counters.health_partition_probes += len(todo)
        limit = trio.CapacityLimiter(PROBE_CONCURRENCY)

        async def probe(w, part):
            async with limit:
                try:
                    if w.part() is not None:
                        await w.probe(part, addr)
                    if w.part() is not None:
                        w.after_beat(part)
                except Exception:       # (as a worker's own failure: logged, counted, the others go on)
                    log.exception("partition %d: probe of %s failed", part.pid, addr)
                    self.rep.counters.repair_errors += 1
                if w.part() is None:
                    w.wake.set()
        async with trio.open_nursery() as nursery:
            for w, part in todo:
                nursery.start_soon(probe, w, part)

    async def _tokens(self, addr: str) -> dict[int, int]:
        """``addr``'s token of each partition it holds that we lead (all pages)."""
        try:
            link = await self.rep.links.get(addr)
        except (TransportError, OSError) as e:
            raise RepairAbort(f"{addr}: {e}") from None
        if link.conn.version < OP_SINCE[Op.NODE_HEALTH]:
            raise Unsupported(addr)
        out: dict[int, int] = {}
        start = 0
        while True:
            self.counters.health_node_probes += 1
            ans = await self.rep.call_json(addr, Header(opcode=Op.NODE_HEALTH, arg=start), room=JSON_ANSWER)
            try:
                for pid, tok in ans["tokens"]:
                    out[int(pid)] = tok
                nxt = ans["next"]
            except (KeyError, TypeError, ValueError) as e:
                raise RepairAbort(f"{addr}: NODE_HEALTH -> unreadable answer ({e})") from None
            if nxt is None:
                return out
            start = int(nxt)


class Unsupported(Exception):
    """The follower node speaks a protocol without NODE_HEALTH."""
