"""The datanode process: accepts connections, dispatches requests to the handlers, and owns the node's parts.

``Node`` is the lifecycle (listen, serve, drain on SIGTERM), the connection boundary (``_on_stream``: nothing a
peer does can end the process), and dispatch (``_dispatch``/``_handle``: one task per request -- a run of
small appends queued behind each other, one task for the run: ``ops.data.AppendRun`` --, the extent's
arrival order taken synchronously).  What a request does is in ``datanode/ops/`` -- follow a write from the
client to the disk in ``datanode/ops/data.py`` -- with replication to the followers in
``datanode/replication.py`` and the leader's repair and scrub in ``datanode/repair.py``.
"""
from __future__ import annotations

import dataclasses
import gc
import logging
import math
import os
import pathlib
import signal
import time

import trio

from . import config as config_mod, crc, trace
from .audit import NOTE as AUDIT_NOTE, AuditLog
from .commit import GroupCommit
from .auth import AuthConfigError, Credentials, DialAuth
from .metrics import NodeMetrics, serve_metrics
from .ops.admin import AdminOps
from .ops.base import PeerTimeout, Reply, RequestCounters
from .ops.data import AppendRun, DataOps
from .ops.repair import RepairOps
from .partition import OpenProgress, PartitionTable
from .pool import BuddyPool
from .protocol import (
    ADMIN_ACTIONS,
    PROTOCOL_REASONS,
    Flag,
    Header,
    Op,
    ProtocolError,
    Result,
    Role,
    decode_message,
    peek_req_id,
    roles_for,
)
from .repair import Repairer
from .replication import Replicator
from .rpc import Links
from .store import StoreError
from .transport.base import Access, Connection, ConnectionClosed, Domain, TransportError
from .transport import tls
from .transport.connect import NotAdmitted, ServerAuth, accept, make_domain, refuse

log = logging.getLogger(__name__)
ENDED_WARN_S = 10.0      # "connection from ... ended: WHY" is logged once per host and WHY this often

GC_YOUNG = 20_000            # allocations between two young-generation collections (CPython's default: 700)


def tune_gc() -> None:
    """The cyclic garbage collector, tuned for a server holding many connections.  Each collection stops the
    event loop while it walks the live objects of its generations; a connection holds ~150 of them (tasks,
    coroutines, cancel scopes), and requests allocate many short-lived objects, most freed by reference
    counting.  With CPython's default (a young collection every 700 net allocations) the node collected
    3-4 times as often with abusive peers churning connections beside 2,000 idle ones, and spent 5-10% of the
    time in pauses (``dnctl soak``: node GC per phase).  A larger young threshold collects the same garbage in
    fewer, hardly longer pauses (what survives, not what was allocated, is walked); older generations keep
    their ratios.  ``gc.freeze()`` once serving takes the start-up objects out of every full collection."""
    g0, g1, g2 = gc.get_threshold()
    if g0 and g0 < GC_YOUNG:
        gc.set_threshold(GC_YOUNG, g1, g2)


