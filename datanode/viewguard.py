"""Never the last copy: whether a node may take a new view of a partition it holds.  Pure (no I/O): the node
asks the new leader for its state (REPLICA_STATE) and hands the answer here (datanode/ops/partitions.py).

Repair is leader-authoritative (datanode/repair.py): a follower is cut back to whatever its leader holds.
So a view whose leader lacks acknowledged bytes loses them on every copy it leads, and a node that drops its
copy for a view (it is no longer named) loses them too unless the new leader holds them.  The rule: a view
is taken only when its leader is *known synced* -- known to hold every acknowledged byte:

* this node itself, when its own copy is synced and it missed no epoch (``Partition.synced``: a new
  partition's copies; a follower its leader confirmed complete; lost by a cut and by a skipped epoch);
* the current leader (only a synced copy may lead: every node enforces this rule when a leader changes);
* another node that says its copy is synced and was a member of this node's view (their histories are the
  same up to there; it stays synced only as a member of every epoch since), or -- a node this copy never
  shared a view with -- that is past it and holds at least everything this copy holds.

What is refused is reported (log, ``views_refused``, ``LAST_COPY`` to the sender) and left as it was: the
copy stays, at its epoch; the etcd agent tries again at its next re-read.
"""
from __future__ import annotations


def local_verdict(me: str, replicas: list[str], epoch: int, synced: bool, new: list[str], new_epoch: int,
                  ) -> tuple[str, str]:
    """What this node knows alone about taking view ``(new, new_epoch)`` over its ``(replicas, epoch)``:
    ("ok", ""), ("ask", leader) -- the new leader must be asked -- or ("refuse", why)."""
    leader = new[0]
    if leader == me:
        if me not in replicas:
            return "refuse", f"this node would lead, but its copy is not a member of its own view (epoch {epoch})"
        if not synced:
            return "refuse", ("this node would lead, but its copy is not known to hold every acknowledged byte "
                              "(cut back, or not yet confirmed by its leader)")
        if new_epoch > epoch + 1:
            return "refuse", (f"this node would lead, but its copy missed epochs {epoch + 1}..{new_epoch - 1}: "
                              f"acknowledged writes may have happened without it")
        return "ok", ""
    if leader == replicas[0]:
        return "ok", ""            # the current leader: only a synced copy leads
    return "ask", leader


def remote_verdict(replicas: list[str], epoch: int, leader: str, st: dict,
                   mine: dict[int, tuple[int, int]]) -> str:
    """Whether the new ``leader``, whose REPLICA_STATE answer is ``st``, is known synced: "" or why not.
    ``mine``: this copy's extents, {extent: (size, digest)} (``ExtentStore.digests``)."""
    if st.get("synced") is False:          # (a node without the field predates it: as before, trusted)
        return f"the new leader {leader} says its copy is not known to hold every acknowledged byte"
    theirs = st.get("epoch")
    if not isinstance(theirs, int) or theirs < epoch:
        return f"the new leader {leader} is at epoch {theirs}, behind this copy's {epoch}"
    if leader in replicas:
        return ""                # a replica at our epoch: its history is ours, up to where it went on
    if theirs == epoch:
        return f"the new leader {leader} was not a replica at epoch {epoch}"
    if leader not in (st.get("replicas") or []):
        return f"the new leader {leader} is not a member of its own view (epoch {theirs})"
    return covers(mine, st)


def covers(mine: dict[int, tuple[int, int | None]], st: dict) -> str:
    """Whether a copy described by a REPLICA_STATE answer holds at least every byte of ``mine``: "" or the
    first extent where it does not (sizes; same size: the same digest, where ``mine`` gives one).  An extent
    it deleted is not counted: deleting is a client's acknowledged request."""
    try:
        marks = {int(k): int(v) for k, v in (st.get("marks") or {}).items()}
        digests = {int(k): int(v) for k, v in (st.get("digests") or {}).items()}
        deleted = {int(e) for e in st.get("deleted") or []}
    except (TypeError, ValueError, AttributeError):
        return "its answer is unreadable"
    for e, (size, dig) in sorted(mine.items()):
        if e in deleted or size == 0:
            continue
        other = marks.get(e)
        if other is None or other < size:
            return f"extent {e}: it holds {other or 0} bytes, this copy {size}"
        if other == size and dig is not None and e in digests and digests[e] != dig:
            return f"extent {e}: same size ({size} bytes), other bytes"
    return ""


def stays_synced(me: str, replicas: list[str], epoch: int, synced: bool, new: list[str], new_epoch: int) -> bool:
    """Whether this copy is still known synced after taking the new view: it was, it is a member of both
    views, and the new epoch follows its own (every write acknowledged meanwhile had to reach it)."""
    return synced and me in replicas and me in new and new_epoch == epoch + 1


def acknowledged(ours: dict[int, tuple[int, int]], acked: dict[int, int]) -> dict[int, tuple[int, int | None]]:
    """What a leader's copy ``ours`` ({extent: (size, digest)}) holds that is acknowledged, for ``covers``:
    an extent written since it took the lead up to its acknowledged end (no digest: appends in flight lie
    beyond), any other one whole."""
    out = {}
    for e, (size, dig) in ours.items():
        end = acked.get(e, size)
        out[e] = (size, dig) if end >= size else (end, None)
    return out
