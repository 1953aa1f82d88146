"""Admin requests: partitions (create, update, delete, list), node and pool status, health, asking a
leader for a repair or scrub pass, the trash of deleted partitions (list, restore, purge), and stopping the
node (a drain, as on SIGTERM: datanode/drain.py).  Bodies and
answers are JSON moved by one-sided ops (ops/buffers.py)."""
from __future__ import annotations

import logging
import secrets
import time
from typing import Callable

import trio

from wire.limits import MAX_PARTITIONS_PER_NODE
from wire.protocol import (
    BodyError,
    Header,
    Op,
    Result,
    Role,
    decode_trash_purge,
    decode_trash_restore,
    decode_view,
    decode_views,
    decode_volume,
)
from ..audit import NOTE as AUDIT_NOTE
from ..config import NodeConfig
from ..partition import PartitionTable
from ..repair import PartitionWorker, Repairer
from .base import Handler, Reply, Request, bad_body, store_call
from .buffers import Buffers
from .partitions import Partitions, ViewRefused

log = logging.getLogger(__name__)


VOLUME_ASK_S = 3.0         # how long a new replica asks the others for its partition's volume


def _decode_create(obj) -> tuple[list[str], int, str]:
    """A PARTITION_CREATE body: the view, and the volume the partition belongs to ("": none)."""
    replicas, epoch = decode_view(obj)
    return replicas, epoch, decode_volume(obj)


