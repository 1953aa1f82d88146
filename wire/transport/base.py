"""The transport interface: what the datanode and the client need from a connection, and nothing more.

A connection gives each side
  * control messages: ``send(header)`` puts one fixed-size header into one of the peer's preposted control
    slots (``send(header, payload)``: with a small payload after it, where ``max_inline`` allows: TCP);
    ``recv()`` returns the next message that landed in one of ours (slots are reposted as they are
    consumed).  Flow control is by credits: a requester never has more requests outstanding than the peer
    has slots, and every request gets exactly one response, so no side ever SENDs into a full ring.
  * one-sided operations on memory the peer registered: ``read(remote, local)`` copies the peer's
    ``remote`` buffer into our ``local`` memoryview, ``write(local, remote)`` the other way.  The peer's
    request handlers take no part: on verbs the NIC does it, on TCP the peer's transport layer does, and it
    serves only ranges inside a region registered with that rkey and the needed right.

Memory is registered once per process in a ``Domain`` (verbs: the protection domain; TCP: the table the
transport consults when a peer asks for a one-sided op).

A region registered ``scoped`` (the datanode's pool and landing memory, the SDK's buffers) is exposed on TCP
only through *grants*: a connection's ``grants`` hold the ranges a request in flight on it named (granted by
``rpc.Requester`` when it sends the request, revoked when the answer arrives or the request fails), and a
peer's one-sided op outside them is refused whatever rkey it names.  On verbs the NIC serves one-sided ops
itself: there a scoped region's MR has no remote rights and each grant binds a type-2 memory window on the
connection's queue pair (its own rkey, invalidated when the grant is dropped; ``verbs.WindowGrants``), where
the device has them; see docs/security.md.
"""
from __future__ import annotations

import abc
import dataclasses
import enum
import itertools
import secrets
from dataclasses import dataclass, field
from typing import Callable, Mapping

import cffi
import trio

from ..env import env_values
from ..protocol import INLINE_MAX, VERSION, RemoteBuf
from ..session import SessionError


_ffi = cffi.FFI()


def address_of(buf) -> int:
    """Virtual address of a buffer.  Not a pin: the caller keeps the memory alive while it is in use (a
    registered region, the pool, the connection's control mmap).

    The cffi buffer is released at once on purpose.  A cffi buffer kept beside the memoryview it exports
    from (say, in a frame held by a refusal's traceback) can reach the cyclic garbage collector together
    with it; CPython's memoryview tp_clear then drops its buffer while it is still exported and the later
    release segfaults (seen once at the end of the VM suite; ``test_transport`` reproduces it)."""
    with _ffi.from_buffer(buf, require_writable=False) as p:
        return int(_ffi.cast("uintptr_t", p))


class TransportChoice(enum.StrEnum):
    """The data path a node or client asks for: ``auto`` uses RDMA verbs if a device works, else TCP."""
    AUTO = "auto"
    VERBS = "verbs"
    TCP = "tcp"


class OptionError(ValueError):
    """A TransportOptions field out of its range: ``key`` names it, ``why`` says what it must be."""

    def __init__(self, key: str, why: str):
        super().__init__(f"{key}: {why}")
        self.key, self.why = key, why


