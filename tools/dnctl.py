"""`dnctl` — the admin CLI: partitions, replicas, data, pools, nodes, local clusters, benchmarks."""
from __future__ import annotations

import dataclasses
import json
import pathlib
import sys
from contextlib import asynccontextmanager

import click
import trio

from client.sdk import ClientError, DataClient, Location
from datanode.protocol import Op, Result

CTX = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


def emit(obj, as_json: bool, text: str | None = None) -> None:
    if as_json:
        click.echo(json.dumps(obj, indent=2, sort_keys=True))
    else:
        click.echo(text if text is not None else json.dumps(obj, indent=2))


def run(fn, *args):
    """Run an async CLI action; a ClientError becomes a clean one-line error and exit status 1."""
    try:
        return trio.run(fn, *args)
    except ClientError as e:
        raise click.ClickException(str(e)) from None
    except trio.TooSlowError:
        raise click.ClickException("timed out") from None


def split_addrs(s: str) -> list[str]:
    addrs = [a.strip() for a in s.split(",") if a.strip()]
    if not addrs:
        raise click.BadParameter("give at least one HOST:PORT")
    for a in addrs:
        check_addr(a)
    if len(set(addrs)) != len(addrs):
        raise click.BadParameter(f"{s!r} names a node twice")
    return addrs


def check_addr(a: str) -> str:
    host, sep, port = a.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise click.BadParameter(f"{a!r} is not HOST:PORT")
    return a


def load_cluster(cluster_dir: str) -> dict:
    from tools import cluster
    try:
        return cluster.load(pathlib.Path(cluster_dir))
    except FileNotFoundError as e:
        raise click.ClickException(str(e)) from None
    except (OSError, ValueError, KeyError) as e:
        raise click.ClickException(f"{cluster_dir}/cluster.json is unreadable: {e}") from None


def cluster_nodes(cluster_dir: str) -> list[str]:
    return [n["addr"] for n in load_cluster(cluster_dir)["nodes"]]


def _why(e: Exception, addr: str) -> str:
    """The error text without a leading "ADDR: " (callers name the node themselves)."""
    text = str(e)
    return text[len(addr) + 2:] if text.startswith(addr + ": ") else text


@asynccontextmanager
async def open_client(nodes, **kw):
    """A DataClient whose partition map comes from any of ``nodes`` that answer (a node may be down)."""
    async with DataClient.open(**kw) as dc:
        errors = []
        for addr in nodes:
            try:
                await dc.discover(addr)
            except ClientError as e:
                errors.append(f"{addr}: {_why(e, addr)}")
        if nodes and len(errors) == len(nodes):
            raise ClientError("no datanode answered: " + "; ".join(errors))
        yield dc


# -- partition membership: shared by `partition create`, `cluster up`, `replica add/remove`, bench ----------
@dataclasses.dataclass
class View:
    """A partition's replica list and epoch as one node (``source``) reports it."""
    pid: int
    replicas: list[str]
    epoch: int
    source: str

    @property
    def leader(self) -> str:
        return self.replicas[0]


async def node_view(dc: DataClient, addr: str, pid: int) -> View | None:
    """The partition as ``addr`` sees it (None: not hosted there).  Raises ClientError if unreachable."""
    for p in await dc.admin(addr, Op.PARTITION_LIST):
        if p["id"] == pid:
            return View(pid, list(p["replicas"]), p["epoch"], addr)
    return None


async def create_partition(dc: DataClient, pid: int, addrs: list[str], epoch: int = 1) -> dict:
    """Create partition ``pid`` on every node of ``addrs`` (leader first).  All or nothing: if one node
    fails, the partition is deleted again from the nodes this call created it on."""
    existing = {}
    for addr in addrs:
        try:
            v = await node_view(dc, addr, pid)
        except ClientError as e:
            raise ClientError(f"creating partition {pid}: {addr} is unreachable: {_why(e, addr)}") from None
        if v is not None:
            if v.replicas != addrs:
                raise ClientError(f"partition {pid} already exists on {addr} with replicas "
                                  f"{','.join(v.replicas)} (epoch {v.epoch})")
            existing[addr] = v
    if len(existing) == len(addrs) and len({v.epoch for v in existing.values()}) == 1:
        return {"id": pid, "replicas": addrs, "epoch": next(iter(existing.values())).epoch, "existed": True}
    if existing:
        raise ClientError(f"partition {pid} already exists on {', '.join(existing)} but not on every replica; "
                          f"use `dnctl replica add` to extend it")
    done = []
    for addr in addrs:
        try:
            await dc.admin(addr, Op.PARTITION_CREATE, partition=pid, body={"replicas": addrs, "epoch": epoch})
        except ClientError as e:
            undone = []
            for d in done:
                try:
                    await dc.admin(d, Op.PARTITION_DELETE, partition=pid)
                    undone.append(d)
                except ClientError:
                    pass
            left = [d for d in done if d not in undone]
            raise ClientError(f"creating partition {pid} failed on {addr}: {_why(e, addr)}"
                              + (f" (undone on {', '.join(undone)})" if undone else "")
                              + (f"; could NOT undo it on {', '.join(left)}" if left else "")) from None
        done.append(addr)
    return {"id": pid, "replicas": addrs, "epoch": epoch, "existed": False}


