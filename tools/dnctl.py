"""`dnctl` -- the admin CLI: local clusters, partitions and their replicas, data, pools, nodes, benchmarks.

Presentation only: every action is a call into ``client/admin.py`` (partition membership, health, repair
and scrub passes, node queries) or ``tools/cluster.py`` (local processes); this file parses options,
renders the results (text with human units, or ``--json`` with raw numbers) and turns errors into one
line.  Each command is defined here exactly once; ``demo``, ``bench`` and ``trash`` come from their own
modules (tools/demo.py, tools/bench.py, tools/trash.py), which do not import this one.
"""
from __future__ import annotations

import functools
import pathlib
import sys

import click

from client import admin, mapadmin
from client.sdk import ClientError, DataClient, Location
from datanode.config import SyncMode
from wire.transport.base import TransportChoice
from wire.protocol import Op
from wire.limits import DEFAULT_REPLICAS, MAX_NODES, replicas_error
from tools import cluster as cl
from tools.bench import bench_command
from tools.clikit import (ADDR, ADDRS, CTX, Group, Login, ProgressLine, bar, cluster_nodes, cluster_option,
                          credentials, emit, etcd_access_options, etcd_map, etcd_option, etcd_url, fmt_bytes,
                          fmt_count, fmt_seconds, load_cluster, login, run, seeds, use_cluster_secret, version)
from tools.demo import demo_command
from tools.trash import trash_group
from tools.volume import VOLUME, volume_group

MiB = 1 << 20


def _secret_file(ctx, param, value):
    """--secret-file: loaded now (one clear line if unusable) into the command's Login, which every client it
    makes is given."""
    if value:
        from wire.auth import AuthConfigError
        try:
            ctx.ensure_object(Login).use_secret(value)
        except AuthConfigError as e:
            raise click.BadParameter(str(e)) from None
    return value


def _tls_ca(ctx, param, value):
    """--tls-ca: loaded now into the command's Login, as --secret-file."""
    if value:
        from wire.transport.tls import TlsConfigError
        try:
            ctx.ensure_object(Login).use_tls_ca(value)
        except TlsConfigError as e:
            raise click.BadParameter(str(e)) from None
    return value


@click.group(cls=Group, context_settings=CTX)
@click.version_option(version(), "--version", prog_name="dnctl")
@click.option("--tls-ca", type=click.Path(dir_okay=False), callback=_tls_ca, expose_value=False, is_eager=True,
              envvar="DATANODE_TLS_CA", show_envvar=True,
              help="CA bundle (PEM): speak TLS to the nodes and check their certificates against it.")
@click.option("--secret-file", type=click.Path(dir_okay=False), callback=_secret_file, expose_value=False,
              is_eager=True, envvar="DATANODE_SECRET_FILE", show_envvar=True,
              help="The cluster secret (or an admin/client role key file, or a volume key file: `dnctl volume "
                   "key`) to authenticate with, for nodes that have secret_file set; with the secret or an admin "
                   "key, etcd entries are sealed and checked with it too.")
@etcd_access_options
def main():
    """Administer datanodes: local clusters, partitions and their replicas, data, pools, benchmarks.

    \b
    Start a local 3-node cluster:  dnctl cluster up --nodes 3 --cluster /tmp/dn
    See it:                        dnctl cluster status --cluster /tmp/dn
    Store a file:                  dnctl put --cluster /tmp/dn --partition 1 FILE
    Read it back:                  dnctl get --cluster /tmp/dn --partition 1 --extent 1 --out OUT
    Write, read back, verify:      dnctl demo --cluster /tmp/dn --mib 300
    Measure:                       dnctl bench --cluster /tmp/dn --size 1MiB --clients 2
    Stop it:                       dnctl cluster down --cluster /tmp/dn

    Every command takes --help; most take --json for scripts (raw numbers; text shows human units).
    Errors are one line and exit status 1.  --cluster DIR is also spelled --dir DIR.
    """


def _where(fn):
    """--via ADDR / --cluster DIR: where to find a partition."""
    fn = cluster_option()(fn)
    return click.option("--via", type=ADDR, help="Any node that hosts the partition (HOST:PORT).")(fn)


def _change_text(res: dict) -> str:
    lines = [f"partition {res['id']}: epoch {res['old']['epoch']} -> {res['new']['epoch']}",
             f"  replicas before: {', '.join(res['old']['replicas'])}",
             f"  replicas now:    {', '.join(res['new']['replicas'])} (leader {res['new']['replicas'][0]})"]
    lines += [f"  {s['action']:6} {s['node']:22} {s['result']}" for s in res["steps"]]
    lines += [f"warning: {w}" for w in res["warnings"]]
    return "\n".join(lines)


def _warn(text: str) -> None:
    click.echo(f"warning: {text}", err=True)


# -- local clusters -----------------------------------------------------------------------------------
@main.group(context_settings=CTX)
def cluster():
    """Run a cluster of datanode processes on this machine (127.0.0.1).

    \b
    dnctl cluster up --nodes 3 --cluster /tmp/dn            # 3 nodes, partition 1 on all of them
    dnctl cluster up --cluster /tmp/dn --sync none --base-port 17310
    dnctl cluster status --cluster /tmp/dn [--json]         # pid, health, partitions of each node
    dnctl cluster add-node --cluster /tmp/dn                # one more node (for `dnctl replica add`)
    dnctl cluster stop-node ADDR --cluster /tmp/dn          # stop one node (it drains first)
    dnctl cluster start-node ADDR --cluster /tmp/dn         # start it again (same address and data)
    dnctl cluster restart-node ADDR --cluster /tmp/dn       # both
    dnctl cluster rolling-restart --cluster /tmp/dn         # every node, one by one, with no write error
    dnctl cluster down --cluster /tmp/dn                    # SIGTERM: each node drains, then exits

    The directory holds cluster.json and node1/, node2/, ... (node.toml, data/, node.log).  The nodes are
    detached: they keep running after dnctl exits.  `up` on a stopped cluster's directory starts the
    same nodes again (same addresses, data kept).  status/down follow each node's real process (the one
    listening on its address), also when it was restarted by hand.
    """


_start_timeout = click.option("--start-timeout", type=click.FloatRange(1, 3600), default=cl.START_TIMEOUT,
                              show_default=True, help="Seconds a node may take to start listening.")


@cluster.command("up")
@click.option("--nodes", "count", type=click.IntRange(1, MAX_NODES), default=3, show_default=True,
              help="How many datanodes (all on this host, each a process with its own pool).")
@cluster_option(required=True, help="Cluster directory (created if needed).")
@click.option("--base-port", type=click.IntRange(1, 65535),
              help="Node i listens on BASE+i-1 (default: free ports picked at random).")
@click.option("--sync", type=click.Choice([m.value for m in SyncMode]), default="always", show_default=True,
              help="always: fdatasync before each ack; none: page cache only (faster, not durable).")
@click.option("--transport", type=click.Choice([m.value for m in TransportChoice]), default="auto", show_default=True,
              help="Data path: auto uses RDMA if a device works, else TCP.")
@click.option("--pool-mib", type=click.IntRange(8, 65536), default=128, show_default=True,
              help="Registered memory pool per node.")
@click.option("--replica-timeout", type=click.FloatRange(0.1, 600), default=5.0, show_default=True,
              help="Seconds a follower may take to ack a forwarded write.")
@click.option("--partition", "pid", type=click.IntRange(1), default=1, show_default=True,
              help=f"Id of the partition created on the first {DEFAULT_REPLICAS} nodes (all of them if fewer).")
@etcd_option
@click.option("--no-etcd", is_flag=True,
              help="No etcd and no manager: the map is what admins set (dnctl replica/partition commands).")
@click.option("--min-writable", type=click.IntRange(0), default=2, show_default=True,
              help="The manager keeps at least this many writable partitions (it creates more).")
@click.option("--insecure", is_flag=True,
              help="No cluster secret and no etcd authentication: anyone who reaches a node or etcd may read, "
                   "write and move data (for a throwaway cluster on a machine of your own).")
