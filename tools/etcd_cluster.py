"""Local etcd members and cluster managers as real processes (for tests, benchmarks, local clusters).

``EtcdProc`` runs Debian's ``etcd`` binary (etcd-server 3.4) on free 127.0.0.1 ports with its data under a
directory of its own (optionally serving TLS); ``ManagerProc`` runs ``dnmanager``.  Both are stopped (or
killed) by ``stop``.  ``setup_auth`` turns etcd's authentication on with one user per component
(wire/etcdmap.py ``permissions``) and keeps their credentials in a directory.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import secrets
import shutil
import signal
import ssl
import subprocess
import sys
import time
import urllib.request

from tools.cluster import START_TIMEOUT, free_port, local_access, local_access_options, node_user, user_name
from wire.etcdmap import (COMPONENTS, DEFAULT_PREFIX, EtcdAccess, EtcdError, auth_request, client, node_permissions,
                          permission, permissions, revocation, shared_node_writes)

AUTH_DIR = "etcd-auth"      # in a cluster directory: one USER:PASSWORD file per etcd user (0600, in a 0700 dir)
# etcd's bcrypt cost for the passwords setup_auth makes: they are random secrets (``secrets.token_urlsafe(24)``),
# which stretching cannot make harder to guess, while every login costs etcd 2**cost rounds of CPU; 4 is
# bcrypt's least.  It is fixed in a hash when the password is set, so the member runs with it from its start.
BCRYPT_COST = 4

# What keeps every member's database file bounded (docs/operations.md, "Limits and sizing"):
# * keep one minute of history: a registration or view rewritten often leaves its old versions behind until
#   a compaction frees them; a watch that reconnects later than that is told "compacted" and re-reads the
#   map (wire/etcdmap.py ``_pump_stream``), so a short window costs a re-read, never a missed change;
# * a quota stated rather than inherited: past it etcd raises its NOSPACE alarm and takes only deletes;
# * what compaction frees is reused but never returned to the file system: the active manager defragments
#   a member whose file is much larger than its use (manager/etcdcare.py).
COMPACTION_RETENTION = "1m"            # etcd's periodic mode: compact to the revision of this long ago
QUOTA_BACKEND_BYTES = 1 << 30          # bytes
ETCD_SIZE_FLAGS = ("--auto-compaction-mode", "periodic", "--auto-compaction-retention", COMPACTION_RETENTION,
                   "--quota-backend-bytes", str(QUOTA_BACKEND_BYTES))


def etcd_binary() -> str:
    path = shutil.which("etcd")
    if path is None:
        raise FileNotFoundError("no etcd on PATH: install it (Debian/Ubuntu: apt install etcd-server), or give "
                                "--etcd URL of a running one, or --no-etcd")
    return path


class EtcdProc:
    """One etcd member on free ports, its data in ``root/etcd.data``, its log in ``root/etcd.log``; alone,
    or one of an ``etcd_cluster``."""

    def __init__(self, root: pathlib.Path, host: str = "127.0.0.1", name: str = "m0", *,
                 client_port: int | None = None, peer_port: int | None = None, tls: "ServerTls | None" = None,
                 plain_port: int | None = None, args: tuple[str, ...] = ()):
        self.root = root
        self.host = host
        self.name = name
        self.client_port = client_port or free_port(host)
        # with ``tls``: also plain HTTP on this port (no client certificate asked there): the middle step of
        # moving a running cluster from HTTP to required client certificates (docs/operations.md)
        self.plain_port = plain_port
        self.peer_port = peer_port or free_port(host)
        self.tls = tls
        self.initial_cluster = f"{name}={self.peer_url}"
        self.token = f"dn-{self.peer_port}"
        self.existing = (root / "etcd.data" / "member").is_dir()    # a restart: keep its cluster      # members of one cluster share it
        self.args = tuple(args)
        self.proc: subprocess.Popen | None = None
        self.argv_prefix: list[str] = []      # e.g. tools.netns.Network.prefix(host): run it on that host

    @property
    def peer_url(self) -> str:
        # with client certificates required, the peer port requires them too: an open peer port would take
        # raft messages from anyone who reaches it
        return f"{'https' if self.tls and self.tls.peer else 'http'}://{self.host}:{self.peer_port}"

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.client_port}"

    @property
    def plain_url(self) -> str:
        return f"http://{self.host}:{self.plain_port if self.tls else self.client_port}"

    @property
    def log_path(self) -> pathlib.Path:
        return self.root / "etcd.log"

    def start(self, timeout: float = START_TIMEOUT, wait: bool = True) -> "EtcdProc":
        self.root.mkdir(parents=True, exist_ok=True)
        peer = self.peer_url
        urls = self.url + (f",{self.plain_url}" if self.tls and self.plain_port else "")
        argv = [etcd_binary(), "--name", self.name, "--data-dir", str(self.root / "etcd.data"),
                "--listen-client-urls", urls, "--advertise-client-urls", urls,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", self.initial_cluster,
                "--initial-cluster-state", "existing" if self.existing else "new",
                "--initial-cluster-token", self.token,
                "--bcrypt-cost", str(BCRYPT_COST),
                "--heartbeat-interval", "100", "--election-timeout", "1000", "--log-level", "warn",
                *ETCD_SIZE_FLAGS, *self.args]
        if self.tls:
            argv += ["--cert-file", self.tls.cert, "--key-file", self.tls.key]
            if self.tls.client_ca:
                argv += ["--client-cert-auth", "--trusted-ca-file", self.tls.client_ca]
            if self.tls.peer:
                argv += ["--peer-cert-file", self.tls.cert, "--peer-key-file", self.tls.key,
                         "--peer-client-cert-auth", "--peer-trusted-ca-file", self.tls.client_ca]
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([*self.argv_prefix, *argv], stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
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
                with urllib.request.urlopen(self.url + "/health", timeout=1, context=self._health_tls()) as r:
                    if json.loads(r.read()).get("health") in ("true", True):
                        return
            except OSError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"etcd on {self.url} not healthy within {timeout}s; see {self.log_path}")

    def _health_tls(self) -> ssl.SSLContext | None:
        if not self.tls:
            return None
        ctx = ssl.create_default_context(cafile=self.tls.ca)
        if self.tls.client_ca:
            ctx.load_cert_chain(self.tls.client_cert, self.tls.client_key)
        return ctx

    def stop(self, timeout: float = 10.0) -> None:
        _stop(self.proc, timeout)

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
            self.proc.wait(timeout=30)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclasses.dataclass(frozen=True)
class ServerTls:
    """An etcd member serving TLS: its certificate and key, the CA that signed it (``ca``, for checking it),
    and -- ``client_ca`` set -- client certificates required, signed by that CA (``client_cert``/``client_key``
    one of them, for the health check)."""
    cert: str
    key: str
    ca: str
    client_ca: str = ""
    client_cert: str = ""
    client_key: str = ""
    peer: bool = False          # the peer port too (with client_ca: certificates required there as well)

    def __post_init__(self):
        if self.peer and not self.client_ca:
            raise ValueError("peer TLS here requires client certificates (client_ca)")


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
    """``dnmanager --etcd URL`` with its log in ``root/manager-<name>.log``."""

    def __init__(self, root: pathlib.Path, etcd: str, name: str = "m1", **opts):
        self.root = root
        self.etcd = etcd
        self.name = name
        self.opts = opts
        self.proc: subprocess.Popen | None = None
        self.argv_prefix: list[str] = []      # e.g. tools.netns.Network.prefix(host): run it on that host

    @property
    def log_path(self) -> pathlib.Path:
        return self.root / f"manager-{self.name}.log"

    def start(self) -> "ManagerProc":
        self.root.mkdir(parents=True, exist_ok=True)
        argv = [*self.argv_prefix, sys.executable, "-P", "-m", "manager.cli", "--etcd", self.etcd,
                "--name", self.name]
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
PKI_DIR = "etcd-pki"        # in a cluster directory: the etcd CA and every certificate (tools/etcd_pki.py)
CLIENT_CERTS = ("root", "manager", "admin", "mount")     # a client certificate each; the maintenance user
# (etcd's root role, for defragmenting) is the manager's and shares its certificate


def local_server_tls(pki: pathlib.Path) -> ServerTls:
    """The member's TLS in a cluster directory: its certificate, client certificates required (the health
    check presents root's)."""
    from tools import etcd_pki
    return ServerTls(str(pki / "server.pem"), str(pki / "server.key"), str(pki / "ca.pem"),
                     client_ca=str(pki / "ca.pem"), client_cert=etcd_pki.paths(pki, "root")["cert"],
                     client_key=etcd_pki.paths(pki, "root")["key"], peer=True)


