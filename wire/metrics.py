"""What the datanode, the manager and the SDK share for metrics: the request families (requests and payload
bytes by op and result, latency by op: prometheus-client families, counted in plain ints and built only when
scraped) and ``serve_metrics``, the ``GET /metrics`` endpoint of a server (the datanode, the manager)."""
from __future__ import annotations

import bisect
import itertools
import logging
import math
from typing import Protocol

import trio

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from .protocol import Op, Result

log = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                   2.5, 5.0, 10.0)
_OP_NAMES = {op.value: op.name for op in Op}
_RESULT_NAMES = {r.value: r.name for r in Result} | {-1: "NO_ANSWER"}   # -1: the peer was gone
_BYTES_OPS = {Op.WRITE, Op.READ}


class RequestFamilies:
    """Requests and payload bytes by op and result, latency by op: the families the node (answered
    requests) and the SDK (requests as the client sees them, client/metrics.py) both keep.  ``registry``
    None: not registered, for a program to register the object (it is a collector) where it wants.

    Counted in plain ints on the request path (``observe``: a dict lookup, a bisect and three additions) and
    turned into prometheus-client metric families only when scraped: its Counter and Histogram children
    take a lock and check their state on every increment, three times per request, a visible share of a
    follower's per-request work."""

    def __init__(self, prefix: str, what: str, registry: CollectorRegistry | None, *,
                 bytes_name: str = "request_payload_bytes"):
        self._names = (f"{prefix}_requests", f"{prefix}_{bytes_name}", f"{prefix}_request_seconds")
        self._what = what
        self._series: dict = {}          # (opcode, result) -> [requests, bytes, per-bucket counts, seconds sum]
        if registry is not None:
            registry.register(self)

    def observe(self, opcode: int, result: int, length: int, seconds: float) -> None:
        s = self._series.get((opcode, result))
        if s is None:
            s = self._series[(opcode, result)] = [0, 0, [0] * (len(LATENCY_BUCKETS) + 1), 0.0]
        s[0] += 1
        if result == Result.OK and opcode in _BYTES_OPS:
            s[1] += length
        s[2][bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1     # bucket i: seconds <= LATENCY_BUCKETS[i]
        s[3] += seconds

    def describe(self):
        return []

    def collect(self):
        n_req, n_bytes, n_lat = self._names
        requests = CounterMetricFamily(n_req, f"Requests {self._what}, by op and result", labels=["op", "result"])
        nbytes = CounterMetricFamily(n_bytes, f"Payload bytes of OK requests {self._what}, by op", labels=["op"])
        latency = HistogramMetricFamily(n_lat, f"Latency of requests {self._what}, by op", labels=["op"])
        by_op: dict[str, list] = {}
        for (opcode, result), (count, length, buckets, total) in sorted(self._series.items()):
            op = _OP_NAMES.get(opcode, "unknown")
            requests.add_metric([op, _RESULT_NAMES.get(result, "unknown")], count)
            agg = by_op.setdefault(op, [0, [0] * len(buckets), 0.0, False])
            agg[0] += length
            agg[1] = [a + b for a, b in zip(agg[1], buckets)]
            agg[2] += total
            agg[3] = agg[3] or (result == Result.OK and opcode in _BYTES_OPS)
        for op, (length, buckets, total, has_bytes) in by_op.items():
            if has_bytes:
                nbytes.add_metric([op], length)
            cumulative = list(itertools.accumulate(buckets))
            latency.add_metric([op], [(floatToGoString(b), c) for b, c in zip((*LATENCY_BUCKETS, math.inf),
                                                                             cumulative)], total)
        yield from (requests, nbytes, latency)


def etcd_invalid_family(prefix: str, counts: dict[str, int]) -> CounterMetricFamily:
    """``<prefix>_etcd_invalid_values_total{reason}``: values read from etcd and ignored (wire/mapcheck.py),
    from an ``Etcd``'s ``invalid`` counts (the node, the manager and the SDK each expose theirs)."""
    fam = CounterMetricFamily(f"{prefix}_etcd_invalid_values", "Values read from etcd that were ignored "
                              "(malformed, a MAC that does not verify, an epoch step too far), by reason",
                              labels=["reason"])
    for reason, k in sorted(counts.items()):
        fam.add_metric([reason], k)
    return fam


class Exposition(Protocol):
    def exposition(self) -> bytes:
        """The text exposition of every family, as ``GET /metrics`` answers it."""


async def serve_metrics(listen: str, metrics: Exposition, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Answer ``GET /metrics`` (text exposition) on ``listen`` until cancelled: a task in the server's
    nursery (the datanode's, the manager's)."""
    host, _, port = listen.rpartition(":")
    listeners = await trio.open_tcp_listeners(int(port), host=host)
    log.info("metrics on http://%s/metrics", listen)
    task_status.started()
    await trio.serve_listeners(lambda s: _answer(s, metrics), listeners)


async def _answer(stream: trio.SocketStream, metrics: Exposition) -> None:
    try:
        with trio.fail_after(5):
            head = b""
            while b"\r\n\r\n" not in head and len(head) < 8192:
                chunk = await stream.receive_some(4096)
                if not chunk:
                    return
                head += chunk
            line = head.split(b"\r\n", 1)[0].split()
            if len(line) >= 2 and line[0] == b"GET" and line[1].split(b"?")[0] == b"/metrics":
                try:
                    body = metrics.exposition()
                    status, ctype = b"200 OK", b"text/plain; version=0.0.4; charset=utf-8"
                except Exception:  # noqa: BLE001 - a fault in observability must not end the data path
                    log.exception("metrics: building the exposition failed (serving on)")
                    body, status, ctype = (b"internal error: see the server's log\n", b"500 Internal Server Error",
                                           b"text/plain")
            else:
                body, status, ctype = b"not found: try /metrics\n", b"404 Not Found", b"text/plain"
            await stream.send_all(b"HTTP/1.1 " + status + b"\r\nContent-Type: " + ctype +
                                  b"\r\nContent-Length: " + str(len(body)).encode() +
                                  b"\r\nConnection: close\r\n\r\n" + body)
    except (trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError, OSError) as e:
        log.debug("metrics request: %s", e)