@click.option("--secret", is_flag=True, hidden=True)       # the default now; kept for scripts
@_start_timeout
@click.option("--json", "as_json", is_flag=True)
def cluster_up(count, cluster, base_port, sync, transport, pool_mib, replica_timeout, pid, etcd, no_etcd,
               min_writable, insecure, secret, start_timeout, as_json):
    """Start a local cluster: one etcd member, N datanodes (a partition on the first three, leader node1)
    and a cluster manager.

    \b
    Example:
      dnctl cluster up --nodes 3 --cluster /tmp/dn
      dnctl put --cluster /tmp/dn --partition 1 /etc/services
      dnctl put --cluster /tmp/dn /etc/services                 # the client picks a partition
      dnctl cluster up --nodes 3 --cluster /tmp/dn2 --etcd http://127.0.0.1:2379   # an existing etcd

    The etcd member keeps its data in DIR/etcd (its log: DIR/etcd/etcd.log); the manager (DIR/manager-m1.log)
    fails over dead leaders, re-replicates, keeps --min-writable partitions.  `cluster down` stops them all.

    \b
    Secure unless --insecure:
      DIR/cluster.secret   a new cluster secret (0600): nodes, the manager and every
                           `--cluster DIR` command authenticate with it, and the map's
                           entries in etcd carry its MAC
      DIR/etcd-pki/        the etcd CA and a client certificate per component and
                           per node: etcd takes no connection without one
      DIR/etcd-auth/       the etcd member's users (0600 each): authentication is on,
                           one user per component (manager, admin, mount) and per
                           node (node-HOST_PORT: writes its own registration only),
                           each allowed only its keys; root only for setting it up
    An existing etcd (--etcd URL) is used as it is: its authentication is yours to set up.
    """
    from datanode.config import ConfigError
    from tools import etcd_cluster as ec
    rootp = pathlib.Path(cluster)
    if etcd and no_etcd:
        raise click.UsageError("give --etcd URL or --no-etcd, not both")
    if insecure and secret:
        raise click.UsageError("give --insecure or --secret, not both")
    prev = cl.load(rootp) if (rootp / "cluster.json").exists() else None
    if prev is not None:
        running = [n["addr"] for n in prev["nodes"] if cl.node_process(n)[0] is not None]
        if running:
            raise click.ClickException(f"a cluster is already running in {rootp} ({', '.join(running)}); stop it "
                                       f"with: dnctl cluster down --cluster {rootp}")
        given = click.get_current_context().get_parameter_source("count") == click.core.ParameterSource.COMMANDLINE
        if given and count != len(prev["nodes"]):
            raise click.UsageError(f"{rootp} holds a stopped cluster of {len(prev['nodes'])} node(s), which "
                                   f"`cluster up` restarts as it was (same addresses, data kept): for {count} "
                                   f"nodes give another --cluster directory")
    etcd_rec, started_etcd = None, False
    try:
        if prev is not None:
            etcd_rec = prev.get("etcd")
            if etcd_rec and etcd_rec.get("managed") and cl.aux_process(etcd_rec, "etcd") is None:
                etcd_rec, started_etcd = ec.start_local_etcd(rootp, etcd_rec), True
        elif etcd:
            etcd_rec = {"url": etcd_url(etcd, None), "managed": False}
        elif not no_etcd:
            rootp.mkdir(parents=True, exist_ok=True)
            etcd_rec, started_etcd = ec.start_local_etcd(rootp, auth=not insecure), True
    except (RuntimeError, TimeoutError, FileNotFoundError, OSError) as e:
        raise click.ClickException(f"etcd: {e}") from None
    auth = pathlib.Path(etcd_rec["auth"]) if etcd_rec and etcd_rec.get("auth") else None
    extra = {"etcd": etcd_rec["url"]} if etcd_rec and prev is None else {}
    if prev is None and not insecure:
        extra["secret_file"] = cl.cluster_secret(rootp)
    if prev is None and auth is not None and not etcd_rec.get("per_node"):
        extra["etcd_credentials"] = str(auth / "datanode")
    try:
        info = cl.up(rootp, count, base_port, sync=sync, transport=transport, pool_mib=pool_mib,
                     replica_timeout=replica_timeout, start_timeout=start_timeout,
                     etcd_rec=etcd_rec if prev is None else None,
                     provision=functools.partial(ec.node_access, etcd_rec) if etcd_rec else None, **extra)
    except (RuntimeError, TimeoutError, ValueError, ConfigError, OSError) as e:
        if started_etcd:
            cl.stop_aux({"etcd": etcd_rec}, "etcd")
        raise click.ClickException(str(e)) from None
    addrs = [n["addr"] for n in info["nodes"]]
    use_cluster_secret(info)

    async def go():
        async with DataClient.from_env(timeout=10, **credentials()) as dc:
            part = None
            if not info.get("restarted"):
                part = await admin.create_partition(dc, pid, addrs[:DEFAULT_REPLICAS])
            return part, await admin.node_status(dc, addrs[0]), await admin.partition_list(dc, addrs[0])

    try:
        part, status, parts = run(go)
        if etcd_rec:
            info["etcd"] = etcd_rec
            live = [m for m in info.get("managers", []) if cl.aux_process(m, "manager") is not None]
            opts = (info.get("managers") or [{}])[0].get("opts") or {"min_writable": min_writable}
            opts = {**opts, **login().paths()}       # the manager authenticates as this command does
            if auth is not None or etcd_rec.get("pki"):
                opts.update(cl.local_access_options(etcd_rec, "manager"))    # its own etcd user and certificate
                if auth is not None and (auth / ec.MAINTENANCE).exists():     # and the user that may defragment
                    opts["etcd_maintenance_credentials"] = str(auth / ec.MAINTENANCE)
            info["managers"] = live or [ec.start_manager(rootp, etcd_rec["url"], "m1", **opts)]
            cl.save(rootp, info)
    except (click.ClickException, RuntimeError) as e:
        if not info.get("restarted"):
            cl.save(rootp, {**info, **({"etcd": etcd_rec} if etcd_rec else {})})
            cl.down(rootp)
        raise click.ClickException(f"{getattr(e, 'message', e)} (cluster stopped again)") from None
    transport_used = ("verbs (RDMA device %s)" % status["rdma_device"]) if status.get("rdma_device") else (
        "tcp" if transport == "tcp" else "tcp (no RDMA device)")
    res = {"dir": str(rootp.resolve()), "nodes": info["nodes"], "config": info.get("config", {}),
           "etcd": info.get("etcd"), "managers": info.get("managers", []),
           "restarted": bool(info.get("restarted")), "transport": transport_used,
           "partitions": [{"id": p["id"], "replicas": p["replicas"], "epoch": p["epoch"]} for p in parts]}
    d = res["dir"]
    cfg = info.get("config", {})
    lines = [("restarted the stopped cluster (same addresses, data kept) in " if info.get("restarted")
              else f"{len(addrs)} datanode(s) up in ") + d
             + f"  [sync {cfg.get('sync')}, transport {transport_used}, pool {cfg.get('pool_mib')} MiB]"]
    if info.get("etcd"):
        e = info["etcd"]
        lines.append(f"  etcd   {e['url']:21}  " + (f"pid {e['pid']:<7}  log {e['log']}" if e.get("managed")
                                                    else "(existing, not managed here)"))
    for m in info.get("managers", []):
        lines.append(f"  manager {m['name']:20}  pid {m['pid']:<7}  log {m['log']}")
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
              f"  dnctl demo --cluster {d} --mib 300",
              f"  dnctl cluster status --cluster {d}",
              f"  dnctl cluster down --cluster {d}"]
    if cfg.get("secret_file"):
        lines.append(f"  export DATANODE_SECRET_FILE={cfg['secret_file']}   # for commands that name a node "
                     f"instead of --cluster")
    emit(res, as_json, "\n".join(lines))


def _stop_line(r: dict) -> str:
    extra = f" in {r['seconds']}s" if "seconds" in r else ""
    return (f"{r['addr']:21} pid {r['pid'] if r['pid'] is not None else '-':<7} {r['result']}{extra}"
            + (f"  ({r['note']})" if r.get("note") else "")
            + (f"  (log: {r['log_tail']})" if r.get("log_tail") else ""))


@cluster.command("down")
@cluster_option(required=True)
@click.option("--timeout", type=click.FloatRange(0.1, 600), default=30.0, show_default=True,
              help="Seconds each node may take to drain before it is killed.")
@click.option("--json", "as_json", is_flag=True)
def cluster_down(cluster, timeout, as_json):
    """Stop the cluster's nodes: SIGTERM (in-flight requests drain), SIGKILL after --timeout.

    Each node is found by the process listening on its address (also one restarted by hand); a pid in
    cluster.json that now belongs to another process is never signalled.  Data stays in the directory;
    `dnctl cluster up --cluster DIR` starts the same nodes again.

    If DIR (or its cluster.json) was removed while the cluster ran, its processes are still found and
    stopped: datanodes started with a config in DIR, an etcd member with its data in DIR, and the managers
    that follow it.
    """
    if not (pathlib.Path(cluster) / "cluster.json").exists():
        stray = cl.stop_strays(pathlib.Path(cluster), timeout)     # its directory was removed under it
        if stray:
            emit(stray, as_json, "\n".join(f"{r['kind']:9} pid {r['pid']:<7} {r['result']}  ({r['what']}; "
                                           f"{cluster} has no cluster.json)" for r in stray))
            if any(r["result"].startswith("killed") for r in stray):
                sys.exit(1)
            return
    load_cluster(cluster)
    aux: list = []
    res = cl.down(pathlib.Path(cluster), timeout, aux)
    lines = [_stop_line(r) for r in res]
    lines += [f"{a['kind'] + ' ' + a['name']:21} pid {a['pid'] if a['pid'] is not None else '-':<7} {a['result']}"
              for a in aux]
    emit(res, as_json, "\n".join(lines))
    if any(r["result"].startswith("killed") for r in res):
        sys.exit(1)


@cluster.command("add-node")
@cluster_option(required=True)
@click.option("--port", type=click.IntRange(1, 65535), help="Port to listen on (default: a free one).")
@_start_timeout
@click.option("--json", "as_json", is_flag=True)
def cluster_add_node(cluster, port, start_timeout, as_json):
    """Start one more datanode in the cluster (same config, no partitions yet).

    \b
    dnctl cluster add-node --cluster /tmp/dn
    dnctl replica add --id 1 --node ADDR --cluster /tmp/dn
    """
    from datanode.config import ConfigError
    load_cluster(cluster)
    try:
        from tools import etcd_cluster as ec
        etcd_rec = cl.load(pathlib.Path(cluster)).get("etcd")
        rec = cl.add_node(pathlib.Path(cluster), port, start_timeout,
                          provision=functools.partial(ec.node_access, etcd_rec) if etcd_rec else None)
    except (RuntimeError, TimeoutError, ValueError, ConfigError, OSError) as e:
        raise click.ClickException(str(e)) from None
    emit(rec, as_json, f"{rec['addr']} up (pid {rec['pid']}, log {rec['log']}); add it to a partition with:\n"
                       f"  dnctl replica add --id 1 --node {rec['addr']} --cluster {cluster}")


@cluster.command("stop-node")
@click.argument("addr", type=ADDR)
@cluster_option(required=True)
@click.option("--timeout", type=click.FloatRange(0.1, 600), default=30.0, show_default=True,
              help="Seconds the node may take to drain before it is killed.")
@click.option("--json", "as_json", is_flag=True)
def cluster_stop_node(addr, cluster, timeout, as_json):
    """Stop one node of the cluster (SIGTERM: it drains; SIGKILL after --timeout).  Its data stays."""
    load_cluster(cluster)
    try:
        rec = cl.stop_node(pathlib.Path(cluster), addr, timeout)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    emit(rec, as_json, _stop_line(rec))


@cluster.command("start-node")
@click.argument("addr", type=ADDR)
@cluster_option(required=True)
@_start_timeout
@click.option("--json", "as_json", is_flag=True)
def cluster_start_node(addr, cluster, start_timeout, as_json):
    """Start one stopped node of the cluster again (same address, config and data)."""
    from datanode.config import ConfigError
    load_cluster(cluster)
    try:
        rec = cl.start_node(pathlib.Path(cluster), addr, start_timeout)
    except (RuntimeError, TimeoutError, ValueError, ConfigError, OSError) as e:
        raise click.ClickException(str(e)) from None
    emit(rec, as_json, f"{addr} started (pid {rec['pid']}, log {rec['log']})")


