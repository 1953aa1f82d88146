"""The admin library: partition membership, replica health, repair/scrub passes and node queries.

Everything a cluster operator does that correctness depends on lives here as plain async functions on a
``DataClient`` -- the replica list and epoch of a partition (``View``), creating and deleting partitions on
every replica, moving a partition to a new replica list at epoch + 1 (``change_replicas``: add, remove,
set-leader), pushing the leader's view to replicas that are behind, asking a leader for a repair or scrub
pass and waiting until it has settled.  Nothing here prints: results are dicts (what ``--json`` shows),
warnings are strings in them, progress goes to an ``on_progress`` callback.  ``tools/dnctl.py`` presents
these results; tests and tools (bench, torture, repair_bench) call them directly.  What goes through the
cluster map in etcd instead (a manager does the work) is :mod:`client.mapadmin`.

Imports run one way: tools (CLI) -> client.admin -> client.sdk -> wire.protocol.
"""
from __future__ import annotations

import dataclasses
import inspect
import json
import logging
from contextlib import asynccontextmanager
from typing import AsyncIterator, Callable, Iterable

import trio

from client.sdk import ClientError, DataClient, check
from wire.protocol import OP_SINCE, VOLUMES_SINCE, Header, Op, Result

log = logging.getLogger(__name__)


# -- addresses ---------------------------------------------------------------------------------------------
def parse_addr(a: str) -> str:
    """``a`` if it is HOST:PORT (port 1..65535), else ValueError naming it."""
    host, sep, port = a.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{a!r} is not HOST:PORT (e.g. 127.0.0.1:17310)")
    return a.strip()


def parse_addrs(s: str) -> list[str]:
    """A comma-separated HOST:PORT list: each checked, none twice, at least one."""
    addrs = [parse_addr(a) for a in s.split(",") if a.strip()]
    if not addrs:
        raise ValueError("give at least one HOST:PORT")
    if len(set(addrs)) != len(addrs):
        raise ValueError(f"{s!r} names a node twice")
    return addrs


def why(e: Exception, addr: str) -> str:
    """An error's text without a leading "ADDR: " (callers name the node themselves)."""
    text = str(e)
    return text[len(addr) + 2:] if text.startswith(addr + ": ") else text


@asynccontextmanager
async def open_client(nodes: Iterable[str], *, from_env: bool = False, **kw) -> AsyncIterator[DataClient]:
    """A DataClient whose partition map comes from any of ``nodes`` that answer (a node may be down);
    ``from_env``: what ``kw`` does not give comes from the environment (``DataClient.from_env``: a CLI)."""
    nodes = list(nodes)
    async with (DataClient.from_env if from_env else DataClient.open)(**kw) as dc:
        errors = []
        for addr in nodes:
            try:
                await dc.discover(addr)
            except ClientError as e:
                errors.append(f"{addr}: {why(e, addr)}")
        if nodes and len(errors) == len(nodes):
            raise ClientError("no datanode answered: " + "; ".join(errors))
        yield dc


# -- node queries ---------------------------------------------------------------------------------------------
async def node_status(dc: DataClient, addr: str) -> dict:
    return await dc.admin(addr, Op.NODE_STATUS)


async def pool_stats(dc: DataClient, addr: str) -> dict:
    return await dc.admin(addr, Op.POOL_STATS)


async def partition_list(dc: DataClient, addr: str) -> list[dict]:
    return await dc.admin(addr, Op.PARTITION_LIST)


async def partition_show(dc: DataClient, addr: str, pid: int) -> dict:
    """One partition as ``addr`` sees it, with ``extent_sizes`` {extent: bytes}."""
    parts = [p for p in await partition_list(dc, addr) if p["id"] == pid]
    if not parts:
        raise ClientError(f"partition {pid} is not on {addr}", Result.NOT_FOUND, addr)
    p = parts[0]
    p["extent_sizes"] = await dc.admin(addr, Op.WATERMARKS, partition=pid)
    return p


def partition_state(p: dict) -> str:
    """read-write | degraded | read-only: the node's own word if it gives one that says more than
    "read-write", else derived from the leader's replica health (a follower not healthy: degraded)."""
    state = p.get("state") or "read-write"
    health = (p.get("health") or {}).get("state")
    if state == "read-write" and health and health not in ("healthy", "unknown"):
        return "degraded"
    return state


