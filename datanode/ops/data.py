"""The data path: appends, reads, extent create/delete.

Follow a write from the client to the disk (``DataOps.op_write``):

  1. the client SENDs a header naming its buffer (addr, rkey, len) into one of our control slots;
     ``Node._dispatch`` (datanode/server.py) decodes it and, for appends, takes a ticket in the extent's lane
     (arrival order) -- or, for a small inline append that continues the one before it on the connection
     whose handler has not started yet, adds it to that one's run (``AppendRun``, below): the run is then
     handled as one append of all its bytes (the steps below, once) and each request answered on its own;
  2. we allocate a block from the registered pool and fetch the payload with a one-sided READ from the
     client's buffer straight into the block (bounded by ``peer_timeout``), then check its CRC32C -- unless
     the payload came inline (a small WRITE on TCP, ``Flag.INLINE``: no READ round trip, and no pool block
     when every follower's link takes it inline too);
  3. in the extent's turn (``async with lane.turn(ticket)``): check the offset is the extent's end, SEND each
     follower the same header marked forwarded with the descriptor rewritten to name *our pool block*
     (``Replicator.submit``, datanode/replication.py: followers READ it from there, no copy here; a payload
     of at most ``INLINE_MAX`` bytes goes inline in the forward instead, where the link takes it), and
     append the block to our extent (datanode/store.py ``append``: CRCs + pwrite): a small one right here in
     the event loop; a large one is handed to a worker thread, where it waits for the extent's earlier
     writes (``ExtentLane.hand_over``) -- the turn ends once it is handed over, so the next append's turn
     overlaps this one's pwrite;
  4. outside the turn (the extent's next append may go on): wait until the append is durable (under
     ``sync = always``: group commit, datanode/commit.py -- one flush for every append queued meanwhile), and
     for every follower's ack
     (``Replicator.wait``: matched on request id, partition, extent, offset, CRC) within ``replica_timeout``;
     reply OK to the client only then; free the block.
  Any failure after the turn began seals the extent (DIVERGED): its replicas may differ, so no more appends.
  Each step's time is counted (``metrics.WriteStages``: fetch = 2, queue = waiting for the turn, local = 3,
  durable and replicas = 4), so a node says where its appends wait.
  A follower runs the same handler for the forwarded header: steps 2 and 3 without the forwarding -- or, for a
  lone inline append that nothing would make wait, the same steps right where it arrives, in the transport's
  delivery, with no task of its own (``DataOps.append_now``).
"""
from __future__ import annotations

import dataclasses
import logging
import os
from time import perf_counter

from .. import trace
from ..crc import crc32c
from ..protocol import INLINE_MAX, Flag, Header, Result
from ..replication import replica_names
from ..store import MAX_EXTENT, StoreError, WouldBlock, io_error, piece_crcs
from ..transport.base import Connection
from .base import LOOP_IO, Handlers, Reply, store_reply

log = logging.getLogger(__name__)