class Node(DataOps, AdminOps, RepairOps):
    def __init__(self, cfg: config_mod.Config, domain: Domain | None = None):
        self.cfg = cfg
        self.me = cfg.listen
        self.started = time.time()
        try:
            self.domain = domain or make_domain(cfg.transport, cfg.rdma_device or None, cfg.gid_index)
        except TransportError as e:
            raise config_mod.ConfigError(f"config key 'transport': {e}") from None
        try:
            server_tls = tls.server_context(cfg.tls_cert, cfg.tls_key) if cfg.tls_cert else None
            dial_tls = tls.client_context(cfg.tls_ca) if cfg.tls_ca else None
        except tls.TlsConfigError as e:
            raise config_mod.ConfigError(f"config key 'tls_cert'/'tls_key'/'tls_ca': {e}") from None
        try:
            creds = Credentials.load(cfg.secret_file) if cfg.secret_file else None
            self.server_auth = ServerAuth(creds, server_tls, cfg.tls_required)
        except (AuthConfigError, ValueError) as e:
            raise config_mod.ConfigError(f"config key 'secret_file': {e}") from None
        # towards other datanodes we are role ``node``, identified by our listen address
        self.dial_auth = (DialAuth(creds, Role.NODE, identity=self.me, tls=dial_tls) if creds or dial_tls
                          else None)
        self.audit = AuditLog(cfg.audit_log or str(pathlib.Path(cfg.data_dir) / "audit.log"), self.me)
        self.accepted = 0                    # connections accepted and not yet ended (max_connections)
        self.client_conns = 0                # of those, admitted as client role (or unauthenticated)
        self.client_conns_by_host: dict[str, int] = {}     # max_connections_per_host
        self.refused_connections = 0
        self._ended_warned: dict[tuple[str, str], list] = {}    # _warn_ended: (host, why) -> [last, held back]
        self.penalties: dict[str, tuple[float, float]] = {}   # _penalty_key -> (its connections wait until, since)
        self.domain.scoped = True            # our memory is reachable only through grants (transport/base.py)
        self.pool = BuddyPool(cfg.pool_mib << 20, cfg.max_block_kib << 10)
        # The whole arena, registered once; peers may read it (followers fetch forwards), never write.
        self.region = self.domain.register(self.pool.arena, self.pool.base_addr,
                                           Access.LOCAL_WRITE | Access.REMOTE_READ)
        self.table = PartitionTable(pathlib.Path(cfg.data_dir), cfg.sync, cfg.open_verify)
        self.state = "starting"              # -> "serving" once serve() has opened the partitions
        self.opening = OpenProgress(verify=cfg.open_verify)
        self.conns: set[Connection] = set()
        self.inflight = 0
        self.draining = False
        self.data_dir_lost: str | None = None    # why the data directory is not the one opened (_watch_data_dir)
        self._agent_scope = trio.CancelScope()   # the etcd agent's: a node that lost its data directory leaves
        self._idle = trio.Event()
        self._create_lock = trio.Lock()      # partition creates: check-then-create must not interleave
        self.counters = RequestCounters()
        self._nursery: trio.Nursery | None = None
        self.replication = Replicator(cfg.replica_timeout)   # fan-out to followers (links set up in serve)
        # sync=always: appends share their fdatasyncs (datanode/commit.py); the only request in flight
        # flushes right in the event loop
        self.commit = GroupCommit(quiet=lambda: self.inflight <= 1)
        self.metrics = NodeMetrics(self)     # Prometheus (datanode/metrics.py); served on metrics_listen
        self.repair = Repairer(me=self.me, cfg=cfg, table=self.table, pool=self.pool, region=self.region,
                               domain=self.domain, replication=self.replication, views=self)  # health, repair, scrub
        self._view_lock = trio.Lock()        # view installs and drops of partitions: one at a time
        self.agent = None                    # the cluster map in etcd, when configured (datanode/etcdagent.py)
        if cfg.etcd:
            from .etcdagent import EtcdAgent
            self.agent = EtcdAgent(self)

    # -- lifecycle ------------------------------------------------------------------------------------
    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Listen at once; open the partitions in a worker thread meanwhile (state "starting": PING and
        NODE_STATUS answer, with progress; anything else is RETRY); then serve ("serving") and start repair."""
        cfg = self.cfg
        listeners = await trio.open_tcp_listeners(cfg.port, host=cfg.host)
        if self.server_auth.creds is None:
            log.warning("!!! AUTHENTICATION IS OFF: no secret_file configured; anyone who can reach %s can read, "
                        "write and delete data and change partitions. Set secret_file (datanode gen-secret) "
                        "before exposing this node to any network. !!!", self.me)
        else:
            log.info("authentication on (cluster secret %s)", pathlib.Path(cfg.secret_file).resolve())
        log.info("datanode %s listening (pid %d, data_dir %s, pool %d MiB, max block %d KiB, sync=%s, "
                 "transport=%s); opening partitions (open_verify=%s)", self.me, os.getpid(), cfg.data_dir,
                 cfg.pool_mib, cfg.max_block_kib, cfg.sync, cfg.transport, cfg.open_verify)
        log.info("CRC32C: %s", crc.CHOICE)

        failed: list[str] = []

        async def open_partitions():
            try:
                await trio.to_thread.run_sync(self.table.load, self.opening, trio.from_thread.check_cancelled)
            except (OSError, StoreError) as e:
                failed.append(f"opening the partitions in {cfg.data_dir}: {e}")
                log.error("%s", failed[0])
                self._nursery.cancel_scope.cancel()
                return
            o = self.opening.to_dict()
            log.info("datanode %s serving: %d partitions, %d extents, %d bytes opened in %.2fs (verify=%s)",
                     self.me, o["partitions"], o["extents"], o["bytes"], o["seconds"], o["verify"])
            self.state = "serving"
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
                    async for sig in signals:
                        log.info("got %s: draining %d in-flight requests", signal.Signals(sig).name,
                                 self.inflight)
                        break
                self.draining = True
                accepting.cancel()
                with trio.move_on_after(30):
                    while self.inflight:
                        self._idle = trio.Event()
                        await self._idle.wait()
                nursery.cancel_scope.cancel()
            if failed:
                raise OSError(failed[0])
        finally:
            self.table.close()
            log.info("datanode %s stopped", self.me)

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
        whatever the peer does (or a bug its requests hit), only this connection ends, with one log line."""
        try:
            host, port = stream.socket.getpeername()[:2]
        except OSError:                          # reset before we even looked at it
            return
        peer = f"{host}:{port}"
        if self.accepted >= self.cfg.max_connections:
            self.refused_connections += 1
            if self.refused_connections % 1000 == 1:
                log.warning("refusing connection from %s: %d connections open (max_connections); %d refused "
                            "so far", peer, self.accepted, self.refused_connections)
            with trio.move_on_after(1):
                await refuse(stream.socket, self.domain, self.cfg.slots, 3)
            return
        self.accepted += 1
        conn = None
        admitted: list[str] = []             # the host whose client count this connection holds (if any)

        def admit(role, identity) -> int:
            status = self._admit(host, role)
            if not status and role in (None, Role.CLIENT):
                self.client_conns += 1
                self.client_conns_by_host[host] = self.client_conns_by_host.get(host, 0) + 1
                admitted.append(host)
            return status

        async def penalty(c: Connection) -> None:
            delay = self.penalties.get(self._penalty_key(host, c), (0.0, 0.0))[0] - trio.current_time()
            if delay > 0:        # peers of this host and role (node: identity) broke the rules lately: wait,
                await trio.sleep(delay)       # reading nothing of theirs meanwhile
        try:
            async with accept(stream.socket, peer, self.domain, transport=self.cfg.transport,
                              slots=self.cfg.slots, timeout=self.cfg.hello_timeout,
                              auth=self.server_auth, admit=admit, hold=penalty) as conn:
                await self._connection(conn)
        except (ConnectionClosed, NotAdmitted) as e:    # a port probe; a refusal (_admit logs those, rate-limited)
            log.debug("connection from %s ended: %s", peer, e)
        except (TransportError, ProtocolError, trio.TooSlowError, OSError, trio.BrokenResourceError,
                trio.ClosedResourceError) as e:
            self._warn_ended(host, peer, e)
        except Exception:     # a bug must cost one connection, never the node
            log.exception("connection from %s ended by an internal error", peer)
        finally:
            self.accepted -= 1
            if admitted:
                self.client_conns -= 1
                left = self.client_conns_by_host[host] - 1
                if left:
                    self.client_conns_by_host[host] = left
                else:
                    del self.client_conns_by_host[host]
            if conn is not None and conn.misbehaved and self.cfg.penalty_max_s:
                self._penalize(self._penalty_key(host, conn), conn.misbehaved)
        # (trio.serve_listeners closes the stream when this returns)

    def _admit(self, host: str, role) -> int:
        """Whether a peer whose hello proved ``role`` may stay: 0, or a HELLO_STATUS code (3: too many
        connections).  Client-role (and unauthenticated) connections may use max_connections minus
        ``reserved_connections`` (at most half kept), and ``max_connections_per_host`` from one host: however
        many connections clients open, datanodes (replication, repair) and admins still get in."""
        if role in (Role.NODE, Role.ADMIN):
            return 0
        cfg = self.cfg
        limit = cfg.max_connections - min(cfg.reserved_connections, cfg.max_connections // 2)
        why = ""
        if self.client_conns >= limit:
            why = (f"{self.client_conns} client connections open (max_connections {cfg.max_connections} minus "
                   f"reserved_connections)")
        elif cfg.max_connections_per_host and self.client_conns_by_host.get(host, 0) >= cfg.max_connections_per_host:
            why = f"{self.client_conns_by_host[host]} client connections open from {host} (max_connections_per_host)"
        if not why:
            return 0
        self.refused_connections += 1
        if self.refused_connections % 1000 == 1:
            log.warning("refusing a client connection from %s: %s; %d refused so far", host, why,
                        self.refused_connections)
        return 3

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

    # -- one connection -------------------------------------------------------------------------------
    async def _connection(self, conn: Connection) -> None:
        """Starts one task per request of the connection, at most ``max_inflight`` at once: a request beyond
        that is answered BUSY by this connection's own task (so a peer that floods requests and never reads
        the answers stalls its own connection on TCP backpressure, and is dropped after ``peer_timeout``:
        neither tasks nor queued answers grow without bound).  A request within the limit is started right
        where the transport delivers it (``deliver_to``: no task switch); the others, and whatever arrives
        behind them, queue for this task."""
        self.conns.add(conn)
        idle = self.cfg.idle_timeout_s or math.inf
        limit = self.cfg.max_inflight or self.cfg.slots
        last = [trio.current_time()]          # when the last request arrived (the idle timeout counts from it)
        runs: list[AppendRun | None] = [None]   # the connection's newest run of appends (AppendRun)
        try:
            async with trio.open_nursery() as nursery:
                def arrived(raw) -> bool:
                    if conn.busy >= limit:
                        return False          # queued: answered BUSY below, in order
                    last[0] = now = trio.current_time()
                    self._dispatch(nursery, conn, raw, runs, now)
                    return True
                conn.deliver_to(arrived)
                try:
                    while True:
                        try:
                            with trio.move_on_at(last[0] + idle) as waiting:
                                raw = await conn.recv()
                        except TransportError:
                            break
                        if waiting.cancelled_caught:
                            if conn.busy or trio.current_time() < last[0] + idle:   # requests came meanwhile
                                if conn.busy:
                                    last[0] = trio.current_time()
                                continue
                            log.info("closing connection from %s: idle for %ss", conn.peer, idle)
                            await conn.aclose()
                            break
                        last[0] = trio.current_time()
                        if conn.busy >= limit:
                            if not await self._busy(conn, raw, limit):
                                break
                            continue
                        self._dispatch(nursery, conn, raw, runs, last[0])
                finally:
                    conn.deliver_to(None)     # the nursery is about to close to new arrivals
        finally:
            self._forget(conn)

    async def _busy(self, conn: Connection, raw: bytes, limit: int) -> bool:
        """Answer a request over the connection's in-flight limit BUSY, inline; False: the peer does not
        read its answers (not sent within ``peer_timeout``), the connection is dropped."""
        self.counters.requests += 1
        self.counters.busy_inflight += 1
        if self.counters.busy_inflight % 1000 == 1:
            log.warning("%s has %d requests in flight (max_inflight %d): answering BUSY (%d so far)",
                        conn.peer, conn.busy, limit, self.counters.busy_inflight)
        try:
            h, _payload = decode_message(raw)
            resp = h.reply(Result.BUSY, arg=limit)
        except ProtocolError:
            resp = Header(opcode=raw[3] if len(raw) > 3 else 0, req_id=peek_req_id(raw) or 0,
                          result=Result.BUSY, arg=limit)
        await self._send(conn, resp)          # bounded by peer_timeout: else the connection is dropped
        return conn.alive

    def _dispatch(self, nursery: trio.Nursery, conn: Connection, raw: bytes, runs: list, now: float) -> None:
        """Start the request's handler -- or, for an inline append that continues the connection's newest
        run of appends (``AppendRun``), add it to that run: it is handled with it, no task of its own.
        ``runs``: the connection's one-item list holding that run; ``now``: the request's arrival."""
        self.counters.requests += 1
        try:
            h, payload = decode_message(raw)
        except ProtocolError as e:
            self.counters.protocol_errors += 1
            log.warning("malformed header from %s: %s", conn.peer, e)
            opcode = raw[3] if len(raw) > 3 else 0
            resp = Header(opcode=opcode, req_id=peek_req_id(raw) or 0, result=Result.PROTOCOL,
                          arg=PROTOCOL_REASONS.index(e.reason))
            conn.busy += 1                        # an answer in flight counts against max_inflight too
            nursery.start_soon(self._send_counted, conn, resp)
            return
        if trace.ON and h.opcode in (Op.WRITE, Op.READ):
            trace.mark(trace.arrived(h.opcode == Op.READ, h.flags & Flag.FORWARDED), h.extent, h.offset)
        run = runs[0]
        if payload is not None and run is not None and run.join(h, payload, now):
            self.inflight += 1
            conn.busy += 1
            return
        ticket = run = None
        if h.opcode in (Op.WRITE, Op.TRUNCATE):   # ordered by arrival: take the ticket now, synchronously
            part = self.table.get(h.partition)
            lane = part.lane(h.extent) if part is not None else None
            if lane is not None:
                ticket = (lane, lane.ticket())
                if payload is not None:
                    run = runs[0] = AppendRun(h, payload, ticket)
        self.inflight += 1
        conn.busy += 1
        # a follower's lone inline append is done right here when nothing would make it wait (append_now); what
        # _handle refuses before any handler runs goes to it, as every other request does
        if (run is not None and h.flags & Flag.FORWARDED and not self.draining and self.state == "serving"
                and self.data_dir_lost is None and (conn.role is None or not self._forbidden(conn, h))
                and self._append_now(nursery, conn, h, ticket, payload, run, now)):
            return
        nursery.start_soon(self._handle, conn, h, ticket, now, payload, run)

    def _append_now(self, nursery: trio.Nursery, conn: Connection, h: Header, ticket, payload, run: AppendRun,
                    t0: float) -> bool:
        """``DataOps.append_now`` of the request, and its answer sent right away where the connection takes
        it at once (else by a task, as ``_handle`` sends): True; False if it goes as a task, untouched."""
        try:
            resp = self.append_now(conn, h, ticket, payload, run)
        except Exception:  # a bug must cost one request, not the node (as in _handle)
            log.exception("%s from %s failed", h.describe(), conn.peer)
            run.start()
            ticket[0].done(ticket[1])
            resp = h.reply(Result.ERROR)
        if resp is None:
            return False
        if trace.ON:
            trace.mark(trace.replied(False, True), h.extent, h.offset)
        try:
            sent = conn.send_nowait(self.cfg.peer_timeout, resp.encode())
        except ProtocolError:
            sent = False                       # (_send answers it as the bug it is)
        except TransportError as e:
            log.debug("reply to %s lost: %s", conn.peer, e)
            sent = True                        # (the connection is gone, the answer with it)
        if not sent:
            nursery.start_soon(self._send_answer, conn, h, t0, resp)
            return True
        self._answered(conn, h, resp.result, trio.current_time() - t0)
        return True

    async def _send_answer(self, conn: Connection, h: Header, t0: float, resp: Header) -> None:
        try:
            await self._send(conn, resp)
        finally:
            self._answered(conn, h, resp.result, trio.current_time() - t0)

    def _answered(self, conn: Connection, h: Header, result: int, took: float) -> None:
        """A request has been answered (``result``; -1: dropped) ``took`` seconds after it arrived: in the
        metrics, and no longer in flight."""
        self.metrics.observe(h.opcode, result, h.length, took)
        self.inflight -= 1
        conn.busy -= 1
        if self.inflight == 0:
            self._idle.set()

    async def _send_counted(self, conn: Connection, resp: Header) -> None:
        try:
            await self._send(conn, resp)
        finally:
            conn.busy -= 1

    async def _send(self, conn: Connection, *resps: Header) -> None:
        """Answers (a run's several at once: one ``sendmsg`` on TCP)."""
        raws = []
        for resp in resps:
            try:
                raws.append(resp.encode())
            except ProtocolError as e:                # a field out of range: a bug, answered as one
                log.error("reply %s to %s does not encode (%s): answering ERROR", resp.describe(), conn.peer, e)
                raws.append(Header(opcode=resp.opcode, req_id=resp.req_id, result=Result.ERROR).encode())
        try:
            sent = (await conn.send_within(self.cfg.peer_timeout, raws[0]) if len(raws) == 1 else
                    await conn.send_many_within(self.cfg.peer_timeout, raws))
            if not sent:      # a peer that reads no answers is dropped
                log.warning("dropping connection from %s: it has not read its answers for %ss", conn.peer,
                            self.cfg.peer_timeout)
                conn.misbehaved = conn.misbehaved or "did not read its answers"
                await conn.aclose()
        except TransportError as e:
            log.debug("reply to %s lost: %s", conn.peer, e)

    async def _handle(self, conn: Connection, h: Header, ticket, t0: float, payload=None,
                      run: AppendRun | None = None) -> None:
        resp = None
        why = ""
        if run is not None:
            whole = run.start()          # a run of appends: one append of all its bytes, answered one by one
            if whole is None:
                run = None
            else:
                h, payload = whole
        try:
            if self.draining and h.opcode not in (Op.PING,):
                raise Reply(Result.RETRY, why="node is shutting down")
            if self.state != "serving" and h.opcode not in (Op.PING, Op.NODE_STATUS):
                raise Reply(Result.RETRY, why="node is starting (opening its partitions)")
            if self.data_dir_lost is not None and h.opcode in _CHANGES_DATA:
                raise Reply(Result.DISK_ERROR, why=self.data_dir_lost)
            if conn.role is not None:
                self._authorize(conn, h)
            handler = HANDLERS[h.opcode]
            if payload is None:
                resp = await handler(self, conn, h, ticket)
            elif run is None:                    # an inline WRITE (decode_message allows no other)
                resp = await handler(self, conn, h, ticket, payload)
            else:                                # a run of them
                resp = await handler(self, conn, h, ticket, payload, requests=1 + len(run.more))
        except Reply as r:
            why = r.why
            if r.result not in (Result.OK, Result.STALE_EPOCH, Result.NOT_FOUND):
                log.info("%s from %s -> %s %s", h.describe(), conn.peer, r.result.name, r.why)
            resp = h.reply(r.result, arg=r.arg)
        except PeerTimeout as e:
            log.warning("%s from %s: %s: dropping the connection", h.describe(), conn.peer, e)
            conn.misbehaved = conn.misbehaved or "did not serve a one-sided op in time"
            await conn.aclose()
            resp = None
        except TransportError as e:
            # one line per connection is logged where it ends (_on_stream); its other requests only at debug
            (log.debug if not conn.alive else log.warning)("%s from %s: connection failed: %s", h.describe(),
                                                            conn.peer, e)
            resp = None
        except Exception:  # a bug must cost one request, not the node
            log.exception("%s from %s failed", h.describe(), conn.peer)
            resp = h.reply(Result.ERROR)
        finally:
            if ticket is not None:
                ticket[0].done(ticket[1])
            answers = [(h, t0, resp)] if run is None else run.answers(resp, t0)
            try:
                if h.opcode in ADMIN_ACTIONS:   # on file before the answer: whoever got one can find its line
                    await self.audit.record(peer=conn.peer, role=conn.role, identity=conn.identity,
                                            op=Op(h.opcode).name, partition=h.partition, epoch=h.epoch,
                                            result=Result(resp.result).name if resp is not None else "DROPPED",
                                            detail=why or AUDIT_NOTE.get())
                replies = [r for _h, _t, r in answers if r is not None]
                if replies:     # still in flight until answered: a drain must not cancel the reply
                    if trace.ON and h.opcode in (Op.WRITE, Op.READ):   # before the send: the peer may see it first
                        step = trace.replied(h.opcode == Op.READ, h.flags & Flag.FORWARDED)
                        for a_h, _t, _r in answers:
                            trace.mark(step, a_h.extent, a_h.offset)
                    await self._send(conn, *replies)
            finally:
                now = trio.current_time()
                for a_h, a_t0, r in answers:
                    self._answered(conn, a_h, r.result if r is not None else -1, now - a_t0)

    async def install_view(self, pid: int, replicas: list[str], epoch: int) -> bool:
        """Adopt a higher epoch and its replica list (False if ``epoch`` is not above ours)."""
        async with self._view_lock:
            part = self.table.get(pid)
            if part is None or epoch <= part.epoch:
                return False
            part.replicas, part.epoch = list(replicas), epoch
            await self._store(part.save)
        self.repair.kick()                   # leadership may have moved here (or away)
        if self.agent is not None:
            self.agent.changed()
        log.info("partition %d now epoch %d replicas %s", part.pid, epoch, ",".join(replicas))
        return True

    async def drop_partition(self, pid: int) -> None:
        """Delete a partition and its data (idempotent)."""
        async with self._view_lock:
            if self.table.get(pid) is None:
                return
            await self._store(self.table.delete, pid)
        log.info("partition %d deleted (its data is kept in the trash for %ss)", pid, self.cfg.trash_retention_s)
        if self.agent is not None:
            self.agent.changed()

    def disk(self) -> dict:
        """Capacity and use of the file system holding ``data_dir`` (bytes)."""
        try:
            st = os.statvfs(self.cfg.data_dir)
        except OSError as e:
            return {"path": self.cfg.data_dir, "error": str(e)}
        return {"path": self.cfg.data_dir, "total": st.f_blocks * st.f_frsize,
                "used": (st.f_blocks - st.f_bfree) * st.f_frsize, "free": st.f_bavail * st.f_frsize}

    _LEADER_ONLY = frozenset({Op.WRITE, Op.TRUNCATE, Op.CREATE_EXTENT, Op.MARK_DELETE})

    def _authorize(self, conn: Connection, h: Header) -> None:
        """The connection's proven role must be one the request's opcode accepts (protocol.OP_ROLES), and a
        forwarded change must come from the partition's current leader (the identity proven in the hello)."""
        why = self._forbidden(conn, h)
        if why:
            self.counters.forbidden += 1
            raise Reply(Result.FORBIDDEN, why=why)

    def _forbidden(self, conn: Connection, h: Header) -> str:
        """Why ``_authorize`` refuses the request ("": it does not)."""
        if conn.role not in roles_for(h):
            return (f"role {conn.role.name.lower()} may not send "
                    f"{'forwarded ' if h.flags & Flag.FORWARDED else ''}{Op(h.opcode).name}")
        if h.flags & Flag.FORWARDED and h.opcode in self._LEADER_ONLY:
            part = self.table.get(h.partition)
            if part is not None and part.leader != conn.identity:
                return (f"forwarded {Op(h.opcode).name} from node {conn.identity}, but the leader of partition "
                        f"{part.pid} is {part.leader}")
        return ""

    def pool_stats(self, reveal: bool = True) -> dict:
        """The pool's figures; its rkey and base address only when ``reveal`` (to admins, or with
        authentication off): a peer has no use for them (it reaches our memory only through grants)."""
        out = {**self.pool.stats(), "registered_once": True,
               "remote_write": bool(self.region.access & Access.REMOTE_WRITE), "grants_required": True}
        if reveal:
            out.update(rkey=self.region.rkey, base_addr=self.pool.base_addr)
        return out

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
            self.data_dir_lost = (f"data directory {path} {why} while the node was running: the files it has "
                                  f"open are not the ones a restart would find, so it refuses writes; restart "
                                  f"it on its data directory")
            log.error("%s", self.data_dir_lost)
            if self.agent is not None:
                log.error("leaving the cluster map (etcd): this node cannot keep what it would acknowledge")
                self._agent_scope.cancel()
            return

    async def _run_agent(self) -> None:
        with self._agent_scope:
            await self.agent.run()

    async def _keep_trash(self) -> None:
        """Purges partitions deleted (or removed from) more than ``trash_retention_s`` ago."""
        every = max(1.0, min(3600.0, self.cfg.trash_retention_s / 4))
        while True:
            await trio.sleep(every)          # not at start: a restarting node has more urgent things to do
            await trio.to_thread.run_sync(self.table.purge_trash, self.cfg.trash_retention_s)

    def status(self, *, asking: int = 0, reveal: bool = True) -> dict:
        """The node's state; ``asking``: requests of the asker's own to leave out of ``inflight``;
        ``reveal``: the pool's rkey and address too (admins, or authentication off)."""
        return {"node": self.me, "state": self.state, "opening": self.opening.to_dict(), "pid": os.getpid(),
                "uptime_s": round(time.time() - self.started, 1),
                "auth": "on" if self.server_auth.creds is not None else "off",
                "tls": ("required" if self.cfg.tls_required else "offered") if self.server_auth.tls else "off",
                "refused_connections": self.refused_connections, "client_connections": self.client_conns,
                "transport": self.cfg.transport, "sync": self.cfg.sync,
                "rdma_device": getattr(self.domain.device, "name", None),
                "rdma_windows": getattr(self.domain.device, "windows_state", None), "draining": self.draining,
                "inflight": self.inflight - asking, "partitions": sorted(self.table.parts),
                "data_dir_lost": self.data_dir_lost,
                "disk": self.disk(),
                "connections": [c.info() for c in list(self.conns)],
                "loop_lag": self.metrics.loop_lag.to_dict(), "gc": self.metrics.gc.to_dict(),
                "write_stages": self.metrics.write_stages.to_dict(),
                "counters": {**dataclasses.asdict(self.counters), **dataclasses.asdict(self.replication.counters),
                             **dataclasses.asdict(self.commit.counters),
                             **self.table.store_counts(),
                             "answers_refused": self.answers_refused(),
                             **dataclasses.asdict(self.repair.counters)},
                "pool": self.pool_stats(reveal)}


# what a node whose data directory is gone refuses (_watch_data_dir): everything that writes under it -- the
# extent changes a leader alone takes from clients, and the admin ops that change partitions or the trash
_CHANGES_DATA = Node._LEADER_ONLY | {Op.PARTITION_CREATE, Op.PARTITION_UPDATE, Op.PARTITION_DELETE,
                                     Op.TRASH_RESTORE, Op.TRASH_PURGE}
DATA_DIR_CHECK_S = 1.0       # how often a node looks at its data directory (one stat)

HANDLERS = {Op[name].value: fn for group in (DataOps, AdminOps, RepairOps) for name, fn in group.HANDLERS.items()}
assert set(HANDLERS) == {op.value for op in Op}, "every opcode has exactly one handler"
