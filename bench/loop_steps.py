"""Scheduler work per request: passes of each process's trio loop and task steps, by where the task waited.

Latency and CPU move 30-100% between adjacent rounds on a shared VM; what a change does to the event loop's
work per request does not.  This runs a local 3-node cluster and `dnctl bench` with a trio instrument in
every node and bench client (put there by a ``sitecustomize`` on PYTHONPATH: no change to the code under
test), and prints per request, for the leader, each follower and the client: loop passes (each an
``epoll_wait``, the run queue's batch and trio's bookkeeping), of them the ones that blocked, task steps, and
the await sites the steps resumed from, most first.

    python -m bench.loop_steps -- --size 4KiB --depth 1 --seconds 8 --mode write
    python -m bench.loop_steps --variant base=/tmp/main-copy --variant now=. --top 12 -- --size 1MiB \\
        --depth 8 --total-mib 1024 --mode write

Requests are the bench's measured ones; the steps also hold the cluster's start and the scratch partition's
set-up (a few hundred), and with ``--mode read`` the unmeasured prefill's writes.  The instrument itself
costs CPU: read latencies and rates here as the instrumented run's, not the code's.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

HOOK = r'''
import collections, json, os, sys
import trio

OUT = os.environ["LOOP_STEPS_OUT"]


def _site(task):
    parts, coro = [], task.coro
    while coro is not None:
        fr = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if fr is None:
            break
        parts.append(f"{fr.f_code.co_name}:{fr.f_lineno}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return task.name.rsplit(".", 1)[-1] + " @ " + " > ".join(parts[-3:])


class _Steps(trio.abc.Instrument):
    def __init__(self):
        self.sites, self.passes, self.blocked = collections.Counter(), 0, 0

    def before_task_step(self, task):
        self.sites[_site(task)] += 1

    def after_io_wait(self, timeout):
        self.passes += 1
        self.blocked += timeout > 0

    def after_run(self):
        with open(os.path.join(OUT, f"steps.{os.getpid()}.json"), "w") as f:
            json.dump({"argv": sys.argv, "passes": self.passes, "blocked": self.blocked,
                       "sites": self.sites.most_common()}, f)


_run = trio.run


def run(*args, instruments=(), **kw):
    return _run(*args, instruments=(*instruments, _Steps()), **kw)


trio.run = run
'''


def dnctl(code: pathlib.Path, hook: str, out: str, *args: str, check: bool = False):
    env = {**os.environ, "PYTHONPATH": f"{hook}:{code}", "LOOP_STEPS_OUT": out}
    # cwd: ``python -c`` puts the working directory ahead of PYTHONPATH (as in perf_ab.py)
    p = subprocess.run([sys.executable, "-c", "from tools.dnctl import main; main()", *args], env=env,
                       cwd=code, capture_output=True, text=True)
    if check and p.returncode != 0:
        raise SystemExit(f"dnctl {' '.join(args[:2])} ({code}) failed: {p.stderr.strip()[-500:]}")
    return p


def measure(code: pathlib.Path, bench: list[str], sync: str) -> tuple[dict, list[dict]]:
    """One cluster and bench from ``code`` with the instrument in every process: (bench JSON, dumps)."""
    with tempfile.TemporaryDirectory(prefix="loop-steps-") as tmp:
        hook, out, cluster = (os.path.join(tmp, n) for n in ("hook", "out", "cluster"))
        os.mkdir(hook)
        os.mkdir(out)
        pathlib.Path(hook, "sitecustomize.py").write_text(HOOK)
        dnctl(code, hook, out, "cluster", "up", "--nodes", "3", "--cluster", cluster, "--sync", sync, check=True)
        try:
            p = dnctl(code, hook, out, "bench", "--cluster", cluster, *bench, "--json")
        finally:
            dnctl(code, hook, out, "cluster", "down", "--cluster", cluster)
        if p.returncode != 0 or "{" not in p.stdout:
            raise SystemExit(f"bench ({code}) failed: {p.stderr.strip()[-800:]}")
        result = json.loads(p.stdout[p.stdout.index("{"):])
        dumps = [json.loads(f.read_text()) | {"pid": int(f.name.split(".")[1])}
                 for f in pathlib.Path(out).glob("steps.*.json")]
    return result, dumps


def report(name: str, result: dict, dumps: list[dict], top: int) -> None:
    requests = sum(r["requests"] for r in result["results"])
    if not requests:
        raise SystemExit(f"{name}: the bench made no request")
    role_of = {pid: addr for addr, pid in result["config"]["node_pids"].items()}
    leader = result["results"][0]["replica_nodes"][0]
    phases = ", ".join(f"{r['phase']} p50 {r['latency_ms']['p50']} ms" for r in result["results"])
    print(f"{name}: {requests} requests ({phases}; instrumented)")
    rows = []
    for d in dumps:
        if d["pid"] in role_of:
            role = "leader" if role_of[d["pid"]] == leader else "follower"
        elif "worker" in d["argv"]:
            role = "client"
        else:
            continue                # dnctl itself, the manager
        rows.append((["leader", "follower", "client"].index(role), role, d))
    for _, role, d in sorted(rows, key=lambda r: r[0]):
        steps = sum(n for _, n in d["sites"])
        print(f"  {role:8s} passes {d['passes'] / requests:5.2f} (blocking {d['blocked'] / requests:4.2f})  "
              f"task steps {steps / requests:5.2f} per request")
        for site, n in d["sites"][:top]:
            if n / requests >= 0.01:
                print(f"      {n / requests:6.3f}  {site}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", action="append", metavar="NAME=DIR",
                    help="a checkout to run the cluster and bench from (default: this one)")
    ap.add_argument("--sync", choices=["always", "none"], default="always")
    ap.add_argument("--top", type=int, default=6, help="await sites shown per process")
    ap.add_argument("bench", nargs=argparse.REMAINDER, help="-- then the dnctl bench options")
    a = ap.parse_args()
    bench = a.bench[1:] if a.bench[:1] == ["--"] else a.bench
    variants = [v.split("=", 1) for v in a.variant or [f"here={pathlib.Path(__file__).resolve().parent.parent}"]]
    for name, code in variants:
        result, dumps = measure(pathlib.Path(code).resolve(), bench, a.sync)
        report(name, result, dumps, a.top)


if __name__ == "__main__":
    main()
