"""node.toml: every key has a default; a bad value is an error that names the key.

A key's value comes from, the later winning: its default; the file (``datanode serve --config node.toml``);
the environment, $DATANODE_<KEY> (``DATANODE_VERBS_INLINE=0`` sets ``verbs_inline``; booleans 1/0, true/false,
yes/no, on/off; other DATANODE_* variables are ignored), read once by ``load`` when the daemon starts; the
command line (``serve --listen ...``).  ``datanode print-config`` shows each key's value and where it came from.
Not from the environment: ``secret_file``, ``tls_ca`` and the etcd_* credentials, whose variables are a
client's (dnctl, the SDK): a node started from an admin's shell must not take them up.

Each key is declared once, with ``key(default, unit, help, check)``, in the section of the component it
tunes; the checks, ``print-config``, and the key table in docs/operations.md (``python -m datanode.config
--write docs/operations.md``; ``--markdown`` prints it) are made from those declarations.  The file stays
flat (a key's section is not written in it): ``Config`` holds every section's keys, and is each section, so
a component may be typed to see its own, or given its own alone (``section``).
The connection keys (TransportConfig) reach the transport as the TransportOptions of the same names
(``transport_options``).
"""
from __future__ import annotations

import dataclasses
import enum
import os
import pathlib
import sys
import tomllib
from types import MappingProxyType
from typing import Any, Callable, ClassVar, Iterator, Mapping, TypeVar

from wire.env import ENV_PREFIX, env_values
from wire.transport.base import OptionError, TransportChoice, TransportOptions


class ConfigError(Exception):
    pass


class SyncMode(enum.StrEnum):
    """When an append is durable: ``always`` fdatasync before every ack; ``none`` page cache only."""
    ALWAYS = "always"
    NONE = "none"


_ENUMS = {"SyncMode": SyncMode, "TransportChoice": TransportChoice}
_WIRE = TransportOptions()       # the connection keys' defaults are the transport's own

# A check looks at a key's value (and the whole config, for a key bounded by another) and returns what is
# wrong with it, or None.
Check = Callable[[Any, Any], "str | None"]


@dataclasses.dataclass(frozen=True)
class KeyInfo:
    unit: str
    help: str
    checks: tuple[Check, ...]
    env: bool                    # may $DATANODE_<KEY> set it


def key(default, unit: str, help: str, check: Check | tuple[Check, ...] = (), *, env: bool = True):
    """A config key: its default, unit and one-line meaning (print-config, the docs), and its checks, run
    in order by ``load``; ``env=False``: the environment does not set it."""
    checks = check if isinstance(check, tuple) else (check,)
    return dataclasses.field(default=default, metadata={"key": KeyInfo(unit, help, checks, env)})


# -- checks -----------------------------------------------------------------------------------------------
def rule(ok: Callable[[Any, Any], bool], why: str | Callable[[Any], str]) -> Check:
    """A check: ``why`` (text, or a function of the config) unless ``ok(value, cfg)``."""
    return lambda v, cfg: None if ok(v, cfg) else why(cfg) if callable(why) else why


def between(lo, hi, unit: str = "", note: str = "") -> Check:
    return rule(lambda v, _: lo <= v <= hi, f"must be between {lo} and {hi}{' ' + unit if unit else ''}"
                                            f"{' (' + note + ')' if note else ''}")


def at_least(lo, why: str) -> Check:
    return rule(lambda v, _: v >= lo, why)


def positive(why: str = "must be > 0 seconds") -> Check:
    return rule(lambda v, _: v > 0, why)


def power_of_two(lo: int, hi: int, note: str = "") -> Check:
    return rule(lambda v, _: lo <= v <= hi and not v & (v - 1),
                f"must be a power of two between {lo} and {hi}{' (' + note + ')' if note else ''}")


def one_of(*values: str) -> Check:
    return rule(lambda v, _: v in values, "must be " + " or ".join(f"'{v}'" for v in values))


def fraction() -> Check:
    return rule(lambda v, _: 0 < v <= 1, "must be in (0, 1]")


def host_port(why: str, empty_ok: bool = False) -> Check:
    def ok(v, _):
        if empty_ok and not v:
            return True
        host, sep, port = v.rpartition(":")
        return bool(sep and host and port.isdigit() and 0 <= int(port) <= 65535)
    return rule(ok, why)


