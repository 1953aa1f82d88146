"""A controlled shutdown (SIGTERM, SIGINT, or an admin's ``NODE_DRAIN``: ``dnctl node drain ADDR``).

A node that just stopped would be handled as a failure: the writes of every partition naming it stall until
its lease expires and the manager moves them.  So a stopping node, before it stops taking writes:

1. **hands off** (``_hand_off``): with the cluster map in etcd and an active manager, it puts
   ``handoff/<listen>`` under its lease (``EtcdAgent.request_handoff``).  The manager moves every partition
   naming it to its other replicas -- where it leads, an in-sync follower leads at epoch + 1, the same fenced
   change as a failover (manager/tasks.py ``hand_off``) -- and the node's agent, seeing views that no longer
   name it, drops its copies.  The node serves as before meanwhile; it waits until it holds no partition
   that has another replica, or until ``drain_timeout_s`` (less a reserve for the next step) is up.  Clients
   follow the new views by their etcd watch and re-send what the old leader refused.
2. **drains**: it refuses new requests (RETRY, "shutting down"), stops accepting connections and waits for
   the requests in flight, until ``drain_timeout_s`` is up;
3. **leaves** etcd: its agent stops and revokes its lease, so nobody waits for the lease to expire.

Without etcd (a cluster run by hand), with no active manager, or with etcd unreachable, step 1 cannot
happen: the node says so, naming the partitions whose writes stop until it is back (or an admin moves them
with ``dnctl partition set-leader``), and goes on with steps 2 and 3.  A step that cannot finish in time
is logged with what was left, and the node stops anyway.  A second signal skips what is left of step 1.

``progress`` is what NODE_STATUS shows under ``drain`` (``dnctl node drain`` follows it); a ``NODE_DRAIN``
that waits (``report``) is answered with it once the node has left etcd, just before it exits -- the requests
in flight that step 2 waits for are the others.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Awaitable, Callable, Iterable

import trio

from wire.etcdmap import EtcdError

if TYPE_CHECKING:
    from .config import ClusterConfig
    from .etcdagent import EtcdAgent
    from .partition import Partition

log = logging.getLogger("datanode.server")
POLL_S = 0.05             # how often the hand-off looks at the partitions still held (local state: cheap)
VIEWS_S = 1.0             # how often it reads etcd's views of those partitions, for the progress and the log
RESERVE_S = 5.0           # of drain_timeout_s, kept for the requests in flight once the hand-off is over
REPORT_S = 2.0            # how long the reports to waiting NODE_DRAIN requests may take to go out


def reserve(timeout: float) -> float:
    """Seconds of the drain's budget kept for step 2 (at most a quarter of it)."""
    return min(RESERVE_S, timeout / 4)


def still_held(parts, me: str) -> list:
    """The partitions a hand-off waits for: held here, with another replica to move to."""
    return [p for p in parts if len(p.replicas) > 1 and me in p.replicas]


def movable(view, leaving: set[str]) -> bool:
    """Can the manager still move this partition off the stopping node(s)?  Not when etcd does not know it,
    nor when every replica is stopping (there is nobody to hand it to)."""
    return view is not None and any(a not in leaving for a in view.replicas)


def why_held(pid: int, view) -> str:
    """What etcd's view says about a partition still held here (``view``: a PartView, or None)."""
    if view is None:
        return "not in the cluster map (etcd does not know it): the manager cannot move it"
    return (f"etcd's view: epoch {view.epoch}, replicas {','.join(view.replicas)}, synced "
            f"{','.join(view.synced) or 'none'}, {view.state}{'' if view.installed else ', being installed'}")


@dataclasses.dataclass(frozen=True)
class NodeControl:
    """What the stop sequence sees of its node and may do to it."""
    me: str                                          # the node's listen address
    cfg: ClusterConfig                               # drain_timeout_s; etcd, for the advice it logs
    parts: Callable[[], Iterable[Partition]]         # the partitions held here now
    state: Callable[[], str]                         # starting | serving | ...
    inflight: Callable[[], int]                      # requests in flight
    drained: Callable[[], Awaitable[None]]           # returns once the answers in flight are sent
    stop_taking: Callable[[], None]                  # refuse new requests from now on (RETRY)
    agent: EtcdAgent | None                          # the cluster map in etcd, when configured
    leave_etcd: Callable[[], Awaitable[str | None]]  # stop the agent; how leaving went (None: no etcd)


