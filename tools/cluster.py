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
import threading
import time

from datanode import config as config_mod
from wire.etcdmap import DEFAULT_PREFIX
from wire.limits import nodes_error


_HANDED_OUT: set[int] = set()
_HANDED_OUT_LOCK = threading.Lock()


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, and never one this process has handed out before: the kernel may
    give the same ephemeral port to two binds in a row, and two nodes told the same port would race for it."""
    with _HANDED_OUT_LOCK:
        while True:
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
            if port not in _HANDED_OUT:
                _HANDED_OUT.add(port)
                return port


# Python starts slowly under software emulation (the Soft-RoCE VM): give daemons longer to come up there.
# How long a starting node may go without progress: to listen, then between two looks at its opening
# progress (a node holding much data keeps reporting progress, and is waited for as long as it does).
START_TIMEOUT = float(os.environ.get("DATANODE_START_TIMEOUT", "90" if os.environ.get("SOFTROCE_VM") else "20"))


def wait_listening(addr: str, timeout: float = START_TIMEOUT, proc: subprocess.Popen | None = None,
                   secret: str | None = None, tls_ca: str | None = None) -> None:
    """Wait until the datanode at ``addr`` serves: it listens, then answers NODE_STATUS with state
    "starting" (and progress) while it opens its partitions, then "serving".  ``timeout`` bounds each
    stretch without progress, not the whole start; TimeoutError names what the node was doing."""
    import trio

    from client.sdk import ClientError, DataClient
    from wire.protocol import Op

    host, _, port = addr.rpartition(":")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"datanode {addr} exited with status {proc.returncode} while starting")
        try:
            with socket.create_connection((host, int(port)), timeout=0.5):
                break
        except OSError:
            time.sleep(0.05)
    else:
        raise TimeoutError(f"datanode {addr} did not start listening within {timeout}s")

    async def until_serving() -> None:
        last, seen = None, None
        stall = time.monotonic() + timeout
        async with DataClient.from_env(timeout=min(timeout, 10.0), pool_mib=2, secret=secret, tls_ca=tls_ca) as dc:
            while True:
                if proc is not None and proc.poll() is not None:
                    raise RuntimeError(f"datanode {addr} exited with status {proc.returncode} while starting")
                try:
                    st = await dc.admin(addr, Op.NODE_STATUS)
                except ClientError as e:
                    seen = f"no status ({e})"
                else:
                    if proc is not None and st.get("pid", proc.pid) != proc.pid:
                        raise RuntimeError(f"datanode {addr}: another process (pid {st['pid']}) answers there, "
                                           f"not the one started (pid {proc.pid})")
                    if st.get("state", "serving") == "serving":    # (a node without "state" serves once listening)
                        return
                    o = st.get("opening", {})
                    progress = (o.get("partitions"), o.get("extents"), o.get("bytes"))
                    if progress != last:
                        last, stall = progress, time.monotonic() + timeout
                    seen = (f"{st['state']}: {o.get('extents')} of {o.get('extents_total')} extents, "
                            f"{o.get('bytes')} of {o.get('bytes_total')} bytes opened")
                if time.monotonic() > stall:
                    raise TimeoutError(f"datanode {addr} made no progress starting for {timeout}s ({seen})")
                await trio.sleep(0.05)

    run_in_thread(until_serving, name=f"wait-serving-{addr}")


def run_in_thread(async_fn, *args, name: str = "trio"):
    """``trio.run(async_fn, *args)`` in a thread of its own -- callers may be inside a trio run themselves
    (tests, torture) -- returning its result or raising its exception."""
    import trio
    out: list = []
    failure: list[BaseException] = []

    def body() -> None:
        try:
            out.append(trio.run(async_fn, *args))
        except BaseException as e:    # noqa: BLE001 - handed to the caller's thread
            failure.append(e)

    t = threading.Thread(target=body, name=name)
    t.start()
    t.join()
    if failure:
        raise failure[0]
    return out[0]


class NodeProc:
    """One datanode process with its own directory and config."""

    def __init__(self, root: pathlib.Path, addr: str, **cfg):
        self.root = root
        self.addr = addr
        self.cfg = {"listen": addr, "data_dir": str(root / "data"), "pool_mib": 128, **cfg}
        self.proc: subprocess.Popen | None = None
        self.pid: int | None = None
        self.argv_prefix: list[str] = []      # e.g. tools.netns.Network.prefix(host): run the node on that host

    @property
    def log_path(self) -> pathlib.Path:
        return self.root / "node.log"

    def start(self, timeout: float = START_TIMEOUT) -> "NodeProc":
        self.root.mkdir(parents=True, exist_ok=True)
        cfg = config_mod.from_dict(self.cfg)       # validate before spawning
        (self.root / "node.toml").write_text(config_mod.to_toml(cfg))
        log = open(self.log_path, "ab")
        # -P: a source checkout in the working directory must not stand in for the installed package
        self.proc = subprocess.Popen([*self.argv_prefix, sys.executable, "-P", "-m", "datanode.cli", "serve",
                                      "--config", str(self.root / "node.toml")], stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        self.pid = self.proc.pid
        wait_listening(self.addr, timeout, self.proc, secret=self.cfg.get("secret_file") or None,
                       tls_ca=self.cfg.get("tls_ca") or None)
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
                                f"start one with: dnctl cluster up --cluster {root}")
    return json.loads(path.read_text())


def local_access(etcd_rec: dict | None, who: str):
    """How ``who`` (a component: root, manager, maintenance, admin, mount; or a node's etcd user) reaches a
    local cluster's own etcd (its record in cluster.json): its etcd user's credentials and, where the
    member requires them, the cluster's CA and its client certificate (tools/etcd_pki.py; the maintenance
    user is the manager's and presents the manager's).  None: the etcd takes anyone."""
    from wire.etcdmap import EtcdAccess
    files = local_access_files(etcd_rec, who)
    return EtcdAccess.load(**files) if files else None


def local_access_files(etcd_rec: dict | None, who: str) -> dict:
    """``local_access`` as EtcdAccess.load's arguments (file paths: for another process)."""
    rec = etcd_rec or {}
    files = {}
    if rec.get("auth"):
        files["credentials"] = str(pathlib.Path(rec["auth"]) / who)
    if rec.get("pki"):
        d = pathlib.Path(rec["pki"])
        cert = "manager" if who == "maintenance" else who
        files.update(ca=str(d / "ca.pem"), cert=str(d / f"{cert}.pem"), key=str(d / f"{cert}.key"))
    return files


