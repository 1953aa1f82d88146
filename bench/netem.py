"""`dnctl bench` at loopback and across hosts with a network's round trip between them, in one run.

    python -m bench.netem                          # loopback, 0, 0.5 and 5 ms, 0.5 ms with 0.1% loss; 3 rounds
    python -m bench.netem --rtt 0.5 --rounds 1 --seconds 10 --json

Three datanodes and the bench's client, each on its own host (tools/netns.py: network namespaces joined by
a router process that holds every packet for half the round trip, with jitter of a tenth of it); `dnctl
bench` puts its scratch partition on all three, so a write crosses the round trip twice (client -> leader,
leader -> followers).  "loopback" is three more nodes on 127.0.0.1, running beside them; "0 ms" is the
network without delay -- what the router itself costs -- so a delayed row reads against both.  A last row
adds per-frame loss (--loss, 0.1%) at 0.5 ms: what loss does, apart from latency.

For each configuration (request size x depth, one client: 4 KiB x 1, 4 KiB x 16, 1 MiB x 8) the table gives
write and read throughput and p50/p99 latency, the medians of ``--rounds`` rounds; a round runs every
setting once, one after the other, so load from elsewhere on the machine falls on all of them alike.  Each
row has the round trip measured there (the fastest of 20 PINGs: the nodes' and the router's own time
included) and what TCP retransmitted (segments / timeouts) on the hosts.  Needs root.

Pipelining keeps throughput when the round trip grows: a client keeps depth x size in flight, so a write's
few extra round trips add to its latency, not to the time between two writes.  The last lines compare
1 MiB x 8 writes at 0.5 ms with loopback and with 0 ms.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
from collections import Counter


import trio

from client.sdk import DataClient
from tools.cluster import NodeProc, cluster_secret, free_port
from tools.netns import Network, unavailable
from wire.protocol import Header, Op, Result

REPO = pathlib.Path(__file__).resolve().parent.parent
CONFIGS = [("4KiB", 1), ("4KiB", 16), ("1MiB", 8)]
NODE_CFG = {"pool_mib": 128, "sync": "always", "transport": "tcp", "log_level": "warning"}
HOSTS = ["n1", "n2", "n3"]


def start_nodes(root: pathlib.Path, addrs: list[str], prefixes: list[list[str]], secret: str) -> list[NodeProc]:
    procs = []
    for i, (addr, prefix) in enumerate(zip(addrs, prefixes)):
        p = NodeProc(root / f"node{i + 1}", addr, **NODE_CFG, secret_file=secret)
        p.argv_prefix = prefix
        procs.append(p)
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(procs)) as ex:
            for f in [ex.submit(p.start, 60) for p in procs]:
                f.result()
    except BaseException:
        stop_nodes(procs)
        raise
    return procs


def stop_nodes(procs: list[NodeProc]) -> None:
    for p in procs:
        p.stop(timeout=20)


def measured_rtt_ms(addr: str, secret: str, n: int = 20) -> float:
    async def go():
        async with DataClient.from_env(transport="tcp", timeout=10, pool_mib=2, secret=secret) as dc:
            times = []
            for _ in range(n + 1):
                t = trio.current_time()
                resp, _ = await dc.request(addr, Header(opcode=Op.PING))
                if resp.result != Result.OK:
                    raise RuntimeError(f"PING {addr}: {resp.result_text()}")
                times.append(trio.current_time() - t)
            return min(times[1:]) * 1e3      # the floor (the first one also connects): loaded nodes add to it
    return trio.run(go)


def tcp_counters(prefixes: list[list[str]]) -> Counter:
    """TCP's retransmitted segments and retransmission timeouts, summed over the hosts (each namespace's own
    counters; none for loopback, whose counters the whole machine shares)."""
    total: Counter = Counter()
    for prefix in prefixes:
        text = subprocess.run([*prefix, "cat", "/proc/net/snmp", "/proc/net/netstat"], capture_output=True,
                              text=True, timeout=30, check=True).stdout.splitlines()
        for names, values in zip(text[::2], text[1::2]):
            kind = names.split(":")[0]
            row = dict(zip(names.split()[1:], map(int, values.split()[1:])))
            if kind == "Tcp":
                total["retrans"] += row.get("RetransSegs", 0)
            elif kind == "TcpExt":
                total["rto"] += row.get("TCPTimeouts", 0)
    return total


def bench(addrs: list[str], size: str, depth: int, seconds: float, prefix: list[str], secret: str) -> dict:
    """One `dnctl bench` run (write, then read) against a scratch partition on ``addrs``, its client run
    under ``prefix`` (on its own host)."""
    out = subprocess.run([*prefix, sys.executable, "-P", "-m", "tools.dnctl", "--secret-file", secret, "bench", "--nodes", ",".join(addrs),
                          "--size", size, "--depth", str(depth), "--clients", "1", "--seconds", str(seconds),
                          "--transport", "tcp", "--json"], capture_output=True, text=True, cwd=REPO,
                         timeout=seconds * 4 + 300)
    if out.returncode != 0:
        raise RuntimeError(f"dnctl bench {size} x {depth}: {out.stderr.strip().splitlines()[-1:]}")
    rows = {r["phase"]: r for r in json.loads(out.stdout)["results"]}
    return {phase: {"mib_s": r["mib_s"], "p50_ms": r["latency_ms"]["p50"], "p99_ms": r["latency_ms"]["p99"],
                    "errors": r["errors"]} for phase, r in rows.items()}


def settings(rtts: list[float], loss: float) -> list[dict]:
    """What to run, in each round's order."""
    out = [{"label": "loopback", "net": None}]
    out += [{"label": f"{rtt:g} ms", "net": (rtt, rtt / 10, 0.0)} for rtt in rtts]
    if loss:
        out.append({"label": f"0.5 ms {loss:.1%}", "net": (0.5, 0.05, loss)})
    return out