async def drain_node(dc: DataClient, addr: str, *, wait: bool = True, timeout: float = 120.0,
                     on_progress: Callable[[dict], None] | None = None, interval: float = 0.25) -> dict:
    """Stop the node at ``addr`` as SIGTERM does (NODE_DRAIN): it hands its partitions to their other
    replicas through the manager, finishes its requests, leaves etcd and exits (datanode/drain.py).

    With ``wait`` the node answers with its report once it has stopped taking requests -- ``phase``,
    ``handed_off`` (partition ids), ``left`` (partition -> why it was not handed off), ``notes`` (what it
    could not do), ``seconds`` -- and this returns it with ``stopped`` (it then no longer answers;
    ``restarted``: another process answers at its address already).  ``on_progress`` meanwhile gets the
    node's NODE_STATUS ``drain`` every ``interval``.  Without ``wait``: once it has taken the request.
    ClientError when it does not take the request or the drain outlasts ``timeout``."""
    before = await node_status(dc, addr)
    spoken = (await dc.links.get(addr)).conn.version
    if spoken < OP_SINCE[Op.NODE_DRAIN]:
        raise ClientError(f"{addr} speaks protocol version {spoken}, without NODE_DRAIN (version "
                          f"{OP_SINCE[Op.NODE_DRAIN]}): stop it with SIGTERM, or upgrade it first", node=addr)
    res = {"node": addr, "pid": before.get("pid"), "stopped": False, "restarted": False}
    try:
        if not wait:
            resp, _ = await dc.request(addr, Header(opcode=Op.NODE_DRAIN, arg=1))
            check(resp, addr)
            return {**res, "already_stopping": bool(resp.arg)}
        with trio.move_on_after(timeout) as waited:
            async with trio.open_nursery() as n:
                if on_progress is not None:
                    n.start_soon(_follow_drain, dc, addr, on_progress, interval)
                resp, data = await dc.request(addr, Header(opcode=Op.NODE_DRAIN), answer=1 << 20,
                                              timeout=timeout + 10)
                n.cancel_scope.cancel()
        if waited.cancelled_caught:
            raise ClientError(f"{addr} has not finished draining after {timeout:g}s (it stops by itself after "
                              f"its drain_timeout_s; see its log)", node=addr)
        check(resp, addr)
    except ClientError as e:
        if e.result is not None or not wait:
            raise
        return {**res, "stopped": True, "phase": "unknown", "handed_off": [], "left": {},
                "notes": [f"it went away before reporting how its drain went ({why(e, addr)}): see its log"]}
    res.update(json.loads(data))
    with trio.move_on_after(10):          # it exits right after its answer
        while not res["stopped"]:
            try:
                pid = (await node_status(dc, addr)).get("pid")
            except ClientError as e:
                res["stopped"] = e.result is None          # no answer: the process is gone
            else:
                res["stopped"] = res["restarted"] = pid != res["pid"]
            await trio.sleep(0.05)
    return res


async def _follow_drain(dc: DataClient, addr: str, on_progress: Callable[[dict], None], interval: float) -> None:
    while True:
        try:
            shown = on_progress((await node_status(dc, addr)).get("drain") or {})
            if inspect.isawaitable(shown):
                await shown
        except ClientError:
            pass
        await trio.sleep(interval)


# -- reading a range -----------------------------------------------------------------------------------------
async def extent_size(dc: DataClient, pid: int, extent: int, replica: str | None = None) -> int:
    """The extent's size from the first replica that answers (leader first, or only ``replica``)."""
    errors = []
    for addr in [replica] if replica else dc.partition(pid).replicas:
        try:
            marks = await dc.watermarks(pid, addr)
        except ClientError as e:
            errors.append(str(e))
            continue
        if extent not in marks:
            raise ClientError(f"extent {extent} not found in partition {pid} (on {addr})", Result.NOT_FOUND, addr)
        return marks[extent]
    raise ClientError(f"cannot learn the size of extent {extent}: " + "; ".join(errors))


