"""Simulated datanodes: hundreds in one process, each speaking what the manager and etcd see of a real node.

A real datanode holds data, fsyncs views and runs a repair worker per led partition; a hundred of them do not
fit a 2-core machine, so the manager's behaviour at cluster scale (hundreds of nodes, tens of thousands of
partitions) could not be measured.  A ``SimNode`` keeps no data -- its partitions are views in memory -- and
answers at once, but what crosses a process boundary is the real thing:

* **etcd**: its own lease (``lease_ttl_s``) and registration key ``nodes/<addr>`` under it, sealed with the
  cluster secret's MAC, listing the partitions held with their epochs and replicas, re-published on change
  at the datanode's own pace (``REPUBLISH_BYTES_PER_S``, datanode/etcdagent.py).  A killed node stops its
  keepalives and so leaves etcd only when its lease expires, as after ``kill -9``.  etcd itself runs without
  authentication here: per-node etcd users cost a bcrypt login each (seconds of etcd CPU for hundreds of
  nodes) and measure nothing about the manager; the map's entries are still sealed and checked.
* **the wire**: a TCP listener per node, the real hello and cluster-secret authentication
  (wire/transport/connect.py ``accept``), and the admin requests the manager sends: ``PARTITION_CREATE``,
  ``PARTITION_UPDATE``, ``PARTITION_UPDATE_MANY`` (answer bitmask as a node's), ``PARTITION_DELETE``,
  ``PARTITION_LIST``, ``PARTITION_HEALTH``, ``REPAIR``, ``REPLICA_STATE``, ``NODE_HEALTH``, ``NODE_STATUS``,
  ``PING``; JSON bodies and answers move by the same one-sided reads and writes.
* **the map**: views etcd holds that name a node are installed on it (and a copy a newer view no longer names
  is dropped), as a datanode's agent does -- through one shared watch for the whole process rather than one
  per node, so etcd carries one stream, not hundreds.

What is simulated: health between sim nodes is a lookup in this process (a leader's follower is "healthy"
when that node is up and holds the partition at the leader's epoch: an instant refill), where real nodes
exchange one ``NODE_HEALTH`` per node pair and heartbeat.  So the figures a sim gives are the manager's and
etcd's, not the datanodes'.
"""
from __future__ import annotations

import http.client
import json
import logging
import os

import trio

from datanode.etcdagent import REPUBLISH_BYTES_PER_S, RESYNC_S
from wire.auth import Credentials
from wire.etcdmap import Etcd, EtcdError, PartView, open_channel, parse_urls
from wire.protocol import (BodyError, Header, Op, ProtocolError, Result, Role, decode_message, decode_view,
                           decode_views)
from wire.transport.base import Domain, TransportError
from wire.transport.connect import ServerAuth, accept

log = logging.getLogger(__name__)
CAPACITY = 1 << 40          # what a sim node says its disk holds (all free: placement never skips one)
SLOTS = 64
MAX_JSON = 1 << 20
KEEPERS = 8                 # threads keeping the nodes' leases alive, each over its own connection
SEND_S = 5.0                # an answer the peer does not take within this long ends its connection


class Refused(Exception):
    def __init__(self, result: Result, arg: int = 0):
        super().__init__(result.name)
        self.result, self.arg = result, arg


class SimPart:
    __slots__ = ("pid", "replicas", "epoch", "synced")

    def __init__(self, pid: int, replicas: list[str], epoch: int, synced: bool = True):
        self.pid, self.replicas, self.epoch, self.synced = pid, list(replicas), epoch, synced

    @property
    def leader(self) -> str:
        return self.replicas[0]


