"""Shared fixtures: real datanode processes (tools.cluster.NodeProc) on free 127.0.0.1 ports, per transport.

* ``transport``   -- "tcp", and "verbs" (marked ``verbs``; skipped unless DATANODE_RDMA_DEVICE names a device
                     and ``wire.transport.verbs`` imports).
* ``nodes``       -- a factory: ``nodes(n, **cfg)`` starts n datanodes (in parallel) with the test's transport
                     and a small, fast config; every node is stopped at teardown, killed if it does not stop.
* ``client(...)`` -- ``DataClient.open`` with the test's transport (and, for verbs, an RDMA-attached domain).
* ``create_partition(dc, pid, addrs)`` -- creates partition ``pid`` on every replica (leader first).
* ``run_cli(module, ...)``, ``dnctl(...)``, ``dnctl_json(...)`` -- a CLI run as a user runs it.

Tests are plain functions that call ``trio.run`` (no pytest-trio needed).
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import pathlib
import signal
import subprocess
import sys
import time
import warnings
from contextlib import asynccontextmanager

import pytest
import trio

REPO = pathlib.Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
# The processes a test starts (datanodes under ``python -P``, the CLIs) import the installed package: in a
# checkout other than the one the venv's editable install names (a git worktree), that is another tree's code.
# They run this tree too.  (tests/test_install.py unsets it: there the wheel alone must do.)
if str(REPO) not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))

from client.sdk import DataClient  # noqa: E402
from wire.protocol import Op  # noqa: E402
from wire.transport.base import Domain, TransportOptions  # noqa: E402
from wire.transport.connect import make_domain  # noqa: E402
from tools.cluster import NodeProc, free_port  # noqa: E402

REPLICA_TIMEOUT = 2.0     # seconds: how long a leader waits for a follower's ack
CLIENT_TIMEOUT = 10.0     # must exceed REPLICA_TIMEOUT so replication failures reach the client as such
SLACK = 3.0               # scheduling slack on top of a timeout (2 cores, CI)
NODE_DEFAULTS = {"pool_mib": 64, "replica_timeout": REPLICA_TIMEOUT, "pool_wait": 5.0, "sync": "always",
                 "log_level": "info"}


# ------------------------------------------------------------------------------------------- transports
def _verbs_skip_reason() -> str | None:
    if not os.environ.get("DATANODE_RDMA_DEVICE"):
        return "no RDMA device: set DATANODE_RDMA_DEVICE (run inside the Soft-RoCE VM)"
    try:
        from wire.transport import verbs  # noqa: F401
    except ImportError as e:
        return f"wire.transport.verbs is not importable: {e}"
    return None


@pytest.fixture(params=["tcp", pytest.param("verbs", marks=pytest.mark.verbs)])
def transport(request) -> str:
    if request.param == "verbs":
        reason = _verbs_skip_reason()
        if reason:
            pytest.skip(reason)
    return request.param


def transport_cfg(transport: str) -> dict:
    cfg = {"transport": transport}
    if transport == "verbs":
        cfg["rdma_device"] = os.environ.get("DATANODE_RDMA_DEVICE", "")
        if os.environ.get("DATANODE_RDMA_GID"):
            cfg["gid_index"] = int(os.environ["DATANODE_RDMA_GID"])
    return cfg


def client_domain(transport: str) -> Domain:
    """The memory domain a test client registers in (with the RDMA device attached for verbs), set up as a
    script's client is: by the environment's $DATANODE_<OPTION> (e.g. DATANODE_RDMA_DEVICE)."""
    return make_domain(transport, TransportOptions.from_env(os.environ))


@asynccontextmanager
async def open_client(transport: str, nodes=(), **kw):
    """A DataClient for tests: the given transport, a short timeout, a small pool."""
    kw.setdefault("timeout", CLIENT_TIMEOUT)
    kw.setdefault("pool_mib", 16)
    kw.setdefault("domain", client_domain(transport))
    async with DataClient.open(list(nodes), transport=transport, **kw) as dc:
        yield dc


@pytest.fixture
def client(transport):
    """``async with client(nodes, **kw) as dc``: a DataClient on the test's transport."""
    def make(nodes=(), **kw):
        return open_client(transport, nodes, **kw)
    return make


async def create_partition(dc: DataClient, pid: int, addrs: list[str], epoch: int = 1) -> None:
    """Create partition ``pid`` on every replica in ``addrs`` (leader first), then load it into ``dc``."""
    for addr in addrs:
        await dc.admin(addr, Op.PARTITION_CREATE, partition=pid, body={"replicas": list(addrs), "epoch": epoch})
    await dc.discover(addrs[0])


