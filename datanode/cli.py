"""`datanode` — the daemon's command line."""
from __future__ import annotations

import logging
import sys

import click
import trio

from . import config as config_mod


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main():
    """The datanode daemon: stores extents of data partitions and replicates writes to followers.

    \b
    Start one:   datanode serve --config node.toml
    Defaults:    datanode print-config   (every key, with its default)
    """


@main.command()
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="node.toml to read.")
@click.option("--listen", help="HOST:PORT (overrides the config).")
@click.option("--data-dir", help="Where partitions live (overrides the config).")
@click.option("--sync", type=click.Choice(["always", "none"]), help="fdatasync before each ack, or not.")
@click.option("--transport", type=click.Choice(["auto", "verbs", "tcp"]), help="Data-path transport.")
@click.option("--pool-mib", type=int, help="Registered pool size in MiB.")
def serve(config_path, listen, data_dir, sync, transport, pool_mib):
    """Run a datanode until SIGTERM/SIGINT (in-flight requests are drained first)."""
    try:
        cfg = config_mod.load(config_path, listen=listen, data_dir=data_dir, sync=sync, transport=transport,
                              pool_mib=pool_mib)
    except config_mod.ConfigError as e:
        raise click.ClickException(str(e)) from None
    logging.basicConfig(level=cfg.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from .server import Node
    try:
        node = Node(cfg)
    except (config_mod.ConfigError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    try:
        trio.run(node.serve)
    except OSError as e:
        raise click.ClickException(f"cannot serve on {cfg.listen}: {e.strerror or e}") from None


@main.command("print-config")
@click.option("--config", "config_path", type=click.Path(dir_okay=False))
def print_config(config_path):
    """Print the effective configuration (defaults filled in) as TOML."""
    try:
        click.echo(config_mod.to_toml(config_mod.load(config_path)), nl=False)
    except config_mod.ConfigError as e:
        raise click.ClickException(str(e)) from None


if __name__ == "__main__":
    main()
