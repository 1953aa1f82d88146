"""The data-path cost of verbs memory windows: ``dnctl bench`` over verbs with windows on and off, alternated
in one run of the Soft-RoCE VM.

    lab/softroce-vm run -- python -m bench.mw_cost [--rounds 2] [--seconds 3] [--json]

Each round brings up a 3-node verbs cluster (sync none: the disk stays out of the way) with
``DATANODE_RDMA_WINDOWS`` = 1 (on: per-request type-2 windows, bound by the requester on its queue pair
and invalidated after the answer) or 0 (off: MR-wide rkeys), for the daemons and the bench client alike,
and runs ``dnctl bench --replicas 3`` at 4 KiB depth 1, 4 KiB depth 16 and 1 MiB depth 8.  Modes alternate
(on, off, on, off, ...) so drift in the VM hits both.  Prints ops/s, MiB/s and p50/p99 latency per case and
mode (the median over rounds) and the ratio on/off.  Absolute numbers are slow (TCG emulation).
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

import click

DEV = os.environ.get("DATANODE_RDMA_DEVICE", "rxe0")
CASES = [("4KiB", 1), ("4KiB", 16), ("1MiB", 8)]


def dnctl(env: dict, *args: str, timeout: float = 900) -> str:
    r = subprocess.run([sys.executable, "-m", "tools.dnctl", *args], capture_output=True, text=True,
                       timeout=timeout, env=env)
    if r.returncode != 0 and "--json" in args and r.stdout.lstrip().startswith("{"):
        return r.stdout                   # a bench with request errors: its numbers count them ("errors")
    if r.returncode != 0:
        raise SystemExit(f"dnctl {' '.join(args)} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    return r.stdout


def one_round(windows: bool, seconds: float, root: str) -> dict:
    env = {**os.environ, "DATANODE_RDMA_WINDOWS": "1" if windows else "0"}
    d = os.path.join(root, "on" if windows else "off")
    dnctl(env, "cluster", "up", "--nodes", "3", "--cluster", d, "--transport", "verbs", "--sync", "none",
          "--pool-mib", "64", "--replica-timeout", "20")
    out = {}
    try:
        for size, depth in CASES:
            res = json.loads(dnctl(env, "bench", "--cluster", d, "--replicas", "3", "--size", size, "--depth",
                                   str(depth), "--seconds", str(seconds), "--transport", "verbs", "--json"))
            out[f"{size} depth {depth}"] = res
    finally:
        try:
            dnctl(env, "cluster", "down", "--cluster", d)
        except SystemExit as e:           # a failed teardown does not void the numbers taken
            print(f"warning: {e}", file=sys.stderr)
    return out


def rows(res: dict) -> dict:
    """phase -> the bench row (write / read)."""
    return {r.get("phase"): r for r in res.get("results", [])}


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--rounds", type=click.IntRange(1, 10), default=2, show_default=True,
              help="Rounds per mode (on and off alternate).")
@click.option("--seconds", type=click.FloatRange(0.5, 600), default=3.0, show_default=True,
              help="Length of each bench phase.")
@click.option("--json", "as_json", is_flag=True, help="Also print every raw bench result.")
def main(rounds, seconds, as_json) -> None:
    """Verbs memory windows on vs off, dnctl bench in the Soft-RoCE VM (run it there)."""
    if not os.path.exists(f"/sys/class/infiniband/{DEV}"):
        print(f"no RDMA device {DEV}: run inside the VM: lab/softroce-vm run -- python -m bench.mw_cost")
        sys.exit(2)
    root = tempfile.mkdtemp(prefix="mwcost-")
    raw: dict[str, list[dict]] = {"on": [], "off": []}
    try:
        for i in range(rounds):
            for mode in ("on", "off"):
                print(f"round {i + 1}: windows {mode}", file=sys.stderr, flush=True)
                raw[mode].append(one_round(mode == "on", seconds, root))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if as_json:
        print(json.dumps(raw, indent=2))
    print(f"dnctl bench --replicas 3 over verbs, {rounds} round(s) per mode alternated, {seconds:g}s phases; "
          "median over rounds")
    print(f"{'case':18} {'phase':5} {'mode':4} {'ops/s':>9} {'MiB/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'errors':>6}")
    for size, depth in CASES:
        case = f"{size} depth {depth}"
        for phase in ("write", "read"):
            med = {}
            for mode in ("on", "off"):
                rs = [rows(r[case]).get(phase, {}) for r in raw[mode]]
                flat = [{"ops_s": x.get("iops"), "mib_s": x.get("mib_s"),
                         "p50_ms": (x.get("latency_ms") or {}).get("p50"),
                         "p99_ms": (x.get("latency_ms") or {}).get("p99"), "errors": x.get("errors")} for x in rs]
                med[mode] = {k: statistics.median([float(x.get(k) or 0) for x in flat])
                             for k in ("ops_s", "mib_s", "p50_ms", "p99_ms", "errors")}
                m = med[mode]
                print(f"{case:18} {phase:5} {mode:4} {m['ops_s']:9.0f} {m['mib_s']:8.1f} {m['p50_ms']:8.2f} "
                      f"{m['p99_ms']:8.2f} {m['errors']:6.0f}")
            if med["off"]["ops_s"]:
                print(f"{'':18} {phase:5} on/off ops/s = {med['on']['ops_s'] / med['off']['ops_s']:.3f}")


if __name__ == "__main__":
    main()