class AdminOps:
    def __init__(self, cfg: NodeConfig, partitions: Partitions, buffers: Buffers, repair: Repairer,
                 status: Callable[..., dict], drain):
        self.cfg = cfg
        self.me = partitions.me
        self.table: PartitionTable = partitions.table
        self.partitions = partitions
        self.buffers = buffers
        self.repair = repair
        self.status = status       # the node's NODE_STATUS (datanode/server.py Node.status)
        self.drain = drain         # the node's controlled shutdown (datanode/drain.py Drain)
        self.tokens = PurgeTokens()

    def handlers(self) -> dict[Op, Handler]:
        return {Op.PARTITION_CREATE: self.partition_create, Op.PARTITION_UPDATE: self.partition_update,
                Op.PARTITION_UPDATE_MANY: self.partition_update_many,
                Op.PARTITION_DELETE: self.partition_delete, Op.PARTITION_LIST: self.partition_list,
                Op.POOL_STATS: self.pool_stats, Op.NODE_STATUS: self.node_status,
                Op.PARTITION_HEALTH: self.partition_health, Op.REPAIR: self.request_repair,
                Op.SCRUB: self.request_scrub, Op.TRASH_LIST: self.trash_list, Op.TRASH_RESTORE: self.trash_restore,
                Op.TRASH_PURGE: self.trash_purge, Op.NODE_DRAIN: self.node_drain}

    async def partition_create(self, rq: Request) -> Header:
        h = rq.h
        replicas, epoch, volume = await self.buffers.pull_body(rq.conn, h, _decode_create)
        if self.me not in replicas:
            raise bad_body(BodyError("not_a_member", f"this node ({self.me}) is not among the replicas"))
        if not volume and epoch > 1 and self.table.get(h.partition) is None:
            volume = await self._volume_of(h.partition, replicas)
        parts = self.partitions
        async with parts.view_lock(h.partition):     # check-then-create of this id; other ids' go on meanwhile
            old = self.table.get(h.partition)
            if old is not None:
                if old.replicas == replicas and old.epoch == epoch and volume in ("", old.volume):
                    return h.reply(Result.OK, arg=epoch)
                raise Reply(Result.EXISTS, arg=old.epoch, why=f"partition {h.partition} exists")
            held = len(self.table.parts) + parts.creating
            if held >= MAX_PARTITIONS_PER_NODE:
                raise Reply(Result.TOO_LARGE, arg=MAX_PARTITIONS_PER_NODE,
                            why=f"this node holds {held} partitions, at most {MAX_PARTITIONS_PER_NODE} "
                                f"(wire/limits.py)")
            # a copy made at epoch 1 starts a new partition (nothing acknowledged yet); a later epoch adds a
            # replica to one with data: it holds every acknowledged byte once its leader confirmed it
            parts.creating += 1
            try:
                await store_call(self.table.create, h.partition, replicas, epoch, epoch == 1, volume)
            finally:
                parts.creating -= 1
        self.partitions.changed(True)
        log.info("partition %d created: replicas %s epoch %d%s", h.partition, ",".join(replicas), epoch,
                 f" volume {volume}" if volume else "")
        return h.reply(Result.OK, arg=epoch)

    async def _volume_of(self, pid: int, replicas: list[str]) -> str:
        """A new replica of an existing partition whose creator did not name its volume (the manager's
        re-replication, ``dnctl replica add``, ``partition sync``) takes it from the partition's other
        copies, leader first: asked as a node, over a hello in which they proved the cluster secret -- the
        same trust as the view checks' (ops/partitions.py).  None answers: in no volume, with a warning (no
        volume key reaches that copy: closed, not open)."""
        with trio.move_on_after(VOLUME_ASK_S):
            for addr in replicas:
                if addr == self.me:
                    continue
                try:
                    st = await self.repair.replica_state(addr, pid)
                except Exception as e:  # noqa: BLE001 - unreachable or not hosting it: ask the next
                    log.debug("partition %d: asking %s its volume: %s", pid, addr, e)
                    continue
                try:
                    return decode_volume(st)
                except BodyError as e:
                    log.warning("partition %d: %s names a bad volume (%s)", pid, addr, e)
        log.warning("partition %d: no other replica told its volume; this copy belongs to none (volume keys are "
                    "refused on it) until it is recreated with the volume", pid)
        return ""

    async def partition_update(self, rq: Request) -> Header:
        conn, h = rq.conn, rq.h
        part = self.partitions.hosted(h)
        replicas, epoch = await self.buffers.pull_body(conn, h, decode_view)
        if conn.role == Role.NODE and replicas[0] != conn.identity:
            raise Reply(Result.FORBIDDEN, why=f"node {conn.identity} may push only a view it leads "
                                              f"(this one is led by {replicas[0]})")
        try:
            installed = await self.partitions.install_view(part.pid, replicas, epoch)
        except ViewRefused as e:
            raise Reply(Result.LAST_COPY, arg=part.epoch, why=str(e)) from None
        if not installed:
            raise Reply(Result.STALE_EPOCH, arg=part.epoch, why=f"epoch {epoch} is not above {part.epoch}")
        return h.reply(Result.OK, arg=epoch)

    async def partition_update_many(self, rq: Request) -> Header:
        """Many views at once (a failover, a hand-off), made durable together before the answer; its arg names
        the entries not installed (a bit per index), each to be sent alone (PARTITION_UPDATE) to learn why."""
        views = await self.buffers.pull_body(rq.conn, rq.h, decode_views)
        done = await self.partitions.install_views(views)
        return rq.h.reply(Result.OK, arg=sum(1 << i for i, ok in enumerate(done) if not ok))

    async def partition_delete(self, rq: Request) -> Header:
        self.partitions.hosted(rq.h)
        await self.partitions.delete_partition(rq.h.partition)
        return rq.h.reply(Result.OK)

    async def partition_list(self, rq: Request) -> Header:
        return await self.buffers.push_json(rq.conn, rq.h, [p.describe(self.me) for p in self.table.all()])

    async def pool_stats(self, rq: Request) -> Header:
        return await self.buffers.push_json(rq.conn, rq.h, self.buffers.stats(reveal=rq.conn.role in (None, Role.ADMIN)))

    async def node_status(self, rq: Request) -> Header:
        return await self.buffers.push_json(rq.conn, rq.h, self.status(asking=1,     # not counting this request
                                                                       reveal=rq.conn.role in (None, Role.ADMIN)))

    async def node_drain(self, rq: Request) -> Header:
        """Stop as on SIGTERM.  Answered with the drain's report once the node has stopped taking requests
        (NODE_STATUS ``drain`` shows the progress meanwhile); with request arg 1 at once (answer arg 1: it was
        stopping already)."""
        started = self.drain.request(f"asked to drain by {rq.conn.peer}")
        AUDIT_NOTE.set("drain started" if started else "already stopping")
        if rq.h.arg == 1:
            return rq.h.reply(Result.OK, arg=0 if started else 1)
        report = await self.drain.report()
        return await self.buffers.push_json(rq.conn, rq.h, {**report, "already_stopping": not started})

    async def partition_health(self, rq: Request) -> Header:
        """One partition's health; partition 0: the replica states of every partition led here, in short
        (``Repairer.fill_summary``: the manager following hundreds of new replicas being filled asks each
        leader once, not once per partition)."""
        if rq.h.partition == 0:
            return await self.buffers.push_json(rq.conn, rq.h, self.repair.fill_summary())
        self.partitions.hosted(rq.h)
        return await self.buffers.push_json(rq.conn, rq.h, self.repair.health(rq.h.partition))

    def _worker(self, h: Header) -> PartitionWorker:
        part = self.partitions.hosted(h)
        w = self.repair.workers.get(part.pid)
        if w is None:
            raise Reply(Result.NOT_LEADER, why=f"leader of partition {part.pid} is {part.leader}")
        return w

    async def request_repair(self, rq: Request) -> Header:
        return rq.h.reply(Result.OK, arg=self._worker(rq.h).request_repair())

    async def request_scrub(self, rq: Request) -> Header:
        return rq.h.reply(Result.OK, arg=self._worker(rq.h).request_scrub())

    # -- the trash (deleted partitions kept trash_retention_s; datanode/partition.py) ----------------------
    def _trash_entries(self) -> list[dict]:
        now = time.time()
        return [{**e, "purge_in_s": max(0.0, round(self.cfg.trash_retention_s - (now - e["deleted"]), 1))}
                for e in self.table.list_trash()]

    async def trash_list(self, rq: Request) -> Header:
        return await self.buffers.push_json(rq.conn, rq.h, await trio.to_thread.run_sync(self._trash_entries))

    async def trash_restore(self, rq: Request) -> Header:
        """Put a trash entry back as its partition and serve it at once, with the replicas and epoch it had
        (a leader's repair brings it up to date; a newer view fences it).  A partition live here: EXISTS."""
        name = await self.buffers.pull_body(rq.conn, rq.h, decode_trash_restore)
        pid = int(name.partition(".")[0])
        async with self.partitions.view_lock(pid):   # no create, install or delete of this partition meanwhile
            if not await trio.to_thread.run_sync((self.table.trash / name).is_dir):
                raise Reply(Result.NOT_FOUND, why=f"no trash entry {name} on this node")
            live = self.table.get(pid)
            if live is not None:
                raise Reply(Result.EXISTS, arg=live.epoch,
                            why=f"partition {pid} is live on this node (epoch {live.epoch}): restoring {name} "
                                f"would clobber it; delete the live copy first (it goes to the trash too)")
            try:
                await trio.to_thread.run_sync(self.table.restore_live, name)
            except FileNotFoundError as e:
                raise Reply(Result.NOT_FOUND, why=str(e)) from None
            except FileExistsError as e:
                raise Reply(Result.EXISTS, why=str(e)) from None
            except ValueError as e:
                raise bad_body(BodyError("other", str(e))) from None
            except OSError as e:
                raise Reply(Result.DISK_ERROR, why=f"restoring {name}: {e}") from None
        self.partitions.changed(True)
        AUDIT_NOTE.set(f"restored {name} as partition {pid}")
        log.warning("partition %d restored from trash entry %s by %s", pid, name, rq.conn.peer)
        return rq.h.reply(Result.OK, arg=pid)

    async def trash_purge(self, rq: Request) -> Header:
        """Delete trash entries for good: the names given (NOT_FOUND if one is not there: nothing purged),
        the expired ones, or all -- in two requests: the first is answered CONFIRM with a token (``arg``) bound
        to the entries it would purge then and to the asking peer; the same request with that token purges
        those entries (those still there).  So no single request, replayed or sent blind, purges anything.
        arg = entries purged."""
        how, names, token = await self.buffers.pull_body(rq.conn, rq.h, decode_trash_purge)
        entries = await trio.to_thread.run_sync(self.table.list_trash)
        held = {e["name"] for e in entries}
        if how == "names":
            missing = sorted(set(names) - held)
            if missing:
                raise Reply(Result.NOT_FOUND, why=f"no trash entry {', '.join(missing)[:300]} on this node")
        who = _asker(rq.conn)
        now = time.monotonic()
        chosen = self.tokens.take(token, who, how, names, now) if token is not None else None
        if chosen is None:
            cutoff = time.time() - self.cfg.trash_retention_s
            would = sorted(names if how == "names" else
                           [e["name"] for e in entries if how == "all" or e["deleted"] <= cutoff])
            if not would:
                AUDIT_NOTE.set(f"purge ({how}): nothing to purge")
                return rq.h.reply(Result.OK, arg=0)
            token = self.tokens.issue(who, how, names, would, now)
            raise Reply(Result.CONFIRM, arg=token,
                        why=f"purging {len(would)} trash entries needs confirmation (token valid "
                            f"{PurgeTokens.VALID_S:.0f}s)")
        gone = await trio.to_thread.run_sync(self.table.purge_names, sorted(set(chosen) & held))
        names_gone = [e["name"] for e in gone]
        AUDIT_NOTE.set(f"purged ({how}, confirmed): {', '.join(names_gone) or 'nothing'}")
        log.warning("trash: %d entries purged (%s, confirmed) by %s", len(gone), how, rq.conn.peer)
        return rq.h.reply(Result.OK, arg=len(gone))