class Drain:
    """The stop sequence of one node (``datanode.server.Node``)."""

    def __init__(self, ctl: NodeControl):
        self.ctl = ctl
        self.requested = trio.Event()        # set by the first signal or NODE_DRAIN
        self.hurry = trio.Event()            # set by a second one: skip what is left of the hand-off
        self.why = ""
        self.phase = ""                      # "" | handing off | draining | leaving | stopped
        self.started: float | None = None    # time.time() of the request
        self.handed_off: list[int] = []      # partitions moved away during the hand-off
        self.left: dict[int, str] = {}       # partitions still held (with another replica), and why
        self.notes: list[str] = []           # what could not be done, one line each
        self.finished = trio.Event()         # the node has stopped taking requests and left etcd
        self.waiting = 0                     # NODE_DRAIN requests waiting for ``report``

    def request(self, why: str, *, again_hurries: bool = False) -> bool:
        """Start stopping (the serve loop runs ``run``); with ``again_hurries`` (a signal) a request while
        stopping skips what is left of the hand-off.  False: it was stopping already."""
        if self.requested.is_set():
            if again_hurries and not self.hurry.is_set():
                log.warning("%s again: not waiting for the hand-off any more", why)
                self.hurry.set()
            return False
        self.why, self.started = why, time.time()
        self.requested.set()
        return True

    def progress(self) -> dict | None:
        if not self.requested.is_set():
            return None
        return {"phase": self.phase or "starting", "why": self.why, "seconds": round(time.time() - self.started, 2),
                "handed_off": sorted(self.handed_off), "left": {str(k): v for k, v in sorted(self.left.items())},
                "notes": list(self.notes), "inflight": self.ctl.inflight() - self.waiting}

    async def report(self) -> dict:
        """The drain's outcome, once the node has stopped taking requests and left etcd."""
        self.waiting += 1
        try:
            await self.finished.wait()
        finally:
            self.waiting -= 1
        return self.progress()

    def _note(self, text: str) -> None:
        self.notes.append(text)
        log.warning("%s", text)

    async def run(self, accepting: trio.CancelScope) -> None:
        ctl, cfg = self.ctl, self.ctl.cfg
        t0 = trio.current_time()
        deadline = t0 + cfg.drain_timeout_s
        log.info("%s: stopping (drain_timeout_s %g): handing off, then %d in-flight requests", self.why,
                 cfg.drain_timeout_s, ctl.inflight())
        self.phase = "handing off"
        if ctl.state() == "serving":
            budget = cfg.drain_timeout_s - reserve(cfg.drain_timeout_s)
            with trio.move_on_at(t0 + budget) as handing:
                await self._hand_off()
            if handing.cancelled_caught:
                self._note(f"the hand-off did not finish within {budget:g}s (drain_timeout_s less "
                           f"{reserve(cfg.drain_timeout_s):g}s for the requests in flight)")
            self._report_left()
        self.phase = "draining"
        ctl.stop_taking()
        if ctl.agent is not None:
            ctl.agent.copy.close()            # clients' long polls of the map answer now, not at their bound
        accepting.cancel()
        with trio.move_on_at(deadline) as waited:
            while ctl.inflight() > self.waiting:          # (the NODE_DRAINs waiting for the report wait on)
                await trio.sleep(POLL_S / 5)
        if waited.cancelled_caught:
            self._note(f"{ctl.inflight() - self.waiting} request(s) still in flight after "
                       f"{cfg.drain_timeout_s:g}s (drain_timeout_s): stopping anyway")
        self.phase = "leaving"
        left = await ctl.leave_etcd()
        if left:
            (log.info if left.startswith("left") else log.warning)("%s", left)
            if not left.startswith("left"):
                self.notes.append(left)
        self.phase = "stopped"
        log.info("stopped taking requests after %.2fs: %d partition(s) handed off%s", trio.current_time() - t0,
                 len(self.handed_off), f", {len(self.left)} not" if self.left else "")
        self.finished.set()
        with trio.move_on_after(REPORT_S):
            await ctl.drained()                           # the reports sent

    # -- step 1 ----------------------------------------------------------------------------------------------
    async def _hand_off(self) -> None:
        ctl = self.ctl
        alone = sorted(p.pid for p in ctl.parts() if len(p.replicas) == 1)
        if alone:
            self._note(f"partition(s) {_ids(alone)} have no other replica: nobody serves them until this node "
                       f"is back")
        held = {p.pid for p in still_held(ctl.parts(), ctl.me)}
        if not held:
            return
        agent = ctl.agent
        if agent is None:
            self._note(f"no cluster map (etcd is not configured): partition(s) {_ids(held)} not handed off; their "
                       f"writes stop until this node is back, unless an admin moves them first "
                       f"(dnctl partition set-leader / replica remove)")
            return
        try:
            manager = await agent.manager()
            if manager is None:
                self._note(f"no active manager in etcd: partition(s) {_ids(held)} not handed off; their writes "
                           f"wait for this node (start one: dnmanager --etcd {ctl.cfg.etcd})")
                return
            await agent.request_handoff()
        except EtcdError as e:
            self._note(f"etcd: {e}: partition(s) {_ids(held)} not handed off")
            return
        log.info("asked manager %s to move partition(s) %s to their other replicas", manager, _ids(held))
        looked = -1e9
        while True:
            now_held = {p.pid for p in still_held(ctl.parts(), ctl.me)}
            self.handed_off = sorted(held - now_held)
            if not now_held:
                self.left = {}
                log.info("every partition handed off (%s)", _ids(held))
                return
            if self.hurry.is_set():
                return
            if trio.current_time() - looked >= VIEWS_S:
                looked = trio.current_time()
                if not await self._worth_waiting(agent, now_held):
                    return
            with trio.move_on_after(POLL_S):
                await self.hurry.wait()

    async def _worth_waiting(self, agent, held: set[int]) -> bool:
        """Look at etcd: note why each partition is still here (``left``); False when waiting is pointless --
        no manager is active any more, or the manager cannot move any of them (``movable``)."""
        et = agent.etcd
        try:
            # every entry is read, but only those of the partitions still here are checked and opened: the
            # hand-off looks each VIEWS_S, and opening all of a thousand views each time cost more than the rest
            kvs, _ = await et.get_prefix(et.parts_prefix)
            keys = {et.part_key(pid) for pid in held}
            views = {v.id: v for v in (et.open(k, val, rev) for k, val, rev in kvs if k in keys) if v is not None}
            manager = await agent.manager()
            kvs, _ = await et.get_prefix(et.key("handoff") + "/")
        except EtcdError as e:
            log.debug("hand-off progress: %s", e)
            return True
        leaving = {k.rsplit("/", 1)[1] for k, _v, _r in kvs} | {self.ctl.me}
        # the views our watch has not delivered yet (they drop our copies): together, as the watch would
        await agent.apply_many([views[pid] for pid in sorted(held) if pid in views])
        held = {p.pid for p in still_held(self.ctl.parts(), self.ctl.me)}
        if not held:
            return True                   # (the caller sees it at once)
        self.left = {pid: why_held(pid, views.get(pid)) for pid in sorted(held)}
        if manager is None:
            self._note("the manager went away during the hand-off")
            return False
        if not any(movable(views.get(pid), leaving) for pid in held):
            self._note(f"partition(s) {_ids(held)} cannot be handed off: etcd does not know them, or every "
                       f"replica is stopping")
            return False
        return True

    def _report_left(self) -> None:
        if not self.left:
            return
        self._note(f"{len(self.left)} partition(s) still here, not handed off: stopping anyway; the manager "
                   f"fails them over once this node's lease is gone")
        for pid, why in self.left.items():
            log.warning("  partition %d: %s", pid, why)


def _ids(pids) -> str:
    return ",".join(map(str, sorted(pids)))