@cluster.command("restart-node")
@click.argument("addr", type=ADDR)
@cluster_option(required=True)
@click.option("--timeout", type=click.FloatRange(0.1, 600), default=30.0, show_default=True,
              help="Seconds the node may take to drain before it is killed.")
@_start_timeout
@click.option("--json", "as_json", is_flag=True)
def cluster_restart_node(addr, cluster, timeout, start_timeout, as_json):
    """Stop one node of the cluster (it drains) and start it again (same address, config and data)."""
    from datanode.config import ConfigError
    load_cluster(cluster)
    root = pathlib.Path(cluster)
    try:
        stopped = cl.stop_node(root, addr, timeout)
        rec = cl.start_node(root, addr, start_timeout)
    except (RuntimeError, TimeoutError, ValueError, ConfigError, OSError) as e:
        raise click.ClickException(str(e)) from None
    rec["stopped"] = stopped
    emit(rec, as_json, _stop_line(stopped) + f"\n{addr} started (pid {rec['pid']}, log {rec['log']})")


@cluster.command("rolling-restart")
@cluster_option(required=True)
@click.option("--timeout", type=click.FloatRange(1, 3600), default=60.0, show_default=True,
              help="Seconds each node may take to stop (hand-off and drain) before it is killed, which stops "
                   "the rolling restart.")
@_start_timeout
@click.option("--sync-timeout", type=click.FloatRange(1), default=600.0, show_default=True,
              help="Seconds to wait, after a node is back, for every partition to be in sync again.")
@click.option("--quiet", "-q", is_flag=True, help="No progress lines on stderr.")
@click.option("--json", "as_json", is_flag=True, help="Per node: pids, seconds to stop, start, get in sync.")
def cluster_rolling_restart(cluster, timeout, start_timeout, sync_timeout, quiet, as_json):
    """Restart every node of the cluster, one at a time, with no error for the applications writing to it.

    \b
    dnctl cluster rolling-restart --cluster /tmp/dn
    dnctl cluster rolling-restart --cluster /tmp/dn --json > restart.json

    Each node gets SIGTERM: it hands its partitions to their other replicas through the manager (writes
    move to the new leaders at once), finishes its requests, leaves etcd and exits.  It is started again
    (same address, config, data); the next node goes only once it is serving, registered, and every
    partition is back in sync (the manager refills the partitions it left: `dnctl partition list` shows
    them writable).  It starts only from a settled cluster, and stops at the first node that does not stop,
    come back or get back in sync, saying which and why (exit status 1; the nodes after it are untouched).
    Without etcd (--no-etcd clusters) nothing can be handed off: writes to a node's partitions wait while
    it restarts.
    """
    info = load_cluster(cluster)
    total = len(info["nodes"])
    if not info.get("etcd") and not quiet:
        _warn("this cluster has no etcd (--no-etcd): nothing can be handed off; the writes to each node's "
              "partitions wait while it restarts")
    line = None             # the "syncing" line, rewritten in place on a terminal; each other step: a line

    def progress(p):
        nonlocal line
        if quiet:
            return
        head = f"[{p['index']}/{p['of']}] {p['addr']}"
        if p["step"] == "syncing":
            line = line or ProgressLine()
            line.update(f"{head} syncing for {fmt_seconds(p['seconds'])}: " + "; ".join(p["pending"][:3]))
            return
        if line is not None:
            line.close()
            line = None
        click.echo(f"{head} " + {"stopping": "stopping (hand-off, drain)",
                                 "stopped": f"stopped in {fmt_seconds(p.get('seconds'))}",
                                 "started": f"started again (pid {p.get('pid')}) in {fmt_seconds(p.get('seconds'))}",
                                 "in sync": f"back in sync in {fmt_seconds(p.get('seconds'))}"}[p["step"]], err=True)

    try:
        done = cl.rolling_restart(pathlib.Path(cluster), timeout=timeout, start_timeout=start_timeout,
                                  sync_timeout=sync_timeout, on_progress=progress)
    except cl.RolloutError as e:
        if line is not None:
            line.close()
        if as_json:
            emit({"nodes": e.done, "restarted": len([r for r in e.done if "sync_s" in r]), "of": total,
                  "error": str(e)}, True)
            click.echo(f"Error: {e}", err=True)
            sys.exit(1)
        raise click.ClickException(str(e)) from None
    text = "\n".join(f"{r['addr']:21} pid {r['old_pid']} -> {r['pid']}: stopped in {fmt_seconds(r['stop_s'])}, "
                     f"serving in {fmt_seconds(r['start_s'])}, in sync in {fmt_seconds(r['sync_s'])}" for r in done)
    emit({"nodes": done, "restarted": len(done), "of": total}, as_json,
         text + f"\nall {total} node(s) restarted, one at a time")


@cluster.command("status")
@cluster_option(required=True)
@click.option("--timeout", type=click.FloatRange(0.1, 60), default=2.0, show_default=True,
              help="Seconds a node has to answer NODE_STATUS.")
@click.option("--json", "as_json", is_flag=True)
def cluster_status(cluster, timeout, as_json):
    """Each node's address, pid and health; exit status 1 if any node is not healthy.

    \b
    health: up            process alive and answers NODE_STATUS within --timeout
            not answering process alive but no answer (starting? stopped? overloaded?)
            down          no datanode process for this node

    The pid is that of the process listening on the node's address (also one started by hand), not
    only the one cluster.json recorded.  With etcd: how many partitions are under-replicated (fewer live,
    synced replicas than their replica count) and the oldest of them (the longest unchanged in etcd).
    """
    import trio
    info = load_cluster(cluster)
    procs = cl.status_pids(pathlib.Path(cluster))

    async def probe(dc, n, out):
        rec = {"addr": n["addr"], "pid": n["pid"], "alive": n["pid"] is not None, "health": "down"}
        if n["note"] and n["note"] != "no process":
            rec["note"] = n["note"]
        out.append(rec)
        if not rec["alive"]:
            return
        rec["health"] = "not answering"
        with trio.move_on_after(timeout):
            try:
                st = await admin.node_status(dc, n["addr"])
                parts = await admin.partition_list(dc, n["addr"])
            except ClientError as e:
                rec["error"] = admin.why(e, n["addr"])
                return
            rec.update(health="up", uptime_s=st["uptime_s"], inflight=st["inflight"], sync=st["sync"],
                       transport=st["transport"], rdma_device=st["rdma_device"], draining=st["draining"],
                       connections=len(st["connections"]),
                       partitions=[{"id": p["id"], "role": p["role"], "epoch": p["epoch"],
                                    "extents": p["extents"], "bytes": p["bytes"], "replicas": p["replicas"],
                                    "state": admin.partition_state(p)} for p in parts])
            if "state" in st:
                rec["state"] = st["state"]
            if st.get("data_dir_lost"):          # up, but refusing writes: its directory is not the one it opened
                rec.update(health="data dir lost", error=st["data_dir_lost"])
        if rec["health"] != "up" and "error" not in rec:
            rec["error"] = f"no answer within {timeout:g}s"

    async def go():
        out: list = []
        async with DataClient.from_env(timeout=timeout, **credentials()) as dc:
            for n in procs:      # one at a time: a hung node costs --timeout, not the others' answers
                await probe(dc, n, out)
        return out

    res = run(go)
    etcd_st, mgr_st = _aux_status(info, timeout)
    lines = []
    for e in etcd_st:
        lines.append(f"etcd   {e['url']:21} {e['pid'] if e['pid'] is not None else '-':>7}  {e['health']:13}"
                     + ("" if e["managed"] else "  (existing etcd, not managed here)"))
    for m in mgr_st:
        lines.append(f"manager {m['name']:20} {m['pid'] if m['pid'] is not None else '-':>7}  {m['health']:13}")
    lines.append(f"{'node':6} {'address':21} {'pid':>7}  {'health':13} {'uptime':>8}  partitions")
    for i, r in enumerate(res, 1):
        parts = ", ".join(f"{p['id']} ({p['role']}, {p['state']}, epoch {p['epoch']}, {p['extents']} extents, "
                          f"{fmt_bytes(p['bytes'])})" for p in r.get("partitions", [])) or "-"
        up = fmt_seconds(r["uptime_s"]) if "uptime_s" in r else "-"
        pid = r["pid"] if r["pid"] is not None else "-"
        lines.append(f"node{i:<2} {r['addr']:21} {pid:>7}  {r['health']:13} {up:>8}  "
                     + (parts if r["health"] == "up" else r.get("error", "")))
        if r.get("note"):
            lines.append(f"       note: {r['note']}")
    healthy = (all(r["health"] == "up" for r in res) and all(e["health"] == "up" for e in etcd_st)
               and (not mgr_st or any(m["health"] in ("active", "standby") for m in mgr_st)))
    lines.append(f"{sum(r['health'] == 'up' for r in res)}/{len(res)} nodes up")
    under = _under_replicated(info, etcd_st)
    if under is not None:
        o = under["oldest"]
        lines.append(f"{under['count']}/{under['of']} partitions under-replicated" + (
            f" (oldest: partition {o['id']}, {o['live_synced']} of {o['want']} replicas live and synced, "
            f"{o['state']}, epoch {o['epoch']}; dnmanager's metrics say for how long)" if o else ""))
    emit({"dir": str(pathlib.Path(cluster).resolve()), "healthy": healthy, "nodes": res, "etcd": etcd_st,
          "managers": mgr_st, "under_replicated": under}, as_json, "\n".join(lines))
    if not healthy:
        sys.exit(1)


def _under_replicated(info: dict, etcd_st: list[dict]) -> dict | None:
    """The partitions below their replica count, from etcd's map (client/mapadmin.py); None without an etcd
    that answers."""
    e = info.get("etcd")
    if not e or not any(r["health"] == "up" for r in etcd_st):
        return None

    async def ask():
        return await mapadmin.under_replicated(etcd_map(e["url"], None))
    try:
        return run(ask)
    except click.ClickException:
        return None


