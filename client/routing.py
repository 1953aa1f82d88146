"""Where each partition is: its replicas (the leader first) and epoch, as the client knows them.

Learnt from the datanodes (``discover``: a node's PARTITION_LIST) or, with ``etcd``, from the cluster map
(wire/etcdmap.py): read once, then kept current -- by long polls of one datanode's copy of etcd's entries
(MAP_READ: ``load_nodes``, ``follow_nodes``) or by a watch of etcd (``load``, ``follow``) -- so a new leader or
replica set is known within one round-trip.  A view from etcd is taken only once checked (wire/mapcheck.py): well-formed, with the
manager's MAC when the client holds the cluster secret or an admin key, its epoch not back nor too far
ahead of the one known, adding only registered nodes; anything else is logged, counted
(``datanode_client_etcd_invalid_values_total`` in ``dc.metrics``) and ignored.  A partition's open extents
belong to the view they were opened in: whenever a view may have changed, ``on_stale(pid)`` tells the writer
to start new ones.
"""
from __future__ import annotations

import json
import logging
import random
from functools import partial
from typing import Callable

import trio

from client.channel import Channel, ClientError, PartitionInfo, transport_error, check
from wire.etcdmap import Etcd, EtcdError, EtcdUnreachable, PartView, open_channel
from wire.protocol import OP_SINCE, Header, Op, Result
from wire.transport.base import TransportError

log = logging.getLogger(__name__)
MAP_ANSWER = 256 << 10      # bytes of answer buffer for one MAP_READ (the node pages the map to fit it)
MAP_WAIT_S = 5.0            # a MAP_READ waits this long at most for a change (well inside a request's timeout)
# "Write the rest elsewhere": a partition a write just failed on is passed over this long while another can
# take the write (put, and dnfs's flushes).  Writes there keep failing until the manager gives it a new view,
# which takes its lease TTL (3 s) + down_after (1 s) + an install: twice that, so a slow failover is not
# hammered; a new view ends it sooner where the writer follows the map (put).
AVOID_S = 10.0


class NoMapHere(ClientError):
    """The node does not serve the map at all (an older version, or no etcd configured): ask another, or etcd."""


