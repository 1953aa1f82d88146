"""Who gets a connection, and whose connection goes under pressure.  Pure decisions (no sockets, no clock, no
randomness of its own): the node (datanode/server.py) tells it what happens and does what it says.

A connection is first *pending* -- accepted, its hello not done -- then *established* with the role its hello
proved (``None``: a node without a secret, which proves nothing).

* **Loopback only.**  A node without a secret takes no peer from another host unless ``insecure = true``:
  refused before it sends a byte.
* **Pending connections** have their own small budget, so connections that never say hello cannot take the
  slots of anyone who does (a pending one also ends at ``hello_timeout``): at most ``preauth_per_host`` from
  one address (a new one takes the place of that address's oldest -- the oldest that has not yet sent its
  whole hello, where there is one: connections that never finish their hello cannot keep a peer of the same
  address out, and a flood of them does not close the hello of a peer that is already proving itself), and
  ``preauth_max`` in all.  From ``preauth_early_drop`` pending
  on, a new one from an address that already has one pending is dropped at random, with a probability
  rising from 30% to 100% at ``preauth_max`` (sshd's MaxStartups).  At ``preauth_max`` a new connection from
  an address with fewer pending takes the place of the oldest pending one of the address with the most: a
  flooding address pays for its flood, a quiet one still gets in.
* **Established connections**: client-role (and unauthenticated) connections may use ``max_connections``
  minus ``reserved`` (datanodes and admins always get in: they use the rest, and ``max_connections`` does
  not stop them), at most ``per_host`` from one host.  Over a limit, the least recently active *idle*
  client connection (nothing in flight) of that host -- of any host, for the overall limit -- is closed to
  make room; with none idle the newcomer is refused.
* **Idle connections** cost memory (each holds its buffers), so there may be at most ``idle_max`` idle
  client connections in all and ``idle_per_host`` from one host; beyond that the least recently active are
  closed (a client reconnects when it next needs one).  A connection whose hello has just proven the client
  role does not count here for ``fresh_s`` (the hello's own time, ``hello_timeout``): its first request is on
  its way, and a crowd of clients opening at once would otherwise close each other's new connections in
  turn.  Only a key holder gets that grace (one that proved nothing could open connections faster than they
  age), and the connection limits above still take an idle new one's place: they bound all of them.
"""
from __future__ import annotations

import dataclasses
import ipaddress
from typing import Callable

from wire.protocol import Role

NODE_ROLES = frozenset({Role.NODE, Role.ADMIN})
EARLY_DROP_FROM = 0.3               # the early-drop probability at preauth_early_drop (sshd's "rate")
TOO_MANY = 3                        # protocol.HELLO_STATUS: "too many connections"
LOOPBACK_ONLY = 8                   # protocol.HELLO_STATUS: "... takes peers on its own host only"


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an IP address) is this host's loopback (an IPv4-mapped one too)."""
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


@dataclasses.dataclass
class Limits:
    max_connections: int = 1024
    reserved: int = 32
    per_host: int = 0
    preauth_max: int = 64
    preauth_per_host: int = 8
    preauth_early_drop: int = 32
    idle_max: int = 0
    idle_per_host: int = 0
    fresh_s: float = 0.0                 # a just-admitted connection is not idle (closed for room) this long
    loopback_only: bool = False          # no secret, not insecure: every peer must be on this host
    unproven_loopback_only: bool = False  # a secret, in transition: a peer that proves nothing must be

    @classmethod
    def from_config(cls, cfg) -> "Limits":
        return cls(max_connections=cfg.max_connections, reserved=cfg.reserved_connections,
                   per_host=cfg.max_connections_per_host, preauth_max=cfg.preauth_max,
                   preauth_per_host=cfg.preauth_per_host, preauth_early_drop=cfg.preauth_early_drop,
                   idle_max=cfg.idle_max, idle_per_host=cfg.idle_per_host, fresh_s=cfg.hello_timeout,
                   loopback_only=not cfg.secret_file and not cfg.insecure,
                   unproven_loopback_only=bool(cfg.secret_file) and cfg.auth_transition and not cfg.insecure)


