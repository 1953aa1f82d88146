"""Admin requests: partitions (create, update, delete, list), node and pool status, health, asking a
leader for a repair or scrub pass, and the trash of deleted partitions (list, restore, purge).  Bodies and
answers are JSON moved by one-sided ops (ops/base.py)."""
from __future__ import annotations

import logging
import time

import trio

from ..audit import NOTE as AUDIT_NOTE
from ..protocol import BodyError, Header, Result, Role, decode_trash_purge, decode_trash_restore
from .base import Handlers, Reply, bad_body

log = logging.getLogger(__name__)


class AdminOps(Handlers):
    async def op_partition_create(self, conn, h: Header, _t) -> Header:
        replicas, epoch = await self._pull_view(conn, h)
        if self.me not in replicas:
            raise bad_body(BodyError("not_a_member", f"this node ({self.me}) is not among the replicas"))
        async with self._create_lock:
            old = self.table.get(h.partition)
            if old is not None:
                if old.replicas == replicas and old.epoch == epoch:
                    return h.reply(Result.OK, arg=epoch)
                raise Reply(Result.EXISTS, arg=old.epoch, why=f"partition {h.partition} exists")
            await self._store(self.table.create, h.partition, replicas, epoch)
        self.repair.kick()
        if self.agent is not None:
            self.agent.changed()
        log.info("partition %d created: replicas %s epoch %d", h.partition, ",".join(replicas), epoch)
        return h.reply(Result.OK, arg=epoch)

    async def op_partition_update(self, conn, h: Header, _t) -> Header:
        part = self._hosted(h)
        replicas, epoch = await self._pull_view(conn, h)
        if conn.role == Role.NODE and replicas[0] != conn.identity:
            raise Reply(Result.FORBIDDEN, why=f"node {conn.identity} may push only a view it leads "
                                              f"(this one is led by {replicas[0]})")
        if not await self.install_view(part.pid, replicas, epoch):
            raise Reply(Result.STALE_EPOCH, arg=part.epoch, why=f"epoch {epoch} is not above {part.epoch}")
        return h.reply(Result.OK, arg=epoch)

    async def op_partition_delete(self, conn, h: Header, _t) -> Header:
        self._hosted(h)
        await self.drop_partition(h.partition)
        return h.reply(Result.OK)

    async def op_partition_list(self, conn, h: Header, _t) -> Header:
        return await self._push_json(conn, h, [p.describe(self.me) for p in self.table.parts.values()])

    async def op_pool_stats(self, conn, h: Header, _t) -> Header:
        return await self._push_json(conn, h, self.pool_stats(reveal=conn.role in (None, Role.ADMIN)))

    async def op_node_status(self, conn, h: Header, _t) -> Header:
        return await self._push_json(conn, h, self.status(asking=1,     # not counting this request
                                                          reveal=conn.role in (None, Role.ADMIN)))

    async def op_partition_health(self, conn, h: Header, _t) -> Header:
        self._hosted(h)
        return await self._push_json(conn, h, self.repair.health(h.partition))

    def _worker(self, h: Header):
        part = self._hosted(h)
        w = self.repair.workers.get(part.pid)
        if w is None:
            raise Reply(Result.NOT_LEADER, why=f"leader of partition {part.pid} is {part.leader}")
        return w

    async def op_repair(self, conn, h: Header, _t) -> Header:
        return h.reply(Result.OK, arg=self._worker(h).request_repair())

    async def op_scrub(self, conn, h: Header, _t) -> Header:
        return h.reply(Result.OK, arg=self._worker(h).request_scrub())

    # -- the trash (deleted partitions kept trash_retention_s; datanode/partition.py) ----------------------
    def _trash_entries(self) -> list[dict]:
        now = time.time()
        return [{**e, "purge_in_s": max(0.0, round(self.cfg.trash_retention_s - (now - e["deleted"]), 1))}
                for e in self.table.list_trash()]

    async def op_trash_list(self, conn, h: Header, _t) -> Header:
        return await self._push_json(conn, h, await trio.to_thread.run_sync(self._trash_entries))

    async def _pull_body(self, conn, h: Header, decode):
        try:
            return decode(await self._pull_json(conn, h))
        except BodyError as e:
            raise bad_body(e) from None

    async def op_trash_restore(self, conn, h: Header, _t) -> Header:
        """Put a trash entry back as its partition and serve it at once, with the replicas and epoch it had
        (a leader's repair brings it up to date; a newer view fences it).  A partition live here: EXISTS."""
        name = await self._pull_body(conn, h, decode_trash_restore)
        async with self._create_lock, self._view_lock:    # no create, view install or delete meanwhile
            pid = int(name.partition(".")[0])
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
        self.repair.kick()
        if self.agent is not None:
            self.agent.changed()
        AUDIT_NOTE.set(f"restored {name} as partition {pid}")
        log.warning("partition %d restored from trash entry %s by %s", pid, name, conn.peer)
        return h.reply(Result.OK, arg=pid)

    async def op_trash_purge(self, conn, h: Header, _t) -> Header:
        """Delete trash entries for good: the names given (NOT_FOUND if one is not there: nothing purged),
        the expired ones, or all.  arg = entries purged."""
        how, names = await self._pull_body(conn, h, decode_trash_purge)
        if how == "names":
            held = {e["name"] for e in await trio.to_thread.run_sync(self.table.list_trash)}
            missing = sorted(set(names) - held)
            if missing:
                raise Reply(Result.NOT_FOUND, why=f"no trash entry {', '.join(missing)[:300]} on this node")
            gone = await trio.to_thread.run_sync(self.table.purge_names, names)
        elif how == "expired":
            gone = await trio.to_thread.run_sync(self.table.purge_trash, self.cfg.trash_retention_s)
        else:
            gone = await trio.to_thread.run_sync(self.table.purge_trash, -1.0)
        names_gone = [e["name"] if isinstance(e, dict) else e for e in gone]
        AUDIT_NOTE.set(f"purged ({how}): {', '.join(names_gone) or 'nothing'}")
        log.warning("trash: %d entries purged (%s) by %s", len(gone), how, conn.peer)
        return h.reply(Result.OK, arg=len(gone))

    HANDLERS = {"PARTITION_CREATE": op_partition_create, "PARTITION_UPDATE": op_partition_update,
                "PARTITION_DELETE": op_partition_delete, "PARTITION_LIST": op_partition_list,
                "POOL_STATS": op_pool_stats, "NODE_STATUS": op_node_status,
                "PARTITION_HEALTH": op_partition_health, "REPAIR": op_repair, "SCRUB": op_scrub,
                "TRASH_LIST": op_trash_list, "TRASH_RESTORE": op_trash_restore, "TRASH_PURGE": op_trash_purge}