def local_tls(etcd_rec: dict | None, who: str = "admin"):
    """An ssl.SSLContext for plain HTTPS requests to a local cluster's etcd as ``who`` (its /health,
    /metrics, maintenance status); None where it speaks HTTP."""
    import ssl
    files = local_access_files(etcd_rec, who)
    if not files.get("ca"):
        return None
    ctx = ssl.create_default_context(cafile=files["ca"])
    ctx.load_cert_chain(files["cert"], files["key"])
    return ctx


def local_access_options(etcd_rec: dict | None, who: str) -> dict:
    """``local_access`` as a component's options / node.toml keys (etcd_credentials, etcd_ca, ...)."""
    a = local_access(etcd_rec, who)
    if a is None:
        return {}
    rec = etcd_rec or {}
    out = {"etcd_credentials": str(pathlib.Path(rec["auth"]) / who)} if rec.get("auth") else {}
    if a.cert:
        out.update(etcd_ca=a.ca, etcd_cert=a.cert, etcd_key=a.key)
    return out


NODE_ETCD_KEYS = ("etcd_credentials", "etcd_ca", "etcd_cert", "etcd_key")


def node_etcd(etcd_rec: dict | None, addr: str, provision=None) -> dict:
    """node.toml's etcd keys for the node at ``addr`` where the directory's own etcd gives every node a user
    and a certificate of its own; else {}.  ``provision(addr)`` makes them for a new node and returns the
    same keys (tools/etcd_cluster.py ``node_access``, which sits above this module)."""
    if not (etcd_rec or {}).get("per_node"):
        return {}
    if provision is not None:
        return provision(addr)
    return local_access_options(etcd_rec, node_user(addr))