class AppendRun:
    """Inline appends that came back to back on one connection for one extent -- each starting where the one
    before it ends, all before the first one's handler ran -- handled as ONE append of their bytes: one turn
    of the extent's lane, one forward to each follower, one local write, one flush, one wait for the acks;
    each request is then answered as if it had gone alone (``answers``).  Under load, when requests queue in
    the socket, the per-append work of the leader and of every follower is paid once per run instead of once
    per request; a lone request is a run of one and goes as it always did.

    The dispatcher (``Node._dispatch``) opens a run for every inline append that takes a lane ticket, and
    ``join`` adds the requests that follow it, synchronously, as they are cut from the stream: only while
    the run's handler has not started, only if no other request of the extent took a ticket in between (the
    extent's arrival order stays what it was), and only requests whose payload matches their CRC (checked
    here; a request that fails it goes alone and is refused alone, as before), and never past the extent's
    size limit.  So every answer is the one the request would have had alone: OK with its own end, or the
    run's refusal, which the requests after the first would have met too (a WRONG_OFFSET, a DIVERGED extent,
    a replica that failed their bytes).  One exception: a disk with less room than the run's bytes (at most
    ``INLINE_MAX``) but enough for the first request's answers NO_SPACE to all of them."""

    MAX = 32                        # requests in one run at most (and at most INLINE_MAX bytes)
    __slots__ = ("head", "ticket", "more", "payloads", "end", "length", "started", "checked")

    def __init__(self, h: Header, payload, ticket):
        self.head, self.ticket = h, ticket
        self.more: list[tuple[Header, float]] = []     # the requests that joined, with their arrival times
        self.payloads = [payload]   # every request's bytes, until the handler starts
        self.end = h.offset + h.length
        self.length = h.length
        self.started = False        # the handler runs: nothing joins any more
        self.checked = False        # the head's payload matched its CRC (checked when the first one joins)

    def join(self, h: Header, payload, t0: float) -> bool:
        head = self.head
        if (self.started or h.offset != self.end or h.extent != head.extent or h.partition != head.partition
                or h.epoch != head.epoch or h.flags != head.flags or self.length + h.length > INLINE_MAX
                or self.end + h.length > MAX_EXTENT or len(self.more) >= self.MAX - 1
                or not self.ticket[0].newest(self.ticket[1]) or crc32c(payload) != h.crc):
            return False
        if not self.checked:
            if crc32c(self.payloads[0]) != head.crc:
                return False
            self.checked = True
        self.more.append((h, t0))
        self.payloads.append(payload)
        self.end += h.length
        self.length += h.length
        return True

    def start(self) -> tuple[Header, memoryview] | None:
        """Called as the handler starts (nothing joins from now on, and the run lets go of the bytes): the
        one append of the run's bytes -- the first request's header grown to cover them all --, or None for
        a lone request (it goes as it came)."""
        self.started = True
        payloads, self.payloads = self.payloads, None
        if not self.more:
            return None
        joined = b"".join(payloads)
        return self.head.but(length=self.length, crc=crc32c(joined)), memoryview(joined)

    def answers(self, resp: Header | None, t0: float) -> list[tuple[Header, float, Header | None]]:
        """Each request of the run with its arrival time and its answer, given the whole append's."""
        return [(h, t, None if resp is None else
                 h.reply(Result.OK, arg=h.offset + h.length, crc=h.crc) if resp.result == Result.OK else
                 h.reply(resp.result, arg=resp.arg))
                for h, t in [(self.head, t0), *self.more]]


def count_stages(acc: list, requests: int, t0: float, t1: float, t2: float, t3: float, t4: float) -> None:
    """An append's stage times (``metrics.WriteStages``: plain sums, no call into it), for ``requests``."""
    acc[0] += requests
    acc[1] += (t1 - t0) * requests
    acc[2] += (t2 - t1) * requests
    acc[3] += (t3 - t2) * requests
    acc[4] += (t4 - t3) * requests


