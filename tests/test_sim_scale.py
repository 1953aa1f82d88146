"""The real manager and etcd against a simulated cluster (lab/simnode.py): tens of nodes, thousands of
partitions, in one process beside the test.

* Kill a node: every partition it led is writable again (a view without it installed on a live leader and
  every replica) within a bound, and every partition it held is back at its replica count, all synced.
* A manager pass costs what changed: with the map settled the manager is all but idle, and a map event that
  changes no partition (an answered admin request) costs it well under what a pass over every partition
  would at thousands of them.
"""
from __future__ import annotations

import shutil
import time

import pytest
import trio

from bench.scale_sim import cluster, cpu_seconds, create, settled, until

pytestmark = pytest.mark.skipif(shutil.which("etcd") is None, reason="needs etcd (etcd-server)")

NODES = 30
PARTITIONS = 1500
WRITABLE_S = 20.0        # kill -> every partition it led writable (goal at 300 nodes: 10 s; a busy 2-core box)
REFILL_S = 60.0
EVENTS = 30
QUIET_CORES = 0.05       # the manager with the map settled, at most
EVENT_MS = 5.0           # manager CPU per map event that touches no partition, at most (a pass over every
                         # partition, a task each, costs tens of ms at 1,500)


def test_kill_a_sim_node_and_the_manager_cost_per_event(tmp_path):
    async def main():
        async with cluster(tmp_path, NODES) as (sim, mgr, admin, _etcd):
            await create(sim, admin, PARTITIONS, 3, timeout=120)
            assert len(sim.views) == PARTITIONS

            # events that change no partition: an answered admin request put every 200 ms (a pass each, which
            # finds nothing to do), against as long a quiet time just before
            await trio.sleep(1)
            quiet_cpu, quiet_s = cpu_seconds(mgr.proc.pid), time.monotonic()
            await trio.sleep(EVENTS * 0.2)
            quiet_cpu, quiet_s = cpu_seconds(mgr.proc.pid) - quiet_cpu, time.monotonic() - quiet_s
            cpu0, t0 = cpu_seconds(mgr.proc.pid), time.monotonic()
            for i in range(EVENTS):
                await admin.put_entry(admin.key("requests", f"done-{i}"),
                                      {"op": "create", "count": 1, "replicas": 3, "state": "done"})
                await trio.sleep(0.2)
            busy_cpu, busy_s = cpu_seconds(mgr.proc.pid) - cpu0, time.monotonic() - t0
            per_event_ms = (busy_cpu - quiet_cpu * busy_s / quiet_s) * 1000 / EVENTS
            print(f"manager CPU per event: {per_event_ms:.2f} ms ({busy_cpu:.2f}s for {EVENTS} events in "
                  f"{busy_s:.1f}s; {quiet_cpu:.2f}s in {quiet_s:.1f}s quiet)")
            assert quiet_cpu / quiet_s <= QUIET_CORES, (f"the manager took {quiet_cpu / quiet_s:.3f} cores with "
                                                        f"the map settled at {PARTITIONS} partitions")
            assert per_event_ms <= EVENT_MS, (f"{per_event_ms:.1f} ms of manager CPU per event at {PARTITIONS} "
                                              f"partitions")

            leads = {a: sim.led_by(a) for a in sim.nodes}
            victim = max(leads, key=lambda a: len(leads[a]))
            held = [pid for pid, v in sim.views.items() if victim in v.replicas]
            sim.kill(victim)
            await until("every partition the killed node led writable",
                        lambda: all(sim.writable(pid, victim) for pid in leads[victim]) or "not yet", WRITABLE_S)
            await until("every partition it held back at 3 synced replicas without it",
                        lambda: (all(victim not in sim.views[pid].replicas for pid in held)
                                 and settled(sim, 3)), REFILL_S, every=0.25)
            for pid in held:
                v = sim.views[pid]
                assert len(v.replicas) == 3 and set(v.synced) == set(v.replicas) and v.installed, v
                for a in v.replicas:
                    assert sim.nodes[a].alive and sim.nodes[a].parts[pid].epoch == v.epoch, (pid, a)
    trio.run(main)
