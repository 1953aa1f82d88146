"""`dnctl bench`: write/read throughput, latency percentiles and CPU cost per GB.

Each client is its own process (``python -m tools.bench worker SPEC``) with its own DataClient, so its CPU
time (getrusage of the worker, all threads) is measured separately from the parent and from the datanodes.
A client keeps ``depth`` requests in flight: writes are pipelined appends to one extent (the SDK's
``submit_append``, as ``DataClient.write`` does), reads are ``DataClient.read`` calls of one request each.
Every request is one latency sample (submit -> answer, so it includes queueing behind the other in-flight
requests of that client).

Parent <-> worker protocol: JSON lines.  The worker prints {"ready"}; the parent sends
{"cmd": "prepare", "phase": P, ...}, the worker answers {"prepared"} (a read phase with nothing written
yet first writes its data, unmeasured), the parent sends {"cmd": "go"} to all workers at once, the worker
prints {"progress": bytes} a few times a second and finally {"result": {...}}; {"cmd": "quit"} ends it.

Datanode CPU is utime+stime from /proc/PID/stat of each node process, read before and after each phase.
"""
from __future__ import annotations

import json
import math
import os
import pathlib
import queue
import re
import resource
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter

import click

from wire.transport.base import TransportChoice
from wire.protocol import INLINE_MAX
from datanode.store import free_in_steps
from tools.clikit import ADDR, ADDRS, CTX, Command, cluster_nodes, cluster_option, credentials, login

MIB = 1 << 20
GB = 1e9
SCRATCH_BASE = 4_000_000_000      # scratch partition ids for --replicas K: SCRATCH_BASE + K


# -- sizes --------------------------------------------------------------------------------------------
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 10 ** 6, "mb": 10 ** 6, "mib": 1 << 20}


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{text!r} is not a size like 4KiB, 128KiB, 1MiB or 65536")
    return int(m.group(1)) * _UNITS[m.group(2).lower()]


def fmt_size(n: int) -> str:
    for unit, k in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k and n % k == 0:
            return f"{n // k}{unit}"
    return f"{n}B"


def percentile(sorted_vals: list, q: float):
    if not sorted_vals:
        return None
    k = min(len(sorted_vals) - 1, max(0, math.ceil(q / 100 * len(sorted_vals)) - 1))
    return sorted_vals[k]


# -- the worker (one client process) -----------------------------------------------------------------------
def _cpu_self() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


async def _worker_main(spec: dict) -> None:
    import trio

    from client.sdk import ClientError, DataClient
    from wire.protocol import MAX_EXTENT

    out_lock = trio.Lock()

    async def say(obj) -> None:
        async with out_lock:
            sys.stdout.write(json.dumps(obj) + "\n")
            sys.stdout.flush()

    size, depth, pid = spec["size"], spec["depth"], spec["partition"]
    block = max(4096, 1 << (size - 1).bit_length())
    pool_mib = max(16, 1 << math.ceil(math.log2(max(1, 2 * depth * block) / MIB + 1)))
    payload = os.urandom(size)
    written: list[list[int]] = []        # [extent, acknowledged bytes]: what the read phase reads

    async with DataClient.from_env(spec["nodes"], block_size=block, depth=depth, pool_mib=pool_mib,
                               transport=spec.get("transport", "auto"), timeout=spec.get("timeout", 30),
                               inline_max=spec.get("inline_max", INLINE_MAX),
                               secret=spec.get("secret_file"), tls_ca=spec.get("tls_ca"),
                               read_from="spread" if spec.get("read_from") == "spread" else "leader") as dc:
        part = dc.partition(pid)
        replicas = part.replicas
        rf = spec.get("read_from", "leader")
        read_replica = None if rf in ("leader", "spread") else rf    # spread: the SDK's (next replica per read)

        async def write_phase(seconds, total, progress):
            """``depth`` writers, each sending an append and awaiting its answer itself (at depth 1: what a
            program awaiting ``dc.append`` does).  The appends leave in offset order: a writer takes the next
            offset and sends holding ``order`` -- taken without a scheduler pass when it is free.  (A task per
            append, woken to free a window slot that woke the sender, cost the client two passes of its loop
            per request beside the one its answer takes.)"""
            lat: list[int] = []
            errors: list[str] = []
            order = trio.Lock()
            state = {"extent": None, "off": 0, "sent": 0}
            deadline = trio.current_time() + seconds if seconds else math.inf

            def more() -> bool:
                return not errors and trio.current_time() < deadline and (total is None or state["sent"] < total)

            async def writer():
                while more():
                    if order.locked():
                        await order.acquire()
                    else:
                        order.acquire_nowait()
                    try:
                        if not more():
                            return
                        if state["extent"] is None or state["off"] + size > MAX_EXTENT:
                            state["extent"], state["off"] = await dc.create_extent(pid), 0
                            written.append([state["extent"], 0])
                        rec = written[-1]
                        t0 = time.perf_counter()
                        fut = await dc.submit_append(part, state["extent"], state["off"], payload)
                        state["off"] += size
                        state["sent"] += size
                    except ClientError as e:
                        errors.append(str(e))
                        return
                    finally:
                        order.release()
                    try:
                        loc = await fut
                    except ClientError as e:
                        errors.append(str(e))
                        return
                    lat.append(int((time.perf_counter() - t0) * 1e6))
                    progress[0] += loc.length
                    rec[1] = max(rec[1], loc.offset + loc.length)

            async with trio.open_nursery() as n:
                for _ in range(depth):
                    n.start_soon(writer)
            return lat, errors

        async def read_phase(seconds, total, progress):
            pieces = [(e, off) for e, n in written for off in range(0, n - size + 1, size)]
            lat: list[int] = []
            errors: list[str] = []
            if not pieces:
                return lat, ["nothing to read"]
            deadline = trio.current_time() + seconds if seconds else math.inf
            state = {"next": 0, "taken": 0}
            # a cold read phase reads every written piece at most once: a second pass would hit the page cache
            limit = len(pieces) if once else math.inf

            async def reader():
                buf = bytearray(size)          # each reader's own, reused: reads land in it, no copies
                while (not errors and trio.current_time() < deadline and state["next"] < limit
                       and (total is None or state["taken"] < total)):
                    extent, off = pieces[state["next"] % len(pieces)]
                    state["next"] += 1
                    state["taken"] += size
                    t0 = time.perf_counter()
                    try:
                        got = await dc.read_into(pid, extent, off, buf, replica=read_replica)
                    except ClientError as e:
                        errors.append(str(e))
                        return
                    lat.append(int((time.perf_counter() - t0) * 1e6))
                    progress[0] += got

            async with trio.open_nursery() as n:
                for _ in range(depth):
                    n.start_soon(reader)
            return lat, errors

        async def reporter(progress, stop: trio.Event):
            while not stop.is_set():
                with trio.move_on_after(0.25):
                    await stop.wait()
                await say({"progress": progress[0]})

        await say({"ready": True, "replicas": replicas, "read_replica": read_replica})
        for _ in range(1000):                       # bounded: a handful of phases in practice
            line = await trio.to_thread.run_sync(sys.stdin.readline)
            if not line:
                return
            cmd = json.loads(line)
            if cmd["cmd"] == "quit":
                return
            if cmd["cmd"] != "prepare":
                continue
            phase, seconds, total = cmd["phase"], cmd.get("seconds"), cmd.get("bytes")
            once = bool(cmd.get("once"))
            prepared = {"prepared": phase}
            if phase == "read" and not written:
                fill = total if total else spec.get("prefill", 64 * MIB)
                fill = max(fill, size * depth)
                _, errs = await write_phase(None, fill, [0])
                prepared["prefilled"] = sum(n for _, n in written)
                if errs:
                    prepared["error"] = errs[0]
            await say(prepared)
            go = json.loads(await trio.to_thread.run_sync(sys.stdin.readline) or '{"cmd": "quit"}')
            if go["cmd"] != "go":
                return
            progress = [0]
            stop = trio.Event()
            cpu0, t0 = _cpu_self(), time.monotonic()
            async with trio.open_nursery() as n:
                n.start_soon(reporter, progress, stop)
                lat, errors = await (write_phase if phase == "write" else read_phase)(seconds, total, progress)
                t1, cpu1 = time.monotonic(), _cpu_self()
                stop.set()
            await say({"result": {"phase": phase, "bytes": progress[0], "requests": len(lat), "start": t0,
                                  "written": sum(n - n % size for _, n in written),
                                  "end": t1, "cpu_s": cpu1 - cpu0, "lat_us": lat, "errors": errors[:5],
                                  "error_count": len(errors)}})


