"""`datanode` — the daemon's command line."""
from __future__ import annotations

import logging
import os
import sys

import click
import trio

from wire import crc, trace

from . import config as config_mod


def _load(config_path, **overrides) -> config_mod.Config:
    """This command's config: node.toml, then the environment's $DATANODE_<KEY> (read here, once), then the
    command line (config.py)."""
    try:
        return config_mod.load(config_path, os.environ, **overrides)
    except config_mod.ConfigError as e:
        raise click.ClickException(str(e)) from None


def _version() -> str:
    from importlib import metadata
    try:
        return metadata.version("datanode")
    except metadata.PackageNotFoundError:
        return "unknown (not installed: pip install -e .)"


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(_version(), "--version", prog_name="datanode")
def main():
    """The datanode daemon: stores extents of data partitions and replicates writes to followers.

    \b
    Start one:   datanode serve --config node.toml
    Settings:    datanode print-config   (every key: its value, where it came from, unit and meaning)
                 a key can be set as $DATANODE_<KEY> too, e.g. DATANODE_VERBS_INLINE=0
                 (not secret_file and tls_ca: those variables are a client's)
    Secrets:     datanode gen-secret > /etc/datanode/secret   (then secret_file = "/etc/datanode/secret")
                 datanode derive-key --secret-file /etc/datanode/secret --role client > client.key
    Trash:       datanode trash list --config node.toml ; datanode trash restore NAME --config node.toml
    """


@main.command()
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="node.toml to read.")
@click.option("--listen", help="HOST:PORT (overrides the config).")
@click.option("--data-dir", help="Where partitions live (overrides the config).")
@click.option("--sync", type=click.Choice([m.value for m in config_mod.SyncMode]), help="fdatasync before each ack, or not.")
@click.option("--transport", type=click.Choice([m.value for m in config_mod.TransportChoice]), help="Data-path transport.")
@click.option("--pool-mib", type=int, help="Registered pool size in MiB (must fit in available memory).")
def serve(config_path, listen, data_dir, sync, transport, pool_mib):
    """Run a datanode until SIGTERM/SIGINT (in-flight requests are drained first)."""
    cfg = _load(config_path, listen=listen, data_dir=data_dir, sync=sync, transport=transport, pool_mib=pool_mib)
    try:
        config_mod.check_host(cfg)
    except config_mod.ConfigError as e:
        raise click.ClickException(str(e)) from None
    logging.basicConfig(level=cfg.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _cpu_sched(cfg.cpu_sched)          # before Node(): every thread the node starts inherits the policy
    if cfg.trace:
        trace.start(cfg.trace)
    crc.use_fastest()                  # before the store's modules take their crc32c (below)
    from .server import Node
    try:
        node = Node(cfg)
    except (config_mod.ConfigError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    except OSError as e:      # the pool's memory, the data directory: what the host refused, in one line
        raise click.ClickException(f"cannot start: {e.strerror or e}"
                                   + (f" ({e.filename})" if getattr(e, "filename", None) else "")
                                   + f" [data_dir {cfg.data_dir}, pool_mib {cfg.pool_mib}]") from None
    try:
        trio.run(node.serve)
    except OSError as e:
        raise click.ClickException(f"cannot serve on {cfg.listen}: {e.strerror or e}") from None


def _cpu_sched(policy: str) -> None:
    """Run this process's threads under SCHED_BATCH (``cpu_sched = "batch"``).  Under CFS a thread that
    wakes up normally preempts the one running if it has had less CPU; a storage node wakes on every
    message, so on a busy machine the nodes of one write preempt each other at every hop and run a request or
    two per wake-up.  Batch threads never preempt on wake-up: they run when the current one blocks or its
    slice ends, by when several messages wait, so each pass of the event loop serves more of them (less CPU
    per request under load).  Nothing else changes: same priority (nice), same share of the CPU."""
    if policy != "batch" or not hasattr(os, "SCHED_BATCH"):
        return
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except OSError as e:
        logging.getLogger(__name__).warning("cpu_sched = batch: cannot set SCHED_BATCH (%s): running under the "
                                            "normal policy", e)


@main.command("print-config")
@click.option("--config", "config_path", type=click.Path(dir_okay=False))
def print_config(config_path):
    """Print the effective configuration as TOML (usable as node.toml): every key with its value, and a
    comment with its unit, where the value came from (default, file, env $DATANODE_<KEY>) and what it does."""
    click.echo(config_mod.to_toml(_load(config_path), annotate=True), nl=False)


@main.command("gen-secret")
def gen_secret():
    """Print a new cluster secret (64 hex digits).  Store it mode 0600 on every datanode and admin host; give
    client hosts only a client key (derive-key)."""
    from wire.auth import gen_secret as make
    click.echo(make(), nl=False)


@main.command("derive-key")
@click.option("--secret-file", required=True, type=click.Path(dir_okay=False, exists=True),
              help="The cluster secret.")
@click.option("--role", type=click.Choice(["client", "node", "admin"]),
              help="The role the key proves (client hosts: client; admin hosts may get admin).")
@click.option("--volume", metavar="NAME",
              help="Instead of --role: a volume key file, the client role on volume NAME's partitions only.")
def derive_key(secret_file, role, volume):
    """Print a role key file: it proves ROLE and nothing else (it cannot derive the other roles' keys).
    Use it as the SDK's secret= / DATANODE_SECRET_FILE on hosts that must not administer the cluster.
    With --volume NAME: a volume key file (dnctl volume key NAME does the same).  The file also carries the
    node CA's public key (node-ca=...), with which its holder checks that a node it reaches is the one it
    dialed; key files made without it keep working, without that check."""
    from wire.auth import ROLE_NAMES, AuthConfigError, Credentials
    if bool(role) == bool(volume):
        raise click.UsageError("give one of --role ROLE or --volume NAME")
    try:
        creds = Credentials.load(secret_file)
        click.echo(creds.volume_key_file(volume) if volume else creds.role_key_file(ROLE_NAMES[role]), nl=False)
    except AuthConfigError as e:
        raise click.ClickException(str(e)) from None


@main.group()
def trash():
    """Partitions deleted (or this node removed from) are kept in data_dir/trash for trash_retention_s."""


def _table(config_path):
    import pathlib

    from .partition import PartitionTable
    from .store import StoreOptions
    cfg = _load(config_path)
    return cfg, PartitionTable(pathlib.Path(cfg.data_dir), cfg.sync, options=StoreOptions.from_config(cfg))


@trash.command("list")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="The node's node.toml.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def trash_list(config_path, as_json):
    """What the trash holds (name, partition, when deleted, bytes)."""
    import json
    import time
    cfg, table = _table(config_path)
    entries = table.list_trash()
    if as_json:
        click.echo(json.dumps(entries, indent=1))
        return
    if not entries:
        click.echo(f"the trash of {cfg.data_dir} is empty")
    for e in entries:
        left = cfg.trash_retention_s - (time.time() - e["deleted"])
        click.echo(f"{e['name']}  partition {e['partition']}  deleted "
                   f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(e['deleted']))}  {e['bytes']} bytes  "
                   f"purged in {max(0, left):.0f}s")


@trash.command("restore")
@click.argument("name")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="The node's node.toml.")
def trash_restore(name, config_path):
    """Put trash entry NAME back as its partition.  Run it with the node stopped; the partition comes back
    with the replicas and epoch it had (a leader's repair then brings it up to date, or fences it)."""
    _cfg, table = _table(config_path)
    try:
        pid = table.restore(name)
    except (FileNotFoundError, FileExistsError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"partition {pid} restored from the trash; start the node to serve it")


if __name__ == "__main__":
    main()
