"""The datanode: accepts connections, serves requests, replicates writes to the partition's followers.

Follow a write from the client to the disk (``Node.op_write``):

  1. the client SENDs a header naming its buffer (addr, rkey, len) into one of our control slots;
     ``_connection`` decodes it and, for appends, takes a ticket in the extent's lane (arrival order);
  2. we allocate a block from the registered pool and fetch the payload with a one-sided READ from the
     client's buffer straight into the block, then check its CRC32C;
  3. in the extent's turn: check the offset is the extent's end, SEND each follower the same header with
     the descriptor rewritten to name *our pool block* (followers READ it from there: no copy here), and
     persist the block to our extent (fdatasync under ``sync = always``);
  4. wait for every follower's ack (matched on request id, partition, extent, offset, CRC) within
     ``replica_timeout``; reply OK to the client only then; free the block.
  Any failure after the turn began seals the extent (DIVERGED): its replicas may differ, so no more appends.

Repair (``datanode/repair.py``, one task per partition this node leads) reuses step 3 for a follower that
missed writes: in the extent's turn the leader reads the range from its store into a pool block and sends
the follower a forwarded WRITE naming that block (``Flag.REPAIR``); ``TRUNCATE`` cuts back what differs.
"""
from __future__ import annotations

import json
import logging
import os
import pathlib
import signal
import time

import trio

from . import config as config_mod
from .crc import crc32c
from .partition import Partition, PartitionTable
from .repair import Repairer, scrub_range
from .pool import BuddyPool, PoolExhausted
from .protocol import (PROTOCOL_REASONS, Flag, Header, Op, ProtocolError, RemoteBuf, Result,
                       decode, peek_req_id)
from .rpc import Links
from .store import StoreError
from .transport.base import Access, Connection, ConnectionClosed, Domain, RemoteAccessError, TransportError
from .transport.connect import accept, make_domain

log = logging.getLogger("datanode")

STORE_RESULTS = {"not_found": Result.NOT_FOUND, "bad_offset": Result.BAD_REQUEST,
                 "too_large": Result.NO_SPACE, "crc": Result.CRC_MISMATCH, "disk": Result.DISK_ERROR,
                 "exists": Result.BAD_REQUEST, "deleted": Result.NOT_FOUND}
MAX_JSON = 1 << 20


class Reply(Exception):
    """Raised inside a handler to answer with a result code (and arg)."""

    def __init__(self, result: Result, arg: int = 0, why: str = ""):
        self.result, self.arg, self.why = result, arg, why
        super().__init__(why or result.name)