def run(args, rtts: list[float], root: pathlib.Path) -> list[dict]:
    plan = settings(rtts, args.loss)
    samples: dict = {s["label"]: {"rtt": [], "configs": {f"{sz} x {d}": [] for sz, d in CONFIGS}} for s in plan}
    # nodes on other hosts talk only with a secret (one without takes its own host's peers only): all get it
    secret = cluster_secret(root)
    local = start_nodes(root / "loopback", [f"127.0.0.1:{free_port()}" for _ in range(3)], [[]] * 3, secret)
    try:
        with Network([*HOSTS, "client"], loss=0.0) as net:
            procs = start_nodes(root / "net", [f"{net.addr(h)}:17310" for h in HOSTS], [net.prefix(h) for h in HOSTS],
                                secret)
            try:
                for rnd in range(args.rounds):
                    for s in plan:
                        if s["net"] is None:
                            addrs, client, hosts = [p.addr for p in local], [], []
                        else:
                            net.set(*s["net"])
                            addrs, client = [p.addr for p in procs], net.prefix("client")
                            hosts = [net.prefix(h) for h in [*HOSTS, "client"]]
                        rtt = measured_rtt_ms(addrs[0], secret)
                        samples[s["label"]]["rtt"].append(rtt)
                        print(f"round {rnd + 1}/{args.rounds} {s['label']}: round trip {rtt:.3f} ms", file=sys.stderr)
                        for size, depth in CONFIGS:
                            before = tcp_counters(hosts)
                            res = bench(addrs, size, depth, args.seconds, client, secret)
                            res["tcp"] = dict(tcp_counters(hosts) - before) if hosts else None
                            samples[s["label"]]["configs"][f"{size} x {depth}"].append(res)
                            w = res.get("write", {})
                            print(f"  {size} x {depth}: write {w.get('mib_s')} MiB/s", file=sys.stderr)
            finally:
                stop_nodes(procs)
    finally:
        stop_nodes(local)
    return [{"setting": label, "rtt_measured_ms": round(statistics.median(v["rtt"]), 3),
             "configs": {name: _median(runs) for name, runs in v["configs"].items()}, "rounds": v}
            for label, v in samples.items()]


