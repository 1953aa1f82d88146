"""The cluster map in etcd: the one module that talks to etcd (datanodes, the manager and the SDK use it).

Library and how it is driven
----------------------------
``etcd3gw`` (OpenStack's client for etcd's v3 JSON gateway, ``/v3/...``; plain HTTP through ``requests``,
few dependencies, works against Debian's etcd-server 3.4).  Its calls block, so every call here runs in a
worker thread through ``trio.to_thread.run_sync``; the event loop never waits on a socket.  A watch is a
streaming HTTP response read line by line in a worker thread (``Etcd.watch``), which hands each batch of
events to the trio side with ``trio.from_thread.run_sync`` into a memory channel.  The watch lives in a
nursery: when that nursery is cancelled a sibling task shuts the stream's socket down, the blocked read in
the thread returns, and the thread ends before the nursery does (no orphan thread).  Several endpoints
(``etcd = "http://a:2379,http://b:2379"``) are tried in turn; the last one that answered is tried first.

etcd3gw has no authentication: ``AuthClient`` adds etcd's -- a token from ``/v3/auth/authenticate`` in every
request's ``Authorization`` header, taken again when etcd says it expired -- and client TLS (``EtcdAccess``:
the user's credentials file, a CA, a client certificate).  Each component has its own etcd user and role,
limited to the keys it reads and writes (``permissions``; ``dnctl etcd setup-auth`` makes them), and so does
each datanode (``node_permissions``; ``dnctl etcd add-node``).

Trust: what is written under the prefix is sealed with a MAC of the cluster secret and everything read is
checked (wire/mapcheck.py) before anyone acts on it; ``Etcd.open`` logs, counts and drops what fails.

Keys (under ``etcd_prefix``, default ``/datanode``)
--------------------------------------------------
* ``nodes/<addr>``   -- a datanode's registration, attached to its **lease** (``lease_ttl_s``): address, pid,
  transport, zone, capacity/free bytes, and the partitions it holds (id -> epoch, replicas).  It disappears
  when the node dies or cannot reach etcd for a TTL: that is how the manager learns a node is gone (only
  that way: ``MapCache``).  Each node's own etcd user may write this key and no other node's
  (``node_permissions``).
* ``parts/<id>``     -- a partition's view (``PartView``): ``replicas`` (leader first), ``epoch``, ``want``
  (its replica count), ``synced`` (replicas known to hold every acknowledged write: only these may lead),
  ``state`` (``writable`` | ``degraded`` | ``recovering`` | ``read_only``) and ``installed`` (every member
  has this epoch).  Changed **only** by compare-and-swap transactions on the key's mod revision (``cas``);
  a manager's changes also require that it still holds the manager key (a deposed manager cannot write).
* ``manager``        -- the active manager's id, attached to its lease (an election: create-if-absent).
* ``requests/<id>``, ``drain/<addr>`` -- admins' requests to the manager and decommission marks
  (manager/tasks.py).
* ``handoff/<addr>`` -- a stopping node asks the manager to move its partitions off it, under its own lease
  (datanode/drain.py).

Who asks etcd what (watch, not poll)
------------------------------------
Changes reach everybody by watches: each datanode watches ``parts/``; each manager follows the whole prefix
through one watch (``MapCache``: one read, then pushed events; a full re-read after a watch reconnect and
every 30 s as a safety net); the SDK watches ``parts/``.  At idle, a datanode sends etcd a lease keepalive
every TTL/3 and re-reads ``parts/`` every 30 s; it re-publishes its key only when its partitions change or
its free bytes move by more than 1% of the disk.  The active manager sends only its keepalives and the
30 s re-read.  Measured with etcd's ``grpc_server_started_total`` (``python bench/etcd_traffic.py``,
TTL 3 s): 1.02 requests/s per datanode, 1.03 for the manager (before watching: 1.3 and 8.8).

How a membership change is made (manager/service.py), and why failover loses no acknowledged write
------------------------------------------------------------------------------------------------
The manager computes the new view (epoch + 1), writes it with a CAS (``installed = false``), then sends
the datanodes' own ``PARTITION_UPDATE`` (and ``PARTITION_CREATE`` for a new replica) -- followers first,
the new leader last -- and only then marks the view ``installed``.  Datanodes also watch ``parts/`` and
install any higher epoch that names them (and drop a partition whose newer view no longer names them), so a
change the manager could not deliver (it died, a node was unreachable) still arrives.

* A write is acknowledged by a leader only after **every** replica of its epoch acknowledged the forwarded
  write at that epoch (``Node.op_write``), i.e. after it is durable on all of them.
* A leader is replaced only when it lost its lease; the new leader is chosen among the **surviving
  replicas of the current epoch** that are in ``synced`` (a replica still being filled by repair is not:
  it may lack older acknowledged writes).  So every write the old leader acknowledged is already on the
  new leader.
* The new epoch is installed on every surviving replica before the new leader is told (it is last), and
  a replica at the new epoch refuses the old epoch's forwards (``STALE_EPOCH``).  From the moment any
  surviving replica has installed it, the old leader -- even if it is alive, merely cut off from etcd --
  can no longer collect an acknowledgement from every replica of its epoch, so it acknowledges nothing
  more; whatever it acknowledged before is on every survivor.  Two managers cannot publish two different
  views of one epoch: the CAS on the mod revision lets only one of them through.
* Unacknowledged tails (a write that reached some replicas but was never acknowledged) are settled by the
  existing leader-authoritative repair (datanode/repair.py): bytes the new leader has are copied to the
  followers, bytes only a follower has are cut back.  Either outcome is correct, because the writer never
  got an OK for them and the SDK re-sends unacknowledged blocks to a new extent.

Self-fencing, and how it squares with "etcd down: reads and writes go on"
------------------------------------------------------------------------
The rule (``EtcdAgent.fence``, checked by ``Handlers._lead`` before a leader takes a WRITE, CREATE_EXTENT
or MARK_DELETE):

* A node refuses leader writes with ``NOT_LEADER`` (counter ``fenced``) while it **knows** its lease is gone:
  a keepalive reached etcd and etcd said the lease expired (the process was paused, or cut off and then
  healed), or etcd answers again after the node could not keep its lease alive.  The fence lifts once the
  node holds a new lease, has re-read ``parts/`` (installing any newer epoch: it may now be a follower, or
  drop its stale copy) and has re-published itself.  The SDK treats ``NOT_LEADER`` as "the map changed":
  it re-reads the view from etcd and goes on.
* When the local clock says the lease may have lapsed (no keepalive confirmed for a TTL, counted from when
  the confirmed request was *sent*), a leader write waits -- at most one keepalive round -- for etcd's
  verdict before it proceeds: this is what stops a leader resumed after SIGSTOP from acknowledging the
  writes that were queued while it was stopped.
* Only leaders of **replicated** partitions fence: the manager moves leadership only to another synced
  replica, so a single-replica partition cannot have been moved and keeps serving.
* When **no** etcd member answers, the node cannot tell "etcd is down" (nobody can change the map, so its
  partitions cannot have been moved) from "I am cut off" (the manager may have moved them).  It does not
  fence then: reads and writes on existing partitions go on with etcd entirely down, as required.  That is
  safe, not just available, because of the epoch fence above: the manager moves a partition only through
  etcd, and the new leader takes writes only after every surviving replica of the old epoch installed the
  new one; the old leader's acknowledgement needs every replica of its epoch, so from then on it gets
  ``STALE_EPOCH`` from the new leader and acknowledges nothing.  Self-fencing makes that refusal prompt and
  explicit (no forwards, no sealed extents, no half-written tails on the old leader) in the cases the node
  can know about; the epoch fence is what makes "no acknowledged write lost, no two leaders acknowledging"
  hold in every case, including the undecidable one.

A datanode that cannot reach etcd otherwise keeps serving the map it has: the data path never waits for
etcd except for the bounded verdict wait above.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import pathlib
import socket
import threading
import time
import urllib.parse

import trio

from .mapcheck import Invalid, PartView, check_change, kind_of, map_key, open_entry, seal

log = logging.getLogger(__name__)

DEFAULT_PREFIX = "/datanode"
SETTLE_S = 1.0    # how often the manager asks after the lease of a registration deleted while that lease lived
CREATE_TXN_MAX = 64   # views per ``create_parts`` transaction: each is a compare and a put, under etcd's 128
# the etcd answers that mean "authenticate again" (a simple token expires after etcd's --auth-token-ttl of
# disuse, and every token dies with the member that issued it)
_AUTH_AGAIN = ("invalid auth token", "auth store is old", "user name is empty")


class EtcdError(Exception):
    """etcd could not be reached or refused a request; the message names the endpoint(s)."""


class EtcdUnreachable(EtcdError):
    """No endpoint answered in time (connection refused or timed out, an overloaded member's 5xx): worth
    trying again later, unlike a refusal."""


@dataclasses.dataclass(frozen=True)
class EtcdAccess:
    """How a component reaches etcd beyond its URL: an etcd user (``credentials``: a file holding one line
    ``USER:PASSWORD``, as etcdctl's --user takes it) and client TLS (``ca`` to check the members' certificates,
    ``cert``/``key`` to present one).  Empty: none."""
    user: str = ""
    password: str = dataclasses.field(default="", repr=False)
    ca: str = ""
    cert: str = ""
    key: str = ""

    @classmethod
    def load(cls, credentials: str | None = None, ca: str | None = None, cert: str | None = None,
             key: str | None = None) -> "EtcdAccess":
        """From files; ValueError names the file and what is wrong with it."""
        user = password = ""
        if credentials:
            try:
                text = pathlib.Path(credentials).read_text().strip()
            except (OSError, UnicodeDecodeError) as e:
                raise ValueError(f"etcd credentials {credentials}: {getattr(e, 'strerror', None) or e}") from None
            user, sep, password = text.partition(":")
            if not sep or not user or not password or "\n" in text:
                raise ValueError(f"etcd credentials {credentials}: expected one line USER:PASSWORD")
        if bool(cert) != bool(key):
            raise ValueError("etcd client TLS: give both the certificate and its key")
        for what, path in (("CA", ca), ("certificate", cert), ("key", key)):
            if path and not pathlib.Path(path).is_file():
                raise ValueError(f"etcd TLS {what} {path}: no such file")
        return cls(user, password, os.path.abspath(ca) if ca else "", os.path.abspath(cert) if cert else "",
                   os.path.abspath(key) if key else "")


def parse_urls(text: str) -> list[tuple[str, str, int]]:
    """``"http://h:2379,http://h2:2379"`` -> [(scheme, host, port)]; ValueError names a bad one."""
    out = []
    for u in (s.strip() for s in text.split(",")):
        if not u:
            continue
        p = urllib.parse.urlsplit(u if "://" in u else "http://" + u)
        if p.scheme not in ("http", "https") or not p.hostname:
            raise ValueError(f"bad etcd URL {u!r}: expected http://HOST:PORT")
        try:
            port = p.port or 2379
        except ValueError:
            raise ValueError(f"bad etcd URL {u!r}: the port is not a number") from None
        out.append((p.scheme, p.hostname, port))
    if not out:
        raise ValueError("no etcd URL given (expected http://HOST:PORT[,http://HOST:PORT...])")
    return out


def _b64(s: str | bytes) -> str:
    import base64
    return base64.b64encode(s.encode() if isinstance(s, str) else s).decode()


def _unb64(s: str) -> bytes:
    import base64
    return base64.b64decode(s)


def _hint(refusal: str) -> str:
    """What to do about an etcd refusal that is a matter of configuration."""
    if "user name is empty" in refusal:
        return (" (etcd has authentication on: give this component its etcd user -- dnctl/dnmanager/dnfs "
                "--etcd-credentials FILE, node.toml etcd_credentials)")
    if "permission denied" in refusal:
        return " (this etcd user's role does not allow it: see docs/security.md, the cluster map in etcd)"
    if "CommonName of client" in refusal:
        return (" (etcd's JSON gateway refuses a client certificate that has a Common Name while its "
                "authentication is on: use one without, as `dnctl etcd issue` makes them)")
    return ""


def _tls_hint(e: Exception) -> str:
    """Why a TLS connection to an etcd member failed, when it is a matter of configuration."""
    text = str(getattr(e, "detail_text", "") or e)
    if "CERTIFICATE_VERIFY_FAILED" in text:
        return " (TLS: its certificate is not trusted: give the CA that signed it, --etcd-ca / etcd_ca)"
    if "certificate required" in text or "BAD_CERTIFICATE" in text or "bad certificate" in text:
        return " (TLS: it wants a client certificate: --etcd-cert and --etcd-key / etcd_cert and etcd_key)"
    if "EOF occurred in violation of protocol" in text or "UNEXPECTED_EOF" in text:
        # TLS 1.3: a member that refuses the client's certificate (none, or another CA's) just hangs up
        return (" (TLS: the member hung up: it requires a client certificate of its cluster's CA -- "
                "--etcd-cert and --etcd-key / etcd_cert and etcd_key)")
    if "WRONG_VERSION_NUMBER" in text:
        return " (TLS: it does not speak TLS there: use http://)"
    return ""


def _prefix_end(prefix: str) -> str:
    b = bytearray(prefix.encode())
    b[-1] += 1
    return bytes(b).decode()


def _refusal(e) -> str:
    """etcd's own words for a refused request (the gateway's JSON ``message``), else the HTTP reason."""
    text = getattr(e, "detail_text", None) or ""
    try:
        return str(json.loads(text).get("message") or e)
    except (TypeError, ValueError, AttributeError):
        return text.strip().splitlines()[0][:200] if text.strip() else (str(e) or type(e).__name__)


@functools.cache
def _client_class():
    import json as json_mod      # ``post`` has a parameter named json
    import etcd3gw   # imported here: a datanode without etcd configured never needs it
    import requests.adapters
    import etcd3gw.exceptions as ex

    class AuthClient(etcd3gw.Etcd3Client):
        """etcd3gw's client, which has no authentication, with etcd's: ``/v3/auth/authenticate`` gives a
        token that every request then carries in its ``Authorization`` header; a request refused because
        the token expired (or its member restarted) authenticates again and is sent once more."""

        def __init__(self, host, port, protocol, timeout, access: EtcdAccess):
            super().__init__(host=host, port=port, protocol=protocol, timeout=timeout, api_path="/v3/",
                             ca_cert=access.ca or None, cert_cert=access.cert or None,
                             cert_key=access.key or None)
            # every call runs in a worker thread: as many connections as threads that may call at once, so
            # none is opened, used once and thrown away ("Connection pool is full")
            adapter = requests.adapters.HTTPAdapter(pool_connections=1, pool_maxsize=worker_threads())
            self.session.mount("http://", adapter)
            self.session.mount("https://", adapter)
            self.access = access
            self.token = ""
            self._mu = threading.Lock()

        def authenticate(self) -> dict:
            """The headers a request carries (a fresh token when there is none yet)."""
            if not self.access.user:
                return {}
            with self._mu:
                if not self.token:
                    try:
                        r = super().post(self.get_url("/auth/authenticate"), **self._tls(),
                                         json={"name": self.access.user, "password": self.access.password})
                    except ex.Etcd3Exception as e:
                        if isinstance(e, (ex.ConnectionFailedError, ex.ConnectionTimeoutError)):
                            raise
                        raise ex.Etcd3Exception(json_mod.dumps({"message": f"authenticating as "
                                                f"{self.access.user!r}: {_refusal(e)}"}), "authentication") from None
                    self.token = str(r.get("token", ""))
                return {"Authorization": self.token}

        def forget(self, token: str) -> None:
            """``token`` was refused: the next request authenticates again."""
            with self._mu:
                if self.token == token:
                    self.token = ""

        def _tls(self) -> dict:
            # per request: requests lets $REQUESTS_CA_BUNDLE override a session's CA, and ours must win
            return {"verify": self.access.ca} if self.access.ca else {}

        def post(self, url, *args, json=None, **kwargs):
            kwargs.update(self._tls())
            for again in (True, True, False):
                headers = self.authenticate()
                try:
                    return super().post(url, *args, json=json, headers=headers, **kwargs)
                except ex.Etcd3Exception as e:
                    if not (again and self.access.user and any(w in (e.detail_text or "") for w in _AUTH_AGAIN)):
                        raise
                    self.forget(headers.get("Authorization", ""))

        def stream(self, path: str, body: dict, timeout):
            """A streaming POST (a watch), authenticated as every request is."""
            return self.session.post(self.get_url(path), json=body, stream=True, timeout=timeout,
                                     headers=self.authenticate(), **self._tls())

    return AuthClient


def worker_threads() -> int:
    """How many etcd calls may be under way at once in this process: trio's default thread limiter bounds
    ``trio.to_thread.run_sync`` (through which every call here runs), 40 unless the program changed it."""
    try:
        return max(1, int(trio.to_thread.current_default_thread_limiter().total_tokens))
    except RuntimeError:                   # not in trio (a client made before trio.run)
        return DEFAULT_WORKER_THREADS


DEFAULT_WORKER_THREADS = 40                # trio's default


def auth_request(c, path: str, body: dict, *, exists_ok: bool = False) -> None:
    """One request of etcd's auth API (``/auth/user/add``, ``/auth/role/grant``, ``/auth/enable``...) on a
    ``client``; ``exists_ok``: a user or role that exists already is fine.  EtcdError says what etcd refused."""
    import etcd3gw.exceptions as ex
    try:
        c.post(c.get_url(path), json=body)
    except ex.Etcd3Exception as e:
        why = _refusal(e)
        if exists_ok and "already exists" in why:
            return
        hint = " (its authentication is on already: give its root user)" if "user name is empty" in why else ""
        raise EtcdError(f"etcd {c.base_url}: {path}: {why}{_tls_hint(e)}{hint}") from None


def permission(perm: str, key: str, range_end: str) -> dict:
    """An etcd role's permission (``/auth/role/grant``'s ``perm``): READ | WRITE | READWRITE on ``key`` up to
    ``range_end`` ("": the key alone)."""
    return {"permType": perm, "key": _b64(key), **({"range_end": _b64(range_end)} if range_end else {})}


def revocation(role: str, key: str, range_end: str) -> dict:
    """``/auth/role/revoke``'s body: take from ``role`` its permission on exactly ``key`` .. ``range_end``."""
    return {"role": role, "key": _b64(key), **({"range_end": _b64(range_end)} if range_end else {})}


