"""dnctl commands for replica health, repair, scrub, leader changes and the crash-torture soak.

Registered into dnctl's main group by ``register(main)`` (one line at the bottom of tools/dnctl.py):

\b
    dnctl partition health --id 1 --cluster /tmp/dn        # the leader's view of every replica
    dnctl replica repair   --id 1 --cluster /tmp/dn --wait  # a full repair pass now (sizes + block CRCs)
    dnctl partition scrub  --id 1 --cluster /tmp/dn --wait  # re-read every block on every replica
    dnctl replica add      --id 1 --node ADDR --via LEADER  # + waits for the new replica, with progress
    dnctl partition set-leader --id 1 ADDR                  # also when the old leader is dead
    dnctl torture --seconds 60 --seed 7                     # SIGKILL/restart nodes under writes, verify

The functions are plain async code on a DataClient, so tests and tools use them too.
"""
from __future__ import annotations

import sys
import time

import click
import trio

from client.sdk import ClientError, DataClient
from datanode.protocol import Op, Result

MiB = 1 << 20


# -- library -------------------------------------------------------------------------------------------
async def health(dc: DataClient, addr: str, pid: int) -> dict:
    """PARTITION_HEALTH from ``addr`` (the leader keeps the replica states; a follower says so)."""
    return await dc.admin(addr, Op.PARTITION_HEALTH, partition=pid)


async def find_leader(dc: DataClient, pid: int, seeds: list[str]) -> str:
    from tools.dnctl import current_view
    return (await current_view(dc, pid, seeds)).leader


async def request(dc: DataClient, leader: str, pid: int, op: Op) -> int:
    """Ask the leader for a repair (Op.REPAIR) or scrub (Op.SCRUB) pass; returns the pass number."""
    resp = await dc.admin(leader, op, partition=pid)
    return resp.arg


def settled(h: dict, only: str | None = None) -> bool:
    fs = [f for f in h.get("followers", []) if only is None or f["addr"] == only]
    if only is not None and not fs:
        return False
    return (all(f["state"] == "healthy" for f in fs) and not h["repair"]["running"]
            and not h["scrub"]["running"])


async def wait_settled(dc: DataClient, leader: str, pid: int, *, only: str | None = None,
                       repair_pass: int = 0, scrub_pass: int = 0, timeout: float = 120.0,
                       on_progress=None, interval: float = 0.25) -> dict:
    """Poll the leader until the followers (or ``only``) are healthy and the asked passes are done."""
    deadline = trio.current_time() + timeout
    h: dict = {}
    while trio.current_time() < deadline:
        try:
            h = await health(dc, leader, pid)
        except ClientError as e:
            h = {"error": str(e)}
        else:
            if on_progress:
                on_progress(h)
            if ("repair" in h and h["repair"]["passes"] >= repair_pass and h["scrub"]["passes"] >= scrub_pass
                    and settled(h, only)):
                return h
        await trio.sleep(interval)
    raise ClientError(f"partition {pid} did not settle within {timeout:g}s: {h}")


