"""The data path's targets in one run: each figure beside its goal and the baseline measured in the same run.

    python -m bench.targets --warm-memory ../shared/bench/warm-memory --out /tmp/targets [--verbs]
    python -m bench.targets --from /tmp/targets          # the table again, from a run's saved JSON

Runs one after the other (nothing else should run on the box meanwhile), each result saved in ``--out``:

1. the memory warmer, if given (a VM's guest memory is slow the first time it is touched);
2. a local 3-node cluster under ``sync = always``:
   ``floor``  ``bench/design_floor.py --cluster``: the trio floor of a 4 KiB durable write at depth 1 and
              ``dnctl bench`` on the cluster, turn by turn;
   ``4k_d1``  ``dnctl bench --size 4KiB --depth 1 --fio`` (fio's 4 KiB write+fdatasync on the same disk);
   ``4k_d16`` ``dnctl bench --size 4KiB --depth 16``;
   ``1m_d1``, ``1m_d8``  1 MiB durable writes at depth 1 and 8, each round against its own ``dd
              conv=fdatasync`` (``--dd --rounds``);
   ``cold``   1 MiB reads at depth 8 from a dropped page cache, each round against ``dd iflag=direct``;
3. a local 3-node cluster under ``sync = none``: ``buf_1m_d8``, ``buf_1m_d1``, ``buf_128k_d1``;
4. with ``--verbs``: ``bench/verbs_ratio.py`` in the Soft-RoCE VM (leader ingest / ``ib_read_bw``).

and prints the table (markdown): figure, goal, now, the same-run baseline, met or not.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
DNCTL = [sys.executable, "-m", "tools.dnctl"]

DURABLE = {   # name -> dnctl bench arguments, on the sync = always cluster
    "4k_d1": ["--size", "4KiB", "--depth", "1", "--mode", "write", "--seconds", "{s}", "--fio"],
    "4k_d16": ["--size", "4KiB", "--depth", "16", "--mode", "write", "--seconds", "{s}"],
    "1m_d1": ["--size", "1MiB", "--depth", "1", "--mode", "write", "--dd", "--rounds", "3", "--total-mib", "512"],
    "1m_d8": ["--size", "1MiB", "--depth", "8", "--mode", "write", "--dd", "--rounds", "4", "--total-mib", "1024"],
    "cold": ["--size", "1MiB", "--depth", "8", "--cold", "--rounds", "3", "--total-mib", "1024"],
}
BUFFERED = {  # on the sync = none cluster
    "buf_1m_d8": ["--size", "1MiB", "--depth", "8", "--mode", "write", "--total-mib", "2048"],
    "buf_1m_d1": ["--size", "1MiB", "--depth", "1", "--mode", "write", "--seconds", "{s}"],
    "buf_128k_d1": ["--size", "128KiB", "--depth", "1", "--mode", "write", "--seconds", "{s}"],
}


def run(cmd: list[str], out: pathlib.Path | None = None, timeout: float = 1800) -> str:
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:4])} ... failed ({p.returncode}): {p.stderr.strip()[-800:]}")
    if out is not None:
        out.write_text(p.stdout)
    return p.stdout


def measure(a, out: pathlib.Path) -> None:
    if a.warm_memory:
        run([a.warm_memory], out / "warm-memory.txt")
    with tempfile.TemporaryDirectory(prefix="targets-") as d:
        for sync, phases in (("always", DURABLE), ("none", BUFFERED)):
            cluster = os.path.join(d, sync)
            run([*DNCTL, "cluster", "up", "--nodes", "3", "--cluster", cluster, "--sync", sync])
            try:
                if sync == "always":
                    run([sys.executable, "-m", "bench.design_floor", "--rounds", "3", "--writes", "1500", "--cluster",
                         cluster, "--seconds", "6", "--json"], out / "floor.json")
                for name, args in phases.items():
                    run([*DNCTL, "bench", "--cluster", cluster, *[x.format(s=a.seconds) for x in args], "--json"],
                        out / f"{name}.json")
            finally:
                run([*DNCTL, "cluster", "down", "--cluster", cluster])
    if a.verbs:
        text = run([str(ROOT / "lab" / "softroce-vm"), "run", "--timeout", "1800", "--", "python",
                    "-m", "bench.verbs_ratio", "--rounds", "2", "--seconds", "6", "--json"], timeout=2400)
        (out / "verbs.txt").write_text(text)


def _load(out: pathlib.Path, name: str):
    p = out / name
    return json.loads(p.read_text()) if p.exists() else None


def _verbs_ratios(out: pathlib.Path) -> dict[int, list[float]]:
    """Per RoCE MTU, the rounds' ratios from verbs_ratio.py's output (its --json list is printed between a
    line "[" and a line "]")."""
    p = out / "verbs.txt"
    if not p.exists():
        return {}
    lines = p.read_text().splitlines()
    try:
        lo, hi = lines.index("["), lines.index("]")
    except ValueError:
        return {}
    by_mtu: dict[int, list[float]] = {}
    for r in json.loads("\n".join(lines[lo:hi + 1])):
        if r.get("ratio") is not None:
            by_mtu.setdefault(r["roce_mtu"], []).append(r["ratio"])
    return by_mtu


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2


def table(out: pathlib.Path) -> list[tuple[str, str, str, str, str]]:
    """Rows: (figure, goal, now, same-run baseline, met: yes / no / "")."""
    rows = []

    def phase(name: str) -> dict | None:
        d = _load(out, f"{name}.json")
        return None if d is None else d["results"][0]

    def cpu_per_req(r: dict, who: str) -> float:
        """ms of CPU per request: the leader's (the scratch partition's first replica) or the client's."""
        s = r["client_cpu"]["cpu_s"] if who == "client" else r["node_cpu"][r["replica_nodes"][0]]["cpu_s"]
        return s / r["requests"] * 1e3

    def cpu_per_gb(r: dict) -> float:
        return r["client_cpu"]["s_per_gb"] + sum(n["s_per_gb"] for n in r["node_cpu"].values())

    d1, fl, d1_all = phase("4k_d1"), _load(out, "floor.json"), _load(out, "4k_d1.json")
    if d1:
        lat = d1["latency_ms"]
        base = []
        if fl:
            sm = fl["summary"]
            floor, ours = sm["trio"]["p50_ms_median"], sm["dnctl-bench"]["p50_ms_median"]
            base.append(f"design floor p50 {floor:.2f} ms with a trio loop per process, "
                        f"{sm['blocking']['p50_ms_median']:.2f} blocking; ours in the same turns {ours:.2f} "
                        f"({ours / floor:.1f}x the trio floor)")
        fio = (d1_all or {}).get("fio") or {}
        if "write_4k_fdatasync" in fio:
            base.append(f"fio 4 KiB write+fdatasync {fio['write_4k_fdatasync']['ms_per_write']:.2f} ms")
        rows.append(("4 KiB durable write, 3 replicas, depth 1: p50 / p99", "<= 1.0 / <= 3 ms",
                     f"{lat['p50']:.2f} / {lat['p99']:.2f} ms", "; ".join(base),
                     "yes" if lat["p50"] <= 1.0 and lat["p99"] <= 3 else "no"))
        rows.append(("leader / client CPU per 4 KiB write, depth 1", "", f"{cpu_per_req(d1, 'leader'):.3f} / "
                     f"{cpu_per_req(d1, 'client'):.3f} ms", "", ""))
    d16 = phase("4k_d16")
    if d16:
        rows.append(("4 KiB durable writes, depth 16", ">= 3,000/s", f"{d16['iops']:,.0f}/s", "",
                     "yes" if d16["iops"] >= 3000 else "no"))
        leader = cpu_per_req(d16, "leader")
        rows.append(("leader CPU per 4 KiB write, depth 16", "<= 0.3 ms", f"{leader:.3f} ms", "",
                     "yes" if leader <= 0.3 else "no"))
    for name, depth, goal in (("1m_d1", 1, None), ("1m_d8", 8, 0.85)):
        d = _load(out, f"{name}.json")
        sm = (d or {}).get("dd_summary", {}).get("3")
        if sm:
            ratios = [f"{x['ratio']:.2f}" for x in d["dd_rounds"] if x.get("ratio") is not None]
            rows.append((f"1 MiB durable writes, depth {depth}: ours x 3 / dd", f">= {goal}" if goal else "",
                         f"{sm['median_ratio']:.3f} (rounds {', '.join(ratios)}; ours {sm['median_ours_mib_s']} "
                         f"MiB/s)", f"dd conv=fdatasync {sm['median_dd_mib_s']} MiB/s",
                         ("yes" if sm["median_ratio"] >= goal else "no") if goal else ""))
    for name, what, goal in (("buf_1m_d8", "1 MiB buffered writes, depth 8", True),
                             ("buf_1m_d1", "1 MiB buffered writes, depth 1", False),
                             ("buf_128k_d1", "128 KiB buffered writes, depth 1", False)):
        r = phase(name)
        if r:
            ok = r["mib_s"] >= 350 and cpu_per_gb(r) <= 4
            rows.append((what, ">= 350 MiB/s at <= 4 CPU-s/GB" if goal else "",
                         f"{r['mib_s']:.0f} MiB/s at {cpu_per_gb(r):.2f} CPU-s/GB, p50 {r['latency_ms']['p50']:.2f} ms",
                         "", ("yes" if ok else "no") if goal else ""))
    cold = (_load(out, "cold.json") or {}).get("cold_read") or {}
    c3 = cold.get("by_replicas", {}).get("3")
    if c3:
        ratio = c3["median_ratio"]["dd_direct"]
        rows.append(("1 MiB cold reads, depth 8, from the leader / dd iflag=direct", ">= 0.90",
                     f"{ratio:.3f} (ours {c3['median_mib_s']['ours']} MiB/s)",
                     f"dd iflag=direct {c3['median_mib_s']['dd_direct']} MiB/s", "yes" if ratio >= 0.9 else "no"))
    for mtu, vr in sorted(_verbs_ratios(out).items()):
        rows.append((f"verbs (Soft-RoCE VM, MTU {mtu}): leader ingest / ib_read_bw", ">= 0.60",
                     f"{_median(vr):.3f} (rounds {', '.join(f'{x:.2f}' for x in vr)})", "ib_read_bw, same VM run",
                     "yes" if _median(vr) >= 0.6 else "no"))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="where each measurement's JSON goes (kept; default: a new temporary directory)")
    ap.add_argument("--from", dest="source", help="print the table of an earlier run's --out, measure nothing")
    ap.add_argument("--warm-memory", help="the memory warmer to run first (e.g. ../shared/bench/warm-memory)")
    ap.add_argument("--seconds", type=float, default=10.0, help="length of each timed phase (default 10)")
    ap.add_argument("--verbs", action="store_true", help="also leader ingest / ib_read_bw in the Soft-RoCE VM "
                    "(lab/softroce-vm setup first; ~15 minutes)")
    a = ap.parse_args()
    if a.source:
        out = pathlib.Path(a.source)
        if not out.is_dir():
            ap.error(f"--from {a.source}: no such directory")
    else:
        if a.warm_memory and not os.access(a.warm_memory, os.X_OK):
            ap.error(f"--warm-memory {a.warm_memory}: not an executable")
        out = pathlib.Path(a.out or tempfile.mkdtemp(prefix="targets-out-"))
        out.mkdir(parents=True, exist_ok=True)
        if a.warm_memory:
            a.warm_memory = os.path.abspath(a.warm_memory)     # the runs' working directory is the checkout
        measure(a, out)
    rows = table(out)
    warm = (out / "warm-memory.txt").exists()
    print(f"the targets table from {out} (memory warmed first: {'yes' if warm else 'NO'})\n")
    print("| figure | goal | now | same-run baseline | met |\n|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")


if __name__ == "__main__":
    main()