def start_local_etcd(root: pathlib.Path, rec: dict | None = None, *, auth: bool = False) -> dict:
    """Start the cluster directory's single etcd member (data in ``root/etcd``), detached; ``rec`` (from
    cluster.json) restarts it on the same ports, as it was.  ``auth``: a new member requires client
    certificates signed by the cluster's own CA (``root/etcd-pki``) and has its authentication on
    (``setup_auth``, credentials in ``root/etcd-auth``), with a user of its own for every datanode
    (``node_access``).  Returns its record for cluster.json."""
    from tools import etcd_pki
    rec = rec or {}
    pki = pathlib.Path(rec["pki"]) if rec.get("pki") else None
    if pki is None and auth and not rec:
        pki = root / PKI_DIR
        etcd_pki.make_ca(pki, str(root.resolve()))
        etcd_pki.issue(pki, "server", hosts=("127.0.0.1", "localhost"))
        for who in CLIENT_CERTS:
            etcd_pki.issue(pki, who)
    e = EtcdProc(root / "etcd", client_port=rec.get("client_port"), peer_port=rec.get("peer_port"),
                 tls=local_server_tls(pki) if pki else None)
    e.start()
    out = {"url": e.url, "pid": e.proc.pid, "dir": str(e.root), "log": str(e.log_path), "managed": True,
           "client_port": e.client_port, "peer_port": e.peer_port}
    if pki is not None:
        out["pki"] = str(pki.resolve())
    if rec.get("auth"):
        out["auth"] = rec["auth"]
        if rec.get("per_node"):
            out["per_node"] = True
    elif auth:
        out["auth"] = str((root / AUTH_DIR).resolve())
        out["per_node"] = True
        root_user = root / AUTH_DIR / "root"
        try:           # a member left by an earlier `up` that failed may have its authentication on already
            again = e.existing and root_user.exists()
            access = local_access({**out, "auth": out["auth"] if again else ""}, "root")
            setup_auth(e.url, root / AUTH_DIR, maintenance=True, per_node=True,
                       access=access or EtcdAccess())
        except BaseException:
            e.stop()
            raise
    return out


