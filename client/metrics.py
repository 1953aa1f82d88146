"""The SDK's client-side Prometheus families, for a program that embeds a DataClient to register:

    registry.register(dc.metrics)          # prometheus_client.REGISTRY or a registry of its own

The same families as the datanode's request path (wire/metrics.py ``RequestFamilies``: requests and
payload bytes by op and result, latency by op), named ``datanode_client_*``; the numbers are the client's
view (end to end, replication included).
"""
from __future__ import annotations

from wire.metrics import RequestFamilies, etcd_invalid_family


class ClientMetrics(RequestFamilies):
    """A prometheus_client collector; nothing is registered until the program does it.  With the map in
    etcd also ``datanode_client_etcd_invalid_values_total{reason}``: views read from etcd and ignored."""

    def __init__(self):
        super().__init__("datanode_client", "sent by this client (round trip)", None, bytes_name="payload_bytes")
        self.etcd = None             # the client's wire.etcdmap.Etcd, when it follows the map there

    def collect(self):
        yield from super().collect()
        if self.etcd is not None:
            yield etcd_invalid_family("datanode_client", self.etcd.invalid)
