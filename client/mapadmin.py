"""Cluster administration through the cluster map in etcd: a manager does the work, these ask it and watch
it happen -- the map as etcd has it, placing new partitions, decommissioning a node.  Nothing here talks to a
datanode (that is :mod:`client.admin`); nothing prints: results are dicts, progress goes to ``on_progress``.

Each takes the map as a ``wire.etcdmap.Etcd`` (its endpoints, etcd user and TLS, and the admin key the
requests and drain marks written here are sealed with: the manager ignores them unsealed when it has a
secret; wire/mapcheck.py).
"""
from __future__ import annotations

import inspect
import time
import uuid
from typing import Callable

import trio

from client.sdk import ClientError
from wire.etcdmap import Etcd, EtcdError, snapshot


async def _etcd_call(coro):
    try:
        return await coro
    except EtcdError as e:
        raise ClientError(str(e)) from None


async def map_snapshot(et: Etcd) -> dict:
    """The map as etcd has it: nodes (with their registrations), partitions (id, replicas, leader, epoch,
    state, ...), the active manager, the nodes being decommissioned and the entries ignored as invalid."""
    snap = await _etcd_call(snapshot(et))
    drains = await _etcd_call(et.entries(et.key("drain") + "/"))
    snap["draining"] = sorted(k.rsplit("/", 1)[1] for k in drains)
    snap["ignored"] = dict(et.invalid)
    return snap


async def under_replicated(et: Etcd) -> dict:
    """The partitions below their replica count as etcd's map has them: fewer replicas than ``want`` that are
    registered and ``synced`` (``PartView.under``; the active manager's alarm counts the same way,
    manager/redundancy.py).  ``oldest``: the one whose view has gone longest without a change (lowest etcd
    revision) -- etcd keeps no times; the manager's metrics say how long."""
    parts = await _etcd_call(et.parts())
    live = set(await _etcd_call(et.nodes()))
    under = sorted((v for v in parts.values() if v.under(live)), key=lambda v: v.rev)

    def row(v) -> dict:
        ok = [r for r in v.replicas if r in live and r in v.synced]
        return {"id": v.id, "replicas": v.replicas, "want": v.want or len(v.replicas), "live_synced": len(ok),
                "state": v.state, "epoch": v.epoch, "revision": v.rev}
    return {"count": len(under), "of": len(parts), "partitions": [v.id for v in under],
            "oldest": row(under[0]) if under else None}


async def place_partitions(et: Etcd, count: int, replicas: int, *, timeout: float = 60.0,
                           volume: str = "") -> list[dict]:
    """Ask the active manager to place and create ``count`` partitions of ``replicas`` replicas (in
    ``volume``, if given); returns their views.  The request is a key ``requests/<id>`` the manager answers in
    (manager/tasks.py)."""
    if await _etcd_call(et.get(et.manager_key)) is None:
        raise ClientError(f"no active manager in etcd {et.urls} (prefix {et.prefix}); start one: "
                          f"dnmanager --etcd {et.urls}")
    key = et.key("requests", uuid.uuid4().hex)
    await _etcd_call(et.put_entry(key, {"op": "create", "count": count, "replicas": replicas, "state": "pending",
                                        **({"volume": volume} if volume else {})}))
    try:
        with trio.move_on_after(timeout):
            while True:
                req = await _etcd_call(et.get_entry(key)) or {}
                if req.get("state") == "done":
                    return req["partitions"]
                if req.get("state") == "failed":
                    raise ClientError(f"the manager could not place {count} partition(s) of {replicas} "
                                      f"replicas: {req.get('error')}")
                await trio.sleep(0.1)
        raise ClientError(f"the manager did not answer within {timeout:g}s (is it active? see its log; a manager "
                          f"with the cluster secret ignores requests not sealed with it: give --secret-file)")
    finally:
        with trio.move_on_after(2) as s:
            s.shield = True
            try:
                await et.delete(key)
            except Exception:  # noqa: BLE001 - best effort: a leftover answered request is harmless
                pass


