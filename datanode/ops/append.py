"""An append (WRITE), leader and follower: one sequence of steps, run by two drivers.

Follow a write from the client to the disk:

  1. the client SENDs a header naming its buffer (addr, rkey, len) into one of our control slots; the
     wrapper (ops/wrap.py) decodes it and takes a ticket in the extent's lane (arrival order) -- or, for a
     small inline append that continues the one before it on the connection whose handler has not started
     yet, adds it to that one's run (ops/run.py ``AppendRun``): the run is then handled as one append of all
     its bytes (the steps below, once) and each request answered on its own;
  2. ``_payload``: we allocate a block from the registered pool and fetch the payload with a one-sided READ
     from the client's buffer straight into the block (bounded by ``payload_timeout``; a client holds at most
     ``conn_fetch_mib`` awaiting READs, all of them ``fetch_pool_share`` of the pool: ``Buffers.await_payload``;
     while it is fetched, other connections' appends to the extent go ahead of it: lane.py) -- unless the payload
     came inline (a small WRITE on TCP, ``Flag.INLINE``: no READ round trip, and no pool block when every
     follower's link takes it inline too); ``_checked``: its CRC32C;
  3. in the extent's turn (``async with lane.turn(ticket)``): ``_in_turn`` checks the extent takes appends and
     the offset is its end; then ``_hand``: ``_forward`` SENDs each follower the same header marked
     forwarded with the descriptor rewritten to name *our pool block* (``Replicator.submit``,
     datanode/replication.py: followers READ it from there, no copy here; a payload of at most ``INLINE_MAX``
     bytes goes inline in the forward instead, where the link takes it), and ``_append_here`` appends a small
     payload right here in the event loop (datanode/store.py ``append``: CRCs + pwrite), while a large one is
     handed to a worker thread, where it waits for the extent's earlier writes (``ExtentLane.hand_over``) --
     the turn ends once it is handed over, so the next append's turn overlaps this one's pwrite;
  4. outside the turn, ``_settle``: the local write done, and durable (``_durable``; under ``sync = always``:
     group commit, datanode/commit.py -- one flush for every append queued meanwhile; the only request in
     flight flushes right here, ``_flush_here``); ``_acked``: every follower's ack (``Replicator.wait``:
     matched on request id, partition, extent, offset, CRC) within ``replica_timeout``; ``_done`` counts it
     and the wrapper replies OK only then.
  Any failure after the turn began seals the extent (DIVERGED): its replicas may differ, so no more appends.
  The handler notes each step in the request's recorder (ops/stages.py): the wrapper turns them into stage
  times (``metrics.WriteStages``) and trace steps.

The drivers: ``write``, the handler, for every append in a task of its own; and ``now``, for a follower's
lone inline append that nothing would make wait, right where its forward arrives, in the transport's
delivery -- the same steps, with no task, and no pass of the event loop before it starts nor after its
flush.
"""
from __future__ import annotations

from wire.protocol import INLINE_MAX, Flag, Header, Op, Result
from wire.transport.base import Connection
from ..commit import GroupCommit
from ..partition import ExtentLane, Partition
from ..replication import Fanout, Replicator, replica_names
from ..store import StoreError, WouldBlock, io_error, piece_crcs
from .base import DISK, LOOP_IO, Handler, Reply, Request, RequestCounters, appended, store_reply
from .buffers import Buffers
from .partitions import Partitions
from .stages import ACKED, DURABLE, FETCHED, FORWARDED, STARTED, TURN, WRITTEN


