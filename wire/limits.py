"""The size limits of a cluster, in one place: the wire checks them, the manager, the datanode and the CLI
take them as their bounds (docs/operations.md, "Limits and sizing").

* ``MAX_REPLICAS``: replicas of one partition.  A write is acknowledged once every replica holds it, so each
  one more is one more forward on every write; a view, a PARTITION_CREATE/UPDATE body and a map entry
  naming more are refused.
* ``DEFAULT_REPLICAS``: what the manager creates (``dnmanager --replicas``) and ``dnctl cluster up`` puts
  partition 1 on (fewer with fewer nodes).
* ``MAX_NODES``: datanodes in one cluster.  What grows with it: etcd's lease keepalives (one per node every
  third of its TTL: about 340 a second at 1,024 nodes and the default 3 s) and the registrations the manager
  follows (one watch); a manager pass costs what changed, not the cluster (manager/service.py), and a
  simulated cluster of 300 nodes and 30,000 partitions drives the real manager and etcd within the goals
  (``python -m bench.scale_sim``), with room for three times that many nodes.  ``dnctl cluster up`` refuses
  more, and the manager says so in its log when more register.
* ``MAX_PARTITIONS_PER_NODE``: partitions one datanode holds.  Its registration in etcd lists them all and
  must stay under the map's value limit (wire/mapcheck.py ``MAX_VALUE_BYTES``) at a usual replica count; a
  node refuses to create more, and the manager places none on a node that holds this many.
* ``MAX_VIEWS_PER_UPDATE``: views one PARTITION_UPDATE_MANY carries (the manager's batched installs; the
  answer names the entries not installed as a bitmask of this many bits).
"""
MAX_REPLICAS = 16
DEFAULT_REPLICAS = 3
MAX_NODES = 1024
MAX_PARTITIONS_PER_NODE = 4096
MAX_VIEWS_PER_UPDATE = 64


def replicas_error(n: int) -> str | None:
    """Why ``n`` is no replica count (one wording everywhere), or None."""
    if not 1 <= n <= MAX_REPLICAS:
        return f"a partition has 1..{MAX_REPLICAS} replicas, not {n}"
    return None


def nodes_error(n: int) -> str | None:
    """Why a cluster cannot have ``n`` datanodes, or None."""
    if not 1 <= n <= MAX_NODES:
        return f"a cluster has 1..{MAX_NODES} datanodes, not {n}"
    return None


def views_error(n: int) -> str | None:
    """Why ``n`` views cannot go in one PARTITION_UPDATE_MANY, or None."""
    if not 1 <= n <= MAX_VIEWS_PER_UPDATE:
        return f"a batched view update carries 1..{MAX_VIEWS_PER_UPDATE} views, not {n}"
    return None
