"""``dnmanager``: run one instance of the cluster manager (manager/service.py) until SIGTERM/SIGINT."""
from __future__ import annotations

import logging
import signal
import sys

import click
import trio

from wire import sdnotify
from wire.auth import AuthConfigError, Credentials
from wire.etcdmap import ACCESS_OPTIONS, EtcdAccess, parse_urls
from wire.limits import DEFAULT_REPLICAS, MAX_REPLICAS
from wire.metrics import serve_metrics
from wire.transport.base import TransportChoice
from wire.transport.tls import TlsConfigError, client_context

from manager.service import Manager, ManagerMetrics


def _access_options(fn):
    for opt, env, name, text in reversed(ACCESS_OPTIONS):
        fn = click.option(opt, name, type=click.Path(dir_okay=False), envvar=env, show_envvar=True, help=text)(fn)
    return fn


@click.command("dnmanager", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--etcd", required=True, metavar="URL[,URL...]",
              help="etcd endpoints, e.g. http://127.0.0.1:2379 (several: comma-separated).")
@click.option("--prefix", default="/datanode", show_default=True, help="Key prefix of this cluster in etcd.")
@click.option("--name", default="manager", show_default=True, help="This instance's name (logs, election key).")
@click.option("--lease-ttl-s", type=click.IntRange(2, 3600), default=3, show_default=True,
              help="The active manager's lease: a standby takes over this long after it dies.")
@click.option("--down-after-s", type=click.FloatRange(0), default=1.0, show_default=True,
              help="A follower without a lease this long is removed from its partitions (then replaced).")
@click.option("--tick-s", type=click.FloatRange(0.05), default=0.25, show_default=True,
              help="How often the active manager looks again while a change is under way (it reacts to "
                   "etcd's watch events at once, and looks at a settled map only every few seconds).")
@click.option("--transport", type=click.Choice([t.value for t in TransportChoice]), default="auto", show_default=True,
              help="How the manager reaches datanodes for admin requests: auto (verbs where this host has an "
                   "RDMA device and the node offers it, else TCP) reaches nodes of every transport setting "
                   "this host can; tcp cannot reach nodes configured transport = \"verbs\".")
@click.option("--min-writable", type=click.IntRange(0), default=2, show_default=True,
              help="Keep at least this many partitions that take writes (writable, or degraded/recovering "
                   "while they heal) with free space; new ones are placed automatically; 0: never create any.")
@click.option("--replicas", type=click.IntRange(1, MAX_REPLICAS), default=DEFAULT_REPLICAS, show_default=True,
              help="Replica count of the partitions it creates for --min-writable (fewer if fewer nodes).")
@click.option("--min-free-mib", type=click.IntRange(0), default=256, show_default=True,
              help="A node with less free disk gets no new replicas; a partition on one does not count as "
                   "writable for --min-writable.")
@click.option("--unfinished-after-s", type=click.FloatRange(1), default=30.0, show_default=True,
              help="An empty partition that only followers hold -- no map names it, its leader does not have "
                   "it: a create that died half-way -- is deleted from them (to their trash) after this long.")
@click.option("--under-replicated-warn-s", type=click.FloatRange(0), default=30.0, show_default=True,
              help="A partition with fewer live, synced replicas than its replica count for this long is logged "
                   "as a warning (once; repair takes a while, so a moment under is normal).  Metrics: "
                   "dnmanager_under_replicated_partitions, dnmanager_under_replicated_oldest_seconds.")
@click.option("--secret-file", type=click.Path(dir_okay=False), envvar="DATANODE_SECRET_FILE", show_envvar=True,
              help="The cluster secret (or an admin role key file), for nodes that have secret_file set.")
@click.option("--tls-ca", type=click.Path(dir_okay=False), envvar="DATANODE_TLS_CA", show_envvar=True,
              help="CA bundle (PEM): speak TLS to the nodes and check their certificates against it.")
