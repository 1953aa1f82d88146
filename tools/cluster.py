"""Local clusters of real datanode processes on 127.0.0.1 (for the demo, benchmarks and tests).

A cluster directory holds ``cluster.json`` (nodes: addr, pid, data dir, log) and one subdirectory per node
with its ``node.toml``, data and ``node.log``.
"""
from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

from datanode import config as config_mod


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# Python starts slowly under software emulation (the Soft-RoCE VM): give daemons longer to come up there.
START_TIMEOUT = float(os.environ.get("DATANODE_START_TIMEOUT", "90" if os.environ.get("SOFTROCE_VM") else "20"))


def wait_listening(addr: str, timeout: float = START_TIMEOUT, proc: subprocess.Popen | None = None) -> None:
    host, _, port = addr.rpartition(":")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"datanode {addr} exited with status {proc.returncode} while starting")
        try:
            with socket.create_connection((host, int(port)), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"datanode {addr} did not start listening within {timeout}s")


class NodeProc:
    """One datanode process with its own directory and config."""

    def __init__(self, root: pathlib.Path, addr: str, **cfg):
        self.root = root
        self.addr = addr
        self.cfg = {"listen": addr, "data_dir": str(root / "data"), "pool_mib": 128, **cfg}
        self.proc: subprocess.Popen | None = None
        self.pid: int | None = None

    @property
    def log_path(self) -> pathlib.Path:
        return self.root / "node.log"

    def start(self, timeout: float = START_TIMEOUT) -> "NodeProc":
        self.root.mkdir(parents=True, exist_ok=True)
        cfg = config_mod.from_dict(self.cfg)       # validate before spawning
        (self.root / "node.toml").write_text(config_mod.to_toml(cfg))
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "datanode.cli", "serve", "--config",
                                      str(self.root / "node.toml")], stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        self.pid = self.proc.pid
        wait_listening(self.addr, timeout, self.proc)
        return self

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            if sig in (signal.SIGKILL, signal.SIGTERM):
                self.proc.wait(timeout=30)

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (drain), then SIGKILL if it does not exit in time; returns the exit status."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


# -- cluster directories (dnctl cluster up/down/status) --------------------------------------------------
def load(root: pathlib.Path) -> dict:
    path = root / "cluster.json"
    if not path.exists():
        raise FileNotFoundError(f"{root} is not a cluster directory (no cluster.json); "
                                f"start one with: dnctl cluster up --dir {root}")
    return json.loads(path.read_text())


def save(root: pathlib.Path, info: dict) -> None:
    (root / "cluster.json").write_text(json.dumps(info, indent=2))


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:   # a zombie is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return True


