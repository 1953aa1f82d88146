"""How far the leaders are in filling new replicas, asked per leader node, not per partition.

While a refill runs (a node added, a replica lost), hundreds of partitions each have a replica that the
leader's repair is filling; the manager marks one ``synced`` once its leader reports that replica healthy and
no repair pass running (manager/service.py ``_check_filled``).  A ``PARTITION_HEALTH`` per partition and
pass cost a request and its answer each, a thousand a second for a thousand partitions.  ``FillWatch.state``
asks instead one ``PARTITION_HEALTH`` of partition 0 per leader node -- its short summary of every partition
it leads -- and answers every partition waiting on that leader from it (manager/combine.py: the first ask
goes at once, the ones arriving meanwhile wait for the next summary, one under way per leader).  A leader of
an older protocol version (``HEALTH_SUMMARY_SINCE``) is asked per partition, as before, and so is one whose
summary does not fit an admin answer (``SHORT_BUFFER``: thousands of partitions of many replicas each).
"""
from __future__ import annotations

from client.sdk import ClientError
from wire.aio import each
from wire.limits import MAX_PARTITIONS_PER_NODE
from wire.protocol import HEALTH_SUMMARY_SINCE, Op, Result
from manager.combine import Combiner

FillState = tuple[int, dict[str, str], bool]     # (the leader's epoch, {follower: state}, a repair pass running)


class FillWatch:
    """Partitions' fill states through ``dc`` (a client.sdk.DataClient with admin credentials)."""

    def __init__(self, dc):
        self.dc = dc
        self._combine = Combiner(self._summaries, max_batch=MAX_PARTITIONS_PER_NODE, senders=1,
                                 cut_short=lambda addr: ClientError(f"asking {addr} its partitions' health was "
                                                                    f"cut short", node=addr))
        self.summaries = 0                          # PARTITION_HEALTH of partition 0 sent (tests, logs)

    async def state(self, leader: str, pid: int) -> FillState | None:
        """``leader``'s view of partition ``pid``'s followers; None when it does not lead it (any more).
        Raises ClientError when the leader cannot be asked."""
        if await self._summarizes(leader):
            return await self._combine.submit(leader, pid)
        return await self._single(leader, pid)

    async def _single(self, leader: str, pid: int) -> FillState | None:
        h = await self.dc.admin(leader, Op.PARTITION_HEALTH, partition=pid)
        if h.get("role") != "leader":
            return None
        return (int(h.get("epoch") or 0), {f["addr"]: f.get("state") for f in h.get("followers", [])},
                bool((h.get("repair") or {}).get("running")))

    async def _summarizes(self, addr: str) -> bool:
        try:
            link = await self.dc.links.get(addr)
        except Exception:  # noqa: BLE001 - unreachable: the single request says so, as before
            return False
        return link.conn.version >= HEALTH_SUMMARY_SINCE

    async def _summaries(self, leader: str, pids: list[int]) -> list:
        self.summaries += 1
        try:
            ans = await self.dc.admin(leader, Op.PARTITION_HEALTH, partition=0)
        except ClientError as e:
            if e.result != Result.SHORT_BUFFER:
                raise
            # (a leader of thousands of partitions of many replicas each: its summary does not fit an admin
            # answer) each partition alone, as from an older node
            return await each(lambda pid: self._single(leader, pid), pids, ClientError)
        parts = ans.get("partitions") or {}
        out: list = []
        for pid in pids:
            entry = parts.get(str(pid))
            try:
                epoch, followers, running = entry
                out.append((int(epoch), {str(a): str(s) for a, s in followers.items()}, bool(running)))
            except (TypeError, ValueError, AttributeError):
                out.append(None)                    # not led there (or an entry we cannot read: as if not)
        return out