class Entry:
    """One connection as admission sees it: ``pending`` (in its hello), ``open``, or ``gone``.  Whoever serves
    it keeps ``last_active`` (when its last request arrived) up to date and sets ``served`` to what counts its
    requests in flight (``.busy``: the Connection); ``handle`` is the caller's, to close it by."""
    __slots__ = ("host", "since", "state", "role", "last_active", "served", "handle", "spoke", "opened")

    def __init__(self, host: str, now: float, handle=None, spoke: Callable[[], bool] | None = None):
        self.host, self.since, self.handle = host, now, handle
        self.spoke = spoke                   # () -> has its peer sent its whole hello? (None: unknown, no)
        self.state = "pending"
        self.role = None
        self.last_active = now
        self.served = None
        self.opened = now                    # when its hello let it in

    @property
    def client(self) -> bool:
        """Counts against the client limits: proven client role, or nothing proven."""
        return self.role not in NODE_ROLES

    def idle(self) -> bool:
        return self.state == "open" and self.client and not (self.served is not None and self.served.busy)

    def closable(self, now: float, fresh_s: float) -> bool:
        """Idle, and (a proven client) past its first ``fresh_s`` after its hello: counts against the idle
        limits.  A peer that proved nothing gets no such grace: anyone could open connections faster."""
        return self.idle() and (self.role != Role.CLIENT or now - self.opened >= fresh_s)


@dataclasses.dataclass
class Verdict:
    entry: Entry | None                      # None: refused
    status: int = 0                          # HELLO_STATUS code to refuse with
    why: str = ""
    close: list[Entry] = dataclasses.field(default_factory=list)   # connections to close to make room