async def set_leader(dc: DataClient, pid: int, addr: str, seeds: list[str]) -> dict:
    """Make ``addr`` the leader at epoch + 1.  With the leader alive this is dnctl's ordinary change
    (``change_replicas``).  With the leader dead, the newest view among the replicas that answer is used,
    every reachable member is updated (``addr`` first) and the old leader is left to be fenced: it learns
    the new epoch from the new leader's heartbeat when it comes back, and is repaired as a follower."""
    from tools.dnctl import View, _why, change_replicas, node_view
    views: dict[str, View] = {}
    errors: dict[str, str] = {}
    for a in dict.fromkeys([addr, *seeds]):
        try:
            v = await node_view(dc, a, pid)
            if v is not None:
                views[a] = v
        except ClientError as e:
            errors[a] = _why(e, a)
    if not views:
        raise ClientError(f"partition {pid}: no replica answered: {errors}")
    newest = max(views.values(), key=lambda v: v.epoch)
    for a in newest.replicas:                 # ask every member we have not heard from
        if a not in views and a not in errors:
            try:
                v = await node_view(dc, a, pid)
                if v is not None:
                    views[a] = v
            except ClientError as e:
                errors[a] = _why(e, a)
    newest = max(views.values(), key=lambda v: v.epoch)
    if addr not in newest.replicas:
        raise ClientError(f"{addr} is not a replica of partition {pid} ({', '.join(newest.replicas)})")
    if addr not in views or views[addr].epoch != newest.epoch:
        raise ClientError(f"{addr} is not at the partition's epoch {newest.epoch}; it cannot lead")
    if newest.leader == addr:
        return {"id": pid, "unchanged": True, "replicas": newest.replicas, "epoch": newest.epoch}
    new = [addr] + [a for a in newest.replicas if a != addr]
    if newest.leader in views:                # the leader is alive: the ordinary change
        return await change_replicas(dc, views[newest.leader], new)
    epoch = newest.epoch + 1
    body = {"replicas": new, "epoch": epoch}
    steps, warnings = [], []
    for a in new:
        if a in errors:
            steps.append({"node": a, "action": "update", "result": f"unreachable ({errors[a]})"})
            warnings.append(f"{a} did not answer; the new leader tells it epoch {epoch} when it is back "
                            f"(until then it is fenced: its epoch-{newest.epoch} requests are refused)")
            continue
        try:
            await dc.admin(a, Op.PARTITION_UPDATE, partition=pid, body=body)
            steps.append({"node": a, "action": "update", "result": "ok"})
        except ClientError as e:
            if a == addr:
                raise ClientError(f"nothing changed: {addr} refused epoch {epoch}: {_why(e, a)}") from None
            steps.append({"node": a, "action": "update", "result": _why(e, a)})
            warnings.append(f"{a}: {_why(e, a)}")
    return {"id": pid, "old": {"replicas": newest.replicas, "epoch": newest.epoch},
            "new": {"replicas": new, "epoch": epoch}, "steps": steps, "warnings": warnings,
            "forced": True}


class ProgressBar:
    """One line on stderr: bytes copied of total, rate, ETA (rewritten in place on a terminal)."""

    def __init__(self, addr: str, stream=None):
        self.addr = addr
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.last = 0.0
        self.seen = False

    def __call__(self, h: dict) -> None:
        cur = (h.get("repair") or {}).get("current")
        f = next((f for f in h.get("followers", []) if f["addr"] == self.addr), None)
        if cur and cur["addr"] == self.addr:
            done, total = cur["copied"], max(cur["total"], 1)
            rate, eta = cur["rate_mib_s"], cur["eta_s"]
            width = 30
            fill = int(width * min(done / total, 1))
            line = (f"{self.addr} repairing [{'#' * fill}{'.' * (width - fill)}] {done / MiB:8.1f}/"
                    f"{total / MiB:.1f} MiB {100 * done / total:5.1f}%  {rate:7.1f} MiB/s  ETA "
                    + (f"{eta:.1f}s" if eta is not None else "?"))
            self.seen = True
        elif f is not None:
            line = f"{self.addr} {f['state']}, {f['bytes_behind'] / MiB:.1f} MiB behind"
        else:
            return
        now = time.monotonic()
        if self.tty:
            self.stream.write("\r" + line.ljust(100))
            self.stream.flush()
        elif now - self.last >= 0.5:
            self.stream.write(line + "\n")
            self.stream.flush()
            self.last = now

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


# -- commands ------------------------------------------------------------------------------------------
def _health_text(h: dict) -> str:
    lines = [f"partition {h['id']} on {h['node']}: {h['role']}, epoch {h['epoch']}, leader {h['leader']}",
             f"  replicas: {', '.join(h['replicas'])}"]
    if "followers" not in h:
        lines.append(f"  {h.get('note', '')}")
        return "\n".join(lines)
    lines.append(f"  {'follower':21} {'state':11} {'last contact':>12} {'behind':>12} {'extents':>7}  error")
    for f in h["followers"]:
        age = f"{f['contact_age_s']:.1f}s ago" if f["contact_age_s"] is not None else "never"
        lines.append(f"  {f['addr']:21} {f['state']:11} {age:>12} {f['bytes_behind']:>12} "
                     f"{f['extents_behind']:>7}  {f['error']}")
    r, s = h["repair"], h["scrub"]
    cur = r["current"]
    lines.append(f"  repair: {'running' if r['running'] else 'idle'}, {r['passes']} passes, cap "
                 f"{r['cap_mib_s'] or 'none'} MiB/s"
                 + (f"; now {cur['addr']}: {cur['copied']}/{cur['total']} bytes at {cur['rate_mib_s']} MiB/s"
                    if cur else "")
                 + (f"; last: {r['last']['bytes_copied']} bytes in {r['last']['seconds']}s" if r["last"] else ""))
    lines.append(f"  scrub: {'running' if s['running'] else 'idle'}, {s['passes']} passes"
                 + (f"; last: {s['last']['extents']} extents, {s['last']['bytes']} bytes, "
                    f"{s['last']['bad_blocks']} bad blocks, {s['last']['repaired']} repaired"
                    if s["last"] else ""))
    if h["sealed_extents"]:
        lines.append(f"  sealed extents: {h['sealed_extents']}")
    return "\n".join(lines)