def a_file(why: str = "no such file") -> Check:
    return rule(lambda v, _: not v or pathlib.Path(v).is_file(), why)


def with_key(other: str, why: str) -> Check:
    """Set only together with key ``other``: this one is wrong when ``other`` is set and it is not."""
    return rule(lambda v, cfg: bool(v) or not getattr(cfg, other), why)


def _wire(name: str) -> Check:
    """The transport's own range check of its option ``name`` (TransportOptions)."""
    def check(v, _):
        try:
            TransportOptions(**{name: v})
        except OptionError as e:
            return e.why
        return None
    return check


def _parsed(parse: Callable[[str], Any]) -> Check:
    """``parse`` takes the value (ValueError: its message is what is wrong)."""
    def check(v, _):
        if not v:
            return None
        try:
            parse(v)
        except ValueError as e:
            return str(e)
        return None
    return check


def _etcd_urls(v):
    from wire.etcdmap import parse_urls
    parse_urls(v)


def _etcd_user(v):
    from wire.etcdmap import EtcdAccess
    EtcdAccess.load(v)


# -- the sections, one per component ----------------------------------------------------------------------
@dataclasses.dataclass
class NodeConfig:
    """the node: its address and name, its files, its process"""
    listen: str = key("127.0.0.1:17310", "HOST:PORT", "address the node serves on; also its name in partitions' "
                      "replica lists", host_port("expected HOST:PORT, e.g. 127.0.0.1:17310"))
    data_dir: str = key("./data", "path", "directory holding the partitions (created if missing)",
                        rule(lambda v, _: bool(v), "must be a directory path"))
    trash_retention_s: float = key(86400.0, "seconds", "a deleted or removed partition's data stays in "
                                   "data_dir/trash this long", at_least(0, "must be >= 0 seconds (0: purge at once)"))
    audit_log: str = key("", "path", "admin actions as JSON lines (empty: data_dir/audit.log)")
    log_level: str = key("info", "level", "debug, info, warning or error",
                         rule(lambda v, _: v.lower() in ("debug", "info", "warning", "error"),
                              "must be debug, info, warning or error"))
    cpu_sched: str = key("batch", "batch|normal", "Linux CPU scheduling policy of the node's threads; batch "
                         "(SCHED_BATCH): a woken node does not preempt a running process, so under load each "
                         "wake-up serves more requests", one_of("batch", "normal"))

    @property
    def host(self) -> str:
        return self.listen.rsplit(":", 1)[0]

    @property
    def port(self) -> int:
        return int(self.listen.rsplit(":", 1)[1])


@dataclasses.dataclass
class TransportConfig:
    """connections and the data path (wire/transport; the TransportOptions of the same names)"""
    transport: TransportChoice = key(TransportChoice.AUTO, "|".join(TransportChoice),
                                     "data path; auto uses RDMA verbs if a device works, else TCP")
    rdma_device: str = key(_WIRE.rdma_device, "name", "RDMA device, e.g. rxe0; empty: the first active one")
    gid_index: int = key(_WIRE.gid_index, "index", "GID table index of the RDMA port (RoCE v2 is usually 1)",
                         _wire("gid_index"))
    slots: int = key(64, "count", "preposted control slots per connection (requests in flight per connection)",
                     between(1, 4096))
    tcp_congestion: str = key(_WIRE.tcp_congestion, "name", "TCP congestion control of every connection (\"\": the "
                              "system's); cubic, because BBR paces each flow itself and sends a large payload in "
                              "many small pieces")
    rdma_windows: bool = key(_WIRE.rdma_windows, "bool", "verbs: a type-2 memory window per request, so a peer "
                             "reaches only the range it was granted (false, or a device without them: the region's "
                             "rkey reaches all of it)")
    verbs_inline: int = key(_WIRE.verbs_inline, "bytes", "verbs: a WRITE payload this small goes in its header's "
                            "SEND, saving the READ round trip (0: off)", _wire("verbs_inline"))
    verbs_spin_us: int = key(_WIRE.verbs_spin_us, "us", "verbs: busy-poll the completion queue this long after the "
                             "last completion (0: off; spinning takes CPU a software device such as rxe needs)",
                             _wire("verbs_spin_us"))
    verbs_unsignaled: bool = key(_WIRE.verbs_unsignaled, "bool", "verbs: no completions for header SENDs and window "
                                 "binds (may pay on hardware)")
    verbs_post_thread_min: int = key(_WIRE.verbs_post_thread_min, "bytes", "verbs: one-sided ops this large are "
                                     "posted from a thread without the GIL (software devices move the bytes inside "
                                     "the post); -1: 64 KiB on software devices, never on hardware; 0: never",
                                     _wire("verbs_post_thread_min"))
    verbs_posters: int = key(_WIRE.verbs_posters, "count", "threads posting those ops", _wire("verbs_posters"))
    trace: str = key(_WIRE.trace, "path", "directory where each request's step times go at exit (wire/trace.py, "
                     "bench/write_timeline.py); empty: off")