@dataclass(frozen=True)
class TransportOptions:
    """How this process's connections are set up and tuned: built once at start (a node from its config,
    whose keys have these names; the SDK from its arguments) and handed to ``connect.make_domain``, whose
    Domain carries it to every connection."""
    tcp_congestion: str = "cubic"   # BBR paces each flow itself and splits large payloads; a LAN wants cubic
    rdma_device: str = ""          # empty: the first active device
    gid_index: int = 1             # RoCE v2 is usually at index 1
    rdma_windows: bool = True      # a peer reaches only the range a request granted it (type-2 memory windows)
    verbs_inline: int = 16 << 10   # a small WRITE's payload rides in its header's SEND: no READ round trip
    verbs_spin_us: int = 0         # busy-polling the CQ takes CPU a software device (rxe) needs; for hardware
    verbs_unsignaled: bool = False  # unsignaled header SENDs and window binds: no gain seen on rxe; for hardware
    verbs_post_thread_min: int = -1  # -1: 64 KiB on software devices, whose post_send moves the bytes under the GIL
    verbs_posters: int = 1         # threads posting those large ops (one did as well as more)
    trace: str = ""                # directory for each request's step times (wire/trace.py); empty: off

    def __post_init__(self) -> None:
        for key, lo, hi in (("gid_index", 0, 255), ("verbs_inline", 0, INLINE_MAX), ("verbs_spin_us", 0, 1_000_000),
                            ("verbs_post_thread_min", -1, 1 << 40), ("verbs_posters", 1, 64)):
            if not lo <= getattr(self, key) <= hi:
                raise OptionError(key, f"must be between {lo} and {hi}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> "TransportOptions":
        """The defaults, each overridden by $DATANODE_<FIELD> where ``environ`` sets it (the variables a node
        takes for the same keys): for programs that pass no options.  ValueError names a bad variable."""
        return cls(**env_values({f.name: f.type for f in dataclasses.fields(cls)}, environ))


class Access(enum.IntFlag):
    LOCAL_WRITE = 1
    REMOTE_READ = 2
    REMOTE_WRITE = 4


class TransportError(Exception):
    """The connection failed (peer gone, QP in error, stream closed); requests in flight on it fail."""


class ConnectionClosed(TransportError):
    pass


class RemoteAccessError(TransportError):
    """A one-sided op was refused by the owner of the memory (unknown rkey, out of bounds, no right)."""


@dataclass(eq=False)
class Region:
    """A registered memory region: ``view`` is the memory, ``addr`` its virtual address."""
    view: memoryview
    addr: int
    access: Access
    rkey: int
    lkey: int = 0
    mr: object = None            # the pyverbs MR when registered with a device
    scoped: bool = False         # peers reach it only through a grant on their connection
    windows: bool = False        # verbs: the MR has no remote rights; grants bind type-2 memory windows

    @property
    def length(self) -> int:
        return len(self.view)

    def remote(self, offset: int = 0, length: int | None = None) -> RemoteBuf:
        """Descriptor exposing [offset, offset+length) of this region to a peer."""
        if length is None:
            length = self.length - offset
        if offset < 0 or length < 0 or offset + length > self.length:
            raise ValueError("descriptor outside the region")
        return RemoteBuf(self.addr + offset, self.rkey, length)


class Domain:
    """All memory this process registered, looked up by rkey for one-sided operations by peers.

    When a verbs device is attached (``connect.make_domain``) every region is also registered there as one
    MR, and the MR's rkey is the region's rkey on both transports."""

    def __init__(self, options: TransportOptions | None = None) -> None:
        self._regions: dict[int, Region] = {}
        self.options = options or TransportOptions()     # how connections in this domain are set up
        self.device = None       # wire.transport.verbs.Device when RDMA is usable
        self.scoped = False      # the default for ``register(scoped=None)`` (the datanode sets True)

    def register(self, view: memoryview, addr: int, access: Access, *, scoped: bool | None = None) -> Region:
        """A region of ``view`` (at ``addr``).  Writable memory, except where there is no device and peers may
        only READ it (``Access.REMOTE_READ`` alone: the TCP transport only ever copies out of it) -- an SDK
        append from a caller's ``bytes``."""
        if not isinstance(view, memoryview):
            raise ValueError("register needs a memoryview")
        if view.readonly and (self.device is not None or access != Access.REMOTE_READ):
            raise ValueError("register needs a writable memoryview (read-only: only REMOTE_READ, without a device)")
        if access & Access.REMOTE_WRITE:
            access |= Access.LOCAL_WRITE          # verbs requires it
        region = Region(view=view, addr=addr, access=access, rkey=0,
                        scoped=self.scoped if scoped is None else scoped)
        if self.device is not None:
            self.device.register(region)          # sets rkey/lkey/mr
        else:
            while True:
                rkey = secrets.randbits(32) or 1
                if rkey not in self._regions:
                    break
            region.rkey = region.lkey = rkey
        self._regions[region.rkey] = region
        return region

    def deregister(self, region: Region) -> None:
        self._regions.pop(region.rkey, None)
        if region.mr is not None and self.device is not None:
            self.device.deregister(region)

    def region(self, rkey: int) -> Region | None:
        """Our region registered under ``rkey`` (None: not ours)."""
        return self._regions.get(rkey)

    def find_local(self, view_addr: int, length: int) -> Region:
        """The region holding our own [addr, addr+length) (for lkeys)."""
        for r in self._regions.values():
            if r.addr <= view_addr and view_addr + length <= r.addr + r.length:
                return r
        raise ValueError("local buffer is not inside any registered region")

    def resolve(self, addr: int, rkey: int, length: int, need: Access,
                grants: "Grants | None" = None) -> memoryview:
        """Serve a peer's one-sided op: the memory it may touch, or RemoteAccessError.  Never reveals which
        check failed beyond a short reason.  A scoped region also needs a grant in ``grants`` (the peer's
        connection's) covering the range with that right."""
        region = self._regions.get(rkey)
        if region is None and grants is not None:    # an rkey of one grant (TCP: ``KeyedGrants``)
            region = self._regions.get(grants.region_rkey(rkey))
        if region is None:
            raise RemoteAccessError("unknown rkey")
        if not (region.access & need):
            raise RemoteAccessError("region does not allow " + ("remote write" if need & Access.REMOTE_WRITE
                                                                else "remote read"))
        start = addr - region.addr
        if length < 0 or start < 0 or start + length > region.length:
            raise RemoteAccessError("outside the registered region")
        if region.scoped and (grants is None or not grants.covers(addr, rkey, length, need)):
            raise RemoteAccessError("not granted to this connection")
        return region.view[start:start + length]


class Grants:
    """The ranges of our memory one connection's peer may touch right now (one entry per request in flight
    that named a buffer).  Small: at most one per outstanding request."""

    def __init__(self) -> None:
        self._g: dict[int, tuple[int, int, int, Access]] = {}
        self._ids = itertools.count(1)

    def add(self, addr: int, rkey: int, length: int, access: Access) -> int:
        token = next(self._ids)
        self._g[token] = (addr, addr + length, rkey, access)
        return token

    async def grant(self, addr: int, rkey: int, length: int, access: Access) -> tuple[int, int]:
        """Expose [addr, addr+length) of the region ``rkey`` names to this connection's peer with ``access``
        until ``drop``: returns the token and the rkey to send the peer (here the region's own; a verbs
        connection binds a memory window and returns the window's rkey)."""
        return self.add(addr, rkey, length, access), rkey

    def drop(self, token: int | None) -> None:
        """Revoke a grant (idempotent); ``settle`` waits until the peer can no longer use it."""
        if token is not None:
            self._g.pop(token, None)

    async def settle(self, token: int | None) -> None:
        """Returns once the peer can no longer touch a dropped grant's range (here: at once); the owner may
        then reuse the buffer."""

    def covers(self, addr: int, rkey: int, length: int, need: Access) -> bool:
        end = addr + length
        for lo, hi, k, acc in self._g.values():
            if k == rkey and lo <= addr and end <= hi and acc & need:
                return True
        return False

    def region_rkey(self, rkey: int) -> int:
        """The region rkey a grant's own rkey stands for (0: none; here grants use the region's)."""
        return 0

    def __len__(self) -> int:
        return len(self._g)


class KeyedGrants(Grants):
    """Grants that each carry an rkey of their own (random, never a region's), as a verbs memory window does:
    used where our transport layer checks the peer's one-sided ops itself (TCP).  With the region's rkey a
    grant was known by its range alone, so when a request ended (say, cancelled) and its buffer went at
    once to a newer request on the same connection, a late answer to the old one matched the new grant and
    landed in the new request's buffer.  With one rkey per grant it is refused: that rkey died with its
    grant.  A scoped region is reachable only through a grant's rkey."""

    def __init__(self, domain: Domain) -> None:
        super().__init__()
        self._domain = domain
        self._keys: dict[int, int] = {}      # a grant's rkey -> its token
        self._key_of: dict[int, int] = {}    # token -> its rkey

    async def grant(self, addr: int, rkey: int, length: int, access: Access) -> tuple[int, int]:
        region = self._domain.region(rkey)
        if region is None or not region.scoped:
            return await super().grant(addr, rkey, length, access)
        token = self.add(addr, rkey, length, access)
        while True:
            key = secrets.randbits(32) or 1
            if key not in self._keys and self._domain.region(key) is None:
                break
        self._keys[key] = token
        self._key_of[token] = key
        return token, key

    def drop(self, token: int | None) -> None:
        super().drop(token)
        key = self._key_of.pop(token, None) if token is not None else None
        if key is not None:
            self._keys.pop(key, None)

    def covers(self, addr: int, rkey: int, length: int, need: Access) -> bool:
        token = self._keys.get(rkey)
        g = self._g.get(token) if token is not None else None
        if g is None:
            return False
        lo, hi, _, acc = g
        return lo <= addr and addr + length <= hi and bool(acc & need)

    def region_rkey(self, rkey: int) -> int:
        token = self._keys.get(rkey)
        g = self._g.get(token) if token is not None else None
        return g[2] if g is not None else 0


@dataclass
class ConnStats:
    sends: int = 0
    recvs: int = 0
    reads: int = 0
    read_bytes: int = 0
    writes: int = 0
    write_bytes: int = 0
    served_reads: int = 0
    served_read_bytes: int = 0
    served_writes: int = 0
    served_write_bytes: int = 0
    refused: int = 0
    posted_refused: int = 0      # our posted one-sided writes the peer refused (TCP)
    extra: dict = field(default_factory=dict)


class Connection(abc.ABC):
    """One connection to one peer.  Used inside ``async with``; the transport's own tasks (stream reader,
    completion poller) live in a nursery the connection owns, so nothing outlives it."""

    transport: str = "?"
    peer: str = "?"
    slots: int = 0           # the peer's control slots: our credit limit for outstanding requests
    role = None              # protocol.Role the peer proved in the hello; None: authentication is off
    identity: str = ""       # a NODE peer's address (its listen HOST:PORT), bound into its proof; a CLIENT's volume
    volume: str = ""         # a CLIENT peer proved this volume's key: it may touch that volume's partitions only
    tls: bool = False        # the stream is TLS (transport/tls.py)
    version: int = VERSION   # the protocol version the hello chose: every header on this connection carries it
    peer_software: str = ""  # what the peer's hello says it runs ("datanode 0.1.0"; empty: it did not say)
    session = None           # wire.session.Session: every control message is MAC'd (set by the hello)

    def __init__(self, our_slots: int) -> None:
        self.stats = ConnStats()
        self.grants = Grants()               # our memory this peer may touch now (requests in flight)
        self.pool_held = 0                   # bytes of the node's pool held by this peer's requests
        self.busy = 0                        # its requests being handled now (the server's count)
        self._closed: str | None = None     # why the connection ended
        self.misbehaved = ""                 # why we dropped the peer for breaking the rules (server policy)
        # control messages that landed in our slots, in arrival order; a transport hands each to ``_land``
        self._ctrl_in, self._ctrl_out = trio.open_memory_channel(our_slots)
        self._on_message = None              # deliver_to's callback
        self._queued = 0                     # messages queued for recv and not yet taken

    @property
    def alive(self) -> bool:
        return self._closed is None

    max_inline = 0           # payload bytes a control message may carry after its header (0: none)

    @abc.abstractmethod
    async def send(self, header: bytes, payload: memoryview | None = None) -> None:
        """One control message: ``header``, and ``payload`` after it in the same message (an inline
        WRITE, protocol.Flag.INLINE; at most ``max_inline`` bytes)."""

    def deliver_to(self, on_message) -> None:
        """Offer each control message that lands from now on to ``on_message(msg)``, called right in the
        transport's own task (reader or completion poller), before queueing it for ``recv``: a requester
        matching answers, or a server starting a request's handler, saves a task switch per message.
        ``on_message`` must neither raise nor wait for another task (short blocking work is allowed: a
        follower's small append and its flush, done where nothing else would wait); it returns True if it took
        the message, False to have it queued for ``recv`` (and the ones after it too, while any is queued:
        arrival order is kept).  ``recv`` raises ConnectionClosed at the end as before."""
        self._on_message = on_message

    def bind_session(self, session) -> None:
        """From now on every control message is MAC'd with ``session``'s keys (the hello made them)."""
        self.session = session

    def _land(self, msg, tag=None) -> bool:
        """A transport's hand-over of one control message (False: more messages than our slots); ``tag``:
        the session MAC it came with.  A message that fails the session's MAC raises TransportError: the
        transport ends the connection (and logs why)."""
        session = self.session
        if session is not None:
            try:
                session.open(msg, tag)
            except SessionError as e:
                self.misbehaved = str(e)
                raise TransportError(f"{e}: connection closed") from None
        on = self._on_message
        if on is not None and not self._queued and on(msg):
            self.stats.recvs += 1
            return True
        try:
            self._ctrl_in.send_nowait(msg)
        except trio.WouldBlock:
            return False
        self._queued += 1
        return True

    async def send_within(self, timeout: float, header: bytes, payload: memoryview | None = None) -> bool:
        """``send``, given up after ``timeout`` seconds (False; a message cut half-way ends the connection).
        A transport whose send usually completes at once overrides this to set the timer only when it must
        wait (a cancel scope with a deadline costs more than a small send)."""
        with trio.move_on_after(timeout) as scope:
            await self.send(header, payload)
        return not scope.cancelled_caught

    def send_nowait(self, timeout: float, header: bytes) -> bool:
        """A control message without payload (an answer) sent right away, without waiting -- for a caller that
        cannot (``deliver_to``'s callback): True once it is on its way; False if nothing was sent (the
        caller sends it with ``send_within``).  A transport that can take a message at once (TCP: the kernel,
        when nobody else is sending) overrides this; ``timeout`` bounds the rest of a message the kernel took
        only part of, sent by the connection's own task (the connection ends if it is not sent in time)."""
        return False

    def send_many_nowait(self, timeout: float, headers: list[bytes]) -> bool:
        """``send_nowait`` for several answers, in order, at once (TCP: one ``sendmsg``): True once all are on
        their way; False if none was sent (the caller sends them with ``send_many_within``)."""
        return False

    async def send_many_within(self, timeout: float, headers: list[bytes]) -> bool:
        """Control messages without payloads (answers), in order, given up after ``timeout`` seconds for all
        of them (False, as ``send_within``).  A transport that can hand them to the kernel at once (TCP: one
        ``sendmsg``) overrides this."""
        with trio.move_on_after(timeout) as scope:
            for h in headers:
                await self.send(h)
        return not scope.cancelled_caught

    async def recv(self) -> bytes:
        """The next control message (raises ConnectionClosed at end)."""
        try:
            msg = await self._ctrl_out.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            raise ConnectionClosed(self._closed or "connection closed") from None
        self._queued -= 1
        self.stats.recvs += 1
        return msg

    @abc.abstractmethod
    async def read(self, remote: RemoteBuf, local: memoryview, local_region: Region) -> None:
        """One-sided: peer's ``remote`` -> our ``local`` (len(local) == remote.length)."""

    @abc.abstractmethod
    async def write(self, local: memoryview, local_region: Region, remote: RemoteBuf, *,
                    posted: bool = False, release: Callable[[], None] | None = None) -> None:
        """One-sided: our ``local`` -> peer's ``remote``.  Returns once the bytes are in the peer's memory
        and raises RemoteAccessError if the peer refused them -- or, ``posted``, as soon as ``local`` may be
        reused and the peer is bound to land the bytes before it handles any later control message of ours
        (a refusal then is only logged: whoever answers with such a message relies on the peer checking what
        landed, as a READ's response carries the data's CRC).  A READ's answer is posted: its response
        follows on the same ordered connection, so waiting for the write's own completion costs a round
        trip for nothing.

        ``posted`` with ``release``: the call may return while the transport still reads ``local`` (verbs:
        the NIC does until the work request completes); ``release()`` runs in the event loop once it no
        longer does -- also when the write or the connection fails --, and never if the call raises.  TCP
        copies ``local`` into the socket before returning and calls ``release`` then."""

    @abc.abstractmethod
    async def aclose(self) -> None: ...

    def info(self) -> dict:
        s = self.stats
        return {"peer": self.peer, "transport": self.transport,
                "role": self.role.name.lower() if self.role is not None else None, "identity": self.identity,
                **({"volume": self.volume} if self.volume else {}), "tls": self.tls,
                "version": self.version, "software": self.peer_software, "session": self.session is not None,
                "pool_held": self.pool_held, "inflight": self.busy, "sends": s.sends, "recvs": s.recvs,
                "reads": s.reads, "read_bytes": s.read_bytes, "writes": s.writes, "write_bytes": s.write_bytes,
                "served_reads": s.served_reads, "served_read_bytes": s.served_read_bytes,
                "served_writes": s.served_writes, "refused": s.refused, **s.extra}