async def read_range(dc: DataClient, pid: int, extent: int, offset: int = 0, length: int | None = None,
                     replica: str | None = None) -> bytes:
    """Read ``length`` bytes at ``offset`` (default: to the extent's end), checked against its size first
    so that a range outside the extent is refused once, naming the size, not by every replica."""
    if offset < 0:
        raise ValueError(f"offset {offset} is negative")
    if length is not None and length < 0:
        raise ValueError(f"length {length} is negative")
    size = await extent_size(dc, pid, extent, replica)
    if offset > size:
        raise ValueError(f"offset {offset} is past the end of extent {extent} ({size} bytes)")
    if length is None:
        length = size - offset
    elif offset + length > size:
        raise ValueError(f"range {offset}+{length} is beyond the end of extent {extent} ({size} bytes)")
    if length == 0:
        return b""
    return await dc.read(pid, extent, offset, length, replica=replica)


# -- partition membership ------------------------------------------------------------------------------------
@dataclasses.dataclass
class View:
    """A partition's replica list and epoch as one node (``source``) reports it."""
    pid: int
    replicas: list[str]
    epoch: int
    source: str
    volume: str = ""

    @property
    def leader(self) -> str:
        return self.replicas[0]


async def node_view(dc: DataClient, addr: str, pid: int) -> View | None:
    """The partition as ``addr`` sees it (None: not hosted there).  Raises ClientError if unreachable."""
    for p in await partition_list(dc, addr):
        if p["id"] == pid:
            return View(pid, list(p["replicas"]), p["epoch"], addr, p.get("volume") or "")
    return None


async def create_partition(dc: DataClient, pid: int, addrs: list[str], epoch: int = 1, volume: str = "",
                           *, fresh: bool = False) -> dict:
    """Create partition ``pid`` on every node of ``addrs`` (the followers first, the leader ``addrs[0]``
    last: a leader starts checking its followers at once, and one that found them not hosting the
    partition yet logged it and ran a wasted repair pass).  All or nothing: if one node fails, the
    partition is deleted again from the nodes this call created it on.  ``volume``: the volume it belongs
    to (every copy keeps it in its meta; fixed for the partition's life).

    ``fresh``: the caller has just asked these nodes which partitions they hold (the manager, for a whole
    batch) and ``pid`` is none of them, so the per-node look for an existing copy is skipped: it lists every
    partition of each node, which made creating the N-th partition cost O(N).  A node that has the
    partition after all refuses the create, and the copies this call made are undone as for any failure."""
    existing = {}
    for addr in ([] if fresh else addrs):
        try:
            v = await node_view(dc, addr, pid)
        except ClientError as e:
            raise ClientError(f"creating partition {pid}: {addr} is unreachable: {why(e, addr)}") from None
        if v is not None:
            if v.replicas != addrs:
                raise ClientError(f"partition {pid} already exists on {addr} with replicas "
                                  f"{','.join(v.replicas)} (epoch {v.epoch})")
            existing[addr] = v
    other = {a: v.volume for a, v in existing.items() if v.volume != volume}
    if other:
        raise ClientError(f"partition {pid} already exists on {', '.join(other)} in "
                          + (f"volume {next(iter(other.values()))}" if any(other.values()) else "no volume")
                          + (f", not in volume {volume}" if volume else ""))
    if len(existing) == len(addrs) and len({v.epoch for v in existing.values()}) == 1:
        return {"id": pid, "replicas": addrs, "epoch": next(iter(existing.values())).epoch, "existed": True,
                **({"volume": volume} if volume else {})}
    if existing:
        raise ClientError(f"partition {pid} already exists on {', '.join(existing)} but not on every replica; "
                          f"use `dnctl replica add` to extend it")
    if volume:
        for addr in addrs:
            spoken = (await dc.links.get(addr)).conn.version
            if spoken < VOLUMES_SINCE:
                raise ClientError(f"creating partition {pid} in volume {volume}: {addr} speaks protocol version "
                                  f"{spoken}, without volumes (version {VOLUMES_SINCE}): upgrade it first",
                                  node=addr)
    done = []
    for addr in [*addrs[1:], addrs[0]]:
        try:
            await dc.admin(addr, Op.PARTITION_CREATE, partition=pid,
                           body={"replicas": addrs, "epoch": epoch, **({"volume": volume} if volume else {})})
        except ClientError as e:
            undone = []
            for d in done:
                try:
                    await dc.admin(d, Op.PARTITION_DELETE, partition=pid)
                    undone.append(d)
                except ClientError:
                    pass
            left = [d for d in done if d not in undone]
            raise ClientError(f"creating partition {pid} failed on {addr}: {why(e, addr)}"
                              + (f" (undone on {', '.join(undone)})" if undone else "")
                              + (f"; could NOT undo it on {', '.join(left)}" if left else "")) from None
        done.append(addr)
    return {"id": pid, "replicas": addrs, "epoch": epoch, "existed": False, **({"volume": volume} if volume else {})}


