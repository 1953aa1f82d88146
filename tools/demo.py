"""`dnctl demo`: write random files through the SDK, read each back from every replica, compare the bytes.

    dnctl cluster up --nodes 3 --cluster /tmp/dn
    dnctl demo --cluster /tmp/dn --mib 300 --files 12

Files are generated from a seed (``random.Random(seed + i)``), so the check compares every byte read
against a fresh copy of what was written without keeping all of it in memory.  Throughput counts only
the time inside ``DataClient.write`` / ``DataClient.read`` (not generating or comparing).
"""
from __future__ import annotations

import json
import random
import time

import click

from client import admin
from client.sdk import ClientError
from tools.clikit import CTX, Command, cluster_nodes, cluster_option, credentials, run

MIB = 1 << 20


def _rate(nbytes: int, secs: float) -> float:
    return nbytes / MIB / secs if secs > 0 else 0.0


def _ranges(locs):
    """Locations merged into contiguous (extent, offset, length) ranges: fewer, larger reads."""
    out: list[list[int]] = []
    for loc in locs:
        if out and out[-1][0] == loc.extent and out[-1][1] + out[-1][2] == loc.offset:
            out[-1][2] += loc.length
        else:
            out.append([loc.extent, loc.offset, loc.length])
    return out


async def run_demo(nodes: list[str], pid: int, total_mib: int, files: int, seed: int, echo,
                   block_kib: int = 1024, depth: int = 8) -> dict:
    sizes = [total_mib * MIB // files] * files
    sizes[-1] += total_mib * MIB - sum(sizes)
    async with admin.open_client(nodes, block_size=block_kib << 10, depth=depth, from_env=True, **credentials()) as dc:
        part = dc.partition(pid)
        replicas = list(part.replicas)
        before = {}
        for addr in replicas:
            try:
                before[addr] = (await admin.node_status(dc, addr))["counters"]
            except ClientError:
                before[addr] = None
        echo(f"partition {pid}: replicas {', '.join(replicas)} (leader {replicas[0]}, epoch {part.epoch})")
        echo(f"writing {files} files, {total_mib} MiB in all, through the leader; reading each back from "
             f"each of the {len(replicas)} replicas")
        w_bytes = 0
        w_secs = 0.0
        r_secs = {a: 0.0 for a in replicas}
        r_bytes = {a: 0 for a in replicas}
        mismatches: list[str] = []
        per_file = []
        width = len(str(files))
        for i, size in enumerate(sizes):
            data = random.Random(seed + i).randbytes(size)
            t0 = time.perf_counter()
            locs = await dc.write(pid, data)
            dt = time.perf_counter() - t0
            w_secs += dt
            w_bytes += size
            ranges = _ranges(locs)
            rec = {"file": i + 1, "bytes": size, "ranges": ranges, "write_mib_s": round(_rate(size, dt), 1),
                   "read_mib_s": {}, "ok": True}
            for addr in replicas:
                got = bytearray()
                t0 = time.perf_counter()
                for extent, offset, length in ranges:
                    got += await dc.read(pid, extent, offset, length, replica=addr)
                dt_r = time.perf_counter() - t0
                r_secs[addr] += dt_r
                r_bytes[addr] += len(got)
                rec["read_mib_s"][addr] = round(_rate(len(got), dt_r), 1)
                if got != data:
                    rec["ok"] = False
                    bad = next((k for k in range(min(len(got), len(data))) if got[k] != data[k]),
                               min(len(got), len(data)))
                    mismatches.append(f"file {i + 1} on {addr}: first difference at byte {bad} "
                                      f"(read {len(got)} of {len(data)} bytes)")
            per_file.append(rec)
            where = ", ".join(f"e{e}@{o}" for e, o, _ in ranges[:3]) + (" ..." if len(ranges) > 3 else "")
            reads = "  ".join(f"{rec['read_mib_s'][a]:7.1f}" for a in replicas)
            echo(f"file {i + 1:>{width}}/{files}  {size / MIB:7.1f} MiB  {where:18}  write {rec['write_mib_s']:7.1f} "
                 f"MiB/s  read/replica {reads} MiB/s  {'ok' if rec['ok'] else 'MISMATCH'}")
        after = {}
        for addr in replicas:
            try:
                after[addr] = (await admin.node_status(dc, addr))["counters"]
            except ClientError:
                after[addr] = None
    nodes_delta = {}
    for addr in replicas:
        if before.get(addr) and after.get(addr):
            nodes_delta[addr] = {k: after[addr][k] - before[addr][k]
                                 for k in ("writes", "replica_writes", "write_bytes", "reads", "read_bytes",
                                           "forwarded", "replication_failures")}
    return {"partition": pid, "replicas": replicas, "files": files, "bytes": w_bytes,
            "write": {"seconds": round(w_secs, 3), "mib_s": round(_rate(w_bytes, w_secs), 1)},
            "read": {a: {"seconds": round(r_secs[a], 3), "mib_s": round(_rate(r_bytes[a], r_secs[a]), 1)}
                     for a in replicas},
            "verified": not mismatches, "mismatches": mismatches, "node_counters": nodes_delta,
            "per_file": per_file}


@click.command(cls=Command, context_settings=CTX)
@cluster_option(required=True, help="A running local cluster (dnctl cluster up).")
@click.option("--mib", type=click.IntRange(1, 1 << 16), default=300, show_default=True,
              help="Total MiB to write.")
@click.option("--files", type=click.IntRange(1, 10000), default=12, show_default=True,
              help="Split into this many files.")
@click.option("--partition", "pid", type=click.IntRange(1), default=1, show_default=True)
@click.option("--seed", type=int, default=1, show_default=True, help="Seed of the random file contents.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON result at the end (progress on stderr).")
def demo_command(cluster, mib, files, pid, seed, as_json):
    """Write random files through the SDK, read every one back from EACH replica, verify the bytes.

    \b
    dnctl cluster up --nodes 3 --cluster /tmp/dn
    dnctl demo --cluster /tmp/dn                  # 300 MiB in 12 files
    dnctl demo --cluster /tmp/dn --mib 100 --files 4 --json

    Prints a line per file (where it went, write MiB/s, read MiB/s from each replica), then a summary;
    exit status 1 if any byte differs.
    """
    if files > mib * MIB:
        raise click.BadParameter("more files than bytes", param_hint="--files")
    nodes = cluster_nodes(cluster)

    def echo(line):
        click.echo(line, err=as_json)

    res = run(run_demo, nodes, pid, mib, files, seed, echo)
    if as_json:
        click.echo(json.dumps(res, indent=2, sort_keys=True))
    else:
        echo("")
        for addr, d in res["node_counters"].items():
            echo(f"  {addr:21} client writes {d['writes']:>6}  replica writes {d['replica_writes']:>6}  "
                 f"{d['write_bytes'] / MIB:8.1f} MiB stored  reads {d['reads']:>6}  "
                 f"replication failures {d['replication_failures']}")
        reads = ", ".join(f"{a} {d['mib_s']:.1f}" for a, d in res["read"].items())
        echo(f"summary: {res['files']} files, {res['bytes'] / MIB:.1f} MiB, written at {res['write']['mib_s']:.1f} "
             f"MiB/s (x{len(res['replicas'])} replicas); read back at {reads} MiB/s; "
             + ("all bytes verified on every replica" if res["verified"] else
                f"{len(res['mismatches'])} MISMATCH(ES)"))
        for m in res["mismatches"]:
            echo(f"  mismatch: {m}")
    if not res["verified"]:
        raise SystemExit(1)