class Node:
    def __init__(self, cfg: config_mod.Config, domain: Domain | None = None):
        self.cfg = cfg
        self.me = cfg.listen
        self.started = time.time()
        try:
            self.domain = domain or make_domain(cfg.transport, cfg.rdma_device or None, cfg.gid_index)
        except TransportError as e:
            raise config_mod.ConfigError(f"config key 'transport': {e}") from None
        self.pool = BuddyPool(cfg.pool_mib << 20, cfg.max_block_kib << 10)
        # The whole arena, registered once; peers may read it (followers fetch forwards), never write.
        self.region = self.domain.register(self.pool.arena, self.pool.base_addr,
                                           Access.LOCAL_WRITE | Access.REMOTE_READ)
        self.table = PartitionTable(pathlib.Path(cfg.data_dir), cfg.sync)
        self.table.load()
        self.conns: set[Connection] = set()
        self.links: Links | None = None      # to followers; set up in serve()
        self.inflight = 0
        self.draining = False
        self._idle = trio.Event()
        self._create_lock = trio.Lock()      # partition creates: check-then-create must not interleave
        self.counters = {"requests": 0, "writes": 0, "write_bytes": 0, "reads": 0, "read_bytes": 0,
                         "forwarded": 0, "replica_writes": 0, "replication_failures": 0,
                         "protocol_errors": 0, "forward_fetch_bytes_by_rkey": {}}
        self._nursery: trio.Nursery | None = None
        self.repair = Repairer(self)         # follower health, repair, scrub (datanode/repair.py)

    # -- lifecycle ------------------------------------------------------------------------------------
    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        cfg = self.cfg
        listeners = await trio.open_tcp_listeners(cfg.port, host=cfg.host)
        log.info("datanode %s serving (pid %d, data_dir %s, pool %d MiB, max block %d KiB, sync=%s, "
                 "transport=%s, %d partitions)", self.me, os.getpid(), cfg.data_dir, cfg.pool_mib,
                 cfg.max_block_kib, cfg.sync, cfg.transport, len(self.table.parts))
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self.links = Links(nursery, self.domain, transport=cfg.transport, slots=cfg.slots,
                                   connect_timeout=cfg.replica_timeout, on_conn=self._track)
                nursery.start_soon(self.repair.run)
                accepting = trio.CancelScope()
                nursery.start_soon(self._accept_loop, listeners, accepting)
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
        finally:
            self.table.close()
            log.info("datanode %s stopped", self.me)

    async def _accept_loop(self, listeners, scope) -> None:
        with scope:
            await trio.serve_listeners(self._on_stream, listeners, handler_nursery=self._nursery)

    async def _on_stream(self, stream: trio.SocketStream) -> None:
        try:
            host, port = stream.socket.getpeername()[:2]
            peer = f"{host}:{port}"
        except OSError:
            return
        try:
            async with accept(stream.socket, peer, self.domain, transport=self.cfg.transport,
                              slots=self.cfg.slots) as conn:
                await self._connection(conn)
        except ConnectionClosed:
            log.debug("connection from %s closed before its hello", peer)   # e.g. a port probe
        except (TransportError, ProtocolError, trio.TooSlowError) as e:
            log.warning("connection from %s: %s", peer, e)

    def _track(self, conn: Connection, opened: bool) -> None:
        (self.conns.add if opened else self.conns.discard)(conn)

    # -- one connection -------------------------------------------------------------------------------
    async def _connection(self, conn: Connection) -> None:
        self.conns.add(conn)
        try:
            async with trio.open_nursery() as nursery:
                while True:
                    try:
                        raw = await conn.recv()
                    except TransportError:
                        break
                    self._dispatch(nursery, conn, raw)
        finally:
            self.conns.discard(conn)

    def _dispatch(self, nursery: trio.Nursery, conn: Connection, raw: bytes) -> None:
        self.counters["requests"] += 1
        try:
            h = decode(raw)
        except ProtocolError as e:
            self.counters["protocol_errors"] += 1
            log.warning("malformed header from %s: %s", conn.peer, e)
            opcode = raw[3] if len(raw) > 3 else 0
            resp = Header(opcode=opcode, req_id=peek_req_id(raw) or 0, result=Result.PROTOCOL,
                          arg=PROTOCOL_REASONS.index(e.reason))
            nursery.start_soon(self._send, conn, resp)
            return
        ticket = None
        if h.opcode in (Op.WRITE, Op.TRUNCATE):   # ordered by arrival: take the ticket now, synchronously
            part = self.table.get(h.partition)
            lane = part.lane(h.extent) if part is not None else None
            if lane is not None:
                ticket = (lane, lane.ticket())
        self.inflight += 1
        nursery.start_soon(self._handle, conn, h, ticket)

    async def _send(self, conn: Connection, resp: Header) -> None:
        try:
            await conn.send(resp.encode())
        except TransportError as e:
            log.debug("reply to %s lost: %s", conn.peer, e)

    async def _handle(self, conn: Connection, h: Header, ticket) -> None:
        resp = None
        try:
            if self.draining and h.opcode not in (Op.PING,):
                raise Reply(Result.RETRY, why="node is shutting down")
            handler = self.HANDLERS[Op(h.opcode)]
            resp = await handler(self, conn, h, ticket)
        except Reply as r:
            if r.result not in (Result.OK, Result.STALE_EPOCH, Result.NOT_FOUND):
                log.info("%s from %s -> %s %s", h.describe(), conn.peer, r.result.name, r.why)
            resp = h.reply(r.result, arg=r.arg)
        except TransportError as e:
            log.warning("%s from %s: connection failed: %s", h.describe(), conn.peer, e)
            resp = None
        except Exception:  # a bug must cost one request, not the node
            log.exception("%s from %s failed", h.describe(), conn.peer)
            resp = h.reply(Result.ERROR)
        finally:
            if ticket is not None:
                ticket[0].done(ticket[1])
            try:
                if resp is not None:   # still in flight until answered: a drain must not cancel the reply
                    await self._send(conn, resp)
            finally:
                self.inflight -= 1
                if self.inflight == 0:
                    self._idle.set()

    # -- helpers --------------------------------------------------------------------------------------
    def _hosted(self, h: Header) -> Partition:
        """The request's partition, or NOT_FOUND."""
        part = self.table.get(h.partition)
        if part is None:
            raise Reply(Result.NOT_FOUND, why=f"partition {h.partition} is not on this node")
        return part

    def _partition(self, h: Header) -> Partition:
        """The request's partition, at the request's epoch (else NOT_FOUND / STALE_EPOCH)."""
        part = self._hosted(h)
        if h.epoch != part.epoch:
            raise Reply(Result.STALE_EPOCH, arg=part.epoch,
                        why=f"epoch {h.epoch} but partition {part.pid} is at {part.epoch}")
        return part

    async def _alloc(self, length: int):
        if length > self.pool.max_block:
            raise Reply(Result.BAD_REQUEST, arg=self.pool.max_block,
                        why=f"{length} bytes is more than the max block {self.pool.max_block}")
        try:
            return await self.pool.alloc(length, timeout=self.cfg.pool_wait)
        except PoolExhausted as e:
            raise Reply(Result.NO_SPACE, why=str(e)) from None

    async def _fetch(self, conn: Connection, remote: RemoteBuf, view: memoryview) -> None:
        try:
            await conn.read(remote, view, self.region)
        except RemoteAccessError as e:
            raise Reply(Result.REMOTE_ACCESS, why=str(e)) from None

    async def _store(self, fn, *args):
        try:
            return await trio.to_thread.run_sync(fn, *args)
        except StoreError as e:
            raise Reply(STORE_RESULTS.get(e.code, Result.ERROR), why=str(e)) from None
        except OSError as e:
            raise Reply(Result.DISK_ERROR, why=str(e)) from None

    async def _push_json(self, conn: Connection, h: Header, obj) -> Header:
        data = json.dumps(obj).encode()
        if len(data) > h.rlen:
            raise Reply(Result.BAD_REQUEST, arg=len(data), why=f"answer needs {len(data)} bytes")
        block = await self._alloc(len(data))
        try:
            view = block.view(len(data))
            view[:] = data
            if data:
                await self._write_remote(conn, view, h.remote.slice(0, len(data)))
        finally:
            self.pool.free(block)
        return h.reply(Result.OK, length=len(data))

    async def _pull_json(self, conn: Connection, h: Header):
        if not (0 < h.length <= MAX_JSON):
            raise Reply(Result.BAD_REQUEST, why="request body missing or too large")
        block = await self._alloc(h.length)
        try:
            view = block.view(h.length)
            await self._fetch(conn, h.remote.slice(0, h.length), view)
            try:
                return json.loads(bytes(view))
            except ValueError:
                raise Reply(Result.BAD_REQUEST, why="body is not JSON") from None
        finally:
            self.pool.free(block)

    async def _write_remote(self, conn: Connection, view: memoryview, remote: RemoteBuf) -> None:
        try:
            await conn.write(view, self.region, remote)
        except RemoteAccessError as e:
            raise Reply(Result.REMOTE_ACCESS, why=str(e)) from None

    async def _forward_all(self, part: Partition, h: Header):
        """Submit a forwarded copy of ``h`` to every follower; returns [(index, pending | exception)]."""
        out = []
        for i, addr in enumerate(part.replicas[1:], start=1):
            fwd = Header(opcode=h.opcode, partition=h.partition, extent=h.extent, offset=h.offset,
                         length=h.length, crc=h.crc, epoch=h.epoch, addr=h.addr, rkey=h.rkey, rlen=h.rlen,
                         arg=h.arg, flags=Flag.FORWARDED, hops=len(part.replicas) - 1 - i)
            try:
                link = await self.links.get(addr)
                out.append((i, await link.submit(fwd, self.cfg.replica_timeout)))
            except (TransportError, OSError) as e:
                out.append((i, e))
        return out

    async def _await_acks(self, part: Partition, h: Header, pendings) -> int | None:
        """Wait for every follower's answer; returns the index of the first failed replica, or None."""
        failed: list[int] = []

        async def one(i, p):
            if isinstance(p, BaseException):
                log.warning("replica %s of partition %d: %s", part.replicas[i], part.pid, p)
                failed.append(i)
                return
            try:
                r = await p.result()
            except TransportError as e:
                log.warning("replica %s of partition %d: %s", part.replicas[i], part.pid, e)
                failed.append(i)
                return
            if (r.result != Result.OK or r.partition != h.partition or r.extent != h.extent
                    or r.offset != h.offset or r.crc != h.crc):
                log.warning("replica %s of partition %d answered %s (%s)", part.replicas[i], part.pid,
                            Result(r.result).name if r.result in Result._value2member_map_ else r.result,
                            h.describe())
                failed.append(i)

        async with trio.open_nursery() as n:
            for i, p in pendings:
                n.start_soon(one, i, p)
        if failed:
            self.counters["replication_failures"] += 1
            return min(failed)
        return None

    # -- handlers -------------------------------------------------------------------------------------
    async def op_ping(self, conn, h, _t):
        return h.reply(Result.OK, arg=os.getpid())

    async def op_write(self, conn: Connection, h: Header, ticket) -> Header:
        part = self._partition(h)
        forwarded = bool(h.flags & Flag.FORWARDED)
        if not forwarded and part.leader != self.me:
            raise Reply(Result.NOT_LEADER, why=f"leader of partition {part.pid} is {part.leader}")
        if ticket is None:
            raise Reply(Result.NOT_FOUND, why=f"extent {h.extent} does not exist")
        lane, t = ticket
        block = await self._alloc(h.length)
        try:
            view = block.view(h.length)
            await self._fetch(conn, h.remote.slice(0, h.length), view)          # one-sided READ
            if crc32c(view) != h.crc:
                raise Reply(Result.CRC_MISMATCH, why="payload CRC does not match the header")
            if forwarded:
                rkeys = self.counters["forward_fetch_bytes_by_rkey"]
                rkeys[str(h.rkey)] = rkeys.get(str(h.rkey), 0) + h.length
            await lane.wait_turn(t)
            if lane.diverged and not (forwarded and h.flags & Flag.REPAIR):   # repair may fill a sealed one
                raise Reply(Result.DIVERGED, why=f"extent {h.extent} sealed: {lane.diverged}")
            if h.offset != lane.next_offset:
                raise Reply(Result.BAD_REQUEST, arg=lane.next_offset,
                            why=f"append at {h.offset} but extent {h.extent} ends at {lane.next_offset}")
            lane.next_offset += h.length
            pendings = []
            try:
                if not forwarded and len(part.replicas) > 1:
                    # the forward names our pool block: followers READ the payload from it, we copy nothing
                    pool_view = Header(**{**_fields(h), "addr": block.addr, "rkey": self.region.rkey,
                                          "rlen": h.length})
                    pendings = await self._forward_all(part, pool_view)
                    self.counters["forwarded"] += 1
                size = await self._store(part.store.write, h.extent, h.offset, view, h.crc)
            except BaseException as e:
                self._seal(part, h.extent, lane, f"local write failed: {e}")
                if pendings:
                    await self._await_acks(part, h, pendings)   # let the followers finish with our block
                raise
            finally:
                lane.done(t)          # the next append to this extent may go on while we wait for acks
            if pendings:
                bad = await self._await_acks(part, h, pendings)
                if bad is not None:
                    self._seal(part, h.extent, lane, f"replica {part.replicas[bad]} failed a write")
                    raise Reply(Result.REPLICATION_FAILED, arg=bad,
                                why=f"replica {part.replicas[bad]} failed {h.describe()}")
        finally:
            self.pool.free(block)
        self.counters["replica_writes" if forwarded else "writes"] += 1
        self.counters["write_bytes"] += h.length
        return h.reply(Result.OK, arg=size, crc=h.crc)

    def _seal(self, part: Partition, extent: int, lane, why: str) -> None:
        if not lane.diverged:
            lane.diverged = why
            part.seal(extent, why)
            log.warning("partition %d extent %d sealed for appends: %s", part.pid, extent, why)

    async def op_read(self, conn, h: Header, _t) -> Header:
        part = self._partition(h)
        if h.rlen < h.length:
            raise Reply(Result.BAD_REQUEST, why="destination buffer smaller than the read")
        block = await self._alloc(h.length)
        try:
            view = block.view(h.length)
            crc = await self._store(part.store.read_into, h.extent, h.offset, h.length, view)
            if h.length:
                await self._write_remote(conn, view, h.remote.slice(0, h.length))  # one-sided WRITE
        finally:
            self.pool.free(block)
        self.counters["reads"] += 1
        self.counters["read_bytes"] += h.length
        return h.reply(Result.OK, length=h.length, crc=crc, arg=part.store.size(h.extent))

    async def op_create_extent(self, conn, h: Header, _t) -> Header:
        part = self._partition(h)
        if h.flags & Flag.FORWARDED:
            if part.lane(h.extent) is not None and part.store.size(h.extent) == 0:
                return h.reply(Result.OK, arg=h.extent)   # repair and a client's create raced: same result
            eid = await self._store(part.store.create_extent, h.extent)
            return h.reply(Result.OK, arg=eid)
        if part.leader != self.me:
            raise Reply(Result.NOT_LEADER, why=f"leader of partition {part.pid} is {part.leader}")
        eid = await self._store(part.store.create_extent, None)
        fh = Header(**{**_fields(h), "extent": eid})
        bad = await self._await_acks(part, fh, await self._forward_all(part, fh))
        if bad is not None:
            raise Reply(Result.REPLICATION_FAILED, arg=bad, why=f"replica {part.replicas[bad]} failed create")
        r = h.reply(Result.OK, arg=eid)
        r.extent = eid
        return r

    async def op_mark_delete(self, conn, h: Header, _t) -> Header:
        part = self._partition(h)
        if not h.flags & Flag.FORWARDED:
            if part.leader != self.me:
                raise Reply(Result.NOT_LEADER)
            bad = await self._await_acks(part, h, await self._forward_all(part, h))
            if bad is not None:
                raise Reply(Result.REPLICATION_FAILED, arg=bad)
        await self._store(part.store.mark_delete, h.extent)
        part.lanes.pop(h.extent, None)
        return h.reply(Result.OK)

    async def op_watermarks(self, conn, h: Header, _t) -> Header:
        part = self._hosted(h)
        return await self._push_json(conn, h, {str(k): v for k, v in part.store.watermarks().items()})

    async def op_partition_create(self, conn, h: Header, _t) -> Header:
        body = await self._pull_json(conn, h)
        replicas, epoch = body.get("replicas"), body.get("epoch", 1)
        if (not isinstance(replicas, list) or not replicas or not all(isinstance(r, str) for r in replicas)
                or len(set(replicas)) != len(replicas) or not isinstance(epoch, int) or epoch < 1):
            raise Reply(Result.BAD_REQUEST, why="body needs replicas: [distinct addresses], epoch >= 1")
        if self.me not in replicas:
            raise Reply(Result.BAD_REQUEST, why=f"this node ({self.me}) is not among the replicas")
        async with self._create_lock:
            old = self.table.get(h.partition)
            if old is not None:
                if old.replicas == replicas and old.epoch == epoch:
                    return h.reply(Result.OK, arg=epoch)
                raise Reply(Result.BAD_REQUEST, arg=old.epoch, why=f"partition {h.partition} exists")
            await trio.to_thread.run_sync(self.table.create, h.partition, replicas, epoch)
        self.repair.kick()
        log.info("partition %d created: replicas %s epoch %d", h.partition, ",".join(replicas), epoch)
        return h.reply(Result.OK, arg=epoch)

    async def op_partition_update(self, conn, h: Header, _t) -> Header:
        part = self._hosted(h)
        body = await self._pull_json(conn, h)
        replicas, epoch = body.get("replicas"), body.get("epoch")
        if not isinstance(replicas, list) or not replicas or not isinstance(epoch, int):
            raise Reply(Result.BAD_REQUEST, why="body needs replicas and epoch")
        if epoch <= part.epoch:
            raise Reply(Result.STALE_EPOCH, arg=part.epoch, why=f"epoch {epoch} is not above {part.epoch}")
        part.replicas, part.epoch = list(replicas), epoch
        await trio.to_thread.run_sync(part.save)
        self.repair.kick()                   # leadership may have moved here (or away)
        log.info("partition %d now epoch %d replicas %s", part.pid, epoch, ",".join(replicas))
        return h.reply(Result.OK, arg=epoch)

    async def op_partition_delete(self, conn, h: Header, _t) -> Header:
        self._hosted(h)
        await trio.to_thread.run_sync(self.table.delete, h.partition)
        log.info("partition %d deleted", h.partition)
        return h.reply(Result.OK)

    async def op_partition_list(self, conn, h: Header, _t) -> Header:
        return await self._push_json(conn, h, [p.describe(self.me) for p in self.table.parts.values()])

    async def op_pool_stats(self, conn, h: Header, _t) -> Header:
        return await self._push_json(conn, h, self.pool_stats())

    async def op_node_status(self, conn, h: Header, _t) -> Header:
        return await self._push_json(conn, h, self.status())

    def pool_stats(self) -> dict:
        return {**self.pool.stats(), "rkey": self.region.rkey, "base_addr": self.pool.base_addr,
                "registered_once": True, "remote_write": bool(self.region.access & Access.REMOTE_WRITE)}

    def status(self) -> dict:
        return {"node": self.me, "pid": os.getpid(), "uptime_s": round(time.time() - self.started, 1),
                "transport": self.cfg.transport, "sync": self.cfg.sync,
                "rdma_device": getattr(self.domain.device, "name", None), "draining": self.draining,
                "inflight": self.inflight, "partitions": sorted(self.table.parts),
                "connections": [c.info() for c in list(self.conns)], "counters": self.counters,
                "pool": self.pool_stats()}

    # -- repair and scrub: the follower's side, and asking the leader (the work is in datanode/repair.py)
    async def op_replica_state(self, conn, h: Header, _t) -> Header:
        part = self._hosted(h)
        return await self._push_json(conn, h, {
            "epoch": part.epoch, "replicas": part.replicas,
            "marks": {str(k): v for k, v in part.store.watermarks().items()},
            "deleted": sorted(part.deleted_extents()), "sealed": sorted(int(e) for e in part.sealed)})

    async def op_block_crcs(self, conn, h: Header, _t) -> Header:
        size, entries = await self._store(self._hosted(h).block_entries, h.extent)
        return await self._push_json(conn, h, {"size": size, "blocks": entries})

    async def op_scrub_extent(self, conn, h: Header, _t) -> Header:
        res = await self._store(scrub_range, self._hosted(h), h.extent, h.offset, h.length)
        self.counters["scrub_bytes"] += res["checked"]
        return await self._push_json(conn, h, res)

    async def op_truncate(self, conn, h: Header, ticket) -> Header:
        """Leader's repair -> follower: cut an extent back to ``offset`` bytes (in the extent's turn)."""
        part = self._partition(h)
        if not h.flags & Flag.FORWARDED or part.leader == self.me:
            raise Reply(Result.BAD_REQUEST, why="only a leader's repair truncates, and only on followers")
        if ticket is None:
            raise Reply(Result.NOT_FOUND, why=f"extent {h.extent} does not exist")
        lane, t = ticket
        await lane.wait_turn(t)
        await self._store(part.store.truncate, h.extent, h.offset)
        lane.next_offset = h.offset
        return h.reply(Result.OK, arg=h.offset)

    def _worker(self, h: Header):
        part = self._hosted(h)
        w = self.repair.workers.get(part.pid)
        if w is None:
            raise Reply(Result.NOT_LEADER, why=f"leader of partition {part.pid} is {part.leader}")
        return w

    async def op_partition_health(self, conn, h: Header, _t) -> Header:
        self._hosted(h)
        return await self._push_json(conn, h, self.repair.health(h.partition))

    async def op_repair(self, conn, h: Header, _t) -> Header:
        return h.reply(Result.OK, arg=self._worker(h).request_repair())

    async def op_scrub(self, conn, h: Header, _t) -> Header:
        return h.reply(Result.OK, arg=self._worker(h).request_scrub())

    HANDLERS = {Op.PING: op_ping, Op.WRITE: op_write, Op.READ: op_read, Op.CREATE_EXTENT: op_create_extent,
                Op.MARK_DELETE: op_mark_delete, Op.WATERMARKS: op_watermarks,
                Op.PARTITION_CREATE: op_partition_create, Op.PARTITION_UPDATE: op_partition_update,
                Op.PARTITION_DELETE: op_partition_delete, Op.PARTITION_LIST: op_partition_list,
                Op.POOL_STATS: op_pool_stats, Op.NODE_STATUS: op_node_status,
                Op.REPLICA_STATE: op_replica_state, Op.BLOCK_CRCS: op_block_crcs,
                Op.SCRUB_EXTENT: op_scrub_extent, Op.TRUNCATE: op_truncate,
                Op.PARTITION_HEALTH: op_partition_health, Op.REPAIR: op_repair, Op.SCRUB: op_scrub}


def _fields(h: Header) -> dict:
    return {k: getattr(h, k) for k in Header.__dataclass_fields__}

