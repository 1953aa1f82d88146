"""What the trust boundaries cost on the data path (TCP): appends of 4 KiB and 1 MiB, one after another, through
three scratch datanodes started side by side in the same run:

    off     no secret (no authentication; grants and limits still apply: they are always on)
    nomac   a cluster secret, the node a copy of this tree that speaks the protocol before sessions (the
            authenticated hello, role checks per request, no frame MACs): what a session adds is auth - nomac
    auth    a cluster secret: an authenticated session (every control message MAC'd: wire/session.py)
    tls     a cluster secret and TLS on the stream (transport/tls.py)

Rounds alternate between the settings so that the machine's noise hits each alike.  Prints, per setting and
size, appends/s, MiB/s, p50/p99 latency and CPU per append (the node's and this client's, from /proc and
process_time), then the same-run ratios of auth to nomac.  Needs the ``openssl`` CLI (a throwaway CA in a
temp dir).

    .venv/bin/python -m bench.trust_cost [--rounds 5] [--seconds 2]
"""
from __future__ import annotations

import argparse
import pathlib
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import trio


from client.sdk import DataClient
from wire.protocol import Op
from tools.cluster import NodeProc, cluster_secret, cpu_seconds, free_port
from wire.protocol import SESSIONS_SINCE

KiB, MiB = 1 << 10, 1 << 20
SIZES = (4 * KiB, MiB)


def make_pki(d: pathlib.Path) -> tuple[str, str, str]:
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run = lambda *a: subprocess.run(["openssl", *a], check=True, capture_output=True, cwd=d)  # noqa: E731
    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj", "/CN=bench CA")
    run("req", *ec, "-keyout", "node.key", "-out", "node.csr", "-subj", "/CN=127.0.0.1")
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    run("x509", "-req", "-in", "node.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out",
        "node.pem", "-days", "1", "-extfile", "san.ext")
    return str(d / "ca.pem"), str(d / "node.pem"), str(d / "node.key")


REPO = pathlib.Path(__file__).resolve().parent.parent


def tree_before_sessions(dest: pathlib.Path) -> pathlib.Path:
    """A copy of this tree's packages whose newest protocol is the one before sessions."""
    for pkg in ("wire", "datanode", "client", "manager", "tools"):
        shutil.copytree(REPO / pkg, dest / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    proto = dest / "wire/protocol.py"
    text, n = re.subn(r"^VERSION = \d+", f"VERSION = {SESSIONS_SINCE - 1}", proto.read_text(), flags=re.M)
    assert n == 1, "wire/protocol.py has no VERSION line to patch"
    proto.write_text(text)
    return dest


async def appends(addr: str, client_kw: dict, size: int, seconds: float) -> list[float]:
    data = random.Random(size).randbytes(size)
    lat = []
    async with DataClient.from_env([addr], timeout=30, pool_mib=16, transport="tcp", **client_kw) as dc:
        eid, off = await dc.create_extent(1), 0
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            if off + size > 100 * MiB:
                eid, off = await dc.create_extent(1), 0
            t0 = time.perf_counter()
            await dc.append(1, eid, off, data)
            lat.append(time.perf_counter() - t0)
            off += size
    return lat


async def setup(addr: str, client_kw: dict) -> None:
    async with DataClient.from_env([], timeout=30, pool_mib=4, transport="tcp", **client_kw) as dc:
        await dc.admin(addr, Op.PARTITION_CREATE, partition=1, body={"replicas": [addr], "epoch": 1})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=2.0, help="per round, setting and size")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="trustcost-") as d:
        d = pathlib.Path(d)
        ca, cert, key = make_pki(d)
        secret = cluster_secret(d)
        old = tree_before_sessions(d / "nomac-tree")
        settings = {"off": ({}, {}),
                    "nomac": ({"secret_file": secret}, {"secret": secret}),
                    "auth": ({"secret_file": secret}, {"secret": secret}),
                    "tls": ({"secret_file": secret, "tls_cert": cert, "tls_key": key},
                            {"secret": secret, "tls_ca": ca})}
        nodes = {}
        try:
            for name, (cfg, ckw) in settings.items():
                n = NodeProc(d / name, f"127.0.0.1:{free_port()}", transport="tcp", sync="none", pool_mib=64, **cfg)
                if name == "nomac":
                    n.argv_prefix = ["env", f"PYTHONPATH={old}"]
                n.start()
                nodes[name] = n
                trio.run(setup, n.addr, ckw)
            lat = {(name, size): [] for name in settings for size in SIZES}
            cpu = {(name, size): 0.0 for name in settings for size in SIZES}
            for r in range(args.rounds):
                for size in SIZES:
                    for name in (list(settings) if r % 2 == 0 else list(reversed(settings))):
                        node0, me0 = cpu_seconds(nodes[name].pid), time.process_time()
                        lat[name, size] += trio.run(appends, nodes[name].addr, settings[name][1], size, args.seconds)
                        cpu[name, size] += cpu_seconds(nodes[name].pid) - node0 + time.process_time() - me0
        finally:
            for n in nodes.values():
                n.stop()
    total = args.rounds * args.seconds
    print(f"{'setting':8} {'size':>8} {'appends/s':>10} {'MiB/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'CPU us/op':>10}")
    for size in SIZES:
        for name in settings:
            xs = sorted(lat[name, size])
            p99 = xs[min(len(xs) - 1, int(0.99 * len(xs)))]
            print(f"{name:8} {size:>8} {len(xs) / total:>10.0f} {len(xs) * size / MiB / total:>8.1f} "
                  f"{statistics.median(xs) * 1e3:>8.3f} {p99 * 1e3:>8.3f} {cpu[name, size] / len(xs) * 1e6:>10.1f}")
    per_op = {k: cpu[k] / len(lat[k]) for k in lat}
    print(f"sessions (auth / nomac, same run): 4 KiB CPU per append {per_op['auth', 4 * KiB] / per_op['nomac', 4 * KiB]:.3f}x, "
          f"1 MiB throughput {len(lat['auth', MiB]) / len(lat['nomac', MiB]):.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