def node_access(etcd_rec: dict, addr: str) -> dict:
    """node.toml's etcd keys for the datanode at ``addr`` of a local cluster whose etcd has a user per
    node: its own etcd user (made now, through the root user, if it has none yet) and its own client
    certificate (issued now by the cluster's CA).  {} for an etcd without them."""
    from tools import etcd_pki
    if not etcd_rec.get("per_node") or not etcd_rec.get("auth"):
        return {}
    auth = pathlib.Path(etcd_rec["auth"])
    name = node_user(addr)
    if etcd_rec.get("pki") and not (pathlib.Path(etcd_rec["pki"]) / f"{name}.pem").exists():
        etcd_pki.issue(pathlib.Path(etcd_rec["pki"]), name)
    if not (auth / name).exists():
        add_node_user(etcd_rec["url"], auth, addr, access=local_access(etcd_rec, "root"))
    return local_access_options(etcd_rec, name)


MAINTENANCE = "maintenance"     # the etcd user that may defragment (etcd's root role), beside the components


def _auth_caller(url: str, access: EtcdAccess):
    c = client(url.split(",")[0].strip(), access, timeout=10)

    def call(path: str, body: dict, exists_ok: bool = False) -> None:
        try:
            auth_request(c, path, body, exists_ok=exists_ok)
        except EtcdError as e:
            raise RuntimeError(str(e)) from None
    return call


def _make_user(call, out: pathlib.Path, name: str, role: str, perms: list[tuple[str, str, str]]) -> str:
    """User ``name`` with a new random password (written to ``out/NAME`` before etcd knows it) and ``role``
    (made with ``perms`` unless it is etcd's root role); returns the credentials' path."""
    pw = secrets.token_urlsafe(24)
    path = out / name
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"{name}:{pw}\n")
    os.chmod(path, 0o600)
    call("/auth/role/add", {"name": role}, exists_ok=True)
    if role != "root":
        for perm, key, end in perms:
            call("/auth/role/grant", {"name": role, "perm": permission(perm, key, end)})
    try:
        call("/auth/user/add", {"name": name, "password": pw})
    except RuntimeError as e:
        if "already exists" not in str(e):
            raise
        call("/auth/user/changepw", {"name": name, "password": pw})
    call("/auth/user/grant", {"user": name, "role": role})
    return str(path.resolve())


