"""Another node's REPLICA_STATE of many partitions, asked together.

A failover or a hand-off gives a node hundreds of views at once whose new leader it must ask whether that
leader's copy is known synced (datanode/viewguard.py), and a new node asks each partition's other replicas
its volume (ops/admin.py).  One ``REPLICA_STATE`` each is a round trip and a landing block per partition
(the landing region holds 8 answers at a time): the checks queue behind each other.  ``StateAsks.ask`` is
``REPLICA_STATE``'s drop-in: the asks waiting for the same node go together in one ``REPLICA_STATES``, the
partitions of one window of ids (``STATES_WINDOW``) per request, at most ``SENDERS`` requests under way per
node.  No caller waits for a timer: the first ask goes at once, those that arrive meanwhile in the next
request; an ask for a partition already waiting to go shares that one (an answer produced after the ask).

A node whose protocol predates the batch (``OP_SINCE``) is asked one partition at a time, as is a partition
whose state did not fit in the batch's answer (``left``) or whose batch the node refused as a whole (its
own request says why).  A batch that got no answer (unreachable, timed out) fails each of its asks with that
error, as each request alone would have.
"""
from __future__ import annotations

import trio

from wire.protocol import OP_SINCE, STATES_WINDOW, Header, Op
from wire.transport.base import TransportError
from .repairkit import JSON_ANSWER, NotHosted, RepairAbort, Refused

SENDERS = 4            # REPLICA_STATES requests under way to one node at once (the landing region holds 8)


class _Ask:
    __slots__ = ("pid", "done", "state", "error", "alone")

    def __init__(self, pid: int):
        self.pid = pid
        self.done = trio.Event()
        self.state: dict | None = None
        self.error: Exception | None = None
        self.alone = False                  # ask it with its own REPLICA_STATE


class StateAsks:
    """Coalesced REPLICA_STATE asks through ``rep`` (the node's Repairer: its links and landing region)."""

    def __init__(self, rep):
        self.rep = rep
        self._waiting: dict[str, dict[int, _Ask]] = {}     # addr -> pid -> the ask not yet sent
        self._sending: dict[str, int] = {}
        self._moved: dict[str, trio.Event] = {}             # addr: a batch to it was answered

    async def ask(self, addr: str, pid: int) -> dict:
        """``addr``'s REPLICA_STATE answer for partition ``pid``; RepairAbort (NotHosted: not there) as the
        single request raises."""
        if not await self._batches(addr):
            return await self._single(addr, pid)
        waiting = self._waiting.setdefault(addr, {})
        item = waiting.get(pid)
        if item is None:
            item = waiting[pid] = _Ask(pid)
        while not item.done.is_set():
            waiting = self._waiting.get(addr) or {}
            if waiting and self._sending.get(addr, 0) < SENDERS:
                batch = _window(waiting)
                self._sending[addr] = self._sending.get(addr, 0) + 1
                try:
                    await self._send(addr, batch)
                finally:
                    self._sending[addr] -= 1
                    self._moved.pop(addr, trio.Event()).set()
            else:
                await self._moved.setdefault(addr, trio.Event()).wait()
        if not self._waiting.get(addr, True):
            del self._waiting[addr]
        if item.alone:
            return await self._single(addr, pid)
        if item.error is not None:
            raise item.error
        return item.state

    async def _batches(self, addr: str) -> bool:
        try:
            link = await self.rep.links.get(addr)
        except (TransportError, OSError):
            return False                    # the single request says it is unreachable, as before
        return link.conn.version >= OP_SINCE[Op.REPLICA_STATES]

    async def _single(self, addr: str, pid: int) -> dict:
        self.rep.counters.state_singles += 1
        return await self.rep.call_json(addr, Header(opcode=Op.REPLICA_STATE, partition=pid))

    async def _send(self, addr: str, batch: list[_Ask]) -> None:
        """One REPLICA_STATES for ``batch`` (one window of ids); sets each ask's answer."""
        base = batch[0].pid
        bits = 0
        for a in batch:
            bits |= 1 << (a.pid - base)
        self.rep.counters.state_batches += 1
        try:
            try:
                ans = await self.rep.call_json(addr, Header(opcode=Op.REPLICA_STATES, partition=base, arg=bits),
                                               room=JSON_ANSWER)
                states, absent = ans["states"], {int(pid) for pid in ans["absent"]}
                if not isinstance(states, dict):
                    raise TypeError("states is not an object")
            except Refused:             # refused as a whole (an error code): each alone learns why
                for a in batch:
                    a.alone = True
                return
            except RepairAbort as e:    # no answer at all: each ask alone would meet the same
                for a in batch:
                    a.error = e
                return
            except (KeyError, TypeError, ValueError) as e:
                err = RepairAbort(f"{addr}: REPLICA_STATES -> unreadable answer ({e})")
                for a in batch:
                    a.error = err
                return
            for a in batch:
                st = states.get(str(a.pid))
                if isinstance(st, dict):
                    a.state = st
                elif a.pid in absent:
                    a.error = NotHosted(f"{addr}: REPLICA_STATE of partition {a.pid} -> NOT_FOUND")
                else:                   # left out (its answer did not fit: ``left``): alone
                    a.alone = True
        finally:
            for a in batch:
                if a.state is None and a.error is None and not a.alone:     # (this sender was cancelled)
                    a.error = RepairAbort(f"{addr}: REPLICA_STATES cut short")
                a.done.set()


def _window(waiting: dict[int, _Ask]) -> list[_Ask]:
    """Take the waiting asks of the lowest id's window out of ``waiting``."""
    base = min(waiting)
    batch = [waiting.pop(pid) for pid in sorted(p for p in waiting if p < base + STATES_WINDOW)]
    return batch