def worker_entry(argv: list[str]) -> None:
    import trio
    spec = json.loads(argv[0])
    try:
        trio.run(_worker_main, spec)
    except Exception as e:  # noqa: BLE001 - reported to the parent as one line
        sys.stdout.write(json.dumps({"fatal": f"{type(e).__name__}: {e}"}) + "\n")
        sys.stdout.flush()
        sys.exit(1)


# -- the parent ------------------------------------------------------------------------------------------
class BenchError(Exception):
    pass


class Worker:
    def __init__(self, index: int, spec: dict, q: queue.Queue, log_dir: pathlib.Path | None):
        self.index = index
        self.stderr_path = (log_dir / f"bench-worker{index}.err") if log_dir else None
        err = open(self.stderr_path, "wb") if self.stderr_path else subprocess.DEVNULL
        self.proc = subprocess.Popen([sys.executable, "-m", "tools.bench", "worker", json.dumps(spec)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                                     bufsize=1)
        if err is not subprocess.DEVNULL:
            err.close()
        self.thread = threading.Thread(target=self._pump, args=(q,), daemon=True)
        self.thread.start()

    def _pump(self, q: queue.Queue) -> None:
        for line in self.proc.stdout:
            try:
                q.put((self.index, json.loads(line)))
            except ValueError:
                q.put((self.index, {"noise": line.rstrip()}))
        q.put((self.index, {"eof": True}))

    def send(self, obj) -> None:
        try:
            self.proc.stdin.write(json.dumps(obj) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass

    def close(self) -> None:
        self.send({"cmd": "quit"})
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def why(self) -> str:
        if self.stderr_path and self.stderr_path.exists():
            lines = [ln for ln in self.stderr_path.read_text(errors="replace").splitlines() if ln.strip()]
            if lines:
                return lines[-1]
        return f"exit status {self.proc.poll()}"


def _collect(workers, q, want: str, timeout: float, on_progress=None) -> dict[int, dict]:
    """Wait until every worker sent a message with key ``want``; returns {index: message}."""
    got: dict[int, dict] = {}
    deadline = time.monotonic() + timeout
    while len(got) < len(workers):
        left = deadline - time.monotonic()
        if left <= 0:
            raise BenchError(f"workers {sorted(set(range(len(workers))) - set(got))} did not report "
                             f"'{want}' within {timeout:g}s")
        try:
            i, msg = q.get(timeout=min(left, 0.2))
        except queue.Empty:
            continue
        if "fatal" in msg:
            raise BenchError(f"client {i}: {msg['fatal']}")
        if "eof" in msg:
            raise BenchError(f"client {i} exited: {workers[i].why()}")
        if "progress" in msg and on_progress:
            on_progress(i, msg["progress"])
        if want in msg:
            got[i] = msg
    return got


WRITE_STAGES = ("fetch", "queue", "local", "durable", "replicas")     # datanode/metrics.py WriteStages


def stage_snapshot(addrs: list[str]) -> dict:
    """Each node's write-stage counters (NODE_STATUS ``write_stages``); a node that does not answer, or
    predates them, is left out."""
    import trio

    from client import admin
    from client.sdk import ClientError, DataClient

    async def snap():
        out = {}
        async with DataClient.from_env(timeout=10, **credentials()) as dc:
            for a in addrs:
                try:
                    st = (await admin.node_status(dc, a)).get("write_stages")
                except ClientError:
                    continue
                if st is not None:
                    out[a] = st
        return out
    try:
        return trio.run(snap)
    except Exception:       # noqa: BLE001 - a breakdown is extra: the phase's figures stand without it
        return {}


def stage_means_ms(before: dict, after: dict) -> dict:
    """Per node, the mean milliseconds per append of each write stage between two ``stage_snapshot``s (a
    phase): {addr: {role: {"appends": n, stage: ms, ...}}}; nodes and roles without appends left out."""
    out = {}
    for addr, roles in after.items():
        for role, stages in roles.items():
            prev = before.get(addr, {}).get(role, {})
            row = {}
            for st in WRITE_STAGES:
                if st not in stages:
                    continue
                n = stages[st]["count"] - prev.get(st, {}).get("count", 0)
                if n > 0:
                    row.setdefault("appends", n)
                    row[st] = round((stages[st]["sum_s"] - prev.get(st, {}).get("sum_s", 0.0)) / n * 1e3, 3)
            if row:
                out.setdefault(addr, {})[role] = row
    return out


def run_config(*, nodes: list[str], pid: int, size: int, clients: int, depth: int, seconds: float | None,
               total: int | None, phases: list[str], node_pids: dict[str, int], read_from: str,
               transport: str, label: str, log_dir: pathlib.Path | None, progress: bool = True,
               inline_max: int = INLINE_MAX, cold: bool = False, disk: str | None = None,
               after_cold=None, after_write=None) -> list[dict]:
    """Run the phases against one partition with ``clients`` worker processes; one result per phase.
    ``cold``: before a read phase, drop the page cache (after the data is written) and read each piece once;
    the counters of ``disk`` (a /proc/diskstats name) around it go into the result (``disk``), and
    ``after_cold(result)`` runs right after it (the same round's baselines); ``after_write(result)`` runs
    right after each write phase (dd's round: ``--dd --rounds``)."""
    from tools.cluster import cpu_seconds
    q: queue.Queue = queue.Queue()
    per_client = -(-total // clients) if total else None
    workers = []
    results = []
    try:
        for i in range(clients):
            spec = {"nodes": nodes, "partition": pid, "size": size, "depth": depth, "index": i,
                    "read_from": read_from, "transport": transport, "inline_max": inline_max,
                    "prefill": min(256 * MIB, max(64 * MIB, size * depth * 64)), **login().paths()}
            workers.append(Worker(i, spec, q, log_dir))
        _collect(workers, q, "ready", 60)
        for phase in phases:
            for w in workers:
                w.send({"cmd": "prepare", "phase": phase, "seconds": seconds, "bytes": per_client,
                        "once": cold and phase == "read"})
            prep = _collect(workers, q, "prepared", 600)
            bad = [f"client {i}: {m['error']}" for i, m in prep.items() if m.get("error")]
            if bad:
                raise BenchError(f"{phase} phase: preparing failed: {bad[0]}")
            cold_read = cold and phase == "read"
            if cold_read:
                drop_caches()
            d0 = disk_sample(disk) if cold_read else None
            stages0 = stage_snapshot(nodes) if phase == "write" else {}
            cpu0 = {a: cpu_seconds(p) for a, p in node_pids.items()}
            done = [0] * clients
            t_start = time.monotonic()
            for w in workers:
                w.send({"cmd": "go"})
            bar_len = int(seconds * 10) if seconds else (per_client or 0) * clients
            with click.progressbar(length=max(1, bar_len), label=f"{label} {phase:5}", file=sys.stderr,
                                   show_eta=not seconds, show_percent=True, width=30,
                                   item_show_func=lambda _: f"{sum(done) / MIB / max(1e-6, time.monotonic() - t_start):8.1f} MiB/s"
                                   ) if progress else _NoBar() as bar:
                shown = [0]

                def on_progress(i, nbytes):
                    done[i] = nbytes
                    pos = (min(bar_len, int((time.monotonic() - t_start) * 10)) if seconds
                           else min(bar_len, sum(done)))
                    if pos > shown[0]:
                        bar.update(pos - shown[0], True)
                        shown[0] = pos

                limit = (seconds + 120) if seconds else 3600
                res = _collect(workers, q, "result", limit, on_progress)
            d1 = disk_sample(disk) if cold_read else None
            cpu1 = {a: cpu_seconds(p) for a, p in node_pids.items()}
            results.append(_aggregate(phase, [res[i]["result"] for i in range(clients)], cpu0, cpu1,
                                      size=size, clients=clients, depth=depth))
            results[-1]["cold"] = cold_read
            if phase == "write":     # where each append's time went on the nodes (mean ms per stage)
                results[-1]["write_stages"] = stage_means_ms(stages0, stage_snapshot(nodes))
                if after_write is not None:
                    after_write(results[-1])
            if cold_read:
                results[-1]["disk"] = disk_delta(d0, d1, results[-1]["bytes"])
                if after_cold is not None:
                    after_cold(results[-1])
    finally:
        for w in workers:
            w.close()
    return results


class _NoBar:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False

    def update(self, *a):
        pass


def _aggregate(phase, rs: list[dict], cpu0, cpu1, *, size, clients, depth) -> dict:
    total = sum(r["bytes"] for r in rs)
    reqs = sum(r["requests"] for r in rs)
    elapsed = max(r["end"] for r in rs) - min(r["start"] for r in rs)
    lat = sorted(x for r in rs for x in r["lat_us"])
    gbytes = total / GB if total else 0
    nodes_cpu = {}
    for a in cpu0:
        if cpu0[a] is not None and cpu1[a] is not None:
            d = cpu1[a] - cpu0[a]
            nodes_cpu[a] = {"cpu_s": round(d, 3), "s_per_gb": round(d / gbytes, 2) if gbytes else None}
    client_cpu = sum(r["cpu_s"] for r in rs)

    def ms(v):
        return round(v / 1000, 3) if v is not None else None
    return {"phase": phase, "size": size, "clients": clients, "depth": depth, "bytes": total,
            "written": sum(r.get("written", 0) for r in rs),
            "requests": reqs, "seconds": round(elapsed, 3),
            # the phase on this machine's CLOCK_MONOTONIC: scripts line it up with what they sampled meanwhile
            "monotonic": [min(r["start"] for r in rs), max(r["end"] for r in rs)],
            "mib_s": round(total / MIB / elapsed, 1) if elapsed > 0 else 0.0,
            "iops": round(reqs / elapsed, 1) if elapsed > 0 else 0.0,
            "latency_ms": {"p50": ms(percentile(lat, 50)), "p99": ms(percentile(lat, 99)),
                           "p999": ms(percentile(lat, 99.9)), "max": ms(lat[-1] if lat else None)},
            "client_cpu": {"cpu_s": round(client_cpu, 3),
                           "s_per_gb": round(client_cpu / gbytes, 2) if gbytes else None},
            "node_cpu": nodes_cpu,
            "errors": sum(r["error_count"] for r in rs), "first_errors": [e for r in rs for e in r["errors"]][:3]}


def _dd_seconds(stderr: str, measured: float) -> float:
    """The seconds dd reports for its copy ("... copied, 1.23 s, ..."; a decimal comma too), else ours."""
    m = re.search(r"copied, ([\d.,]+) s,", stderr)
    return float(m.group(1).replace(",", ".")) if m else measured


def run_dd(directory: pathlib.Path, mib: int) -> dict:
    path = directory / "ddtest"
    click.echo(f"dd: writing {mib} MiB to {path} ...", err=True)
    cmd = ["dd", "if=/dev/zero", f"of={path}", "bs=1M", f"count={mib}", "conv=fdatasync"]
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"command": " ".join(cmd), "error": str(e)}
    finally:
        dt = time.monotonic() - t0
        remove_file(path)
    if p.returncode != 0:
        return {"command": " ".join(cmd), "error": (p.stderr.strip().splitlines() or ["failed"])[-1]}
    secs = _dd_seconds(p.stderr, dt)
    return {"command": " ".join(cmd), "bytes": mib * MIB, "seconds": round(secs, 3),
            "mb_s": round(mib * MIB / 1e6 / secs, 1), "mib_s": round(mib / secs, 1),
            "dd_says": p.stderr.strip().splitlines()[-1] if p.stderr.strip() else ""}


def dd_round(ours_mib_s: float, replicas: int, dd: dict) -> dict:
    """One write round against its dd: ours x replicas / dd -- the disk's bytes per second for our replicated
    writes (every replica's copy lands on this one disk in a local cluster) against dd's on the same disk."""
    ratio = round(ours_mib_s * replicas / dd["mib_s"], 3) if dd.get("mib_s") else None
    return {"replicas": replicas, "ours_mib_s": ours_mib_s, "dd": dd, "ratio": ratio}


def dd_summary(rounds: list[dict]) -> dict:
    """Per replica count: the rounds, and the medians of ours, of dd and of the same-round ratios."""
    out = {}
    for k in dict.fromkeys(r["replicas"] for r in rounds):
        mine = [r for r in rounds if r["replicas"] == k]
        ratios = [r["ratio"] for r in mine if r["ratio"] is not None]
        dds = [r["dd"]["mib_s"] for r in mine if r["dd"].get("mib_s")]
        out[str(k)] = {"rounds": len(mine),
                       "median_ratio": round(statistics.median(ratios), 3) if ratios else None,
                       "median_ours_mib_s": round(statistics.median(r["ours_mib_s"] for r in mine), 1),
                       "median_dd_mib_s": round(statistics.median(dds), 1) if dds else None}
    return out


def remove_file(path: pathlib.Path) -> None:
    """Remove a baseline's scratch file (dd's, fio's: up to a GiB), emptied in steps first as the nodes free
    a deleted extent (datanode/store/files.py ``free_in_steps``): on a discard-mounted disk shared with a running
    cluster, freeing it at once would hold every node's fdatasync behind one long discard."""
    try:
        free_in_steps(path)
    except OSError:
        pass
    try:
        path.unlink()
    except OSError:
        pass


DROP_CACHES = "/proc/sys/vm/drop_caches"


def drop_caches() -> None:
    """Write back dirty pages, then drop the page cache (and dentries, inodes): the next read goes to disk."""
    os.sync()
    try:
        with open(DROP_CACHES, "w") as f:
            f.write("3\n")
    except OSError as e:
        raise BenchError(f"--cold needs to write {DROP_CACHES} (root): {e.strerror or e}") from None


def disk_of(path: pathlib.Path) -> str | None:
    """The block device (its /proc/diskstats name) that holds ``path``, or None (a virtual file system)."""
    try:
        st = os.stat(path)
        dev = pathlib.Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}").resolve()
    except OSError:
        return None
    return dev.name if (dev / "stat").exists() else None


def disk_sample(name: str | None) -> tuple | None:
    """The read counters of ``name`` in /proc/diskstats, with the time: (t, reads, sectors, read_ms, io_ms)."""
    if not name:
        return None
    try:
        with open("/proc/diskstats") as f:
            for line in f:
                x = line.split()
                if len(x) >= 14 and x[2] == name:
                    return (time.monotonic(), int(x[3]), int(x[5]), int(x[6]), int(x[12]))
    except OSError:
        pass
    return None


def disk_delta(a: tuple | None, b: tuple | None, nbytes: int) -> dict | None:
    """What the disk did between two samples, as ``iostat -x`` shows it for reads: MiB read (and its share of
    the ``nbytes`` asked for: >= 1.0 means every byte came from the disk, not the page cache), requests, the
    average request size, the average read queue depth (aqu-sz: read ms per ms) and utilisation."""
    if not a or not b or b[0] <= a[0]:
        return None
    secs = b[0] - a[0]
    reads, sectors, read_ms, io_ms = (b[i] - a[i] for i in range(1, 5))
    rbytes = sectors * 512
    return {"read_mib": round(rbytes / MIB, 1), "of_asked": round(rbytes / nbytes, 3) if nbytes else None,
            "requests": reads, "avg_req_kib": round(rbytes / 1024 / reads, 1) if reads else None,
            "aqu_sz": round(read_ms / 1000 / secs, 2), "util": round(min(1.0, io_ms / 1000 / secs), 3)}


def _timed_read(cmd: list[str], path: pathlib.Path, nbytes: int, disk: str | None, parse) -> dict:
    """Drop the page cache, run ``cmd`` (a read of ``path``), with the disk's counters around it."""
    try:
        drop_caches()
        a = disk_sample(disk)
        t0 = time.monotonic()
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        dt = time.monotonic() - t0
        b = disk_sample(disk)
    except FileNotFoundError:
        return {"command": " ".join(cmd), "error": f"{cmd[0]} is not installed"}
    except (OSError, subprocess.TimeoutExpired, BenchError) as e:
        return {"command": " ".join(cmd), "error": str(e)}
    if p.returncode != 0:
        return {"command": " ".join(cmd), "error": (p.stderr.strip().splitlines() or ["failed"])[-1]}
    try:
        secs = parse(p, dt)
    except (ValueError, KeyError, IndexError) as e:
        return {"command": " ".join(cmd), "error": f"unreadable output: {e}"}
    return {"command": " ".join(cmd), "bytes": nbytes, "seconds": round(secs, 3),
            "mib_s": round(nbytes / MIB / secs, 1), "disk": disk_delta(a, b, nbytes)}


def _fio_seconds(p: subprocess.CompletedProcess, _dt: float) -> float:
    job = json.loads(p.stdout[p.stdout.index("{"):])["jobs"][0]["read"]
    return job["io_bytes"] / job["bw_bytes"]


COLD_BASELINES = ("dd", "dd_direct", "fio_direct")
# The headline ratio is ours / dd iflag=direct: it reads the disk as the nodes read a cold range (O_DIRECT,
# 1 MiB at a time, no page-cache pages to allocate); the buffered dd swings 2-3x between adjacent rounds on
# these VMs (its speed is how fast the guest gets fresh page-cache pages), and fio at the bench's depth is
# the disk's ceiling (its ratio is shown too, as is the ratio to the fastest baseline of each round).
RATIO_USES = "dd_direct"


class ColdBaseline:
    """The local disk's cold read, for --cold, beside each cold read round of ours: a file of the same size as
    what our round read (DIR/coldread: urandom, fdatasync, written once), then -- each after dropping the page
    cache, with the disk's counters around it -- ``dd bs=1M`` (buffered, with the kernel's readahead: the
    path the nodes' reads take), ``dd bs=1M iflag=direct`` (the device, no page cache) and fio 1 MiB O_DIRECT
    reads at the bench's depth (libaio; the device with as many reads in flight as we ask for)."""

    def __init__(self, directory: pathlib.Path, depth: int):
        self.path = directory / "coldread"
        self.depth = depth
        self.disk = disk_of(directory)
        self.nbytes = 0
        self.error: str | None = None

    def prepare(self, nbytes: int) -> None:
        mib = max(1, -(-nbytes // MIB))
        write = ["dd", "if=/dev/urandom", f"of={self.path}", "bs=1M", f"count={mib}", "conv=fdatasync"]
        try:
            p = subprocess.run(write, capture_output=True, text=True, timeout=900)
        except (OSError, subprocess.TimeoutExpired) as e:
            self.error = f"{' '.join(write)}: {e}"
            return
        if p.returncode != 0:
            self.error = f"{' '.join(write)}: {(p.stderr.strip().splitlines() or ['failed'])[-1]}"
            return
        self.nbytes = mib * MIB

    def run(self) -> dict:
        """One round of the three baselines: {name: result}."""
        if self.error:
            return {k: {"command": "", "error": self.error} for k in COLD_BASELINES}
        mib = self.nbytes // MIB
        dd = ["dd", f"if={self.path}", "of=/dev/null", "bs=1M", f"count={mib}"]
        fio = ["fio", "--name=coldread", f"--filename={self.path}", "--rw=read", "--bs=1M", f"--size={mib}M",
               "--direct=1", "--ioengine=libaio", f"--iodepth={self.depth}", "--output-format=json"]
        return {"dd": _timed_read(dd, self.path, self.nbytes, self.disk, lambda p, dt: _dd_seconds(p.stderr, dt)),
                "dd_direct": _timed_read([*dd, "iflag=direct"], self.path, self.nbytes, self.disk,
                                         lambda p, dt: _dd_seconds(p.stderr, dt)),
                "fio_direct": _timed_read(fio, self.path, self.nbytes, self.disk, _fio_seconds)}

    def close(self) -> None:
        remove_file(self.path)


async def _drop_scratch(dc, pid: int, members: list[str]) -> None:
    """Delete a scratch partition and purge it from the nodes' trash: a deleted partition is kept there a
    day (``trash_retention_s``), and a few benches of GiBs each filled this box's disk that way."""
    from client import admin
    await admin.delete_partition(dc, pid, members)
    for addr in members:
        names = [e["name"] for e in await admin.trash_list(dc, addr) if e["partition"] == pid]
        if names:
            await admin.trash_purge(dc, addr, names=names)


def cold_summary(rounds: list[dict]) -> dict:
    """Median over the rounds of each same-round ratio (ours / baseline), and of each side's MiB/s."""
    out: dict = {"rounds": len(rounds), "ratio_uses": RATIO_USES, "median_ratio": {}, "median_mib_s": {}}
    for k in ("ours", *COLD_BASELINES):
        vals = [r[k]["mib_s"] for r in rounds if r.get(k, {}).get("mib_s")]
        if vals:
            out["median_mib_s"][k] = round(statistics.median(vals), 1)
    for k in (*COLD_BASELINES, "fastest"):
        vals = [r["ratio"][k] for r in rounds if r["ratio"].get(k) is not None]
        if vals:
            out["median_ratio"][k] = round(statistics.median(vals), 3)
    return out


def run_warm(command: str) -> dict:
    """Run the memory warmer (e.g. shared/bench/warm-memory) once, before the first phase."""
    t0 = time.monotonic()
    try:
        p = subprocess.run([command], capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"ran": False, "command": command, "error": str(e)}
    said = (p.stdout.strip() or p.stderr.strip()).splitlines()
    if p.returncode != 0:
        return {"ran": False, "command": command, "error": said[-1] if said else f"exit status {p.returncode}"}
    return {"ran": True, "command": command, "seconds": round(time.monotonic() - t0, 1),
            "said": said[-1] if said else ""}


def fresh_memory_gib_s(mib: int = 256) -> float:
    """How fast this machine hands out memory nobody touched lately: GiB/s of a first write to every page of a
    new anonymous mapping (each a page fault).  On a VM, memory the guest has given back to the host is several
    times slower than memory touched recently -- and a page-cache-bound figure follows it.
    The bench takes it at its start and its end, so a reader sees which memory the run had."""
    import mmap
    n = mib << 20
    m = mmap.mmap(-1, n)
    try:
        t0 = time.perf_counter()
        m[::4096] = b"\1" * (n // 4096)
        return round(mib / 1024 / (time.perf_counter() - t0), 2)
    finally:
        m.close()


def run_fio(directory: pathlib.Path, mib: int) -> dict:
    """Baselines on the local file system of ``directory`` (fio): a 4 KiB write + fdatasync at depth 1 (the
    cost floor of one durable small write), a 1 MiB sequential write with one fsync at the end, and a 1 MiB
    O_DIRECT read of that file (a read that the page cache does not serve: the disk's cold read)."""
    path = directory / "fiotest"
    common = ["fio", f"--filename={path}", "--output-format=json", "--ioengine=psync", "--numjobs=1"]
    jobs = {
        "write_4k_fdatasync": ["--name=w4k", "--rw=write", "--bs=4k", "--size=8M", "--fdatasync=1"],
        "write_1m_end_fsync": ["--name=w1m", "--rw=write", "--bs=1M", f"--size={mib}M", "--end_fsync=1"],
        "read_1m_direct": ["--name=r1m", "--rw=read", "--bs=1M", f"--size={mib}M", "--direct=1"],
    }
    out: dict = {}
    try:
        for name, args in jobs.items():
            cmd = [*common, *args]
            try:
                p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            except FileNotFoundError:
                return {"error": "fio is not installed (apt-get install fio)"}
            except (OSError, subprocess.TimeoutExpired) as e:
                return {"error": f"{name}: {e}"}
            if p.returncode != 0:
                return {"error": f"{name}: {(p.stderr.strip().splitlines() or ['failed'])[-1]}"}
            job = json.loads(p.stdout[p.stdout.index("{"):])["jobs"][0]
            side = job["read"] if name.startswith("read") else job["write"]
            r = {"command": " ".join(cmd), "mib_s": round(side["bw_bytes"] / MIB, 1), "iops": round(side["iops"], 1)}
            if name == "write_4k_fdatasync":
                r["ms_per_write"] = round(1000 / side["iops"], 3) if side["iops"] else None
                sync = job.get("sync", {}).get("lat_ns", {})
                if sync.get("percentile"):
                    r["fdatasync_p50_ms"] = round(sync["percentile"].get("50.000000", 0) / 1e6, 3)
            out[name] = r
    finally:
        remove_file(path)
    return out


def write_plot(out: dict, path: pathlib.Path) -> None:
    """A PNG: throughput per phase (with the same-run baselines as lines) and latency percentiles."""
    try:
        import matplotlib
    except ImportError:
        raise click.ClickException("--plot needs matplotlib: pip install 'datanode[bench]' "
                                   "(./dev setup installs it)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = out["results"]
    cfg = out["config"]
    names = [f"{r['replicas']}r {r['phase']}{' (cold)' if r.get('cold') else ''}" for r in rows]
    total, seen = Counter(names), Counter()
    labels = []
    for name in names:                        # rounds of one phase (--rounds): numbered
        seen[name] += 1
        labels.append(f"{name} {seen[name]}" if total[name] > 1 else name)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    xs = range(len(rows))
    bars = ax1.bar(xs, [r["mib_s"] for r in rows], color=["#4c72b0" if r["phase"] == "write" else "#55a868"
                                                            for r in rows])
    for b, r in zip(bars, rows):
        ax1.annotate(f"{r['mib_s']:.1f}\n{r['iops']:.0f}/s", (b.get_x() + b.get_width() / 2, b.get_height()),
                     ha="center", va="bottom", fontsize=8)
    base = []
    dd = out.get("dd") or {}
    if dd.get("mib_s"):
        base.append((dd["mib_s"], "dd conv=fdatasync", "#c44e52"))
        base.append((dd["mib_s"] / 3, "dd / 3 (3 copies, one disk)", "#dd8452"))
    fio = out.get("fio") or {}
    if "read_1m_direct" in fio:
        base.append((fio["read_1m_direct"]["mib_s"], "fio 1M O_DIRECT read (cold)", "#8172b3"))
    cr = out.get("cold_read") or {}
    if cr.get("mib_s"):
        base.append((cr["mib_s"], "dd iflag=direct read of a cold file (median)", "#64b5cd"))
    for y, name, color in base:
        ax1.axhline(y, ls="--", color=color, lw=1, label=f"{name}: {y:.0f} MiB/s")
    if base:
        ax1.legend(fontsize=7, loc="upper right")
    ax1.set_xticks(list(xs), labels)
    ax1.set_ylabel("MiB/s")
    ax1.set_title("throughput (bar label: MiB/s, requests/s)")
    w = 0.25
    for k, (q, color) in enumerate((("p50", "#4c72b0"), ("p99", "#dd8452"), ("p999", "#c44e52"))):
        ax2.bar([x + (k - 1) * w for x in xs], [r["latency_ms"][q] or 0 for r in rows], w, label=q, color=color)
    if "write_4k_fdatasync" in fio:
        y = fio["write_4k_fdatasync"]["ms_per_write"]
        ax2.axhline(y, ls="--", color="grey", lw=1, label=f"fio 4k write+fdatasync: {y:.2f} ms")
    ax2.set_yscale("log")
    ax2.set_xticks(list(xs), labels)
    ax2.set_ylabel("ms per request (log)")
    ax2.set_title("latency percentiles")
    ax2.legend(fontsize=7)
    warm = out.get("warm_memory") or {}
    fig.suptitle(f"dnctl bench: {fmt_size(cfg['size'])} x {cfg['clients']} client(s) x depth {cfg['depth']}, "
                 f"sync {cfg['sync']}, {cfg['transport']}; memory warmed: {'yes' if warm.get('ran') else 'NO'}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- the command ---------------------------------------------------------------------------------------------
def _disk_text(d: dict | None) -> str:
    if not d:
        return "disk: -"
    return (f"disk read {d['read_mib']:.0f} MiB ({d['of_asked']:.2f}x asked), {d['requests']} req of "
            f"{d['avg_req_kib'] or 0:.0f} KiB, aqu-sz {d['aqu_sz']:.1f}, util {100 * d['util']:.0f}%")


def _cold_lines(cold_read: dict | None, cold_rounds: list[dict]) -> list[str]:
    """Each cold round (ours, then the baselines, each from a dropped page cache) and the median ratios."""
    if not cold_rounds:
        return []
    lines = [f"cold read rounds (page cache dropped before each read; disk {(cold_read or {}).get('disk') or '?'} "
             "counters during it, as iostat -x shows them):"]
    names = {"ours": "ours", "dd": "dd bs=1M", "dd_direct": "dd iflag=direct", "fio_direct": "fio O_DIRECT"}
    for r in cold_rounds:
        lines.append(f"  {r['replicas']} replica(s), round {r['round']}:")
        for k in ("ours", *COLD_BASELINES):
            x = r.get(k)
            if not x:
                continue
            if "error" in x:
                lines.append(f"    {names[k]:16} {x['command']}: {x['error']}")
                continue
            ratio = f"ours = {r['ratio'][k]:.2f} of it" if k != "ours" and r["ratio"].get(k) else ""
            lines.append(f"    {names[k]:16} {x['mib_s']:8.1f} MiB/s  {_disk_text(x.get('disk'))}  {ratio}")
    for k, sm in ((cold_read or {}).get("by_replicas") or {}).items():
        mr, mm = sm["median_ratio"], sm["median_mib_s"]
        if not mr:
            continue
        order = [sm["ratio_uses"], *(b for b in COLD_BASELINES if b != sm["ratio_uses"])]
        lines.append(f"  {k} replica(s), median of {sm['rounds']} round(s): ours {mm.get('ours', 0):.1f} MiB/s = "
                     + ", ".join(f"{mr[b]:.2f} of {names[b]} ({mm.get(b, 0):.0f})" for b in order if b in mr)
                     + (f"; {mr['fastest']:.2f} of the fastest baseline each round" if "fastest" in mr else ""))
    return lines


def _dd_round_lines(dd_rounds: list[dict]) -> list[str]:
    """Each write round against the dd right after it, and the median ratio per replica count."""
    lines = []
    for k, sm in dd_summary(dd_rounds).items():
        mine = [r for r in dd_rounds if str(r["replicas"]) == k]
        for r in mine if len(mine) > 1 else []:
            d = r["dd"]
            lines.append(f"  {k} replica(s), write round {r['round']}: ours {r['ours_mib_s']:.1f} MiB/s x {k}, "
                         + (f"dd {d['mib_s']:.1f} MiB/s: {r['ratio']:.3f}" if r["ratio"] is not None
                            else f"dd failed: {d.get('error')}"))
        if sm["median_ratio"] is not None:
            lines.append(f"  {k} replica(s): ours x {k} / dd = {sm['median_ratio']:.3f}"
                         + (f" (median of {sm['rounds']} rounds, each write phase against the dd right after it)"
                            if sm["rounds"] > 1 else
                            f" (ours {sm['median_ours_mib_s']:.1f} MiB/s, dd {sm['median_dd_mib_s']:.1f} MiB/s; "
                            "--rounds N for a median of same-round ratios)"))
    return lines


def _table(header: dict, rows: list[dict], dd: dict | None, node_names: dict[str, str], fio: dict | None = None,
           warm: dict | None = None, cold_read: dict | None = None, cold_rounds: list[dict] | None = None,
           fresh: dict | None = None, dd_rounds: list[dict] | None = None) -> str:
    lines = [f"bench: {fmt_size(header['size'])} requests, {header['clients']} client process(es) x depth "
             f"{header['depth']}, {header['budget']} per phase; nodes: sync {header['sync']}, transport "
             f"{header['transport']}; reads from {header['read_from']}"]
    names = list(node_names.values())
    h = (f"{'replicas':>8} {'partition':>10} {'phase':5} {'MiB/s':>8} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} "
         f"{'p99.9 ms':>8} {'client CPU':>10}  node CPU s/GB ({'/'.join(names)})  errors")
    lines += [h, "-" * len(h)]
    for r in rows:
        lat = r["latency_ms"]
        ncpu = "/".join(f"{r['node_cpu'][a]['s_per_gb']:.1f}" if a in r["node_cpu"]
                        and r["node_cpu"][a]["s_per_gb"] is not None else "-" for a in node_names)
        cc = r["client_cpu"]["s_per_gb"]
        part = "scratch" if r["partition"] >= SCRATCH_BASE else r["partition"]
        lines.append(f"{r['replicas']:>8} {part:>10} {('cold' if r.get('cold') else r['phase']):5} {r['mib_s']:>8.1f} {r['iops']:>8.0f} "
                     f"{_f(lat['p50'])} {_f(lat['p99'])} {_f(lat['p999'])} {(f'{cc:.1f} s/GB' if cc is not None else '-'):>10}  "
                     f"{ncpu:<{len('node CPU s/GB ()') + len('/'.join(names))}}  {r['errors']}")
        for addr, roles in (r.get("write_stages") or {}).items():
            for role, st in roles.items():
                lines.append(f"{'':>8} {node_names.get(addr, addr)} {role:8} ms per append: " + "  ".join(
                    f"{k} {st[k]:.3f}" for k in WRITE_STAGES if k in st))
        for e in r["first_errors"]:
            lines.append(f"{'':>8} error: {e}")
    lines.append("CPU is utime+stime per GB (1e9 bytes) of client payload moved; node CPU is each datanode "
                 "process's, client CPU the sum over client processes.")
    if any(r.get("write_stages") for r in rows):
        lines.append("ms per append: the mean time a write phase's appends spent in each stage on each node, "
                     "as leader or follower: fetch (payload READ + CRC), queue (the extent's earlier appends), "
                     "local (forwards sent, pwrite after the extent's earlier ones), durable (flush), replicas "
                     "(leader: after its flush, until every follower acked).")
    if dd:
        if "error" in dd:
            lines.append(f"dd: {dd['command']}: {dd['error']}")
        else:
            lines.append(f"dd (same disk, one fdatasync at the end): {dd['mb_s']:.1f} MB/s = {dd['mib_s']:.1f} "
                         f"MiB/s  [{dd['command']}]")
        lines += _dd_round_lines(dd_rounds or [])
    if fio:
        if "error" in fio:
            lines.append(f"fio: {fio['error']}")
        else:
            w4, w1, r1 = fio["write_4k_fdatasync"], fio["write_1m_end_fsync"], fio["read_1m_direct"]
            lines.append(f"fio (same disk): 4KiB write+fdatasync {w4['ms_per_write']:.3f} ms ({w4['iops']:.0f}/s); "
                         f"1MiB write {w1['mib_s']:.1f} MiB/s; 1MiB O_DIRECT read (cold) {r1['mib_s']:.1f} MiB/s")
    lines += _cold_lines(cold_read, cold_rounds or [])
    warm = warm or {}
    lines.append(f"memory warmed before this run: yes ({warm['command']}, {warm['seconds']} s)" if warm.get("ran")
                 else f"memory warmed before this run: NO ({warm.get('error') or 'give --warm-memory PATH'}; "
                      "on a VM the first touch of guest memory is slow and measures the hypervisor)")
    if fresh and fresh.get("end_gib_s") is not None:
        lines.append(f"fresh memory at the run's start / end: {fresh['start_gib_s']:.2f} / "
                     f"{fresh['end_gib_s']:.2f} GiB/s (a first write to 256 MiB nobody touched lately; where it is "
                     "slow, page-cache-bound figures measure the hypervisor's memory, not the store)")
    return "\n".join(lines)


def _f(v) -> str:
    return f"{v:>8.2f}" if v is not None else f"{'-':>8}"


@click.command(cls=Command, context_settings=CTX)
@cluster_option(help="A running local cluster (dnctl cluster up).")
@click.option("--nodes", type=ADDRS, help="Or: datanodes HOST:PORT,... (the scratch partition's replicas, "
              "or any nodes that know --partition).")
@click.option("--partition", "pid", type=click.IntRange(1),
              help="Write into this existing partition instead of a scratch one (its data stays there).")
@click.option("--replicas", "replica_counts",
              help="Scratch partitions on the first K nodes, e.g. '1,3' for single-node vs 3-replica side by "
                   "side (default: one on every node).")
@click.option("--size", default="1MiB", show_default=True, help="Request size: 4KiB, 128KiB, 1MiB, 4MiB ...")
@click.option("--clients", type=click.IntRange(1, 64), default=1, show_default=True,
              help="Client processes, each with its own DataClient.")
@click.option("--depth", type=click.IntRange(1, 64), default=8, show_default=True,
              help="Requests in flight per client.")
@click.option("--seconds", type=click.FloatRange(0.5, 3600), help="Length of each phase (default 10).")
@click.option("--total-mib", type=click.IntRange(1), help="Or: MiB moved per phase (all clients together).")
@click.option("--mode", type=click.Choice(["write", "read", "both"]), default="both", show_default=True)
@click.option("--read-from", default="leader", show_default=True,
              help="leader | spread (each read to the next replica in turn: DataClient(read_from='spread')) "
                   "| HOST:PORT.")
@click.option("--transport", type=click.Choice([m.value for m in TransportChoice]), default="auto", show_default=True,
              help="Client transport.")
@click.option("--inline-max", default=fmt_size(INLINE_MAX), show_default=True,
              help="Appends up to this size travel inline with their header on TCP (no READ round trip); "
                   "0 turns it off (to compare).")
@click.option("--dd", "with_dd", is_flag=True,
              help="Also run dd if=/dev/zero of=DIR/ddtest bs=1M count=1024 conv=fdatasync and show its MB/s, "
                   "and ours x replicas / dd (every replica's copy lands on DIR's one disk).  With --rounds N "
                   "the write phase runs N times, each followed by its own dd (ours, dd, ours, dd, ...), and "
                   "the table gives each round's ratio and their median.")
@click.option("--dd-mib", type=click.IntRange(1, 1 << 16), default=1024, show_default=True)
@click.option("--fio", "with_fio", is_flag=True,
              help="Also run fio baselines in DIR: 4KiB write+fdatasync, 1MiB write, 1MiB O_DIRECT (cold) read.")
@click.option("--cold", is_flag=True,
              help="Read phases from a cold page cache: after the data is written, sync and drop the page cache "
                   "(echo 3 > /proc/sys/vm/drop_caches: needs root), and read each written byte once, --rounds "
                   "times.  With --cluster, each round is followed by the same-run baselines on DIR's disk, "
                   "each after a drop, reading as many bytes as the round did: dd bs=1M (buffered), dd "
                   "iflag=direct, fio O_DIRECT at --depth; the table shows each round's ratios, their median, "
                   "and the disk's counters (MiB read, request size, queue depth) during each read.")
@click.option("--rounds", type=click.IntRange(1, 20),
              help="Rounds, each against its own baselines (ours, dd, ours, dd, ...): with --cold, cold read "
                   "rounds (default 3); with --dd, write rounds (default 1).  On a shared VM adjacent rounds of "
                   "the same code differ by 10-30%: a same-round ratio's median is what to compare.")
@click.option("--warm-memory", "warm_cmd", type=click.Path(exists=True, dir_okay=False),
              help="Run this memory warmer (e.g. shared/bench/warm-memory) once before the first phase; the "
                   "output says whether it ran.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, writable=True),
              help="Write a PNG: throughput (with the dd/fio baselines) and latency percentiles per phase "
                   "(needs matplotlib: the 'bench' extra).")
@click.option("--keep", is_flag=True, help="Keep the scratch partitions (default: deleted at the end).")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON (progress stays on stderr).")
def bench_command(cluster, nodes, pid, replica_counts, size, clients, depth, seconds, total_mib, mode, read_from,
                  transport, inline_max, with_dd, dd_mib, with_fio, cold, rounds, warm_cmd, plot_path, keep, as_json):
    """Measure write and read throughput, latency percentiles and CPU per GB.

    \b
    dnctl bench --cluster /tmp/dn                               # 1MiB, 1 client x depth 8, 10 s each
    dnctl bench --cluster /tmp/dn --size 128KiB --clients 2 --seconds 5
    dnctl bench --cluster /tmp/dn --replicas 1,3 --dd           # single node vs 3 replicas, and dd
    dnctl bench --nodes 127.0.0.1:17310 --partition 7 --mode write --total-mib 512 --json
    dnctl bench --cluster /tmp/dn --cold --total-mib 2048 --rounds 5   # cold reads vs the disk, interleaved
    dnctl bench --cluster /tmp/dn --mode write --dd --rounds 5        # writes vs dd, interleaved
    dnctl bench --cluster /tmp/dn --size 4KiB --depth 1 --dd --fio --warm-memory ../shared/bench/warm-memory \\
                --plot bench.png --json > bench.json    # baselines in the same run, a picture, raw numbers

    By default the data goes into a throw-away scratch partition on every node (deleted at the end, also
    after an error or Ctrl-C; --keep keeps it); --partition N writes into an existing partition instead
    (its data stays).  Writes are pipelined appends (--depth in flight per client) to one extent at a
    time; each client's read phase reads back what it wrote (--mode read alone first writes some data,
    unmeasured).  Latency is per request, submit to answer.  Datanode CPU comes from /proc/PID/stat, so
    it is measured only for nodes on this machine.  Nothing is left in the cluster directory.
    """
    import tempfile

    import trio

    from client import admin
    from client.sdk import ClientError, DataClient
    from tools import cluster as cl

    root = cluster
    if bool(root) == bool(nodes):
        raise click.UsageError("give exactly one of --cluster DIR or --nodes A,B,C")
    if seconds and total_mib:
        raise click.UsageError("give only one of --seconds or --total-mib")
    if replica_counts and pid:
        raise click.UsageError("give only one of --replicas (scratch partitions) or --partition (an existing one)")
    if with_dd and not root:
        raise click.UsageError("--dd needs --cluster (dd writes DIR/ddtest)")
    if with_fio and not root:
        raise click.UsageError("--fio needs --cluster (fio writes DIR/fiotest)")
    if cold and not os.access(DROP_CACHES, os.W_OK):
        raise click.UsageError(f"--cold drops the page cache through {DROP_CACHES}, which needs root")
    if plot_path:
        try:
            import matplotlib  # noqa: F401  (fail before the run, not after it)
        except ImportError:
            raise click.ClickException("--plot needs matplotlib: pip install 'datanode[bench]' "
                                       "(./dev setup installs it)") from None
    try:
        nbytes = parse_size(size)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--size") from None
    if not (1 <= nbytes <= 4 * MIB):
        raise click.BadParameter("must be between 1 byte and 4MiB", param_hint="--size")
    try:
        inline_bytes = parse_size(inline_max)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--inline-max") from None
    if inline_bytes > INLINE_MAX:
        raise click.BadParameter(f"at most {fmt_size(INLINE_MAX)} (the protocol's limit)", param_hint="--inline-max")
    if not seconds and not total_mib:
        seconds = 10.0
    if rounds and not (cold or with_dd):
        raise click.UsageError("--rounds goes with --cold (read rounds) or --dd (write rounds)")
    cold_rounds_n = (rounds or 3) if cold else 0
    write_rounds_n = (rounds or 1) if with_dd else 1
    total = total_mib * MIB if total_mib else None
    addrs = cluster_nodes(root) if root else nodes
    if read_from not in ("leader", "spread"):
        ADDR.convert(read_from, None, None)
    if not pid and not replica_counts:
        replica_counts = str(len(addrs))
    if replica_counts:
        try:
            counts = [int(x) for x in replica_counts.split(",") if x.strip()]
        except ValueError:
            raise click.BadParameter("expected numbers like 1,3", param_hint="--replicas") from None
        if not counts or any(not 1 <= k <= len(addrs) for k in counts):
            raise click.BadParameter(f"each count must be between 1 and {len(addrs)} (the nodes given)",
                                     param_hint="--replicas")
        targets = [(SCRATCH_BASE + k, addrs[:k], True) for k in counts]
    else:
        targets = [(pid, None, False)]
    phases = ["write", "read"] if mode == "both" else [mode]
    if "write" in phases:
        phases = ["write"] * write_rounds_n + [p for p in phases if p != "write"]
    if cold and "read" in phases:
        phases = [p for p in phases if p != "read"] + ["read"] * cold_rounds_n

    async def setup():
        async with DataClient.from_env(timeout=10, **credentials()) as dc:
            status = {}
            for a in addrs:
                try:
                    status[a] = await admin.node_status(dc, a)
                except ClientError as e:
                    status[a] = {"error": str(e)}
            infos = []
            for tpid, members, scratch in targets:
                if scratch:
                    await _drop_scratch(dc, tpid, members)           # leftovers of an interrupted run
                    await admin.create_partition(dc, tpid, members)
                    infos.append((tpid, members))
                    continue
                found = None
                for a in addrs:
                    if "error" in status[a]:
                        continue
                    for p in await admin.partition_list(dc, a):
                        if p["id"] == tpid:
                            found = p["replicas"]
                    if found:
                        break
                if not found:
                    raise ClientError(f"partition {tpid} is not on {', '.join(addrs)}")
                infos.append((tpid, found))
            for _, members in infos:      # replicas not named by --nodes: their CPU is measured too
                for a in members:
                    if a not in status:
                        try:
                            status[a] = await admin.node_status(dc, a)
                        except ClientError as e:
                            status[a] = {"error": str(e)}
            return status, infos

    async def cleanup(infos):
        async with DataClient.from_env(timeout=10, **credentials()) as dc:
            for tpid, members in infos:
                await _drop_scratch(dc, tpid, members)

    try:
        status, infos = trio.run(setup)
    except ClientError as e:
        raise click.ClickException(str(e)) from None
    scratch = [(tpid, members) for tpid, members in infos if tpid >= SCRATCH_BASE]
    up = {a: s for a, s in status.items() if "error" not in s}
    if not up:
        raise click.ClickException("no datanode answered: " + "; ".join(s["error"] for s in status.values()))
    node_pids = {}
    for a, s in up.items():
        host = a.rpartition(":")[0]
        if (host.startswith("127.") or host == "localhost") and cl.node_alive(s["pid"]):
            node_pids[a] = s["pid"]
    node_names = {a: f"n{i + 1}" for i, a in enumerate(list(dict.fromkeys([*addrs, *status])))}
    first = next(iter(up.values()))
    transport_used = (f"verbs ({first['rdma_device']})" if first.get("rdma_device") else "tcp")
    header = {"size": nbytes, "clients": clients, "depth": depth,
              "budget": f"{seconds:g} s" if seconds else f"{total_mib} MiB", "sync": first.get("sync"),
              "transport": transport_used, "read_from": read_from, "nodes": addrs, "node_pids": node_pids,
              "inline_max": inline_bytes, "cold": cold, "rounds": cold_rounds_n or None,
              "write_rounds": write_rounds_n if with_dd and "write" in phases else None}
    log_tmp = tempfile.TemporaryDirectory(prefix="dnctl-bench-")    # workers' stderr: nothing left behind
    log_dir = pathlib.Path(log_tmp.name)
    rows = []
    dd = fio = cold_read = None
    cold_rounds: list[dict] = []
    dd_rounds: list[dict] = []
    warm = {"ran": False}
    fresh: dict = {}
    try:
        if warm_cmd:
            click.echo(f"warming memory: {warm_cmd} ...", err=True)
            warm = run_warm(warm_cmd)
        fresh["start_gib_s"] = fresh_memory_gib_s()
        for tpid, members in infos:
            label = f"{len(members)} replica{'s' if len(members) > 1 else ''}"
            base = ColdBaseline(pathlib.Path(root), depth * clients) if cold and root else None

            def after_cold(row, base=base, k=len(members)):
                rnd = {"replicas": k, "round": sum(1 for r in cold_rounds if r["replicas"] == k) + 1,
                       "ours": {"mib_s": row["mib_s"], "bytes": row["bytes"], "disk": row.get("disk")}}
                if base is not None:
                    if not base.nbytes and not base.error:
                        click.echo(f"cold read baselines: a {-(-row['bytes'] // MIB)} MiB file in {root} ...",
                                   err=True)
                        base.prepare(row["bytes"])
                    rnd.update(base.run())
                ours = row["mib_s"]
                ratio = {b: round(ours / rnd[b]["mib_s"], 3) if rnd.get(b, {}).get("mib_s") else None
                         for b in COLD_BASELINES}
                best = max((rnd[b]["mib_s"] for b in COLD_BASELINES if rnd.get(b, {}).get("mib_s")), default=0)
                ratio["fastest"] = round(ours / best, 3) if best else None
                rnd["ratio"] = ratio
                cold_rounds.append(rnd)

            def after_write(row, k=len(members)):
                if not with_dd:
                    return
                dd_rounds.append({**dd_round(row["mib_s"], k, run_dd(pathlib.Path(root), dd_mib)),
                                  "round": sum(1 for r in dd_rounds if r["replicas"] == k) + 1})

            try:
                res = run_config(nodes=members, pid=tpid, size=nbytes, clients=clients, depth=depth,
                                 seconds=seconds, total=total, phases=phases, node_pids=node_pids,
                                 read_from=read_from, transport=transport, label=label, log_dir=log_dir,
                                 inline_max=inline_bytes, cold=cold, disk=base.disk if base else None,
                                 after_cold=after_cold, after_write=after_write)
            except BenchError as e:
                raise click.ClickException(str(e)) from None
            finally:
                if base is not None:
                    base.close()
            for r in res:
                r["partition"], r["replicas"] = tpid, len(members)
                r["replica_nodes"] = members
            rows += res
        fresh["end_gib_s"] = fresh_memory_gib_s()
        if with_dd:
            if dd_rounds:         # dd ran after each write phase; the table's dd: the median round's
                good = sorted((r for r in dd_rounds if r["dd"].get("mib_s")), key=lambda r: r["dd"]["mib_s"])
                dd = (good[len(good) // 2] if good else dd_rounds[-1])["dd"]
            else:                 # no write phase: dd once, as a reference
                dd = run_dd(pathlib.Path(root), dd_mib)
        if with_fio:
            click.echo(f"fio: baselines in {root} ...", err=True)
            fio = run_fio(pathlib.Path(root), min(dd_mib, 512))
        if cold_rounds and root:
            cold_read = {"disk": disk_of(pathlib.Path(root)), "by_replicas": {
                str(k): cold_summary([r for r in cold_rounds if r["replicas"] == k])
                for k in dict.fromkeys(r["replicas"] for r in cold_rounds)}}
            dds = [r[RATIO_USES]["mib_s"] for r in cold_rounds if r.get(RATIO_USES, {}).get("mib_s")]
            if dds:
                cold_read["mib_s"] = sorted(dds)[len(dds) // 2]      # the plot's line: the headline baseline
    finally:
        log_tmp.cleanup()
        if scratch and not keep:
            try:
                trio.run(cleanup, scratch)
            except ClientError as e:
                click.echo(f"warning: could not delete scratch partitions: {e}", err=True)
    out = {"config": header, "results": rows, "dd": dd, "fio": fio, "warm_memory": warm, "cold_read": cold_read,
           "cold_rounds": cold_rounds, "dd_rounds": dd_rounds, "dd_summary": dd_summary(dd_rounds),
           "fresh_memory": fresh}
    if plot_path:
        write_plot(out, pathlib.Path(plot_path))
        out["plot"] = str(plot_path)
    if as_json:
        click.echo(json.dumps(out, indent=2, sort_keys=True))
    else:
        click.echo(_table(header, rows, dd, node_names, fio, warm, cold_read, cold_rounds, fresh, dd_rounds))
        if plot_path:
            click.echo(f"plot: {plot_path}")
    if any(r["errors"] for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "worker":
        worker_entry(sys.argv[2:])
    else:
        bench_command()
