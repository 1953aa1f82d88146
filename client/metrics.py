"""The SDK's client-side Prometheus families, for a program that embeds a DataClient to register:

    registry.register(dc.metrics)          # prometheus_client.REGISTRY or a registry of its own

The same families as the datanode's request path (datanode/metrics.py ``RequestFamilies``: requests and
payload bytes by op and result, latency by op), named ``datanode_client_*``; the numbers are the client's
view (end to end, replication included).
"""
from __future__ import annotations

from datanode.metrics import RequestFamilies


class ClientMetrics(RequestFamilies):
    """A prometheus_client collector; nothing is registered until the program does it."""

    def __init__(self):
        super().__init__("datanode_client", "sent by this client (round trip)", None, bytes_name="payload_bytes")