def client(url: str, access: EtcdAccess | None = None, timeout: float = 2.0):
    """An etcd3gw client for one endpoint, authenticating and speaking TLS as ``access`` says (the dnfs etcd
    metadata engine uses its key-value calls directly)."""
    (scheme, host, port), = parse_urls(url)
    return _client_class()(host, port, scheme, timeout, access or EtcdAccess())


# etcd access on a command line (dnctl, dnmanager and dnfs make their options of these): option, the
# environment variable it is also read from, EtcdAccess.load's argument, help
ACCESS_OPTIONS = (
    ("--etcd-credentials", "DATANODE_ETCD_CREDENTIALS", "credentials",
     "File holding USER:PASSWORD, this program's etcd user where etcd has authentication on (`dnctl cluster "
     "up` keeps one per component in DIR/etcd-auth/)."),
    ("--etcd-ca", "DATANODE_ETCD_CA", "ca", "CA bundle (PEM) to check the etcd members' certificates (https://)."),
    ("--etcd-cert", "DATANODE_ETCD_CERT", "cert", "Client certificate (PEM) for etcd members that require one."),
    ("--etcd-key", "DATANODE_ETCD_KEY", "key", "Its private key (PEM)."),
)

COMPONENTS = ("datanode", "manager", "admin", "mount")
DNFS_PREFIX = "dnfs/"      # the dnfs etcd metadata engine's keys (client/fs/meta_etcd.py): its own prefix