class SimNode:
    """One simulated datanode (``SimCluster`` makes and runs them)."""

    def __init__(self, cluster: "SimCluster", listener: trio.SocketListener):
        self.cluster = cluster
        host, port = listener.socket.getsockname()[:2]
        self.addr = f"{host}:{port}"
        self.listener = listener
        self.parts: dict[int, SimPart] = {}
        self.alive = True
        self.scope = trio.CancelScope()
        self.registered = False
        self.lease_id = 0
        self.lease_lost = trio.Event()
        self.requests = 0
        self.free = CAPACITY
        self._changed = trio.Event()
        self.auth = ServerAuth(cluster.creds, identity=self.addr)

    # -- the partitions ------------------------------------------------------------------------------
    def changed(self) -> None:
        self._changed.set()

    def touch(self) -> None:
        """Something in the registration changes (the free bytes): one event for the manager, no partition."""
        self.free = CAPACITY - CAPACITY // 50 if self.free == CAPACITY else CAPACITY
        self.changed()

    def install(self, pid: int, replicas: list[str], epoch: int) -> bool:
        """A newer view naming this node (True: installed, or held already at that epoch and replicas)."""
        part = self.parts.get(pid)
        if part is None or self.addr not in replicas:
            return False
        if epoch <= part.epoch:
            return epoch == part.epoch and part.replicas == replicas
        part.replicas, part.epoch = list(replicas), epoch
        self.changed()
        return True

    def drop(self, pid: int, epoch: int) -> None:
        part = self.parts.get(pid)
        if part is not None and epoch > part.epoch:
            del self.parts[pid]
            self.changed()

    def record(self) -> dict:
        return {"addr": self.addr, "pid": os.getpid(), "transport": "tcp", "zone": "", "capacity_bytes": CAPACITY,
                "free_bytes": self.free,
                "partitions": {str(p.pid): {"epoch": p.epoch, "replicas": list(p.replicas)}
                               for p in self.parts.values()}}

    # -- running -------------------------------------------------------------------------------------
    async def run(self) -> None:
        with self.scope:
            async with trio.open_nursery() as n:
                n.start_soon(self._register_loop)
                await trio.serve_listeners(self._on_stream, [self.listener], handler_nursery=n)
        self.alive = False

    def kill(self) -> None:
        """As ``kill -9``: connections and listener close, keepalives stop, the lease expires in etcd."""
        self.alive = False
        self.scope.cancel()

    async def _register_loop(self) -> None:
        etcd = self.cluster.etcd
        delay = 0.5
        while True:
            try:
                self.lease_id = await etcd.grant(self.cluster.lease_ttl_s)
                self.lease_lost = trio.Event()
                last = self.record()
                await etcd.put_entry(etcd.node_key(self.addr), last, self.lease_id)
                self.registered = True
                delay = 0.5
                async with trio.open_nursery() as n:
                    n.start_soon(self._republish, self.lease_id, last)
                    await self.lease_lost.wait()      # (kept alive by the cluster's LeaseKeeper)
                    n.cancel_scope.cancel()
                log.warning("sim %s: lease %x lost: registering again", self.addr, self.lease_id)
                self.registered = False
            except EtcdError as e:
                self.registered = False
                log.warning("sim %s: etcd registration: %s", self.addr, e)
                delay = min(delay * 2, 5.0)
            await trio.sleep(delay)

    async def _republish(self, lease: int, last: dict) -> None:
        """As datanode/etcdagent.py: a burst of changes coalesced, at most about REPUBLISH_BYTES_PER_S."""
        etcd = self.cluster.etcd
        next_at = trio.current_time()
        while True:
            self._changed = trio.Event()
            await self._changed.wait()
            await trio.sleep(0.05)
            await trio.sleep_until(next_at)
            rec = self.record()
            if rec == last:
                continue
            try:
                await etcd.put_entry(etcd.node_key(self.addr), rec, lease)
                last = rec
                self.cluster.republished += 1
                next_at = trio.current_time() + len(json.dumps(rec)) / REPUBLISH_BYTES_PER_S
            except EtcdError as e:
                log.warning("sim %s: publishing: %s", self.addr, e)
                self._changed.set()

    # -- the wire ------------------------------------------------------------------------------------
    async def _on_stream(self, stream: trio.SocketStream) -> None:
        try:
            host, port = stream.socket.getpeername()[:2]
        except OSError:
            return
        try:
            async with accept(stream.socket, f"{host}:{port}", self.cluster.domain, transport="tcp", slots=SLOTS,
                              auth=self.auth) as conn:
                async with trio.open_nursery() as n:
                    while True:
                        raw = await conn.recv()
                        n.start_soon(self._handle, conn, raw)
        except (TransportError, ProtocolError, OSError, trio.BrokenResourceError, trio.ClosedResourceError,
                trio.TooSlowError) as e:
            log.debug("sim %s: connection from %s:%s ended: %s", self.addr, host, port, e)

    async def _handle(self, conn, raw: bytes) -> None:
        self.requests += 1
        try:
            h, _payload = decode_message(raw)
        except ProtocolError:
            return
        try:
            resp = await self._answer(conn, h)
        except Refused as e:
            resp = h.reply(e.result, arg=e.arg)
        except BodyError:
            resp = h.reply(Result.BAD_BODY)
        try:
            await conn.send_within(SEND_S, resp.encode())
        except TransportError:
            pass

    async def _body(self, conn, h: Header):
        if not h.length or h.length > MAX_JSON:
            raise Refused(Result.BAD_BODY)
        buf = bytearray(h.length)
        await conn.read(h.remote.slice(0, h.length), memoryview(buf), None)
        try:
            return json.loads(buf)
        except ValueError:
            raise Refused(Result.BAD_BODY) from None

    async def _json(self, conn, h: Header, obj) -> Header:
        data = json.dumps(obj).encode()
        if len(data) > h.rlen:
            raise Refused(Result.SHORT_BUFFER, len(data))
        if data:
            await conn.write(memoryview(data), None, h.remote.slice(0, len(data)))
        return h.reply(Result.OK, length=len(data))

    def _hosted(self, h: Header) -> SimPart:
        part = self.parts.get(h.partition)
        if part is None:
            raise Refused(Result.NOT_FOUND)
        return part

    async def _answer(self, conn, h: Header) -> Header:
        op = h.opcode
        if op == Op.PING:
            return h.reply(Result.OK)
        if op == Op.PARTITION_CREATE:
            replicas, epoch = decode_view(await self._body(conn, h))
            if self.addr not in replicas:
                raise Refused(Result.BAD_BODY)
            old = self.parts.get(h.partition)
            if old is not None:
                if old.replicas == replicas and old.epoch == epoch:
                    return h.reply(Result.OK, arg=epoch)
                raise Refused(Result.EXISTS, old.epoch)
            self.parts[h.partition] = SimPart(h.partition, replicas, epoch, synced=epoch == 1)
            self.changed()
            return h.reply(Result.OK, arg=epoch)
        if op == Op.PARTITION_UPDATE:
            part = self._hosted(h)
            replicas, epoch = decode_view(await self._body(conn, h))
            if self.addr not in replicas:
                self.drop(part.pid, epoch)
                return h.reply(Result.OK, arg=epoch)
            if not self.install(part.pid, replicas, epoch):
                raise Refused(Result.STALE_EPOCH, part.epoch)
            return h.reply(Result.OK, arg=epoch)
        if op == Op.PARTITION_UPDATE_MANY:
            views = decode_views(await self._body(conn, h))
            missed = 0
            for i, (pid, replicas, epoch) in enumerate(views):
                if not self.install(pid, replicas, epoch):
                    missed |= 1 << i
            self.cluster.batches += 1
            return h.reply(Result.OK, arg=missed)
        if op == Op.PARTITION_DELETE:
            self._hosted(h)
            del self.parts[h.partition]
            self.changed()
            return h.reply(Result.OK)
        if op == Op.PARTITION_LIST:
            return await self._json(conn, h, [
                {"id": p.pid, "replicas": p.replicas, "epoch": p.epoch, "synced": p.synced, "volume": "",
                 "leader": p.leader, "role": "leader" if p.leader == self.addr else "follower", "extents": 0,
                 "bytes": 0, "sealed_extents": [], "state": "read-write", "health": {}}
                for p in self.parts.values()])
        if op == Op.PARTITION_HEALTH:
            if h.partition == 0:           # every partition led here at once, as a datanode's fill summary
                return await self._json(conn, h, self.fill_summary())
            return await self._json(conn, h, self.health(self._hosted(h)))
        if op == Op.REPAIR:
            part = self._hosted(h)
            if part.leader != self.addr:
                raise Refused(Result.NOT_LEADER)
            return h.reply(Result.OK, arg=1)
        if op == Op.REPLICA_STATE:
            part = self._hosted(h)
            return await self._json(conn, h, {"token": _token(part), "epoch": part.epoch, "replicas": part.replicas,
                                              "synced": part.synced, "cuts": 0, "marks": {}, "digests": {},
                                              "deleted": [], "sealed": []})
        if op == Op.NODE_HEALTH:
            asker = conn.identity if conn.role != Role.ADMIN else ""
            tokens = sorted([p.pid, _token(p)] for p in self.parts.values()
                            if p.pid >= h.arg and (not asker or p.leader == asker))
            return await self._json(conn, h, {"tokens": tokens, "next": None})
        if op == Op.NODE_STATUS:
            return await self._json(conn, h, {"node": self.addr, "state": "serving", "sim": True,
                                              "partitions": sorted(self.parts)})
        raise Refused(Result.NOT_FOUND)

    def health(self, part: SimPart) -> dict:
        """PARTITION_HEALTH as a leader answers it: a follower is healthy when its node is up and holds the
        partition at our epoch (a sim's refill is instant)."""
        out = {"id": part.pid, "node": self.addr, "epoch": part.epoch, "replicas": part.replicas,
               "leader": part.leader, "role": "leader" if part.leader == self.addr else "follower"}
        if part.leader != self.addr:
            out["note"] = "replica health is kept by the leader; ask it"
            return out
        followers = []
        for a in part.replicas[1:]:
            peer = self.cluster.nodes.get(a)
            theirs = peer.parts.get(part.pid) if peer is not None and peer.alive else None
            ok = theirs is not None and theirs.epoch == part.epoch
            followers.append({"addr": a, "state": "healthy" if ok else "unreachable"})
        out.update(followers=followers, repair={"running": False}, state="healthy")
        return out


    def fill_summary(self) -> dict:
        """PARTITION_HEALTH of partition 0 (datanode/repair.py ``fill_summary``'s shape):
        {"partitions": {id: [epoch, {follower: state}, repair running]}} for each partition led here."""
        out = {}
        for part in self.parts.values():
            if part.leader == self.addr:
                h = self.health(part)
                out[str(part.pid)] = [part.epoch, {f["addr"]: f["state"] for f in h["followers"]}, False]
        return {"partitions": out}