@dataclasses.dataclass
class MemoryConfig:
    """the registered pool, and how much of it and how long a request and a connection may hold"""
    pool_mib: int = key(256, "MiB", "registered memory pool (buddy allocator) for request payloads",
                        between(1, 65536))
    max_block_kib: int = key(4096, "KiB", "largest pool block, so the largest single request payload", (
        power_of_two(4, 65536),
        rule(lambda v, cfg: (cfg.pool_mib * 1024) % v == 0,
             lambda cfg: f"pool_mib ({cfg.pool_mib} MiB) must be a multiple of the max block")))
    pool_wait: float = key(10.0, "seconds", "how long a request may wait for pool memory before POOL_BUSY",
                           positive())
    conn_pool_share: float = key(0.5, "fraction", "most of the pool one connection may hold (BUSY beyond; fair "
                                 "share when short)", fraction())
    conn_fetch_mib: int = key(32, "MiB", "pool one connection's requests may hold awaiting their payload READs at "
                              "once (BUSY beyond)",
                              rule(lambda v, cfg: v << 20 >= cfg.max_block_kib << 10,
                                   lambda cfg: f"must hold at least one max block ({cfg.max_block_kib} KiB)"))
    fetch_pool_share: float = key(0.5, "fraction", "most of the pool all connections together may hold awaiting "
                                  "payload READs (BUSY beyond; an equal share each when more than half is taken): "
                                  "the rest stays for reads, answers and forwards", fraction())
    payload_timeout: float = key(5.0, "seconds", "how long a client may take to serve the one-sided READ of its "
                                 "WRITE's payload (or a request body): beyond, the request fails PAYLOAD_TIMEOUT, "
                                 "its pool block is freed and its connection dropped (a node's forwards: "
                                 "peer_timeout)", positive())
    peer_timeout: float = key(10.0, "seconds", "how long a peer may take to serve a one-sided op before its request "
                              "fails and its connection is dropped", positive())


@dataclasses.dataclass
class StoreConfig:
    """the extent store (datanode/store/): durability, opening, the disk"""
    sync: SyncMode = key(SyncMode.ALWAYS, "|".join(SyncMode),
                         "always: fdatasync before every ack; none: page cache only (survives a killed "
                         "process, not a power cut)")
    open_verify: str = key("tail", "tail|full", "at start, CRC-check only each extent's tail (scrub checks the rest "
                           "soon after) or every block before serving", one_of("tail", "full"))
    one_flush: bool = key(True, "bool", "a durable flush takes one fdatasync where that is safe (sync_file_range "
                          "first); false: always two, data then CRCs")
    free_step_bytes: int = key(8 << 20, "bytes", "a deleted extent or a big truncate is freed this much per fsync, "
                               "so a disk mounted with online discard does not stall its other writers (0: at once)",
                               at_least(0, "must be >= 0 bytes (0: off)"))
    prefill_bytes: int = key(256 << 10, "bytes", "sync=always: a small append zero-fills the data file this far "
                             "ahead, so the appends after it do not grow the file (0: off)",
                             at_least(0, "must be >= 0 bytes (0: off)"))
    direct_reads: bool = key(True, "bool", "big aligned reads of bytes not in the page cache use O_DIRECT (false: "
                             "the page cache)")
    direct_writes: bool = key(True, "bool", "big aligned appends use O_DIRECT (false: the page cache)")
    lean_appends: bool = key(True, "bool", "which path serves a plain inline append on TCP -- a client's to a "
                             "partition whose only replica is this node, a leader's forward to a follower here: "
                             "true, the connection's data-plane thread (CRC, pwrite, a flush shared with the "
                             "appends queued meanwhile; datanode/ops/lean.py); false, the WRITE handler's task like "
                             "every other append")