class Appends:
    def __init__(self, partitions: Partitions, buffers: Buffers, replication: Replicator, commit: GroupCommit,
                 counters: RequestCounters):
        self.partitions = partitions
        self.buffers = buffers
        self.replication = replication
        self.commit = commit
        self.counters = counters

    def handlers(self) -> dict[Op, Handler]:
        return {Op.WRITE: self.write}

    # -- the drivers ----------------------------------------------------------------------------------------
    async def write(self, rq: Request) -> Header:
        """The append of ``rq`` (``rq.requests`` of them, a run), in its task."""
        h, st = rq.h, rq.stages
        st.mark(STARTED)
        forwarded = bool(h.flags & Flag.FORWARDED)
        part = self.partitions.at_epoch(h) if forwarded else await self.partitions.lead(h)
        if rq.ticket is None:
            raise Reply(Result.NOT_FOUND, why=f"extent {h.extent} does not exist")
        lane, t = rq.ticket
        holder = None if forwarded else rq.conn     # a leader's forwards are not held to a client's share
        fanout = not forwarded and len(part.replicas) > 1
        block = None
        try:
            view, block = await self._payload(rq, part, fanout, holder)
            if rq.payload is None:               # fetched: nobody passes it in the lane from now on
                lane.fetched(t)
            pieces = self._checked(h, view)
            st.mark(FETCHED)
            async with lane.turn(t, settle=False):
                st.mark(TURN)
                self._in_turn(part, lane, h)
                fan, written = await self._hand(rq, part, lane, view, pieces, block, fanout)
            # outside the turn: the extent's next append goes on while this one is written and made durable
            size = await self._settle(rq, part, lane, fan, written)
            if fan:
                await self._acked(part, lane, h, fan)
                st.mark(ACKED)
                if part.acked.get(h.extent, 0) < h.offset + h.length:    # (a leader's confirmations read it)
                    part.acked[h.extent] = h.offset + h.length
        finally:
            if block is not None:
                self.buffers.free(block, holder)
        return self._done(h, size, rq.requests)

    def now(self, rq: Request) -> Header | None:
        """A follower's lone inline append (a run of one, just opened) done right here, when nothing would make
        it wait: its extent's turn is now, with no write of the extent out (``ExtentLane.up``), and its flush
        may run in the event loop (``GroupCommit.here``).  Its answer; or None, with nothing done: not now,
        or a request to refuse (``write`` does, with its reasons), and it goes the usual way, as a task."""
        h, payload, (lane, t) = rq.h, rq.payload, rq.ticket
        if len(payload) > LOOP_IO or h.flags & Flag.REPAIR or not lane.up(t) or not self.commit.here():
            return None
        st = rq.stages
        st.mark(STARTED)
        try:
            part = self.partitions.at_epoch(h)
            pieces = self._checked(h, payload)
            st.mark(FETCHED)
            self._in_turn(part, lane, h)
        except Reply:
            st.clear()                           # the task notes its own steps
            return None
        st.mark(TURN)
        stage = "write"
        try:
            size = self._append_here(lane, part, h, payload, pieces)
            if size is None:                     # it would block: a task hands it to a worker thread
                st.clear()
                return None
            st.mark(WRITTEN)
            stage = "flush"
            self._flush_here(part, h, size)      # GroupCommit.here said it may, and nothing ran since
            st.mark(DURABLE)
        except Reply as e:
            self.replication.seal(part, h.extent, lane, f"local {stage} failed: {e}")
            raise
        self.counters.appends_now += 1
        return self._done(h, size, 1)

    # -- the steps ----------------------------------------------------------------------------------------------
    async def _payload(self, rq: Request, part: Partition, fanout: bool, holder: Connection | None):
        """The payload in hand: (its bytes, the pool block holding them or None)."""
        h = rq.h
        if rq.payload is not None and (not fanout or await self.replication.inline_ok(part, h.length)):
            return rq.payload, None              # it came inline and goes on inline: no pool block
        awaiting = rq.payload is None and holder is not None   # a client's payload, which it may never serve
        if awaiting:
            await self.buffers.await_payload(holder, h.length)
        try:
            block = await self.buffers.alloc(h.length, holder)
            view = block.view(h.length)
            try:
                if rq.payload is not None:
                    view[:] = rq.payload             # some follower takes no inline payload: it READs the block
                else:
                    await self.buffers.fetch(rq.conn, h.remote.slice(0, h.length), view, client=awaiting)
                    if h.flags & Flag.FORWARDED:
                        self.counters.count_forward_fetch(rq.conn.identity or rq.conn.peer, h.length)
            except BaseException:
                self.buffers.free(block, holder)
                raise
        finally:
            if awaiting:
                self.buffers.payload_done(holder, h.length)
        return view, block

    @staticmethod
    def _checked(h: Header, view) -> list[int]:
        """The payload matches the header's CRC; the CRCs of its block pieces (the store's), in the same pass."""
        pieces, whole = piece_crcs(h.offset, view)
        if whole != h.crc:
            raise Reply(Result.CRC_MISMATCH, why="payload CRC does not match the header")
        return pieces

    def _in_turn(self, part: Partition, lane: ExtentLane, h: Header) -> None:
        """In the extent's turn (every earlier append has reached the store or been handed to the disk): the
        extent takes appends, this one starts where it ends, and a leader still leads at the request's epoch
        (the payload's fetch may have awaited a step-down)."""
        forwarded = h.flags & Flag.FORWARDED
        if lane.diverged and not (forwarded and h.flags & Flag.REPAIR):     # repair may fill a sealed one
            raise Reply(Result.DIVERGED, why=f"extent {h.extent} sealed: {lane.diverged}")
        end = lane.tail if lane.writing else self.partitions.size(part, h.extent)
        if h.offset != end:
            raise Reply(Result.WRONG_OFFSET, arg=end, why=f"append at {h.offset} but extent {h.extent} ends at {end}")
        if not forwarded:
            self.partitions.still_leading(part, h)

    async def _hand(self, rq: Request, part: Partition, lane: ExtentLane, view, pieces, block,
                    fanout: bool) -> tuple[Fanout | None, object]:
        """In the turn: the forwards sent, and the local write done right here (its new size) or handed to a
        worker thread behind the extent's earlier writes (its ``aio.Handed``: the turn may end at once)."""
        h, fan = rq.h, None
        try:
            if fanout:
                rq.stages.mark(FORWARDED)        # before the sends: a follower may see one before we return
                fan = await self._forward(part, h, view, block)
            written = self._append_here(lane, part, h, view, pieces)
            if written is None:
                written = lane.hand_over(DISK, h.offset + h.length, part.store.append, h.extent, h.offset, view,
                                         None, pieces)
        except BaseException as e:
            await self._seal(part, lane, h, fan, f"local write failed: {e}")
            raise
        return fan, written

    async def _forward(self, part: Partition, h: Header, view, block) -> Fanout:
        """The forwards to the followers: a small payload inline where the link takes it; otherwise the
        forward names our pool block, and followers READ the payload from it (we copy nothing)."""
        if block is None:
            fwd = h.forwarded()
        else:
            fwd = h.but(flags=(h.flags | Flag.FORWARDED) & ~Flag.INLINE, addr=block.addr,
                        rkey=self.buffers.region.rkey, rlen=h.length)
        return await self.replication.submit(part, fwd, view if h.length <= INLINE_MAX else None)

    @staticmethod
    def _append_here(lane: ExtentLane, part: Partition, h: Header, view, pieces) -> int | None:
        """``store.append`` (no sync) right here, for a small one when no earlier write of the extent is still
        out (a pwrite into the page cache costs less than the hop to a worker thread): the extent's new size.
        None: not here (too big, a write is out, or the page cache would block)."""
        if len(view) > LOOP_IO or lane.writing:
            return None
        try:
            return part.store.append(h.extent, h.offset, view, None, pieces, blocking=False)
        except WouldBlock:
            return None
        except StoreError as e:
            raise store_reply(e) from None
        except OSError as e:
            raise store_reply(io_error("append", e)) from None

    async def _settle(self, rq: Request, part: Partition, lane: ExtentLane, fan: Fanout | None, written) -> int:
        """The local write done (awaited if it was handed over) and durable: the extent's new size."""
        h, stage = rq.h, "write"
        try:
            size = written if isinstance(written, int) else await appended(lane, written)
            rq.stages.mark(WRITTEN)
            stage = "flush"
            await self._durable(part, h, size)
            rq.stages.mark(DURABLE)
        except BaseException as e:
            await self._seal(part, lane, h, fan, f"local {stage} failed: {e}")
            raise
        return size

    async def _durable(self, part: Partition, h: Header, end: int) -> None:
        """Until ``[0, end)`` of the extent is durable: group commit (at once under sync=none); flushed right
        here when this is the only request in flight (GroupCommit: "Alone, right here")."""
        if self.commit.here():
            self._flush_here(part, h, end)
            return
        try:
            await self.commit.durable(part.store, h.extent, end)
        except StoreError as e:
            raise store_reply(e) from None

    def _flush_here(self, part: Partition, h: Header, end: int) -> None:
        if part.store.durable_size(h.extent) < end:
            try:
                self.commit.flush_here(part.store, h.extent)
            except StoreError as e:
                raise store_reply(e) from None

    async def _acked(self, part: Partition, lane: ExtentLane, h: Header, fan: Fanout) -> None:
        """Every follower acknowledged the append (else the extent is sealed: REPLICATION_FAILED)."""
        failed = await self.replication.wait(fan)
        if failed:
            names = replica_names(fan.replicas, failed)
            self.replication.seal(part, h.extent, lane, f"replica {names} failed a write")
            raise Reply(Result.REPLICATION_FAILED, arg=failed, why=f"replica {names} failed {h.describe()}")

    async def _seal(self, part: Partition, lane: ExtentLane, h: Header, fan: Fanout | None, why: str) -> None:
        """A step failed after the turn began: seal the extent (its replicas may differ now) and wait until
        the followers are done with our pool block (the caller frees it next)."""
        self.replication.seal(part, h.extent, lane, why)
        if fan:
            await self.replication.wait(fan)

    def _done(self, h: Header, size: int, requests: int) -> Header:
        """The append is acknowledged: counted ``requests`` times (a run), and its answer."""
        c = self.counters
        if h.flags & Flag.FORWARDED:
            c.replica_writes += requests
        else:
            c.writes += requests
        c.joined_writes += requests - 1
        c.write_bytes += h.length
        return h.reply(Result.OK, arg=size, crc=h.crc)