def _aux_status(info: dict, timeout: float) -> tuple[list[dict], list[dict]]:
    """The cluster directory's etcd member(s) and manager(s): pid, and health (etcd: up / down / not
    answering; manager: active / standby / down)."""
    import json as _json
    import urllib.request
    e = info.get("etcd")
    if not e:
        return [], []
    etcd_st = []
    active = None
    ctx = None
    if "https://" in e["url"]:          # the admin's CA and, where the member requires one, its certificate
        import ssl
        acc = login().etcd
        ctx = ssl.create_default_context(cafile=acc.ca or None)
        if acc.cert:
            ctx.load_cert_chain(acc.cert, acc.key)
    for url in e["url"].split(","):
        pid = cl.aux_process(e, "etcd") if e.get("managed") else None
        rec = {"url": url, "pid": pid, "managed": bool(e.get("managed")), "dir": e.get("dir"), "health": "down"}
        try:
            with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=timeout, context=ctx) as r:
                rec["health"] = "up" if _json.loads(r.read()).get("health") in ("true", True) else "not healthy"
        except (OSError, ValueError):
            rec["health"] = "not answering" if pid is not None else "down"
        etcd_st.append(rec)
    if any(r["health"] == "up" for r in etcd_st):
        async def who():
            return (await mapadmin.map_snapshot(etcd_map(e["url"], None)))["manager"]
        try:
            active = run(who)
        except click.ClickException:
            active = None
    mgr_st = []
    for m in info.get("managers", []):
        pid = cl.aux_process(m, "manager")
        health = "down" if pid is None else (
            "active" if active and active.startswith(f"{m['name']}@") and active.endswith(f":{pid}") else "standby")
        mgr_st.append({"name": m["name"], "pid": pid, "health": health, "log": m.get("log")})
    return etcd_st, mgr_st


# -- etcd ---------------------------------------------------------------------------------------------
@main.group(context_settings=CTX)
def etcd():
    """The cluster's etcd: its users and certificates.

    \b
    dnctl etcd issue --pki /root/etcd-ca --new-ca --server 10.0.0.1 server
    dnctl etcd setup-auth --etcd https://10.0.0.1:2379 --etcd-ca ca.pem --out /etc/datanode/etcd-auth
    dnctl etcd add-node 10.0.0.5:17310 --etcd https://10.0.0.1:2379 --out /etc/datanode/etcd-auth
    """


@etcd.command("setup-auth")
@etcd_option
@click.option("--prefix", default="/datanode", show_default=True, help="The cluster's key prefix in etcd.")
@click.option("--out", type=click.Path(file_okay=False), required=True,
              help="Directory for the users' credentials (made 0700; one USER:PASSWORD file each, 0600).")
@click.option("--maintenance", is_flag=True,
              help="Also a user with etcd's root role for dnmanager --etcd-maintenance-credentials, so the "
                   "active manager can defragment the members (etcd allows it to no lesser role).")
@click.option("--json", "as_json", is_flag=True)
def etcd_setup_auth(etcd, prefix, out, maintenance, as_json):
    """Turn etcd's authentication on for a cluster: one etcd user and role per component, each allowed only
    its keys under --prefix, and the root user (for this setup only; keep its file offline).

    \b
      datanode   reads partition views, writes its registration   node.toml: etcd_credentials
      manager    reads the map, writes views and its election key  dnmanager --etcd-credentials
      admin      reads the map, writes requests and drain marks   dnctl --etcd-credentials
      mount      reads views and registrations, dnfs metadata     dnfs --etcd-credentials, the SDK
      maintenance  (--maintenance) etcd's root role, to defragment   dnmanager --etcd-maintenance-credentials
    Copy each file to the hosts of its component only.  On an etcd whose authentication is on already
    (another cluster's), give its root user: dnctl --etcd-credentials ROOT_FILE etcd setup-auth ...
    Example:
      dnctl --etcd-ca ca.pem etcd setup-auth --etcd https://10.0.0.1:2379 --out ./etcd-auth
    """
    from tools import etcd_cluster as ec
    url = etcd_url(etcd, None, what="etcd setup-auth")
    lg = login()
    try:
        paths = ec.setup_auth(url, pathlib.Path(out), prefix, access=lg.etcd, maintenance=maintenance)
    except (RuntimeError, OSError) as e:
        raise click.ClickException(str(e)) from None
    emit(paths, as_json, "\n".join(f"{who:9} {path}" for who, path in paths.items())
         + f"\netcd {url}: authentication on; prefix {prefix}")


@etcd.command("add-node")
@click.argument("addr", metavar="HOST:PORT")
@etcd_option
@click.option("--prefix", default="/datanode", show_default=True, help="The cluster's key prefix in etcd.")
@click.option("--out", type=click.Path(file_okay=False), required=True,
              help="Directory for the node user's credentials (made 0700; its USER:PASSWORD file 0600).")
@click.option("--json", "as_json", is_flag=True)
def etcd_add_node(addr, etcd, prefix, out, as_json):
    """Give the datanode listening at HOST:PORT an etcd user of its own (through etcd's root user): it reads
    what every datanode reads and writes only its own registration and hand-off request, so a compromised
    node cannot unregister or impersonate the others.  Put the file in its node.toml (etcd_credentials).

    
    Example:
      dnctl --etcd-credentials root --etcd-ca ca.pem --etcd-cert root.pem --etcd-key root.key \\
          etcd add-node 10.0.0.5:17310 --etcd https://10.0.0.1:2379 --out ./etcd-auth
    When every node runs with its own user, take the shared datanode user's writes away:
    `dnctl etcd lock-node-role` (docs/operations.md, "etcd: certificates and users").
    """
    from tools import etcd_cluster as ec
    url = etcd_url(etcd, None, what="etcd add-node")
    try:
        path = ec.add_node_user(url, pathlib.Path(out), addr, prefix, access=login().etcd)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="HOST:PORT") from None
    except (RuntimeError, OSError) as e:
        raise click.ClickException(str(e)) from None
    emit({"addr": addr, "user": ec.node_user(addr, prefix), "credentials": path}, as_json,
         f"{addr}: etcd user {ec.node_user(addr, prefix)}, credentials {path}")


@etcd.command("lock-node-role")
@etcd_option
@click.option("--prefix", default="/datanode", show_default=True, help="The cluster's key prefix in etcd.")
def etcd_lock_node_role(etcd, prefix):
    """The shared datanode role may no longer write registrations or hand-off requests (it keeps its reads):
    the last step of moving a cluster to a user per node (`dnctl etcd add-node`), once every node runs with
    its own.  Needs etcd's root user."""
    from tools import etcd_cluster as ec
    url = etcd_url(etcd, None, what="etcd lock-node-role")
    try:
        ec.lock_shared_node_role(url, prefix, access=login().etcd)
    except (RuntimeError, OSError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"etcd {url}: the shared role {ec.user_name('datanode', prefix)} now only reads")


@etcd.command("issue")
@click.argument("name")
@click.option("--pki", type=click.Path(file_okay=False), required=True,
              help="The CA's directory (ca.pem, ca.key; made 0700); the certificate and key go there too.")
@click.option("--new-ca", is_flag=True, help="Make the CA first (an existing one is kept).")
@click.option("--server", "hosts", metavar="HOST[,HOST...]",
              help="A member's server certificate for these IP addresses / names (also a client one, as etcd's "
                   "gateway needs), instead of a client certificate.")
@click.option("--json", "as_json", is_flag=True)
def etcd_issue(name, pki, new_ca, hosts, as_json):
    """Issue NAME.pem and NAME.key from the cluster's etcd CA: a client certificate (no Common Name: etcd's
    gateway refuses one that has a name while its users are on) for a component or a node, or with --server
    the members' certificate.  Give each component its own; etcd then takes no connection without one
    (etcd --client-cert-auth --trusted-ca-file ca.pem; docs/operations.md).

    
    Example:
      dnctl etcd issue --pki /root/etcd-ca --new-ca --server 10.0.0.1,10.0.0.2,10.0.0.3 server
      dnctl etcd issue --pki /root/etcd-ca node-10.0.0.5_17310
    """
    from tools import etcd_pki
    d = pathlib.Path(pki)
    try:
        if new_ca:
            etcd_pki.make_ca(d)
        cert, key = etcd_pki.issue(d, name, hosts=tuple(h.strip() for h in hosts.split(",") if h.strip())
                                   if hosts else ())
    except (ValueError, OSError) as e:
        raise click.ClickException(str(e)) from None
    emit({"ca": str((d / "ca.pem").resolve()), "cert": cert, "key": key}, as_json,
         f"certificate {cert}\nkey         {key}\nCA          {(d / 'ca.pem').resolve()}")


# -- partitions ---------------------------------------------------------------------------------------
@main.group(context_settings=CTX)
def partition():
    """Create, list, show and delete data partitions; change their leader; health, scrub.

    \b
    dnctl partition create --id 2 --replicas 127.0.0.1:17310,127.0.0.1:17311
    dnctl partition create --count 2 --replicas 3 --volume photos --cluster /tmp/dn
    dnctl partition list 127.0.0.1:17310
    dnctl partition show --id 2 127.0.0.1:17311
    dnctl partition health --id 2 --via 127.0.0.1:17310      # the leader's view of every replica
    dnctl partition scrub  --id 2 --via 127.0.0.1:17310      # re-read every block on every replica
    dnctl partition set-leader --id 2 127.0.0.1:17311        # also when the old leader is dead
    dnctl partition sync --id 2 --via 127.0.0.1:17310        # push the leader's view to lagging replicas
    dnctl partition delete --id 2 --replicas 127.0.0.1:17310,127.0.0.1:17311
    Replicas are added, removed and repaired with `dnctl replica`.
    """


@partition.command("create")
@click.option("--id", "pid", type=click.IntRange(1), help="Partition id (with a HOST:PORT list).")
@click.option("--replicas", required=True, metavar="N | HOST:PORT,...",
              help="A replica count (the manager places them: needs etcd) or a HOST:PORT list, leader first.")
@click.option("--count", type=click.IntRange(1, 1000), help="How many partitions the manager places (default 1).")
@click.option("--volume", type=VOLUME, help="The volume the partitions belong to (fixed for their life): a "
                                            "volume key for it reaches them, and no other partition.")
@etcd_option
@cluster_option()
@click.option("--timeout", type=click.FloatRange(1), default=60, show_default=True,
              help="Seconds to wait for the manager's answer.")
