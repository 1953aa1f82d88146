"""``dnctl trash``: the partitions a node deleted (or was removed from), kept in ``data_dir/trash`` for
``trash_retention_s`` (datanode/partition.py).

Two ways to reach a node's trash:

* **over the wire** (a running node): admin-role requests ``TRASH_LIST`` / ``TRASH_RESTORE`` / ``TRASH_PURGE``
  (datanode/ops/admin.py, audit-logged; client/admin.py ``trash_*``).  ``--node ADDR`` alone names the node;
  with ``--cluster DIR`` or ``--config node.toml``, a node found running is reached this way too.  A restore
  on a running node serves the partition at once; restoring a partition that is live there is refused.
* **on the local disk** (a node that is down): ``--config node.toml`` or ``--cluster DIR [--node ADDR]`` on the
  node's host; ``restore`` then puts the directory back for the node to load at its next start.
"""
from __future__ import annotations

import dataclasses
import pathlib
import sys
import time

import click

from tools.clikit import ADDR, CTX, cluster_option, credentials, default_secret, emit, fmt_bytes, load_cluster, run


@dataclasses.dataclass
class Target:
    addr: str
    cfg: object | None          # its Config, when we know its data_dir (--config / --cluster)
    wire: bool                  # running: over the wire; else on the local disk


def _targets(config_path, cluster, node) -> list[Target]:
    """The nodes chosen: ``--node ADDR`` alone (a running node, over the wire), ``--config`` (one node) or
    ``--cluster DIR`` (every node, or ``--node``'s); each reached over the wire if running, else on disk."""
    from datanode import config as config_mod
    if config_path and cluster:
        raise click.UsageError("say whose trash with one of --config node.toml, --cluster DIR [--node ADDR] or "
                               "--node ADDR")
    if not config_path and not cluster:
        if not node:
            raise click.UsageError("say whose trash: --node ADDR (a running node), --config node.toml or "
                                   "--cluster DIR [--node ADDR]")
        return [Target(node, None, True)]
    paths = [pathlib.Path(config_path)] if config_path else [
        pathlib.Path(n["dir"]) / "node.toml" for n in load_cluster(cluster)["nodes"] if not node or n["addr"] == node]
    if not paths:
        raise click.UsageError(f"no node {node} in the cluster {cluster}")
    out = []
    for p in paths:
        try:
            cfg = config_mod.load(str(p))
        except config_mod.ConfigError as e:
            raise click.ClickException(str(e)) from None
        if config_path and node and node != cfg.listen:
            raise click.UsageError(f"--node {node} is not the node of {config_path} ({cfg.listen})")
        default_secret(cfg.secret_file)
        out.append(Target(cfg.listen, cfg, _running(cfg) is not None))
    return out


def _table(cfg):
    from datanode.partition import PartitionTable
    from datanode.store import StoreOptions
    return PartitionTable(pathlib.Path(cfg.data_dir), cfg.sync, options=StoreOptions.from_config(cfg))


def _running(cfg) -> int | None:
    from tools import cluster as cl
    return cl.listener_pid(cfg.listen)


def _over_wire(targets: list[Target], fn):
    """``fn(dc, target)`` for each target reached over the wire, with one admin client; [results]."""
    wired = [t for t in targets if t.wire]
    if not wired:
        return []

    async def go():
        from client.sdk import DataClient
        async with DataClient.from_env(timeout=10, **credentials()) as dc:
            return [await fn(dc, t) for t in wired]
    return run(go)


_where = [click.option("--config", "config_path", type=click.Path(dir_okay=False),
                       help="One node's node.toml (over the wire if it runs, else its data_dir on this host)."),
          cluster_option(help="A local cluster directory: every node of it (or --node ADDR)."),
          click.option("--node", type=ADDR, help="A running node, over the wire (HOST:PORT; admin role: the cluster "
                                                 "secret or an admin key file); with --cluster: only this node.")]


