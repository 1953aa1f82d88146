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


def wait_listening(addr: str, timeout: float = 20.0, proc: subprocess.Popen | None = None) -> None:
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

    def start(self, timeout: float = 20.0) -> "NodeProc":
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


def up(root: pathlib.Path, nodes: int = 3, base_port: int | None = None, **cfg) -> dict:
    """Start ``nodes`` daemons (detached: they outlive this process) and record them in cluster.json."""
    root.mkdir(parents=True, exist_ok=True)
    if (root / "cluster.json").exists():
        info = load(root)
        if any(pid_alive(n["pid"]) for n in info["nodes"]):
            raise RuntimeError(f"a cluster is already running in {root}; stop it with: dnctl cluster down "
                               f"--dir {root}")
    started = []
    try:
        for i in range(nodes):
            port = base_port + i if base_port else free_port()
            n = NodeProc(root / f"node{i + 1}", f"127.0.0.1:{port}", **cfg).start()
            started.append(n)
    except BaseException:
        for n in started:
            n.stop()
        raise
    info = {"nodes": [{"addr": n.addr, "pid": n.pid, "dir": str(n.root), "log": str(n.log_path)}
                      for n in started]}
    save(root, info)
    return info


def down(root: pathlib.Path, timeout: float = 30.0) -> list[dict]:
    info = load(root)
    out = []
    for n in info["nodes"]:
        pid, state = n["pid"], "not running"
        if pid_alive(pid):
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout
            while pid_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
                state = "killed (did not drain in time)"
            else:
                state = "stopped"
        out.append({"addr": n["addr"], "pid": pid, "result": state})
    return out