async def delete_partition(dc: DataClient, pid: int, addrs: list[str]) -> dict[str, str]:
    """Delete ``pid`` from each node; returns {addr: "deleted" | "not there" | error text}."""
    out = {}
    for addr in addrs:
        try:
            await dc.admin(addr, Op.PARTITION_DELETE, partition=pid)
            out[addr] = "deleted"
        except ClientError as e:
            out[addr] = "not there" if e.result == Result.NOT_FOUND else why(e, addr)
    return out


async def current_view(dc: DataClient, pid: int, seeds: list[str], *, may_lose: str | None = None,
                       warn: Callable[[str], None] = log.warning) -> View:
    """The partition's authoritative replica list and epoch: its leader's view.

    ``seeds`` are nodes to ask who the leader is.  If the leader does not answer and the change at hand
    takes it out of the lead (``may_lose`` = the leader's address), the newest view among the other
    replicas is used instead (and ``warn`` is told); otherwise that is an error naming the leader."""
    views: dict[str, View] = {}
    errors: dict[str, str] = {}

    async def ask(addr):
        if addr in views or addr in errors:
            return
        try:
            v = await node_view(dc, addr, pid)
        except ClientError as e:
            errors[addr] = why(e, addr)
            return
        if v is not None:
            views[addr] = v

    for addr in seeds:
        await ask(addr)
        if views:
            break
    if not views:
        if errors and len(errors) == len(seeds):
            raise ClientError(f"partition {pid}: no node answered ("
                              + "; ".join(f"{a}: {w}" for a, w in errors.items()) + ")")
        raise ClientError(f"partition {pid} is not on {', '.join(seeds)}", Result.NOT_FOUND)
    newest = max(views.values(), key=lambda v: v.epoch)
    for _ in range(4):     # follow the leader named by the newest view (bounded: views may disagree)
        await ask(newest.leader)
        if newest.leader in views and views[newest.leader].epoch >= newest.epoch:
            return views[newest.leader]
        if newest.leader in errors:
            break
        newest = max(views.values(), key=lambda v: v.epoch)
    leader = newest.leader
    if leader in errors and may_lose == leader:
        for addr in newest.replicas:
            await ask(addr)
        best = max(views.values(), key=lambda v: v.epoch)
        warn(f"leader {leader} of partition {pid} does not answer ({errors[leader]}); using the view of "
             f"{best.source} (epoch {best.epoch})")
        return best
    if leader in errors:
        raise ClientError(f"partition {pid}: its leader {leader} does not answer: {errors[leader]}")
    raise ClientError(f"partition {pid}: leader {leader} does not host it (views disagree: "
                      + ", ".join(f"{a} epoch {v.epoch}" for a, v in views.items()) + ")")


