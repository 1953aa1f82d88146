"""Admin requests: partitions (create, update, delete, list), node and pool status, health, and asking a
leader for a repair or scrub pass.  Bodies and answers are JSON moved by one-sided ops (ops/base.py)."""
from __future__ import annotations

import logging

from ..protocol import BodyError, Header, Result, Role
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

    HANDLERS = {"PARTITION_CREATE": op_partition_create, "PARTITION_UPDATE": op_partition_update,
                "PARTITION_DELETE": op_partition_delete, "PARTITION_LIST": op_partition_list,
                "POOL_STATS": op_pool_stats, "NODE_STATUS": op_node_status,
                "PARTITION_HEALTH": op_partition_health, "REPAIR": op_repair, "SCRUB": op_scrub}
