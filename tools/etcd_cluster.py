"""Local etcd members and cluster managers as real processes (for tests, benchmarks, local clusters).

``EtcdProc`` runs Debian's ``etcd`` binary (etcd-server 3.4) on free 127.0.0.1 ports with its data under a
directory of its own; ``ManagerProc`` runs ``datanode manager``.  Both are stopped (or killed) by ``stop``.
"""
from __future__ import annotations

import json
import pathlib
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

from tools.cluster import START_TIMEOUT, free_port


def etcd_binary() -> str:
    path = shutil.which("etcd") or ("/usr/bin/etcd" if pathlib.Path("/usr/bin/etcd").exists() else None)
    if path is None:
        raise FileNotFoundError("no etcd binary: install Debian's etcd-server (./dev setup does)")
    return path


class EtcdProc:
    """One etcd member on free ports, its data in ``root/etcd.data``, its log in ``root/etcd.log``; alone,
    or one of an ``etcd_cluster``."""

    def __init__(self, root: pathlib.Path, host: str = "127.0.0.1", name: str = "m0", *,
                 client_port: int | None = None, peer_port: int | None = None):
        self.root = root
        self.host = host
        self.name = name
        self.client_port = client_port or free_port(host)
        self.peer_port = peer_port or free_port(host)
        self.initial_cluster = f"{name}={self.peer_url}"
        self.token = f"dn-{self.peer_port}"
        self.existing = (root / "etcd.data" / "member").is_dir()    # a restart: keep its cluster      # members of one cluster share it
        self.proc: subprocess.Popen | None = None

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.client_port}"

    @property
    def log_path(self) -> pathlib.Path:
        return self.root / "etcd.log"

    def start(self, timeout: float = START_TIMEOUT, wait: bool = True) -> "EtcdProc":
        self.root.mkdir(parents=True, exist_ok=True)
        peer = self.peer_url
        argv = [etcd_binary(), "--name", self.name, "--data-dir", str(self.root / "etcd.data"),
                "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", self.initial_cluster,
                "--initial-cluster-state", "existing" if self.existing else "new",
                "--initial-cluster-token", self.token,
                "--heartbeat-interval", "100", "--election-timeout", "1000", "--log-level", "warn"]
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        log.close()
        if wait:
            self.wait_healthy(timeout)
        return self

    def wait_healthy(self, timeout: float = START_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with status {self.proc.returncode}; see {self.log_path}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    if json.loads(r.read()).get("health") in ("true", True):
                        return
            except OSError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"etcd on {self.url} not healthy within {timeout}s; see {self.log_path}")

    def stop(self, timeout: float = 10.0) -> None:
        _stop(self.proc, timeout)

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
            self.proc.wait(timeout=30)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def etcd_cluster(root: pathlib.Path, n: int = 3, host: str = "127.0.0.1") -> list[EtcdProc]:
    """Start ``n`` etcd members that form one cluster (each under ``root/eI``); returns them when healthy."""
    members = [EtcdProc(root / f"e{i}", host, name=f"e{i}") for i in range(n)]
    initial = ",".join(f"{m.name}={m.peer_url}" for m in members)
    for m in members:
        m.initial_cluster, m.token = initial, members[0].token
        m.start(wait=False)
    for m in members:
        m.wait_healthy()
    return members


def urls(members: list[EtcdProc]) -> str:
    return ",".join(m.url for m in members)


class ManagerProc:
    """``datanode manager --etcd URL`` with its log in ``root/manager-<name>.log``."""

    def __init__(self, root: pathlib.Path, etcd: str, name: str = "m1", **opts):
        self.root = root
        self.etcd = etcd
        self.name = name
        self.opts = opts
        self.proc: subprocess.Popen | None = None

    @property
    def log_path(self) -> pathlib.Path:
        return self.root / f"manager-{self.name}.log"

    def start(self) -> "ManagerProc":
        self.root.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "tools.manager", "manager", "--etcd", self.etcd, "--name", self.name]
        for k, v in self.opts.items():
            argv += [f"--{k.replace('_', '-')}", str(v)]
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        log.close()
        return self

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.alive():
            self.proc.send_signal(sig)
            self.proc.wait(timeout=30)

    def stop(self, timeout: float = 10.0) -> None:
        _stop(self.proc, timeout)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def _stop(proc: subprocess.Popen | None, timeout: float) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGCONT)
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)


# -- a local cluster directory's own etcd member and manager (dnctl cluster up/down/status) ----------------------
def start_local_etcd(root: pathlib.Path, rec: dict | None = None) -> dict:
    """Start the cluster directory's single etcd member (data in ``root/etcd``), detached; ``rec`` (from
    cluster.json) restarts it on the same ports.  Returns its record for cluster.json."""
    rec = rec or {}
    e = EtcdProc(root / "etcd", client_port=rec.get("client_port"), peer_port=rec.get("peer_port"))
    e.start()
    return {"url": e.url, "pid": e.proc.pid, "dir": str(e.root), "log": str(e.log_path), "managed": True,
            "client_port": e.client_port, "peer_port": e.peer_port}


def start_manager(root: pathlib.Path, etcd: str, name: str = "m1", **opts) -> dict:
    """Start ``datanode manager`` for the cluster directory, detached; returns its record for cluster.json."""
    m = ManagerProc(root, etcd, name, **opts).start()
    time.sleep(0.3)
    if not m.alive():
        tail = m.log_path.read_text(errors="replace").strip().splitlines()[-1:] if m.log_path.exists() else []
        raise RuntimeError(f"manager {name} exited at once" + (f": {tail[0]}" if tail else ""))
    return {"name": name, "pid": m.proc.pid, "log": str(m.log_path), "opts": opts}