class PartitionMap:
    """The partitions this client knows, by id, and the requests that keep them current."""

    def __init__(self, channel: Channel, etcd: Etcd | None):
        self.channel = channel
        self.etcd = etcd                                        # the cluster map in etcd, if any
        self.partitions: dict[int, PartitionInfo] = {}
        self.views: dict[int, PartView] = {}                    # etcd's views (state, want, ...)
        self.volumes: dict[int, str] = {}       # pid -> its volume ("": none), as its nodes list it (discover)
        self.changed = trio.Event()             # set (and replaced) whenever a view is learnt
        self.map_nodes: list[str] = []          # followed through these datanodes (MAP_READ), not etcd's watch
        self.map_node = ""                      # ... the one asked now
        self.map_rev = 0                        # the etcd revision the map is known up to
        self.map_fresh = True                   # the node last asked was in touch with etcd
        self.on_stale: Callable[[int], None] = lambda pid: None

    def partition(self, pid: int) -> PartitionInfo:
        try:
            return self.partitions[pid]
        except KeyError:
            raise ClientError(f"partition {pid} is unknown (known: {sorted(self.partitions)})",
                              Result.NOT_FOUND) from None

    async def discover(self, addr: str) -> list[PartitionInfo]:
        found = []
        for p in await self.channel.admin(addr, Op.PARTITION_LIST):
            info = PartitionInfo(p["id"], p["replicas"], p["epoch"])
            self.volumes[info.pid] = p.get("volume") or ""      # set at creation, never changed
            old = self.partitions.get(info.pid)
            if addr == info.replicas[0] and p.get("health"):      # only the leader keeps replica health
                info.health, info.seen = p["health"], trio.current_time()
            elif old is not None and old.epoch == info.epoch:
                info.health, info.seen = old.health, old.seen
            if old is None or info.epoch >= old.epoch:
                self.partitions[info.pid] = info
            found.append(info)
        return found

    async def load(self) -> int:
        """Read every partition's view from etcd; returns the revision it was read at."""
        kvs, rev = await self.etcd.get_prefix(self.etcd.parts_prefix)
        for k, v, mrev in kvs:
            await self.accept(self.etcd.open(k, v, mrev))
        return rev

    async def load_by(self, deadline: float) -> int:
        """``load``, tried again while etcd does not answer (its login or read timed out, or the connection
        was refused) until ``deadline``: many clients starting at once queue at etcd, and one that gave up
        at its first timeout would only come back later with the same login.  The waits grow and are
        jittered, so clients that failed together do not return together.  A refusal (credentials,
        permissions) is not retried.  EtcdError says what was waited for, and for how long."""
        start, delay, tries = trio.current_time(), 0.1, 0
        while True:
            tries += 1
            try:
                return await self.load()
            except EtcdUnreachable as e:
                now = trio.current_time()
                pause = random.uniform(delay / 2, delay)
                if now + pause >= deadline:
                    raise EtcdUnreachable(f"etcd did not answer the login and read of the map in "
                                          f"{now - start:.1f} s ({tries} attempts; last: {e})") from None
                log.info("partition map: %s; trying again in %.2f s", e, pause)
                await trio.sleep(pause)
                delay = min(delay * 2, 2.0)

    # -- the map from the datanodes (each node's copy of parts/: datanode/mapcopy.py) ------------------
    async def read_node(self, addr: str, wait: float = 0.0) -> int:
        """Learn from ``addr`` every ``parts/`` entry changed after ``map_rev`` -- waiting up to ``wait``
        for one when there is none -- and return the revision now known.  Each entry is checked as one read
        from etcd is (``Etcd.open``, ``accept``): the node passes on what etcd holds, MACs included, so it
        cannot make us take a view the manager did not seal.  ClientError: the node cannot serve the map."""
        try:
            link = await self.channel.links.get(addr)
        except TransportError as e:
            raise transport_error(addr, e) from None      # (a refused hello says so: ``auth``)
        if link.conn.version < OP_SINCE[Op.MAP_READ]:
            raise NoMapHere(f"{addr}: protocol version {link.conn.version} has no MAP_READ", node=addr)
        while True:
            h = Header(opcode=Op.MAP_READ, offset=self.map_rev, arg=int(wait * 1000))
            # a long poll holds its answer buffer: a small share of the pool, so other requests go on
            answer = min(MAP_ANSWER, self.channel.rpool.arena_bytes // 8)
            resp, data = await self.channel.request(addr, h, answer=answer, timeout=wait + self.channel.timeout)
            if resp.result == Result.NOT_FOUND:
                raise NoMapHere(f"{addr}: {resp.result_text()}", Result.NOT_FOUND, addr)
            check(resp, addr)
            try:
                page = json.loads(data)
                entries, rev = [(str(k), str(v).encode(), int(m)) for k, v, m in page["entries"]], int(page["rev"])
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise ClientError(f"{addr}: a malformed map answer ({type(e).__name__})", node=addr) from None
            if not page.get("ready"):
                raise ClientError(f"{addr}: has not read the map from etcd yet", node=addr)
            self.map_fresh = bool(page.get("fresh", True))
            for key, value, mod in entries:
                if key.startswith(self.etcd.parts_prefix):
                    await self.accept(self.etcd.open(key, value, mod))
            self.map_rev = max(self.map_rev, rev)
            if not page.get("more"):
                return self.map_rev
            wait = 0.0

    def _candidates(self) -> list[str]:
        """Nodes to follow the map through, the current one first: those given, then every replica known."""
        known = [a for info in self.partitions.values() for a in info.replicas]
        order = list(dict.fromkeys([self.map_node, *self.map_nodes, *known]))
        return [a for a in order if a]

    async def load_nodes(self, nodes: list[str], deadline: float) -> int:
        """Read the whole map from one of ``nodes`` (a random one: clients spread over them) and follow it
        through them from now on.  Many clients starting at once meet the nodes' limits on connections in
        their hello (datanode/ops/admission.py), where every new dial takes the place of an older one: so one
        node is tried at a time, in turn, with growing waits drawn at random from zero up (full jitter), until
        ``deadline``.  ClientError when none serves it by then, at once when every node said it serves no
        map at all (``NoMapHere``)."""
        self.map_nodes = list(nodes)
        order = random.sample(self.map_nodes, len(self.map_nodes))
        errors: dict[str, ClientError] = {}
        delay, turn = 0.2, 0
        while True:
            addr = order[turn % len(order)]
            turn += 1
            try:
                rev = await self.read_node(addr)
            except ClientError as e:
                if e.auth:                      # our credentials: no other node takes them either
                    raise
                errors[addr] = e
            else:
                self.map_node = addr
                return rev
            pause = random.uniform(0, delay)
            none = len(errors) == len(order) and all(isinstance(e, NoMapHere) for e in errors.values())
            if none or trio.current_time() + pause >= deadline:
                raise ClientError("no datanode serves the map: " + "; ".join(map(str, errors.values())))
            await trio.sleep(pause)
            delay = min(delay * 2, 4.0)

    async def follow_nodes(self) -> None:
        """Keep the views current through one node's long polls, moving to the next candidate when it fails;
        after a round in which none answered, etcd once (the fallback), then a jittered pause."""
        delay = 0.2
        while True:
            failed = 0
            for addr in self._candidates():
                try:
                    while True:
                        await self.read_node(addr, MAP_WAIT_S)
                        self.map_node, delay = addr, 0.2
                        if not self.map_fresh:       # cut off from etcd: its copy may not change any more
                            raise ClientError(f"{addr}: not in touch with etcd now", node=addr)
                except ClientError as e:
                    log.info("partition map from %s: %s; trying another node", addr, e)
                    failed += 1
            if failed and self.etcd is not None:
                try:
                    self.map_rev = max(self.map_rev, await self.load())
                except EtcdError as e:
                    log.info("partition map: no node serves it and etcd: %s", e)
            await trio.sleep(random.uniform(delay / 2, delay))
            delay = min(delay * 2, 5.0)

    async def accept(self, view: PartView | None) -> None:
        """Learn a view read from etcd (checked: ``Etcd.open``) if it may follow the one known."""
        old = self.partitions.get(view.id) if view is not None else None
        if old is not None and view.epoch < old.epoch:
            return                  # etcd behind what a node told us (a view set by hand, not adopted yet)
        if old is not None:
            try:
                registered = await self.etcd.registered_for(old.replicas, view)
            except EtcdError as e:
                log.warning("partition %d: etcd's epoch %d not taken now (checking its replicas: %s)", view.id,
                            view.epoch, e)
                return
            if not self.etcd.follows(old.epoch, old.replicas, view, registered):
                return
        if view is not None:
            self.learn(view)

    def learn(self, view: PartView) -> None:
        old = self.partitions.get(view.id)
        if old is None or view.epoch >= old.epoch:
            self.views[view.id] = view
            self.partitions[view.id] = PartitionInfo(view.id, list(view.replicas), view.epoch, rev=view.rev)
            if old is not None and view.epoch > old.epoch:
                self.on_stale(view.id)       # open extents of the old epoch: start new ones
                log.info("partition %d: epoch %d, leader %s (from etcd)", view.id, view.epoch, view.leader)
            ev, self.changed = self.changed, trio.Event()
            ev.set()

    async def follow(self, rev: int) -> None:
        """Keep the views current from etcd's watch, from revision ``rev`` on (runs until cancelled)."""
        send, recv = open_channel()
        async with trio.open_nursery() as n:
            n.start_soon(partial(self.etcd.watch, self.etcd.parts_prefix, send, start_revision=rev + 1))
            async for batch in recv:
                if batch is None:                       # reconnected: events may be missing
                    try:
                        await self.load()
                    except EtcdError:
                        pass
                    continue
                for typ, key, value, mrev in batch:
                    if typ == "PUT":
                        await self.accept(self.etcd.open(key, value, mrev))

    async def await_new_view(self, pid: int, epoch: int, deadline: float, since_rev: int | None = None) -> bool:
        """Wait until the map has partition ``pid`` above ``epoch``, or a newer installed view of it
        (the manager finished installing the one we have) (True), or ``deadline`` (False).  ``since_rev``:
        the revision of the view a failed request used -- a view installed since then counts, even when it
        arrived before this call (a planned leader change: the new leader refused us while the manager was
        still installing, and the installed view came by the watch right after)."""
        v0 = self.views.get(pid)
        rev0 = since_rev if since_rev is not None else v0.rev if v0 is not None else None
        while True:
            info, v = self.partitions.get(pid), self.views.get(pid)
            if info is not None and info.epoch > epoch:
                return True
            if v is not None and v.rev != rev0 and v.installed:
                return True
            ev = self.changed
            with trio.move_on_at(deadline):
                await ev.wait()
            if trio.current_time() >= deadline:
                return False

    async def refresh(self, pid: int) -> PartitionInfo:
        """Re-read the partition's replicas and epoch: from etcd when the map lives there, else from its
        members (after a replica change)."""
        if self.map_nodes:
            # another node than the one followed first: that one may be behind (it said nothing of the change)
            order = self._candidates()
            for addr in order[1:] + order[:1]:
                try:
                    await self.read_node(addr)
                except ClientError as e:
                    log.info("partition %d: the map from %s: %s", pid, addr, e)
                    continue
                self.on_stale(pid)
                return self.partition(pid)
        if self.etcd is not None:
            try:
                view = await self.etcd.part(pid)
            except EtcdError as e:
                log.warning("partition %d: etcd: %s; asking its members", pid, e)
            else:
                if view is not None:
                    await self.accept(view)
                    self.on_stale(pid)
                    return self.partition(pid)
        best: PartitionInfo | None = None
        for addr in list(self.partition(pid).replicas):
            try:
                infos = await self.discover(addr)
            except ClientError:
                continue
            for info in infos:
                if info.pid == pid and (best is None or info.epoch > best.epoch):
                    best = info
        if best is not None:            # the members' newest view wins, even over a newer-looking cache
            self.partitions[pid] = best
        self.on_stale(pid)
        return self.partition(pid)
