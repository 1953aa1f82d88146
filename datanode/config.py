"""node.toml: every key has a default; a bad value is an error that names the key.

A key's value comes from, the later winning: its default; the file (``datanode serve --config node.toml``);
the environment, $DATANODE_<KEY> (``DATANODE_VERBS_INLINE=0`` sets ``verbs_inline``; booleans 1/0, true/false,
yes/no, on/off; other DATANODE_* variables are ignored), read once by ``load`` when the daemon starts; the
command line (``serve --listen ...``).  ``datanode print-config`` shows each key's value and where it came from.
Not from the environment: ``secret_file`` and ``tls_ca``, whose variables are a client's (dnctl, the SDK):
a node started from an admin's shell must not take them up.
The connection keys (tcp_congestion, rdma_*, gid_index, verbs_*, trace) reach the transport as the
TransportOptions of the same names (``transport_options``).
"""
from __future__ import annotations

import dataclasses
import enum
import os
import pathlib
import tomllib
from types import MappingProxyType
from typing import ClassVar, Mapping

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
# their $DATANODE_ variables are a client's (module docstring)
_NOT_FROM_ENV = ("secret_file", "tls_ca", "etcd_credentials", "etcd_ca", "etcd_cert", "etcd_key")


@dataclasses.dataclass
class Config:
    listen: str = "127.0.0.1:17310"
    data_dir: str = "./data"
    pool_mib: int = 256            # registered pool arena
    max_block_kib: int = 4096      # largest pool block (and so the largest single request payload)
    sync: SyncMode = SyncMode.ALWAYS                  # always: fdatasync before every ack | none: page cache only
    transport: TransportChoice = TransportChoice.AUTO  # auto | verbs | tcp
    rdma_device: str = _WIRE.rdma_device  # e.g. "rxe0"; empty: first active device (only when transport != tcp)
    gid_index: int = _WIRE.gid_index      # GID table index of the RDMA port (RoCE v2 is usually 1)
    replica_timeout: float = 5.0   # seconds a follower may take to ack a forwarded write
    pool_wait: float = 10.0        # seconds a request may wait for pool memory before POOL_BUSY
    peer_timeout: float = 10.0     # seconds a peer may take to serve a one-sided op (else its connection is dropped)
    slots: int = 64                # preposted control slots per connection
    log_level: str = "info"
    cpu_sched: str = "batch"       # the node's Linux CPU scheduling policy: batch (SCHED_BATCH) | normal
    metrics_listen: str = ""       # HOST:PORT serving Prometheus /metrics (empty: off)
    # -- connection tuning (wire/transport: TransportOptions, whose fields have these names) --
    tcp_congestion: str = _WIRE.tcp_congestion  # cubic: a LAN gains nothing from BBR's pacing of each flow
    rdma_windows: bool = _WIRE.rdma_windows     # a peer reaches only the range a request granted it
    verbs_inline: int = _WIRE.verbs_inline      # bytes of a WRITE's payload sent in its header's SEND (0: off)
    verbs_spin_us: int = _WIRE.verbs_spin_us    # busy-poll the CQ after a completion (0: off; for hardware)
    verbs_unsignaled: bool = _WIRE.verbs_unsignaled  # no completions for header SENDs and binds (for hardware)
    verbs_post_thread_min: int = _WIRE.verbs_post_thread_min  # one-sided ops this large posted off the GIL
    verbs_posters: int = _WIRE.verbs_posters    # threads posting them
    trace: str = _WIRE.trace       # directory for each request's step times, written at exit (empty: off)
    # -- replica health, repair and scrub (datanode/repair.py) --
    heartbeat_s: float = 1.0       # how often a leader probes each follower
    repair_interval_s: float = 60.0  # a full repair pass (sizes and block CRCs) at least this often
    repair_mib_s: float = 64.0     # repair bandwidth cap per node, MiB/s (0: unlimited)
    repair_chunk_kib: int = 1024   # bytes moved per repair write (one extent-lane turn each)
    scrub_interval_s: float = 3600.0  # background scrub pass this often (0: only on demand)
    scrub_mib_s: float = 32.0      # scrub read rate cap per node, MiB/s (0: unlimited)
    # -- trust boundaries (docs/security.md) --
    secret_file: str = ""          # the cluster secret (datanode gen-secret); empty: no auth, loopback peers only
    insecure: bool = False         # without a secret, take peers from other hosts too (else loopback only)
    auth_transition: bool = False  # with a secret: also take peers without one (switching a running cluster)
    hello_timeout: float = 5.0     # seconds a new connection may take to complete its hello
    preauth_max: int = 64          # connections still in their hello at once (all hosts): never others' slots
    preauth_per_host: int = 8      # of those, from one address
    preauth_early_drop: int = 32   # from this many in their hello, new ones are dropped at random (sshd MaxStartups)
    max_connections: int = 1024    # connections past their hello at once; idle clients make room, else refused
    reserved_connections: int = 32  # of max_connections, kept for role node and admin (clients never take them)
    max_connections_per_host: int = 0   # client-role connections from one host at once (0: no per-host limit)
    idle_timeout_s: float = 600.0  # a connection with nothing in flight for this long is closed (0: never)
    idle_max: int = 128            # idle client connections kept (memory); the least active go (0: no limit)
    idle_per_host: int = 32        # of those, from one host (0: no limit)
    conn_pool_share: float = 0.5   # most of the pool one connection's requests may hold (fraction)
    payload_timeout: float = 5.0   # seconds a client may take to serve its payload READ (else PAYLOAD_TIMEOUT)
    conn_fetch_mib: int = 32       # MiB of pool one connection's requests may hold awaiting their payload READs
    fetch_pool_share: float = 0.5  # most of the pool all blocks awaiting a payload READ may hold (fraction)
    max_inflight: int = 0          # requests one connection may have in flight; more are answered BUSY (0: = slots)
    penalty_max_s: float = 2.0     # a host+role (node: +identity) whose peer was dropped for abuse: its new connections wait (0: never)
    trash_retention_s: float = 86400.0   # a deleted/removed partition's data is kept in data_dir/trash this long
    audit_log: str = ""            # admin actions, one JSON line each (empty: data_dir/audit.log)
    tls_cert: str = ""             # PEM certificate (chain) this node presents to TLS clients (empty: no TLS)
    tls_key: str = ""              # its private key (PEM)
    tls_ca: str = ""               # CA bundle (PEM) to verify other nodes with; set: this node dials them with TLS
    tls_required: bool = False     # refuse plaintext connections (needs tls_cert)
    # -- cluster map in etcd (wire/etcdmap.py); empty etcd: no etcd, the map is what admins set --
    etcd: str = ""                 # e.g. "http://127.0.0.1:2379" or "http://a:2379,http://b:2379"
    etcd_prefix: str = "/datanode"  # every key of this cluster lives under it
    etcd_credentials: str = ""     # file holding USER:PASSWORD, this node's etcd user (empty: etcd without auth)
    etcd_ca: str = ""              # CA bundle (PEM) the etcd members' certificates are checked against (https://)
    etcd_cert: str = ""            # client certificate (PEM) presented to etcd, where it requires one
    etcd_key: str = ""             # its private key (PEM)
    lease_ttl_s: int = 3           # registration lease: etcd forgets a dead node this long after its death
    zone: str = "default"          # failure-domain label: the manager spreads replicas across zones
    drain_timeout_s: float = 30.0  # a stopping node's bound on handing its partitions off and finishing requests
    # -- opening the partitions at start --
    open_verify: str = "tail"      # tail: at open, CRC-check only what crash recovery needs (each extent's
                                   # tail); a leader scrubs soon after start (unless scrub_interval_s = 0) |
                                   # full: CRC-check every block before serving (slow: reads all data)
    # -- the extent store (datanode/store/) --
    one_flush: bool = True         # one fdatasync per durable flush where safe; false: two, to compare or rule it out
    free_step_bytes: int = 8 << 20  # smaller if deletes stall other writers on a discard-mounted disk (0: at once)
    prefill_bytes: int = 256 << 10  # zeros ahead, so small durable appends do not grow the file (0: off, to compare)
    direct_reads: bool = True      # false if big cold reads are read again soon (they then stay in the page cache)
    direct_writes: bool = True     # false on a file system whose O_DIRECT is slow (appends then use the page cache)
    # -- the write path (datanode/ops/append.py; its common case: datanode/ops/lean.py) --
    lean_appends: bool = True      # plain inline appends (unreplicated; followers'): the connection's thread

    # where each key's value came from (``load`` notes it; print-config shows it); not a key itself
    origin: ClassVar[Mapping[str, str]] = MappingProxyType({})

    @property
    def host(self) -> str:
        return self.listen.rsplit(":", 1)[0]

    @property
    def port(self) -> int:
        return int(self.listen.rsplit(":", 1)[1])


