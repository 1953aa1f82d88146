"""Prometheus /metrics of a live node moves when data moves; the SDK's families can be registered."""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import urllib.request

import trio
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import create_partition, dnctl, open_client, pattern
from tools.cluster import free_port

PID = 3
MiB = 1 << 20


def scrape(addr: str) -> dict:
    """{(name, frozenset(labels)): value} of every sample."""
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=10) as r:
        assert r.status == 200
        text = r.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def test_metrics_move_when_data_moves(nodes):
    maddrs = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    a, b = nodes(1, metrics_listen=maddrs[0]) + nodes(1, metrics_listen=maddrs[1])
    data = pattern(5, 3 * MiB)

    before = scrape(maddrs[0])
    assert value(before, "datanode_partitions") == 0
    assert value(before, "datanode_disk_total_bytes") > 0 and value(before, "datanode_disk_free_bytes") > 0
    assert value(before, "datanode_pool_bytes") == 64 * MiB
    assert value(before, "datanode_starting") == 0          # serving (1 while it opens its partitions)

    async def body():
        async with open_client("tcp", []) as dc:
            await create_partition(dc, PID, [a.addr, b.addr])
            locs = await dc.write(PID, data)
            got = b"".join([await dc.read_location(loc) for loc in locs])
            assert got == data
            registry = CollectorRegistry()
            registry.register(dc.metrics)
            client_text = generate_latest(registry).decode()
            return client_text

    client_text = trio.run(body)
    after = scrape(maddrs[0])
    follower = scrape(maddrs[1])
    ok_writes = value(after, "datanode_requests_total", op="WRITE", result="OK")
    assert ok_writes >= 1 and value(before, "datanode_requests_total", op="WRITE", result="OK") == 0
    assert value(after, "datanode_request_payload_bytes_total", op="WRITE") == len(data)
    assert value(after, "datanode_request_payload_bytes_total", op="READ") == len(data)
    assert value(after, "datanode_request_seconds_count", op="WRITE") == ok_writes
    # where each append's time went: every stage counted once per append, by role, and together no
    # longer than the node held the requests
    stages = ("fetch", "queue", "local", "durable", "replicas")
    for st in stages:
        assert value(after, "datanode_write_stage_seconds_count", role="leader", stage=st) == ok_writes, st
        assert value(follower, "datanode_write_stage_seconds_count", role="follower", stage=st) == (
            0 if st == "replicas" else ok_writes), st
        assert value(after, "datanode_write_stage_seconds_count", role="follower", stage=st) == 0
    assert 0 < sum(value(after, "datanode_write_stage_seconds_sum", role="leader", stage=st) for st in stages) \
        <= value(after, "datanode_request_seconds_sum", op="WRITE")
    assert value(after, "datanode_forwarded_writes_total") == ok_writes
    assert value(follower, "datanode_forward_fetch_bytes_total") == len(data)
    assert value(after, "datanode_partitions") == 1
    assert value(after, "datanode_partition_leader", partition=str(PID)) == 1
    assert value(follower, "datanode_partition_leader", partition=str(PID)) == 0
    assert value(after, "datanode_partition_bytes", partition=str(PID)) == len(data)
    assert value(after, "datanode_pool_high_water_bytes") > 0
    assert value(after, "datanode_pool_in_use_bytes") == 0
    assert value(after, "datanode_answers_refused_total") == 0      # every read's answer was taken
    # the SDK's families, registered by the embedding program
    client = {(s.name, frozenset(s.labels.items())): s.value
              for fam in text_string_to_metric_families(client_text) for s in fam.samples}
    assert value(client, "datanode_client_payload_bytes_total", op="WRITE") == len(data)
    assert value(client, "datanode_client_requests_total", op="WRITE", result="OK") == ok_writes


def test_metrics_endpoint_answers_only_metrics(nodes):
    maddr = f"127.0.0.1:{free_port()}"
    nodes(1, metrics_listen=maddr)
    try:
        urllib.request.urlopen(f"http://{maddr}/other", timeout=10)
        raise AssertionError("expected 404")
    except urllib.error.HTTPError as e:
        assert e.code == 404


def test_status_reports_disk_and_does_not_count_itself(nodes):
    [a] = nodes(1)

    async def body():
        async with open_client("tcp", []) as dc:
            from wire.protocol import Op
            st = await dc.admin(a.addr, Op.NODE_STATUS)
            assert st["inflight"] == 0, st["inflight"]
            assert st["disk"]["total"] > 0 and 0 <= st["disk"]["free"] <= st["disk"]["total"]
            assert st["state"] == "serving"
            assert [c["transport"] for c in st["connections"]] == ["tcp"]
    trio.run(body)


