"""The command lines as a user meets them: real `dnctl` / `datanode` processes against real local clusters.

No command shows a Python traceback (bad ranges, addresses without a port, a data_dir that cannot be made,
a pool larger than memory); `cluster status/down` follow a node's real process (also one started by
hand) and `cluster stop-node/start-node/restart-node` work; a put against a dead follower leaves no empty
extent per attempt; `bench` leaves nothing behind; the README's commands run as written; --version,
--json, print-config units, ./dev help; node status / partition list present what they should.
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time

import pytest

from tools import cluster as cl
from wire.transport.tcp import congestion_of, tune_socket
from tools.cluster import free_port
from tests.conftest import dnctl, dnctl_json

REPO = pathlib.Path(__file__).resolve().parent.parent
BIN = pathlib.Path(sys.executable).parent
FAST = ["--replica-timeout", "2"]


def refused(p: subprocess.CompletedProcess, *words: str) -> None:
    """A clean refusal: nonzero exit, no traceback, one error naming ``words``."""
    assert p.returncode != 0, p.stdout
    assert "Traceback" not in p.stderr and "Traceback" not in p.stdout, p.stderr
    assert "Error:" in p.stderr, p.stderr
    for w in words:
        assert w in p.stderr, (w, p.stderr)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """A 3-node local cluster made by `dnctl cluster up`, with one small file in partition 1."""
    root = tmp_path_factory.mktemp("cli") / "c"
    dnctl("cluster", "up", "--nodes", 3, "--cluster", root, *FAST, check=True)
    info = json.loads((root / "cluster.json").read_text())
    src = root.parent / "f.bin"
    src.write_bytes(os.urandom(1000))
    put = dnctl_json("put", "--cluster", root, "--partition", 1, src, "--json")
    yield {"root": root, "addrs": [n["addr"] for n in info["nodes"]], "extent": put["locations"][0]["extent"],
           "data": src.read_bytes()}
    dnctl("cluster", "down", "--cluster", root, "--timeout", 10)


# -- no traceback, the reason named ------------------------------------------------------------------
@pytest.mark.parametrize("args, words", [
    (["--offset", "-5"], ["--offset", "-5"]),
    (["--length", "-1"], ["--length", "-1"]),
    (["--offset", "5000"], ["5000", "past the end", "1000 bytes"]),
    (["--offset", "990", "--length", "100"], ["990+100", "1000 bytes"]),
])
def test_get_bad_range_is_refused_once_with_reason(live, tmp_path, args, words):
    p = dnctl("get", "--cluster", live["root"], "--partition", 1, "--extent", live["extent"], *args,
              "--out", tmp_path / "o")
    refused(p, *words)
    assert "bad request" not in p.stderr
    assert p.stderr.count("Error:") == 1


def test_get_json_and_range(live, tmp_path):
    out = tmp_path / "o"
    p = dnctl("get", "--cluster", live["root"], "--partition", 1, "--extent", live["extent"], "--offset", 100,
              "--out", out, "--json", check=True)
    res = json.loads(p.stdout)
    assert out.read_bytes() == live["data"][100:]
    assert res["length"] == 900 and res["offset"] == 100 and res["extent"] == live["extent"]
    p = dnctl("get", "--cluster", live["root"], "--partition", 1, "--extent", live["extent"], "--offset", 1000,
              "--out", out, check=True)
    assert out.read_bytes() == b""


@pytest.mark.parametrize("cmd", [["node", "status"], ["pool", "stats"], ["partition", "list"],
                                 ["partition", "show", "--id", "1"]])
def test_address_without_port_is_a_usage_error(cmd):
    p = dnctl(*cmd, "nothostport")
    refused(p, "nothostport", "HOST:PORT")
    assert p.returncode == 2


@pytest.mark.parametrize("make, words", [
    (lambda tmp: "/proc/no-such-dir/data", ["data_dir", "/proc/no-such-dir/data"]),
    (lambda tmp: (tmp / "file").write_text("x") and str(tmp / "file"), ["data_dir", "not a directory"]),
])
def test_serve_refuses_a_data_dir_it_cannot_use(tmp_path, make, words):
    d = make(tmp_path)
    p = subprocess.run([str(BIN / "datanode"), "serve", "--listen", f"127.0.0.1:{free_port()}", "--data-dir", d],
                       capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr
    for w in words:
        assert w in p.stderr, p.stderr


def test_serve_refuses_a_pool_beyond_available_memory(tmp_path):
    avail = int(next(ln.split()[1] for ln in open("/proc/meminfo") if ln.startswith("MemAvailable:"))) * 1024
    if avail >= 64 << 30:
        pytest.skip("this machine has 64 GiB available: pool_mib's maximum fits")
    p = subprocess.run([str(BIN / "datanode"), "serve", "--listen", f"127.0.0.1:{free_port()}", "--data-dir",
                        str(tmp_path / "d"), "--pool-mib", "65536"], capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr
    assert "pool_mib" in p.stderr and "available" in p.stderr, p.stderr


def test_version_print_config_and_dev_help():
    for exe in ("dnctl", "datanode"):
        p = subprocess.run([str(BIN / exe), "--version"], capture_output=True, text=True, timeout=60)
        assert p.returncode == 0 and re.search(r"version \d+\.\d+", p.stdout), p.stdout + p.stderr
    p = subprocess.run([str(BIN / "datanode"), "print-config"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    from datanode import config
    import dataclasses
    import tomllib
    keys = {f.name for f in dataclasses.fields(config.Config)}
    lines = [ln for ln in p.stdout.splitlines() if ln.strip() and not ln.startswith("#")]   # not: section titles
    assert {ln.split("=")[0].strip() for ln in lines} == keys
    for ln in lines:     # key = value   # [unit] one-line description
        m = re.fullmatch(r"\S+ = .*?\s+# \[([^\]]+)\] (\S.{8,})", ln)
        assert m, ln
    assert set(tomllib.loads(p.stdout)) == keys     # still valid TOML: usable as node.toml
    p = subprocess.run(["./dev"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "usage: ./dev" in p.stdout and "./dev test" in p.stdout, p.stdout + p.stderr
    assert p.stderr == ""
    p = subprocess.run(["bash", "-c", 'eval "$(sed -n "/^pick_python()/,/^}/p" dev)"; pick_python'], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stderr == "", p.stderr


# -- presentation -------------------------------------------------------------------------------------
def test_node_status_and_partition_list_present_transport_units_health(live):
    a = live["addrs"][0]
    sf = ("--secret-file", live["root"] / "cluster.secret")     # a command that names a node, not DIR
    p = dnctl(*sf, "node", "status", a, check=True)
    conns = [ln for ln in p.stdout.splitlines() if ln.startswith("  127.0.0.1:")]
    assert conns and all(" tcp " in ln for ln in conns), p.stdout
    assert all(" session " in ln for ln in conns), p.stdout     # a cluster with a secret: authenticated sessions
    assert re.search(r"\d+(\.\d)? (B|KiB|MiB|GiB)", p.stdout), p.stdout
    raw = dnctl_json(*sf, "node", "status", a, "--json")
    assert isinstance(raw["uptime_s"], (int, float)) and all(c["transport"] == "tcp" for c in raw["connections"])
    with socket.socket() as probe:        # each connection's congestion control, as this machine gives it
        tune_socket(probe)
        cc = congestion_of(probe)
    assert all(c["congestion"] == cc for c in raw["connections"]) and all(f" tcp ({cc}) " in ln for ln in conns), \
        (raw["connections"], p.stdout)
    assert isinstance(raw["pool"]["arena_bytes"], int)
    # the file put in partition 1 (led by the first node): where its appends spent their time, per stage
    assert raw["write_stages"]["leader"]["durable"]["count"] >= 1, raw["write_stages"]
    assert re.search(r"^appends as leader \(\d+\), mean ms per stage: fetch \d+\.\d{3}, queue .*, durable "
                     r"\d+\.\d{3}, replicas \d+\.\d{3}$", p.stdout, re.M), p.stdout
    p = dnctl(*sf, "partition", "list", a, check=True)
    row = next(ln for ln in p.stdout.splitlines() if ln.split()[0] == "1")
    assert "leader" in row and "healthy" in row and live["addrs"][1] in row, p.stdout
    p = dnctl(*sf, "partition", "show", "--id", 1, a, check=True)
    assert "follower health:" in p.stdout and "healthy" in p.stdout and "state read-write" in p.stdout, p.stdout


def test_scrub_and_repair_show_progress_while_waiting(live):
    p = dnctl("partition", "scrub", "--id", 1, "--cluster", live["root"], check=True)
    assert re.search(r"^scrub ", p.stderr, re.M), p.stderr
    assert "scrub: idle" in p.stdout, p.stdout
    p = dnctl("replica", "repair", "--id", 1, "--cluster", live["root"], check=True)
    assert re.search(r"^(repair |\S+ repairing )", p.stderr, re.M), p.stderr
    p = dnctl("replica", "repair", "--id", 1, "--cluster", live["root"], "--quiet", "--json", check=True)
    assert p.stderr == "" and json.loads(p.stdout)["repair"]["passes"] >= 2


# -- local cluster processes ---------------------------------------------------------------------------
def _pid_gone(pid: int, timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not cl.pid_alive(pid):
            return True
        time.sleep(0.05)
    return False


def test_free_ports_are_never_handed_out_twice():
    # The kernel gives the same ephemeral port to two binds in a row often enough (133 of 2,000 on this box)
    # that two nodes of one test cluster were once told the same port: one could not listen, and the
    # other answered for both.
    ports = [free_port() for _ in range(1000)]
    assert len(set(ports)) == len(ports)


def test_cluster_follows_real_process_and_restarts_one_node(tmp_path):
    root = tmp_path / "c"
    dnctl("cluster", "up", "--nodes", 2, "--dir", root, *FAST, check=True)     # --dir: the old spelling
    try:
        info = json.loads((root / "cluster.json").read_text())
        a, b = (n["addr"] for n in info["nodes"])
        old_b = info["nodes"][1]["pid"]
        src = tmp_path / "f"
        src.write_bytes(os.urandom(300_000))
        loc = dnctl_json("put", "--cluster", root, "--partition", 1, src, "--json")
        eid = loc["locations"][0]["extent"]

        # restart-node: a new process on the same address; the stop handed partition 1 off it (epoch + 1), so
        # its copy is back once the manager has made it a replica again and repair has filled it
        r = dnctl_json("cluster", "restart-node", b, "--cluster", root, "--json")
        assert r["stopped"]["result"] == "stopped" and r["pid"] != old_b and _pid_gone(old_b)
        deadline = time.monotonic() + 60
        while True:
            parts = json.loads(dnctl("partition", "list", "--cluster", root, "--json").stdout)
            if any(p["id"] == 1 and b in p["replicas"] and b in p["synced"] and p["installed"] for p in parts):
                break
            assert time.monotonic() < deadline, parts
            time.sleep(0.5)
        got = tmp_path / "g"
        dnctl("get", "--cluster", root, "--partition", 1, "--extent", eid, "--replica", b, "--out", got, check=True)
        assert got.read_bytes() == src.read_bytes()

        # stop-node, then start it BY HAND: status reports the hand-started pid, down stops it
        st = dnctl_json("cluster", "stop-node", b, "--cluster", root, "--json")
        assert st["result"] == "stopped"
        s = json.loads(dnctl("cluster", "status", "--cluster", root, "--json").stdout)
        assert [n["health"] for n in s["nodes"]] == ["up", "down"]
        hand = subprocess.Popen([str(BIN / "datanode"), "serve", "--config", str(root / "node2" / "node.toml")],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            cl.wait_listening(b, proc=hand, secret=str(root / "cluster.secret"))
            s = dnctl_json("cluster", "status", "--cluster", root, "--json")
            nb = s["nodes"][1]
            assert nb["health"] == "up" and nb["pid"] == hand.pid, nb
            p = dnctl("cluster", "start-node", b, "--cluster", root)
            refused(p, "already running", str(hand.pid))
            down = dnctl_json("cluster", "down", "--cluster", root, "--json")
            assert [d["result"] for d in down] == ["stopped", "stopped"], down
            assert hand.wait(timeout=30) is not None
        finally:
            if hand.poll() is None:
                hand.kill()
                hand.wait()
        s = json.loads(dnctl("cluster", "status", "--cluster", root, "--json").stdout)
        assert [n["health"] for n in s["nodes"]] == ["down", "down"]
        # start-node brings one back; the other stays down
        r = dnctl_json("cluster", "start-node", a, "--cluster", root, "--json")
        assert r["result"] == "started" and cl.pid_alive(r["pid"])
        s = json.loads(dnctl("cluster", "status", "--cluster", root, "--json").stdout)
        assert [n["health"] for n in s["nodes"]] == ["up", "down"]
    finally:
        dnctl("cluster", "down", "--cluster", root, "--timeout", 10)


def test_cluster_up_on_a_stopped_cluster_of_another_size_refuses(tmp_path):
    # `cluster up` on a stopped cluster restarts it as it was; asked for another number of nodes it used to
    # restart the old ones without a word (a benchmark asking for 3 nodes got 1)
    root = tmp_path / "c"
    dnctl("cluster", "up", "--nodes", 1, "--cluster", root, *FAST, check=True)
    dnctl("cluster", "down", "--cluster", root, "--timeout", 10, check=True)
    try:
        refused(dnctl("cluster", "up", "--nodes", 2, "--cluster", root, *FAST),
                "stopped cluster of 1 node", "another --cluster")
        assert len(json.loads((root / "cluster.json").read_text())["nodes"]) == 1
        r = dnctl("cluster", "up", "--cluster", root, *FAST, check=True)      # no --nodes: as it was
        assert "restarted the stopped cluster" in r.stdout
        assert len(json.loads((root / "cluster.json").read_text())["nodes"]) == 1
    finally:
        dnctl("cluster", "down", "--cluster", root, "--timeout", 10)


def test_cluster_down_stops_a_cluster_whose_directory_was_removed_under_it(tmp_path):
    # `rm -rf` of a running cluster's directory left its etcd, manager and nodes running with nothing to find
    # them by: `cluster down` said "not a cluster directory", and `cluster up` on the same ports only said
    # "already in use" (this happened to us twice while benchmarking)
    root = tmp_path / "c"
    port = free_port()
    dnctl("cluster", "up", "--nodes", 1, "--cluster", root, "--base-port", port, *FAST, check=True)
    info = json.loads((root / "cluster.json").read_text())
    pids = [n["pid"] for n in info["nodes"]] + [info["etcd"]["pid"]] + [m["pid"] for m in info["managers"]]
    try:
        # a manager still starting when its directory goes cannot read its credentials and exits by itself:
        # remove the directory under one that runs
        mlog = pathlib.Path(info["managers"][0]["log"])
        deadline = time.monotonic() + 60
        while "ACTIVE" not in (mlog.read_text(errors="replace") if mlog.exists() else ""):
            assert time.monotonic() < deadline, "the manager never became active"
            time.sleep(0.1)
        shutil.rmtree(root)
        p = dnctl("cluster", "up", "--nodes", 1, "--cluster", root, "--base-port", port, *FAST)
        refused(p, "already in use", f"dnctl cluster down --cluster {root}", str(info["nodes"][0]["pid"]))
        down = dnctl_json("cluster", "down", "--cluster", root, "--json")
        assert sorted(d["pid"] for d in down) == sorted(pids), (down, pids)
        assert [d["kind"] for d in down] == ["manager", "datanode", "etcd"], down
        assert all(d["result"] == "stopped" for d in down), down
        assert all(_pid_gone(pid) for pid in pids)
        refused(dnctl("cluster", "down", "--cluster", root), "not a cluster directory")   # nothing left to stop
        dnctl("cluster", "up", "--nodes", 1, "--cluster", root, "--base-port", port, *FAST, check=True)
    finally:
        dnctl("cluster", "down", "--cluster", root, "--timeout", 10)
        for pid in pids:
            if cl.pid_alive(pid):
                os.kill(pid, 9)


def test_put_with_dead_follower_leaks_no_extent_and_partition_is_degraded(tmp_path):
    # --no-etcd: without a manager nobody shrinks the set, so the puts are refused (with a manager the
    # writer rides through: tests/test_placement.py)
    root = tmp_path / "c"
    dnctl("cluster", "up", "--nodes", 3, "--cluster", root, "--no-etcd", *FAST, check=True)
    try:
        a, _, c = (n["addr"] for n in json.loads((root / "cluster.json").read_text())["nodes"])
        src = tmp_path / "f"
        src.write_bytes(os.urandom(5000))
        dnctl("put", "--cluster", root, "--partition", 1, src, check=True)
        dnctl("cluster", "stop-node", c, "--cluster", root, check=True)

        def leader_view():
            return next(p for p in dnctl_json("--secret-file", root / "cluster.secret", "partition", "list", a,
                                                      "--json") if p["id"] == 1)
        deadline = time.monotonic() + 30
        while (leader_view().get("health") or {}).get("followers", {}).get(c) != "unreachable":
            assert time.monotonic() < deadline, "the leader never noticed the dead follower"
            time.sleep(0.2)
        before = leader_view()["extents"]
        for _ in range(3):
            p = dnctl("put", "--cluster", root, "--partition", 1, src)
            refused(p, c)
        assert leader_view()["extents"] == before
        p = dnctl("--secret-file", root / "cluster.secret", "partition", "show", "--id", 1, a, check=True)
        assert "state degraded" in p.stdout and f"{c} unreachable" in p.stdout, p.stdout
        # the follower back: writes work again
        dnctl("cluster", "start-node", c, "--cluster", root, check=True)
        deadline = time.monotonic() + 30
        while True:
            p = dnctl("put", "--cluster", root, "--partition", 1, src)
            if p.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert p.returncode == 0, p.stderr
    finally:
        dnctl("cluster", "down", "--cluster", root, "--timeout", 10)


def test_bench_uses_a_scratch_partition_and_leaves_nothing(tmp_path):
    # --no-etcd: a manager would add partitions of its own (min_writable) while the bench runs
    root = tmp_path / "c"
    dnctl("cluster", "up", "--nodes", 2, "--cluster", root, "--no-etcd", *FAST, check=True)
    try:
        a = json.loads((root / "cluster.json").read_text())["nodes"][0]["addr"]
        sf = ("--secret-file", root / "cluster.secret")
        before = dnctl_json(*sf, "partition", "list", a, "--json")
        png = tmp_path / "bench.png"
        p = dnctl("bench", "--cluster", root, "--size", "64KiB", "--total-mib", 4, "--json", "--plot", png,
                  "--dd", "--fio", "--dd-mib", 8, timeout=300)
        assert p.returncode == 0, p.stdout + p.stderr
        res = json.loads(p.stdout)
        assert {r["phase"] for r in res["results"]} == {"write", "read"}
        # the same-run baselines, whether memory was warmed, and a picture of it all
        assert res["warm_memory"] == {"ran": False}
        assert res["dd"]["mib_s"] > 0 and res["fio"]["read_1m_direct"]["mib_s"] > 0, res["fio"]
        assert res["fio"]["write_4k_fdatasync"]["ms_per_write"] > 0
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
        assert all(r["bytes"] >= 4 << 20 and r["partition"] != 1 for r in res["results"])
        # each write phase broken down by stage on every node: the first replica led every append
        for r in res["results"]:
            if r["phase"] != "write":
                assert "write_stages" not in r
                continue
            leader, *followers = r["replica_nodes"]
            st = r["write_stages"]
            assert set(st) == set(r["replica_nodes"]), st
            assert st[leader]["leader"]["appends"] == r["requests"], (st, r["requests"])
            assert set(st[leader]["leader"]) == {"appends", "fetch", "queue", "local", "durable",
                                                 *(["replicas"] if followers else [])}
            for f in followers:      # a leader forwards a run of appends as one (ops/run.py AppendRun)
                assert list(st[f]) == ["follower"] and 1 <= st[f]["follower"]["appends"] <= r["requests"]
                assert "replicas" not in st[f]["follower"]
            assert sum(v for k, v in st[leader]["leader"].items() if k != "appends") <= r["latency_ms"]["max"]
        assert "ms per append" in dnctl("bench", "--cluster", root, "--size", "64KiB", "--total-mib", 1,
                                        "--mode", "write", timeout=120).stdout
        after = dnctl_json(*sf, "partition", "list", a, "--json")
        assert [(q["id"], q["extents"], q["bytes"]) for q in after] == [(q["id"], q["extents"], q["bytes"])
                                                                        for q in before]
        assert not list(root.glob("bench-worker*")), list(root.iterdir())
        assert not list(root.glob("*test")), list(root.iterdir())            # ddtest, fiotest removed
        trash = dnctl_json("trash", "list", "--cluster", root, "--json")
        assert not trash, trash                       # the scratch data is not kept in the trash either
    finally:
        dnctl("cluster", "down", "--cluster", root, "--timeout", 10)


def test_bench_write_rounds_each_against_the_dd_right_after_it(tmp_path):
    """--dd --rounds N: the write phase runs N times, each followed by its own dd on the cluster's disk; each
    round's ratio is ours x replicas / dd (every replica's copy lands on that one disk), and the table gives
    the rounds and their median.  --rounds without --cold or --dd is refused."""
    root = tmp_path / "c"
    dnctl("cluster", "up", "--nodes", 2, "--cluster", root, "--no-etcd", *FAST, check=True)
    try:
        p = dnctl("bench", "--cluster", root, "--size", "64KiB", "--total-mib", 2, "--mode", "write", "--dd",
                  "--dd-mib", 8, "--rounds", 3, "--json", timeout=300)
        assert p.returncode == 0, p.stdout + p.stderr
        res = json.loads(p.stdout)
        writes = [r for r in res["results"] if r["phase"] == "write"]
        assert len(writes) == len(res["results"]) == 3 and res["config"]["write_rounds"] == 3
        rounds = res["dd_rounds"]
        assert [r["round"] for r in rounds] == [1, 2, 3]
        for w, r in zip(writes, rounds):
            assert r["replicas"] == 2 and r["ours_mib_s"] == w["mib_s"] and r["dd"]["mib_s"] > 0, r
            # the ratio is rounded to 3 places: a small one is off by more than 1%
            assert r["ratio"] == pytest.approx(w["mib_s"] * 2 / r["dd"]["mib_s"], rel=0.01, abs=0.0006)
        summary = res["dd_summary"]["2"]
        assert summary["rounds"] == 3
        assert summary["median_ratio"] == pytest.approx(sorted(r["ratio"] for r in rounds)[1], abs=0.001)
        assert res["dd"] in [r["dd"] for r in rounds]          # the table's dd: the median round's
        p = dnctl("bench", "--cluster", root, "--size", "64KiB", "--total-mib", 1, "--mode", "write", "--dd",
                  "--dd-mib", 8, "--rounds", 2, timeout=300)
        assert p.returncode == 0, p.stdout + p.stderr
        assert "2 replica(s), write round 2: ours " in p.stdout and "median of 2 rounds" in p.stdout, p.stdout
        p = dnctl("bench", "--cluster", root, "--size", "64KiB", "--total-mib", 1, "--rounds", 2, timeout=60)
        assert p.returncode == 2 and "--rounds goes with --cold" in p.stderr, p.stdout + p.stderr
        assert not list(root.glob("*test")), list(root.iterdir())            # every ddtest removed
    finally:
        dnctl("cluster", "down", "--cluster", root, "--timeout", 10)


@pytest.mark.skipif(not os.access("/proc/sys/vm/drop_caches", os.W_OK), reason="--cold needs root")
def test_bench_cold_reads_each_written_byte_once_beside_a_cold_dd(tmp_path):
    """--cold: every read round starts after the page cache is dropped and reads every written byte exactly
    once (a second pass would be served by the page cache), and the disk says it read at least that much;
    each round is followed by the same-run baselines (dd buffered, dd iflag=direct, fio O_DIRECT), each of as
    many bytes, and the summary is the median of the rounds' ratios."""
    root = tmp_path / "c"
    dnctl("cluster", "up", "--nodes", 1, "--cluster", root, "--no-etcd", *FAST, check=True)
    try:
        # --mode read: 64 MiB written first (unmeasured), then two cold passes over it, well inside 60 s
        p = dnctl("bench", "--cluster", root, "--size", "64KiB", "--mode", "read", "--seconds", 60, "--cold",
                  "--rounds", 2, "--json", timeout=300)
        assert p.returncode == 0, p.stdout + p.stderr
        res = json.loads(p.stdout)
        reads = res["results"]
        assert len(reads) == 2 and res["config"]["cold"] and res["config"]["rounds"] == 2
        for read in reads:
            assert read["cold"] and read["errors"] == 0
            assert read["written"] >= 64 << 20 and read["bytes"] == read["written"], (read["bytes"], read["written"])
            assert read["seconds"] < 60
            if read["disk"]:                # the disk read every byte asked for (other readers only add)
                assert read["disk"]["of_asked"] >= 0.95, read["disk"]
        rounds = res["cold_rounds"]
        assert [r["round"] for r in rounds] == [1, 2]
        for r in rounds:
            for k in ("dd", "dd_direct", "fio_direct"):
                assert r[k]["mib_s"] > 0 and r[k]["bytes"] >= r["ours"]["bytes"], (k, r[k])
                assert r["ratio"][k] == pytest.approx(r["ours"]["mib_s"] / r[k]["mib_s"], rel=0.01)
        summary = res["cold_read"]["by_replicas"]["1"]
        assert summary["rounds"] == 2 and summary["ratio_uses"] == "dd_direct"
        assert min(r["ratio"]["dd_direct"] for r in rounds) <= summary["median_ratio"]["dd_direct"] \
            <= max(r["ratio"]["dd_direct"] for r in rounds)
        assert not list(root.glob("coldread")), list(root.iterdir())
        p = dnctl("bench", "--cluster", root, "--size", "64KiB", "--total-mib", 2, "--cold", "--rounds", 1,
                  timeout=300)
        assert p.returncode == 0 and "cold read rounds (page cache dropped before each read" in p.stdout, p.stdout + p.stderr
        assert "of dd iflag=direct" in p.stdout and "median of 1 round" in p.stdout and " cold " in p.stdout, p.stdout
    finally:
        dnctl("cluster", "down", "--cluster", root, "--timeout", 10)