async def change_replicas(dc: DataClient, old: View, new: list[str]) -> dict:
    """Move partition ``old.pid`` from ``old.replicas`` to ``new`` at epoch ``old.epoch + 1``.

    New nodes get PARTITION_CREATE (new list and epoch) first; then every member of old ∪ new gets
    PARTITION_UPDATE, the old leader first (it stops taking writes at the old epoch); removed nodes then get
    PARTITION_DELETE (best effort: a dead node being removed is the usual case).  Raises ClientError naming
    the node if a member of the new list cannot be updated."""
    pid, epoch = old.pid, old.epoch + 1
    added = [a for a in new if a not in old.replicas]
    removed = [a for a in old.replicas if a not in new]
    steps: list[dict] = []
    warnings: list[str] = []
    # pre-flight: every node that stays must be reachable and agree on the current epoch
    for addr in new:
        try:
            v = await node_view(dc, addr, pid)
        except ClientError as e:
            raise ClientError(f"nothing changed: {addr} does not answer: {why(e, addr)}") from None
        if addr in added:
            if v is not None:
                raise ClientError(f"nothing changed: {addr} already hosts partition {pid} (epoch {v.epoch}, "
                                  f"replicas {','.join(v.replicas)}); delete it there first")
        elif v is None:
            raise ClientError(f"nothing changed: replica {addr} does not host partition {pid}; "
                              f"remove it and add it again")
        elif v.epoch != old.epoch:
            raise ClientError(f"nothing changed: replica {addr} is at epoch {v.epoch} but the leader at "
                              f"{old.epoch}; bring them in line with: dnctl partition sync --id {pid} "
                              f"--via {old.source}")
    body = {"replicas": new, "epoch": epoch}
    for addr in added:
        try:
            await dc.admin(addr, Op.PARTITION_CREATE, partition=pid, body=body)
        except ClientError as e:
            for a in [s["node"] for s in steps if s["action"] == "create"]:
                await delete_partition(dc, pid, [a])
            raise ClientError(f"nothing changed: creating partition {pid} on new replica {addr} failed: "
                              f"{why(e, addr)}") from None
        steps.append({"node": addr, "action": "create", "result": "ok"})
    order = [old.replicas[0]] + [a for a in old.replicas[1:]] + [a for a in new if a not in old.replicas]
    updated: list[str] = list(added)
    for addr in order:
        if addr in added:
            continue
        try:
            await dc.admin(addr, Op.PARTITION_UPDATE, partition=pid, body=body)
        except ClientError as e:
            text = why(e, addr)
            if e.result == Result.STALE_EPOCH and e.arg == epoch:
                v = await node_view(dc, addr, pid)
                if v is not None and v.replicas == new:
                    steps.append({"node": addr, "action": "update", "result": "already done"})
                    updated.append(addr)
                    continue
            if addr in removed:
                steps.append({"node": addr, "action": "update", "result": text})
                continue
            behind = [a for a in new if a not in updated]
            raise ClientError(f"partition {pid}: update to epoch {epoch} failed on {addr}: {text}; now at epoch "
                              f"{epoch}: {', '.join(updated) or 'none'}; still at {old.epoch}: "
                              f"{', '.join(behind)}; finish with: dnctl partition sync --id {pid} --via "
                              f"{updated[0] if updated else old.source}") from None
        steps.append({"node": addr, "action": "update", "result": "ok"})
        updated.append(addr)
    for addr in removed:
        try:
            await dc.admin(addr, Op.PARTITION_DELETE, partition=pid)
            steps.append({"node": addr, "action": "delete", "result": "ok"})
        except ClientError as e:
            told = any(s["node"] == addr and s["action"] == "update" and s["result"] == "ok" for s in steps)
            if told and e.result == Result.NOT_FOUND:
                # a node told a view without itself drops its copy (to its trash) then and there
                steps.append({"node": addr, "action": "delete", "result": "ok (dropped when told the new view)"})
                continue
            steps.append({"node": addr, "action": "delete", "result": why(e, addr)})
            warnings.append(f"removed replica {addr} did not delete its copy ({why(e, addr)}); it "
                            + (f"knows it was removed (epoch {epoch})" if told else
                               f"still believes it is a replica at epoch {old.epoch} (the others refuse it)")
                            + f"; delete it later with: dnctl partition delete --id {pid} --replicas {addr}")
    return {"id": pid, "old": {"replicas": old.replicas, "epoch": old.epoch},
            "new": {"replicas": new, "epoch": epoch}, "steps": steps, "warnings": warnings}


