"""``python -m lab soak`` (lab/abuse.py), bounded: every abuser at once beside well-behaved clients, in alternating
unloaded/loaded pairs.  The p99 goal is a benchmark's (``python -m lab soak --pairs 5``), not a test's: this checks
what must hold whatever the machine's speed -- the clients' appends all succeed in both phases, the abusers
really ran (idle connections held), the node survives without a traceback, and the report carries each
pair's ratio, the median and where the node's time went."""
from __future__ import annotations

import pathlib
import subprocess
import sys

from lab import abuse

REPO = pathlib.Path(__file__).resolve().parent.parent


def test_soak_pairs_all_abusers_at_once():
    res = abuse.soak(seconds=1.0, pairs=2, clients=1, size=4096, idle=60, warmup=3.0)
    assert res["node_alive"] and res["tracebacks_in_log"] == 0
    assert len(res["pairs"]) == 2
    for p in res["pairs"]:
        for phase in ("unloaded", "loaded"):
            r = p[phase]
            assert r["appends"] > 0 and r["p99_ms"] > 0
            assert r["loop_lag_p99_le_ms"] is not None and r["gc"] is not None
            assert r["cpu_pct"]["node"] is not None
        assert p["loaded"]["cpu_pct"]["abusers"] is not None and p["unloaded"]["cpu_pct"]["abusers"] is None
        assert p["p99_ratio"] == round(p["loaded"]["p99_ms"] / p["unloaded"]["p99_ms"], 2)
    assert res["p99_ratio_min"] <= res["p99_ratio_median"] <= res["p99_ratio_max"]
    assert res["abusers"]["idle_connections_held"] == 2 * 60 and res["abusers"]["idle_connections_refused"] == 0


def test_soak_cli_refuses_unknown_abusers():
    p = subprocess.run([sys.executable, "-m", "lab", "soak", "--abusers", "unread,nosuch"],
                       capture_output=True, text=True, cwd=REPO, timeout=60)
    assert p.returncode == 2 and "one or more of unserved, unread, slowloris, idle" in p.stderr
    assert "Traceback" not in p.stderr
    p = subprocess.run([sys.executable, "-m", "lab", "soak", "--help"], capture_output=True, text=True,
                       cwd=REPO, timeout=60)
    assert "--pairs" in p.stdout and "median" in p.stdout