def register(main: click.Group) -> None:
    from tools import dnctl
    partition: click.Group = main.commands["partition"]
    replica: click.Group = main.commands["replica"]
    where = [click.option("--via", help="Any node that hosts the partition (HOST:PORT)."),
             click.option("--cluster", type=click.Path(file_okay=False), help="A local cluster dir.")]

    def with_where(fn):
        for opt in reversed(where):
            fn = opt(fn)
        return fn

    @partition.command("health")
    @click.option("--id", "pid", type=click.IntRange(1), required=True, help="Partition id.")
    @with_where
    @click.option("--json", "as_json", is_flag=True)
    def partition_health(pid, via, cluster, as_json):
        """The leader's view of each follower: state (healthy, lagging, repairing, unreachable), last
        contact, bytes behind; repair and scrub progress."""
        async def go():
            async with DataClient.open(timeout=5) as dc:
                leader = await find_leader(dc, pid, dnctl._seeds(via, cluster))
                return await health(dc, leader, pid)
        h = dnctl.run(go)
        dnctl.emit(h, as_json, _health_text(h))

    @partition.command("scrub")
    @click.option("--id", "pid", type=click.IntRange(1), required=True, help="Partition id.")
    @with_where
    @click.option("--wait/--no-wait", default=True, show_default=True, help="Wait for the pass to finish.")
    @click.option("--timeout", type=click.FloatRange(1), default=600, show_default=True)
    @click.option("--json", "as_json", is_flag=True)
    def partition_scrub(pid, via, cluster, wait, timeout, as_json):
        """Re-read every block on every replica now and check its CRC; bad blocks are refetched from a
        replica whose copy verifies (rate: the leader's scrub_mib_s)."""
        run_pass(Op.SCRUB, "scrub", pid, via, cluster, wait, timeout, as_json)

    @replica.command("repair")
    @click.option("--id", "pid", type=click.IntRange(1), required=True, help="Partition id.")
    @with_where
    @click.option("--wait/--no-wait", default=True, show_default=True, help="Wait until every replica is healthy.")
    @click.option("--timeout", type=click.FloatRange(1), default=600, show_default=True)
    @click.option("--json", "as_json", is_flag=True)
    def replica_repair(pid, via, cluster, wait, timeout, as_json):
        """A full repair pass now: compare sizes and block CRCs with every follower and copy, cut or
        delete what differs (the leader is authoritative)."""
        run_pass(Op.REPAIR, "repair", pid, via, cluster, wait, timeout, as_json)

    # `replica add` (replaces dnctl's): its membership change, then wait for the fill with a progress bar

    @click.command("add", context_settings=dnctl.CTX)
    @click.option("--id", "pid", type=click.IntRange(1), required=True, help="Partition id.")
    @click.option("--node", "addr", required=True, help="The node to add (HOST:PORT); it must be running.")
    @with_where
    @click.option("--wait/--no-wait", default=True, show_default=True,
                  help="Wait until repair made the new replica identical (progress on stderr).")
    @click.option("--timeout", type=click.FloatRange(1), default=3600, show_default=True)
    @click.option("--json", "as_json", is_flag=True)
    def replica_add(pid, addr, via, cluster, wait, timeout, as_json):
        """Add NODE as the last replica of a partition (epoch + 1); the leader's repair fills it, and it is
        healthy only when identical.  Shows bytes copied, rate and ETA while waiting."""
        dnctl.check_addr(addr)
        seeds = dnctl._seeds(via, cluster)
        bar = ProgressBar(addr)

        async def go():
            async with DataClient.open(timeout=10) as dc:
                old = await dnctl.current_view(dc, pid, seeds)
                if addr in old.replicas:
                    raise ClientError(f"{addr} is already a replica of partition {pid}")
                res = await dnctl.change_replicas(dc, old, old.replicas + [addr])
                if wait:
                    t0 = time.monotonic()
                    n = await request(dc, old.leader, pid, Op.REPAIR)
                    try:
                        h = await wait_settled(dc, old.leader, pid, only=addr, repair_pass=n, timeout=timeout,
                                               on_progress=bar)
                    finally:
                        bar.close()
                    last = h["repair"]["last"] or {}
                    res["repair"] = {"seconds": round(time.monotonic() - t0, 2),
                                     "bytes_copied": last.get("bytes_copied"), "mib_s": last.get("mib_s"),
                                     "state": next(f["state"] for f in h["followers"] if f["addr"] == addr)}
                return res
        res = dnctl.run(go)
        text = dnctl._change_text(res)
        if "repair" in res:
            r = res["repair"]
            text += (f"\n{addr} is {r['state']}: identical to the leader after {r['seconds']}s "
                     f"(last pass copied {r['bytes_copied']} bytes at {r['mib_s']} MiB/s)")
        else:
            text += f"\nnote: {addr} is being filled by repair; see: dnctl partition health --id {pid}"
        dnctl.emit(res, as_json, text)

    replica.add_command(replica_add, "add")

    @click.command("set-leader", context_settings=dnctl.CTX)
    @click.option("--id", "pid", type=click.IntRange(1), required=True, help="Partition id.")
    @click.argument("addr")
    @with_where
    @click.option("--json", "as_json", is_flag=True)
    def partition_set_leader(pid, addr, via, cluster, as_json):
        """Make replica ADDR the leader (moved to the front of the list, epoch + 1), also when the old
        leader is dead: the old leader is then fenced by the epoch, learns the new list from the new leader
        when it comes back, and is repaired as a follower."""
        dnctl.check_addr(addr)
        seeds = [a for a in (dnctl._seeds(via, cluster) if (via or cluster) else []) if a != addr]

        async def go():
            async with DataClient.open(timeout=5) as dc:
                return await set_leader(dc, pid, addr, seeds)
        res = dnctl.run(go)
        if res.get("unchanged"):
            dnctl.emit(res, as_json, f"{addr} already leads partition {pid} (epoch {res['epoch']})")
        else:
            dnctl.emit(res, as_json, dnctl._change_text(res))

    partition.add_command(partition_set_leader, "set-leader")

    @main.command("torture", context_settings=dnctl.CTX)
    @click.option("--seed", type=int, help="Random seed (default: random, printed).")
    @click.option("--seconds", type=click.FloatRange(1), default=60, show_default=True)
    @click.option("--clients", type=click.IntRange(1, 16), default=3, show_default=True)
    @click.option("--dir", "root", type=click.Path(file_okay=False), help="Work dir (default: a temp dir).")
    @click.option("--json", "as_json", is_flag=True)
    def torture(seed, seconds, clients, root, as_json):
        """Crash torture: clients write continuously while random nodes (leaders too) are SIGKILLed and
        restarted; at the end every acknowledged write must read back from every replica."""
        from tools import torture as t
        res = t.main_sync(seed=seed, seconds=seconds, clients=clients, root=root)
        dnctl.emit(res, as_json, t.summary(res))
        if not res["ok"]:
            sys.exit(1)


__all__ = ["health", "find_leader", "request", "wait_settled", "set_leader", "register", "Result"]


def run_pass(op, name: str, pid, via, cluster, wait, timeout, as_json) -> None:
    """Ask the partition's leader for a repair or scrub pass; optionally wait until it has settled."""
    from tools import dnctl
    key = f"{name}_pass"

    async def go():
        async with DataClient.open(timeout=10) as dc:
            leader = await find_leader(dc, pid, dnctl._seeds(via, cluster))
            n = await request(dc, leader, pid, op)
            if not wait:
                return {key: n, "leader": leader}
            return await wait_settled(dc, leader, pid, timeout=timeout, **{key: n})
    h = dnctl.run(go)
    if key in h:
        dnctl.emit(h, as_json, f"{name} pass {h[key]} requested on leader {h['leader']}")
    else:
        dnctl.emit(h, as_json, _health_text(h))