def port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def is_datanode(pid: int) -> bool:
    """True if ``pid`` is (still) a datanode process, so we never signal a process that reused the pid."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return False
    return b"datanode.cli" in argv or any(a.endswith(b"/datanode") for a in argv[:2])


def node_alive(pid: int) -> bool:
    return pid_alive(pid) and is_datanode(pid)


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of a process (all its threads) from /proc/PID/stat, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(") ", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / _TICK     # fields 14 and 15 of proc(5)


def up(root: pathlib.Path, nodes: int = 3, base_port: int | None = None, **cfg) -> dict:
    """Start ``nodes`` daemons (detached: they outlive this process) and record them in cluster.json.

    ``cfg`` is node.toml keys (sync, transport, pool_mib, replica_timeout, ...), the same for every node.
    All or nothing: if one node fails to start, the ones already started are stopped again."""
    if nodes < 1:
        raise ValueError("a cluster needs at least one node")
    root.mkdir(parents=True, exist_ok=True)
    if (root / "cluster.json").exists():
        info = load(root)
        running = [n["addr"] for n in info["nodes"] if node_alive(n["pid"])]
        if running:
            raise RuntimeError(f"a cluster is already running in {root} ({', '.join(running)}); stop it with: "
                               f"dnctl cluster down --dir {root}")
        return _restart(root, info)
    for i in range(nodes):
        pdir = root / f"node{i + 1}" / "data" / "partitions"
        if pdir.is_dir() and any(pdir.iterdir()):
            raise RuntimeError(f"{root / f'node{i + 1}'} holds data but {root} has no cluster.json; "
                               f"use an empty --dir")
    if base_port:
        if not (1 <= base_port and base_port + nodes - 1 <= 65535):
            raise ValueError(f"ports {base_port}..{base_port + nodes - 1} are out of range")
        busy = [base_port + i for i in range(nodes) if not port_free("127.0.0.1", base_port + i)]
        if busy:
            raise RuntimeError(f"port(s) {', '.join(map(str, busy))} on 127.0.0.1 already in use; "
                               f"pick another --base-port")
    started: list[NodeProc] = []
    try:
        ports: set[int] = set()
        for i in range(nodes):
            if base_port:
                port = base_port + i
            else:
                port = next((q for q in (free_port() for _ in range(100)) if q not in ports), None)
                if port is None:
                    raise RuntimeError("could not find a free port on 127.0.0.1")
            ports.add(port)
            n = NodeProc(root / f"node{i + 1}", f"127.0.0.1:{port}", **cfg)
            started.append(n)
            n.start()
    except BaseException as e:
        for n in started:
            n.stop()
        if isinstance(e, (RuntimeError, TimeoutError)) and started:
            tail = _log_tail(started[-1].log_path)
            if tail:
                raise RuntimeError(f"{e}; its log ({started[-1].log_path}) ends with: {tail}") from None
        raise
    info = {"nodes": [{"addr": n.addr, "pid": n.pid, "dir": str(n.root), "log": str(n.log_path)}
                      for n in started],
            "config": {k: v for k, v in started[0].cfg.items() if k not in ("listen", "data_dir")},
            "started": time.time()}
    save(root, info)
    return info


def add_node(root: pathlib.Path, port: int | None = None) -> dict:
    """Start one more node (no partitions) in a running cluster's directory, with the cluster's config."""
    info = load(root)
    i = len(info["nodes"]) + 1
    if port is not None and not port_free("127.0.0.1", port):
        raise RuntimeError(f"port {port} on 127.0.0.1 is already in use")
    taken = {int(n["addr"].rpartition(":")[2]) for n in info["nodes"]}
    if port is None:
        port = next((q for q in (free_port() for _ in range(100)) if q not in taken), None)
        if port is None:
            raise RuntimeError("could not find a free port on 127.0.0.1")
    proc = NodeProc(root / f"node{i}", f"127.0.0.1:{port}", **info.get("config", {}))
    proc.start()
    rec = {"addr": proc.addr, "pid": proc.pid, "dir": str(proc.root), "log": str(proc.log_path)}
    info["nodes"].append(rec)
    save(root, info)
    return rec


def _restart(root: pathlib.Path, info: dict) -> dict:
    """Start a stopped cluster again: same addresses (partitions name them), same config, data kept."""
    busy = [n["addr"] for n in info["nodes"]
            if not port_free(n["addr"].rpartition(":")[0], int(n["addr"].rpartition(":")[2]))]
    if busy:
        raise RuntimeError(f"cannot restart the cluster in {root}: {', '.join(busy)} already in use by "
                           f"another process")
    cfg = info.get("config", {})
    started: list[NodeProc] = []
    try:
        for n in info["nodes"]:
            proc = NodeProc(pathlib.Path(n["dir"]), n["addr"], **cfg)
            started.append(proc)
            proc.start()
    except BaseException:
        for proc in started:
            proc.stop()
        raise
    for n, proc in zip(info["nodes"], started):
        n["pid"] = proc.pid
    info["started"] = time.time()
    info["restarted"] = True
    save(root, info)
    return info


def _log_tail(path: pathlib.Path) -> str:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1].strip() if lines else ""


def down(root: pathlib.Path, timeout: float = 30.0) -> list[dict]:
    """SIGTERM every node (they drain in-flight requests), SIGKILL one that does not exit within
    ``timeout``.  Nodes are signalled together and waited for together."""
    info = load(root)
    out = []
    waiting = []
    for n in info["nodes"]:
        pid = n["pid"]
        rec = {"addr": n["addr"], "pid": pid, "result": "not running"}
        out.append(rec)
        if not pid_alive(pid):
            continue
        if not is_datanode(pid):
            rec["result"] = "not running (pid now belongs to another process; left alone)"
            continue
        os.kill(pid, signal.SIGCONT)
        os.kill(pid, signal.SIGTERM)
        waiting.append((rec, time.monotonic()))
    deadline = time.monotonic() + timeout
    for rec, t0 in waiting:
        while pid_alive(rec["pid"]) and time.monotonic() < deadline:
            time.sleep(0.02)
        if pid_alive(rec["pid"]):
            os.kill(rec["pid"], signal.SIGKILL)
            rec["result"] = f"killed (did not drain within {timeout:g}s)"
        else:
            rec["result"] = "stopped"
            rec["seconds"] = round(time.monotonic() - t0, 2)
            tail = _log_tail(pathlib.Path(next(n["log"] for n in info["nodes"] if n["pid"] == rec["pid"])))
            if tail and "stopped" not in tail:
                rec["log_tail"] = tail
    return out