@dataclasses.dataclass
class ReplicationConfig:
    """replication: a leader's forwards to its followers"""
    replica_timeout: float = key(5.0, "seconds", "how long a leader waits for a follower's ack before failing the "
                                 "write", positive("must be > 0 seconds"))


@dataclasses.dataclass
class RepairConfig:
    """replica health, repair and scrub (datanode/health.py, repair.py, scrub.py)"""
    heartbeat_s: float = key(1.0, "seconds", "how often a leader probes each follower", positive())
    repair_interval_s: float = key(60.0, "seconds", "a full repair pass (sizes and block CRCs) at least this often",
                                   positive())
    repair_mib_s: float = key(64.0, "MiB/s", "repair bandwidth cap per node (0: unlimited)",
                              at_least(0, "must be >= 0 (0: unlimited / off)"))
    repair_chunk_kib: int = key(1024, "KiB", "bytes moved per repair write (one extent-lane turn each)",
                                power_of_two(4, 65536, "capped at max_block_kib"))
    scrub_interval_s: float = key(3600.0, "seconds", "background scrub pass this often (0: only on demand)",
                                  at_least(0, "must be >= 0 (0: unlimited / off)"))
    scrub_mib_s: float = key(32.0, "MiB/s", "scrub read rate cap per node (0: unlimited)",
                             at_least(0, "must be >= 0 (0: unlimited / off)"))


@dataclasses.dataclass
class TrustConfig:
    """trust boundaries: the cluster secret and TLS (docs/security.md)"""
    secret_file: str = key("", "path", "the cluster secret (datanode gen-secret); empty: no authentication, peers "
                           "on this host only (unless insecure), warned at start",
                           a_file("no such file (make one with: datanode gen-secret > FILE)"), env=False)
    insecure: bool = key(False, "bool", "without secret_file: also take peers from other hosts, unauthenticated -- "
                         "anyone who reaches the port can then read, write and delete (false: loopback peers only)")
    auth_transition: bool = key(False, "bool", "while switching a running cluster to secret_file: also take peers "
                                "without the secret (loopback only unless insecure) and talk to nodes without one; "
                                "turn it off once every node and client has the secret (docs/security.md)",
                                rule(lambda v, cfg: not v or bool(cfg.secret_file),
                                     "is for switching to a secret: set secret_file too"))
    tls_cert: str = key("", "path", "PEM certificate (chain) presented to TLS clients; names the node's listen "
                        "IP/host", (with_key("tls_key", "tls_cert and tls_key go together"), a_file()))
    tls_key: str = key("", "path", "the certificate's private key (PEM)",
                       (with_key("tls_cert", "tls_cert and tls_key go together"), a_file()))
    tls_ca: str = key("", "path", "CA bundle to verify other nodes' certificates; set: node-to-node links use TLS",
                      a_file(), env=False)
    tls_required: bool = key(False, "bool", "refuse plaintext connections (clients must dial with TLS)",
                             rule(lambda v, cfg: not v or bool(cfg.tls_cert), "needs tls_cert and tls_key"))