@click.option("--json", "as_json", is_flag=True)
def partition_create(pid, replicas, count, volume, etcd, cluster, timeout, as_json):
    """Create partitions: placed by the manager, or on the replicas you name.

    
    dnctl partition create --count 4 --replicas 3 --cluster /tmp/dn     # the manager places them
    dnctl partition create --count 4 --replicas 3 --etcd http://10.0.0.1:2379
    dnctl partition create --id 2 --replicas 127.0.0.1:17310,127.0.0.1:17311
    dnctl partition create --count 2 --replicas 3 --volume photos --cluster /tmp/dn

    Placed (a count): the active manager (dnmanager) picks the nodes -- never two replicas of a
    partition on one node, replicas in different zones while there are enough, the nodes with the most
    free space first, leaders spread -- creates each partition on them and publishes it in etcd.
    Named (a list): created on every replica, all or nothing (undone everywhere if one node fails).
    """
    if replicas.strip().isdigit():
        n = int(replicas)
        if replicas_error(n):
            raise click.BadParameter(replicas_error(n), param_hint="--replicas")
        if pid is not None:
            raise click.UsageError("--id goes with a HOST:PORT list; with a replica count the manager picks ids")
        et = etcd_map(etcd, cluster, what="placing partitions (--replicas N)")

        async def place():
            return await mapadmin.place_partitions(et, count or 1, n, timeout=timeout, volume=volume or "")
        made = run(place)
        emit({"partitions": made, **({"volume": volume} if volume else {})}, as_json, "\n".join(
            f"partition {p['id']} created: replicas {','.join(p['replicas'])} (leader {p['leader']}, "
            f"epoch {p['epoch']}, {p['state']})" + (f" in volume {volume}" if volume else "") for p in made))
        return
    try:
        replicas = admin.parse_addrs(replicas)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--replicas") from None
    if pid is None:
        raise click.UsageError("--id is required with a HOST:PORT list (or give a replica count to let the "
                               "manager place it)")
    if count not in (None, 1):
        raise click.UsageError("--count goes with a replica count (--replicas 3), not with a HOST:PORT list")

    async def go():
        async with DataClient.from_env(**credentials()) as dc:
            return await admin.create_partition(dc, pid, replicas, volume=volume or "")
    res = run(go)
    emit(res, as_json, f"partition {pid} {'already exists' if res['existed'] else 'created'} on "
                       f"{', '.join(replicas)} (leader {replicas[0]}, epoch {res['epoch']})"
                       + (f" in volume {volume}" if volume else ""))


@partition.command("delete")
@click.option("--id", "pid", type=click.IntRange(1), required=True, help="Partition id.")
@click.option("--replicas", type=ADDRS, help="Comma-separated HOST:PORT list (default: the partition's replicas).")
@_where
@click.option("--json", "as_json", is_flag=True)
def partition_delete(pid, replicas, via, cluster, as_json):
    """Delete a partition from its replicas; each keeps its data in its trash for trash_retention_s (dnctl trash)."""
    where = None if replicas else seeds(via, cluster)

    async def go():
        async with DataClient.from_env(**credentials()) as dc:
            addrs = replicas or (await admin.current_view(dc, pid, where)).replicas
            return await admin.delete_partition(dc, pid, addrs)
    res = run(go)
    emit(res, as_json, "\n".join(f"{a:21} {r}" for a, r in res.items()))
    if any(r not in ("deleted", "not there") for r in res.values()):
        sys.exit(1)


@partition.command("set-leader")
@click.option("--id", "pid", type=click.IntRange(1), required=True, help="Partition id.")
@click.argument("addr", type=ADDR)
@_where
@click.option("--json", "as_json", is_flag=True)
def partition_set_leader(pid, addr, via, cluster, as_json):
    """Make replica ADDR the leader (moved to the front of the list, epoch + 1), also when the old
    leader is dead: the old leader is then fenced by the epoch, learns the new list from the new leader
    when it comes back, and is repaired as a follower.

    Clients re-read the partition map (their epoch is now stale); in-flight writes to the old leader may
    fail: retry them.
    """
    others = [a for a in (seeds(via, cluster) if (via or cluster) else []) if a != addr]

    async def go():
        async with DataClient.from_env(timeout=5, **credentials()) as dc:
            return await admin.set_leader(dc, pid, addr, others)
    res = run(go)
    if res.get("unchanged"):
        emit(res, as_json, f"{addr} already leads partition {pid} (epoch {res['epoch']})")
    else:
        emit(res, as_json, _change_text(res))


@partition.command("sync")
@click.option("--id", "pid", type=click.IntRange(1), required=True, help="Partition id.")
@_where
@click.option("--json", "as_json", is_flag=True)
def partition_sync(pid, via, cluster, as_json):
    """Send the leader's replica list and epoch to replicas that are behind (after a failed change)."""
    where = seeds(via, cluster)

    async def go():
        async with DataClient.from_env(**credentials()) as dc:
            return await admin.sync_partition(dc, pid, where)
    res = run(go)
    emit(res, as_json, f"partition {pid} epoch {res['epoch']} (leader {res['replicas'][0]})\n"
         + "\n".join(f"  {a:21} {r}" for a, r in res["nodes"].items()))
    if any(r.startswith(("failed", "disagrees")) for r in res["nodes"].values()):
        sys.exit(1)


def _replica_health(p: dict) -> str:
    """The followers' states from a PARTITION_LIST entry ("-" on a follower: the leader keeps them)."""
    fs = (p.get("health") or {}).get("followers") or {}
    if p.get("role") != "leader":
        return "(kept by the leader)"
    return ", ".join(f"{a} {s}" for a, s in fs.items()) or "no followers"


@partition.command("list")
@click.argument("addr", type=ADDR, required=False)
@etcd_option
@cluster_option()
@click.option("--json", "as_json", is_flag=True)
def partition_list(addr, etcd, cluster, as_json):
    """List partitions: the cluster's, from etcd (--cluster DIR or --etcd URL), or those a node hosts (ADDR).

    
    dnctl partition list --cluster /tmp/dn [--json]     # id, replicas, leader, epoch, state (etcd's map)
    dnctl partition list 127.0.0.1:17310                # role, state, epoch, size, follower health
    """
    if addr is None:
        et = etcd_map(etcd, cluster, what="partition list without ADDR")

        async def snap():
            return await mapadmin.map_snapshot(et)
        m = run(snap)
        rows = [{k: p[k] for k in ("id", "replicas", "leader", "epoch", "state", "want", "synced", "installed")}
                for p in m["partitions"]]
        lines = [f"{'id':>4} {'state':10} {'epoch':>5}  {'leader':21}  replicas"]
        lines += [f"{p['id']:>4} {p['state']:10} {p['epoch']:>5}  {p['leader']:21}  {','.join(p['replicas'])}"
                  + ("" if p["installed"] else "  (installing)") for p in rows]
        if not rows:
            lines.append("(no partitions in etcd yet)")
        lines.append(f"manager: {m['manager'] or 'none active'}; {len(m['nodes'])} node(s) registered"
                     + (f"; decommissioning: {', '.join(m['draining'])}" if m["draining"] else ""))
        if m["ignored"]:
            lines.append("warning: etcd entries ignored as invalid (not shown): " + ", ".join(
                f"{k} {v}" for k, v in sorted(m["ignored"].items())))
        emit(rows, as_json, "\n".join(lines))
        return
    if etcd or cluster:
        raise click.UsageError("give ADDR (a node's own list) or --cluster/--etcd (etcd's map), not both")

    async def go():
        async with DataClient.from_env(**credentials()) as dc:
            return await admin.partition_list(dc, addr)
    parts = run(go)
    lines = [f"{'id':>4} {'role':9} {'state':10} {'epoch':>5} {'extents':>7} {'size':>10} {'volume':12}  replicas  "
             f"[follower health]"]
    for p in parts:
        lines.append(f"{p['id']:>4} {p['role']:9} {admin.partition_state(p):10} {p['epoch']:>5} {p['extents']:>7} "
                     f"{fmt_bytes(p['bytes']):>10} {p.get('volume') or '-':12}  {','.join(p['replicas'])}  "
                     f"[{_replica_health(p)}]")
    if not parts:
        lines.append(f"(no partitions on {addr})")
    emit(parts, as_json, "\n".join(lines))


@partition.command("show")
@click.option("--id", "pid", type=click.IntRange(1), required=True, help="Partition id.")
@click.argument("addr", type=ADDR)
@click.option("--json", "as_json", is_flag=True)
def partition_show(pid, addr, as_json):
    """Show one partition as a node sees it: state, replicas and their health, epoch, extents and sizes."""
    async def go():
        async with DataClient.from_env(**credentials()) as dc:
            return await admin.partition_show(dc, addr, pid)
    p = run(go)
    h = p.get("health") or {}
    sizes = p.get("extent_sizes") or {}
    text = (f"partition {p['id']} on {addr}: {p['role']}, epoch {p['epoch']}, state {admin.partition_state(p)}\n"
            f"  replicas: {', '.join(p['replicas'])} (leader {p['replicas'][0]})\n"
            f"  volume: {p.get('volume') or '(none)'}\n"
            f"  follower health: {_replica_health(p)}"
            + (f"; {fmt_bytes(h['bytes_behind'])} behind" if h.get("bytes_behind") else "") + "\n"
            f"  extents: {p['extents']}, size: {fmt_bytes(p['bytes'])}\n"
            f"  sealed extents: {p['sealed_extents'] or 'none'}")
    if sizes:
        shown = list(sizes.items())[:20]
        text += "\n  extent sizes: " + ", ".join(f"{e}: {fmt_bytes(n)}" for e, n in shown) + (
            f" ... ({len(sizes) - len(shown)} more; --json has all)" if len(sizes) > len(shown) else "")
    emit(p, as_json, text)