def _median(runs: list[dict]) -> dict:
    out = {}
    for phase in ("write", "read"):
        got = [r[phase] for r in runs if phase in r]
        if got:
            out[phase] = {k: round(statistics.median(g[k] or 0 for g in got), 3) for k in ("mib_s", "p50_ms", "p99_ms")}
            out[phase]["errors"] = sum(g["errors"] for g in got)
    tcp = [r["tcp"] for r in runs if r.get("tcp") is not None]
    if tcp:
        out["tcp"] = {k: sum(t.get(k, 0) for t in tcp) for k in ("retrans", "rto")}
    return out


def table(rows: list[dict], rounds: int) -> str:
    lines = [f"{'setting':13} {'rtt ms':>7}  {'size x depth':12} {'write MiB/s':>11} {'p50 ms':>7} {'p99 ms':>7}"
             f" {'read MiB/s':>11} {'p50 ms':>7} {'p99 ms':>7}  TCP retrans/RTOs"]
    for r in rows:
        for name, c in r["configs"].items():
            w, rd = c.get("write", {}), c.get("read", {})
            tcp = f"{c['tcp']['retrans']}/{c['tcp']['rto']}" if "tcp" in c else "-"
            lines.append(f"{r['setting']:13} {r['rtt_measured_ms']:7.3f}  {name:12} {w.get('mib_s', 0):11.1f} "
                         f"{w.get('p50_ms', 0):7.2f} {w.get('p99_ms', 0):7.2f} {rd.get('mib_s', 0):11.1f} "
                         f"{rd.get('p50_ms', 0):7.2f} {rd.get('p99_ms', 0):7.2f}  {tcp}"
                         + ("  (errors)" if w.get("errors") or rd.get("errors") else ""))
    lines.append(f"(medians of {rounds} round(s); TCP counts summed over them)")
    by = {r["setting"]: r["configs"]["1MiB x 8"].get("write", {}).get("mib_s") for r in rows}
    half = by.get("0.5 ms")
    for base in ("loopback", "0 ms"):
        if half and by.get(base):
            lines.append(f"1 MiB x 8 writes at 0.5 ms: {half / by[base]:.0%} of {base}")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rtt", default="0,0.5,5", help="round trips in ms, comma-separated (default 0,0.5,5)")
    ap.add_argument("--loss", type=float, default=0.001,
                    help="frame loss of the extra 0.5 ms row (default 0.001; 0: no such row)")
    ap.add_argument("--seconds", type=float, default=4.0, help="length of each bench phase (default 4)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of every setting, interleaved (default 3)")
    ap.add_argument("--json", action="store_true", help="print the rows (and every round's figures) as JSON")
    args = ap.parse_args()
    try:
        rtts = [float(x) for x in args.rtt.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--rtt: {args.rtt!r} is not a list of numbers like 0,0.5,5")
    if any(r < 0 for r in rtts) or not 0 <= args.loss < 1 or args.rounds < 1 or args.seconds <= 0:
        ap.error("round trips must be >= 0, the loss in [0, 1), rounds and seconds positive")
    why = unavailable()
    if why:
        sys.exit(f"bench/netem.py: {why}")
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="dn-netem-") as tmp:
        try:
            rows = run(args, rtts, pathlib.Path(tmp))
        except RuntimeError as e:
            sys.exit(f"bench/netem.py: {e}")
    load1 = os.getloadavg()
    if args.json:
        print(json.dumps({"rows": rows, "loadavg": [load0, load1], "loss": args.loss}, indent=2))
    else:
        print(table(rows, args.rounds))
        print(f"load average {load0[0]:.2f} before, {load1[0]:.2f} after ({os.cpu_count()} CPUs): "
              f"other work on the machine moves these figures")
    return 0


if __name__ == "__main__":
    sys.exit(main())