def user_name(component: str, prefix: str = DEFAULT_PREFIX) -> str:
    """The etcd user (and role) of a component of the cluster at ``prefix`` (clusters sharing an etcd each
    have their own)."""
    p = prefix.strip("/")
    return component if p == DEFAULT_PREFIX.strip("/") else f"{p.replace('/', '-')}-{component}"


def node_user(addr: str, prefix: str = DEFAULT_PREFIX) -> str:
    """The etcd user (and role) of the datanode listening at ``addr`` (``node-10.0.0.5_17310``: no colon,
    which would end the user's name in a USER:PASSWORD file)."""
    return user_name("node-" + addr.replace("[", "").replace("]", "").replace(":", "_"), prefix)


def client_login(info: dict) -> dict:
    """DataClient arguments that reach a local cluster as its admin: its secret, TLS CA and etcd admin user."""
    cfg = info.get("config", {})
    return {"secret": cfg.get("secret_file") or None, "tls_ca": cfg.get("tls_ca") or None,
            "etcd_access": local_access(info.get("etcd"), "admin")}


def cluster_map(info: dict):
    """The cluster map of a local cluster (a wire.etcdmap.Etcd reached as its admin: the etcd admin user,
    the secret's admin key for the entries' MACs), None when it has no etcd."""
    from wire.auth import Credentials
    from wire.etcdmap import Etcd
    from wire.protocol import Role
    url = (info.get("etcd") or {}).get("url")
    if not url:
        return None
    login = client_login(info)
    key = Credentials.load(login["secret"]).key(Role.ADMIN) if login["secret"] else None
    return Etcd(url, access=login["etcd_access"], admin_key=key)


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