def _health_text(h: dict) -> str:
    lines = [f"partition {h['id']} on {h['node']}: {h['role']}, epoch {h['epoch']}, leader {h['leader']}",
             f"  replicas: {', '.join(h['replicas'])}"]
    if "followers" not in h:
        lines.append(f"  {h.get('note', '')}")
        return "\n".join(lines)
    lines.append(f"  {'follower':21} {'state':11} {'last contact':>12} {'behind':>10} {'extents':>7}  error")
    for f in h["followers"]:
        age = f"{fmt_seconds(f['contact_age_s'])} ago" if f["contact_age_s"] is not None else "never"
        lines.append(f"  {f['addr']:21} {f['state']:11} {age:>12} {fmt_bytes(f['bytes_behind']):>10} "
                     f"{f['extents_behind']:>7}  {f['error'] or ''}")
    r, s = h["repair"], h["scrub"]
    cur = r["current"]
    lines.append(f"  repair: {'running' if r['running'] else 'idle'}, {r['passes']} passes, cap "
                 f"{r['cap_mib_s'] or 'none'} MiB/s"
                 + (f"; now {cur['addr']}: {fmt_bytes(cur['copied'])} of {fmt_bytes(cur['total'])} at "
                    f"{cur['rate_mib_s']} MiB/s" if cur else "")
                 + (f"; last: {fmt_bytes(r['last']['bytes_copied'])} in {fmt_seconds(r['last']['seconds'])}"
                    if r["last"] else ""))
    lines.append(f"  scrub: {'running' if s['running'] else 'idle'}, {s['passes']} passes"
                 + (f"; last: {s['last']['extents']} extents, {fmt_bytes(s['last']['bytes'])}, "
                    f"{s['last']['bad_blocks']} bad blocks, {s['last']['repaired']} repaired"
                    if s["last"] else ""))
    if h["sealed_extents"]:
        lines.append(f"  sealed extents: {h['sealed_extents']}")
    return "\n".join(lines)


@partition.command("health")
@click.option("--id", "pid", type=click.IntRange(1), required=True, help="Partition id.")
@_where
@click.option("--json", "as_json", is_flag=True)
def partition_health(pid, via, cluster, as_json):
    """The leader's view of each follower: state (healthy, lagging, repairing, unreachable), last
    contact, bytes behind; repair and scrub progress."""
    where = seeds(via, cluster)

    async def go():
        async with DataClient.from_env(timeout=5, **credentials()) as dc:
            return await admin.health(dc, await admin.find_leader(dc, pid, where), pid)
    h = run(go)
    emit(h, as_json, _health_text(h))


class _PassProgress:
    """Progress of a repair or scrub pass on stderr while dnctl waits for it.

    Repair: the leader's ``repair.current`` (bytes copied of total, rate, ETA).  Scrub: the bytes the
    replicas have checked since the pass was asked for (their ``scrub_bytes`` counters) of the partition's
    size times its replicas; a node that reports ``scrub.current`` itself is shown as it says."""

    def __init__(self, name: str, dc=None, view=None):
        self.name, self.dc, self.view = name, dc, view
        self.line = ProgressLine()
        self.t0 = None
        self.base: dict[str, int] = {}
        self.total = 0

    async def start(self, trio_now: float) -> None:
        self.t0 = trio_now
        if self.name != "scrub" or self.dc is None:
            return
        for a in self.view.replicas:
            self.base[a] = await self._scrubbed(a) or 0
        try:
            p = next(p for p in await admin.partition_list(self.dc, self.view.leader) if p["id"] == self.view.pid)
            self.total = p["bytes"] * len(self.view.replicas)
        except (ClientError, StopIteration):
            self.total = 0

    async def _scrubbed(self, addr: str) -> int | None:
        try:
            st = await admin.node_status(self.dc, addr)
        except ClientError:
            return None
        c = st.get("counters") or {}
        return c.get("scrub_bytes") if isinstance(c, dict) else None

    async def __call__(self, h: dict) -> None:
        import trio
        if self.t0 is None:
            self.t0 = trio.current_time()
        el = max(trio.current_time() - self.t0, 0.0)
        r, s = h.get("repair") or {}, h.get("scrub") or {}
        if self.name == "repair":
            cur = r.get("current")
            if cur:
                eta = f"{fmt_seconds(cur['eta_s'])}" if cur.get("eta_s") is not None else "?"
                self.line.update(f"{cur['addr']} repairing {bar(cur['copied'], max(cur['total'], 1))} "
                                 f"{fmt_bytes(cur['copied'])}/{fmt_bytes(cur['total'])} {cur['rate_mib_s']:.1f} "
                                 f"MiB/s ETA {eta}")
            else:
                states = ", ".join(f"{f['addr']} {f['state']}" for f in h.get("followers", []))
                self.line.update(f"repair {'running' if r.get('running') else 'waiting'} {fmt_seconds(el)}: "
                                 f"{states}")
            return
        cur = s.get("current")
        if cur and cur.get("total"):
            done, total = cur.get("checked", 0), cur["total"]
        else:
            done, total = 0, self.total
            for a, b in self.base.items():
                now = await self._scrubbed(a)
                if now is not None:
                    done += max(now - b, 0)
        if total:
            rate = done / MiB / el if el > 0 else 0.0
            self.line.update(f"scrub {bar(done, total)} {fmt_bytes(done)}/{fmt_bytes(total)} checked, "
                             f"{rate:.1f} MiB/s, {fmt_seconds(el)}")
        else:
            self.line.update(f"scrub {'running' if s.get('running') else 'waiting'} {fmt_seconds(el)}")

    def close(self) -> None:
        self.line.close()


def _run_pass(op: Op, name: str, pid, via, cluster, wait, timeout, as_json, quiet) -> None:
    """Ask the partition's leader for a repair or scrub pass; with --wait show progress until it settled."""
    where = seeds(via, cluster)
    key = f"{name}_pass"

    async def go():
        import trio
        async with DataClient.from_env(timeout=10, **credentials()) as dc:
            view = await admin.current_view(dc, pid, where)
            prog = _PassProgress(name, dc, view) if wait and not quiet else None
            if prog:
                await prog.start(trio.current_time())
            try:
                return await admin.run_pass(dc, op, pid, [view.leader], wait=wait, timeout=timeout,
                                            on_progress=prog)
            finally:
                if prog:
                    prog.close()
    h = run(go)
    if key in h:
        emit(h, as_json, f"{name} pass {h[key]} requested on leader {h['leader']}")
    else:
        emit(h, as_json, _health_text(h))


_pass_opts = [click.option("--timeout", type=click.FloatRange(1), default=600, show_default=True,
                           help="Seconds to wait for the pass."),
              click.option("--quiet", "-q", is_flag=True, help="No progress line on stderr."),
              click.option("--json", "as_json", is_flag=True)]


def _with_pass_opts(fn):
    for opt in reversed(_pass_opts):
        fn = opt(fn)
    return fn


@partition.command("scrub")
@click.option("--id", "pid", type=click.IntRange(1), required=True, help="Partition id.")
@_where
@click.option("--wait/--no-wait", default=True, show_default=True, help="Wait for the pass to finish.")
@_with_pass_opts
def partition_scrub(pid, via, cluster, wait, timeout, quiet, as_json):
    """Re-read every block on every replica now and check its CRC; bad blocks are refetched from a
    replica whose copy verifies (rate: the leader's scrub_mib_s).  Shows progress on stderr while it waits."""
    _run_pass(Op.SCRUB, "scrub", pid, via, cluster, wait, timeout, as_json, quiet)


# -- replicas -----------------------------------------------------------------------------------------
@main.group(context_settings=CTX)
def replica():
    """Add a node to a partition's replicas, remove one, or repair them now.

    \b
    dnctl replica add    --id 1 --node 127.0.0.1:17313 --cluster /tmp/dn   # waits until it is filled
    dnctl replica remove --id 1 --node 127.0.0.1:17312 --via 127.0.0.1:17310
    dnctl replica repair --id 1 --cluster /tmp/dn                         # a full repair pass now

    The current list and epoch are read from the partition's leader; the new list is installed at
    epoch + 1 on every member of the old and new lists (a new node gets the partition created first, a
    removed node has it deleted afterwards).  Clients re-read the partition map after a change.

    A new replica starts empty; the leader's repair (datanode/repair.py) fills it, and `replica add`
    waits for that with a progress line (bytes copied, rate, ETA) unless --no-wait.
    """


@replica.command("add")
@click.option("--id", "pid", type=click.IntRange(1), required=True, help="Partition id.")
@click.option("--node", "addr", type=ADDR, required=True, help="The node to add (HOST:PORT); it must be running.")
@_where
@click.option("--wait/--no-wait", default=True, show_default=True,
              help="Wait until repair made the new replica identical (progress on stderr).")
@click.option("--timeout", type=click.FloatRange(1), default=3600, show_default=True)
@click.option("--quiet", "-q", is_flag=True, help="No progress line on stderr.")
@click.option("--json", "as_json", is_flag=True)
def replica_add(pid, addr, via, cluster, wait, timeout, quiet, as_json):
    """Add NODE as the last replica of a partition (epoch + 1); the leader's repair fills it, and it is
    healthy only when identical.  Shows bytes copied, rate and ETA while waiting."""
    where = seeds(via, cluster)

    async def go():
        async with DataClient.from_env(timeout=10, **credentials()) as dc:
            prog = None if quiet else _PassProgress("repair")
            try:
                return await admin.add_replica(dc, pid, addr, where, wait=wait, timeout=timeout,
                                               on_progress=prog)
            finally:
                if prog:
                    prog.close()
    res = run(go)
    text = _change_text(res)
    if "repair" in res:
        r = res["repair"]
        text += (f"\n{addr} is {r['state']}: identical to the leader after {fmt_seconds(r['seconds'])} "
                 f"({fmt_bytes(r['bytes_copied'])} copied; the last repair pass ran at {r['mib_s']} MiB/s)")
    else:
        text += f"\nnote: {addr} is being filled by repair; see: dnctl partition health --id {pid}"
    emit(res, as_json, text)


@replica.command("remove")
@click.option("--id", "pid", type=click.IntRange(1), required=True, help="Partition id.")
@click.option("--node", "addr", type=ADDR, required=True, help="The replica to remove (HOST:PORT); may be down.")
@_where
@click.option("--json", "as_json", is_flag=True)
def replica_remove(pid, addr, via, cluster, as_json):
    """Remove NODE from a partition's replicas and delete the partition there (best effort if NODE is down).

    Removing the leader makes the next replica the leader.
    """
    where = seeds(via, cluster)

    async def go():
        async with DataClient.from_env(timeout=5, **credentials()) as dc:
            return await admin.remove_replica(dc, pid, addr, where, warn=_warn)
    res = run(go)
    emit(res, as_json, _change_text(res))