def _token(part: SimPart) -> int:
    return hash((part.epoch, 0, 0, part.synced)) & ((1 << 63) - 1)


class SimCluster:
    """``count`` sim nodes on ``host`` (free ports), registered in etcd ``url`` under ``prefix``; ``secret``: the
    cluster secret's Credentials (hellos authenticated, entries sealed), None for neither."""

    def __init__(self, url: str, count: int, *, secret: Credentials | None = None, prefix: str = "/datanode",
                 lease_ttl_s: int = 3, host: str = "127.0.0.1"):
        self.creds = secret
        self.count = count
        self.host = host
        self.lease_ttl_s = lease_ttl_s
        self.etcd = Etcd(url, prefix, timeout=max(1.0, lease_ttl_s / 2),
                         admin_key=secret.key(Role.ADMIN) if secret is not None else None)
        self.domain = Domain()
        self.nodes: dict[str, SimNode] = {}
        self.views: dict[int, PartView] = {}     # the last view of each partition the shared watch saw
        self.batches = 0                          # PARTITION_UPDATE_MANY requests answered
        self.republished = 0                      # registrations rewritten
        self.keepalives = 0

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Start every node (listening and registering), then follow ``parts/`` until cancelled."""
        async with trio.open_nursery() as n:
            for _ in range(self.count):
                listener, = await trio.open_tcp_listeners(0, host=self.host)
                node = SimNode(self, listener)
                self.nodes[node.addr] = node
                n.start_soon(node.run)
            n.start_soon(self._watch)
            n.start_soon(self._resync_loop)
            n.start_soon(self._keep_leases)
            with trio.fail_after(60 + self.count / 10):
                while not all(x.registered for x in self.nodes.values()):
                    await trio.sleep(0.1)
            task_status.started(self)

    def kill(self, addr: str) -> None:
        self.nodes[addr].kill()

    # -- leases: every node's own, kept alive together ---------------------------------------------------
    async def _keep_leases(self) -> None:
        """Each registered node's lease refreshed every TTL/3, as a datanode does -- but by a few worker
        threads, each over one HTTP connection for its share of the nodes: hundreds of keepalives a second,
        each a thread hop and a ``requests`` call, would take the process more CPU than everything else it
        does.  etcd sees the same requests.  A lease etcd says has expired (the process was too busy) makes
        its node register anew, as a datanode does."""
        (_scheme, host, port), = parse_urls(self.etcd.urls.split(",")[0])
        conns: dict[int, http.client.HTTPConnection] = {}

        def keep(k: int, ids: list[int]) -> list[int]:
            out = []
            for lease in ids:
                for again in (True, False):
                    try:
                        if k not in conns:
                            conns[k] = http.client.HTTPConnection(host, port, timeout=5)
                        conns[k].request("POST", "/v3/lease/keepalive", body=json.dumps({"ID": lease}),
                                         headers={"Content-Type": "application/json"})
                        doc = json.loads(conns[k].getresponse().read())
                        out.append(int(doc.get("result", {}).get("TTL", -1)))
                        break
                    except (OSError, ValueError, http.client.HTTPException):
                        conns.pop(k, None)
                        if not again:
                            out.append(0)        # no word from etcd: not an expiry
            return out

        async def share(k: int, nodes: list[SimNode]) -> None:
            ttls = await trio.to_thread.run_sync(keep, k, [x.lease_id for x in nodes])
            for node, ttl in zip(nodes, ttls):
                if ttl < 0:
                    node.lease_lost.set()
        while True:
            t0 = trio.current_time()
            live = [x for x in self.nodes.values() if x.alive and x.registered and x.lease_id]
            async with trio.open_nursery() as n:
                for k in range(KEEPERS):
                    n.start_soon(share, k, live[k::KEEPERS])
            self.keepalives += len(live)
            await trio.sleep_until(t0 + self.lease_ttl_s / 3)

    # -- the shared view of parts/ (what each node's agent would do with its own watch) ----------------
    async def _watch(self) -> None:
        send, recv = open_channel()
        async with trio.open_nursery() as n:
            n.start_soon(self.etcd.watch, self.etcd.parts_prefix, send)
            async for batch in recv:
                if batch is None:
                    await self._resync()
                    continue
                for typ, key, value, rev in batch:
                    if typ == "PUT":
                        v = self.etcd.open(key, value, rev)
                        if v is not None:
                            self.apply(v)

    async def _resync_loop(self) -> None:
        while True:
            await trio.sleep(RESYNC_S)
            await self._resync()

    async def _resync(self) -> None:
        try:
            kvs, _rev = await self.etcd.get_prefix(self.etcd.parts_prefix)
        except EtcdError as e:
            log.debug("sim: parts/ re-read: %s", e)
            return
        for key, value, mod in kvs:
            v = self.etcd.open(key, value, mod)
            if v is not None:
                self.apply(v)

    def apply(self, v: PartView) -> None:
        old = self.views.get(v.id)
        if old is not None and old.epoch > v.epoch:
            return
        self.views[v.id] = v
        for a in v.replicas:
            node = self.nodes.get(a)
            if node is not None and node.alive:
                node.install(v.id, v.replicas, v.epoch)
        for a in (old.replicas if old is not None else []):
            node = self.nodes.get(a)
            if a not in v.replicas and node is not None and node.alive:
                node.drop(v.id, v.epoch)

    # -- what a bench asks ---------------------------------------------------------------------------
    def led_by(self, addr: str) -> list[int]:
        return [p.pid for p in self.nodes[addr].parts.values() if p.leader == addr]

    def writable(self, pid: int, dead: str) -> bool:
        """Partition ``pid`` could take a write without ``dead``: a live leader holds a view without it, and
        every replica of that view is up and holds it at that epoch."""
        v = self.views.get(pid)
        if v is None or dead in v.replicas:
            return False
        for a in v.replicas:
            node = self.nodes.get(a)
            p = node.parts.get(pid) if node is not None and node.alive else None
            if p is None or p.epoch != v.epoch or p.replicas != v.replicas:
                return False
        return True