class DataOps(Handlers):
    async def op_ping(self, conn, h: Header, _t) -> Header:
        return h.reply(Result.OK, arg=os.getpid())

    def append_now(self, conn: Connection, h: Header, ticket, payload: memoryview, run: AppendRun) -> Header | None:
        """A follower's lone inline append, done right where it arrived -- in the transport's delivery
        (``Node._dispatch``): no task of its own, no pass of the event loop before it starts nor after its
        flush -- when nothing would make it wait: its extent's turn is now, with no write of the extent out
        (``ExtentLane.up``), and its flush may run right here (``GroupCommit.here``).  The steps of
        ``op_write`` for a forwarded inline payload (CRC, offset, append, flush; a failure of the append or
        the flush seals the extent) and its answer; or None, with nothing done: not now, or a request to
        refuse (the handler does, with its reasons), and it goes the usual way, as a task.  At 4 KiB x 1 this
        takes half a follower's loop passes and a tenth of its Python calls per write away (bench/README.md,
        stop 38)."""
        lane, t = ticket
        if (len(payload) > LOOP_IO or h.flags & Flag.REPAIR or run.more or lane.diverged or not lane.up(t)
                or not self.commit.here()):
            return None
        try:
            part = self._partition(h)
            end = self._size(part, h.extent)
        except Reply:
            return None
        t0 = perf_counter()
        pieces, whole = piece_crcs(h.offset, payload)
        if whole != h.crc or h.offset != end:
            return None
        t1 = perf_counter()
        if trace.ON:
            trace.mark("started.F", h.extent, h.offset)
        store = part.store
        try:
            size = store.append(h.extent, h.offset, payload, None, pieces, blocking=False)
        except WouldBlock:
            return None
        except (StoreError, OSError) as e:
            return self._sealed_now(conn, part, h, lane, t, run, "write", e)
        run.start()                      # nothing joins it now
        t3 = perf_counter()
        if trace.ON:
            trace.mark("written.F", h.extent, h.offset)
        try:
            if store.durable_size(h.extent) < size:
                self.commit.flush_here(store, h.extent)
        except StoreError as e:
            return self._sealed_now(conn, part, h, lane, t, run, "flush", e)
        t4 = perf_counter()
        lane.done(t)
        if trace.ON:
            trace.mark("durable.F", h.extent, h.offset)
        count_stages(self.metrics.write_stages.follower, 1, t0, t1, t1, t3, t4)
        self.counters.replica_writes += 1
        self.counters.appends_now += 1
        self.counters.write_bytes += h.length
        return h.reply(Result.OK, arg=size, crc=h.crc)

    def _sealed_now(self, conn, part, h: Header, lane, t: int, run: AppendRun, stage: str, e: Exception) -> Header:
        """``append_now``'s append or flush failed: the extent sealed, the request answered as ``op_write``
        answers it."""
        run.start()
        err = e if isinstance(e, StoreError) else io_error("append", e)
        self.replication.seal(part, h.extent, lane, f"local {stage} failed: {err}")
        lane.done(t)
        r = store_reply(err)
        log.info("%s from %s -> %s %s", h.describe(), conn.peer, r.result.name, r.why)
        return h.reply(r.result, arg=r.arg)

    async def op_write(self, conn: Connection, h: Header, ticket, payload: memoryview | None = None, *,
                       requests: int = 1) -> Header:
        """``requests``: how many requests this append answers (a run of them: ``AppendRun``); they count
        in the node's counters and stage times (each waited that long) as that many writes."""
        t0 = perf_counter()                      # the stages' marks (metrics.WriteStages)
        forwarded = bool(h.flags & Flag.FORWARDED)
        if trace.ON:
            trace.mark("started.F" if forwarded else "started.L", h.extent, h.offset)
        part = self._partition(h) if forwarded else await self._lead(h)
        if ticket is None:
            raise Reply(Result.NOT_FOUND, why=f"extent {h.extent} does not exist")
        lane, t = ticket
        holder = None if forwarded else conn     # a leader's forwards are not held to a client's share
        block = None
        fanout = not forwarded and len(part.replicas) > 1
        try:
            if payload is not None and (not fanout or await self.replication.inline_ok(part, h.length)):
                view = payload                   # eager: it came inline and goes on inline; no pool block
            else:
                block = await self._alloc(h.length, holder)
                view = block.view(h.length)
                if payload is not None:
                    view[:] = payload            # some follower takes no inline payload: it READs the block
                else:
                    await self._fetch(conn, h.remote.slice(0, h.length), view)          # one-sided READ
                    if forwarded:
                        self.counters.count_forward_fetch(conn.identity or conn.peer, h.length)
            # one pass over the bytes: the payload's CRC, and the block pieces' CRCs the store needs
            pieces, whole = piece_crcs(h.offset, view)
            if whole != h.crc:
                raise Reply(Result.CRC_MISMATCH, why="payload CRC does not match the header")
            fan = None
            t1 = perf_counter()
            async with lane.turn(t, settle=False):
                t2 = perf_counter()
                if lane.diverged and not (forwarded and h.flags & Flag.REPAIR):  # repair may fill a sealed one
                    raise Reply(Result.DIVERGED, why=f"extent {h.extent} sealed: {lane.diverged}")
                # in our turn, every earlier append has reached the store or been handed to the disk
                end = lane.tail if lane.writing else self._size(part, h.extent)
                if h.offset != end:
                    raise Reply(Result.WRONG_OFFSET, arg=end,
                                why=f"append at {h.offset} but extent {h.extent} ends at {end}")
                if not forwarded:
                    self._still_leading(part, h)     # the fetch awaited: a step-down may have come meanwhile
                try:
                    if fanout:
                        # a small payload goes inline to each follower whose link takes it; otherwise the
                        # forward names our pool block: followers READ the payload from it, we copy nothing
                        small = view if h.length <= INLINE_MAX else None
                        if block is None:
                            fwd = h.forwarded()
                        else:
                            fwd = h.but(flags=(h.flags | Flag.FORWARDED) & ~Flag.INLINE,
                                        addr=block.addr, rkey=self.region.rkey, rlen=h.length)
                        if trace.ON:         # before the sends: a follower may see one before we return
                            trace.mark("forwarded.L", h.extent, h.offset)
                        fan = await self.replication.submit(part, fwd, small)
                    # the local write: done right here (small), or handed to a worker thread behind the
                    # extent's earlier writes -- our turn ends as soon as it is handed over
                    written = self._hand_append(lane, part.store, h.extent, h.offset, view, pieces)
                except BaseException as e:
                    await self._seal(part, h.extent, lane, fan, f"local write failed: {e}")
                    raise
            # outside the turn: the extent's next append goes on while this one is written (if it was handed
            # over) and becomes durable (group commit, datanode/commit.py), and the followers answer
            stage = "write"
            try:
                size = written if isinstance(written, int) else await self._appended(lane, written)
                t3 = perf_counter()
                if trace.ON:
                    trace.mark("written.F" if forwarded else "written.L", h.extent, h.offset)
                stage = "flush"
                await self._durable(part.store, h.extent, size)
                t4 = perf_counter()
                if trace.ON:
                    trace.mark("durable.F" if forwarded else "durable.L", h.extent, h.offset)
            except BaseException as e:
                await self._seal(part, h.extent, lane, fan, f"local {stage} failed: {e}")
                raise
            if fan:
                failed = await self.replication.wait(fan)
                if trace.ON:
                    trace.mark("acked.L", h.extent, h.offset)
                if failed:
                    names = replica_names(fan.replicas, failed)
                    self.replication.seal(part, h.extent, lane, f"replica {names} failed a write")
                    raise Reply(Result.REPLICATION_FAILED, arg=failed, why=f"replica {names} failed {h.describe()}")
                acc = self.metrics.write_stages.leader
                acc[5] += requests
                acc[6] += (perf_counter() - t4) * requests
            else:
                acc = self.metrics.write_stages.follower if forwarded else self.metrics.write_stages.leader
            count_stages(acc, requests, t0, t1, t2, t3, t4)
        finally:
            if block is not None:
                self._free(block, holder)
        if forwarded:
            self.counters.replica_writes += requests
        else:
            self.counters.writes += requests
        self.counters.joined_writes += requests - 1
        self.counters.write_bytes += h.length
        return h.reply(Result.OK, arg=size, crc=h.crc)

    async def _seal(self, part, extent: int, lane, fan, why: str) -> None:
        """A step of an append failed after its turn began: seal the extent (its replicas may differ now) and
        wait until the followers are done with our pool block (the caller frees it next)."""
        self.replication.seal(part, extent, lane, why)
        if fan:
            await self.replication.wait(fan)

    async def op_read(self, conn, h: Header, _t) -> Header:
        part = self._partition(h)        # the buffer holds h.length bytes: checked by decode
        if not h.flags & Flag.ANY_REPLICA:
            self._leader_of(part)
        taken = await self._answer_budget(conn, h.length)     # before the disk: see ByteBudget
        block = None

        def release() -> None:          # the answer's block and budget, once the transport is done with them
            if block is not None:
                self._free(block, conn)
            conn.answers.give(taken)

        handed = False
        try:
            block = await self._alloc(h.length, conn)
            view = block.view(h.length)
            if trace.ON:
                trace.mark("read.started", h.extent, h.offset)
            crc = await self._read(part.store, h.extent, h.offset, h.length, view)
            if trace.ON:
                trace.mark("read.disk", h.extent, h.offset)
            if h.length:
                # one-sided WRITE, posted: our response follows it on the connection, and the client checks
                # the bytes against the CRC in it.  The transport hands the block back (``release``) once it
                # no longer reads it: on TCP before the call returns, on verbs when the WRITE completes --
                # after our response is on its way behind it
                await self._write_remote(conn, view, h.remote.slice(0, h.length), posted=True, release=release)
                handed = True
                if trace.ON:
                    trace.mark("read.sent", h.extent, h.offset)
        finally:
            if not handed:
                release()
        self.counters.reads += 1
        self.counters.read_bytes += h.length
        return h.reply(Result.OK, length=h.length, crc=crc, arg=self._size(part, h.extent))

    async def op_create_extent(self, conn, h: Header, _t) -> Header:
        part = self._partition(h)
        if h.flags & Flag.FORWARDED:
            # The leader's repair and a client's create may race (both forwards may even be creating here at
            # once, in worker threads): an empty extent of that id is the same result either way.
            try:
                eid = await self._store(part.store.create_extent, h.extent)
            except Reply as e:
                if e.result == Result.EXISTS and part.lane(h.extent) is not None and self._size(part, h.extent) == 0:
                    return h.reply(Result.OK, arg=h.extent)
                raise
            return h.reply(Result.OK, arg=eid)
        part = await self._lead(h)
        view = list(part.replicas)          # the view of h.epoch: forwards go to it, whatever happens meanwhile
        eid = await self._store(part.store.create_extent, None)
        try:
            self._still_leading(part, h)     # stepped down during the create: take it back, redirect the client
        except Reply:
            await self._store(part.store.mark_delete, eid)
            part.lanes.pop(eid, None)
            raise
        failed = await self.replication.replicate(part, h.forwarded(extent=eid), view)
        if failed:
            # not on every replica: take it back (its tombstone makes repair delete it where it did land),
            # so a client retrying against a dead follower does not leave an empty extent per try
            await self._store(part.store.mark_delete, eid)
            part.lanes.pop(eid, None)
            raise Reply(Result.REPLICATION_FAILED, arg=failed,
                        why=f"replica {replica_names(view, failed)} failed create (extent {eid} taken back)")
        return dataclasses.replace(h.reply(Result.OK, arg=eid), extent=eid)

    async def op_mark_delete(self, conn, h: Header, _t) -> Header:
        part = self._partition(h)
        if not h.flags & Flag.FORWARDED:
            part = await self._lead(h)
            view = list(part.replicas)
            failed = await self.replication.replicate(part, h.forwarded(), view)
            if failed:
                raise Reply(Result.REPLICATION_FAILED, arg=failed,
                            why=f"replica {replica_names(view, failed)} failed delete")
        await self._store(part.store.mark_delete, h.extent)
        part.lanes.pop(h.extent, None)
        return h.reply(Result.OK)

    async def op_watermarks(self, conn, h: Header, _t) -> Header:
        part = self._hosted(h)
        return await self._push_json(conn, h, {str(k): v for k, v in part.store.watermarks().items()})

    HANDLERS = {"PING": op_ping, "WRITE": op_write, "READ": op_read, "CREATE_EXTENT": op_create_extent,
                "MARK_DELETE": op_mark_delete, "WATERMARKS": op_watermarks}