async def sync_partition(dc: DataClient, pid: int, seeds: list[str]) -> dict:
    """Send the leader's replica list and epoch to replicas that are behind (after a failed change).
    ``nodes`` maps each replica to what happened there; a value starting with "failed" or "disagrees"
    means that replica is still out of line."""
    view = await current_view(dc, pid, seeds)
    out = {}
    for addr in view.replicas:
        try:
            v = await node_view(dc, addr, pid)
            if v is None:
                await dc.admin(addr, Op.PARTITION_CREATE, partition=pid,    # (a copy at epoch 1 asks no one)
                               body={"replicas": view.replicas, "epoch": view.epoch,
                                     **({"volume": view.volume} if view.volume else {})})
                out[addr] = f"created at epoch {view.epoch} (empty until the leader's repair fills it)"
            elif v.epoch < view.epoch:
                await dc.admin(addr, Op.PARTITION_UPDATE, partition=pid,
                               body={"replicas": view.replicas, "epoch": view.epoch})
                out[addr] = f"updated {v.epoch} -> {view.epoch}"
            elif v.epoch == view.epoch and v.replicas == view.replicas:
                out[addr] = "in sync"
            else:
                out[addr] = f"disagrees: epoch {v.epoch}, replicas {','.join(v.replicas)}"
        except ClientError as e:
            out[addr] = f"failed: {why(e, addr)}"
    return {"id": pid, "replicas": view.replicas, "epoch": view.epoch, "nodes": out}


async def set_leader(dc: DataClient, pid: int, addr: str, seeds: list[str]) -> dict:
    """Make ``addr`` the leader at epoch + 1.  With the leader alive this is the ordinary change
    (``change_replicas``).  With the leader dead, the newest view among the replicas that answer is used,
    every reachable member is updated (``addr`` first) and the old leader is left to be fenced: it learns
    the new epoch from the new leader's heartbeat when it comes back, and is repaired as a follower."""
    views: dict[str, View] = {}
    errors: dict[str, str] = {}

    async def ask(a: str) -> None:
        try:
            v = await node_view(dc, a, pid)
            if v is not None:
                views[a] = v
        except ClientError as e:
            errors[a] = why(e, a)

    for a in dict.fromkeys([addr, *seeds]):
        await ask(a)
    if not views:
        raise ClientError(f"partition {pid}: no replica answered ("
                          + "; ".join(f"{a}: {w}" for a, w in errors.items()) + ")")
    newest = max(views.values(), key=lambda v: v.epoch)
    for a in newest.replicas:                 # ask every member we have not heard from
        if a not in views and a not in errors:
            await ask(a)
    newest = max(views.values(), key=lambda v: v.epoch)
    if addr not in newest.replicas:
        raise ClientError(f"{addr} is not a replica of partition {pid} ({', '.join(newest.replicas)})")
    if addr not in views or views[addr].epoch != newest.epoch:
        raise ClientError(f"{addr} is not at the partition's epoch {newest.epoch}; it cannot lead")
    if newest.leader == addr:
        return {"id": pid, "unchanged": True, "replicas": newest.replicas, "epoch": newest.epoch}
    new = [addr] + [a for a in newest.replicas if a != addr]
    if newest.leader in views:                # the leader is alive: the ordinary change
        return await change_replicas(dc, views[newest.leader], new)
    epoch = newest.epoch + 1
    body = {"replicas": new, "epoch": epoch}
    steps, warnings = [], []
    for a in new:
        if a in errors:
            steps.append({"node": a, "action": "update", "result": f"unreachable ({errors[a]})"})
            warnings.append(f"{a} did not answer; the new leader tells it epoch {epoch} when it is back "
                            f"(until then it is fenced: its epoch-{newest.epoch} requests are refused)")
            continue
        try:
            await dc.admin(a, Op.PARTITION_UPDATE, partition=pid, body=body)
            steps.append({"node": a, "action": "update", "result": "ok"})
        except ClientError as e:
            if a == addr:
                raise ClientError(f"nothing changed: {addr} refused epoch {epoch}: {why(e, a)}") from None
            steps.append({"node": a, "action": "update", "result": why(e, a)})
            warnings.append(f"{a}: {why(e, a)}")
    return {"id": pid, "old": {"replicas": newest.replicas, "epoch": newest.epoch},
            "new": {"replicas": new, "epoch": epoch}, "steps": steps, "warnings": warnings,
            "forced": True}


