"""``python -m lab``: the tools that attack, fuzz and torture a cluster to find what breaks.  For developers
and CI, not a user command: the package is not shipped in the wheel."""
from __future__ import annotations

import click

from lab.abuse import soak_command
from lab.etcd_torture import etcd_torture_command
from lab.fuzz import fuzz_command
from lab.torture import torture_command
from tools.clikit import CTX, Group


@click.group(cls=Group, context_settings=CTX)
def main():
    """Abuse, fuzz and crash-torture real datanodes (each command starts what it needs or targets --node)."""


for cmd in (soak_command, fuzz_command, torture_command, etcd_torture_command):
    main.add_command(cmd)

if __name__ == "__main__":
    main()