def where(fn):
    for opt in reversed(_where):
        fn = opt(fn)
    return fn


@click.group("trash", context_settings=CTX)
def trash_group():
    """Deleted partitions kept for trash_retention_s: list them, put one back, purge them -- over the wire on a
    running node (--node ADDR; admin role), or on the local disk of a node that is down (--config/--cluster).

    \b
    dnctl trash list --node 127.0.0.1:17311
    dnctl trash restore 7.1700000000000000000 --node 127.0.0.1:17311
    dnctl trash list --cluster /tmp/dn                 # every node: running ones over the wire, others on disk
    dnctl trash purge --expired --config /etc/datanode/node.toml
    """


@trash_group.command("list")
@where
@click.option("--json", "as_json", is_flag=True)
def trash_list(config_path, cluster, node, as_json):
    """What each node's trash holds: entry name, partition, when deleted, bytes, time left before the purge."""
    from client import admin
    targets = _targets(config_path, cluster, node)
    now = time.time()
    rows = []
    for t in targets:
        if not t.wire:
            rows += [{**e, "node": t.addr, "via": "disk",
                      "purge_in_s": max(0.0, round(t.cfg.trash_retention_s - (now - e["deleted"]), 1))}
                     for e in _table(t.cfg).list_trash()]

    async def one(dc, t):
        return [{**e, "node": t.addr, "via": "node"} for e in await admin.trash_list(dc, t.addr)]
    for got in _over_wire(targets, one):
        rows += got
    rows.sort(key=lambda r: (r["node"], r["deleted"]))
    lines = [f"{r['node']:21}  {r['name']:32}  partition {r['partition']:<6}  deleted "
             f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(r['deleted']))}  {fmt_bytes(r['bytes']):>10}  "
             f"purged in {r['purge_in_s']:.0f}s" for r in rows]
    emit(rows, as_json, "\n".join(lines) if lines else "the trash is empty")


@trash_group.command("restore")
@click.argument("name")
@where
@click.option("--json", "as_json", is_flag=True)
def trash_restore(name, config_path, cluster, node, as_json):
    """Put trash entry NAME back as its partition, with the replicas and epoch it had.  A running node serves
    it at once (a partition of that id live there is an error, nothing is changed); on a node that is down,
    the directory is put back for its next start.  Then a leader's repair brings the copy up to date, or a
    newer view fences it."""
    from client import admin
    from wire.protocol import BodyError, check_trash_name
    try:
        check_trash_name(name)
    except BodyError as e:
        raise click.BadParameter(e.detail, param_hint="NAME") from None
    targets = _targets(config_path, cluster, node)
    if len(targets) > 1:                  # which node holds it?
        holders = []
        for t in targets:
            if not t.wire:
                if (pathlib.Path(t.cfg.data_dir) / "trash" / name).is_dir():
                    holders.append(t)

        async def holds(dc, t):
            return t if any(e["name"] == name for e in await admin.trash_list(dc, t.addr)) else None
        holders += [t for t in _over_wire(targets, holds) if t is not None]
        if not holders:
            raise click.ClickException(f"no trash entry {name!r} (see: dnctl trash list)")
        if len(holders) > 1:
            raise click.UsageError(f"{len(holders)} nodes hold {name!r}: say which with --node")
        targets = holders
    t = targets[0]
    if t.wire:
        async def restore(dc, t):
            return await admin.trash_restore(dc, t.addr, name)
        part = _over_wire([t], restore)[0]
        emit({"node": t.addr, "name": name, "partition": part, "via": "node"}, as_json,
             f"partition {part} restored on {t.addr} from {name}; the node serves it now")
        return
    try:
        part = _table(t.cfg).restore(name)
    except (FileNotFoundError, FileExistsError, OSError) as e:
        raise click.ClickException(str(e)) from None
    emit({"node": t.addr, "name": name, "partition": part, "via": "disk"}, as_json,
         f"partition {part} restored on {t.addr} (on its disk: it is down) from {name}; start the node to serve it")