def permissions(prefix: str) -> dict[str, list[tuple[str, str, str]]]:
    """The etcd role of each component: (READ | WRITE | READWRITE, key, range end -- "" for one key) for
    exactly what it reads and writes under the cluster's ``prefix`` (the key layout above):

    * ``datanode``: reads the partitions' views, writes its registration (and reads the others', to check
      that a view adds only registered nodes) and, when it stops, its hand-off request (and reads which
      manager is active, to know whether anyone will act on it);
    * ``manager``: reads the whole map, writes views, its election key and its answers to requests;
    * ``admin`` (dnctl): reads the whole map, writes requests and drain marks;
    * ``mount`` (the SDK, dnfs): reads views and registrations; dnfs's etcd metadata (``dnfs/``)."""
    root = "/" + prefix.strip("/") + "/"

    def sub(name: str, perm: str) -> tuple[str, str, str]:
        return perm, root + name + "/", _prefix_end(root + name + "/")
    everything = ("READ", root, _prefix_end(root))
    return {"datanode": [sub("parts", "READ"), sub("nodes", "READWRITE"), sub("handoff", "READWRITE"),
                         ("READ", root + "manager", "")],
            "manager": [everything, sub("parts", "READWRITE"), ("READWRITE", root + "manager", ""),
                        sub("requests", "READWRITE")],
            "admin": [everything, sub("requests", "READWRITE"), sub("drain", "READWRITE")],
            "mount": [sub("parts", "READ"), sub("nodes", "READ"),
                      ("READWRITE", DNFS_PREFIX, _prefix_end(DNFS_PREFIX))]}


