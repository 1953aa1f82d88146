"""`dnctl` — the admin CLI: partitions, replicas, data, pools, nodes, local clusters, benchmarks."""
from __future__ import annotations

import json
import pathlib
import sys

import click
import trio

from client.sdk import ClientError, DataClient, Location
from datanode.protocol import Op

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


def split_addrs(s: str) -> list[str]:
    addrs = [a.strip() for a in s.split(",") if a.strip()]
    for a in addrs:
        host, sep, port = a.rpartition(":")
        if not sep or not port.isdigit():
            raise click.BadParameter(f"{a!r} is not HOST:PORT")
    return addrs


def cluster_nodes(cluster_dir: str) -> list[str]:
    from tools import cluster
    return [n["addr"] for n in cluster.load(pathlib.Path(cluster_dir))["nodes"]]


@click.group(context_settings=CTX)
def main():
    """Administer datanodes.

    \b
    A local 3-node cluster:       dnctl cluster up --nodes 3 --dir /tmp/dn
    Store a file:                 dnctl put --cluster /tmp/dn --partition 1 FILE
    Read it back:                 dnctl get --cluster /tmp/dn --partition 1 --extent E --out OUT
    Every command takes --help; most take --json for scripts.
    """


# -- partitions ---------------------------------------------------------------------------------------
@main.group(context_settings=CTX)
def partition():
    """Create, list and show data partitions."""


@partition.command("create")
@click.option("--id", "pid", type=click.IntRange(1), required=True, help="Partition id.")
@click.option("--replicas", required=True, help="Comma-separated HOST:PORT list, leader first.")
@click.option("--json", "as_json", is_flag=True)
def partition_create(pid, replicas, as_json):
    """Create a partition on every replica (all or nothing: undone everywhere if one node fails)."""
    addrs = split_addrs(replicas)

    async def go():
        async with DataClient.open() as dc:
            done = []
            for addr in addrs:
                try:
                    await dc.admin(addr, Op.PARTITION_CREATE, partition=pid,
                                   body={"replicas": addrs, "epoch": 1})
                except ClientError as e:
                    for d in done:
                        try:
                            await dc.admin(d, Op.PARTITION_DELETE, partition=pid)
                        except ClientError:
                            pass
                    raise ClientError(f"creating partition {pid} failed on {addr}: {e}") from None
                done.append(addr)
        return {"id": pid, "replicas": addrs, "epoch": 1}

    res = run(go)
    emit(res, as_json, f"partition {pid} created on {', '.join(addrs)} (leader {addrs[0]}, epoch 1)")


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
    return [node] if node else cluster_nodes(cluster)


@main.command()
@click.option("--node", help="A datanode HOST:PORT (its partition map is used).")
@click.option("--cluster", type=click.Path(file_okay=False), help="A local cluster dir (dnctl cluster up).")
@click.option("--partition", "pid", type=int, required=True)
@click.argument("file", type=click.File("rb"))
@click.option("--json", "as_json", is_flag=True)
def put(node, cluster, pid, file, as_json):
    """Store FILE in a partition; prints where it went: extent id, offset, size and CRC32C."""
    data = file.read()

    async def go():
        async with DataClient.open(_nodes(node, cluster)) as dc:
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
    """Read an extent range (CRC-checked, failing over across replicas) into --out."""
    async def go():
        async with DataClient.open(_nodes(node, cluster)) as dc:
            n = length
            if n is None:
                marks = await dc.watermarks(pid, replica)
                if extent not in marks:
                    raise ClientError(f"extent {extent} not found in partition {pid}")
                n = marks[extent] - offset
            return await dc.read(pid, extent, offset, n, replica=replica)
    data = run(go)
    out.write(data)
    if out is not sys.stdout.buffer and getattr(out, "name", "-") != "<stdout>":
        click.echo(f"{len(data)} bytes read from extent {extent}", err=True)


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


if __name__ == "__main__":
    main()