def test_a_failing_exposition_is_a_500_and_the_server_serves_on():
    """A fault while building the exposition (a bug in a collector) answers 500 and the metrics server --
    a task in the node's nursery -- keeps serving: it must not end the node."""
    from wire.metrics import serve_metrics

    class Flaky:
        calls = 0

        def exposition(self) -> bytes:
            Flaky.calls += 1
            if Flaky.calls == 1:
                raise RuntimeError("a collector broke")
            return b"ok 1\n"

    maddr = f"127.0.0.1:{free_port()}"

    def get():
        try:
            with urllib.request.urlopen(f"http://{maddr}/metrics", timeout=10) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    async def main():
        async with trio.open_nursery() as n:
            await n.start(serve_metrics, maddr, Flaky())
            first = await trio.to_thread.run_sync(get)
            second = await trio.to_thread.run_sync(get)
            n.cancel_scope.cancel()
        assert first[0] == 500 and b"log" in first[1], first
        assert second == (200, b"ok 1\n"), second
    trio.run(main)


def test_a_traced_cluster_gives_every_append_its_steps_in_causal_order():
    """bench/write_timeline.py (DATANODE_TRACE, wire/trace.py): a real cluster and bench, each append's steps
    on the client, the leader and both followers -- and each median after the step that causes it (true of every
    append, so of the medians: times are CLOCK_MONOTONIC on one machine)."""
    root = pathlib.Path(__file__).resolve().parent.parent
    p = subprocess.run([sys.executable, "-m", "bench.write_timeline", "--seconds", "1", "--json"],
                       capture_output=True, text=True, timeout=120, cwd=root)
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout)
    assert out["appends"] > 20
    t = {r["step"]: r["p50"] for r in out["steps"]}
    chain = ["submit", "arrived.L", "started.L", "forwarded.L"]
    for f in ("F1", "F2"):
        follower = [f"arrived.{f}", f"started.{f}", f"written.{f}", f"durable.{f}", f"replied.{f}"]
        steps = chain + follower + ["acked.L", "replied.L", "answered"]
        assert [t[s] for s in steps] == sorted(t[s] for s in steps), (f, t)
    assert t["started.L"] < t["written.L"] < t["durable.L"] < t["acked.L"]


def test_a_traced_cluster_gives_every_read_its_steps_in_causal_order():
    """bench/write_timeline.py --reads: each READ's steps on the client and the node that served it, each median
    after the step that causes it (the request arrives, takes its budget and block, the disk, the payload goes
    out, then the answer) -- and no append's step is taken for a read's."""
    root = pathlib.Path(__file__).resolve().parent.parent
    p = subprocess.run([sys.executable, "-m", "bench.write_timeline", "--reads", "--size", "1MiB",
                        "--depth", "2", "--seconds", "1", "--json"], capture_output=True, text=True, timeout=120,
                       cwd=root)
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout)
    assert out["reads"] > 20
    t = {r["step"]: r["p50"] for r in out["steps"]}
    steps = ["read.submit", "read.arrived", "read.started", "read.disk", "read.sent", "read.replied",
             "read.answered"]
    assert sorted(t) == sorted(steps), t
    assert [t[s] for s in steps] == sorted(t.values()), t


def test_the_loop_lag_probe_wakes_once_a_second_while_no_request_comes():
    """Every wake-up of an idle process costs CPU (most of an idle node's was the probe's 50 a second): while
    the node takes no request the probe sleeps IDLE_PERIOD, and the first request brings PERIOD back."""
    from trio.testing import MockClock

    from datanode.metrics import LoopLag

    lag = LoopLag(CollectorRegistry())
    taken = [0]

    async def main():
        async with trio.open_nursery() as n:
            n.start_soon(lag.run, lambda: taken[0])
            await trio.sleep(10)                     # no request for 10 s
            idle = sum(lag.counts)
            for _ in range(200):                     # then a request every 5 ms for 1 s
                taken[0] += 1
                await trio.sleep(0.005)
            busy = sum(lag.counts) - idle
            n.cancel_scope.cancel()
        return idle, busy

    idle, busy = trio.run(main, clock=MockClock(autojump_threshold=0))
    assert idle <= 12                                # ~1 + 10 s / IDLE_PERIOD, not 10 s / PERIOD = 500
    assert busy >= 1 / LoopLag.PERIOD - 5           # ~50: the probe at PERIOD while requests come


def test_who_may_connect_is_a_gauge_and_in_node_status(nodes, tmp_path):
    """Without a secret: auth off, loopback peers only (insecure = true: any host), in /metrics and in
    `dnctl node status`; with the secret: auth on."""
    from wire.auth import gen_secret
    sec = tmp_path / "secret"
    sec.write_text(gen_secret())
    sec.chmod(0o600)
    maddrs = [f"127.0.0.1:{free_port()}" for _ in range(3)]
    plain, = nodes(1, metrics_listen=maddrs[0])
    nodes(1, metrics_listen=maddrs[1], insecure=True)
    nodes(1, metrics_listen=maddrs[2], secret_file=str(sec))
    assert value(scrape(maddrs[0]), "datanode_auth", auth="off", peers="loopback") == 1
    assert value(scrape(maddrs[1]), "datanode_auth", auth="off", peers="any") == 1
    assert value(scrape(maddrs[2]), "datanode_auth", auth="on", peers="none") == 1
    p = dnctl("node", "status", plain.addr, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "authentication off; takes peers: this host only, unauthenticated (no secret)" in p.stdout, p.stdout