def test_bench_says_whether_memory_was_warmed(tmp_path):
    """--warm-memory runs the warmer once before the first phase and the table says so; and how fast fresh
    memory was at the run's start and end (text and --json)."""
    root = tmp_path / "c"
    warmer = tmp_path / "warm"
    warmer.write_text("#!/bin/sh\necho warm-memory: touched 0.1 GiB\n")
    warmer.chmod(0o755)
    dnctl("cluster", "up", "--nodes", 1, "--cluster", root, *FAST, check=True)
    try:
        p = dnctl("bench", "--cluster", root, "--size", "4KiB", "--total-mib", 1, "--mode", "write",
                  "--warm-memory", warmer, timeout=300)
        assert p.returncode == 0, p.stdout + p.stderr
        assert f"memory warmed before this run: yes ({warmer}" in p.stdout, p.stdout
        assert "fresh memory at the run's start / end: " in p.stdout, p.stdout
        p = dnctl("bench", "--cluster", root, "--size", "4KiB", "--total-mib", 1, "--mode", "write", timeout=300)
        assert "memory warmed before this run: NO" in p.stdout, p.stdout
        p = dnctl("bench", "--cluster", root, "--size", "4KiB", "--total-mib", 1, "--mode", "write", "--json",
                  timeout=300)
        out = json.loads(p.stdout)
        assert out["warm_memory"]["ran"] is False
        assert out["fresh_memory"]["start_gib_s"] > 0 and out["fresh_memory"]["end_gib_s"] > 0, out["fresh_memory"]
    finally:
        dnctl("cluster", "down", "--cluster", root, "--timeout", 10)


