"""Where new partitions and new replicas go: pure functions of the nodes' registrations (no I/O).

The manager (manager/service.py, manager/tasks.py) calls them with what etcd says about the live nodes
(``nodes/<addr>`` records: zone, free_bytes) and how many replicas / leaders each node holds already.

Rules, in order of precedence, for each replica picked:
1. never two replicas of one partition on one node (a node short of that is an error, not a fallback);
2. a zone the partition does not use yet, while there is one (zones spread when there are enough);
3. the fewest replicas placed on the node by this same call (N partitions created together spread over
   all the nodes instead of piling onto the three emptiest disks);
4. the most free space -- where nodes within ``ROOMY`` (10%) of the freest count as equal, so that nodes
   sharing a disk size (or a disk) are not told apart by a few megabytes written a moment ago --
5. the fewest replicas held already; then the most free space exactly, then the address (deterministic).
The leader of each new partition is the chosen replica that leads the fewest partitions (held + placed),
so leaders -- which do the forwarding work -- spread as well.
"""
from __future__ import annotations

from collections import Counter
from typing import Iterable, Mapping

from wire.limits import MAX_PARTITIONS_PER_NODE


ROOMY = 0.9      # a node with at least this share of the freest node's free space counts as "most free"


class PlacementError(Exception):
    """Not enough eligible nodes for the replica count asked for; the message says what is missing."""


def eligible(nodes: Mapping[str, dict], *, exclude: Iterable[str] = (), min_free_bytes: int = 0) -> dict[str, dict]:
    """The nodes new replicas may go to: not excluded (draining), with at least ``min_free_bytes`` free,
    holding fewer than ``MAX_PARTITIONS_PER_NODE`` partitions."""
    ex = set(exclude)
    return {a: r for a, r in nodes.items() if a not in ex and int(r.get("free_bytes") or 0) >= min_free_bytes
            and len(r.get("partitions") or {}) < MAX_PARTITIONS_PER_NODE}


def place(nodes: Mapping[str, dict], count: int, replicas: int, *, held: Mapping[str, int] | None = None,
          leading: Mapping[str, int] | None = None) -> list[list[str]]:
    """Replica lists (leader first) for ``count`` new partitions of ``replicas`` replicas each.

    ``nodes``: addr -> registration ({"zone": ..., "free_bytes": ...}), already filtered to the nodes that
    may take replicas (``eligible``).  ``held``/``leading``: replicas / leaderships each node has now."""
    if count < 1 or replicas < 1:
        raise ValueError("count and replicas must be at least 1")
    if len(nodes) < replicas:
        raise PlacementError(f"{replicas} replicas need {replicas} distinct nodes; only {len(nodes)} eligible "
                             f"({', '.join(sorted(nodes)) or 'none'})")
    held = Counter(held or {})
    leading = Counter(leading or {})
    placed: Counter = Counter()
    out = []
    for _ in range(count):
        chosen: list[str] = []
        for _ in range(replicas):
            chosen.append(_best(nodes, chosen, placed, held))
        for a in chosen:
            placed[a] += 1
        leader = min(chosen, key=lambda a: (leading[a], -_free(nodes[a]), a))
        leading[leader] += 1
        out.append([leader] + [a for a in chosen if a != leader])
    return out


def pick_spare(nodes: Mapping[str, dict], replicas: list[str], *, held: Mapping[str, int] | None = None) -> str | None:
    """One more replica for a partition that has ``replicas`` (re-replication, decommission): a node not
    among them, in a new zone if there is one, then the most free space.  None: no such node."""
    held = Counter(held or {})
    cands = {a: r for a, r in nodes.items() if a not in replicas and held[a] < MAX_PARTITIONS_PER_NODE}
    if not cands:
        return None
    return _best(cands, [], Counter(), held, used_zones={_zone(nodes.get(a)) for a in replicas})


def _zone(rec: dict | None) -> str:
    return str((rec or {}).get("zone") or "default")


def _free(rec: dict) -> int:
    return int(rec.get("free_bytes") or 0)


def _best(nodes: Mapping[str, dict], chosen: list[str], placed: Counter, held: Counter,
          used_zones: set[str] | None = None) -> str:
    zones = {_zone(nodes[a]) for a in chosen} | (used_zones or set())
    cands = [a for a in nodes if a not in chosen and held[a] + placed[a] < MAX_PARTITIONS_PER_NODE]
    if not cands:
        raise PlacementError(f"no node left that holds fewer than {MAX_PARTITIONS_PER_NODE} partitions "
                             f"(wire/limits.py MAX_PARTITIONS_PER_NODE)")
    top = max(_free(nodes[a]) for a in cands)

    def room(a):
        f = _free(nodes[a])
        return -top if f >= ROOMY * top else -f
    return min(cands, key=lambda a: (_zone(nodes[a]) in zones, placed[a], room(a), held[a], -_free(nodes[a]), a))