class Admission:
    def __init__(self, limits: Limits, rand: Callable[[], float]):
        self.limits = limits
        self.rand = rand                     # uniform in [0, 1): the early drop's dice
        self.pending: dict[str, list[Entry]] = {}     # host -> its pending connections, oldest first
        self.npending = 0
        self.clients: dict[str, list[Entry]] = {}     # host -> its open client connections
        self.nclient = 0
        self.nother = 0                      # open node and admin connections
        self.refused = 0
        self.evicted = 0

    # -- a new connection ---------------------------------------------------------------------------------
    def arrive(self, host: str, now: float, handle=None, spoke: Callable[[], bool] | None = None) -> Verdict:
        """A new connection from ``host``: ``spoke`` tells, when asked, whether its peer has sent its whole
        hello (a pending connection that has is closed to make room only after those that have not)."""
        lim = self.limits
        if lim.loopback_only and not is_loopback(host):
            return self._refuse(LOOPBACK_ONLY, f"{host} is not this host, and this node has no secret "
                                               f"(insecure = false)")
        mine = self.pending.get(host, [])
        if lim.preauth_max and mine and self.npending >= lim.preauth_early_drop:
            span = max(1, lim.preauth_max - lim.preauth_early_drop)
            p = EARLY_DROP_FROM + (1 - EARLY_DROP_FROM) * min(1.0, (self.npending - lim.preauth_early_drop) / span)
            if self.rand() < p:
                return self._refuse(TOO_MANY, f"{self.npending} connections have not finished their hello "
                                              f"(random early drop from preauth_early_drop)")
        close: list[Entry] = []
        if lim.preauth_per_host and len(mine) >= lim.preauth_per_host:
            close.append(self._drop(_stuck(mine)))   # its own oldest: a stuck hello yields to a new one
        elif lim.preauth_max and self.npending >= lim.preauth_max:
            top = max(self.pending, key=lambda h: len(self.pending[h]))
            if len(self.pending[top]) <= len(mine):
                return self._refuse(TOO_MANY, f"{self.npending} connections have not finished their hello "
                                              f"(preauth_max)")
            close.append(self._drop(_stuck(self.pending[top])))
        e = Entry(host, now, handle, spoke)
        self.pending.setdefault(host, []).append(e)
        self.npending += 1
        return Verdict(e, close=close)

    # -- its hello is done ----------------------------------------------------------------------------------
    def hello(self, e: Entry, role: int | None, now: float) -> Verdict:
        """``e`` proved ``role`` (None: nothing proven): let it in (and close these to make room) or not."""
        if e.state != "pending":             # closed to make room meanwhile
            return self._refuse(TOO_MANY, "its place was given to another connection")
        self._remove(e)
        e.role, e.last_active, e.opened = role, now, now
        lim = self.limits
        if role is None and lim.unproven_loopback_only and not is_loopback(e.host):
            return self._refuse(LOOPBACK_ONLY, f"{e.host} is not this host and proved nothing (auth_transition "
                                               f"takes peers without the secret from this host only)")
        close: list[Entry] = []
        if not e.client:
            if self.nclient + self.nother >= lim.max_connections:
                victim = self._oldest_idle(x for lst in self.clients.values() for x in lst)
                if victim is None:
                    return self._refuse(TOO_MANY, f"{self.nclient + self.nother} connections open "
                                                  f"(max_connections), no client connection idle")
                close.append(self._drop(victim))
            e.state = "open"
            self.nother += 1
            return Verdict(e, close=close)
        mine = self.clients.get(e.host, [])
        if lim.per_host and len(mine) >= lim.per_host:
            victim = self._oldest_idle(mine)
            if victim is None:
                return self._refuse(TOO_MANY, f"{len(mine)} client connections open from {e.host} "
                                              f"(max_connections_per_host), none idle")
            close.append(self._drop(victim))
        limit = lim.max_connections - min(lim.reserved, lim.max_connections // 2)
        if self.nclient >= limit:
            victim = self._oldest_idle(x for lst in self.clients.values() for x in lst)
            if victim is None:
                return self._refuse(TOO_MANY, f"{self.nclient} client connections open (max_connections "
                                              f"{lim.max_connections} minus reserved_connections), none idle",
                                    close)
            close.append(self._drop(victim))
        e.state = "open"
        self.clients.setdefault(e.host, []).append(e)
        self.nclient += 1
        return Verdict(e, close=close + self._idle_over(e, now))

    def _idle_over(self, new: Entry, now: float) -> list[Entry]:
        """Idle client connections beyond ``idle_per_host`` (of the newcomer's host) and ``idle_max`` (all):
        the least recently active go."""
        lim, out = self.limits, []
        if lim.idle_per_host:
            idle = sorted((x for x in self.clients.get(new.host, []) if x.closable(now, lim.fresh_s)), key=_age)
            out += [self._drop(x) for x in idle[:max(0, len(idle) - lim.idle_per_host)]]
        if lim.idle_max:
            idle = sorted((x for lst in self.clients.values() for x in lst if x.closable(now, lim.fresh_s)),
                          key=_age)
            out += [self._drop(x) for x in idle[:max(0, len(idle) - lim.idle_max)]]
        return out

    @staticmethod
    def _oldest_idle(entries) -> Entry | None:
        return min((x for x in entries if x.idle()), key=_age, default=None)

    def _drop(self, e: Entry) -> Entry:
        """``e`` is closed to make room (the caller closes it)."""
        self._remove(e)
        self.evicted += 1
        return e

    def _remove(self, e: Entry) -> None:
        """Take ``e`` out of whatever it is counted in; it is ``gone`` until the caller says otherwise."""
        if e.state == "pending":
            lst, self.npending = self.pending[e.host], self.npending - 1
            table = self.pending
        elif e.state == "open" and e.client:
            lst, self.nclient = self.clients[e.host], self.nclient - 1
            table = self.clients
        else:
            if e.state == "open":
                self.nother -= 1
            e.state = "gone"
            return
        lst.remove(e)
        if not lst:
            del table[e.host]
        e.state = "gone"

    # -- it ended -------------------------------------------------------------------------------------------
    def left(self, e: Entry) -> None:
        self._remove(e)

    def _refuse(self, status: int, why: str, close: list[Entry] | None = None) -> Verdict:
        self.refused += 1
        return Verdict(None, status, why, close or [])

    def counts(self) -> dict:
        return {"pending_connections": self.npending, "client_connections": self.nclient,
                "node_admin_connections": self.nother,
                "idle_client_connections": sum(x.idle() for lst in self.clients.values() for x in lst),
                "refused_connections": self.refused, "connections_closed_for_room": self.evicted}


def _age(e: Entry) -> float:
    return e.last_active


def _stuck(pending: list[Entry]) -> Entry:
    """The pending connection to close to make room: the oldest whose peer has not sent its whole hello (it
    may never), else the oldest."""
    for e in pending:
        if e.spoke is None or not e.spoke():
            return e
    return pending[0]
