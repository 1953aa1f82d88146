"""Prometheus metrics of a datanode, with prometheus-client (its registry, metric types and text exposition).

Two kinds:
* **observed on the request path**: requests and bytes by op and result, request latency histograms by op
  (``NodeMetrics.observe``, called once per answered request by the request wrapper, ``ops.wrap.Wrap``);
* **read at scrape time** from the components that own the numbers (``_NodeCollector``): the pool, the
  connections by transport, partitions with their role, health and bytes, replication failures by replica,
  forwarded bytes, repair and scrub, and the disk of ``data_dir``.  Nothing on the hot path pays for those.

``wire.metrics.serve_metrics`` answers ``GET /metrics`` on ``metrics_listen`` (a config key; empty = off)
from the node's own nursery.  The SDK's client-side families are in ``client/metrics.py``.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

import trio
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    SummaryMetricFamily,
)

from wire.metrics import RequestFamilies, etcd_invalid_family, serve_metrics  # noqa: F401 - the node serves it

if TYPE_CHECKING:
    from wire.pool import BuddyPool

    from .partition import OpenProgress, Partition

log = logging.getLogger(__name__)

WRITE_STAGES = ("fetch", "queue", "local", "durable", "replicas")


class WriteStages:
    """Where an append's time goes on this node, stage by stage, for the leader's and the followers' part
    (the WRITE handler notes each step in its request's recorder, ``ops.stages.Stages``, which adds them here):

    * ``fetch``    -- the payload in hand and its CRC checked: the one-sided READ from the client's (leader)
      or the leader's (follower) buffer; next to nothing for a payload that came inline;
    * ``queue``    -- waiting for the extent's turn (earlier appends to the same extent);
    * ``local``    -- from the turn: the forwards sent (leader) and the bytes written to the extent (pwrite;
      a big one in a worker thread, after the extent's earlier pwrites: ``ExtentLane.hand_over``);
    * ``durable``  -- until the append is on disk (group commit; nothing under ``sync = none``);
    * ``replicas`` -- leader only: after its own flush, until every follower's ack is in.

    So the leader's stages add up to the time it held the request (its answer follows), and a slow write
    says on which side it was slow: its own disk (``durable``), its followers (``replicas``: their
    ``fetch`` + ``local`` + ``durable`` + the hops), the extent's other writers (``queue``).

    A run of appends (``ops.run.AppendRun``: one append answering several requests) counts as that many
    appends, each with the run's times: the means stay per request, what a client waited.

    Counts and sums only (a summary: the mean per stage is what tells), kept in two plain lists the recorder
    adds to -- no histogram bucket per stage: observing buckets on every append cost the leader a noticeable
    share of its CPU.  ``leader`` and ``follower``: [appends, fetch, queue, local, durable seconds, appends
    that had followers, replicas seconds].  Exposed as
    ``datanode_write_stage_seconds{role,stage}`` (``_count``, ``_sum``) and in NODE_STATUS (``to_dict``;
    ``dnctl bench`` breaks each write phase down with it: tools/bench.py ``stage_means_ms``)."""

    def __init__(self) -> None:
        self.leader = [0, 0.0, 0.0, 0.0, 0.0, 0, 0.0]
        self.follower = [0, 0.0, 0.0, 0.0, 0.0, 0, 0.0]

    def to_dict(self) -> dict:
        """{role: {stage: {"count": appends, "sum_s": seconds}}} since the node started (roles, and a leader's
        ``replicas`` while it had no followers, left out until counted)."""
        out = {}
        for role, acc in (("leader", self.leader), ("follower", self.follower)):
            row = {st: {"count": acc[0], "sum_s": round(acc[1 + i], 6)} for i, st in enumerate(WRITE_STAGES[:4])
                   if acc[0]}
            if acc[5]:
                row["replicas"] = {"count": acc[5], "sum_s": round(acc[6], 6)}
            if row:
                out[role] = row
        return out

    def describe(self):
        return []

    def collect(self):
        fam = SummaryMetricFamily("datanode_write_stage_seconds", "Time appends spent in each stage on this "
                                  "node (fetch, queue, local, durable, replicas), by role", labels=["role", "stage"])
        for role, stages in self.to_dict().items():
            for st, v in stages.items():
                fam.add_metric([role, st], count_value=v["count"], sum_value=v["sum_s"])
        yield fam


LAG_BUCKETS_MS = (0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)


class LoopLag:
    """How late the node's event loop runs a task that asked to wake up: a probe sleeps ``PERIOD`` again and
    again and counts how much later than asked it woke (cumulative counts per bucket of ``LAG_BUCKETS_MS``,
    plus the worst).  A late wake-up delays every request waiting on that loop by the same: comparing this
    with the clients' latency says whether slow requests wait on the node's loop or elsewhere (the kernel,
    the CPU given to other processes).  While the node takes no request the probe wakes only once every
    ``IDLE_PERIOD``: a late wake-up of an idle loop delays nobody, and every wake-up of an idle process
    costs CPU (most of an idle node's)."""
    PERIOD = 0.02            # 50 wake-ups a second: each costs the loop a pass, so more would cost an idle
                             # node and a busy one's requests visibly
    IDLE_PERIOD = 1.0        # after a sleep of the probe in which no request came

    def __init__(self, registry: CollectorRegistry | None = None):
        self.counts = [0] * (len(LAG_BUCKETS_MS) + 1)     # the last one: above the largest bucket
        self.max_ms = 0.0
        self.histogram = Histogram("datanode_loop_lag_seconds", "How much later than asked the event loop woke "
                                   "a sleeping probe task", buckets=tuple(b / 1e3 for b in LAG_BUCKETS_MS),
                                   registry=registry)

    def observe(self, lag_s: float) -> None:
        ms = lag_s * 1e3
        i = 0
        while i < len(LAG_BUCKETS_MS) and ms > LAG_BUCKETS_MS[i]:
            i += 1
        self.counts[i] += 1
        self.max_ms = max(self.max_ms, ms)
        self.histogram.observe(lag_s)

    async def run(self, taken=None) -> None:
        """``taken``: () -> how many requests the node has taken so far (None: always ``PERIOD``)."""
        seen = None
        while True:
            n = None if taken is None else taken()
            period = self.IDLE_PERIOD if n is not None and n == seen else self.PERIOD
            seen = n
            t = trio.current_time()
            await trio.sleep(period)
            self.observe(max(0.0, trio.current_time() - t - period))

    def to_dict(self) -> dict:
        """{"buckets_ms": upper bounds, "counts": per bucket (cumulative since start; last: above), "max_ms"}."""
        return {"buckets_ms": list(LAG_BUCKETS_MS), "counts": list(self.counts), "max_ms": round(self.max_ms, 3)}


class GcPauses:
    """The cyclic garbage collector's pauses, per generation (count, total and worst seconds): a full
    collection walks every tracked object -- with thousands of connections open, every task, frame and
    buffer of theirs -- and the event loop stands still meanwhile."""

    def __init__(self):
        self.count = [0, 0, 0]
        self.total_s = [0.0, 0.0, 0.0]
        self.max_s = [0.0, 0.0, 0.0]
        self._t0 = 0.0

    def install(self) -> None:
        import gc
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        import time
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        g = min(2, info.get("generation", 2))
        dt = time.perf_counter() - self._t0
        self.count[g] += 1
        self.total_s[g] += dt
        self.max_s[g] = max(self.max_s[g], dt)

    def to_dict(self) -> dict:
        import gc
        return {"collections": list(self.count), "total_ms": [round(t * 1e3, 3) for t in self.total_s],
                "max_ms": [round(t * 1e3, 3) for t in self.max_s], "threshold": list(gc.get_threshold())}


def lag_percentile(before: dict | None, after: dict, q: float) -> float:
    """The ``q`` quantile (an upper bound: its bucket's) of the loop lag between two ``LoopLag.to_dict``."""
    counts = [a - (before["counts"][i] if before else 0) for i, a in enumerate(after["counts"])]
    total = sum(counts)
    if not total:
        return 0.0
    seen = 0
    for i, c in enumerate(counts):
        seen += c
        if seen >= q * total:
            return float(after["buckets_ms"][i]) if i < len(after["buckets_ms"]) else float("inf")
    return float("inf")


@dataclasses.dataclass(frozen=True)
class NodeReadings:
    """What the node's metrics read at scrape time: its components' own numbers (never the node itself)."""
    me: str                                      # the node's listen address: which partitions it leads
    state: Callable[[], str]                     # starting | serving | ...
    opening: OpenProgress                        # the partitions' opening at start
    pool: BuddyPool
    conns: Callable[[], Iterable[Any]]           # the open connections (each with its ``transport``)
    auth_on: bool                                # peers must prove the cluster secret
    open_to: str                                 # secret | loopback | any: who is taken without it
    admission_counts: Callable[[], Mapping[str, int]]   # ops.admission.Admission.counts
    counters: Any                                # ops.base.RequestCounters
    answers_refused: Callable[[], int]
    replication: Any                             # replication.ReplicationCounters
    repair: Any                                  # repair.RepairCounters
    parts: Callable[[], Iterable[Partition]]     # the partitions held
    etcd_invalid: Mapping[str, int] | None       # etcd values ignored as invalid, by reason (None: no etcd)
    disk: Callable[[], Mapping[str, int]]        # the file system of data_dir: total, free, used


class NodeMetrics(RequestFamilies):
    def __init__(self, node: NodeReadings | None):
        self.registry = CollectorRegistry(auto_describe=True)
        super().__init__("datanode", "answered (arrival to answer)", self.registry)
        self.loop_lag = LoopLag(self.registry)
        self.write_stages = WriteStages()
        self.registry.register(self.write_stages)
        self.gc = GcPauses()
        if node is not None:
            self.registry.register(_NodeCollector(node))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _NodeCollector:
    """Reads the numbers the node's components own, at scrape time."""

    def __init__(self, readings: NodeReadings):
        self.readings = readings

    def describe(self):
        return []

    def collect(self):
        n = self.readings
        yield _gauge("datanode_starting", "1 while the node opens its partitions (data requests get RETRY)",
                     1 if n.state() == "starting" else 0)
        o = n.opening
        yield _gauge("datanode_opening_bytes", "Bytes of extent files opened so far at start", o.bytes)
        yield _gauge("datanode_opening_bytes_total", "Bytes of extent files to open at start", o.bytes_total)
        pool = n.pool.stats()
        yield _gauge("datanode_pool_bytes", "Registered pool arena size", pool["arena_bytes"])
        yield _gauge("datanode_pool_in_use_bytes", "Pool bytes allocated to requests now", pool["in_use_bytes"])
        yield _gauge("datanode_pool_high_water_bytes", "Most pool bytes ever in use", pool["high_water_bytes"])
        yield _counter("datanode_pool_waits", "Allocations that had to wait for pool memory", pool["waits"])
        yield _counter("datanode_pool_timeouts", "Allocations that gave up (POOL_BUSY)", pool["timeouts"])

        conns = GaugeMetricFamily("datanode_connections", "Open connections by transport", labels=["transport"])
        by_transport: dict[str, int] = {}
        for c in list(n.conns()):
            by_transport[c.transport] = by_transport.get(c.transport, 0) + 1
        for t in ("tcp", "verbs"):
            conns.add_metric([t], by_transport.get(t, 0))
        yield conns

        # who may connect: alert on auth="off" (and on peers="any")
        sec = GaugeMetricFamily("datanode_auth", "1; labels: whether peers must prove the cluster secret (auth) "
                                "and which peers are taken without it (peers: none, loopback, any)",
                                labels=["auth", "peers"])
        sec.add_metric(["on" if n.auth_on else "off",
                        "none" if n.open_to == "secret" else n.open_to], 1)
        yield sec
        a = n.admission_counts()
        yield _gauge("datanode_pending_connections", "Connections still in their hello", a["pending_connections"])
        yield _gauge("datanode_idle_client_connections", "Client connections with nothing in flight",
                     a["idle_client_connections"])
        yield _counter("datanode_refused_connections", "Connections refused (limits, loopback only)",
                       a["refused_connections"])
        yield _counter("datanode_connections_closed_for_room",
                       "Pending or idle connections closed to make room for new ones", a["connections_closed_for_room"])

        c = n.counters
        yield _counter("datanode_views_refused", "View changes refused: their leader is not known to hold every "
                       "acknowledged byte (LAST_COPY)", c.views_refused)
        yield _counter("datanode_protocol_errors", "Malformed headers received", c.protocol_errors)
        yield _counter("datanode_answers_refused",
                       "READ answers (posted one-sided writes) a client refused: it had given up on the read",
                       n.answers_refused())
        r = n.replication
        yield _counter("datanode_forwarded_writes", "Appends forwarded to followers (as leader)", r.forwarded)
        fb = CounterMetricFamily("datanode_forward_fetch_bytes", "Bytes fetched from leaders' pools (as follower)",
                                 labels=[])
        fb.add_metric([], sum(c.forward_fetch_bytes_by_leader.values()))
        yield fb
        rf = CounterMetricFamily("datanode_replication_failures", "Forwarded requests a follower failed",
                                 labels=["replica"])
        for addr, k in sorted(r.failures_by_replica.items()):
            rf.add_metric([addr], k)
        yield rf
        yield _counter("datanode_extent_seals", "Extents sealed because replicas may differ", r.seals)

        rc = n.repair
        yield _counter("datanode_repair_bytes", "Bytes copied to followers by repair", rc.repair_bytes)
        yield _counter("datanode_repair_passes", "Repair passes finished", rc.repair_passes)
        yield _counter("datanode_repair_errors", "Repair passes of a follower that stopped", rc.repair_errors)
        yield _counter("datanode_scrub_bytes", "Bytes re-read and CRC-checked by scrub", rc.scrub_bytes)
        yield _counter("datanode_scrub_passes", "Scrub passes finished", rc.scrub_passes)
        yield _counter("datanode_scrub_bad_blocks", "Blocks scrub found failing their CRC", rc.scrub_bad_blocks)

        parts = list(n.parts())
        yield _gauge("datanode_partitions", "Partitions hosted", len(parts))
        role = GaugeMetricFamily("datanode_partition_leader", "1 if this node leads the partition",
                                 labels=["partition"])
        pbytes = GaugeMetricFamily("datanode_partition_bytes", "Bytes in the partition's extents here",
                                   labels=["partition"])
        healthy = GaugeMetricFamily("datanode_partition_followers_healthy",
                                    "Followers the leader sees healthy (leader only)", labels=["partition"])
        behind = GaugeMetricFamily("datanode_partition_bytes_behind",
                                   "Bytes the followers lack (leader only)", labels=["partition"])
        for p in parts:
            pid = str(p.pid)
            role.add_metric([pid], 1 if p.leader == n.me else 0)
            pbytes.add_metric([pid], sum(p.store.watermarks().values()))
            if p.leader == n.me and p.health:
                healthy.add_metric([pid], sum(1 for s in p.health.get("followers", {}).values() if s == "healthy"))
                behind.add_metric([pid], p.health.get("bytes_behind", 0))
        yield from (role, pbytes, healthy, behind)

        if n.etcd_invalid is not None:
            yield etcd_invalid_family("datanode", n.etcd_invalid)

        disk = n.disk()
        if "total" in disk:
            yield _gauge("datanode_disk_total_bytes", "Size of the file system holding data_dir", disk["total"])
            yield _gauge("datanode_disk_free_bytes", "Bytes available to the node in data_dir", disk["free"])
            yield _gauge("datanode_disk_used_bytes", "Bytes used on the file system holding data_dir", disk["used"])


def _gauge(name: str, doc: str, value) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)