def _check(cfg: Config) -> Config:
    def bad(key, why):
        src = cfg.origin.get(key, "")
        raise ConfigError(f"config key '{key}': {why} (got {getattr(cfg, key)!r}"
                          + (f", from {src})" if src.startswith("env") else ")"))

    host, sep, port = cfg.listen.rpartition(":")
    if not sep or not host or not port.isdigit() or not (0 <= int(port) <= 65535):
        bad("listen", "expected HOST:PORT, e.g. 127.0.0.1:17310")
    if not cfg.data_dir:
        bad("data_dir", "must be a directory path")
    if cfg.metrics_listen:
        mh, msep, mport = cfg.metrics_listen.rpartition(":")
        if not msep or not mh or not mport.isdigit() or not (0 <= int(mport) <= 65535):
            bad("metrics_listen", "expected HOST:PORT (e.g. 127.0.0.1:9310), or empty for no metrics")
    if not (1 <= cfg.pool_mib <= 64 * 1024):
        bad("pool_mib", "must be between 1 and 65536")
    kib = cfg.max_block_kib
    if kib < 4 or kib & (kib - 1) or kib * 1024 > 64 << 20:
        bad("max_block_kib", "must be a power of two between 4 and 65536")
    if (cfg.pool_mib * 1024) % kib:
        bad("max_block_kib", f"pool_mib ({cfg.pool_mib} MiB) must be a multiple of the max block")
    for key, kind in (("sync", SyncMode), ("transport", TransportChoice)):
        try:
            setattr(cfg, key, kind(getattr(cfg, key)))
        except ValueError:
            bad(key, "must be " + " or ".join(f"'{m.value}'" for m in kind))
    try:
        transport_options(cfg)
    except OptionError as e:
        bad(e.key, e.why)
    if cfg.replica_timeout <= 0:
        bad("replica_timeout", "must be > 0 seconds")
    if cfg.secret_file and not pathlib.Path(cfg.secret_file).is_file():
        bad("secret_file", "no such file (make one with: datanode gen-secret > FILE)")
    if cfg.hello_timeout <= 0 or cfg.max_connections < 1 or cfg.idle_timeout_s < 0:
        bad("hello_timeout" if cfg.hello_timeout <= 0 else "max_connections" if cfg.max_connections < 1
            else "idle_timeout_s", "must be > 0 (idle_timeout_s: >= 0, 0 = never)")
    if bool(cfg.tls_cert) != bool(cfg.tls_key):
        bad("tls_cert" if not cfg.tls_cert else "tls_key", "tls_cert and tls_key go together")
    for key in ("tls_cert", "tls_key", "tls_ca", "etcd_ca", "etcd_cert", "etcd_key"):
        if getattr(cfg, key) and not pathlib.Path(getattr(cfg, key)).is_file():
            bad(key, "no such file")
    if cfg.tls_required and not cfg.tls_cert:
        bad("tls_required", "needs tls_cert and tls_key")
    for key in ("preauth_max", "preauth_per_host", "preauth_early_drop", "idle_max", "idle_per_host"):
        if getattr(cfg, key) < 0:
            bad(key, "must be >= 0 (0: no limit)")
    if cfg.preauth_max and not 0 < cfg.preauth_early_drop <= cfg.preauth_max:
        bad("preauth_early_drop", f"must be between 1 and preauth_max ({cfg.preauth_max})")
    if cfg.auth_transition and not cfg.secret_file:
        bad("auth_transition", "is for switching to a secret: set secret_file too")
    if cfg.reserved_connections < 0:
        bad("reserved_connections", "must be >= 0 (0: none kept for nodes and admins)")
    if cfg.max_connections_per_host < 0:
        bad("max_connections_per_host", "must be >= 0 (0: no per-host limit)")
    if cfg.penalty_max_s < 0:
        bad("penalty_max_s", "must be >= 0 seconds (0: no penalty)")
    if cfg.max_inflight < 0:
        bad("max_inflight", "must be >= 0 (0: the same as slots)")
    if not 0 < cfg.conn_pool_share <= 1:
        bad("conn_pool_share", "must be in (0, 1]")
    if not 0 < cfg.fetch_pool_share <= 1:
        bad("fetch_pool_share", "must be in (0, 1]")
    if cfg.conn_fetch_mib << 20 < cfg.max_block_kib << 10:
        bad("conn_fetch_mib", f"must hold at least one max block ({cfg.max_block_kib} KiB)")
    if cfg.trash_retention_s < 0:
        bad("trash_retention_s", "must be >= 0 seconds (0: purge at once)")
    for key in ("pool_wait", "peer_timeout", "payload_timeout"):
        if getattr(cfg, key) <= 0:
            bad(key, "must be > 0 seconds")
    if not (1 <= cfg.slots <= 4096):
        bad("slots", "must be between 1 and 4096")
    for key in ("heartbeat_s", "repair_interval_s"):
        if getattr(cfg, key) <= 0:
            bad(key, "must be > 0 seconds")
    for key in ("repair_mib_s", "scrub_mib_s", "scrub_interval_s"):
        if getattr(cfg, key) < 0:
            bad(key, "must be >= 0 (0: unlimited / off)")
    rk = cfg.repair_chunk_kib
    if rk < 4 or rk & (rk - 1) or rk > 65536:
        bad("repair_chunk_kib", "must be a power of two between 4 and 65536 (capped at max_block_kib)")
    for key in ("free_step_bytes", "prefill_bytes"):
        if getattr(cfg, key) < 0:
            bad(key, "must be >= 0 bytes (0: off)")
    if cfg.open_verify not in ("tail", "full"):
        bad("open_verify", "must be 'tail' or 'full'")
    if cfg.etcd:
        from wire.etcdmap import parse_urls
        try:
            parse_urls(cfg.etcd)
        except ValueError as e:
            bad("etcd", str(e))
    if cfg.etcd_credentials:
        from wire.etcdmap import EtcdAccess
        try:
            EtcdAccess.load(cfg.etcd_credentials)
        except ValueError as e:
            bad("etcd_credentials", str(e))
    if bool(cfg.etcd_cert) != bool(cfg.etcd_key):
        bad("etcd_cert" if not cfg.etcd_cert else "etcd_key", "etcd_cert and etcd_key go together")
    if not cfg.etcd_prefix.startswith("/") or cfg.etcd_prefix.strip("/") == "":
        bad("etcd_prefix", "must be an absolute key prefix such as /datanode")
    if not (2 <= cfg.lease_ttl_s <= 3600):
        bad("lease_ttl_s", "must be between 2 and 3600 seconds (etcd's smallest lease is about 2 s)")
    if not 1 <= cfg.drain_timeout_s <= 3600:
        bad("drain_timeout_s", "must be between 1 and 3600 seconds")
    if not cfg.zone or "/" in cfg.zone:
        bad("zone", "must be a non-empty label without '/'")
    if cfg.cpu_sched not in ("batch", "normal"):
        bad("cpu_sched", "must be 'batch' or 'normal'")
    if cfg.log_level.lower() not in ("debug", "info", "warning", "error"):
        bad("log_level", "must be debug, info, warning or error")
    return cfg