def node_permissions(prefix: str, addr: str) -> list[tuple[str, str, str]]:
    """The role of one datanode's own etcd user: everything ``datanode`` reads, and writes to its own
    registration and hand-off request only (``nodes/<addr>``, ``handoff/<addr>``).  So one node cannot
    overwrite or delete another's registration, nor revoke another's lease: etcd revokes a lease only for a
    user who may write every key attached to it."""
    root = "/" + prefix.strip("/") + "/"
    return ([("READ", key, end) for _perm, key, end in permissions(prefix)["datanode"]]
            + [("READWRITE", root + "nodes/" + addr, ""), ("READWRITE", root + "handoff/" + addr, "")])


def shared_node_writes(prefix: str) -> list[tuple[str, str]]:
    """(key, range end) of the writes the shared ``datanode`` role holds that per-node users replace."""
    return [(key, end) for perm, key, end in permissions(prefix)["datanode"] if perm == "READWRITE"]


class Etcd:
    """A handle on the cluster map in etcd (blocking etcd3gw calls, run in worker threads).

    ``access``: etcd user and client TLS (``EtcdAccess``).  ``admin_key``: the cluster's ``admin`` role key
    (from the secret or an admin key file), from which entries' MACs are made and checked (wire/mapcheck.py);
    None: no MACs.  Every value read is checked there; one that must be ignored is logged (once a minute per
    key and reason) and counted in ``invalid`` (by reason)."""

    LOG_EVERY_S = 60.0

    def __init__(self, urls: str, prefix: str = DEFAULT_PREFIX, timeout: float = 2.0, *,
                 access: EtcdAccess | None = None, admin_key: bytes | None = None):
        self.urls = urls
        self.prefix = "/" + prefix.strip("/")
        self.timeout = timeout
        self.access = access or EtcdAccess()
        self.mac_key = map_key(admin_key, self.prefix) if admin_key else None
        self._clients = [_client_class()(h, p, s, timeout, self.access) for s, h, p in parse_urls(urls)]
        self._good = 0
        self._mu = threading.Lock()
        self.invalid: dict[str, int] = {}
        self._logged: dict[tuple[str, str], float] = {}
        # lease requests take threads of their own: behind a burst of map writes (a failover of hundreds of
        # partitions fills trio's thread limiter) a keepalive waiting for a thread lets the lease lapse, and the
        # manager that is making the burst loses its election half-way through it
        self._lease_threads = trio.CapacityLimiter(2)

    # -- what is read and written: checked and sealed (wire/mapcheck.py) ------------------------------
    def seal(self, key: str, body: dict) -> str:
        return seal(self.mac_key, key, body)

    def open(self, key: str, raw: bytes | str, rev: int = 0):
        """The checked content of the sealed entry ``key`` (a PartView, with ``rev``, or a dict), or None
        when it must be ignored (logged and counted)."""
        try:
            out = open_entry(self.mac_key, self.prefix, key, raw)
        except Invalid as e:
            self.reject(key, e)
            return None
        if isinstance(out, PartView):
            out.rev = rev
        return out

    async def registered_for(self, old_replicas: list[str], view: PartView) -> set[str] | None:
        """The registered nodes ``follows`` needs to check ``view`` against: None when it adds no replica or is
        sealed (the registration rule guards unsealed maps only), so no read of etcd is made for nothing."""
        if self.mac_key is not None or all(r in old_replicas for r in view.replicas):
            return None
        return set(await self.nodes())

    def follows(self, old_epoch: int, old_replicas: list[str], view: PartView, registered=None) -> bool:
        """May ``view`` follow what the caller holds (mapcheck.check_change)?  If not: logged and counted.
        A sealed view (its MAC verified) may add a node whose lease has lapsed since the manager chose it: the
        registration rule guards only unsealed maps, where anyone who can write etcd could name any address."""
        if self.mac_key is not None:
            registered = None
        try:
            check_change(old_epoch, old_replicas, view, registered)
        except Invalid as e:
            self.reject(self.part_key(view.id), e)
            return False
        return True

    def reject(self, key: str, e: Invalid) -> None:
        self.invalid[e.reason] = self.invalid.get(e.reason, 0) + 1
        self._log_limited(key, e.reason, f"ignored ({e.reason}): {e}")

    def _log_limited(self, key: str, what: str, text: str) -> None:
        """A warning, at most once a minute for a key and ``what`` (a flood of bad values is no log flood)."""
        now = time.monotonic()
        if now - self._logged.get((key, what), -math.inf) >= self.LOG_EVERY_S:
            if len(self._logged) > 1024:
                self._logged.clear()
            self._logged[(key, what)] = now
            log.warning("etcd %s: %s", key, text)

    # -- keys ---------------------------------------------------------------------------------------
    def key(self, *parts) -> str:
        return "/".join([self.prefix, *map(str, parts)])

    @property
    def nodes_prefix(self) -> str:
        return self.key("nodes") + "/"

    @property
    def parts_prefix(self) -> str:
        return self.key("parts") + "/"

    # -- plumbing -----------------------------------------------------------------------------------
    def _call_sync(self, fn):
        """Run ``fn(client)`` against the endpoints in turn (the last good one first)."""
        import etcd3gw.exceptions as ex
        import requests
        errors = []
        n = len(self._clients)
        start = self._good
        for i in range(n):
            k = (start + i) % n
            c = self._clients[k]
            try:
                out = fn(c)
            except (ex.ConnectionFailedError, ex.ConnectionTimeoutError, ex.InternalServerError,
                    requests.RequestException, ValueError, OSError) as e:
                # etcd3gw passes some of requests' errors through unwrapped: a member killed mid-answer
                # ends the body early (ChunkedEncodingError) or leaves half a JSON document (ValueError);
                # a CA or certificate file gone (replaced while rotating it) is a plain OSError, tried again
                what = f"{type(e).__name__}: {e}" if type(e) is OSError else type(e).__name__
                errors.append(f"{c.base_url}: {what}{_tls_hint(e)}")
                continue
            except ex.Etcd3Exception as e:
                raise EtcdError(f"etcd {c.base_url} refused the request: {_refusal(e)}"
                                + _hint(_refusal(e))) from None
            self._good = k
            return out
        raise EtcdUnreachable("etcd unreachable (" + "; ".join(errors) + ")")

    async def call(self, fn, *, lease: bool = False):
        return await trio.to_thread.run_sync(self._call_sync, fn,
                                             limiter=self._lease_threads if lease else None)

    async def _post(self, path: str, body: dict, *, lease: bool = False) -> dict:
        return await self.call(lambda c: c.post(c.get_url(path), json=body), lease=lease)

    # -- kv -----------------------------------------------------------------------------------------
    async def get_prefix(self, prefix: str, *, leases: bool = False) -> tuple[list[tuple], int]:
        """[(key, value, mod_revision)] under ``prefix`` and the store revision they were read at;
        ``leases``: [(key, value, mod_revision, lease)] (0: attached to none)."""
        r = await self._post("/kv/range", {"key": _b64(prefix), "range_end": _b64(_prefix_end(prefix))})
        kvs = [(_unb64(kv["key"]).decode(), _unb64(kv.get("value", "")), int(kv.get("mod_revision", 0)),
                *((int(kv.get("lease", 0)),) if leases else ())) for kv in r.get("kvs", [])]
        return kvs, int(r.get("header", {}).get("revision", 0))

    async def get(self, key: str) -> tuple[bytes, int] | None:
        r = await self._post("/kv/range", {"key": _b64(key)})
        kvs = r.get("kvs", [])
        if not kvs:
            return None
        return _unb64(kvs[0].get("value", "")), int(kvs[0].get("mod_revision", 0))

    async def put(self, key: str, value: str, lease: int | None = None) -> None:
        body = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = lease
        await self._post("/kv/put", body)

    async def delete(self, key: str) -> None:
        await self._post("/kv/deleterange", {"key": _b64(key)})

    async def txn(self, compare: list[dict], success: list[dict]) -> tuple[bool, int]:
        """(succeeded, the store revision after it: a put's new mod revision)."""
        r = await self._post("/kv/txn", {"compare": compare, "success": success, "failure": []})
        return bool(r.get("succeeded", False)), int(r.get("header", {}).get("revision", 0))

    # -- leases -------------------------------------------------------------------------------------
    async def grant(self, ttl: int) -> int:
        r = await self._post("/lease/grant", {"TTL": int(ttl), "ID": 0}, lease=True)
        return int(r["ID"])

    async def keepalive(self, lease: int) -> int:
        """Refresh ``lease``; returns its TTL, or -1 if it has already expired."""
        r = await self._post("/lease/keepalive", {"ID": lease}, lease=True)
        return int(r.get("result", {}).get("TTL", -1))

    async def revoke(self, lease: int) -> None:
        await self._post("/kv/lease/revoke", {"ID": lease})

    async def lease_ttl(self, lease: int) -> int:
        """Seconds ``lease`` has left; -1 once it expired or was revoked."""
        r = await self._post("/kv/lease/timetolive", {"ID": lease}, lease=True)
        return int(r.get("TTL", -1))

    async def release(self, lease: "Lease", timeout: float = 1.0) -> None:
        """On a clean stop: revoke ``lease`` now (shielded, bounded), so others need not wait for its TTL."""
        if lease is None or not lease.ok:
            return
        with trio.move_on_after(timeout) as s:
            s.shield = True
            try:
                await self.revoke(lease.id)
            except EtcdError:
                pass

    # -- the map ------------------------------------------------------------------------------------
    def part_key(self, pid: int) -> str:
        return self.key("parts", pid)

    def node_key(self, addr: str) -> str:
        return self.key("nodes", addr)

    @property
    def manager_key(self) -> str:
        return self.key("manager")

    async def entries(self, prefix: str) -> dict[str, object]:
        """The checked entries under ``prefix`` (one of the sealed subtrees), by key; invalid ones left out."""
        kvs, _ = await self.get_prefix(prefix)
        out = {}
        for k, v, rev in kvs:
            got = self.open(k, v, rev)
            if got is not None:
                out[k] = got
        return out

    async def get_entry(self, key: str):
        """The checked entry at ``key`` (None: absent, or invalid)."""
        got = await self.get(key)
        return self.open(key, got[0], got[1]) if got else None

    async def put_entry(self, key: str, body: dict, lease: int | None = None) -> None:
        await self.put(key, self.seal(key, body), lease)

    async def parts(self) -> dict[int, PartView]:
        return {v.id: v for v in (await self.entries(self.parts_prefix)).values()}

    async def part(self, pid: int) -> PartView | None:
        return await self.get_entry(self.part_key(pid))

    async def nodes(self) -> dict[str, dict]:
        return {k[len(self.nodes_prefix):]: d for k, d in (await self.entries(self.nodes_prefix)).items()}

    async def cas_part(self, view: PartView, *, expect_rev: int, holder: tuple[str, str] | None = None,
                       also: tuple[str, dict] | None = None) -> bool:
        """Write ``view`` (sealed) if its key is still at ``expect_rev`` (0: does not exist yet) and, with
        ``holder=(key, value)``, only while ``key`` still holds ``value`` (the manager's election key).
        ``also=(key, body)``: put that too, sealed, in the same transaction (an admin request's progress)."""
        key = self.part_key(view.id)
        cmp = ([{"key": _b64(key), "result": "EQUAL", "target": "CREATE", "create_revision": 0}]
               if expect_rev == 0 else
               [{"key": _b64(key), "result": "EQUAL", "target": "MOD", "mod_revision": expect_rev}])
        if holder is not None:
            cmp.append({"key": _b64(holder[0]), "result": "EQUAL", "target": "VALUE", "value": _b64(holder[1])})
        puts = [{"request_put": {"key": _b64(key), "value": _b64(self.seal(key, view.body()))}}]
        if also is not None:
            puts.append({"request_put": {"key": _b64(also[0]), "value": _b64(self.seal(*also))}})
        ok, rev = await self.txn(cmp, puts)
        if ok:
            view.rev = rev
        return ok

    async def cas_parts(self, items: list[tuple[PartView, int]], *, holder: tuple[str, str]) -> bool:
        """``cas_part`` for many partitions in one transaction, all or none: each view written only if its key
        is still at its expected revision (0: does not exist yet), all only while ``holder`` holds.  False:
        some key moved (or the holder changed) -- ``cas_part`` each to learn which.  At most
        ``CREATE_TXN_MAX`` views (etcd's ``--max-txn-ops``)."""
        if not 0 < len(items) <= CREATE_TXN_MAX:
            raise ValueError(f"cas_parts: {len(items)} views (1 to {CREATE_TXN_MAX} per transaction)")
        cmp, puts = [], []
        for view, expect_rev in items:
            key = _b64(self.part_key(view.id))
            cmp.append({"key": key, "result": "EQUAL", "target": "CREATE", "create_revision": 0} if expect_rev == 0
                       else {"key": key, "result": "EQUAL", "target": "MOD", "mod_revision": expect_rev})
            puts.append({"request_put": {"key": key, "value": _b64(self.seal(self.part_key(view.id), view.body()))}})
        cmp.append({"key": _b64(holder[0]), "result": "EQUAL", "target": "VALUE", "value": _b64(holder[1])})
        ok, rev = await self.txn(cmp, puts)
        if ok:
            for view, _ in items:
                view.rev = rev
        return ok

    async def create_parts(self, views: list[PartView], *, holder: tuple[str, str],
                           also: tuple[str, dict] | None = None) -> bool:
        """Write new partitions' views in one transaction: each only if its key does not exist yet, all only
        while ``holder`` holds (the manager's election key); ``also``: an admin request's progress, in the
        same transaction.  All or none.  A batch of creates costs one etcd round trip and one revision, not
        one per partition (etcd's ``--max-txn-ops``, 128 by default, bounds the batch: ``CREATE_TXN_MAX``)."""
        if not 0 < len(views) <= CREATE_TXN_MAX:
            raise ValueError(f"create_parts: {len(views)} views (1 to {CREATE_TXN_MAX} per transaction)")
        cmp = [{"key": _b64(self.part_key(v.id)), "result": "EQUAL", "target": "CREATE", "create_revision": 0}
               for v in views]
        cmp.append({"key": _b64(holder[0]), "result": "EQUAL", "target": "VALUE", "value": _b64(holder[1])})
        puts = [{"request_put": {"key": _b64(self.part_key(v.id)),
                                 "value": _b64(self.seal(self.part_key(v.id), v.body()))}} for v in views]
        if also is not None:
            puts.append({"request_put": {"key": _b64(also[0]), "value": _b64(self.seal(*also))}})
        ok, rev = await self.txn(cmp, puts)
        if ok:
            for v in views:
                v.rev = rev
        return ok

    async def cas_delete_part(self, pid: int, *, expect_rev: int, holder: tuple[str, str]) -> bool:
        """Delete partition ``pid``'s view if it is still at ``expect_rev`` and ``holder`` still holds."""
        key = self.part_key(pid)
        ok, _ = await self.txn([{"key": _b64(key), "result": "EQUAL", "target": "MOD", "mod_revision": expect_rev},
                                {"key": _b64(holder[0]), "result": "EQUAL", "target": "VALUE",
                                 "value": _b64(holder[1])}],
                               [{"request_delete_range": {"key": _b64(key)}}])
        return ok

    async def campaign(self, key: str, value: str, lease: int) -> bool:
        """Take ``key`` for ``value`` if nobody holds it (an election: the key lives as long as ``lease``)."""
        ok, _ = await self.txn([{"key": _b64(key), "result": "EQUAL", "target": "CREATE", "create_revision": 0}],
                               [{"request_put": {"key": _b64(key), "value": _b64(value), "lease": lease}}])
        return ok

    # -- watch --------------------------------------------------------------------------------------
    async def watch(self, prefix: str, send: trio.MemorySendChannel, *, start_revision: int = 0,
                    leases: bool = False, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Stream changes under ``prefix`` into ``send`` as lists of (type, key, value, mod_revision) with
        type "PUT" or "DELETE" (``leases``: and the lease a PUT attached the key to, 0 for none), until
        cancelled.  Reconnects (to any endpoint) when the stream ends,
        resuming after the last revision seen; a ``None`` item means "events may have been missed: re-read"
        (sent after every reconnect)."""
        body = {"key": _b64(prefix), "range_end": _b64(_prefix_end(prefix))}
        next_rev = start_revision
        started = False
        backoff = 0.2
        while True:
            req = {"create_request": {**body, **({"start_revision": next_rev} if next_rev else {})}}
            try:
                c, resp = await self.call(lambda c: (c, c.stream("/watch", req, timeout=(self.timeout, None))))
            except EtcdError as e:
                log.debug("watch %s: %s", prefix, e)
                resp = None
            except Exception as e:   # requests' own connection errors (not wrapped by etcd3gw here)
                log.debug("watch %s: %s", prefix, e)
                resp = None
            if resp is not None:
                if not started:
                    started = True
                    task_status.started()
                else:
                    send.send_nowait(None)
                last, refused = await self._pump_stream(resp, send, from_now=not next_rev, leases=leases)
                if refused and c.access.user and any(w in refused for w in _AUTH_AGAIN):
                    c.forget(resp.request.headers.get("Authorization", ""))   # authenticate again, soon
                    backoff = 0.05
                elif refused:
                    self._log_limited(prefix, "watch", f"etcd refused the watch: {refused}{_hint(refused)}")
                else:
                    backoff = 0.2
                    if last < 0:
                        next_rev = 0          # our revision was compacted away: from now on (+ re-read)
                    elif last:
                        next_rev = last + 1
            await trio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)

    async def _pump_stream(self, resp, send: trio.MemorySendChannel, from_now: bool,
                           leases: bool = False) -> tuple[int, str]:
        """Read one watch stream in a worker thread until it ends or we are cancelled; returns the last
        revision seen (0: none, -1: etcd cancelled the watch, e.g. its start revision was compacted; a watch
        ``from_now`` has seen the revision it was created at) and, when etcd refused the watch
        (authentication, permission), its reason."""
        last = [0]
        refused = [""]

        def pump():
            try:
                for line in resp.iter_lines(chunk_size=None):
                    if not line.strip():
                        continue
                    doc = json.loads(line)
                    err = doc.get("error") if "result" not in doc else None
                    if isinstance(err, dict) and err.get("grpc_code", err.get("code")) in (7, 16):
                        refused[0] = str(err.get("message", err))    # PermissionDenied, Unauthenticated
                    if err:
                        return                        # (else: the member is going away; reconnect)
                    res = doc.get("result", {})
                    if from_now and res.get("created") and not res.get("canceled"):
                        # watching from here: a reconnect resumes after this revision, not from a later "now"
                        last[0] = max(last[0], int(res.get("header", {}).get("revision", 0)))
                    batch = []
                    for ev in res.get("events", []):
                        kv = ev["kv"]
                        rev = int(kv.get("mod_revision", 0))
                        batch.append((ev.get("type", "PUT"), _unb64(kv["key"]).decode(),
                                      _unb64(kv.get("value", "")), rev, *((int(kv.get("lease", 0)),) if leases else ())))
                        last[0] = max(last[0], rev)
                    if res.get("canceled") and not res.get("compact_revision") and res.get("cancel_reason"):
                        refused[0] = str(res["cancel_reason"])
                        return
                    if res.get("canceled") or res.get("compact_revision"):
                        log.warning("watch canceled by etcd (compaction?): re-reading")
                        last[0] = -1
                        return
                    if batch:
                        trio.from_thread.run_sync(send.send_nowait, batch)
            except Exception as e:   # the stream broke (etcd gone) or we shut it down
                log.debug("watch stream ended: %s", e)

        async def closer():
            try:
                await trio.sleep_forever()
            finally:
                _shutdown(resp)

        async with trio.open_nursery() as n:
            n.start_soon(closer)
            await trio.to_thread.run_sync(pump)
            n.cancel_scope.cancel()
        _shutdown(resp)
        return last[0], refused[0]


class MapCache:
    """The whole map under the prefix (nodes, partitions, manager key), kept current in memory by **one
    watch** instead of polling: read once, then every change is pushed by etcd.  A full re-read happens after
    a watch reconnect (events may have been missed) and every ``resync_s`` as a safety net.  ``seq`` grows on
    every change; ``wait(seen)`` returns once it is above ``seen``.

    Each key keeps the mod revision it was last seen at, and an event or a re-read never replaces a newer
    one (a re-read racing a watch event cannot bring an old value back).

    The valid entries are also kept by subtree, with each node's partitions, and a reader that acts on
    changes (the manager's passes) learns which keys changed (``follow``): what it reads costs what changed,
    not the size of the map.

    Entries of the sealed subtrees (nodes, partitions, requests, drain marks) are checked as they arrive
    (``Etcd.open``; a view also against the one it replaces, ``Etcd.follows``, with the registered nodes).  An
    invalid value is ignored: the key keeps its last valid content, and ``bad`` notes the invalid value's
    revision (the manager writes the valid view back over it: ``invalid_parts``).

    A registration is the node's only while it is attached to a lease, and it ends only with that lease:
    etcd deletes the key when the lease expires or the node revokes it (a clean stop), and no other node may
    revoke it (etcd revokes a lease only for a user allowed to write every key attached to it: the node's own,
    or etcd's root role).  So a
    registration put without a lease is ignored, and one that is deleted, or overwritten by a value that
    must be ignored, is kept until etcd says its lease is gone (``_settle``): whoever deleted it could not
    end the node's lease, so the deletion says nothing about the node."""

    def __init__(self, etcd: Etcd, resync_s: float = 30.0):
        self.etcd = etcd
        self.resync_s = resync_s
        self.kv: dict[str, tuple[bytes, int]] = {}   # key -> (value, mod revision)
        self.ok: dict[str, object] = {}               # sealed key -> its last valid content (PartView / dict)
        # the valid entries again, by subtree ("parts", "nodes", ...), and each node's partitions (those whose
        # valid view names it): a pass reads what it needs without walking the whole map
        self.sub: dict[str, dict[str, object]] = {}
        self.members: dict[str, set[int]] = {}
        self._followers: list[MapChanges] = []
        self.bad: dict[str, int] = {}                 # sealed key -> revision of the invalid value it holds
        self.gone: dict[str, int] = {}                # deleted key -> revision of its deletion
        self.lease: dict[str, int] = {}               # registration key -> the lease its valid value is under
        self.unsure: dict[str, int] = {}              # registration kept though its key changed -> that lease
        self._unsure_ev = trio.Event()
        self.rev = 0
        self.seq = 0
        self.reads = 0
        self._ev = trio.Event()

    @property
    def root(self) -> str:
        return self.etcd.prefix + "/"

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Read the map (retrying until etcd answers), report started, then follow it until cancelled."""
        delay = 0.25
        while True:
            try:
                await self.reload()
                break
            except EtcdError as e:
                log.debug("map cache: %s", e)
                await trio.sleep(delay)
                delay = min(delay * 2, 5.0)
        task_status.started()
        send, recv = open_channel()
        async with trio.open_nursery() as n:
            n.start_soon(functools.partial(self.etcd.watch, self.root, send, start_revision=self.rev + 1,
                                           leases=True))
            n.start_soon(self._resync_loop)
            n.start_soon(self._settle_loop)
            async for batch in recv:
                if batch is None:
                    await self._try_reload()
                    continue
                changed = False
                for typ, key, value, rev, lease in batch:
                    changed |= self._apply(key, value if typ == "PUT" else None, rev, lease)
                if changed:
                    self._notify()

    async def _resync_loop(self) -> None:
        while True:
            await trio.sleep(self.resync_s)
            await self._try_reload()

    async def _try_reload(self) -> None:
        try:
            await self.reload()
        except EtcdError as e:
            log.debug("map cache re-read: %s", e)

    async def reload(self) -> None:
        kvs, rev = await self.etcd.get_prefix(self.root, leases=True)
        self.reads += 1
        changed = False
        seen = set()
        for key, value, mod, lease in kvs:
            seen.add(key)
            changed |= self._apply(key, value, mod, lease)
        for key, (_v, mod) in list(self.kv.items()):
            if key not in seen and mod <= rev:      # gone at the read's revision (not re-created after it)
                changed |= self._apply(key, None, rev)
        self.rev = max(self.rev, rev)
        if changed:
            self._notify()

    def _apply(self, key: str, value: bytes | None, rev: int, lease: int = 0) -> bool:
        cur = self.kv.get(key)
        if (cur is not None and rev <= cur[1]) or rev <= self.gone.get(key, 0):
            return False
        if value is None:
            if cur is None:
                return False
            del self.kv[key]
            self.bad.pop(key, None)
            self.gone[key] = rev
            if not self._keep_registration(key):
                self._forget(key)
        else:
            self.kv[key] = (value, rev)
            self.gone.pop(key, None)
            if kind_of(self.etcd.prefix, key) is not None:
                self._check(key, value, rev, lease)
        self.rev = max(self.rev, rev)
        for f in self._followers:
            f.touch(key)
        return True

    def _check(self, key: str, value: bytes, rev: int, lease: int = 0) -> None:
        got = self.etcd.open(key, value, rev)
        old = self.ok.get(key)
        if isinstance(got, PartView) and isinstance(old, PartView) and not self.etcd.follows(
                old.epoch, old.replicas, got, set(self.nodes())):
            got = None
        if got is not None and not lease and key.startswith(self.etcd.nodes_prefix):
            self.etcd.reject(key, Invalid("unleased", "a registration attached to no lease (a node's ends with "
                                                      "its lease)"))
            got = None
        if got is None:
            self.bad[key] = rev
            self._keep_registration(key)
        else:
            self._keep(key, got)
            self.bad.pop(key, None)
            if key.startswith(self.etcd.nodes_prefix):
                self.lease[key] = lease
                self.unsure.pop(key, None)

    def _keep(self, key: str, got) -> None:
        """``got`` is ``key``'s valid content now (and in the indexes)."""
        self._forget(key)
        self.ok[key] = got
        kind = kind_of(self.etcd.prefix, key)
        self.sub.setdefault(kind[0], {})[key] = got
        if isinstance(got, PartView):
            for r in got.replicas:
                self.members.setdefault(r, set()).add(got.id)

    def _forget(self, key: str) -> None:
        old = self.ok.pop(key, None)
        if old is None:
            return
        self.sub.get(kind_of(self.etcd.prefix, key)[0], {}).pop(key, None)
        if isinstance(old, PartView):
            for r in old.replicas:
                held = self.members.get(r)
                if held is not None:
                    held.discard(old.id)
                    if not held:
                        del self.members[r]

    def follow(self) -> "MapChanges":
        """A record of the keys that change from now on (``MapChanges.take``): a reader that acts on changes
        looks at those, not at the whole map."""
        f = MapChanges(self.etcd)
        self._followers.append(f)
        return f

    def _keep_registration(self, key: str) -> bool:
        """A valid registration's key was deleted or overwritten by a value to ignore: keep the registration
        until etcd says its lease is gone (``_settle``).  False for any other key."""
        lease = self.lease.get(key) if key in self.ok else None
        if not lease:
            self.lease.pop(key, None)
            return False
        self.unsure[key] = lease
        self._unsure_ev.set()
        return True

    async def _settle_loop(self) -> None:
        """Ask etcd about the leases of registrations kept though their key changed (``unsure``): one
        request per such registration and second, none while there is none."""
        while True:
            if not self.unsure:
                await self._unsure_ev.wait()
            self._unsure_ev = trio.Event()
            await self._settle()
            if self.unsure:                  # ask again in a second, or at once when another one comes
                with trio.move_on_after(SETTLE_S):
                    await self._unsure_ev.wait()

    async def _settle(self) -> None:
        changed = False
        for key, lease in list(self.unsure.items()):
            try:
                ttl = await self.etcd.lease_ttl(lease)
            except EtcdError as e:
                log.debug("lease %x of %s: %s", lease, key, e)
                continue
            if self.unsure.get(key) != lease:
                continue                               # re-registered meanwhile
            if ttl <= 0:
                del self.unsure[key]
                self.lease.pop(key, None)
                if key not in self.kv or key in self.bad:
                    self._forget(key)                  # the node's lease ended: so has its registration
                    for f in self._followers:
                        f.touch(key)
                    changed = True
            else:
                self.etcd._log_limited(key, "unattributed", f"changed while the node's lease {lease:x} lives: "
                                       f"not the node's doing (a registration ends with its lease); kept")
        if changed:
            self._notify()

    def _notify(self) -> None:
        self.seq += 1
        self._ev.set()
        self._ev = trio.Event()

    async def wait(self, seen: int) -> int:
        while self.seq <= seen:
            await self._ev.wait()
        return self.seq

    # -- views of the cached map (checked entries only) ----------------------------------------------------
    def get(self, key: str) -> bytes | None:
        """The raw value of a key outside the sealed subtrees (the manager's election key)."""
        got = self.kv.get(key)
        return got[0] if got else None

    def under(self, prefix: str) -> list[tuple[str, object]]:
        """(key, checked content) of every valid entry under ``prefix`` (a full key prefix), from memory."""
        kind = kind_of(self.etcd.prefix, prefix)
        if kind is not None and not kind[1]:            # a whole subtree: its index
            return list(self.sub.get(kind[0], {}).items())
        return [(k, v) for k, v in self.ok.items() if k.startswith(prefix)]

    def nodes(self) -> dict[str, dict]:
        pre = self.etcd.nodes_prefix
        return {k[len(pre):]: v for k, v in self.sub.get("nodes", {}).items()}

    def parts(self) -> dict[int, PartView]:
        """Every partition's last valid view, at the key's current revision (a change the manager makes
        overwrites an invalid value stored after it): a copy each, O(partitions) -- a pass reads ``part``."""
        return {v.id: dataclasses.replace(v, rev=self.kv[k][1]) for k, v in self.sub.get("parts", {}).items()}

    def part(self, pid: int) -> PartView | None:
        """Partition ``pid``'s last valid view (a copy), as ``parts`` has it."""
        key = self.etcd.part_key(pid)
        v = self.ok.get(key)
        return dataclasses.replace(v, rev=self.kv[key][1]) if isinstance(v, PartView) else None

    def peek(self, pid: int) -> PartView | None:
        """Partition ``pid``'s last valid view itself, not a copy (read only; its ``rev`` may be behind)."""
        v = self.ok.get(self.etcd.part_key(pid))
        return v if isinstance(v, PartView) else None

    def part_ids(self) -> list[int]:
        return [v.id for v in self.sub.get("parts", {}).values()]

    def count_parts(self) -> int:
        return len(self.sub.get("parts", {}))

    def pids_of(self, addr: str) -> set[int]:
        """The partitions whose valid view names ``addr``."""
        return set(self.members.get(addr, ()))

    def invalid_parts(self) -> tuple[list[PartView], dict[int, int]]:
        """Partitions whose key holds an invalid value now: (their last valid views, at the invalid value's
        revision -- to be written back --, {partition: revision} of those without a valid view known)."""
        pre = self.etcd.parts_prefix
        known, unknown = [], {}
        for k, rev in self.bad.items():
            if not k.startswith(pre):
                continue
            v = self.ok.get(k)
            if v is not None:
                known.append(dataclasses.replace(v, rev=rev))
            elif k[len(pre):].isdigit():
                unknown[int(k[len(pre):])] = rev
        return known, unknown


class MapChanges:
    """What changed in a ``MapCache`` since the last ``take`` (``MapCache.follow``): partition ids, node
    addresses, and whether anything else under the prefix did (requests, drain and hand-off marks, the
    manager key)."""

    def __init__(self, etcd: Etcd):
        self.parts_prefix, self.nodes_prefix = etcd.parts_prefix, etcd.nodes_prefix
        self.parts: set[int] = set()
        self.nodes: set[str] = set()
        self.other = False

    def touch(self, key: str) -> None:
        if key.startswith(self.parts_prefix):
            name = key[len(self.parts_prefix):]
            if name.isdigit():
                self.parts.add(int(name))
                return
        elif key.startswith(self.nodes_prefix):
            self.nodes.add(key[len(self.nodes_prefix):])
            return
        self.other = True

    def take(self) -> tuple[set[int], set[str], bool]:
        out = (self.parts, self.nodes, self.other)
        self.parts, self.nodes, self.other = set(), set(), False
        return out


def _shutdown(resp) -> None:
    """Unblock a thread reading ``resp``: shut its socket down, then close it."""
    try:
        s = socket.fromfd(resp.raw.fileno(), socket.AF_INET, socket.SOCK_STREAM)
        try:
            s.shutdown(socket.SHUT_RDWR)
        finally:
            s.close()
    except (OSError, ValueError, AttributeError):
        pass
    try:
        resp.close()
    except Exception:  # noqa: BLE001 - closing a broken stream
        pass


def open_channel():
    """A channel for ``Etcd.watch`` (unbounded: the watch thread must never block on the trio side)."""
    return trio.open_memory_channel(math.inf)


class Lease:
    """A lease kept alive in the background: ``ok`` is False from the moment a keepalive finds it expired
    (or etcd has not confirmed it for a whole TTL) until ``renew`` got a new one.

    ``confirmed`` is the local time a request that etcd answered "alive" was *sent* (so ``confirmed + ttl``
    never lies past etcd's own expiry); ``expired`` is True once etcd itself said the lease is gone (as
    opposed to: no member answered).  ``on_check`` is called after every keepalive attempt, whatever its
    outcome, with the lease (the datanode's self-fencing waits on it: datanode/etcdagent.py)."""

    def __init__(self, etcd: Etcd, ttl: int, on_check=None):
        self.etcd, self.ttl = etcd, max(2, int(ttl))
        self.id = 0
        self.ok = False
        self.expired = False
        self.lost = trio.Event()
        self.confirmed = 0.0
        self.on_check = on_check

    async def grant(self) -> int:
        sent = trio.current_time()
        self.id = await self.etcd.grant(self.ttl)
        self.ok, self.expired, self.lost = True, False, trio.Event()
        self.confirmed = sent
        return self.id

    async def keep_alive(self) -> None:
        """Refresh every TTL/3 until the lease is lost (then set ``lost`` and return) or cancelled."""
        bound = self.ttl / 3 + self.etcd.timeout
        wait = self.ttl / 3
        while True:
            await trio.sleep(wait)
            wait = self.ttl / 3
            sent = trio.current_time()
            try:
                with trio.fail_after(bound):
                    ttl = await self.etcd.keepalive(self.id)
            except (EtcdError, trio.TooSlowError) as e:
                ttl = None
                log.warning("lease %x: keepalive failed: %s", self.id, e)
            now = trio.current_time()
            if ttl is None and now - sent > 1.5 * bound:
                # the attempt's time ran out while this process did not run (stopped, paused): that is no word
                # from etcd, so not "unreachable" either (a waiting leader write would go on); ask again at once
                wait = 0
                continue
            if ttl is not None and ttl > 0:
                self.confirmed = sent
            elif ttl is not None:
                self.expired = True
            if self.on_check is not None:
                self.on_check(self)
            if self.expired or now - self.confirmed >= self.ttl:
                self.ok = False
                self.lost.set()
                log.warning("lease %x lost (%s)", self.id, "expired" if self.expired else "etcd unreachable")
                return


async def snapshot(e: Etcd) -> dict:
    """The whole map as JSON-able data: nodes (registered, with their lease), partitions, manager, and how
    many entries were ignored as invalid (by reason).  Meant for ``dnctl partition list --json`` /
    ``dnctl cluster status``."""
    nodes = await e.nodes()
    parts = await e.parts()
    mgr = await e.get(e.manager_key)
    return {"etcd": e.urls, "prefix": e.prefix, "manager": mgr[0].decode() if mgr else None,
            "nodes": [{"addr": a, **{k: v for k, v in d.items() if k != "addr"}} for a, d in sorted(nodes.items())],
            "partitions": [parts[p].to_dict() for p in sorted(parts)], "ignored": dict(e.invalid)}
