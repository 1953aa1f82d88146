"""The datanode process: accepts connections, hands their requests to the wrapper, and owns the node's parts.

``Node`` is the lifecycle (listen, serve, the controlled shutdown of datanode/drain.py on SIGTERM or
``NODE_DRAIN``), the connection boundary (``_on_stream``: nothing a
peer does can end the process, and the connection limits and penalties), and the composition of the node's
parts.  Every request goes through ``ops.wrap.Wrap`` (arrival, admission, the handler, the answer); what a
request does is in ``datanode/ops/`` -- follow a write from the client to the disk in
``datanode/ops/append.py`` -- with replication to the followers in ``datanode/replication.py`` and the
leader's repair and scrub in ``datanode/repair.py``.
"""
from __future__ import annotations

import dataclasses
import gc
import logging
import math
import os
import pathlib
import random
import signal
import time

import trio

from wire import crc, sdnotify
from wire.auth import AuthConfigError, Credentials, DialAuth
from wire.pool import BuddyPool
from wire.protocol import HELLO_SIZE, ProtocolError, Role
from wire.rpc import Links
from wire.transport import tls
from wire.transport.base import Access, Connection, ConnectionClosed, Domain, TransportError
from wire.transport.connect import NotAdmitted, ServerAuth, accept, make_domain, refuse
from wire.transport.tcp import received_bytes
from . import config as config_mod
from .audit import AuditLog
from .commit import GroupCommit
from .drain import Drain, NodeControl
from .metrics import NodeMetrics, NodeReadings, serve_metrics
from .ops.admin import AdminOps
from .ops.admission import Admission, Limits
from .ops.append import Appends
from .ops.base import RequestCounters
from .ops.buffers import Buffers
from .ops.data import DataOps
from .ops.lean import Lean
from .ops.mapread import MapOps
from .ops.partitions import Partitions, ViewRefused
from .ops.repair import RepairOps
from .ops.wrap import Serving, Wrap
from .partition import OpenProgress, PartitionTable
from .repair import Repairer
from .replication import Replicator
from .store import StoreError, StoreOptions

log = logging.getLogger(__name__)
ENDED_WARN_S = 10.0      # "connection from ... ended: WHY" is logged once per host and WHY this often

GC_YOUNG = 20_000            # allocations between two young-generation collections (CPython's default: 700)


def tune_gc() -> None:
    """The cyclic garbage collector, tuned for a server holding many connections.  Each collection stops the
    event loop while it walks the live objects of its generations; a connection holds ~150 of them (tasks,
    coroutines, cancel scopes), and requests allocate many short-lived objects, most freed by reference
    counting.  With CPython's default (a young collection every 700 net allocations) a node with abusive peers
    churning connections beside many idle ones spends a visible share of its time in pauses (``python -m lab
    soak`` reports node GC per phase).  A larger young threshold collects the same garbage in
    fewer, hardly longer pauses (what survives, not what was allocated, is walked); older generations keep
    their ratios.  ``gc.freeze()`` once serving takes the start-up objects out of every full collection."""
    g0, g1, g2 = gc.get_threshold()
    if g0 and g0 < GC_YOUNG:
        gc.set_threshold(GC_YOUNG, g1, g2)


class NodeViews:
    """The node's ``partition.Views``, through its partitions (ops/partitions.py): a refused view (its leader
    is not known to hold every acknowledged byte) is logged and counted there, and is False here; the etcd
    agent tries it again at its next re-read, repair at its next look."""

    def __init__(self, partitions: Partitions):
        self.partitions = partitions

    async def install_view(self, pid: int, replicas: list[str], epoch: int) -> bool:
        try:
            return await self.partitions.install_view(pid, replicas, epoch)
        except ViewRefused:
            return False

    async def install_views(self, views: list[tuple[int, list[str], int]]) -> list[bool]:
        return await self.partitions.install_views(views)

    async def drop_partitions(self, views: list[tuple[int, list[str], int]]) -> list[bool]:
        return await self.partitions.drop_partitions(views)

    async def drop_partition(self, pid: int, replicas: list[str], epoch: int, *, equal_ok: bool = False) -> bool:
        try:
            return await self.partitions.drop_partition(pid, replicas, epoch, equal_ok=equal_ok)
        except ViewRefused:
            return False