# Every key's unit and one-line meaning: `datanode print-config` prints them beside the values.
KEY_HELP: dict[str, tuple[str, str]] = {
    "listen": ("HOST:PORT", "address the node serves on; also its name in partitions' replica lists"),
    "data_dir": ("path", "directory holding the partitions (created if missing)"),
    "pool_mib": ("MiB", "registered memory pool (buddy allocator) for request payloads"),
    "max_block_kib": ("KiB", "largest pool block, so the largest single request payload"),
    "sync": ("|".join(SyncMode), "always: fdatasync before every ack; none: page cache only (not durable)"),
    "transport": ("|".join(TransportChoice), "data path; auto uses RDMA verbs if a device works, else TCP"),
    "rdma_device": ("name", "RDMA device, e.g. rxe0; empty: the first active one"),
    "gid_index": ("index", "GID table index of the RDMA port (RoCE v2 is usually 1)"),
    "tcp_congestion": ("name", "TCP congestion control of every connection (\"\": the system's); cubic, because BBR "
                               "paces each flow itself and sends a large payload in many small pieces"),
    "rdma_windows": ("bool", "verbs: a type-2 memory window per request, so a peer reaches only the range it was "
                             "granted (false, or a device without them: the region's rkey reaches all of it)"),
    "verbs_inline": ("bytes", "verbs: a WRITE payload this small goes in its header's SEND, saving the READ "
                              "round trip (0: off)"),
    "verbs_spin_us": ("us", "verbs: busy-poll the completion queue this long after the last completion (0: off; "
                            "spinning takes CPU a software device such as rxe needs)"),
    "verbs_unsignaled": ("bool", "verbs: no completions for header SENDs and window binds (may pay on hardware)"),
    "verbs_post_thread_min": ("bytes", "verbs: one-sided ops this large are posted from a thread without the GIL "
                                       "(software devices move the bytes inside the post); -1: 64 KiB on "
                                       "software devices, never on hardware; 0: never"),
    "verbs_posters": ("count", "threads posting those ops"),
    "trace": ("path", "directory where each request's step times go at exit (wire/trace.py, "
                      "bench/write_timeline.py); empty: off"),
    "replica_timeout": ("seconds", "how long a leader waits for a follower's ack before failing the write"),
    "pool_wait": ("seconds", "how long a request may wait for pool memory before POOL_BUSY"),
    "peer_timeout": ("seconds", "how long a peer may take to serve a one-sided op before its request fails "
                                "and its connection is dropped"),
    "metrics_listen": ("HOST:PORT", "where Prometheus /metrics is served (empty: off)"),
    "etcd": ("URL,URL...", "etcd endpoints holding the cluster map (empty: no etcd; views set by admins)"),
    "etcd_prefix": ("key", "prefix of every etcd key of this cluster"),
    "etcd_credentials": ("path", "file holding USER:PASSWORD of this node's etcd user (role datanode; dnctl "
                                 "cluster up makes DIR/etcd-auth/datanode); empty: etcd has no authentication"),
    "etcd_ca": ("path", "CA bundle (PEM) to check the etcd members' certificates with (https:// URLs)"),
    "etcd_cert": ("path", "client certificate (PEM) presented to etcd members that require one"),
    "etcd_key": ("path", "the client certificate's private key (PEM)"),
    "lease_ttl_s": ("seconds", "registration lease in etcd: a dead node is noticed this long after it dies"),
    "zone": ("label", "failure domain: the manager spreads replicas across zones"),
    "drain_timeout_s": ("seconds", "SIGTERM or `dnctl node drain`: how long the node waits for the manager to move "
                                   "its partitions to other replicas and for its requests to finish before it "
                                   "stops anyway (saying what was left)"),
    "open_verify": ("tail|full", "at start, CRC-check only each extent's tail (scrub checks the rest soon "
                                 "after) or every block before serving"),
    "one_flush": ("bool", "a durable flush takes one fdatasync where that is safe (sync_file_range first); "
                          "false: always two, data then CRCs"),
    "free_step_bytes": ("bytes", "a deleted extent or a big truncate is freed this much per fsync, so a disk "
                                 "mounted with online discard does not stall its other writers (0: at once)"),
    "prefill_bytes": ("bytes", "sync=always: a small append zero-fills the data file this far ahead, so the "
                               "appends after it do not grow the file (0: off)"),
    "lean_appends": ("bool", "which path serves a plain inline append on TCP -- a client's to a partition whose "
                             "only replica is this node, a leader's forward to a follower here: true, the "
                             "connection's data-plane thread (CRC, pwrite, a flush shared with the appends "
                             "queued meanwhile; datanode/ops/lean.py); false, the WRITE handler's task like "
                             "every other append"),
    "direct_reads": ("bool", "big aligned reads of bytes not in the page cache use O_DIRECT (false: the page cache)"),
    "direct_writes": ("bool", "big aligned appends use O_DIRECT (false: the page cache)"),
    "slots": ("count", "preposted control slots per connection (requests in flight per connection)"),
    "log_level": ("level", "debug, info, warning or error"),
    "cpu_sched": ("batch|normal", "Linux CPU scheduling policy of the node's threads; batch (SCHED_BATCH): a "
                                  "woken node does not preempt a running process, so under load each wake-up "
                                  "serves more requests"),
    "heartbeat_s": ("seconds", "how often a leader probes each follower"),
    "repair_interval_s": ("seconds", "a full repair pass (sizes and block CRCs) at least this often"),
    "repair_mib_s": ("MiB/s", "repair bandwidth cap per node (0: unlimited)"),
    "repair_chunk_kib": ("KiB", "bytes moved per repair write (one extent-lane turn each)"),
    "scrub_interval_s": ("seconds", "background scrub pass this often (0: only on demand)"),
    "scrub_mib_s": ("MiB/s", "scrub read rate cap per node (0: unlimited)"),
    "secret_file": ("path", "the cluster secret (datanode gen-secret); empty: no authentication, peers on this "
                            "host only (unless insecure), warned at start"),
    "insecure": ("bool", "without secret_file: also take peers from other hosts, unauthenticated -- anyone who "
                         "reaches the port can then read, write and delete (false: loopback peers only)"),
    "auth_transition": ("bool", "while switching a running cluster to secret_file: also take peers without the "
                                "secret (loopback only unless insecure) and talk to nodes without one; turn it off "
                                "once every node and client has the secret (docs/security.md)"),
    "hello_timeout": ("seconds", "how long a new connection may take to complete its (authenticated) hello"),
    "preauth_max": ("count", "connections still in their hello at once, all hosts (0: no limit); at the limit a "
                             "new one from a quieter address takes the place of the oldest of the busiest address"),
    "preauth_per_host": ("count", "connections still in their hello from one address; a new one takes the "
                                  "place of the oldest that has not sent its whole hello, else of the oldest "
                                  "(0: no limit)"),
    "preauth_early_drop": ("count", "from this many connections in their hello, a new one from an address that "
                                    "has one pending is dropped at random, 30% rising to 100% at preauth_max "
                                    "(sshd's MaxStartups)"),
    "idle_max": ("count", "idle client connections (nothing in flight) kept at once; beyond, the least recently "
                          "active are closed (0: no limit)"),
    "idle_per_host": ("count", "idle client connections kept from one host; beyond, its least recently active are "
                               "closed (0: no limit)"),
    "max_connections": ("count", "connections past their hello at once; a new one takes the place of the least "
                                 "recently active idle client connection, or is refused with 'too many "
                                 "connections' (those in their hello count against preauth_max instead)"),
    "reserved_connections": ("count", "of max_connections, this many are kept for datanodes (role node) and admins: "
                                      "client-role connections are refused beyond max_connections minus these (at "
                                      "most half of max_connections is kept), so clients cannot lock replication "
                                      "and admins out"),
    "max_connections_per_host": ("count", "client-role connections from one host at once; more are refused with "
                                          "'too many connections' (0: no per-host limit; mind NAT and loopback)"),
    "idle_timeout_s": ("seconds", "a connection with nothing in flight this long is closed (0: never)"),
    "conn_pool_share": ("fraction", "most of the pool one connection may hold (BUSY beyond; fair share when short)"),
    "payload_timeout": ("seconds", "how long a client may take to serve the one-sided READ of its WRITE's payload "
                                   "(or a request body): beyond, the request fails PAYLOAD_TIMEOUT, its pool block "
                                   "is freed and its connection dropped (a node's forwards: peer_timeout)"),
    "conn_fetch_mib": ("MiB", "pool one connection's requests may hold awaiting their payload READs at once "
                              "(BUSY beyond)"),
    "fetch_pool_share": ("fraction", "most of the pool all connections together may hold awaiting payload READs "
                                     "(BUSY beyond; an equal share each when more than half is taken): the rest "
                                     "stays for reads, answers and forwards"),
    "max_inflight": ("count", "requests one connection may have in flight; more are answered BUSY at once "
                              "(0: the same as slots)"),
    "penalty_max_s": ("seconds", "after a peer is dropped for abuse (payload not served, answers not read, "
                                 "slots overrun), new connections of its host and role (a node: its identity) wait "
                                 "0.05s after their hello, doubling per offence up to this (0: never)"),
    "trash_retention_s": ("seconds", "a deleted or removed partition's data stays in data_dir/trash this long"),
    "audit_log": ("path", "admin actions as JSON lines (empty: data_dir/audit.log)"),
    "tls_cert": ("path", "PEM certificate (chain) presented to TLS clients; names the node's listen IP/host"),
    "tls_key": ("path", "the certificate's private key (PEM)"),
    "tls_ca": ("path", "CA bundle to verify other nodes' certificates; set: node-to-node links use TLS"),
    "tls_required": ("bool", "refuse plaintext connections (clients must dial with TLS)"),
}


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


