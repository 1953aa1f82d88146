"""Replication from a partition's leader to its followers: the fan-out, the acks, and sealing.

The leader sends every follower of the partition a *forwarded* copy of a request (``Header.forwarded``):
for a WRITE the copy names the leader's pool block holding the payload, so each follower fetches it from
there with its own one-sided READ -- the leader copies nothing.  Forwards go out in a fixed order on one
link per follower (``rpc.Links``), inside the extent's lane turn, so every follower sees the appends of an
extent in the same order as the leader.  ``submit`` sends them and returns at once; ``wait`` then collects
every follower's answer within ``replica_timeout`` and names *all* the followers that failed.

An answer only counts as an ack if it echoes the request (partition, extent, offset, CRC) with OK.  A write
that is not acknowledged by every follower is not acknowledged to the client either, and the extent is
*sealed* (``seal``): its replicas may now differ, so no more appends go to it (``DIVERGED``) until the
leader's repair (datanode/repair.py) has made them identical again; the client continues on a new extent.
"""
from __future__ import annotations

import dataclasses
import logging


from .partition import ExtentLane, Partition
from wire.protocol import Flag, Header, Op, Result
from wire.rpc import AnswerGroup, Links, Pending
from wire.transport.base import TransportError

log = logging.getLogger(__name__)


@dataclasses.dataclass
class ReplicationCounters:
    forwarded: int = 0                       # appends (WRITEs) fanned out to the followers
    replication_failures: int = 0            # fan-outs that some follower failed
    failures_by_replica: dict = dataclasses.field(default_factory=dict)   # follower -> failures
    seals: int = 0                           # extents sealed because replicas may differ


class Fanout:
    """The forwards of one request in flight: (replica index, pending answer or the error sending it)."""

    def __init__(self, part: Partition, request: Header, replicas: list[str]):
        self.part = part
        self.request = request
        self.replicas = replicas             # the view the forwards were sent at (the request's epoch)
        self.sent: list[tuple[int, Pending | BaseException]] = []

    def __bool__(self) -> bool:
        return bool(self.sent)


class Replicator:
    def __init__(self, replica_timeout: float):
        self.timeout = replica_timeout
        self.links: Links | None = None      # to the followers; set by the node when it starts serving
        self.counters = ReplicationCounters()

    async def submit(self, part: Partition, fwd: Header, payload=None, *,
                     replicas: list[str] | None = None) -> Fanout:
        """Send ``fwd`` (already marked forwarded) to every follower, in replica order; returns at once.
        With ``payload`` (a small WRITE's bytes) it goes inline (``Flag.INLINE``, no buffer named) to every
        follower whose link carries that much; ``fwd`` must then name a buffer holding the same bytes for
        any other (``inline_ok`` says whether one is needed).

        ``replicas``: the view of ``fwd.epoch``, taken by the caller *before* any await (the partition's view
        may change meanwhile: a step-down must not redirect a request of the old epoch to the new view)."""
        replicas = list(part.replicas) if replicas is None else replicas
        out = Fanout(part, fwd, replicas)
        group = AnswerGroup()          # wait() wakes once, for the last ack
        inline = None
        if payload is not None:
            inline = fwd if fwd.flags & Flag.INLINE and not fwd.rlen else fwd.but(flags=fwd.flags | Flag.INLINE,
                                                                                  addr=0, rkey=0, rlen=0)
        try:
            for i, addr in enumerate(replicas[1:], start=1):
                try:
                    link = await self.links.get(addr)
                    if inline is not None and link.conn.max_inline >= len(payload):
                        out.sent.append((i, await link.submit(inline, self.timeout, payload, group=group)))
                    else:
                        out.sent.append((i, await link.submit(fwd, self.timeout, group=group)))
                except (TransportError, OSError) as e:
                    out.sent.append((i, e))
        finally:
            group.seal()
        if out.sent and fwd.opcode == Op.WRITE:
            self.counters.forwarded += 1
        return out

    async def inline_ok(self, part: Partition, n: int) -> bool:
        """Whether every follower's link can take an ``n``-byte payload inline (so the leader needs no pool
        block to forward it).  A follower that cannot be reached counts as able (its forward fails anyway)."""
        for addr in part.replicas[1:]:
            try:
                link = await self.links.get(addr)
            except (TransportError, OSError):
                continue
            if link.conn.max_inline < n:
                return False
        return True

    async def wait(self, fan: Fanout) -> int:
        """Every follower's answer; returns the failed followers as a bitmask of replica indexes (0: all
        acknowledged)."""
        part, h = fan.part, fan.request
        failed: set[int] = set()

        # every forward is already on its way: waiting for the answers one after the other takes as long as
        # waiting for all at once (each Pending has its own deadline), without a nursery and task per follower;
        # and as the forwards are one AnswerGroup, the first result() that waits returns with the last answer
        for i, p in fan.sent:
            addr = fan.replicas[i]
            if isinstance(p, BaseException):
                log.warning("replica %s of partition %d: %s", addr, part.pid, p)
                failed.add(i)
                continue
            try:
                r = await p.result()
            except TransportError as e:
                log.warning("replica %s of partition %d: %s", addr, part.pid, e)
                failed.add(i)
                continue
            if (r.result != Result.OK or r.partition != h.partition or r.extent != h.extent
                    or r.offset != h.offset or r.crc != h.crc):
                log.warning("replica %s of partition %d answered %s (%s)", addr, part.pid,
                            r.result_text(), h.describe())
                failed.add(i)
        if failed:
            self.counters.replication_failures += 1
            for i in failed:
                addr = fan.replicas[i]
                self.counters.failures_by_replica[addr] = self.counters.failures_by_replica.get(addr, 0) + 1
        return sum(1 << i for i in failed)

    async def replicate(self, part: Partition, fwd: Header, replicas: list[str] | None = None) -> int:
        """``submit`` then ``wait``: for requests that need no local step in between."""
        return await self.wait(await self.submit(part, fwd, replicas=replicas))

    def seal(self, part: Partition, extent: int, lane: ExtentLane, why: str) -> None:
        """Refuse further appends to ``extent`` (durably): its replicas may differ."""
        if not lane.diverged:
            lane.diverged = why
            part.seal(extent, why)
            self.counters.seals += 1
            log.warning("partition %d extent %d sealed for appends: %s", part.pid, extent, why)


def replica_names(replicas: list[str], mask: int) -> str:
    """The addresses of the replicas set in a failed-replica bitmask (of the view the forwards went to)."""
    return ",".join(a for i, a in enumerate(replicas) if mask >> i & 1)
