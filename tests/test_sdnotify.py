"""Readiness for systemd (wire/sdnotify.py): what a ``Type=notify`` unit's socket receives, and when.

A test binds the datagram socket systemd would, hands its path to a real process as ``$NOTIFY_SOCKET``, and
checks that READY=1 arrives once the process does its job: the datanode serves, the manager has read the map
from etcd, the mount answers at its mount point.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys

import pytest
import trio

from client.fs.mount import mount_pid
from client.sdk import DataClient
from wire import sdnotify
from tests.conftest import NODE_DEFAULTS, create_partition
from tools.cluster import START_TIMEOUT, NodeProc, free_port
from tools.etcd_cluster import EtcdProc, ManagerProc, etcd_binary


class NotifySocket:
    """The service manager's end: a datagram socket at ``path`` (or in the abstract namespace)."""

    def __init__(self, path: str):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + path[1:] if path.startswith("@") else path)

    def recv(self, timeout: float) -> str | None:
        self.sock.settimeout(timeout)
        try:
            return self.sock.recv(4096).decode()
        except TimeoutError:
            return None

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def notify_socket(tmp_path):
    s = NotifySocket(str(tmp_path / "notify"))
    yield s
    s.close()


def test_ready_reaches_the_socket_in_a_path_and_in_the_abstract_namespace(notify_socket, monkeypatch):
    monkeypatch.setenv("NOTIFY_SOCKET", notify_socket.path)
    assert sdnotify.ready("serving 127.0.0.1:1")
    assert notify_socket.recv(5) == "READY=1\nSTATUS=serving 127.0.0.1:1"
    abstract = NotifySocket(f"@datanode-test-{os.getpid()}")
    try:
        monkeypatch.setenv("NOTIFY_SOCKET", abstract.path)
        assert sdnotify.ready()
        assert abstract.recv(5) == "READY=1"
    finally:
        abstract.close()


def test_without_a_service_manager_nothing_is_sent(monkeypatch, tmp_path):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert not sdnotify.ready()
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "nobody-listens"))
    assert not sdnotify.ready()          # logged, never raised: the daemon keeps serving


def test_a_datanode_is_ready_once_it_serves(notify_socket, monkeypatch, tmp_path):
    monkeypatch.setenv("NOTIFY_SOCKET", notify_socket.path)         # the node inherits it
    node = NodeProc(tmp_path / "node", f"127.0.0.1:{free_port()}", **NODE_DEFAULTS).start()   # waits until serving
    try:
        assert notify_socket.recv(5) == f"READY=1\nSTATUS=serving {node.addr}", node.log_path.read_text()
    finally:
        node.stop()


def test_a_manager_is_ready_once_it_has_read_the_map(notify_socket, monkeypatch, tmp_path):
    try:
        etcd_binary()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    etcd = EtcdProc(tmp_path / "etcd")            # its ports are picked; it starts later
    monkeypatch.setenv("NOTIFY_SOCKET", notify_socket.path)
    manager = ManagerProc(tmp_path, etcd.url, "m1", min_writable=0).start()
    monkeypatch.delenv("NOTIFY_SOCKET")           # etcd notifies too: not to this socket
    try:
        assert notify_socket.recv(2.0) is None, "ready before etcd answered"
        etcd.start()
        assert notify_socket.recv(START_TIMEOUT) == f"READY=1\nSTATUS=manager m1: joined {etcd.url}", \
            manager.log_path.read_text()
        assert manager.alive()
    finally:
        manager.stop()
        etcd.stop()


@pytest.mark.skipif(not os.path.exists("/dev/fuse") or shutil.which("fusermount3") is None,
                    reason="no FUSE (/dev/fuse, fusermount3)")
def test_a_mount_is_ready_once_it_answers_at_the_mount_point(notify_socket, tmp_path):
    node = NodeProc(tmp_path / "node", f"127.0.0.1:{free_port()}", **NODE_DEFAULTS).start()
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    proc = None
    try:
        async def mkpart():
            async with DataClient.open(timeout=10) as dc:
                await create_partition(dc, 1, [node.addr])
        trio.run(mkpart)
        with open(tmp_path / "mount.log", "wb") as log:
            proc = subprocess.Popen([sys.executable, "-m", "client.fs.cli", "mount", "--foreground", "--node",
                                     node.addr, "--meta", f"sqlite:{tmp_path / 'meta.db'}", str(mnt)],
                                    env=dict(os.environ, NOTIFY_SOCKET=notify_socket.path), stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        assert notify_socket.recv(START_TIMEOUT) == f"READY=1\nSTATUS=mounted {mnt}", \
            (tmp_path / "mount.log").read_text()
        assert mount_pid(str(mnt)) == proc.pid
        (mnt / "f").write_bytes(b"ready")
        assert (mnt / "f").read_bytes() == b"ready"
        proc.send_signal(signal.SIGTERM)          # as systemctl stop does: it unmounts
        assert proc.wait(timeout=60) == 0 and mount_pid(str(mnt)) is None
    finally:
        if proc is not None and proc.poll() is None:
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True)
            proc.kill()
            proc.wait()
        node.stop()
