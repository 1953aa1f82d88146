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
     the offset is its end; then the replication pipeline (ops/pipeline.py) SENDs each follower the same
     header marked forwarded (``forward``) with the descriptor rewritten to name *our pool block*
     (``Replicator.submit``, datanode/replication.py: followers READ it from there, no copy here; a payload of
     at most ``INLINE_MAX`` bytes goes inline in the forward instead, where the link takes it), and ``local``
     appends a small payload right here in the event loop (``_append_here``, datanode/store.py ``append``:
     CRCs + pwrite), while a large one is handed to a worker thread (``_hand_over``), where it waits for the
     extent's earlier writes (``ExtentLane.hand_over``) -- the turn ends once it is handed over, so the next
     append's turn overlaps this one's pwrite;
  4. outside the turn, ``settle``: the local write done (``_written``), and durable (``_durable``; under
     ``sync = always``: group commit, datanode/commit.py -- one flush for every append queued meanwhile; the
     only request in flight flushes right here, ``_flush_here``); then the pipeline awaits every follower's ack
     (``Replicator.wait``: matched on request id, partition, extent, offset, CRC) within ``replica_timeout``;
     ``_done`` counts it and the wrapper replies OK only then.
  Any failure after the turn began seals the extent (DIVERGED, ``broken``): its replicas may differ, so no
  more appends.  The handler notes each step in the request's recorder (ops/stages.py): the wrapper turns
  them into stage times (``metrics.WriteStages``) and trace steps.

