"""Prepare, the first of a request's three parts (``Wrap``: prepare, operate, post): whether the node takes
it at all, before any handler runs -- the node's state (starting, draining, its data directory lost), the
connection's proven role, a volume key's scope (its volume's partitions only), and a forwarded change's
sender being the partition's leader."""
from __future__ import annotations

import dataclasses

from wire.protocol import Header, Op, Result, roles_for
from wire.transport.base import Connection
from ..partition import PartitionTable
from .admission import is_loopback
from .base import Reply, RequestCounters
from .pipeline import forwarded

LEADER_ONLY = frozenset({Op.WRITE, Op.TRUNCATE, Op.CREATE_EXTENT, Op.MARK_DELETE})
# the requests on a partition's data (see ``Wrap._gone``)
ON_DATA = LEADER_ONLY | {Op.READ, Op.WATERMARKS, Op.BLOCK_CRCS, Op.REPLICA_STATE, Op.SCRUB_EXTENT}
# what a node whose data directory is gone refuses: everything that writes under it -- the extent changes a
# leader alone takes from clients, and the admin ops that change partitions or the trash
CHANGES_DATA = LEADER_ONLY | {Op.PARTITION_CREATE, Op.PARTITION_UPDATE, Op.PARTITION_UPDATE_MANY, Op.PARTITION_DELETE,
                              Op.TRASH_RESTORE, Op.TRASH_PURGE}
PROVEN_ADMIN = frozenset({Op.TRASH_PURGE})     # never from an unauthenticated peer on another host
# what a volume-scoped connection may send without naming a partition of its volume: the ops about the node,
# not a partition (a listing shows ids, replicas and sizes, no data).  Everything else is scoped: an opcode
# added later is refused to volume keys until it is listed here.
VOLUME_FREE = frozenset({Op.PING, Op.NODE_STATUS, Op.POOL_STATS, Op.PARTITION_LIST})


def volume_refusal(volume: str, opcode: int, pid: int, part_volume: str | None) -> str:
    """Why a connection that proved the key of ``volume`` ("": no volume key, unscoped) may not send
    ``opcode`` on partition ``pid``, which belongs to ``part_volume`` ("": none; None: not on this node);
    "": it may."""
    if not volume or opcode in VOLUME_FREE or part_volume == volume:
        return ""
    where = ("is not on this node" if part_volume is None else
             f"belongs to volume {part_volume}" if part_volume else "belongs to no volume")
    return f"volume {volume}'s key may not send {Op(opcode).name} on partition {pid}: it {where}"


@dataclasses.dataclass
class Serving:
    """Whether the node takes requests now (the node sets it; ``Admit`` reads it)."""
    state: str = "starting"              # -> "serving" once the partitions are open
    draining: bool = False               # stopping: only PING and NODE_STATUS (its progress) are answered
    data_dir_lost: str | None = None     # why changes are refused (Node._watch_data_dir)


class Admit:
    """The request's refusal, if the node refuses it before any handler runs (``Admit(conn, h)`` raises it)."""

    def __init__(self, serving: Serving, table: PartitionTable, counters: RequestCounters):
        self.serving = serving
        self.table = table
        self.counters = counters

    def __call__(self, conn: Connection, h: Header) -> None:
        s = self.serving
        if s.draining and h.opcode not in (Op.PING, Op.NODE_STATUS):
            raise Reply(Result.RETRY, why="node is shutting down")
        if s.state != "serving" and h.opcode not in (Op.PING, Op.NODE_STATUS):
            raise Reply(Result.RETRY, why="node is starting (opening its partitions)")
        if s.data_dir_lost is not None and h.opcode in CHANGES_DATA:
            raise Reply(Result.DISK_ERROR, why=s.data_dir_lost)
        why = self._forbidden(conn, h)
        if why:
            self.counters.forbidden += 1
            raise Reply(Result.FORBIDDEN, why=why)

    def _forbidden(self, conn: Connection, h: Header) -> str:
        """The connection's proven role must be one the request's opcode accepts (protocol.OP_ROLES); a
        forwarded change, and a leader's confirmation that a follower is synced, must come from the
        partition's current leader (the node identity proven in the hello; without authentication, the one the
        peer named -- unproven, but a peer that does not pretend to be the leader is refused); purging the
        trash needs a proven admin (without authentication: a peer on this host); a connection that proved a
        volume key reaches only that volume's partitions (``volume_refusal``): why not ("": it may)."""
        if conn.role is not None and conn.role not in roles_for(h):
            return (f"role {conn.role.name.lower()} may not send "
                    f"{'forwarded ' if forwarded(h) else ''}{Op(h.opcode).name}")
        if conn.volume:
            part = self.table.get(h.partition)
            why = volume_refusal(conn.volume, h.opcode, h.partition, part.volume if part is not None else None)
            if why:
                return why
        if conn.role is None and h.opcode in PROVEN_ADMIN and not is_loopback(conn.peer.rpartition(":")[0]):
            return (f"{Op(h.opcode).name} needs an authenticated admin (this node has no secret: only from "
                    f"its own host)")
        if (forwarded(h) and h.opcode in LEADER_ONLY) or (h.opcode == Op.REPLICA_STATE and h.arg):
            part = self.table.get(h.partition)       # (at another epoch: refused STALE_EPOCH by the handler)
            if part is not None and h.epoch == part.epoch and part.leader != conn.identity:
                what = "confirmation" if h.opcode == Op.REPLICA_STATE else f"forwarded {Op(h.opcode).name}"
                return (f"{what} from {'node ' + conn.identity if conn.identity else 'a peer that is no node'}, "
                        f"but the leader of partition {part.pid} is {part.leader}")
        return ""