async def add_replica(dc: DataClient, pid: int, addr: str, seeds: list[str], *, wait: bool = True,
                      timeout: float = 3600, on_progress: Callable[[dict], None] | None = None) -> dict:
    """Add ``addr`` as the last replica (epoch + 1).  With ``wait``, ask the leader for a repair pass and
    wait until the new replica is healthy (identical to the leader); ``res["repair"]`` says how it went."""
    old = await current_view(dc, pid, seeds)
    if addr in old.replicas:
        raise ClientError(f"{addr} is already a replica of partition {pid} "
                          f"({', '.join(old.replicas)}, epoch {old.epoch})")
    def copied(h: dict) -> int:       # bytes the leader's repair copied to ``addr``, over all its passes
        return next((f.get("repaired_bytes") or 0 for f in h.get("followers", []) if f["addr"] == addr), 0)
    before = copied(await health(dc, old.leader, pid)) if wait else 0
    res = await change_replicas(dc, old, old.replicas + [addr])
    if wait:
        t0 = trio.current_time()
        n = await request_pass(dc, old.leader, pid, Op.REPAIR)
        h = await wait_settled(dc, old.leader, pid, only=addr, repair_pass=n, timeout=timeout,
                               on_progress=on_progress)
        last = h["repair"]["last"] or {}
        # the fill may span passes (the view change starts one by itself; ours may come after it)
        res["repair"] = {"seconds": round(trio.current_time() - t0, 2), "bytes_copied": copied(h) - before,
                         "mib_s": last.get("mib_s"),
                         "state": next(f["state"] for f in h["followers"] if f["addr"] == addr)}
    return res


async def remove_replica(dc: DataClient, pid: int, addr: str, seeds: list[str],
                         warn: Callable[[str], None] = log.warning) -> dict:
    """Take ``addr`` out of the replicas (epoch + 1) and delete the partition there (best effort if it is
    down).  Removing the leader makes the next replica the leader."""
    old = await current_view(dc, pid, [a for a in seeds if a != addr] or [addr], may_lose=addr, warn=warn)
    if addr not in old.replicas:
        raise ClientError(f"{addr} is not a replica of partition {pid} "
                          f"({', '.join(old.replicas)}, epoch {old.epoch})")
    if len(old.replicas) == 1:
        raise ClientError(f"{addr} is the only replica of partition {pid}; use "
                          f"`dnctl partition delete` to delete the partition")
    return await change_replicas(dc, old, [a for a in old.replicas if a != addr])


# -- replica health, repair and scrub ------------------------------------------------------------------------
async def health(dc: DataClient, addr: str, pid: int) -> dict:
    """PARTITION_HEALTH from ``addr`` (the leader keeps the replica states; a follower says so)."""
    return await dc.admin(addr, Op.PARTITION_HEALTH, partition=pid)


async def find_leader(dc: DataClient, pid: int, seeds: list[str]) -> str:
    return (await current_view(dc, pid, seeds)).leader


async def request_pass(dc: DataClient, leader: str, pid: int, op: Op) -> int:
    """Ask the leader for a repair (Op.REPAIR) or scrub (Op.SCRUB) pass; returns the pass number."""
    resp = await dc.admin(leader, op, partition=pid)
    return resp.arg


# -- the trash of deleted partitions on a running node (admin role) ----------------------------------------
async def trash_list(dc: DataClient, addr: str) -> list[dict]:
    """The trash entries of the node at ``addr``: [{"name", "partition", "deleted", "bytes", "purge_in_s"}]."""
    return await dc.admin(addr, Op.TRASH_LIST)