@trash_group.command("purge")
@click.argument("names", nargs=-1)
@where
@click.option("--expired", is_flag=True, help="Only entries older than the node's trash_retention_s.")
@click.option("--all", "everything", is_flag=True, help="Every entry (the data is gone for good).")
@click.option("--yes", "-y", is_flag=True, help="Do not ask: purge what is listed (for scripts).")
@click.option("--json", "as_json", is_flag=True)
def trash_purge(names, config_path, cluster, node, expired, everything, yes, as_json):
    """Delete trash entries for good: the NAMEs given, or --expired ones, or --all.  Shows what will go and
    asks first (--yes: does not ask); a running node purges only on a second request carrying the
    confirmation token it gave for exactly those entries.

    \b
    dnctl trash purge --expired --node 127.0.0.1:17311          # lists them, asks y/N
    dnctl trash purge 7.1700000000000000000 --node 127.0.0.1:17311 --yes --json
    """
    from client import admin
    from wire.protocol import BodyError, check_trash_name
    if sum(map(bool, (names, expired, everything))) != 1:
        raise click.UsageError("say which entries: NAME..., --expired or --all")
    try:
        for n in names:
            check_trash_name(n)
    except BodyError as e:
        raise click.BadParameter(e.detail, param_hint="NAMES") from None
    targets = _targets(config_path, cluster, node)
    now = time.time()

    def chosen(entries: list[dict]) -> list[dict]:
        return [e for e in entries if everything or e["name"] in names or (expired and e["purge_in_s"] <= 0)]

    # what each node would purge, as its trash lists it now (a running node: over the wire)
    plan: dict[str, tuple[Target, list[dict]]] = {}
    for t in targets:
        if not t.wire:
            plan[t.addr] = (t, chosen([{**e, "purge_in_s": t.cfg.trash_retention_s - (now - e["deleted"])}
                                       for e in _table(t.cfg).list_trash()]))

    async def listing(dc, t):
        return t, chosen(await admin.trash_list(dc, t.addr))
    for t, got in _over_wire(targets, listing):
        plan[t.addr] = (t, got)
    missing = set(names) - {e["name"] for _t, es in plan.values() for e in es}
    if missing:
        raise click.ClickException(f"no trash entry {', '.join(sorted(missing))} (see: dnctl trash list)")
    todo = {a: (t, es) for a, (t, es) in plan.items() if es}
    if not todo:
        emit([], as_json, "nothing to purge")
        return
    if not yes:
        if not sys.stdin.isatty():
            raise click.UsageError("purging needs a yes: run it on a terminal to be asked, or give --yes")
        for a, (_t, es) in sorted(todo.items()):
            for e in es:
                click.echo(f"{a:21}  {e['name']:32}  partition {e['partition']:<6}  {fmt_bytes(e['bytes']):>10}",
                           err=True)
        n = sum(len(es) for _t, es in todo.values())
        if not click.confirm(f"purge these {n} trash entries for good (the data cannot be restored)?", err=True):
            raise click.ClickException("nothing purged")
    gone = []
    for a, (t, es) in todo.items():
        if not t.wire:
            gone += [{"node": a, "name": e["name"], "bytes": e["bytes"], "via": "disk"}
                     for e in _table(t.cfg).purge_names([e["name"] for e in es])]

    async def one(dc, t):
        es = todo.get(t.addr, (t, []))[1]
        if not es:
            return []
        got = await admin.trash_purge(dc, t.addr, names=[e["name"] for e in es])
        return [{"node": t.addr, "name": e["name"], "bytes": e["bytes"], "via": "node"} for e in got]
    for got in _over_wire([t for t, _es in todo.values()], one):
        gone += got
    emit(gone, as_json, "\n".join(f"purged {g['name']} on {g['node']}" for g in gone) or "nothing to purge")