def _out_dir(out: pathlib.Path) -> None:
    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(out, 0o700)


def setup_auth(url: str, out: pathlib.Path, prefix: str = DEFAULT_PREFIX, *,
               access: EtcdAccess | None = None, maintenance: bool = False, per_node: bool = False) -> dict[str, str]:
    """Turn etcd's authentication on for the cluster at ``prefix``: one etcd user and role per component,
    each allowed exactly its key ranges (wire/etcdmap.py ``permissions``), and the ``root`` user (setup only).
    Each user's ``USER:PASSWORD`` goes to ``out/NAME`` (0600, ``out`` 0700) before etcd knows it.  ``access``:
    client TLS and, on an etcd whose authentication is on already (another cluster's), its root user -- then
    only this cluster's users are added.  ``maintenance``: also a user with etcd's root role for the
    manager's defragmentation (manager/etcdcare.py; etcd grants it to no lesser role).  ``per_node``: no
    shared ``datanode`` user; each node gets its own (``add_node_user``).  Returns {component,
    "maintenance" or "root": credentials path}.  RuntimeError says what etcd refused."""
    access = access or EtcdAccess()
    _out_dir(out)
    call = _auth_caller(url, access)
    enabled = access.user == "root"
    users = {user_name(comp, prefix): comp for comp in COMPONENTS if not (per_node and comp == "datanode")}
    if maintenance:
        users[user_name(MAINTENANCE, prefix)] = MAINTENANCE
    if not enabled:
        users["root"] = "root"
    paths = {}
    for name, comp in users.items():
        role = "root" if comp in ("root", MAINTENANCE) else name
        paths[comp] = _make_user(call, out, name, role, [] if role == "root" else permissions(prefix)[comp])
    if not enabled:
        call("/auth/enable", {})
    return paths


def add_node_user(url: str, out: pathlib.Path, addr: str, prefix: str = DEFAULT_PREFIX, *,
                  access: EtcdAccess | None) -> str:
    """The etcd user of the datanode at ``addr``, through etcd's root user (``access``): it reads what every
    datanode reads and writes only its own registration and hand-off request (``node_permissions``).  Its
    ``USER:PASSWORD`` goes to ``out/NAME``; returns that path.  RuntimeError says what etcd refused."""
    from wire.mapcheck import Invalid, check_node
    try:
        check_node(addr, {})
    except Invalid as e:
        raise ValueError(str(e)) from None
    _out_dir(out)
    name = node_user(addr, prefix)
    return _make_user(_auth_caller(url, access or EtcdAccess()), out, name, name, node_permissions(prefix, addr))


def lock_shared_node_role(url: str, prefix: str = DEFAULT_PREFIX, *, access: EtcdAccess | None) -> None:
    """Take from the shared ``datanode`` role its writes to every node's registration and hand-off (they
    become reads), once every node has a user of its own: the last step of moving a cluster to per-node
    users (docs/operations.md)."""
    call = _auth_caller(url, access or EtcdAccess())
    role = user_name("datanode", prefix)
    for key, end in shared_node_writes(prefix):
        call("/auth/role/revoke", revocation(role, key, end))
        call("/auth/role/grant", {"name": role, "perm": permission("READ", key, end)})


def start_manager(root: pathlib.Path, etcd: str, name: str = "m1", **opts) -> dict:
    """Start ``dnmanager`` for the cluster directory, detached; returns its record for cluster.json."""
    m = ManagerProc(root, etcd, name, **opts).start()
    time.sleep(0.3)
    if not m.alive():
        tail = m.log_path.read_text(errors="replace").strip().splitlines()[-1:] if m.log_path.exists() else []
        raise RuntimeError(f"manager {name} exited at once" + (f": {tail[0]}" if tail else ""))
    return {"name": name, "pid": m.proc.pid, "log": str(m.log_path), "opts": opts}