async def trash_restore(dc: DataClient, addr: str, name: str) -> int:
    """Put trash entry ``name`` back on the running node at ``addr`` (it serves it at once, with the replicas
    and epoch it had); returns the partition id.  A partition of that id live there: ClientError (EXISTS)."""
    try:
        return (await dc.admin(addr, Op.TRASH_RESTORE, body={"name": name})).arg
    except ClientError as e:
        pid = name.partition(".")[0]
        if e.result == Result.EXISTS:
            live = f"is live there (epoch {e.arg})" if e.arg else "has a directory there again"
            raise ClientError(f"{addr}: partition {pid} {live}: restoring {name} would clobber it; delete the "
                              f"live copy first (it goes to the trash too)", result=e.result, node=addr,
                              arg=e.arg) from None
        if e.result == Result.NOT_FOUND:
            raise ClientError(f"{addr}: no trash entry {name} there (see: dnctl trash list)", result=e.result,
                              node=addr) from None
        raise


async def trash_purge(dc: DataClient, addr: str, *, names: list[str] | None = None, expired: bool = False,
                      everything: bool = False) -> list[dict]:
    """Delete trash entries on ``addr`` for good: ``names`` (all must exist, else nothing is purged), the
    expired ones, or ``everything``.  Returns the entries purged (as ``trash_list`` showed them).  The node
    purges only on a second request carrying the confirmation token its answer to the first gave (CONFIRM):
    show the caller what will go *before* calling this (dnctl trash purge does, or takes --yes)."""
    if sum(map(bool, (names, expired, everything))) != 1:
        raise ValueError("say exactly one of names, expired or everything")
    before = await trash_list(dc, addr)
    body = {"names": list(names)} if names else {"expired": True} if expired else {"all": True}
    try:
        try:
            await dc.admin(addr, Op.TRASH_PURGE, body=body)
        except ClientError as e:
            if e.result != Result.CONFIRM:
                raise
            await dc.admin(addr, Op.TRASH_PURGE, body={**body, "token": f"{e.arg:016x}"})
    except ClientError as e:
        if e.result == Result.NOT_FOUND:
            held = {x["name"] for x in before}
            raise ClientError(f"{addr}: no trash entry {', '.join(n for n in names if n not in held)} there "
                              f"(nothing purged; see: dnctl trash list)", result=e.result, node=addr) from None
        raise
    after = {e["name"] for e in await trash_list(dc, addr)}
    return [e for e in before if e["name"] not in after]


def settled(h: dict, only: str | None = None) -> bool:
    fs = [f for f in h.get("followers", []) if only is None or f["addr"] == only]
    if only is not None and not fs:
        return False
    return (all(f["state"] == "healthy" for f in fs) and not h["repair"]["running"]
            and not h["scrub"]["running"])


async def wait_settled(dc: DataClient, leader: str, pid: int, *, only: str | None = None,
                       repair_pass: int = 0, scrub_pass: int = 0, timeout: float = 120.0,
                       on_progress: Callable[[dict], None] | None = None, interval: float = 0.25) -> dict:
    """Poll the leader until the followers (or ``only``) are healthy and the asked passes are done.
    ``on_progress`` gets every health answer on the way (for a progress display; it may be async)."""
    deadline = trio.current_time() + timeout
    h: dict = {}
    while trio.current_time() < deadline:
        try:
            h = await health(dc, leader, pid)
        except ClientError as e:
            h = {"error": str(e)}
        else:
            if on_progress:
                shown = on_progress(h)
                if inspect.isawaitable(shown):
                    await shown
            if ("repair" in h and h["repair"]["passes"] >= repair_pass and h["scrub"]["passes"] >= scrub_pass
                    and settled(h, only)):
                return h
        await trio.sleep(interval)
    raise ClientError(f"partition {pid} did not settle within {timeout:g}s: {h.get('error') or h}")


async def run_pass(dc: DataClient, op: Op, pid: int, seeds: list[str], *, wait: bool = True,
                   timeout: float = 600, on_progress: Callable[[dict], None] | None = None) -> dict:
    """Ask the partition's leader for a repair or scrub pass.  Without ``wait``: {"<name>_pass": n,
    "leader": addr}; with it, the leader's health once the pass is done and every follower is healthy."""
    key = {Op.REPAIR: "repair_pass", Op.SCRUB: "scrub_pass"}[op]
    leader = await find_leader(dc, pid, seeds)
    n = await request_pass(dc, leader, pid, op)
    if not wait:
        return {key: n, "leader": leader}
    return await wait_settled(dc, leader, pid, timeout=timeout, on_progress=on_progress, **{key: n})