class Node:
    def __init__(self, cfg: config_mod.Config, domain: Domain | None = None):
        self.cfg = cfg
        self.me = cfg.listen
        self.started = time.time()
        try:
            self.domain = domain or make_domain(cfg.transport, config_mod.transport_options(cfg))
        except TransportError as e:
            raise config_mod.ConfigError(f"config key 'transport': {e}") from None
        try:
            server_tls = tls.server_context(cfg.tls_cert, cfg.tls_key) if cfg.tls_cert else None
            dial_tls = tls.client_context(cfg.tls_ca) if cfg.tls_ca else None
        except tls.TlsConfigError as e:
            raise config_mod.ConfigError(f"config key 'tls_cert'/'tls_key'/'tls_ca': {e}") from None
        try:
            creds = Credentials.load(cfg.secret_file) if cfg.secret_file else None
            self.server_auth = ServerAuth(creds, server_tls, cfg.tls_required, transition=cfg.auth_transition,
                                          identity=self.me)     # what callers must name as the node they dialed
        except (AuthConfigError, ValueError) as e:
            raise config_mod.ConfigError(f"config key 'secret_file': {e}") from None
        # towards other datanodes we are role ``node``, identified by our listen address (also without a
        # secret: a follower then takes forwarded changes only from a peer that names its leader)
        self.dial_auth = DialAuth(creds, Role.NODE, identity=self.me, tls=dial_tls,
                                  transition=cfg.auth_transition)
        self.audit = AuditLog(cfg.audit_log or str(pathlib.Path(cfg.data_dir) / "audit.log"), self.me)
        # who gets a connection, whose goes under pressure (ops/admission.py); loopback only without a secret
        # unless insecure (with auth_transition too: it then takes peers without the secret)
        self.open_to = ("secret" if creds is not None and not cfg.auth_transition else
                        "any" if cfg.insecure else "loopback")
        self.admission = Admission(Limits.from_config(cfg), random.random)
        self._refusals_logged: dict[str, float] = {}    # why -> when last logged
        self._ended_warned: dict[tuple[str, str], list] = {}    # _warn_ended: (host, why) -> [last, held back]
        self.penalties: dict[str, tuple[float, float]] = {}   # _penalty_key -> (its connections wait until, since)
        self.domain.scoped = True            # our memory is reachable only through grants (transport/base.py)
        self.pool = BuddyPool(cfg.pool_mib << 20, cfg.max_block_kib << 10)
        # The whole arena, registered once; peers may read it (followers fetch forwards), never write.
        self.region = self.domain.register(self.pool.arena, self.pool.base_addr,
                                           Access.LOCAL_WRITE | Access.REMOTE_READ)
        self.table = PartitionTable(pathlib.Path(cfg.data_dir), cfg.sync, cfg.open_verify,
                                    StoreOptions.from_config(cfg))
        self.serving = Serving()             # starting -> serving; draining; data directory lost
        self.opening = OpenProgress(verify=cfg.open_verify)
        self.conns: set[Connection] = set()
        self._agent_scope = trio.CancelScope()   # the etcd agent's: a node that lost its data directory leaves
        self._agent_ended = trio.Event()
        self.counters = RequestCounters()
        self._nursery: trio.Nursery | None = None
        self.replication = Replicator(cfg.replica_timeout)   # fan-out to followers (links set up in serve)
        # sync=always: appends share their fdatasyncs (datanode/commit.py); the only request in flight
        # flushes right in the event loop
        self.commit = GroupCommit(quiet=lambda: self.wrap.inflight <= 1)
        # each part is given its config section and the parts of the node it uses, never the node
        node_keys = config_mod.section(cfg, config_mod.NodeConfig)
        cluster_keys = config_mod.section(cfg, config_mod.ClusterConfig)
        self.partitions = Partitions(node_keys, self.me, self.table, self.counters, None, self._partitions_changed)
        self.views = NodeViews(self.partitions)  # how the etcd agent and repair install and drop views
        self.agent = None                    # the cluster map in etcd, when configured (datanode/etcdagent.py)
        if cfg.etcd:
            from .etcdagent import EtcdAgent
            self.agent = EtcdAgent(cluster_keys, me=self.me, transport=cfg.transport, data_dir=cfg.data_dir,
                                   creds=creds, table=self.table, views=self.views)
            self.partitions.agent = self.agent   # leaders self-fence by it
        self.repair = Repairer(me=self.me, cfg=cfg, table=self.table, pool=self.pool, region=self.region,
                               domain=self.domain, replication=self.replication,
                               views=self.views)   # health, repair, scrub
        self.partitions.peers = self.repair          # a view's new leader is asked whether it is synced
        serving, conns = self.serving, self.conns

        def stop_taking() -> None:
            serving.draining = True

        self.drain = Drain(NodeControl(         # the controlled shutdown (SIGTERM, NODE_DRAIN)
            me=self.me, cfg=cluster_keys, parts=self.table.all, state=lambda: serving.state,
            inflight=lambda: self.wrap.inflight, drained=lambda: self.wrap.drained(), stop_taking=stop_taking,
            agent=self.agent, leave_etcd=self.leave_etcd))
        self.metrics = NodeMetrics(NodeReadings(     # Prometheus (datanode/metrics.py); served on metrics_listen
            me=self.me, state=lambda: serving.state, opening=self.opening, pool=self.pool, conns=lambda: conns,
            auth_on=creds is not None, open_to=self.open_to, admission_counts=self.admission.counts,
            counters=self.counters, answers_refused=self.answers_refused, replication=self.replication.counters,
            repair=self.repair.counters, parts=self.table.all,
            etcd_invalid=self.agent.etcd.invalid if self.agent is not None else None, disk=self.disk))
        self.buffers = Buffers(config_mod.section(cfg, config_mod.MemoryConfig), self.pool, self.region)
        appends = Appends(self.partitions, self.buffers, self.replication, self.commit, self.counters)
        handlers = {**appends.handlers(),
                    **DataOps(self.partitions, self.buffers, self.replication, self.counters).handlers(),
                    **AdminOps(node_keys, self.partitions, self.buffers, self.repair, self.status,
                               self.drain).handlers(),
                    **RepairOps(self.partitions, self.buffers, self.repair.counters).handlers(),
                    **MapOps(self.agent.copy if self.agent else None, self.buffers, self.serving).handlers()}
        self.lean = (Lean(self.me, self.table, self.replication, self.counters, cfg.sync == config_mod.SyncMode.ALWAYS,
                          self.commit.here) if cfg.lean_appends else None)
        self.wrap = Wrap(cfg=cfg, serving=self.serving, table=self.table, counters=self.counters,
                         metrics=self.metrics, audit=self.audit, handlers=handlers, now=appends.now, lean=self.lean)

    @property
    def state(self) -> str:
        return self.serving.state

    def _partitions_changed(self, kick: bool) -> None:
        """The partitions held here changed: leadership may have moved (``kick``: repair looks now), and the
        cluster map hears of it."""
        if kick:
            self.repair.kick()
        if self.agent is not None:
            self.agent.changed()

    # -- lifecycle ------------------------------------------------------------------------------------
    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Listen at once; open the partitions in a worker thread meanwhile (state "starting": PING and
        NODE_STATUS answer, with progress; anything else is RETRY); then serve ("serving") and start repair."""
        cfg = self.cfg
        listeners = await trio.open_tcp_listeners(cfg.port, host=cfg.host)
        if self.open_to == "any":
            log.warning("!!! AUTHENTICATION IS OFF and insecure = true: anyone who can reach %s from any host "
                        "can read, write and delete data and change partitions. Set secret_file (datanode "
                        "gen-secret), or remove insecure to take loopback peers only. !!!", self.me)
        elif self.open_to == "loopback":
            log.warning("AUTHENTICATION IS OFF (no secret_file): this node takes peers on its own host only "
                        "(loopback); set secret_file (datanode gen-secret) to serve other hosts")
        else:
            log.info("authentication on (cluster secret %s)", pathlib.Path(cfg.secret_file).resolve())
        if cfg.auth_transition:
            log.warning("auth_transition: this node also takes peers without the secret (%s) and talks to nodes "
                        "without one; turn it off once every node and client has the secret",
                        "from any host" if cfg.insecure else "loopback only")
        log.info("datanode %s listening (pid %d, data_dir %s, pool %d MiB, max block %d KiB, sync=%s, "
                 "transport=%s); opening partitions (open_verify=%s)", self.me, os.getpid(), cfg.data_dir,
                 cfg.pool_mib, cfg.max_block_kib, cfg.sync, cfg.transport, cfg.open_verify)
        log.info("CRC32C: %s", crc.CHOICE)

        failed: list[str] = []
        opening = trio.CancelScope()       # cancelled by a stop request: a node told to stop never serves

        async def open_partitions():
            with opening:
                try:
                    await trio.to_thread.run_sync(self.table.load, self.opening, trio.from_thread.check_cancelled)
                except (OSError, StoreError) as e:
                    failed.append(f"opening the partitions in {cfg.data_dir}: {e}")
                    log.error("%s", failed[0])
                    self._nursery.cancel_scope.cancel()
                    return
            if self.drain.requested.is_set():     # (the load may finish between the request and the cancel)
                return
            o = self.opening.to_dict()
            log.info("datanode %s serving: %d partitions, %d extents, %d bytes opened in %.2fs (verify=%s)",
                     self.me, o["partitions"], o["extents"], o["bytes"], o["seconds"], o["verify"])
            self.serving.state = "serving"
            sdnotify.ready(f"serving {self.me}")
            gc.freeze()          # what start-up made (modules, the opened partitions) lives as long as we do
            self._nursery.start_soon(self.repair.run)
            if self.agent is not None:            # registers the partitions it now holds
                self._nursery.start_soon(self._run_agent)

        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self.replication.links = Links(nursery, self.domain, transport=cfg.transport, slots=cfg.slots,
                                               connect_timeout=cfg.replica_timeout, on_conn=self._track,
                                               auth=self.dial_auth)
                nursery.start_soon(self._keep_trash)
                nursery.start_soon(self._watch_data_dir)
                await nursery.start(self.commit.run)
                nursery.start_soon(self.metrics.loop_lag.run, lambda: self.counters.requests)
                self.metrics.gc.install()
                tune_gc()
                if cfg.metrics_listen:
                    await nursery.start(serve_metrics, cfg.metrics_listen, self.metrics)
                accepting = trio.CancelScope()
                nursery.start_soon(self._accept_loop, listeners, accepting)
                nursery.start_soon(open_partitions)
                task_status.started(self)
                with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                    async with trio.open_nursery() as stopping:
                        stopping.start_soon(self._signals, signals)
                        await self.drain.requested.wait()        # a signal, or an admin's NODE_DRAIN
                        opening.cancel()
                        await self.drain.run(accepting)          # hand off, finish in-flight, leave etcd
                        stopping.cancel_scope.cancel()
                nursery.cancel_scope.cancel()
            if failed:
                raise OSError(failed[0])
        finally:
            self.table.close()
            log.info("datanode %s stopped", self.me)

    async def _signals(self, signals) -> None:
        """SIGTERM/SIGINT start the controlled shutdown; another one hurries it."""
        async for sig in signals:
            self.drain.request(f"got {signal.Signals(sig).name}", again_hurries=True)

    async def leave_etcd(self) -> str | None:
        """Stop the etcd agent, which revokes the node's lease on its way out; how that went (None: no etcd)."""
        if self.agent is None:
            return None
        self._agent_scope.cancel()
        if self.serving.state == "serving":          # (the agent starts once the partitions are open)
            await self._agent_ended.wait()
        return self.agent.left

    def _warn_ended(self, host: str, peer: str, e: Exception) -> None:
        """"connection from PEER ended: WHY" -- at most once per ENDED_WARN_S for one host and the same WHY
        (any port), then with how many like it were held back: a peer that keeps failing the same way (a
        manager dialling the wrong transport, a scanner, a misconfigured client in a retry loop) must not
        fill the log, and so the disk."""
        now = time.monotonic()
        key = (host, (str(e) or type(e).__name__).replace(peer, host))     # the same failure, any port
        seen = self._ended_warned.get(key)
        if seen is not None and now - seen[0] < ENDED_WARN_S:
            seen[1] += 1
            return
        held = seen[1] if seen is not None else 0
        if len(self._ended_warned) >= 4096:           # bounded: forget hosts quiet for a while
            self._ended_warned = {k: v for k, v in self._ended_warned.items() if now - v[0] < ENDED_WARN_S}
        self._ended_warned[key] = [now, 0]
        log.warning("connection from %s ended: %s%s", peer, str(e) or type(e).__name__,
                    f" ({held} more from {host} ended so in the last {now - seen[0]:.0f}s)" if held else "")

    async def _accept_loop(self, listeners, scope) -> None:
        with scope:
            await trio.serve_listeners(self._on_stream, listeners, handler_nursery=self._nursery)

    async def _on_stream(self, stream: trio.SocketStream) -> None:
        """One peer's connection, from its hello to its end.  The boundary of everything a peer can cause:
        whatever the peer does (or a bug its requests hit), only this connection ends, with one log line.
        Admission (ops/admission.py) decides whether it may stay, before its hello and once the hello has
        proven its role, and which other connections are closed to make room (their cancel scopes)."""
        try:
            host, port = stream.socket.getpeername()[:2]
        except OSError:                          # reset before we even looked at it
            return
        peer = f"{host}:{port}"
        scope = trio.CancelScope()
        sock = stream.socket
        v = self.admission.arrive(host, trio.current_time(), scope,
                                  lambda: (received_bytes(sock) or 0) >= HELLO_SIZE)
        self._make_room(v.close)
        if v.entry is None:
            self._refused(peer, v.why)
            with trio.move_on_after(1):
                await refuse(stream.socket, self.domain, self.cfg.slots, v.status)
            return
        entry = v.entry
        conn = None

        def admit(role, identity) -> int:
            got = self.admission.hello(entry, role, trio.current_time())
            self._make_room(got.close)
            if got.entry is None:
                self._refused(peer, got.why)
                return got.status
            return 0

        async def penalty(c: Connection) -> None:
            delay = self.penalties.get(self._penalty_key(host, c), (0.0, 0.0))[0] - trio.current_time()
            if delay > 0:        # peers of this host and role (node: identity) broke the rules lately: wait,
                await trio.sleep(delay)       # reading nothing of theirs meanwhile
        try:
            with scope:
                async with accept(stream.socket, peer, self.domain, transport=self.cfg.transport,
                                  slots=self.cfg.slots, timeout=self.cfg.hello_timeout,
                                  auth=self.server_auth, admit=admit, hold=penalty) as conn:
                    entry.served = conn
                    await self._connection(conn, entry)
            if scope.cancelled_caught:
                log.debug("connection from %s closed to make room", peer)
        except (ConnectionClosed, NotAdmitted) as e:    # a port probe; a refusal (logged by _refused)
            log.debug("connection from %s ended: %s", peer, e)
        except (TransportError, ProtocolError, trio.TooSlowError, OSError, trio.BrokenResourceError,
                trio.ClosedResourceError) as e:
            self._warn_ended(host, peer, e)
        except Exception:     # a bug must cost one connection, never the node
            log.exception("connection from %s ended by an internal error", peer)
        finally:
            self.admission.left(entry)
            if conn is not None and conn.misbehaved and self.cfg.penalty_max_s:
                self._penalize(self._penalty_key(host, conn), conn.misbehaved)
        # (trio.serve_listeners closes the stream when this returns)

    @staticmethod
    def _make_room(close) -> None:
        """Close connections admission gave up to make room (pending ones, or idle clients)."""
        for e in close:
            e.handle.cancel()

    def _refused(self, peer: str, why: str) -> None:
        """A connection refused: one log line per reason at most every ENDED_WARN_S, with the count so far."""
        now = time.monotonic()
        kind = why.split(" (")[-1] if " (" in why else why
        if now - self._refusals_logged.get(kind, -math.inf) >= ENDED_WARN_S:
            if len(self._refusals_logged) > 64:
                self._refusals_logged.clear()
            self._refusals_logged[kind] = now
            log.warning("refusing a connection from %s: %s; %d refused so far", peer, why, self.admission.refused)

    PENALTY_MIN, PENALTY_FORGET = 0.05, 30.0

    @staticmethod
    def _penalty_key(host: str, conn: Connection) -> str:
        """Whose offences a new connection pays for: its host and the role it proved in the hello, and for a
        node its identity (its listen address, proven with the node key).  So a client-role peer that abuses
        the node from a host does not slow the replication links of a datanode on the same host (on loopback:
        every local peer), nor an admin's commands.  Without authentication: the host alone."""
        if conn.role is None:
            return host
        return f"{host} {conn.role.name.lower()}" + (f" {conn.identity}" if conn.identity else "")

    def _penalize(self, key: str, why: str) -> None:
        """A peer of ``key`` (``_penalty_key``) was dropped for breaking the rules: the key's next connections
        wait after their hello, before their first request is read (doubling per offence, up to
        ``penalty_max_s``; forgotten after PENALTY_FORGET quiet seconds), so a peer that reconnects at once to
        abuse again gets a bounded share of the node.  Connections already open (well-behaved clients keep
        theirs) are not touched."""
        now = trio.current_time()
        until, last = self.penalties.get(key, (0.0, 0.0))
        prev = max(0.0, until - last) if now - last < self.PENALTY_FORGET else 0.0
        step = min(self.cfg.penalty_max_s, max(self.PENALTY_MIN, prev * 2))
        self.penalties[key] = (now + step, now)
        if len(self.penalties) > 4096:        # bounded, whatever the number of hosts
            for k in [k for k, (_, t) in self.penalties.items() if now - t > self.PENALTY_FORGET]:
                del self.penalties[k]
        self.counters.penalties += 1
        if self.counters.penalties % 100 == 1:
            log.warning("peer from %s dropped (%s): its new connections wait %.2fs (%d such drops so far)", key,
                        why, step, self.counters.penalties)

    def _track(self, conn: Connection, opened: bool) -> None:
        if opened:
            self.conns.add(conn)
        else:
            self._forget(conn)

    def _forget(self, conn: Connection) -> None:
        """An ended connection leaves the set; what its counters add to the node's totals stays."""
        if conn in self.conns:
            self.conns.discard(conn)
            self.counters.answers_refused += conn.stats.posted_refused

    def answers_refused(self) -> int:
        """READ answers (posted one-sided writes) clients refused, over every connection there was."""
        return self.counters.answers_refused + sum(c.stats.posted_refused for c in list(self.conns))

    async def _connection(self, conn: Connection, entry=None) -> None:
        self.conns.add(conn)
        try:
            await self.wrap.serve(conn, entry)
        finally:
            self._forget(conn)

    def disk(self) -> dict:
        """Capacity and use of the file system holding ``data_dir`` (bytes)."""
        try:
            st = os.statvfs(self.cfg.data_dir)
        except OSError as e:
            return {"path": self.cfg.data_dir, "error": str(e)}
        return {"path": self.cfg.data_dir, "total": st.f_blocks * st.f_frsize,
                "used": (st.f_blocks - st.f_bfree) * st.f_frsize, "free": st.f_bavail * st.f_frsize}

    async def _watch_data_dir(self) -> None:
        """Checks every ``DATA_DIR_CHECK_S`` that ``data_dir`` is still the directory the node opened (the same
        device and inode).  Removed, moved aside, or hidden by another file system (a disk unmounted under
        the node, or one mounted over it): the extent files the node has open are then no longer the ones a
        restart finds, so every append acknowledged from then on would be lost at the next start.  The node
        then refuses every request that would change its data (DISK_ERROR, saying why), says so in
        NODE_STATUS (``data_dir_lost``) and logs it once; reads go on from the open files.  With etcd it also
        leaves the cluster map (its agent stops and revokes its lease), so the manager treats it as a dead
        node: leadership moves to a replica that has the data, and the partitions are re-replicated.  A
        restart on the right directory clears it."""
        path = self.cfg.data_dir
        try:
            st = os.stat(path)
        except OSError:
            return                  # not there at start: opening the partitions fails and says so
        opened = (st.st_dev, st.st_ino)
        while True:
            await trio.sleep(DATA_DIR_CHECK_S)
            try:
                st = os.stat(path)
            except FileNotFoundError:
                why = "was removed"
            except OSError as e:
                why = f"cannot be looked at ({e})"
            else:
                if (st.st_dev, st.st_ino) == opened:
                    continue
                why = "was replaced (another directory is at its path: moved aside, or a file system unmounted " \
                      "from or mounted over it)"
            self.serving.data_dir_lost = (f"data directory {path} {why} while the node was running: the files it "
                                          f"has open are not the ones a restart would find, so it refuses writes; "
                                          f"restart it on its data directory")
            log.error("%s", self.serving.data_dir_lost)
            if self.agent is not None:
                log.error("leaving the cluster map (etcd): this node cannot keep what it would acknowledge")
                self._agent_scope.cancel()
            return

    async def _run_agent(self) -> None:
        try:
            with self._agent_scope:
                await self.agent.run()
        finally:
            self._agent_ended.set()

    async def _keep_trash(self) -> None:
        """Purges partitions deleted (or removed from) more than ``trash_retention_s`` ago."""
        every = max(1.0, min(3600.0, self.cfg.trash_retention_s / 4))
        while True:
            await trio.sleep(every)          # not at start: a restarting node has more urgent things to do
            await trio.to_thread.run_sync(self.table.purge_trash, self.cfg.trash_retention_s)

    def peers_taken(self) -> str:
        """Which peers this node takes, in words (NODE_STATUS ``peers``, the log at start)."""
        unproven = {"loopback": "this host only", "any": "ANY HOST"}.get(self.open_to)
        if unproven is None:
            return "those holding the secret"
        if self.cfg.auth_transition:
            return f"those holding the secret; without it, {unproven} (auth_transition)"
        return f"{unproven}, unauthenticated (no secret{', insecure = true' if self.open_to == 'any' else ''})"

    def _volumes(self) -> dict[str, list[int]]:
        """volume -> the partitions of it held here (those of no volume are not listed)."""
        out: dict[str, list[int]] = {}
        for part in sorted(self.table.all(), key=lambda p: p.pid):
            if part.volume:
                out.setdefault(part.volume, []).append(part.pid)
        return out

    def status(self, *, asking: int = 0, reveal: bool = True) -> dict:
        """The node's state; ``asking``: requests of the asker's own to leave out of ``inflight``;
        ``reveal``: the pool's rkey and address too (admins, or authentication off)."""
        return {"node": self.me, "state": self.state, "opening": self.opening.to_dict(), "pid": os.getpid(),
                "uptime_s": round(time.time() - self.started, 1),
                "auth": "on" if self.server_auth.creds is not None else "off",
                "peers": self.peers_taken(), "insecure": self.open_to == "any",
                "tls": ("required" if self.cfg.tls_required else "offered") if self.server_auth.tls else "off",
                **self.admission.counts(),
                "transport": self.cfg.transport, "sync": self.cfg.sync,
                "rdma_device": getattr(self.domain.device, "name", None),
                "rdma_windows": getattr(self.domain.device, "windows_state", None),
                "draining": self.serving.draining, "drain": self.drain.progress(),
                "inflight": self.wrap.inflight - asking,
                "partitions": sorted(p.pid for p in self.table.all()), "data_dir_lost": self.serving.data_dir_lost,
                "volumes": self._volumes(),
                "disk": self.disk(),
                "connections": [c.info() for c in list(self.conns)],
                "loop_lag": self.metrics.loop_lag.to_dict(), "gc": self.metrics.gc.to_dict(),
                "write_stages": self.metrics.write_stages.to_dict(),
                "counters": {**dataclasses.asdict(self.counters), **dataclasses.asdict(self.replication.counters),
                             **dataclasses.asdict(self.commit.counters),
                             **self.table.store_counts(),
                             "answers_refused": self.answers_refused(),
                             **dataclasses.asdict(self.repair.counters)},
                "pool": self.buffers.stats(reveal)}


DATA_DIR_CHECK_S = 1.0       # how often a node looks at its data directory (one stat)