async def delete_partition(dc: DataClient, pid: int, addrs: list[str]) -> dict[str, str]:
    """Delete ``pid`` from each node; returns {addr: "deleted" | "not there" | error text}."""
    out = {}
    for addr in addrs:
        try:
            await dc.admin(addr, Op.PARTITION_DELETE, partition=pid)
            out[addr] = "deleted"
        except ClientError as e:
            out[addr] = "not there" if e.result == Result.NOT_FOUND else _why(e, addr)
    return out


async def current_view(dc: DataClient, pid: int, seeds: list[str], *, may_lose: str | None = None) -> View:
    """The partition's authoritative replica list and epoch: its leader's view.

    ``seeds`` are nodes to ask who the leader is.  If the leader does not answer and the change at hand
    takes it out of the lead (``may_lose`` = the leader's address), the newest view among the other
    replicas is used instead; otherwise that is an error naming the leader."""
    views: dict[str, View] = {}
    errors: dict[str, str] = {}

    async def ask(addr):
        if addr in views or addr in errors:
            return
        try:
            v = await node_view(dc, addr, pid)
        except ClientError as e:
            errors[addr] = _why(e, addr)
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
        raise ClientError(f"partition {pid} is not on {', '.join(seeds)}")
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
        click.echo(f"warning: leader {leader} of partition {pid} does not answer ({errors[leader]}); using "
                   f"the view of {best.source} (epoch {best.epoch})", err=True)
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
            raise ClientError(f"nothing changed: {addr} does not answer: {_why(e, addr)}") from None
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
                              f"{_why(e, addr)}") from None
        steps.append({"node": addr, "action": "create", "result": "ok"})
    order = [old.replicas[0]] + [a for a in old.replicas[1:]] + [a for a in new if a not in old.replicas]
    updated: list[str] = list(added)
    for addr in order:
        if addr in added:
            continue
        try:
            await dc.admin(addr, Op.PARTITION_UPDATE, partition=pid, body=body)
        except ClientError as e:
            why = _why(e, addr)
            if e.result == Result.STALE_EPOCH and e.arg == epoch:
                v = await node_view(dc, addr, pid)
                if v is not None and v.replicas == new:
                    steps.append({"node": addr, "action": "update", "result": "already done"})
                    updated.append(addr)
                    continue
            if addr in removed:
                steps.append({"node": addr, "action": "update", "result": why})
                continue
            behind = [a for a in new if a not in updated]
            raise ClientError(f"partition {pid}: update to epoch {epoch} failed on {addr}: {why}; now at epoch "
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
            steps.append({"node": addr, "action": "delete", "result": _why(e, addr)})
            told = any(s["node"] == addr and s["action"] == "update" and s["result"] == "ok" for s in steps)
            warnings.append(f"removed replica {addr} did not delete its copy ({_why(e, addr)}); it "
                            + (f"knows it was removed (epoch {epoch})" if told else
                               f"still believes it is a replica at epoch {old.epoch} (the others refuse it)")
                            + f"; delete it later with: dnctl partition delete --id {pid} --replicas {addr}")
    return {"id": pid, "old": {"replicas": old.replicas, "epoch": old.epoch},
            "new": {"replicas": new, "epoch": epoch}, "steps": steps, "warnings": warnings}


def _change_text(res: dict) -> str:
    lines = [f"partition {res['id']}: epoch {res['old']['epoch']} -> {res['new']['epoch']}",
             f"  replicas before: {', '.join(res['old']['replicas'])}",
             f"  replicas now:    {', '.join(res['new']['replicas'])} (leader {res['new']['replicas'][0]})"]
    lines += [f"  {s['action']:6} {s['node']:22} {s['result']}" for s in res["steps"]]
    lines += [f"warning: {w}" for w in res["warnings"]]
    return "\n".join(lines)


def _seeds(via, cluster, extra=()) -> list[str]:
    if via and cluster:
        raise click.UsageError("give only one of --via ADDR or --cluster DIR")
    seeds = [check_addr(via)] if via else cluster_nodes(cluster) if cluster else []
    seeds += [a for a in extra if a not in seeds]
    if not seeds:
        raise click.UsageError("say where the partition is: --via ADDR (any of its replicas) or --cluster DIR")
    return seeds


@click.group(context_settings=CTX)
def main():
    """Administer datanodes: local clusters, partitions and their replicas, data, pools, benchmarks.

    \b
    Start a local 3-node cluster:  dnctl cluster up --nodes 3 --dir /tmp/dn
    See it:                        dnctl cluster status --dir /tmp/dn
    Store a file:                  dnctl put --cluster /tmp/dn --partition 1 FILE
    Read it back:                  dnctl get --cluster /tmp/dn --partition 1 --extent 1 --out OUT
    Write, read back, verify:      dnctl demo --dir /tmp/dn --mib 300
    Measure:                       dnctl bench --dir /tmp/dn --size 1MiB --clients 2
    Stop it:                       dnctl cluster down --dir /tmp/dn

    Every command takes --help; most take --json for scripts.  Errors are one line and exit status 1.
    """


# -- local clusters -----------------------------------------------------------------------------------
@main.group(context_settings=CTX)
def cluster():
    """Run a cluster of datanode processes on this machine (127.0.0.1).

    \b
    dnctl cluster up --nodes 3 --dir /tmp/dn             # 3 nodes, partition 1 on all of them
    dnctl cluster up --dir /tmp/dn --sync none --base-port 17310
    dnctl cluster status --dir /tmp/dn [--json]          # pid, health, partitions of each node
    dnctl cluster add-node --dir /tmp/dn                 # one more node (for `dnctl replica add`)
    dnctl cluster down --dir /tmp/dn                     # SIGTERM: each node drains, then exits

    The directory holds cluster.json and node1/, node2/, ... (node.toml, data/, node.log).  The nodes are
    detached: they keep running after dnctl exits.  `up` on a stopped cluster's directory starts the
    same nodes again (same addresses, data kept).
    """


@cluster.command("up")
@click.option("--nodes", "count", type=click.IntRange(1, 64), default=3, show_default=True,
              help="How many datanodes.")
@click.option("--dir", "root", type=click.Path(file_okay=False), required=True,
              help="Cluster directory (created if needed).")
@click.option("--base-port", type=click.IntRange(1, 65535),
              help="Node i listens on BASE+i-1 (default: free ports picked at random).")
@click.option("--sync", type=click.Choice(["always", "none"]), default="always", show_default=True,
              help="always: fdatasync before each ack; none: page cache only (faster, not durable).")
@click.option("--transport", type=click.Choice(["auto", "tcp", "verbs"]), default="auto", show_default=True,
              help="Data path: auto uses RDMA if a device works, else TCP.")
@click.option("--pool-mib", type=click.IntRange(8, 65536), default=128, show_default=True,
              help="Registered memory pool per node.")
@click.option("--replica-timeout", type=click.FloatRange(0.1, 600), default=5.0, show_default=True,
              help="Seconds a follower may take to ack a forwarded write.")
@click.option("--partition", "pid", type=click.IntRange(1), default=1, show_default=True,
              help="Id of the partition created on all nodes.")
@click.option("--json", "as_json", is_flag=True)
def cluster_up(count, root, base_port, sync, transport, pool_mib, replica_timeout, pid, as_json):
    """Start N datanodes and create a partition replicated on all of them (leader: node1).

    \b
    Example:
      dnctl cluster up --nodes 3 --dir /tmp/dn
      dnctl put --cluster /tmp/dn --partition 1 /etc/services
    """
    from datanode.config import ConfigError
    from tools import cluster as cl
    rootp = pathlib.Path(root)
    try:
        info = cl.up(rootp, count, base_port, sync=sync, transport=transport, pool_mib=pool_mib,
                     replica_timeout=replica_timeout)
    except (RuntimeError, TimeoutError, ValueError, ConfigError, OSError) as e:
        raise click.ClickException(str(e)) from None
    addrs = [n["addr"] for n in info["nodes"]]

    async def go():
        async with DataClient.open(timeout=10) as dc:
            part = None
            if not info.get("restarted"):
                part = await create_partition(dc, pid, addrs)
            status = await dc.admin(addrs[0], Op.NODE_STATUS)
            parts = await dc.admin(addrs[0], Op.PARTITION_LIST)
            return part, status, parts

    try:
        part, status, parts = trio.run(go)
    except ClientError as e:
        if not info.get("restarted"):
            cl.down(rootp)
        raise click.ClickException(f"{e} (cluster stopped again)") from None
    transport_used = ("verbs (RDMA device %s)" % status["rdma_device"]) if status.get("rdma_device") else (
        "tcp" if transport == "tcp" else "tcp (no RDMA device)")
    res = {"dir": str(rootp.resolve()), "nodes": info["nodes"], "config": info.get("config", {}),
           "restarted": bool(info.get("restarted")), "transport": transport_used,
           "partitions": [{"id": p["id"], "replicas": p["replicas"], "epoch": p["epoch"]} for p in parts]}
    d = res["dir"]
    cfg = info.get("config", {})
    lines = [("restarted the stopped cluster (same addresses, data kept) in " if info.get("restarted")
              else f"{len(addrs)} datanode(s) up in ") + d
             + f"  [sync {cfg.get('sync')}, transport {transport_used}, pool {cfg.get('pool_mib')} MiB]"]
    for i, n in enumerate(info["nodes"], 1):
        lines.append(f"  node{i}  {n['addr']:21}  pid {n['pid']:<7}  log {n['log']}")
    for p in parts:
        lines.append(f"partition {p['id']}: replicas {','.join(p['replicas'])} (leader {p['replicas'][0]}, "
                     f"epoch {p['epoch']})")
    show = pid if any(p["id"] == pid for p in parts) else (parts[0]["id"] if parts else pid)
    shown = next((p for p in parts if p["id"] == show), None)
    rep = shown["replicas"][-1] if shown else addrs[-1]
    lines += ["", "try:",
              f"  dnctl put --cluster {d} --partition {show} FILE          # prints the extent it went to",
              f"  dnctl get --cluster {d} --partition {show} --extent 1 --out OUT",
              f"  dnctl get --cluster {d} --partition {show} --extent 1 --replica {rep} --out OUT",
              f"  dnctl demo --dir {d} --mib 300",
              f"  dnctl cluster status --dir {d}",
              f"  dnctl cluster down --dir {d}"]
    emit(res, as_json, "\n".join(lines))


@cluster.command("down")
@click.option("--dir", "root", type=click.Path(file_okay=False), required=True)
@click.option("--timeout", type=click.FloatRange(0.1, 600), default=30.0, show_default=True,
              help="Seconds each node may take to drain before it is killed.")
@click.option("--json", "as_json", is_flag=True)
def cluster_down(root, timeout, as_json):
    """Stop the cluster's nodes: SIGTERM (in-flight requests drain), SIGKILL after --timeout.

    Data stays in the directory; `dnctl cluster up --dir DIR` starts the same nodes again.
    """
    from tools import cluster as cl
    load_cluster(root)
    res = cl.down(pathlib.Path(root), timeout)
    lines = []
    for r in res:
        extra = f" in {r['seconds']}s" if "seconds" in r else ""
        lines.append(f"{r['addr']:21} pid {r['pid']:<7} {r['result']}{extra}"
                     + (f"  (log: {r['log_tail']})" if r.get("log_tail") else ""))
    emit(res, as_json, "\n".join(lines))
    if any(r["result"].startswith("killed") for r in res):
        sys.exit(1)


@cluster.command("add-node")
@click.option("--dir", "root", type=click.Path(file_okay=False), required=True)
@click.option("--port", type=click.IntRange(1, 65535), help="Port to listen on (default: a free one).")
@click.option("--json", "as_json", is_flag=True)
def cluster_add_node(root, port, as_json):
    """Start one more datanode in the cluster (same config, no partitions yet).

    \b
    dnctl cluster add-node --dir /tmp/dn
    dnctl replica add --id 1 --node ADDR --cluster /tmp/dn
    """
    from datanode.config import ConfigError
    from tools import cluster as cl
    load_cluster(root)
    try:
        rec = cl.add_node(pathlib.Path(root), port)
    except (RuntimeError, TimeoutError, ValueError, ConfigError, OSError) as e:
        raise click.ClickException(str(e)) from None
    emit(rec, as_json, f"{rec['addr']} up (pid {rec['pid']}, log {rec['log']}); add it to a partition with:\n"
                       f"  dnctl replica add --id 1 --node {rec['addr']} --cluster {root}")


@cluster.command("status")
@click.option("--dir", "root", type=click.Path(file_okay=False), required=True)
@click.option("--timeout", type=click.FloatRange(0.1, 60), default=2.0, show_default=True,
              help="Seconds a node has to answer NODE_STATUS.")
@click.option("--json", "as_json", is_flag=True)
def cluster_status(root, timeout, as_json):
    """Each node's address, pid and health; exit status 1 if any node is not healthy.

    \b
    health: up            process alive and answers NODE_STATUS within --timeout
            not answering process alive but no answer (stopped? overloaded?)
            down          process gone
    """
    from tools import cluster as cl
    info = load_cluster(root)

    async def probe(dc, n, out):
        rec = {"addr": n["addr"], "pid": n["pid"], "alive": cl.node_alive(n["pid"]), "health": "down"}
        out.append(rec)
        if not rec["alive"]:
            return
        rec["health"] = "not answering"
        with trio.move_on_after(timeout):
            try:
                st = await dc.admin(n["addr"], Op.NODE_STATUS)
                parts = await dc.admin(n["addr"], Op.PARTITION_LIST)
            except ClientError as e:
                rec["error"] = _why(e, n["addr"])
                return
            rec.update(health="up", uptime_s=st["uptime_s"], inflight=st["inflight"], sync=st["sync"],
                       transport=st["transport"], rdma_device=st["rdma_device"], draining=st["draining"],
                       connections=len(st["connections"]),
                       partitions=[{"id": p["id"], "role": p["role"], "epoch": p["epoch"],
                                    "extents": p["extents"], "bytes": p["bytes"], "replicas": p["replicas"]}
                                   for p in parts])
            if st["pid"] != n["pid"]:
                rec["warning"] = f"answered as pid {st['pid']}, cluster.json says {n['pid']}"
        if rec["health"] != "up" and "error" not in rec:
            rec["error"] = f"no answer within {timeout:g}s"

    async def go():
        out: list = []
        async with DataClient.open(timeout=timeout) as dc:
            for n in info["nodes"]:    # one at a time: a hung node costs --timeout, not the others' answers
                await probe(dc, n, out)
        return out

    res = run(go)
    lines = [f"{'node':6} {'address':21} {'pid':>7}  {'health':13} {'uptime':>8}  partitions"]
    for i, r in enumerate(res, 1):
        parts = ", ".join(f"{p['id']} ({p['role']}, epoch {p['epoch']}, {p['extents']} extents, "
                          f"{p['bytes']} B)" for p in r.get("partitions", [])) or "-"
        up = f"{r['uptime_s']:.0f}s" if "uptime_s" in r else "-"
        lines.append(f"node{i:<2} {r['addr']:21} {r['pid']:>7}  {r['health']:13} {up:>8}  "
                     + (parts if r["health"] == "up" else r.get("error", "")))
        if r.get("warning"):
            lines.append(f"       warning: {r['warning']}")
    healthy = all(r["health"] == "up" for r in res)
    lines.append(f"{sum(r['health'] == 'up' for r in res)}/{len(res)} nodes up")
    emit({"dir": str(pathlib.Path(root).resolve()), "healthy": healthy, "nodes": res}, as_json, "\n".join(lines))
    if not healthy:
        sys.exit(1)


# -- partitions ---------------------------------------------------------------------------------------
@main.group(context_settings=CTX)
def partition():
    """Create, list and show data partitions; change their leader.

    \b
    dnctl partition create --id 2 --replicas 127.0.0.1:17310,127.0.0.1:17311
    dnctl partition list 127.0.0.1:17310
    dnctl partition show --id 2 127.0.0.1:17311
    dnctl partition set-leader --id 2 127.0.0.1:17311
    dnctl partition sync --id 2 --via 127.0.0.1:17310     # push the leader's view to lagging replicas
    dnctl partition delete --id 2 --replicas 127.0.0.1:17310,127.0.0.1:17311
    Replicas are added and removed with `dnctl replica`.
    """


@partition.command("create")
@click.option("--id", "pid", type=click.IntRange(1), required=True, help="Partition id.")
@click.option("--replicas", required=True, help="Comma-separated HOST:PORT list, leader first.")
@click.option("--json", "as_json", is_flag=True)
def partition_create(pid, replicas, as_json):
    """Create a partition on every replica (all or nothing: undone everywhere if one node fails)."""
    addrs = split_addrs(replicas)

    async def go():
        async with DataClient.open() as dc:
            return await create_partition(dc, pid, addrs)

    res = run(go)
    emit(res, as_json, f"partition {pid} {'already exists' if res['existed'] else 'created'} on "
                       f"{', '.join(addrs)} (leader {addrs[0]}, epoch {res['epoch']})")


@partition.command("delete")
@click.option("--id", "pid", type=click.IntRange(1), required=True, help="Partition id.")
@click.option("--replicas", help="Comma-separated HOST:PORT list (default: the partition's replicas).")
@click.option("--via", help="Any replica HOST:PORT, to find the replicas.")
@click.option("--cluster", type=click.Path(file_okay=False), help="A local cluster dir, to find them.")
@click.option("--json", "as_json", is_flag=True)
def partition_delete(pid, replicas, via, cluster, as_json):
    """Delete a partition and its data from its replicas (irreversible)."""
    async def go():
        async with DataClient.open() as dc:
            addrs = split_addrs(replicas) if replicas else (await current_view(
                dc, pid, _seeds(via, cluster))).replicas
            return await delete_partition(dc, pid, addrs)
    res = run(go)
    emit(res, as_json, "\n".join(f"{a:21} {r}" for a, r in res.items()))
    if any(r not in ("deleted", "not there") for r in res.values()):
        sys.exit(1)


@partition.command("set-leader")
@click.option("--id", "pid", type=click.IntRange(1), required=True, help="Partition id.")
@click.argument("addr")
@click.option("--via", help="Another replica to ask (default: ADDR itself).")
@click.option("--cluster", type=click.Path(file_okay=False), help="A local cluster dir.")
@click.option("--json", "as_json", is_flag=True)
def partition_set_leader(pid, addr, via, cluster, as_json):
    """Make replica ADDR the partition's leader (moves it to the front of the list, epoch + 1).

    Clients must re-read the partition map (their epoch is now stale).  In-flight writes to the old
    leader may fail; retry them.
    """
    check_addr(addr)
    seeds = [addr] + [a for a in (_seeds(via, cluster) if (via or cluster) else []) if a != addr]

    async def go():
        async with DataClient.open() as dc:
            old = await current_view(dc, pid, seeds, may_lose=None)
            if addr not in old.replicas:
                raise ClientError(f"{addr} is not a replica of partition {pid} "
                                  f"(replicas: {', '.join(old.replicas)})")
            if old.leader == addr:
                return {"id": pid, "unchanged": True, "replicas": old.replicas, "epoch": old.epoch}
            return await change_replicas(dc, old, [addr] + [a for a in old.replicas if a != addr])
    res = run(go)
    if res.get("unchanged"):
        emit(res, as_json, f"{addr} already leads partition {pid} (epoch {res['epoch']})")
    else:
        emit(res, as_json, _change_text(res))


@partition.command("sync")
@click.option("--id", "pid", type=click.IntRange(1), required=True, help="Partition id.")
@click.option("--via", help="Any replica HOST:PORT.")
@click.option("--cluster", type=click.Path(file_okay=False), help="A local cluster dir.")
@click.option("--json", "as_json", is_flag=True)
def partition_sync(pid, via, cluster, as_json):
    """Send the leader's replica list and epoch to replicas that are behind (after a failed change)."""
    async def go():
        async with DataClient.open() as dc:
            view = await current_view(dc, pid, _seeds(via, cluster))
            out = {}
            for addr in view.replicas:
                try:
                    v = await node_view(dc, addr, pid)
                    if v is None:
                        await dc.admin(addr, Op.PARTITION_CREATE, partition=pid,
                                       body={"replicas": view.replicas, "epoch": view.epoch})
                        out[addr] = f"created at epoch {view.epoch} (empty: no data repair yet)"
                    elif v.epoch < view.epoch:
                        await dc.admin(addr, Op.PARTITION_UPDATE, partition=pid,
                                       body={"replicas": view.replicas, "epoch": view.epoch})
                        out[addr] = f"updated {v.epoch} -> {view.epoch}"
                    elif v.epoch == view.epoch and v.replicas == view.replicas:
                        out[addr] = "in sync"
                    else:
                        out[addr] = f"disagrees: epoch {v.epoch}, replicas {','.join(v.replicas)}"
                except ClientError as e:
                    out[addr] = f"failed: {_why(e, addr)}"
            return {"id": pid, "replicas": view.replicas, "epoch": view.epoch, "nodes": out}
    res = run(go)
    emit(res, as_json, f"partition {pid} epoch {res['epoch']} (leader {res['replicas'][0]})\n"
         + "\n".join(f"  {a:21} {r}" for a, r in res["nodes"].items()))
    if any(r.startswith(("failed", "disagrees")) for r in res["nodes"].values()):
        sys.exit(1)


# -- replicas -----------------------------------------------------------------------------------------
@main.group(context_settings=CTX)
def replica():
    """Add a node to a partition's replicas, or remove one.

    \b
    dnctl replica add    --id 1 --node 127.0.0.1:17313 --cluster /tmp/dn
    dnctl replica remove --id 1 --node 127.0.0.1:17312 --via 127.0.0.1:17310

    The current list and epoch are read from the partition's leader; the new list is installed at
    epoch + 1 on every member of the old and new lists (a new node gets the partition created first, a
    removed node has it deleted afterwards).  Clients re-read the partition map after a change.

    No data is copied by this command: a new replica starts EMPTY (extents written before it joined
    exist only on the other replicas; reads fail over to them).  Filling it is the leader's repair
    (datanode/repair.py), where the datanode has it, not this command's job.
    """


_where = [click.option("--via", help="Any node that hosts the partition (HOST:PORT)."),
          click.option("--cluster", type=click.Path(file_okay=False), help="A local cluster dir."),
          click.option("--json", "as_json", is_flag=True)]


def _with_where(fn):
    for opt in reversed(_where):
        fn = opt(fn)
    return fn


@replica.command("add")
@click.option("--id", "pid", type=click.IntRange(1), required=True, help="Partition id.")
@click.option("--node", "addr", required=True, help="The node to add (HOST:PORT); it must be running.")
@_with_where
def replica_add(pid, addr, via, cluster, as_json):
    """Add NODE as the last replica of a partition (it starts empty: this command copies no data)."""
    check_addr(addr)
    seeds = _seeds(via, cluster)

    async def go():
        async with DataClient.open() as dc:
            old = await current_view(dc, pid, seeds)
            if addr in old.replicas:
                raise ClientError(f"{addr} is already a replica of partition {pid} "
                                  f"({', '.join(old.replicas)}, epoch {old.epoch})")
            return await change_replicas(dc, old, old.replicas + [addr])
    res = run(go)
    emit(res, as_json, _change_text(res) + f"\nnote: {addr} starts empty; this command copies no data")


@replica.command("remove")
@click.option("--id", "pid", type=click.IntRange(1), required=True, help="Partition id.")
@click.option("--node", "addr", required=True, help="The replica to remove (HOST:PORT); may be down.")
@_with_where
def replica_remove(pid, addr, via, cluster, as_json):
    """Remove NODE from a partition's replicas and delete the partition there (best effort if NODE is down).

    Removing the leader makes the next replica the leader.
    """
    check_addr(addr)
    seeds = [a for a in _seeds(via, cluster) if a != addr] or [addr]

    async def go():
        async with DataClient.open(timeout=5) as dc:
            old = await current_view(dc, pid, seeds, may_lose=addr)
            if addr not in old.replicas:
                raise ClientError(f"{addr} is not a replica of partition {pid} "
                                  f"({', '.join(old.replicas)}, epoch {old.epoch})")
            if len(old.replicas) == 1:
                raise ClientError(f"{addr} is the only replica of partition {pid}; use "
                                  f"`dnctl partition delete` to delete the partition")
            return await change_replicas(dc, old, [a for a in old.replicas if a != addr])
    res = run(go)
    emit(res, as_json, _change_text(res))


@partition.command("list")
@click.argument("addr")
@click.option("--json", "as_json", is_flag=True)
def partition_list(addr, as_json):
    """List the partitions a node hosts."""
    async def go():
        async with DataClient.open() as dc:
            return await dc.admin(addr, Op.PARTITION_LIST)
    parts = run(go)
    lines = [f"{'id':>4} {'role':9} {'epoch':>5} {'extents':>7} {'bytes':>12}  replicas"]
    for p in parts:
        lines.append(f"{p['id']:>4} {p['role']:9} {p['epoch']:>5} {p['extents']:>7} {p['bytes']:>12}  "
                     f"{','.join(p['replicas'])}")
    emit(parts, as_json, "\n".join(lines))


@partition.command("show")
@click.option("--id", "pid", type=int, required=True)
@click.argument("addr")
@click.option("--json", "as_json", is_flag=True)
def partition_show(pid, addr, as_json):
    """Show one partition as a node sees it: replicas, epoch, extents and their sizes."""
    async def go():
        async with DataClient.open() as dc:
            parts = [p for p in await dc.admin(addr, Op.PARTITION_LIST) if p["id"] == pid]
            if not parts:
                raise ClientError(f"partition {pid} is not on {addr}")
            p = parts[0]
            p["extent_sizes"] = await dc.admin(addr, Op.WATERMARKS, partition=pid)
            return p
    p = run(go)
    text = (f"partition {p['id']} on {addr}: {p['role']}, epoch {p['epoch']}, state {p['state']}\n"
            f"  replicas: {', '.join(p['replicas'])}\n  extents: {p['extents']}, bytes: {p['bytes']}\n"
            f"  sealed extents: {p['sealed_extents'] or 'none'}")
    emit(p, as_json, text)


# -- data ---------------------------------------------------------------------------------------------
def _nodes(node, cluster):
    if bool(node) == bool(cluster):
        raise click.UsageError("give exactly one of --node ADDR or --cluster DIR")
    return [check_addr(node)] if node else cluster_nodes(cluster)


@main.command()
@click.option("--node", help="A datanode HOST:PORT (its partition map is used).")
@click.option("--cluster", type=click.Path(file_okay=False), help="A local cluster dir (dnctl cluster up).")
@click.option("--partition", "pid", type=int, required=True)
@click.argument("file", type=click.File("rb"))
@click.option("--json", "as_json", is_flag=True)
def put(node, cluster, pid, file, as_json):
    """Store FILE in a partition; prints where it went: extent id, offset, size and CRC32C.

    The write goes to the partition's leader, which forwards it to every follower and answers only when
    all replicas have it.

    \b
    dnctl put --cluster /tmp/dn --partition 1 /etc/services
    dnctl put --node 127.0.0.1:17310 --partition 1 --json big.bin
    """
    data = file.read()

    async def go():
        async with open_client(_nodes(node, cluster)) as dc:
            return await dc.write(pid, data)
    locs = run(go)
    out = {"size": len(data), "locations": [loc.to_dict() for loc in locs]}
    text = "\n".join(f"extent {loc.extent} offset {loc.offset} size {loc.length} crc32c {loc.crc:#010x}"
                     for loc in _merge(locs)) or "empty file: nothing stored"
    emit(out, as_json, text)


def _merge(locs: list[Location]) -> list[Location]:
    """Adjacent pieces of one extent shown as one range (CRC of the whole range)."""
    from datanode.crc import crc32c_combine
    out: list[Location] = []
    for loc in locs:
        if out and out[-1].extent == loc.extent and out[-1].offset + out[-1].length == loc.offset:
            prev = out[-1]
            out[-1] = Location(prev.partition, prev.extent, prev.offset, prev.length + loc.length,
                               crc32c_combine(prev.crc, loc.crc, loc.length))
        else:
            out.append(loc)
    return out


@main.command()
@click.option("--node")
@click.option("--cluster", type=click.Path(file_okay=False))
@click.option("--partition", "pid", type=int, required=True)
@click.option("--extent", type=int, required=True)
@click.option("--offset", type=int, default=0, show_default=True)
@click.option("--length", type=int, help="Bytes to read (default: to the end of the extent).")
@click.option("--replica", help="Read from this replica HOST:PORT only.")
@click.option("--out", "out", type=click.File("wb"), required=True, help="Output file ('-' for stdout).")
def get(node, cluster, pid, extent, offset, length, replica, out):
    """Read an extent range (CRC-checked, failing over across replicas) into --out.

    \b
    dnctl get --cluster /tmp/dn --partition 1 --extent 1 --out copy.bin
    dnctl get --cluster /tmp/dn --partition 1 --extent 1 --replica 127.0.0.1:17312 --out -
    dnctl get --node 127.0.0.1:17310 --partition 1 --extent 1 --offset 4096 --length 100 --out -
    """
    async def go():
        async with open_client(_nodes(node, cluster)) as dc:
            n = length
            if n is None:
                marks, errors = None, []
                for addr in [replica] if replica else dc.partition(pid).replicas:   # leader first, then others
                    try:
                        marks = await dc.watermarks(pid, addr)
                        break
                    except ClientError as e:
                        errors.append(str(e))
                if marks is None:
                    raise ClientError("cannot learn the extent's size: " + "; ".join(errors))
                if extent not in marks:
                    raise ClientError(f"extent {extent} not found in partition {pid}")
                n = marks[extent] - offset
            return await dc.read(pid, extent, offset, n, replica=replica)
    data = run(go)
    out.write(data)
    if out is not sys.stdout.buffer and getattr(out, "name", "-") != "<stdout>":
        click.echo(f"{len(data)} bytes read from extent {extent}"
                   + (f" on {replica}" if replica else ""), err=True)


# -- pools and nodes ----------------------------------------------------------------------------------
@main.group(context_settings=CTX)
def pool():
    """Registered memory pools."""


@pool.command("stats")
@click.argument("addr")
@click.option("--json", "as_json", is_flag=True)
def pool_stats(addr, as_json):
    """A node's pool: arena size, bytes in use, high-water mark, free blocks per order, waits."""
    async def go():
        async with DataClient.open() as dc:
            return await dc.admin(addr, Op.POOL_STATS)
    s = run(go)
    mib = 1 << 20
    free = ", ".join(f"{int(k) // 1024}K x{v}" for k, v in sorted(s["free_blocks_per_order"].items(),
                                                                   key=lambda kv: int(kv[0])) if v)
    text = (f"arena {s['arena_bytes'] / mib:.0f} MiB (one registration, rkey {s['rkey']:#x}), "
            f"max block {s['max_block'] // 1024} KiB\n"
            f"in use {s['in_use_bytes'] / mib:.1f} MiB, high-water {s['high_water_bytes'] / mib:.1f} MiB, "
            f"live blocks {s['live_blocks']}\nallocs {s['allocs']}, waits {s['waits']}, "
            f"timeouts {s['timeouts']}\nfree blocks: {free}")
    emit(s, as_json, text)


@main.group(context_settings=CTX)
def node():
    """Datanodes."""


@node.command("status")
@click.argument("addr")
@click.option("--json", "as_json", is_flag=True)
def node_status(addr, as_json):
    """Health, partitions, counters and each connection's transport."""
    async def go():
        async with DataClient.open() as dc:
            return await dc.admin(addr, Op.NODE_STATUS)
    s = run(go)
    c = s["counters"]
    lines = [f"node {s['node']} pid {s['pid']} up {s['uptime_s']}s, transport {s['transport']}, "
             f"sync {s['sync']}, rdma device {s['rdma_device'] or 'none'}",
             f"partitions {s['partitions']}, in flight {s['inflight']}",
             f"writes {c['writes']} ({c['write_bytes']} B incl. replica writes {c['replica_writes']}), "
             f"reads {c['reads']}, replication failures {c['replication_failures']}, "
             f"protocol errors {c['protocol_errors']}",
             "connections:"]
    for conn in s["connections"]:
        lines.append(f"  {conn['peer']:22} {conn['transport']:5} sends {conn['sends']} recvs {conn['recvs']} "
                     f"served reads {conn['served_reads']}")
    emit(s, as_json, "\n".join(lines))


# -- demo and benchmarks (their code lives in tools/demo.py and tools/bench.py) ---------------------------
def _register() -> None:
    from tools.bench import bench_command
    from tools.demo import demo_command
    main.add_command(demo_command, "demo")
    main.add_command(bench_command, "bench")


_register()
from tools import dnctl_repair; dnctl_repair.register(main)  # noqa: E402,E702  health/repair/scrub/torture

if __name__ == "__main__":
    main()