# -- the README, as written ------------------------------------------------------------------------------
def _readme_block(title: str) -> list[str]:
    text = (REPO / "README.md").read_text()
    sec = text[text.index(f"## {title}"):]
    block = sec[sec.index("```sh\n") + 6:]
    block = block[:block.index("```")]
    return [ln for ln in block.splitlines() if ln.strip()]


def test_readme_using_it_runs_as_written(tmp_path):
    lines = _readme_block("Using it")
    assert all(ln.startswith(".venv/bin/") for ln in lines), lines
    for _ in range(50):
        base = free_port()
        if base + 2 < 65536 and all(cl.port_free("127.0.0.1", base + i) for i in range(3)):
            break
    root = tmp_path / "dn"
    ports = {str(17310 + i): str(base + i) for i in range(3)}
    try:
        for ln in lines:
            cmd = ln.split("  #")[0].strip()
            cmd = cmd.replace("/tmp/dn", str(root)).replace(".venv/bin/", f"{BIN}/")
            cmd = re.sub(r"1731[0-2]", lambda m: ports[m.group(0)], cmd)
            p = subprocess.run(["bash", "-c", cmd], cwd=REPO, capture_output=True, timeout=300)
            err = p.stderr.decode(errors="replace")
            assert p.returncode == 0 and "Traceback" not in err, f"{ln}\n-> {p.returncode}\n{err}"
    finally:
        if (root / "cluster.json").exists():
            dnctl("cluster", "down", "--cluster", root, "--timeout", 10)
    assert not list(root.glob("bench-worker*"))
    assert (root / "copy").read_bytes() == (REPO / "README.md").read_bytes()


def test_readme_commands_name_the_venv():
    """Every dnctl/datanode/python command in the README is spelled with .venv/bin/ (or after activate)."""
    text = (REPO / "README.md").read_text()
    for block in re.findall(r"```sh\n(.*?)```", text, re.S):
        for ln in block.replace("\\\n", " ").splitlines():         # a command continued with \ is one line
            first = shlex.split(ln, comments=True)[:1]
            if first and first[0] in ("dnctl", "datanode", "python", "python3"):
                raise AssertionError(f"README runs {first[0]} without .venv/bin/: {ln}")