def _asker(conn) -> tuple:
    """Who a confirmation token is for: the peer's host, proven role and node identity."""
    return conn.peer.rpartition(":")[0], conn.role, conn.identity


class PurgeTokens:
    """Confirmation tokens of TRASH_PURGE (pure): each names what the request that got it would purge then,
    for that asker and that request, once, for ``VALID_S``; at most ``MAX`` outstanding (the oldest go)."""
    VALID_S = 120.0
    MAX = 64

    def __init__(self, rand=lambda: secrets.randbits(64)):
        self.rand = rand
        self.pending: dict[int, tuple] = {}     # token -> (asker, how, names asked, entries chosen, expires)

    def issue(self, who, how: str, names: list[str], chosen: list[str], now: float) -> int:
        for t in [t for t, v in self.pending.items() if v[4] <= now]:
            del self.pending[t]
        while len(self.pending) >= self.MAX:
            del self.pending[next(iter(self.pending))]
        token = self.rand() or 1
        self.pending[token] = (who, how, sorted(names), list(chosen), now + self.VALID_S)
        return token

    def take(self, token: int, who, how: str, names: list[str], now: float) -> list[str] | None:
        """The entries ``token`` confirms for this asker and request (used up), or None."""
        got = self.pending.get(token)
        if got is None or got[4] <= now or got[:3] != (who, how, sorted(names)):
            return None
        del self.pending[token]
        return got[3]
