"""bench/scale.py at its smallest: a real secured cluster grown and timed, every figure a number."""
from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

FIGURES = ["etcd_db_bytes_after_create", "etcd_db_in_use_bytes_after_create", "etcd_db_file_bytes_after_create",
           "etcd_db_bytes_after_failover", "etcd_db_in_use_bytes_after_failover", "create_ms_per_partition",
           "idle_cpu_cores", "failover_s", "failover_retried", "failover_cpu_s", "refill_s", "refill_cpu_s",
           "stop_exit_s", "stop_cpu_s", "stop_resync_s",
           "stop_under_replicated_60s", "clients_failed", "clients_open_p50_s", "clients_open_p99_s",
           "etcd_connections_peak"]


@pytest.mark.skipif(shutil.which("etcd") is None, reason="needs etcd (etcd-server)")
@pytest.mark.timeout(420)     # ~1 min alone; the shared CI machine may be several times slower
def test_the_scale_bench_gives_every_figure_a_number(tmp_path):
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "bench.scale", "--partitions", "5", "--nodes", "3",
                        "--clients", "3", "--step-timeout", "120", "--dir", str(tmp_path), "--json"],
                       capture_output=True, text=True, timeout=400, cwd=ROOT)
    took = time.monotonic() - t0
    assert p.returncode == 0, p.stderr[-3000:]
    run, = json.loads(p.stdout)["runs"]
    assert run["partitions"] == 5 and run["map_partitions"] >= 5
    bad = {k: run.get(k) for k in FIGURES if not isinstance(run.get(k), (int, float)) or isinstance(run.get(k), bool)}
    assert not bad, (bad, run.get("notes"), p.stderr[-3000:])
    assert run["clients_failed"] == 0 and run["failover_not_writable"] == 0, run
    assert run["clients_partitions_seen"] == [run["map_partitions"]], run
    # every process it started is gone: nothing runs with the cluster's directory in its command line
    left = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout.split()
    assert not left, left
    assert took < 180, f"the smallest run took {took:.0f}s (~1 min alone: 2 min and some slack for a shared machine)"