def decommission_progress(snap: dict, addr: str) -> dict:
    """Where a decommission of ``addr`` stands, from a map snapshot: the partitions still naming it and
    what each waits for; ``done`` once etcd names it nowhere and the node holds no partition."""
    views = [p for p in snap["partitions"] if addr in p["replicas"]]
    node = next((n for n in snap["nodes"] if n["addr"] == addr), None)
    held = sorted(int(k) for k in ((node or {}).get("partitions") or {}))
    live = {n["addr"] for n in snap["nodes"]}
    steps = []
    for p in views:
        staying = [a for a in p["replicas"] if a != addr]
        unsynced = [a for a in p["replicas"] if a not in p["synced"]]
        if not p["installed"]:
            what = f"installing epoch {p['epoch']}"
        elif unsynced:
            what = f"filling {','.join(unsynced)} (repair)"
        elif len(staying) < (p["want"] or len(p["replicas"])):
            what = "waiting for a spare node" if all(a in live for a in staying) else "waiting for failover"
        else:
            what = "removing"
        steps.append({"id": p["id"], "replicas": p["replicas"], "epoch": p["epoch"], "step": what})
    return {"node": addr, "draining": addr in snap.get("draining", []), "remaining": steps,
            "held_by_node": held, "node_registered": node is not None,
            "done": not views and not held}


async def decommission(et: Etcd, addr: str, *, wait: bool = True, timeout: float = 3600,
                       stuck_after: float = 30.0, on_progress: Callable[[dict], None] | None = None) -> dict:
    """Mark ``addr`` as draining (the manager moves every replica off it: add a spare, repair fills it,
    remove ``addr``), and with ``wait`` follow it until the node is empty.  Returns the last progress,
    with ``moved``: partition -> the node that replaced ``addr``.  If for ``stuck_after`` seconds nothing
    is left but partitions no other node can take (each live node holds them already, or is full or
    draining), raises a ClientError saying so; the node stays draining, so adding a node resumes it."""
    snap = await map_snapshot(et)
    known = {n["addr"] for n in snap["nodes"]} | {a for p in snap["partitions"] for a in p["replicas"]}
    if addr not in known:
        raise ClientError(f"{addr} is neither a registered node nor a replica in etcd {et.urls}")
    if snap["manager"] is None:
        raise ClientError(f"no active manager in etcd {et.urls}; start one: dnmanager --etcd {et.urls}")
    before = {p["id"]: p["replicas"] for p in snap["partitions"] if addr in p["replicas"]}
    await _etcd_call(et.put_entry(et.key("drain", addr), {"since": time.time()}))
    t0 = trio.current_time()
    prog = decommission_progress(snap, addr)
    prog["partitions_total"] = len(before)
    stuck_since = None
    while wait:
        snap = await map_snapshot(et)
        prog = decommission_progress(snap, addr)
        prog["partitions_total"] = len(before)
        prog["seconds"] = round(trio.current_time() - t0, 2)
        if on_progress:
            shown = on_progress(prog)
            if inspect.isawaitable(shown):
                await shown
        if prog["done"]:
            break
        no_spare = [s["id"] for s in prog["remaining"] if s["step"] == "waiting for a spare node"]
        if prog["remaining"] and len(no_spare) == len(prog["remaining"]):
            stuck_since = stuck_since if stuck_since is not None else trio.current_time()
            if trio.current_time() - stuck_since >= stuck_after:
                raise ClientError(
                    f"decommission of {addr} is stuck: no other node can take a replica of partition(s) "
                    f"{', '.join(map(str, no_spare))} (every live node holds one already, or is full or "
                    f"draining); add a node and it goes on by itself, or undo it: "
                    f"dnctl node decommission {addr} --cancel")
        else:
            stuck_since = None
        if trio.current_time() - t0 > timeout:
            raise ClientError(f"decommission of {addr} not done within {timeout:g}s: "
                              + "; ".join(f"partition {s['id']}: {s['step']}" for s in prog["remaining"]))
        await trio.sleep(0.25)
    now = {p["id"]: p["replicas"] for p in snap["partitions"]}
    prog["moved"] = {str(pid): [a for a in now.get(pid, []) if a not in reps] for pid, reps in before.items()}
    return prog


async def cancel_decommission(et: Etcd, addr: str) -> None:
    """The node may take replicas again (what was already moved stays moved)."""
    await _etcd_call(et.delete(et.key("drain", addr)))
