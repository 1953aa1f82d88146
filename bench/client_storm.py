"""Many SDK clients opening at once against one cluster: failures, open time, etcd's cost.

    python -m bench.client_storm --cluster DIR [--clients 100] [--per-process 1] [--via auto] [--json]
    python -m bench.client_storm --clients 100            # starts a default secured local cluster of its own

Each process imports the SDK, says it is ready and waits; once all are ready they are released together
and each opens ``DataClient.open`` as a script would with the cluster's client credentials (the secret
claiming the client role, the etcd ``mount`` user), checks it knows a partition, and reports its open time.
``--per-process N`` opens N clients as tasks of one process (each a separate ``DataClient``: its own
connections, and through etcd its own login and watch), to reach a thousand clients on a small machine.  A
client counts as open once ``DataClient.open`` returned with the map read and a partition known: its hello
(the session's key exchange and proofs), the map (MAP_READ from one node, or etcd's login and read) and one
PARTITION_LIST.

Many clients on one host share its address, and a datanode bounds the hellos in progress per address
(``preauth_per_host``: a flood from one address costs that address alone).  Clients of a real cluster come
from many hosts, so each client here connects from an address of its own in 127.0.0.0/8 (``source_address``;
Linux routes the whole block to loopback); ``--one-address`` makes them all 127.0.0.1 instead.

Printed: clients, failures (with the first errors), open time p50/p99/max, the CPU etcd spent and the CPU
the datanodes and the client processes spent per client open (/proc, from the go until all are open and a
second more), etcd's ``grpc_server_started_total`` for Authenticate and Watch, and how many TCP connections
etcd held (``ss``): before, at the most while the clients opened, and with all of them open.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

REPO = pathlib.Path(__file__).resolve().parent.parent

# one process: import, say ready, wait for the go line, open N clients at once, print one JSON line per
# client, then hold them open until stdin closes (so etcd's connections can be counted meanwhile)
CHILD = r"""
import json, logging, sys, time
import trio
logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
from client.sdk import DataClient
from wire.etcdmap import EtcdAccess, _client_class
_client_class()          # etcd3gw and requests imported: the open is timed, not the imports
url, cred, secret, timeout, n = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]), int(sys.argv[5])
nodes, via, first = [a for a in sys.argv[6].split(",") if a], sys.argv[7], int(sys.argv[8])
access = EtcdAccess.load(**json.loads(cred)) if cred else None
print("ready", flush=True)
sys.stdin.readline()

def source(i):
    # client i's own loopback address: 127.1.0.1, 127.1.0.2, ... (first < 0: the host's one address)
    return "" if first < 0 else f"127.{1 + i // 62500}.{i // 250 % 250}.{i % 250 + 1}"

async def one(done, i):
    t0 = time.monotonic()
    try:
        async with DataClient.from_env(nodes, transport="tcp", pool_mib=4, etcd=url, etcd_access=access,
                                   secret=secret or None, role="client" if secret else None,
                                   timeout=timeout, map_via=via,
                                   source_address=source(first + i)) as dc:
            took = time.monotonic() - t0
            if not dc.partitions:
                raise RuntimeError("opened, but knows no partition")
            print(json.dumps({"ok": True, "open_s": took, "partitions": len(dc.partitions)}), flush=True)
            done.release()
            await trio.sleep_forever()
    except Exception as e:
        print(json.dumps({"ok": False, "open_s": time.monotonic() - t0, "error": f"{type(e).__name__}: {e}"}),
              flush=True)
        done.release()

async def main():
    done = trio.Semaphore(0)
    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(one, done, i)
        for _ in range(n):
            await done.acquire()
        print("opened", flush=True)
        await trio.to_thread.run_sync(sys.stdin.readline)
        nursery.cancel_scope.cancel()

trio.run(main)
"""


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _started(url: str, tls=None) -> dict[str, float]:
    """etcd's ``grpc_server_started_total`` by method (``tls``: an ssl context where it requires a certificate)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10, context=tls) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for m in re.finditer(r'^grpc_server_started_total\{grpc_method="([^"]+)".*\}\s+(\S+)$', text, re.M):
        out[m.group(1)] = out.get(m.group(1), 0) + float(m.group(2))
    return out


def _connections(port: int) -> int:
    """Established TCP connections to etcd's client port (its side of them)."""
    out = subprocess.run(["ss", "-Htn", "state", "established", f"( sport = :{port} )"], capture_output=True,
                         text=True).stdout
    return sum(1 for line in out.splitlines() if line.strip())