The drivers: ``write``, the handler, for every append in a task of its own (the pipeline takes the steps,
on leader and follower alike); and ``now``, for a follower's lone inline append that nothing would make
wait, right where its forward arrives, in the transport's delivery -- the same steps, with no task, and no
pass of the event loop before it starts nor after its flush.
"""
from __future__ import annotations

from typing import NoReturn

from wire.protocol import INLINE_MAX, Flag, Header, Op, Result
from wire.transport.base import Connection
from ..commit import GroupCommit
from ..partition import ExtentLane, Partition
from ..replication import Replicator, replica_names
from ..store import StoreError, WouldBlock, io_error, piece_crcs
from .base import DISK, LOOP_IO, Handler, Reply, Request, RequestCounters, appended, store_reply
from .buffers import Buffers
from .partitions import Partitions
from .pipeline import Forwardable, Order, Pipeline, Replicated
from .stages import DURABLE, FETCHED, STARTED, TURN, WRITTEN


class Appends(Forwardable):
    """The append's steps, as the replication pipeline (ops/pipeline.py) takes them -- ``prepare``: the
    payload in hand and checked; in the extent's ``turn``: ``in_turn``'s checks, the forwards (``forward``)
    and the local write started (``local``: right here, or handed to a worker thread); ``settle``: the local
    write done and durable; then the followers' acks, ``answer``, and ``release`` (the pool block).  Each
    names the plain step it takes (``_payload``, ``_checked``, ``_in_turn``, ``_append_here``, ``_hand_over``,
    ``_written``, ``_durable``, ``_done``): ``now`` takes the same ones."""

    ORDER = Order.FORWARD_LOCAL          # the followers write while we do
    WHAT = "write"

    def __init__(self, partitions: Partitions, buffers: Buffers, replication: Replicator, commit: GroupCommit,
                 counters: RequestCounters):
        self.partitions = partitions
        self.buffers = buffers
        self.replication = replication
        self.commit = commit
        self.counters = counters
        self.pipeline = Pipeline(partitions, replication)

    def handlers(self) -> dict[Op, Handler]:
        return {Op.WRITE: self.write}

    # -- the drivers ----------------------------------------------------------------------------------------
    async def write(self, rq: Request) -> Header:
        """The append of ``rq`` (``rq.requests`` of them, a run), in its task."""
        rq.stages.mark(STARTED)
        return await self.pipeline.run(self, rq)

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
            self._in_turn(part, lane, h, leader=False)
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
        return self._done(h, size, 1, leader=False)

    # -- the pipeline's steps -----------------------------------------------------------------------------------
    async def prepare(self, x: Replicated) -> None:
        """The payload in hand (fetched: nobody passes it in the lane from now on) and checked."""
        rq = x.rq
        if rq.ticket is None:
            raise Reply(Result.NOT_FOUND, why=f"extent {rq.h.extent} does not exist")
        x.payload, x.block = await self._payload(rq, x.part, x.view is not None, rq.conn if x.leader else None)
        if rq.payload is None:
            rq.ticket[0].fetched(rq.ticket[1])
        x.pieces = self._checked(rq.h, x.payload)
        rq.stages.mark(FETCHED)

    def turn(self, x: Replicated):
        lane, t = x.rq.ticket
        return lane.turn(t, settle=False)

    def in_turn(self, x: Replicated) -> None:
        x.rq.stages.mark(TURN)
        self._in_turn(x.part, x.rq.ticket[0], x.h, x.leader)

    def forward(self, x: Replicated) -> tuple[Header, object]:
        """A small payload inline where the link takes it; otherwise the forward names our pool block, and
        followers READ the payload from it (we copy nothing)."""
        h = x.h
        if x.block is None:
            fwd = h.forwarded()
        else:
            fwd = h.forwarded(flags=h.flags & ~Flag.INLINE, addr=x.block.addr,
                              rkey=self.buffers.region.rkey, rlen=h.length)
        return fwd, x.payload if h.length <= INLINE_MAX else None

    async def local(self, x: Replicated) -> None:
        """The local write, right here (the new size) or handed to a worker thread behind the extent's earlier
        writes (its ``aio.Handed``: the turn may end at once)."""
        lane, h = x.rq.ticket[0], x.h
        written = self._append_here(lane, x.part, h, x.payload, x.pieces)
        x.outcome = written if written is not None else self._hand_over(lane, x.part, h, x.payload, x.pieces)

    async def settle(self, x: Replicated) -> None:
        """Outside the turn: the local write done (awaited if it was handed over) and durable."""
        rq = x.rq
        x.outcome = size = await self._written(rq.ticket[0], x.outcome)
        rq.stages.mark(WRITTEN)
        x.stage = "flush"
        await self._durable(x.part, rq.h, size)
        rq.stages.mark(DURABLE)

    def broken(self, x: Replicated, e: BaseException) -> None:
        """Any failure after the turn began seals the extent: its replicas may differ."""
        self.replication.seal(x.part, x.h.extent, x.rq.ticket[0], f"local {x.stage} failed: {e}")

    async def replicas_failed(self, x: Replicated, failed: int) -> NoReturn:
        names = replica_names(x.fan.replicas, failed)
        self.replication.seal(x.part, x.h.extent, x.rq.ticket[0], f"replica {names} failed a write")
        raise Reply(Result.REPLICATION_FAILED, arg=failed, why=f"replica {names} failed {x.h.describe()}")

    def answer(self, x: Replicated) -> Header:
        h = x.h
        if x.fan and x.part.acked.get(h.extent, 0) < h.offset + h.length:   # (a leader's confirmations read it)
            x.part.acked[h.extent] = h.offset + h.length
        return self._done(h, x.outcome, x.rq.requests, x.leader)

    def release(self, x: Replicated) -> None:
        if x.block is not None:
            self.buffers.free(x.block, x.rq.conn if x.leader else None)

    # -- the steps ----------------------------------------------------------------------------------------------
    async def _payload(self, rq: Request, part: Partition, fanout: bool, holder: Connection | None):
        """The payload in hand: (its bytes, the pool block holding them or None).  ``holder``: the client
        whose share of the pool it counts against (None: a leader's forward)."""
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
                    if holder is None:
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

    def _in_turn(self, part: Partition, lane: ExtentLane, h: Header, leader: bool) -> None:
        """In the extent's turn (every earlier append has reached the store or been handed to the disk): the
        extent takes appends, this one starts where it ends, and a leader still leads at the request's epoch
        (the payload's fetch may have awaited a step-down)."""
        if lane.diverged and (leader or not h.flags & Flag.REPAIR):     # a repair may fill a sealed one
            raise Reply(Result.DIVERGED, why=f"extent {h.extent} sealed: {lane.diverged}")
        end = lane.tail if lane.writing else self.partitions.size(part, h.extent)
        if h.offset != end:
            raise Reply(Result.WRONG_OFFSET, arg=end, why=f"append at {h.offset} but extent {h.extent} ends at {end}")
        if leader:
            self.partitions.still_leading(part, h)

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

    @staticmethod
    def _hand_over(lane: ExtentLane, part: Partition, h: Header, view, pieces):
        """``store.append`` handed to a worker thread, where it waits for the extent's earlier writes."""
        return lane.hand_over(DISK, h.offset + h.length, part.store.append, h.extent, h.offset, view, None, pieces)

    @staticmethod
    async def _written(lane: ExtentLane, written) -> int:
        """The extent's new size once the local write is done (``written``: the size, or the handed-over
        write to await)."""
        return written if isinstance(written, int) else await appended(lane, written)

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

    def _done(self, h: Header, size: int, requests: int, leader: bool) -> Header:
        """The append is acknowledged: counted ``requests`` times (a run), and its answer."""
        c = self.counters
        if leader:
            c.writes += requests
        else:
            c.replica_writes += requests
        c.joined_writes += requests - 1
        c.write_bytes += h.length
        return h.reply(Result.OK, arg=size, crc=h.crc)
