"""``dnctl trash``: the partitions a node deleted (or was removed from), kept in ``data_dir/trash`` for
``trash_retention_s`` (datanode/partition.py).  The commands work on the node's data directory, so they run on
the node's host: ``--config node.toml`` names one node, ``--cluster DIR`` every node of a local cluster (``--node
ADDR`` one of them).  ``restore`` needs the node stopped (it loads its partitions at start); ``list`` and
``purge`` do not."""
from __future__ import annotations

import pathlib
import shutil
import time

import click

from tools.clikit import ADDR, CTX, cluster_option, emit, fmt_bytes, load_cluster


def _nodes(config_path, cluster, node) -> list[tuple[str, object]]:
    """[(node address, its Config)] of the nodes chosen by --config or --cluster [--node]."""
    from datanode import config as config_mod
    if bool(config_path) == bool(cluster):
        raise click.UsageError("say whose trash: --config node.toml (one node) or --cluster DIR [--node ADDR]")
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
        out.append((cfg.listen, cfg))
    return out


def _table(cfg):
    from datanode.partition import PartitionTable
    return PartitionTable(pathlib.Path(cfg.data_dir), cfg.sync)


def _running(cfg) -> int | None:
    from tools import cluster as cl
    return cl.listener_pid(cfg.listen)


_where = [click.option("--config", "config_path", type=click.Path(dir_okay=False), help="One node's node.toml."),
          cluster_option(help="A local cluster directory: every node of it (or --node ADDR)."),
          click.option("--node", type=ADDR, help="With --cluster: only this node (HOST:PORT).")]


def where(fn):
    for opt in reversed(_where):
        fn = opt(fn)
    return fn


@click.group("trash", context_settings=CTX)
def trash_group():
    """Deleted partitions kept for trash_retention_s: list them, put one back, purge them.

    \b
    dnctl trash list --cluster /tmp/dn
    dnctl cluster stop-node 127.0.0.1:17311 --cluster /tmp/dn
    dnctl trash restore 7.1700000000000000000 --cluster /tmp/dn --node 127.0.0.1:17311
    dnctl trash purge --expired --config /etc/datanode/node.toml
    """


@trash_group.command("list")
@where
@click.option("--json", "as_json", is_flag=True)
def trash_list(config_path, cluster, node, as_json):
    """What each node's trash holds: entry name, partition, when deleted, bytes, time left before the purge."""
    now = time.time()
    rows = []
    for addr, cfg in _nodes(config_path, cluster, node):
        for e in _table(cfg).list_trash():
            rows.append({**e, "node": addr, "purge_in_s": max(0.0, round(cfg.trash_retention_s - (now - e["deleted"]), 1))})
    lines = [f"{r['node']:21}  {r['name']:32}  partition {r['partition']:<6}  deleted "
             f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(r['deleted']))}  {fmt_bytes(r['bytes']):>10}  "
             f"purged in {r['purge_in_s']:.0f}s" for r in rows]
    emit(rows, as_json, "\n".join(lines) if lines else "the trash is empty")


@trash_group.command("restore")
@click.argument("name")
@where
@click.option("--json", "as_json", is_flag=True)
def trash_restore(name, config_path, cluster, node, as_json):
    """Put trash entry NAME back as its partition, with the replicas and epoch it had; the node must be stopped
    (start it again afterwards: a leader's repair brings the copy up to date, or a newer view fences it)."""
    chosen = [(a, c) for a, c in _nodes(config_path, cluster, node)
              if (pathlib.Path(c.data_dir) / "trash" / name).is_dir()]
    if not chosen:
        raise click.ClickException(f"no trash entry {name!r} (see: dnctl trash list)")
    if len(chosen) > 1:
        raise click.UsageError(f"{len(chosen)} nodes hold {name!r}: say which with --node")
    addr, cfg = chosen[0]
    pid = _running(cfg)
    if pid is not None:
        raise click.ClickException(f"node {addr} is running (pid {pid}): stop it first, it loads its partitions at "
                                   f"start (dnctl cluster stop-node ADDR --cluster DIR, or your service manager)")
    try:
        part = _table(cfg).restore(name)
    except (FileNotFoundError, FileExistsError, OSError) as e:
        raise click.ClickException(str(e)) from None
    emit({"node": addr, "name": name, "partition": part}, as_json,
         f"partition {part} restored on {addr} from {name}; start the node to serve it")


@trash_group.command("purge")
@click.argument("names", nargs=-1)
@where
@click.option("--expired", is_flag=True, help="Only entries older than the node's trash_retention_s.")
@click.option("--all", "everything", is_flag=True, help="Every entry (the data is gone for good).")
@click.option("--json", "as_json", is_flag=True)
def trash_purge(names, config_path, cluster, node, expired, everything, as_json):
    """Delete trash entries for good: the NAMEs given, or --expired ones, or --all."""
    if sum(map(bool, (names, expired, everything))) != 1:
        raise click.UsageError("say which entries: NAME..., --expired or --all")
    gone = []
    for addr, cfg in _nodes(config_path, cluster, node):
        table = _table(cfg)
        if expired:
            gone += [{"node": addr, "name": n} for n in table.purge_trash(cfg.trash_retention_s)]
            continue
        for e in table.list_trash():
            if everything or e["name"] in names:
                shutil.rmtree(table.trash / e["name"], ignore_errors=True)
                gone.append({"node": addr, "name": e["name"], "bytes": e["bytes"]})
    missing = set(names) - {g["name"] for g in gone}
    if missing:
        raise click.ClickException(f"no trash entry {', '.join(sorted(missing))} (see: dnctl trash list)")
    emit(gone, as_json, "\n".join(f"purged {g['name']} on {g['node']}" for g in gone) or "nothing to purge")