def storm(cluster: pathlib.Path, clients: int, per_process: int = 1, timeout: float = 15.0,
          via: str = "etcd", one_address: bool = False) -> dict:
    """Open ``clients`` SDK clients at once against the local cluster in ``cluster`` (``dnctl cluster up``'s
    directory), each following the map ``via`` etcd or the cluster's nodes (``DataClient(map_via=)``, with
    the nodes given to open), each from an address of its own (``one_address``: all from 127.0.0.1);
    returns what ``main`` prints."""
    from tools.cluster import local_access_files, local_tls
    info = json.loads((cluster / "cluster.json").read_text())
    info["nodes"] = [n for n in info["nodes"] if n.get("pid") and pathlib.Path(f"/proc/{n['pid']}").exists()]
    url = info["etcd"]["url"]
    files = local_access_files(info["etcd"], "mount")      # its etcd user and, where required, certificate
    cred = json.dumps(files) if files else ""
    secret = info["config"].get("secret_file") or ""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    counts = [per_process] * (clients // per_process) + ([clients % per_process] if clients % per_process else [])
    nodes = ",".join(n["addr"] for n in info["nodes"]) if via != "etcd" else ""
    warnings: list[str] = []
    firsts = [-1 if one_address else sum(counts[:j]) for j in range(len(counts))]
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, url, cred, secret, str(timeout), str(k), nodes, via,
                               str(first)],
                              cwd=REPO,
                              env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for k, first in zip(counts, firsts)]
    try:
        for p in procs:
            line = p.stdout.readline()
            if line.strip() != "ready":
                raise RuntimeError(f"a client process did not start: {line!r} {p.stderr.read()[-2000:]}")
        etcd_pid = info["etcd"]["pid"]
        node_pids = [n["pid"] for n in info["nodes"]]
        cpu0, rpc0 = _cpu_s(etcd_pid), _started(url, local_tls(info["etcd"]))
        nodes0, clients0 = sum(map(_cpu_s, node_pids)), sum(_cpu_s(p.pid) for p in procs)
        conns0 = _connections(info["etcd"]["client_port"])
        peak, sampling = [conns0], threading.Event()

        def sample() -> None:           # the most connections etcd held at once, from the go on
            while not sampling.wait(0.1):
                peak[0] = max(peak[0], _connections(info["etcd"]["client_port"]))
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        results = []
        for p, k in zip(procs, counts):
            while True:
                line = p.stdout.readline()
                if not line or line.strip() == "opened":
                    break
                results.append(json.loads(line))
            if len(results) < sum(counts[:procs.index(p) + 1]):
                results.append({"ok": False, "open_s": float("nan"), "error": "process died: "
                                + p.stderr.read()[-500:]})
        time.sleep(1.0)           # the follow tasks are up: count etcd's connections with every client open
        conns = _connections(info["etcd"]["client_port"])
        sampling.set()
        sampler.join()
        cpu1, rpc1 = _cpu_s(etcd_pid), _started(url, local_tls(info["etcd"]))
        nodes1, clients1 = sum(map(_cpu_s, node_pids)), sum(_cpu_s(p.pid) for p in procs)
    finally:
        for p in procs:
            try:
                p.stdin.close()
            except OSError:
                pass
        for p in procs:
            try:
                p.wait(timeout=30)
                warnings.extend(line for line in p.stderr.read().splitlines() if line.strip())
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    opens = sorted(r["open_s"] for r in results if r["ok"])
    counted: dict[str, int] = {}
    for w in warnings:
        w = re.sub(r"\d+(\.\d+)?", "N", w)[:200]     # alike warnings once, with their count
        counted[w] = counted.get(w, 0) + 1

    def pct(q: float) -> float:
        return round(opens[min(len(opens) - 1, int(q * len(opens)))], 3) if opens else float("nan")
    errors = [r["error"] for r in results if not r["ok"]]
    return {"clients": clients, "via": via, "processes": len(procs), "addresses": 1 if one_address else clients,
            "failed": len(errors), "errors": errors[:5],
            "open_p50_s": pct(0.50), "open_p99_s": pct(0.99), "open_max_s": round(opens[-1], 3) if opens else None,
            "etcd_cpu_s": round(cpu1 - cpu0, 2),
            "nodes_cpu_ms_per_client": round((nodes1 - nodes0) * 1000 / clients, 2),
            "client_cpu_ms_per_client": round((clients1 - clients0) * 1000 / clients, 2),
            "etcd_authenticate": rpc1.get("Authenticate", 0) - rpc0.get("Authenticate", 0),
            "etcd_watch_streams": rpc1.get("Watch", 0) - rpc0.get("Watch", 0),
            "etcd_connections_before": conns0, "etcd_connections_open": conns,
            "etcd_connections_peak": max(peak[0], conns),
            "partitions_seen": sorted({r["partitions"] for r in results if r["ok"]}),
            "client_warnings": sorted(counted.items(), key=lambda kv: -kv[1])[:5]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cluster", type=pathlib.Path, help="a running local cluster (dnctl cluster up); default: "
                    "start a default secured one of 3 nodes in a temporary directory")
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--per-process", type=int, default=1, help="clients opened by each process")
    ap.add_argument("--timeout", type=float, default=15.0, help="each client's timeout (its open's deadline)")
    ap.add_argument("--via", choices=("etcd", "nodes", "auto"), default="etcd",
                    help="where the clients follow the map (DataClient's map_via; not etcd: the nodes are given)")
    ap.add_argument("--one-address", action="store_true",
                    help="every client connects from 127.0.0.1 (default: each from its own 127.x.y.z)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    tmp = None
    cluster = a.cluster
    if cluster is None:
        tmp = tempfile.TemporaryDirectory()
        cluster = pathlib.Path(tmp.name) / "c"
        subprocess.run([sys.executable, "-m", "tools.dnctl", "cluster", "up", "--nodes", "3", "--cluster",
                        str(cluster)], cwd=REPO, check=True, capture_output=True)
    try:
        out = storm(cluster, a.clients, a.per_process, a.timeout, a.via, a.one_address)
    finally:
        if tmp is not None:
            subprocess.run([sys.executable, "-m", "tools.dnctl", "cluster", "down", "--cluster", str(cluster)],
                           cwd=REPO, capture_output=True)
            tmp.cleanup()
    print(json.dumps(out) if a.json else "\n".join(f"{k:24} {v}" for k, v in out.items()))


if __name__ == "__main__":
    main()