# ---------------------------------------------------------------------------------------------- nodes
class Nodes:
    """Starts datanode processes under ``root`` and guarantees they are gone at teardown."""

    def __init__(self, root: pathlib.Path, transport: str):
        self.root = root
        self.transport = transport
        self.procs: list[NodeProc] = []

    def __call__(self, n: int = 1, **cfg) -> list[NodeProc]:
        cfg = {**NODE_DEFAULTS, **transport_cfg(self.transport), **cfg}
        new = []
        for _ in range(n):
            i = len(self.procs) + 1
            p = NodeProc(self.root / f"node{i}", f"127.0.0.1:{free_port()}", **cfg)
            self.procs.append(p)
            new.append(p)
        with concurrent.futures.ThreadPoolExecutor(max_workers=n) as ex:
            for f in [ex.submit(p.start) for p in new]:
                f.result()
        return new

    def teardown(self) -> list[str]:
        """SIGTERM every live node (all at once), then SIGKILL whatever has not exited within 10 s."""
        live = [p for p in self.procs if p.proc is not None and p.proc.poll() is None]
        for p in live:
            for sig in (signal.SIGCONT, signal.SIGTERM):      # SIGCONT: a paused node must see the SIGTERM
                try:
                    p.proc.send_signal(sig)
                except ProcessLookupError:
                    pass
        problems = []
        for p in live:
            try:
                p.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                problems.append(f"datanode {p.addr} did not stop within 10s of SIGTERM: killed")
                p.proc.kill()
                p.proc.wait(timeout=10)
        return problems

    def dump_logs(self, lines: int = 40) -> None:
        print_tails([p.log_path for p in self.procs], lines)


def print_tails(paths, lines: int = 40) -> None:
    """The end of each log (printed: pytest shows it with the failure); missing ones are skipped."""
    for path in paths:
        try:
            text = pathlib.Path(path).read_text(errors="replace").splitlines()
        except OSError:
            continue
        print(f"----- {path} (last {lines} lines) -----")
        print("\n".join(text[-lines:]))


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "rep_" + rep.when, rep)


@pytest.fixture
def nodes(request, tmp_path):
    """Factory: ``nodes(n, **cfg) -> [NodeProc]``, started on free ports with the test's transport."""
    transport = request.getfixturevalue("transport") if "transport" in request.fixturenames else "tcp"
    n = Nodes(tmp_path / "cluster", transport)
    yield n
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed:
        n.dump_logs()
    for problem in n.teardown():
        warnings.warn(problem)


class TaskSteps(trio.abc.Instrument):
    """Counts the steps one task takes (``trio.lowlevel.add_instrument`` it): how a test sees whether a call
    let the scheduler run other tasks, or how often a waiting task was woken."""

    def __init__(self, task) -> None:
        self.task, self.n = task, 0

    def before_task_step(self, task) -> None:
        self.n += task is self.task


def run(fn, *args):
    """Run an async test body."""
    return trio.run(fn, *args)


def eventually(check, timeout: float = 10.0, what: str = "", interval: float = 0.1) -> None:
    """Wait until ``check()`` is true (an AssertionError or OSError in it counts as not yet); after
    ``timeout`` seconds its last failure is the test's.  For what a mount or node does in its own time: a
    reclaim pass, a compaction, another mount's change."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            assert check(), what or f"not so within {timeout} s"
            return
        except (AssertionError, OSError):
            if time.monotonic() > deadline:
                raise
            time.sleep(interval)


def pattern(seed: int, n: int) -> bytes:
    """Deterministic, position-dependent bytes (so a misplaced block is detected)."""
    import random
    return random.Random(seed).randbytes(n)


def dirty_pages(path: str, below: int = 0) -> int | None:
    """Pages of ``path`` dirty or under writeback in the page cache (``cachestat``, Linux >= 6.5; None where the
    kernel has no such call): 0 means every byte written to it has gone to the device.  ``below``: only the
    pages wholly below that offset (0: the whole file)."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    import mmap
    pages = below // mmap.PAGESIZE * mmap.PAGESIZE
    if below and not pages:
        return 0
    rng, out = (ctypes.c_uint64 * 2)(0, pages), (ctypes.c_uint64 * 5)()
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.syscall(451, fd, ctypes.byref(rng), ctypes.byref(out), 0) != 0:   # 451: cachestat
            return None
    finally:
        os.close(fd)
    return out[1] + out[2]


# ------------------------------------------------------------------------------------------------ CLIs
def run_cli(module: str, *args, check: bool = False, timeout: float = 180, env: dict | None = None,
            no_traceback: bool = False, binary: bool = False) -> subprocess.CompletedProcess:
    """``python -m module args`` from this tree's root, output as text (bytes that do not decode are
    replaced, so a garbled message fails an assertion, not the helper).  ``check``: a nonzero exit raises
    with both streams; ``no_traceback``: so does a traceback on stderr, whatever the exit (a user never
    sees one); ``env``: the whole environment (default: this process's, which names this tree); ``binary``:
    output as bytes (a command writing data to stdout)."""
    p = subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=REPO, env=env, capture_output=True,
                       text=not binary, errors=None if binary else "replace", timeout=timeout)
    out, err = (repr(p.stdout[:2000]), p.stderr.decode(errors="replace")) if binary else (p.stdout, p.stderr)
    if (check and p.returncode != 0) or (no_traceback and "Traceback" in err):
        raise AssertionError(f"{module} {' '.join(map(str, args))} -> {p.returncode}\n{out}\n{err}")
    return p


def dnctl(*args, **kw) -> subprocess.CompletedProcess:
    """``dnctl args``: see run_cli for the keywords."""
    return run_cli("tools.dnctl", *args, **kw)


def dnctl_json(*args, **kw):
    """``dnctl args`` that must succeed, its stdout parsed as JSON (pass ``--json`` in ``args``)."""
    return json.loads(dnctl(*args, check=True, **kw).stdout)