@dataclasses.dataclass
class AdmissionConfig:
    """admission: which connections and requests the node takes, and how many (docs/security.md)"""
    hello_timeout: float = key(5.0, "seconds", "how long a new connection may take to complete its "
                               "(authenticated) hello", positive())
    preauth_max: int = key(64, "count", "connections still in their hello at once, all hosts (0: no limit); at the "
                           "limit a new one from a quieter address takes the place of the oldest of the busiest "
                           "address", at_least(0, "must be >= 0 (0: no limit)"))
    preauth_per_host: int = key(8, "count", "connections still in their hello from one address; a new one takes the "
                                "place of the oldest that has not sent its whole hello, else of the oldest (0: no "
                                "limit)", at_least(0, "must be >= 0 (0: no limit)"))
    preauth_early_drop: int = key(32, "count", "from this many connections in their hello, a new one from an "
                                  "address that has one pending is dropped at random, 30% rising to 100% at "
                                  "preauth_max (sshd's MaxStartups)", (
                                      at_least(0, "must be >= 0 (0: no limit)"),
                                      rule(lambda v, cfg: not cfg.preauth_max or 0 < v <= cfg.preauth_max,
                                           lambda cfg: f"must be between 1 and preauth_max ({cfg.preauth_max})")))
    max_connections: int = key(1024, "count", "connections past their hello at once; a new one takes the place of "
                               "the least recently active idle client connection, or is refused with 'too many "
                               "connections' (those in their hello count against preauth_max instead)",
                               at_least(1, "must be >= 1"))
    reserved_connections: int = key(32, "count", "of max_connections, this many are kept for datanodes (role node) "
                                    "and admins: client-role connections are refused beyond max_connections minus "
                                    "these (at most half of max_connections is kept), so clients cannot lock "
                                    "replication and admins out",
                                    at_least(0, "must be >= 0 (0: none kept for nodes and admins)"))
    max_connections_per_host: int = key(0, "count", "client-role connections from one host at once; more are "
                                        "refused with 'too many connections' (0: no per-host limit; mind NAT and "
                                        "loopback)", at_least(0, "must be >= 0 (0: no per-host limit)"))
    idle_timeout_s: float = key(600.0, "seconds", "a connection with nothing in flight this long is closed (0: "
                                "never)", at_least(0, "must be >= 0 seconds (0: never)"))
    idle_max: int = key(128, "count", "idle client connections (nothing in flight; an authenticated one past "
                        "hello_timeout since its hello) kept at once; beyond, the least recently active are closed "
                        "(0: no limit)", at_least(0, "must be >= 0 (0: no limit)"))
    idle_per_host: int = key(32, "count", "idle client connections kept from one host; beyond, its least recently "
                             "active are closed (0: no limit)", at_least(0, "must be >= 0 (0: no limit)"))
    max_inflight: int = key(0, "count", "requests one connection may have in flight; more are answered BUSY at once "
                            "(0: the same as slots)", at_least(0, "must be >= 0 (0: the same as slots)"))
    penalty_max_s: float = key(2.0, "seconds", "after a peer is dropped for abuse (payload not served, answers not "
                               "read, slots overrun), new connections of its host and role (a node: its identity) "
                               "wait 0.05s after their hello, doubling per offence up to this (0: never)",
                               at_least(0, "must be >= 0 seconds (0: no penalty)"))


@dataclasses.dataclass
class ClusterConfig:
    """the cluster map in etcd (wire/etcdmap.py), this node's registration, its drain; empty etcd: no etcd,
    the map is what admins set"""
    etcd: str = key("", "URL,URL...", "etcd endpoints holding the cluster map (empty: no etcd; views set by admins)",
                    _parsed(_etcd_urls))
    etcd_prefix: str = key("/datanode", "key", "prefix of every etcd key of this cluster",
                           rule(lambda v, _: v.startswith("/") and v.strip("/") != "",
                                "must be an absolute key prefix such as /datanode"))
    etcd_credentials: str = key("", "path", "file holding USER:PASSWORD of this node's etcd user (role datanode; "
                                "dnctl cluster up makes DIR/etcd-auth/datanode); empty: etcd has no authentication",
                                _parsed(_etcd_user), env=False)
    etcd_ca: str = key("", "path", "CA bundle (PEM) to check the etcd members' certificates with (https:// URLs)",
                       a_file(), env=False)
    etcd_cert: str = key("", "path", "client certificate (PEM) presented to etcd members that require one",
                         (with_key("etcd_key", "etcd_cert and etcd_key go together"), a_file()), env=False)
    etcd_key: str = key("", "path", "the client certificate's private key (PEM)",
                        (with_key("etcd_cert", "etcd_cert and etcd_key go together"), a_file()), env=False)
    lease_ttl_s: int = key(3, "seconds", "registration lease in etcd: a dead node is noticed this long after it "
                           "dies", between(2, 3600, "seconds", "etcd's smallest lease is about 2 s"))
    zone: str = key("default", "label", "failure domain: the manager spreads replicas across zones",
                    rule(lambda v, _: bool(v) and "/" not in v, "must be a non-empty label without '/'"))
    drain_timeout_s: float = key(30.0, "seconds", "SIGTERM or `dnctl node drain`: how long the node waits for the "
                                 "manager to move its partitions to other replicas and for its requests to finish "
                                 "before it stops anyway (saying what was left)", between(1, 3600, "seconds"))