def _argv(pid: int) -> list[str] | None:
    """The command line of process ``pid`` (None if it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0")]
    except OSError:
        return None


def _datanode_argv(argv: list[str]) -> bool:
    return "datanode.cli" in argv or any(a.endswith("/datanode") for a in argv[:2])


def is_datanode(pid: int) -> bool:
    """True if ``pid`` is (still) a datanode process, so we never signal a process that reused the pid."""
    argv = _argv(pid)
    return argv is not None and _datanode_argv(argv)


def node_alive(pid: int) -> bool:
    return pid_alive(pid) and is_datanode(pid)


def listener_pid(addr: str) -> int | None:
    """The pid of the process listening on ``addr`` (TCP), or None if nothing listens there."""
    import psutil      # here, not at the top: tests and tools that only start nodes do not need it
    host, _, port = addr.rpartition(":")
    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.Error, OSError):
        return None
    for c in conns:
        if (c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == int(port) and c.pid
                and c.laddr.ip in (host, "0.0.0.0", "::", "::ffff:" + host)):
            return c.pid
    return None


def node_process(rec: dict) -> tuple[int | None, str]:
    """The datanode process that is this cluster.json node *now*, and how it was found.

    The process listening on the node's address is it (whoever started it: ``dnctl``, a test, or a
    person by hand), if it is a datanode; otherwise the recorded pid, if that is still a datanode started
    with this node's config (it may still be opening its data, not listening yet).  Returns (pid, note):
    (None, why) when no such process runs."""
    pid = listener_pid(rec["addr"])
    if pid is not None:
        if is_datanode(pid):
            return pid, ("" if pid == rec.get("pid") else f"pid {pid} listens on {rec['addr']} "
                         f"(not started by dnctl: cluster.json says {rec.get('pid')})")
        return None, f"{rec['addr']} is taken by another process (pid {pid}, not a datanode)"
    rp = rec.get("pid")
    if rp and node_alive(rp) and _started_with(rp, pathlib.Path(rec["dir"]) / "node.toml"):
        return rp, "not listening yet"
    return None, "no process"


def _started_with(pid: int, path: pathlib.Path) -> bool:
    return str(path) in (_argv(pid) or [])


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of a process (all its threads) from /proc/PID/stat, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(") ", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / _TICK     # fields 14 and 15 of proc(5)


def cluster_secret(root: pathlib.Path) -> str:
    """DIR/cluster.secret, made now (0600 from its creation) unless it exists; its absolute path."""
    from wire.auth import gen_secret
    path = root.resolve() / "cluster.secret"
    if not path.exists():
        root.mkdir(parents=True, exist_ok=True)
        with open(path, "w", opener=lambda p, f: os.open(p, f | os.O_EXCL, 0o600)) as f:
            f.write(gen_secret())
    return str(path)


def up(root: pathlib.Path, nodes: int = 3, base_port: int | None = None, *, start_timeout: float = START_TIMEOUT,
       etcd_rec: dict | None = None, provision=None, **cfg) -> dict:
    """Start ``nodes`` daemons (detached: they outlive this process) and record them in cluster.json.

    ``cfg`` is node.toml keys (sync, transport, pool_mib, replica_timeout, ...), the same for every node;
    ``etcd_rec`` (the directory's own etcd) adds each node's own etcd user and certificate, made by
    ``provision`` (``node_etcd``).
    All or nothing: if one node fails to start, the ones already started are stopped again."""
    if nodes_error(nodes):
        raise ValueError(nodes_error(nodes))
    root.mkdir(parents=True, exist_ok=True)
    if (root / "cluster.json").exists():
        info = load(root)
        running = [n["addr"] for n in info["nodes"] if node_process(n)[0] is not None]
        if running:
            raise RuntimeError(f"a cluster is already running in {root} ({', '.join(running)}); stop it with: "
                               f"dnctl cluster down --cluster {root}")
        return _restart(root, info, start_timeout)
    for i in range(nodes):
        pdir = root / f"node{i + 1}" / "data" / "partitions"
        if pdir.is_dir() and any(pdir.iterdir()):
            raise RuntimeError(f"{root / f'node{i + 1}'} holds data but {root} has no cluster.json; "
                               f"use an empty --cluster dir")
    if base_port:
        if not (1 <= base_port and base_port + nodes - 1 <= 65535):
            raise ValueError(f"ports {base_port}..{base_port + nodes - 1} are out of range")
        busy = [base_port + i for i in range(nodes) if not port_free("127.0.0.1", base_port + i)]
        if busy:
            raise RuntimeError(f"port(s) {', '.join(map(str, busy))} on 127.0.0.1 already in use; "
                               f"pick another --base-port" + _held_by(busy))
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
            n = NodeProc(root / f"node{i + 1}", f"127.0.0.1:{port}", **cfg,
                         **node_etcd(etcd_rec, f"127.0.0.1:{port}", provision))
            started.append(n)
            n.start(start_timeout)
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
            "config": {k: v for k, v in started[0].cfg.items() if k not in ("listen", "data_dir", *NODE_ETCD_KEYS)
                       or k in cfg},
            "started": time.time()}
    save(root, info)
    return info


def _held_by(ports: list[int]) -> str:
    """What holds these ports, where that is a datanode of a cluster directory that is gone (how to stop it)."""
    gone = {}
    for port in ports:
        pid = listener_pid(f"127.0.0.1:{port}")
        d = cluster_dir_of(pid) if pid else None
        if d is not None and not (d / "cluster.json").exists():
            gone.setdefault(d, []).append(f"{port} (datanode pid {pid})")
    return "".join(f"; {', '.join(held)}: of a cluster in {d}, whose cluster.json is gone (the directory removed "
                   f"while it ran?): stop its processes with: dnctl cluster down --cluster {d}"
                   for d, held in gone.items())


def add_node(root: pathlib.Path, port: int | None = None, start_timeout: float = START_TIMEOUT,
             provision=None) -> dict:
    """Start one more node (no partitions) in a running cluster's directory, with the cluster's config
    (``provision``: makes its etcd user and certificate, ``node_etcd``)."""
    info = load(root)
    i = len(info["nodes"]) + 1
    if nodes_error(i):
        raise ValueError(nodes_error(i))
    if port is not None and not port_free("127.0.0.1", port):
        raise RuntimeError(f"port {port} on 127.0.0.1 is already in use")
    taken = {int(n["addr"].rpartition(":")[2]) for n in info["nodes"]}
    if port is None:
        port = next((q for q in (free_port() for _ in range(100)) if q not in taken), None)
        if port is None:
            raise RuntimeError("could not find a free port on 127.0.0.1")
    proc = NodeProc(root / f"node{i}", f"127.0.0.1:{port}", **info.get("config", {}),
                    **node_etcd(info.get("etcd"), f"127.0.0.1:{port}", provision))
    proc.start(start_timeout)
    rec = {"addr": proc.addr, "pid": proc.pid, "dir": str(proc.root), "log": str(proc.log_path)}
    info["nodes"].append(rec)
    save(root, info)
    return rec


def _restart(root: pathlib.Path, info: dict, start_timeout: float = START_TIMEOUT) -> dict:
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
            proc = NodeProc(pathlib.Path(n["dir"]), n["addr"], **cfg, **node_etcd(info.get("etcd"), n["addr"]))
            started.append(proc)
            proc.start(start_timeout)
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


def _find(info: dict, addr: str) -> dict:
    for n in info["nodes"]:
        if n["addr"] == addr:
            return n
    raise ValueError(f"{addr} is not a node of this cluster (nodes: {', '.join(n['addr'] for n in info['nodes'])})")


def _stop_pids(recs: list[tuple[dict, int]], timeout: float) -> None:
    """SIGTERM each (rec, pid) together, wait together, SIGKILL what did not drain; fills rec["result"]."""
    waiting = []
    for rec, pid in recs:
        try:
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            rec["result"] = "not running"
            continue
        waiting.append((rec, pid, time.monotonic()))
    deadline = time.monotonic() + timeout
    for rec, pid, t0 in waiting:
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        if pid_alive(pid):
            os.kill(pid, signal.SIGKILL)
            rec["result"] = f"killed (did not drain within {timeout:g}s)"
        else:
            rec["result"] = "stopped"
            rec["seconds"] = round(time.monotonic() - t0, 2)


def _opt(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv[:-1] else None


def _full_path(pid: int, path: str | None) -> pathlib.Path | None:
    """``path``, an argument of process ``pid``, made absolute against that process's working directory."""
    if not path:
        return None
    try:
        return pathlib.Path(os.path.normpath(os.path.join(os.readlink(f"/proc/{pid}/cwd"), path)))
    except OSError:
        return None


def _under(pid: int, path: str | None, root: pathlib.Path) -> bool:
    """Is ``path`` (an argument of process ``pid``) inside ``root``?"""
    full = _full_path(pid, path)
    return full is not None and (full == root or root in full.parents)


def cluster_dir_of(pid: int) -> pathlib.Path | None:
    """The cluster directory a datanode process was started in by ``dnctl cluster up`` (DIR of its
    ``--config DIR/nodeN/node.toml``), or None."""
    argv = _argv(pid)
    full = _full_path(pid, _opt(argv, "--config")) if argv and _datanode_argv(argv) else None
    if full is None:
        return None
    return full.parent.parent if full.name == "node.toml" and full.parent.name.startswith("node") else None


def strays(root: pathlib.Path) -> list[dict]:
    """The processes of a cluster directory that has no cluster.json any more -- it was removed (or emptied)
    under a running cluster, so ``down`` has nothing to find them by: datanodes started with a config in it,
    an etcd member keeping its data in it, and the managers following that etcd member.  Managers first,
    etcd last (the order to stop them in): [{"kind", "pid", "what"}]."""
    import psutil
    root = pathlib.Path(os.path.abspath(root))
    nodes, etcds, managers = [], [], []
    for proc in psutil.process_iter():
        pid = proc.pid
        if pid == os.getpid():
            continue
        argv = _argv(pid)
        if not argv or not argv[0]:
            continue
        if _datanode_argv(argv) and _under(pid, _opt(argv, "--config"), root):
            nodes.append({"kind": "datanode", "pid": pid, "what": _opt(argv, "--config")})
        elif argv[0].endswith("etcd") and _under(pid, _opt(argv, "--data-dir"), root):
            etcds.append({"kind": "etcd", "pid": pid, "what": _opt(argv, "--listen-client-urls") or "?"})
        elif "manager.cli" in argv:
            managers.append({"kind": "manager", "pid": pid, "what": _opt(argv, "--etcd") or "?"})
    urls = {u for e in etcds for u in e["what"].split(",")}
    return [m for m in managers if m["what"] in urls] + nodes + etcds


def stop_strays(root: pathlib.Path, timeout: float = 30.0) -> list[dict]:
    """Stop ``strays(root)`` (managers, then datanodes -- SIGTERM, they drain -- then etcd); each gets a
    ``result``."""
    found = strays(root)
    for kind in ("manager", "datanode", "etcd"):
        _stop_pids([(r, r["pid"]) for r in found if r["kind"] == kind], timeout)
    return found


def aux_process(rec: dict, kind: str) -> int | None:
    """The live process of a cluster directory's manager (``kind`` "manager") or own etcd member ("etcd"),
    by its recorded pid -- only if that pid is still such a process (a reused pid is never signalled)."""
    pid = rec.get("pid")
    if not pid or not pid_alive(pid):
        return None
    argv = _argv(pid)
    if argv is None:
        return None
    if kind == "manager":
        ok = "manager.cli" in argv
    else:
        ok = argv[0].endswith("etcd") and rec.get("dir", "") in " ".join(argv)
    return pid if ok else None


def stop_aux(info: dict, kind: str, timeout: float = 10.0) -> list[dict]:
    """Stop the directory's managers (``kind`` "manager") or its own etcd member ("etcd")."""
    recs = info.get("managers", []) if kind == "manager" else (
        [info["etcd"]] if info.get("etcd", {}).get("managed") else [])
    out, todo = [], []
    for r in recs:
        pid = aux_process(r, kind)
        res = {"kind": kind, "name": r.get("name", "etcd"), "pid": pid, "result": "not running"}
        out.append(res)
        if pid is not None:
            todo.append((res, pid))
    _stop_pids(todo, timeout)
    return out


def down(root: pathlib.Path, timeout: float = 30.0, aux: list | None = None) -> list[dict]:
    """SIGTERM every node (they drain in-flight requests), SIGKILL one that does not exit within
    ``timeout``.  Nodes are signalled together and waited for together.  Each node is found by its real
    process (``node_process``): a node restarted by hand is stopped too, a stale pid is never signalled.
    The directory's managers are stopped first (so none reacts to the nodes leaving), its own etcd member
    last; what happened to them is appended to ``aux`` if given (the returned list is the nodes')."""
    info = load(root)
    aux_out = stop_aux(info, "manager", timeout)
    out = []
    todo = []
    for n in info["nodes"]:
        pid, note = node_process(n)
        rec = {"addr": n["addr"], "pid": pid, "result": "not running"}
        if pid is None and note.startswith(n["addr"]):
            rec["result"] = f"not running ({note}; left alone)"
        elif note and pid is not None and note != "not listening yet":
            rec["note"] = note
        out.append(rec)
        if pid is not None:
            todo.append((rec, pid))
    _stop_pids(todo, timeout)
    for rec in out:
        if rec["result"] == "stopped":
            tail = _log_tail(pathlib.Path(_find(info, rec["addr"])["log"]))
            if tail and "stopped" not in tail:
                rec["log_tail"] = tail
    aux_out += stop_aux(info, "etcd", timeout)
    if aux is not None:
        aux.extend(aux_out)
    return out


def stop_node(root: pathlib.Path, addr: str, timeout: float = 30.0) -> dict:
    """Stop one node of the cluster (SIGTERM: it drains; SIGKILL after ``timeout``)."""
    info = load(root)
    n = _find(info, addr)
    pid, note = node_process(n)
    rec = {"addr": addr, "pid": pid, "result": "not running" + (f" ({note})" if note.startswith(addr) else "")}
    if pid is not None:
        _stop_pids([(rec, pid)], timeout)
    return rec


def start_node(root: pathlib.Path, addr: str, start_timeout: float = START_TIMEOUT) -> dict:
    """Start one stopped node of the cluster again: same address, config and data."""
    info = load(root)
    n = _find(info, addr)
    pid, note = node_process(n)
    if pid is not None:
        raise RuntimeError(f"{addr} is already running (pid {pid})")
    if note.startswith(addr):
        raise RuntimeError(note)
    proc = NodeProc(pathlib.Path(n["dir"]), addr, **info.get("config", {}), **node_etcd(info.get("etcd"), addr))
    try:
        proc.start(start_timeout)
    except (RuntimeError, TimeoutError) as e:
        proc.stop()
        tail = _log_tail(proc.log_path)
        raise RuntimeError(f"{e}" + (f"; its log ({proc.log_path}) ends with: {tail}" if tail else "")) from None
    n["pid"] = proc.pid
    save(root, info)
    return {"addr": addr, "pid": proc.pid, "result": "started", "log": n["log"]}


def status_pids(root: pathlib.Path) -> list[dict]:
    """Each node of cluster.json with the pid of its real process (None: not running) and a note."""
    info = load(root)
    out = []
    for n in info["nodes"]:
        pid, note = node_process(n)
        out.append({**n, "pid": pid, "recorded_pid": n.get("pid"), "note": note})
    return out


# -- rolling restart (dnctl cluster rolling-restart) ----------------------------------------------------------
class RolloutError(RuntimeError):
    """A rolling restart stopped; ``done``: the per-node records of the nodes restarted before it."""

    def __init__(self, message: str, done: list[dict]):
        super().__init__(message)
        self.done = done


def sync_pending(snap: dict, baseline: dict[int, int], addr: str | None = None, pid: int | None = None) -> list[str]:
    """What keeps a cluster map snapshot (``wire.etcdmap.snapshot``) from being back in sync: node ``addr``
    (process ``pid``) not registered, a partition whose view is being installed, has replicas being filled,
    or has fewer replicas than ``baseline`` (partition -> replica count it had in sync; one not there: its
    ``want``).  Empty: in sync."""
    out = []
    if snap.get("manager") is None:
        out.append("no active manager in etcd")
    if addr is not None:
        reg = next((n for n in snap["nodes"] if n["addr"] == addr), None)
        if reg is None or (pid is not None and reg.get("pid") != pid):
            out.append(f"{addr} not registered in etcd yet")
    for p in snap["partitions"]:
        unsynced = [a for a in p["replicas"] if a not in p["synced"]]
        want = baseline.get(p["id"], p.get("want") or len(p["replicas"]))
        if not p["installed"]:
            out.append(f"partition {p['id']}: installing epoch {p['epoch']}")
        elif unsynced:
            out.append(f"partition {p['id']}: filling {','.join(unsynced)}")
        elif len(p["replicas"]) < want:
            out.append(f"partition {p['id']}: {len(p['replicas'])} of {want} replicas")
    return out


async def _unsettled_leaders(addrs: list[str], login: dict) -> list[str]:
    """Without etcd: what keeps the partitions from being in sync, asked of their leaders (every follower
    healthy, no repair running)."""
    from client import admin
    from client.sdk import ClientError, DataClient
    out = []
    async with DataClient.from_env(timeout=5, pool_mib=2, **login) as dc:
        for addr in addrs:
            try:
                for p in await admin.partition_list(dc, addr):
                    if p["replicas"][0] == addr and not admin.settled(await admin.health(dc, addr, p["id"])):
                        out.append(f"partition {p['id']}: its leader {addr} is repairing a follower")
            except ClientError as e:
                out.append(f"{addr}: {e}")
    return out


def rolling_restart(root: pathlib.Path, *, timeout: float = 60.0, start_timeout: float = START_TIMEOUT,
                    sync_timeout: float = 600.0, on_progress=None) -> list[dict]:
    """Restart every node of the cluster in ``root``, one at a time: SIGTERM (it hands its partitions off
    and drains: datanode/drain.py), start it again, and wait until it is registered and every partition is
    back in sync (``sync_pending``; without etcd: its leaders report every follower healthy) before the
    next.  ``on_progress(dict)`` hears each step.  Returns a record per node; RolloutError (naming the node,
    with the records so far) when a node does not stop within ``timeout``, does not come back, or the
    partitions are not in sync within ``sync_timeout`` -- the nodes after it are left alone."""
    from client.mapadmin import map_snapshot
    from client.sdk import ClientError
    info = load(root)
    et = cluster_map(info)
    login = client_login(info)
    nodes = [n["addr"] for n in info["nodes"]]
    say = on_progress or (lambda p: None)
    down = [r["addr"] for r in status_pids(root) if r["pid"] is None]
    if down:
        raise RolloutError(f"node(s) {', '.join(down)} not running: start them first (dnctl cluster start-node "
                           f"ADDR --cluster {root})", [])

    def pending(addr=None, pid=None) -> list[str]:
        if et is None:
            return run_in_thread(_unsettled_leaders, nodes, login)
        try:
            return sync_pending(run_in_thread(map_snapshot, et), baseline, addr, pid)
        except ClientError as e:         # etcd unreachable: not in sync as far as we can tell
            return [str(e)]

    baseline: dict[int, int] = {}
    if et is not None:
        try:
            snap = run_in_thread(map_snapshot, et)
        except ClientError as e:
            raise RolloutError(f"the cluster map: {e}", []) from None
        baseline = {p["id"]: len(p["replicas"]) for p in snap["partitions"]}
    left = pending()
    if left:
        raise RolloutError("not in sync before the restart (a rolling restart takes one replica away at a time, "
                           "so it starts only from a settled cluster): " + "; ".join(left[:5]), [])
    done: list[dict] = []
    for i, addr in enumerate(nodes, 1):
        where = {"index": i, "of": len(nodes), "addr": addr}
        rec = {"addr": addr, "old_pid": node_process(_find(info, addr))[0], "stopping_at": round(time.time(), 3)}
        say({**where, "step": "stopping"})
        t0 = time.monotonic()
        stopped = stop_node(root, addr, timeout)
        rec.update(stop=stopped["result"], stop_s=round(time.monotonic() - t0, 2))
        if stopped["result"].startswith("killed"):
            raise RolloutError(f"{addr} did not stop within {timeout:g}s of SIGTERM and was killed; rolling "
                               f"restart stopped after {i - 1} of {len(nodes)} nodes (its log: "
                               f"{_find(info, addr)['log']})", done + [rec])
        say({**where, "step": "stopped", "seconds": rec["stop_s"]})
        t0 = time.monotonic()
        try:
            started = start_node(root, addr, start_timeout)
        except (RuntimeError, TimeoutError, ValueError, OSError, config_mod.ConfigError) as e:
            raise RolloutError(f"{addr} did not come back: {e}; rolling restart stopped after {i - 1} of "
                               f"{len(nodes)} nodes (the ones after it were not touched)", done + [rec]) from None
        rec.update(pid=started["pid"], start_s=round(time.monotonic() - t0, 2))
        say({**where, "step": "started", "seconds": rec["start_s"], "pid": rec["pid"]})
        t0 = time.monotonic()
        while True:
            left = pending(addr, rec["pid"])
            waited = time.monotonic() - t0
            if not left:
                break
            if waited > sync_timeout:
                raise RolloutError(f"not back in sync {sync_timeout:g}s after {addr} restarted: "
                                   + "; ".join(left[:5]) + f"; rolling restart stopped after {i} of "
                                   f"{len(nodes)} nodes", done + [rec])
            say({**where, "step": "syncing", "seconds": round(waited, 2), "pending": left})
            time.sleep(0.25)
        rec.update(sync_s=round(time.monotonic() - t0, 2), in_sync_at=round(time.time(), 3))
        say({**where, "step": "in sync", "seconds": rec["sync_s"]})
        done.append(rec)
    return done