@replica.command("repair")
@click.option("--id", "pid", type=click.IntRange(1), required=True, help="Partition id.")
@_where
@click.option("--wait/--no-wait", default=True, show_default=True, help="Wait until every replica is healthy.")
@_with_pass_opts
def replica_repair(pid, via, cluster, wait, timeout, quiet, as_json):
    """A full repair pass now: compare sizes and block CRCs with every follower and copy, cut or
    delete what differs (the leader is authoritative).  Shows progress on stderr while it waits."""
    _run_pass(Op.REPAIR, "repair", pid, via, cluster, wait, timeout, as_json, quiet)


# -- data ---------------------------------------------------------------------------------------------
def _nodes(node, cluster):
    if bool(node) == bool(cluster):
        raise click.UsageError("give exactly one of --node ADDR or --cluster DIR")
    return [node] if node else cluster_nodes(cluster)


@main.command()
@click.option("--node", type=ADDR, help="A datanode HOST:PORT (its partition map is used).")
@cluster_option()
@etcd_option
@click.option("--partition", "pid", type=click.IntRange(1),
              help="Partition to write to (default: the client picks writable ones from etcd's map).")
@click.option("--timeout", type=click.FloatRange(1), default=30, show_default=True,
              help="Seconds the write may take, failing over to other partitions included.")
@click.argument("file", type=click.File("rb"))
@click.option("--json", "as_json", is_flag=True)
def put(node, cluster, etcd, pid, timeout, file, as_json):
    """Store FILE; prints where it went: partition, extent id, offset, size and CRC32C.

    The write goes to a partition's leader, which forwards it to every follower and answers only when
    all replicas have it.  Without --partition the client picks writable partitions from the cluster map
    in etcd and, if one fails (a replica died), writes the rest to another -- within --timeout.

    \b
    dnctl put --cluster /tmp/dn /etc/services
    dnctl put --cluster /tmp/dn --partition 1 /etc/services
    dnctl put --node 127.0.0.1:17310 --partition 1 --json big.bin
    dnctl put --etcd http://10.0.0.1:2379 --json big.bin
    """
    data = file.read()
    if pid is None:
        if node:
            raise click.UsageError("--node needs --partition; without it give --cluster DIR or --etcd URL")
        url = etcd_url(etcd, cluster, what="put without --partition")

        async def anywhere():
            async with DataClient.from_env(etcd=url, timeout=timeout, **credentials()) as dc:
                return await dc.put(data, timeout=timeout)
        locs = run(anywhere)
        out = {"size": len(data), "locations": [loc.to_dict() for loc in locs],
               "partitions": sorted({loc.partition for loc in locs})}
        text = "\n".join(f"partition {loc.partition} extent {loc.extent} offset {loc.offset} size {loc.length} "
                         f"crc32c {loc.crc:#010x}" for loc in _merge(locs)) or "empty file: nothing stored"
        emit(out, as_json, text)
        return
    nodes = _nodes(node, cluster)

    async def go():
        async with admin.open_client(nodes, from_env=True, **credentials()) as dc:
            return await dc.write(pid, data)
    locs = run(go)
    out = {"size": len(data), "locations": [loc.to_dict() for loc in locs]}
    text = "\n".join(f"extent {loc.extent} offset {loc.offset} size {loc.length} crc32c {loc.crc:#010x}"
                     for loc in _merge(locs)) or "empty file: nothing stored"
    emit(out, as_json, text)


def _merge(locs: list[Location]) -> list[Location]:
    """Adjacent pieces of one extent shown as one range (CRC of the whole range)."""
    from wire.crc import crc32c_combine
    out: list[Location] = []
    for loc in locs:
        if (out and out[-1].partition == loc.partition and out[-1].extent == loc.extent
                and out[-1].offset + out[-1].length == loc.offset):
            prev = out[-1]
            out[-1] = Location(prev.partition, prev.extent, prev.offset, prev.length + loc.length,
                               crc32c_combine(prev.crc, loc.crc, loc.length))
        else:
            out.append(loc)
    return out


@main.command()
@click.option("--node", type=ADDR, help="A datanode HOST:PORT (its partition map is used).")
@cluster_option()
@click.option("--partition", "pid", type=click.IntRange(1), required=True)
@click.option("--extent", type=click.IntRange(1), required=True)
@click.option("--offset", type=click.IntRange(0), default=0, show_default=True, help="First byte to read.")
@click.option("--length", type=click.IntRange(0), help="Bytes to read (default: to the end of the extent).")
@click.option("--replica", type=ADDR, help="Read from this replica HOST:PORT only.")
@click.option("--out", "out", type=click.File("wb"), required=True, help="Output file ('-' for stdout).")
@click.option("--json", "as_json", is_flag=True,
              help="Print what was read (bytes, CRC32C, range, replica) as JSON on stdout (needs --out FILE).")
def get(node, cluster, pid, extent, offset, length, replica, out, as_json):
    """Read an extent range (CRC-checked, failing over across replicas) into --out.

    \b
    dnctl get --cluster /tmp/dn --partition 1 --extent 1 --out copy.bin
    dnctl get --cluster /tmp/dn --partition 1 --extent 1 --replica 127.0.0.1:17312 --out -
    dnctl get --node 127.0.0.1:17310 --partition 1 --extent 1 --offset 4096 --length 100 --out -
    dnctl get --cluster /tmp/dn --partition 1 --extent 1 --out copy.bin --json
    """
    from wire.crc import crc32c
    to_stdout = out is sys.stdout.buffer or getattr(out, "name", "-") in ("-", "<stdout>")
    if as_json and to_stdout:
        raise click.UsageError("--json prints to stdout: give --out FILE for the data")
    nodes = _nodes(node, cluster)

    async def go():
        async with admin.open_client(nodes, from_env=True, **credentials()) as dc:
            return await admin.read_range(dc, pid, extent, offset, length, replica)
    data = run(go)
    out.write(data)
    info = {"partition": pid, "extent": extent, "offset": offset, "length": len(data), "crc32c": crc32c(data),
            "replica": replica, "out": getattr(out, "name", None)}
    if as_json:
        emit(info, True)
    elif not to_stdout:
        click.echo(f"{len(data)} bytes read from extent {extent} at offset {offset}"
                   + (f" on {replica}" if replica else "") + f" (crc32c {info['crc32c']:#010x})", err=True)


# -- pools and nodes ----------------------------------------------------------------------------------
@main.group(context_settings=CTX)
def pool():
    """Registered memory pools."""


@pool.command("stats")
@click.argument("addr", type=ADDR)
@click.option("--json", "as_json", is_flag=True)
def pool_stats(addr, as_json):
    """A node's pool: arena size, bytes in use, high-water mark, free blocks per order, waits."""
    async def go():
        async with DataClient.from_env(**credentials()) as dc:
            return await admin.pool_stats(dc, addr)
    s = run(go)
    free = ", ".join(f"{fmt_bytes(int(k))} x{v}" for k, v in sorted(s["free_blocks_per_order"].items(),
                                                                 key=lambda kv: int(kv[0])) if v)
    rkey = f", rkey {s['rkey']:#x}" if "rkey" in s else ""      # shown to admins only when auth is on
    text = (f"arena {fmt_bytes(s['arena_bytes'])} (one registration{rkey}), "
            f"max block {fmt_bytes(s['max_block'])}\n"
            f"in use {fmt_bytes(s['in_use_bytes'])}, high-water {fmt_bytes(s['high_water_bytes'])}, "
            f"live blocks {s['live_blocks']}\nallocs {fmt_count(s['allocs'])}, waits {s['waits']}, "
            f"timeouts {s['timeouts']}\nfree blocks: {free or 'none'}")
    emit(s, as_json, text)


@main.group(context_settings=CTX)
def node():
    """Datanodes."""


def _counter(c, key):
    v = c.get(key) if isinstance(c, dict) else None
    return v if isinstance(v, (int, float)) else None