@dataclasses.dataclass
class MetricsConfig:
    """metrics"""
    metrics_listen: str = key("", "HOST:PORT", "where Prometheus /metrics is served (empty: off)",
                              host_port("expected HOST:PORT (e.g. 127.0.0.1:9310), or empty for no metrics",
                                        empty_ok=True))


S = TypeVar("S")
SECTIONS = (NodeConfig, TransportConfig, MemoryConfig, StoreConfig, ReplicationConfig, RepairConfig, TrustConfig,
            AdmissionConfig, ClusterConfig, MetricsConfig)


# A dataclass lists its bases' fields from the last base to the first: SECTIONS' order, reversed.
@dataclasses.dataclass
class Config(MetricsConfig, ClusterConfig, AdmissionConfig, TrustConfig, RepairConfig, ReplicationConfig,
             StoreConfig, MemoryConfig, TransportConfig, NodeConfig):
    """Every key of every section: what node.toml sets."""

    # where each key's value came from (``load`` notes it; print-config shows it); not a key itself
    origin: ClassVar[Mapping[str, str]] = MappingProxyType({})


def section(cfg: Config, cls: type[S]) -> S:
    """``cfg``'s keys of section ``cls``, as that section alone: what a component that needs no other is given."""
    return cls(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cls)})


def sections() -> Iterator[tuple[type, list[dataclasses.Field]]]:
    """Each section and its keys, in order."""
    for s in SECTIONS:
        yield s, [f for f in dataclasses.fields(s)]


def _info(f: dataclasses.Field) -> KeyInfo:
    return f.metadata["key"]


def _check(cfg: Config) -> Config:
    def bad(key, why):
        src = cfg.origin.get(key, "")
        raise ConfigError(f"config key '{key}': {why} (got {getattr(cfg, key)!r}"
                          + (f", from {src})" if src.startswith("env") else ")"))

    for f in dataclasses.fields(Config):
        kind = _ENUMS.get(f.type)
        if kind is not None:
            try:
                setattr(cfg, f.name, kind(getattr(cfg, f.name)))
            except ValueError:
                bad(f.name, "must be " + " or ".join(f"'{m.value}'" for m in kind))
        for check in _info(f).checks:
            why = check(getattr(cfg, f.name), cfg)
            if why is not None:
                bad(f.name, why)
    return cfg


def check_host(cfg: Config) -> Config:
    """Check the config against this machine before serving: ``data_dir`` is (or can be made) a
    writable directory, and ``pool_mib`` fits in the memory available now.  ConfigError names the key."""
    d = pathlib.Path(cfg.data_dir)
    if d.exists() and not d.is_dir():
        raise ConfigError(f"config key 'data_dir': {cfg.data_dir} exists and is not a directory")
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"config key 'data_dir': cannot create {cfg.data_dir}: {e.strerror or e}") from None
    if not os.access(d, os.W_OK | os.X_OK):
        raise ConfigError(f"config key 'data_dir': {cfg.data_dir} is not writable")
    avail = _mem_available()
    if avail is not None and cfg.pool_mib << 20 > avail:
        raise ConfigError(f"config key 'pool_mib': {cfg.pool_mib} MiB is more memory than this machine has "
                          f"available ({avail >> 20} MiB); lower it")
    return cfg


def _mem_available() -> int | None:
    """Bytes of memory available for a new allocation (MemAvailable), or None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def transport_options(cfg: TransportConfig) -> TransportOptions:
    """The node's connection settings for ``connect.make_domain``: Config has a key for each field."""
    return TransportOptions(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(TransportOptions)})


def etcd_access(cfg: ClusterConfig):
    """The node's etcd user and client TLS (``wire.etcdmap.EtcdAccess``) from its etcd_* keys."""
    from wire.etcdmap import EtcdAccess
    return EtcdAccess.load(cfg.etcd_credentials, cfg.etcd_ca, cfg.etcd_cert, cfg.etcd_key)


