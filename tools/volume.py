"""``dnctl volume``: volumes -- a name and the partitions created in it -- and their keys.

A partition's volume is set when it is created (``dnctl partition create --volume NAME``) and kept in every
copy's meta on the datanodes; a volume key (``dnctl volume key NAME``) proves the client role scoped to the
partitions of that volume alone (wire/auth.py, datanode/ops/admit.py).  The membership lives on the nodes, so
``list`` asks them.
"""
from __future__ import annotations

import os

import click

from client import admin
from client.sdk import ClientError, DataClient
from tools.clikit import ADDR, CTX, cluster_nodes, cluster_option, credentials, emit, login, run


class VolumeType(click.ParamType):
    name = "NAME"

    def convert(self, value, param, ctx):
        from wire.protocol import BodyError, check_volume
        try:
            return check_volume(value)
        except BodyError as e:
            self.fail(e.detail, param, ctx)


VOLUME = VolumeType()


@click.group("volume", context_settings=CTX)
def volume_group():
    """Volumes: a name and the partitions created in it; a volume key reaches those partitions only.

    \b
    dnctl partition create --count 2 --replicas 3 --volume photos --cluster /tmp/dn
    dnctl volume key photos --cluster /tmp/dn --out photos.key     # for the volume's client hosts
    dnctl volume list --cluster /tmp/dn                             # volume -> its partitions
    dnfs mount --cluster /tmp/dn --secret-file photos.key /mnt/photos
    dnctl --secret-file photos.key put --cluster /tmp/dn file.bin  # lands on a partition of photos
    """


@volume_group.command("key")
@click.argument("name", type=VOLUME)
@cluster_option(help="A local cluster directory: its secret makes the key.")
@click.option("--out", type=click.Path(dir_okay=False),
              help="Write the key file here (mode 0600; it must not exist yet) instead of printing it.")
@click.option("--json", "as_json", is_flag=True)
def volume_key(name, cluster, out, as_json):
    """Make the key file of volume NAME (from the cluster secret or an admin key file: --secret-file, or
    --cluster DIR).  It proves the client role on NAME's partitions and nothing else: reads, appends,
    extent create and delete there; FORBIDDEN on every other partition.  Give it where a role key file
    goes: dnfs mount --secret-file, dnctl --secret-file, DataClient(secret=...), $DATANODE_SECRET_FILE."""
    from wire.auth import AuthConfigError
    if cluster:
        from tools.clikit import load_cluster
        load_cluster(cluster)             # its secret, unless --secret-file named one
    creds = login().secret
    if creds is None:
        raise click.UsageError("making a volume key needs the cluster secret or an admin key file: "
                               "--secret-file FILE or --cluster DIR")
    try:
        text = creds.volume_key_file(name)
    except AuthConfigError as e:
        raise click.ClickException(str(e)) from None
    if out is None:
        if as_json:
            emit({"volume": name, "key_file": text}, True)
        else:
            click.echo(text, nl=False)
        return
    try:
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:
        raise click.ClickException(f"{out}: {e.strerror or e}") from None
    with os.fdopen(fd, "w") as f:
        f.write(text)
    emit({"volume": name, "out": os.path.abspath(out)}, as_json, f"volume {name}: key file written to {out}")


@volume_group.command("list")
@click.argument("addrs", type=ADDR, nargs=-1)
@cluster_option()
@click.option("--json", "as_json", is_flag=True)
def volume_list(addrs, cluster, as_json):
    """The volumes and their partitions, as the nodes ADDR... (or every node of --cluster DIR) hold them."""
    if bool(addrs) == bool(cluster):
        raise click.UsageError("give node addresses (HOST:PORT ...) or --cluster DIR")
    nodes = list(addrs) or cluster_nodes(cluster)

    async def go():
        vols: dict[str, set] = {}
        errors = {}
        async with DataClient.from_env(**credentials()) as dc:
            for addr in nodes:
                try:
                    for p in await admin.partition_list(dc, addr):
                        vols.setdefault(p.get("volume") or "", set()).add(p["id"])
                except ClientError as e:
                    errors[addr] = str(e)
        if errors and len(errors) == len(nodes):
            raise ClientError("no node answered: " + "; ".join(errors.values()))
        return {"volumes": {v: sorted(ps) for v, ps in sorted(vols.items()) if v},
                "no_volume": sorted(vols.get("", ())), "unreachable": errors}
    res = run(go)
    lines = [f"{v:16} partitions {', '.join(map(str, ps))}" for v, ps in res["volumes"].items()]
    lines.append(f"{'(no volume)':16} partitions {', '.join(map(str, res['no_volume'])) or '-'}")
    lines += [f"warning: {a} did not answer: {e}" for a, e in res["unreachable"].items()]
    emit(res, as_json, "\n".join(lines))