def _status_text(s: dict) -> str:
    c = s.get("counters") or {}
    lines = [f"node {s['node']} pid {s['pid']} up {fmt_seconds(s['uptime_s'])}"
             + (f", {s['state']}" if s.get("state") else "") + (", DRAINING" if s.get("draining") else "")
             + (", DATA DIRECTORY LOST" if s.get("data_dir_lost") else "")
             + f"; configured transport {s['transport']}, sync {s['sync']}, rdma device "
             f"{s.get('rdma_device') or 'none'}"
             + (f" (memory windows {s['rdma_windows']})" if s.get("rdma_device") and s.get("rdma_windows") else ""),
             f"partitions {len(s['partitions']) if isinstance(s['partitions'], list) else s['partitions']}"
             + "".join(f", volume {v}: {','.join(map(str, ps))}" for v, ps in (s.get("volumes") or {}).items())
             + f", requests in flight {s['inflight']}"]
    if s.get("data_dir_lost"):
        lines.insert(1, s["data_dir_lost"])
    if "peers" in s:             # who may connect (a node of an older version does not say)
        lines.append(f"authentication {s.get('auth')}" + (f" (tls {s['tls']})" if s.get("tls") != "off" else "")
                     + f"; takes peers: {s['peers']}" + ("  !!! INSECURE" if s.get("insecure") else "")
                     + f"; connections: {s.get('client_connections', 0)} client "
                       f"({s.get('idle_client_connections', 0)} idle), "
                       f"{s.get('node_admin_connections', 0)} node/admin, "
                       f"{s.get('pending_connections', 0)} in their hello; {s.get('refused_connections', 0)} refused, "
                       f"{s.get('connections_closed_for_room', 0)} closed for room")
    o = s.get("opening") or {}
    if s.get("state") == "starting" and o:
        lines.append(f"opening ({o.get('verify')} check): partitions {o.get('partitions')}/"
                     f"{o.get('partitions_total')}, extents {fmt_count(o.get('extents'))}/"
                     f"{fmt_count(o.get('extents_total'))}, {fmt_bytes(o.get('bytes'))} of "
                     f"{fmt_bytes(o.get('bytes_total'))}, {fmt_seconds(o.get('seconds') or 0)} so far")
    disk = s.get("disk")
    if disk:
        lines.append(f"disk {disk.get('path', '')}: {fmt_bytes(disk.get('used'))} used of "
                     f"{fmt_bytes(disk.get('total'))}, {fmt_bytes(disk.get('free'))} free")
    pool_ = s.get("pool")
    if pool_:
        lines.append(f"pool {fmt_bytes(pool_.get('arena_bytes'))}: {fmt_bytes(pool_.get('in_use_bytes'))} in use, "
                     f"high-water {fmt_bytes(pool_.get('high_water_bytes'))}, waits {pool_.get('waits')}")
    lines.append(f"writes {fmt_count(_counter(c, 'writes'))} ({fmt_bytes(_counter(c, 'write_bytes'))}, of them "
                 f"replica writes {fmt_count(_counter(c, 'replica_writes'))}), reads {fmt_count(_counter(c, 'reads'))} "
                 f"({fmt_bytes(_counter(c, 'read_bytes'))}), forwarded {fmt_count(_counter(c, 'forwarded'))}, "
                 f"replication failures {fmt_count(_counter(c, 'replication_failures'))}, protocol errors "
                 f"{fmt_count(_counter(c, 'protocol_errors'))}")
    for role, stages in (s.get("write_stages") or {}).items():     # since the node started
        n = max(v["count"] for v in stages.values())
        lines.append(f"appends as {role} ({fmt_count(n)}), mean ms per stage: " + ", ".join(
            f"{st} {v['sum_s'] / v['count'] * 1e3:.3f}" for st, v in stages.items() if v["count"]))
    conns = s.get("connections") or []
    lines.append(f"connections ({len(conns)}):" if conns else "connections: none")
    for conn in conns:
        kind = conn["transport"] + (f" ({conn['congestion']})" if conn.get("congestion") else "")
        lines.append(f"  {conn['peer']:22} {kind:12} protocol {conn.get('version', '?')} "
                     + ("session " if conn.get("session") else "")       # every control message MAC'd
                     + (f"volume {conn['volume']} " if conn.get("volume") else "") +
                     f"sends {fmt_count(conn.get('sends'))} "
                     f"recvs {fmt_count(conn.get('recvs'))} served reads {fmt_count(conn.get('served_reads'))} "
                     f"({fmt_bytes(conn.get('served_read_bytes'))})")
    return "\n".join(lines)


@node.command("status")
@click.argument("addr", type=ADDR)
@click.option("--json", "as_json", is_flag=True, help="The node's status document, raw numbers.")
def node_status(addr, as_json):
    """Health, partitions, counters, disk, pool and each connection's transport (the one actually in
    use: tcp or verbs, per connection), in human units; --json has the raw numbers."""
    async def go():
        async with DataClient.from_env(**credentials()) as dc:
            return await admin.node_status(dc, addr)
    s = run(go)
    emit(s, as_json, _status_text(s))


@node.command("drain")
@click.argument("addr", type=ADDR)
@cluster_option(help="The node's local cluster directory (its secret; its etcd, to check the map afterwards).")
@etcd_option
@click.option("--wait/--no-wait", default=True, show_default=True, help="Follow the node until it has stopped.")
@click.option("--timeout", type=click.FloatRange(1), default=120, show_default=True,
              help="Seconds to wait for it to stop (the node itself gives up on a hand-off after its "
                   "drain_timeout_s and stops anyway).")
@click.option("--quiet", "-q", is_flag=True, help="No progress line on stderr.")
@click.option("--json", "as_json", is_flag=True)
def node_drain(addr, cluster, etcd, wait, timeout, quiet, as_json):
    """Stop node ADDR the way SIGTERM does, without a shell on its host: it hands its partitions to their
    other replicas first, so writes move on with no error and almost no stall.

    \b
    dnctl node drain 127.0.0.1:17312 --cluster /tmp/dn
    dnctl node drain 10.0.0.7:17310 --etcd http://10.0.0.1:2379 --json

    With the cluster map in etcd and an active manager, the manager moves every partition naming ADDR off it
    (where ADDR leads, an in-sync follower leads at epoch + 1, the fencing of a failover; where it follows,
    it is left out until it is back); then ADDR finishes its requests in flight, revokes its etcd lease and
    exits.  Without etcd or a manager it cannot hand off: it says so (the partitions it led take no writes
    until it is back) and stops.  After its drain_timeout_s (node.toml) it stops whatever is left.  When it
    starts again, the manager refills the partitions it left (`dnctl partition list` shows them writable
    again).  Progress (phase, partitions moved, what is left and why) goes to stderr.
    """
    if cluster:
        load_cluster(cluster)
    et = etcd_map(etcd, cluster) if etcd or (cluster and (cl.load(pathlib.Path(cluster)).get("etcd") or {})
                                             .get("url")) else None
    line = ProgressLine() if wait and not quiet else None

    def progress(p):
        if not p:
            return
        left = p["left"]
        line.update(f"drain {addr}: {p['phase']}, {len(p['handed_off'])} partition(s) handed off"
                    + (f", {len(left)} to go ({','.join(left)})" if left else "") + f", {fmt_seconds(p['seconds'])}")

    def named(snap) -> list[int]:
        return [p["id"] for p in snap["partitions"] if addr in p["replicas"]]

    async def go():
        try:
            async with DataClient.from_env(**credentials()) as dc:
                res = await admin.drain_node(dc, addr, wait=wait, timeout=timeout,
                                             on_progress=progress if line else None)
        finally:
            if line:
                line.close()
        if et is not None and res["stopped"]:       # what the map says now
            snap = await mapadmin.map_snapshot(et)
            res["etcd"] = {"registered": any(n["addr"] == addr for n in snap["nodes"]), "named_by": named(snap)}
        return res
    res = run(go)
    if not wait:
        emit(res, as_json, f"{addr} is stopping" + (" (it was already)" if res["already_stopping"] else "")
             + f"; follow it with: dnctl node status {addr}")
        return
    moved = ",".join(map(str, res["handed_off"])) or "none"
    text = [f"{addr} " + ("stopped" if res["stopped"] else "answered its drain but still runs")
            + f" after {fmt_seconds(res['seconds'])}" + (" (and runs again: a new process answers)"
                                                          if res["restarted"] else "")
            + f"; partitions handed off: {moved}"]
    text += [f"warning: partition {k} was not handed off: {v}" for k, v in res["left"].items()]
    text += [f"warning: {n}" for n in res["notes"]]
    e = res.get("etcd")
    if e:
        text.append("etcd: " + ("registration gone" if not e["registered"] else
                                "still registered (its lease was not revoked: it expires within lease_ttl_s)")
                    + ("; no partition names it" if not e["named_by"] else
                       f"; named by partition(s) {','.join(map(str, e['named_by']))}"))
    emit(res, as_json, "\n".join(text))
    if not res["stopped"]:
        sys.exit(1)


@node.command("decommission")
@click.argument("addr", type=ADDR)
@etcd_option
@cluster_option()
@click.option("--wait/--no-wait", default=True, show_default=True, help="Follow it until the node is empty.")
@click.option("--timeout", type=click.FloatRange(1), default=3600, show_default=True)
@click.option("--stuck-after", type=click.FloatRange(1), default=30, show_default=True,
              help="Give up waiting (the node stays draining) when no node can take what is left for this long.")
@click.option("--cancel", is_flag=True, help="Let the node take replicas again (moved ones stay moved).")
@click.option("--quiet", "-q", is_flag=True, help="No progress line on stderr.")
@click.option("--json", "as_json", is_flag=True)
def node_decommission(addr, etcd, cluster, wait, timeout, stuck_after, cancel, quiet, as_json):
    """Move every replica off node ADDR, then leave it empty (the manager does it, through etcd).

    \b
    dnctl node decommission 127.0.0.1:17312 --cluster /tmp/dn
    dnctl node decommission 10.0.0.7:17310 --etcd http://10.0.0.1:2379 --json

    For each partition on ADDR the active manager adds a replica on another node (another zone where
    possible, the most free space), lets the leader's repair fill it, and only then removes ADDR
    (epoch + 1; if ADDR led, a filled replica leads).  ADDR drops its copies when it sees the new views.
    It takes no new replicas afterwards, until --cancel.  Progress (partitions left, what each waits for)
    goes to stderr; the end state is "ADDR holds no partitions: it can be stopped".
    """
    et = etcd_map(etcd, cluster, what="node decommission")
    url = et.urls
    if cancel:
        async def undo():
            await mapadmin.cancel_decommission(et, addr)
        run(undo)
        emit({"node": addr, "draining": False}, as_json, f"{addr} takes replicas again")
        return
    line = ProgressLine() if wait and not quiet else None

    def progress(p):
        done = p["partitions_total"] - len(p["remaining"])
        now = "; ".join(f"{s['id']}: {s['step']}" for s in p["remaining"][:4])
        line.update(f"decommission {addr} {bar(done, max(p['partitions_total'], 1))} {done}/"
                    f"{p['partitions_total']} partitions moved, {fmt_seconds(p['seconds'])}"
                    + (f" [{now}]" if now else "") + ("" if p["remaining"] or not p["held_by_node"] else
                                                      f" [node still holds {p['held_by_node']}]"))

    async def go():
        try:
            return await mapadmin.decommission(et, addr, wait=wait, timeout=timeout, stuck_after=stuck_after,
                                               on_progress=progress if line else None)
        finally:
            if line:
                line.close()
    res = run(go)
    if res["done"]:
        moved = ", ".join(f"{pid} -> {','.join(to) or '?'}" for pid, to in res["moved"].items())
        text = f"{addr} holds no partitions: it can be stopped" + (f" (moved: {moved})" if moved else "")
    else:
        text = (f"{addr} is being decommissioned: {len(res['remaining'])} partition(s) to move; follow it with: "
                f"dnctl partition list --etcd {url}")
    emit(res, as_json, text)


# -- demo, benchmarks, torture (each in its own module) -------------------------------------------------
main.add_command(demo_command, "demo")
main.add_command(bench_command, "bench")
main.add_command(trash_group, "trash")
main.add_command(volume_group, "volume")


if __name__ == "__main__":
    main()
