"""The replication pipeline: every operation a leader forwards to its followers, on leader and follower alike.

In the spirit of CubeFS's replication protocol (repl/repl_protocol.go: prepare, operate, post), an operation
that changes a partition's data on every replica (an append, creating and deleting an extent, a repair's
truncate) declares its steps once (``Forwardable``) and ``Pipeline.run`` takes them, in one place for every
such operation:

* whose request it is: a client's, to be forwarded (this node leads the partition at the request's epoch, and
  the view to forward to is taken now, before any await), or a leader's forward (``Flag.FORWARDED``: the
  follower applies it at that epoch and forwards nothing).  ``forwarded`` is the one reading of that flag;
* ``prepare``: the operation's checks and what the forward will carry (an append's payload, fetched);
* in the operation's ``turn`` (an extent's arrival order, where it keeps one): ``in_turn`` checks, then the
  forwards and the local step, in the order the operation declares (``Order``);
* ``settle``: the local step made durable, outside the turn (the extent's next append goes on meanwhile);
* the followers' acks (``replica_timeout``); a follower that failed: ``replicas_failed`` (undo, seal) and
  REPLICATION_FAILED;
* ``answer``; and, whatever happened, ``release`` (post: what ``prepare`` took, freed after every follower is
  done with it).

A step that fails once the forwards or the local change began is reported to ``broken`` (an append seals its
extent: its replicas may differ), and the followers' answers are awaited before anything is released.  So a
request is acknowledged only once its local change is durable and every follower acknowledged its own.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import AsyncContextManager, NoReturn

from wire.protocol import Flag, Header, Result
from ..partition import Partition
from ..replication import Fanout, Replicator, replica_names
from .base import Reply, Request
from .partitions import Partitions
from .stages import ACKED, FORWARDED


def forwarded(h: Header) -> bool:
    """Whether the request is a leader's forward (the follower's side of a replicated operation)."""
    return bool(h.flags & Flag.FORWARDED)


class Order(enum.Enum):
    """When the leader takes its local step, relative to the forwards and the followers' acks."""
    FORWARD_LOCAL = "forward, local, acks"   # the followers work while we do (an append)
    LOCAL_FORWARD = "local, forward, acks"   # the forward carries what the local step made (a new extent's id)
    ACKS_LOCAL = "forward, acks, local"      # nothing changes here unless every follower did it (a delete)


@dataclasses.dataclass(slots=True, eq=False)
class Replicated:
    """One forwardable request on its way through the pipeline: plain state, no I/O."""
    rq: Request
    leader: bool                         # a client's request, this node forwards it; else a leader's forward
    part: Partition | None = None        # the request's partition (led here, or at the forward's epoch)
    view: list[str] | None = None        # a leader with followers: the replicas the forwards go to
    fan: Fanout | None = None            # the forwards in flight
    waited: bool = True                  # their answers are in (or there are none)
    payload: object = None               # what the forward carries (an append's bytes) ...
    block: object = None                 # ... and the pool block holding them (followers READ from it)
    pieces: list[int] | None = None      # the payload's block CRCs
    outcome: object = None               # what the local step made: a handed-over write, a size, an extent id
    stage: str = "write"                 # the local step under way (for the reason a failure gives)

    @property
    def h(self) -> Header:
        return self.rq.h


class Forwardable:
    """An operation a leader replicates: its steps, for ``Pipeline.run``.  Defaults: no turn, nothing to
    prepare, settle or release."""

    ORDER: Order = Order.FORWARD_LOCAL
    FOLLOWERS_ONLY = ""                  # only a leader's forward, never a client's request: why (a repair's truncate)
    WHAT = "request"                     # its name in a REPLICATION_FAILED answer

    async def prepare(self, x: Replicated) -> None:
        pass

    def turn(self, x: Replicated) -> AsyncContextManager | None:
        return None

    def in_turn(self, x: Replicated) -> None:
        pass

    def forward(self, x: Replicated) -> tuple[Header, object]:
        """The followers' copy of the request, and a payload to send inline with it (or None)."""
        return x.h.forwarded(), None

    async def local(self, x: Replicated) -> None:
        raise NotImplementedError

    async def settle(self, x: Replicated) -> None:
        pass

    def broken(self, x: Replicated, e: BaseException) -> None:
        pass

    async def replicas_failed(self, x: Replicated, failed: int) -> NoReturn:
        raise Reply(Result.REPLICATION_FAILED, arg=failed,
                    why=f"replica {replica_names(x.fan.replicas, failed)} failed {self.WHAT}")

    def answer(self, x: Replicated) -> Header:
        raise NotImplementedError

    def release(self, x: Replicated) -> None:
        pass


class Pipeline:
    def __init__(self, partitions: Partitions, replication: Replicator | None):
        self.partitions = partitions
        self.replication = replication       # None: only follower-only operations run here

    async def run(self, op: Forwardable, rq: Request) -> Header:
        x = Replicated(rq, not forwarded(rq.h))
        x.part = await self._partition(op, x)
        if x.leader and len(x.part.replicas) > 1:
            x.view = list(x.part.replicas)       # the view of the request's epoch, whatever happens meanwhile
        try:
            await op.prepare(x)
            turn = op.turn(x)
            if turn is None:
                await self._operate(op, x)
            else:
                async with turn:
                    op.in_turn(x)
                    await self._operate(op, x)
            try:
                await op.settle(x)
            except BaseException as e:
                await self._broken(op, x, e)
                raise
            if x.fan is not None:
                await self._acked(op, x)
            if op.ORDER is Order.ACKS_LOCAL:
                await op.local(x)
            return op.answer(x)
        finally:
            op.release(x)

    async def _partition(self, op: Forwardable, x: Replicated) -> Partition:
        h = x.h
        if op.FOLLOWERS_ONLY:
            part = self.partitions.at_epoch(h)
            if x.leader or part.leader == self.partitions.me:
                raise Reply(Result.WRONG_ROLE, why=op.FOLLOWERS_ONLY)
            return part
        return await self.partitions.lead(h) if x.leader else self.partitions.at_epoch(h)

    async def _operate(self, op: Forwardable, x: Replicated) -> None:
        """The forwards and the local step, in the operation's order (its acks come later)."""
        order = op.ORDER
        try:
            if order is Order.LOCAL_FORWARD:
                await op.local(x)
            if x.view is not None:
                x.rq.stages.mark(FORWARDED)      # before the sends: a follower may see one before we return
                fwd, inline = op.forward(x)
                x.waited = False
                x.fan = await self.replication.submit(x.part, fwd, inline, replicas=x.view)
            if order is Order.FORWARD_LOCAL:
                await op.local(x)
        except BaseException as e:
            await self._broken(op, x, e)
            raise

    async def _broken(self, op: Forwardable, x: Replicated, e: BaseException) -> None:
        """A step failed once the change began: the operation's say (an append seals its extent), then the
        followers' answers (they may still be reading what the forward named)."""
        op.broken(x, e)
        if not x.waited:
            x.waited = True
            if x.fan:
                await self.replication.wait(x.fan)

    async def _acked(self, op: Forwardable, x: Replicated) -> None:
        x.waited = True
        failed = await self.replication.wait(x.fan)
        if failed:
            await op.replicas_failed(x, failed)
        x.rq.stages.mark(ACKED)