@_access_options
@click.option("--etcd-maintenance-credentials", type=click.Path(dir_okay=False),
              envvar="DATANODE_ETCD_MAINTENANCE_CREDENTIALS", show_envvar=True,
              help="File holding USER:PASSWORD of an etcd user with etcd's root role, used only to defragment "
                   "the members (etcd lets no lesser role do it); without it, under etcd's authentication, "
                   "the manager only warns when a member's file is mostly free space.")
@click.option("--etcd-defrag-check-s", type=click.FloatRange(0), default=300.0, show_default=True,
              help="Seconds between the active manager's looks at each etcd member's database file "
                   "(defragmented when mostly free space, one member at a time); 0: never.")
@click.option("--etcd-defrag-min-free-mib", type=click.IntRange(1), default=32, show_default=True,
              help="MiB of free space in a member's database file (and at least half of the file) that make "
                   "it worth defragmenting.")
@click.option("--metrics-listen", metavar="HOST:PORT",
              help="Serve Prometheus /metrics here (whether active; etcd values ignored as invalid, by reason; "
                   "partitions under-replicated, and for how long).")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info")
def manager_command(etcd, prefix, name, lease_ttl_s, down_after_s, tick_s, transport, min_writable, replicas,
                    min_free_mib, unfinished_after_s, under_replicated_warn_s, secret_file, tls_ca,
                    etcd_maintenance_credentials, etcd_defrag_check_s, etcd_defrag_min_free_mib, metrics_listen,
                    log_level, **access):
    """Run a cluster manager on etcd until SIGTERM/SIGINT.

    \b
    Start any number of them; exactly one is active (elected through etcd), the
    others take over when its lease lapses.  The active one moves leadership off
    dead leaders, shrinks partitions whose followers died (after --down-after-s),
    re-replicates them onto spare nodes, adopts partitions datanodes report
    (and removes empty ones a create that died half-way left on followers),
    places new partitions (dnctl partition create --count N; --min-writable)
    and empties decommissioned nodes (dnctl node decommission ADDR).
    Example:  dnmanager --etcd http://10.0.0.1:2379,http://10.0.0.2:2379
    """
    try:
        parse_urls(etcd)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--etcd") from None
    try:
        creds = Credentials.load(secret_file) if secret_file else None
    except AuthConfigError as e:
        raise click.BadParameter(str(e), param_hint="--secret-file") from None
    try:
        tls = client_context(tls_ca) if tls_ca else None
    except TlsConfigError as e:
        raise click.BadParameter(str(e), param_hint="--tls-ca") from None
    try:
        etcd_access = EtcdAccess.load(**access)
        maintenance = (EtcdAccess.load(**{**access, "credentials": etcd_maintenance_credentials})
                       if etcd_maintenance_credentials else None)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    if metrics_listen:
        host, sep, port = metrics_listen.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise click.BadParameter(f"{metrics_listen!r} is not HOST:PORT", param_hint="--metrics-listen")
    if creds is None:
        click.echo("warning: no --secret-file: the map's entries carry no MAC, so anyone who can write to etcd "
                   "can move partitions (docs/security.md)", err=True)
    logging.basicConfig(level=log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    m = Manager(etcd, prefix=prefix, name=name, lease_ttl_s=lease_ttl_s, down_after_s=down_after_s,
                tick_s=tick_s, transport=transport, min_writable=min_writable, replicas=replicas,
                min_free_mib=min_free_mib, unfinished_after_s=unfinished_after_s,
                under_replicated_warn_s=under_replicated_warn_s, secret=creds, tls=tls,
                etcd_access=etcd_access,
                etcd_care={"check_s": etcd_defrag_check_s, "min_free_bytes": etcd_defrag_min_free_mib << 20,
                           "maintenance": maintenance})

    async def main():
        async with trio.open_nursery() as n:
            n.start_soon(m.run)
            if metrics_listen:
                await n.start(serve_metrics, metrics_listen, ManagerMetrics(m))
            n.start_soon(sdnotify.ready_when, lambda: m.cache.reads > 0, f"manager {name}: joined {etcd}")
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    break
            n.cancel_scope.cancel()
    trio.run(main)


main = manager_command

if __name__ == "__main__":
    main()