def from_dict(d: dict, source: str = "config", origin: Mapping[str, str] | None = None) -> Config:
    """A checked Config of ``d``'s keys (TOML-typed values); ``origin``: where each came from."""
    fields = {f.name: f for f in dataclasses.fields(Config)}
    kwargs = {}
    for key, value in d.items():
        if key not in fields:
            raise ConfigError(f"{source}: unknown key '{key}' (known: {', '.join(sorted(fields))})")
        want = fields[key].type
        ok = {"str": isinstance(value, str), "bool": isinstance(value, bool),
              "int": isinstance(value, int) and not isinstance(value, bool),
              "float": isinstance(value, (int, float)) and not isinstance(value, bool)}.get(
                  want, isinstance(value, str) and want in _ENUMS)
        if not ok:
            raise ConfigError(f"config key '{key}': expected {want}, got {value!r}")
        kwargs[key] = float(value) if want == "float" else value
    cfg = Config(**kwargs)
    cfg.origin = MappingProxyType(dict(origin or {}))
    return _check(cfg)


def load(path: str | pathlib.Path | None, environ: Mapping[str, str] | None = None, **overrides) -> Config:
    """The node's config: defaults, then the file at ``path`` (None: none), then $DATANODE_<KEY> of
    ``environ`` (the daemon passes os.environ; None: none), then ``overrides`` (the command line; a None
    value is not given).  The Config's ``origin`` says where each key that is not its default came from."""
    d: dict = {}
    if path is not None:
        p = pathlib.Path(path)
        try:
            d = tomllib.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {p} does not exist") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {p}: {e}") from None
    origin = dict.fromkeys(d, f"file {path}")
    try:
        env = env_values({f.name: f.type for f in dataclasses.fields(Config) if _info(f).env}, environ or {})
    except ValueError as e:
        raise ConfigError(f"environment: {e}") from None
    given = {k: v for k, v in overrides.items() if v is not None}
    origin.update({k: f"env {ENV_PREFIX}{k.upper()}" for k in env})
    origin.update(dict.fromkeys(given, "command line"))
    return from_dict({**d, **env, **given}, str(path or "config"), origin)


def _toml_value(v) -> str:
    return f'"{v}"' if isinstance(v, str) else str(v).lower() if isinstance(v, bool) else str(v)


def _title(section: type) -> str:
    return " ".join((section.__doc__ or "").split())


def to_toml(cfg: Config, annotate: bool = False) -> str:
    """The config as TOML; with ``annotate`` each section opens with a comment saying what it tunes, and each
    key is followed by a comment: its unit, where its value came from (default, file, env, command line) and
    its meaning."""
    lines = []
    for section, fields in sections():
        if annotate:
            lines += [""] if lines else []
            lines.append(f"# -- {_title(section)} --")
        for f in fields:
            line = f"{f.name} = {_toml_value(getattr(cfg, f.name))}"
            if annotate:
                info = _info(f)
                line = f"{line:30} # [{info.unit}] ({cfg.origin.get(f.name, 'default')}) {info.help}"
            lines.append(line)
    return "\n".join(lines) + "\n"


def markdown() -> str:
    """The key table of docs/operations.md: per section, each key's default, unit and meaning."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|")
    out = []
    for section, fields in sections():
        out += [f"**{cell(_title(section))}** (`{section.__name__}`)", "",
                "| key | default | unit | meaning |", "| --- | --- | --- | --- |"]
        for f in fields:
            info = _info(f)
            default = _toml_value(f.default)
            out.append(f"| `{f.name}` | `{cell(default)}` | {cell(info.unit)} | {cell(info.help)}"
                       + ("" if info.env else " (not from the environment)") + " |")
        out.append("")
    return "\n".join(out)


DOCS_BEGIN = ("<!-- node.toml keys: made by `python -m datanode.config --markdown` "
              "(tests/test_node_config.py checks) -->")
DOCS_END = "<!-- end of node.toml keys -->"


def with_table(doc: str) -> str:
    """``doc`` (docs/operations.md) with the key table between its DOCS_BEGIN and DOCS_END lines made anew."""
    begin, end = doc.index(DOCS_BEGIN) + len(DOCS_BEGIN) + 1, doc.index(DOCS_END)
    return doc[:begin] + markdown() + doc[end:]


if __name__ == "__main__":
    args = sys.argv[1:]
    if args == ["--markdown"]:
        print(markdown(), end="")
    elif len(args) == 2 and args[0] == "--write":
        path = pathlib.Path(args[1])
        path.write_text(with_table(path.read_text()))
    else:
        sys.exit("usage: python -m datanode.config --markdown        print the node.toml key table\n"
                 "       python -m datanode.config --write FILE.md   make it anew in FILE.md (docs/operations.md)")