def transport_options(cfg: Config) -> TransportOptions:
    """The node's connection settings for ``connect.make_domain``: Config has a key for each field."""
    return TransportOptions(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(TransportOptions)})


def etcd_access(cfg: Config):
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
        env = env_values({f.name: f.type for f in dataclasses.fields(Config) if f.name not in _NOT_FROM_ENV},
                         environ or {})
    except ValueError as e:
        raise ConfigError(f"environment: {e}") from None
    given = {k: v for k, v in overrides.items() if v is not None}
    origin.update({k: f"env {ENV_PREFIX}{k.upper()}" for k in env})
    origin.update(dict.fromkeys(given, "command line"))
    return from_dict({**d, **env, **given}, str(path or "config"), origin)


def to_toml(cfg: Config, annotate: bool = False) -> str:
    """The config as TOML; with ``annotate`` each key is followed by a comment: its unit, where its value came
    from (default, file, env, command line) and its meaning."""
    lines = []
    for f in dataclasses.fields(Config):
        v = getattr(cfg, f.name)
        line = (f'{f.name} = "{v}"' if isinstance(v, str) else f"{f.name} = {str(v).lower()}"
                if isinstance(v, bool) else f"{f.name} = {v}")
        if annotate:
            unit, text = KEY_HELP.get(f.name, ("", ""))
            text = f"({cfg.origin.get(f.name, 'default')}) {text}"
            line = f"{line:30} # [{unit}] {text}" if unit else line
        lines.append(line)
    return "\n".join(lines) + "\n"
