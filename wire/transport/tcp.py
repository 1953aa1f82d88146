"""TCP transport: the same control messages and one-sided operations as verbs, carried on one stream.

Frames on the stream (after the hello), each a 32-byte frame header, big-endian (a frame and its payload
leave in one ``sendmsg``):

    type u8 | status u8 | pad u16 | length u32 | op_id u64 | addr u64 | rkey u32 | reserved u32

  CTRL        +length bytes: one control message (a protocol header; for an inline WRITE its payload
              after it, ``max_inline``) for the peer's slots.  On an authenticated session (wire/session.py)
              op_id and addr carry the message's 16-byte MAC instead (unused otherwise: zero)
  READ_REQ    "send me [addr, +length) of region rkey"      -> answered by READ_RESP (+length bytes if ok)
  WRITE_REQ   +length bytes "put these at [addr, +length)"  -> answered by WRITE_RESP; with op_id 0 (a
              *posted* write: ``write(posted=True)``) only when refused -- the writer does not wait, and
              the stream's order lands the bytes before any control message sent after them

One-sided requests are served here, by the transport layer of the memory's owner, never by request
handlers: ``Domain.resolve`` checks rkey, right and bounds, and a refusal reveals nothing.  Payload bytes go
straight between the socket and the registered memory (``recv_into`` / ``send`` on memoryviews).

One reader task reads every frame; it never sends (a reader blocked on sending while the peer does the
same would deadlock both), so answers to one-sided requests go through a small queue to a server task.

The lean path (per-request CPU): the socket is driven by ``LeanSocket``, which calls the kernel at
once and waits for readiness only when it would block -- trio's socket methods yield to the scheduler on every
call, also one that completes at once (a whole scheduler pass, ~30 Python calls, per send and per receive).
The reader pulls whatever the kernel has into one buffer (``_FrameReader``) and cuts frames from it, so a
batch of small messages costs one ``recv`` instead of two per frame; payloads bigger than what is buffered
land straight in their memory.  Because nothing here yields when the kernel is quick, the reader yields
explicitly every ``FAIR_FRAMES`` frames it cut without waiting (the other tasks, and cancellation, get their
turn).
"""
from __future__ import annotations

import errno
import itertools
import logging
import mmap
import socket as _socket
import struct
from dataclasses import dataclass

import trio

from ..protocol import HEADER_SIZE, INLINE_MAX, MAX_PAYLOAD, RemoteBuf
from .base import (Access, Connection, ConnectionClosed, Domain, KeyedGrants, Region, RemoteAccessError,
                   TransportError, TransportOptions)

log = logging.getLogger(__name__)

FRAME = struct.Struct(">BBHIQQII")
FSIZE = FRAME.size
_CTRL_HEAD = struct.Struct(">BBHI")      # a CTRL frame's first 8 bytes; its MAC follows (op_id, addr)
_TAG = struct.Struct(">QQ")
_FRAME_TAIL = bytes(8)                   # rkey, reserved
READ_BUFFER = 256 << 10  # the reader's buffer: one recv takes every small frame the kernel holds
FAIR_FRAMES = 32         # frames the reader cuts from its buffer before it lets other tasks run
CTRL, READ_REQ, READ_RESP, WRITE_REQ, WRITE_RESP = 1, 2, 3, 4, 5
MAX_CTRL = HEADER_SIZE + INLINE_MAX    # a header, and an inline WRITE's payload after it
SERVE_QUEUE = 64        # one-sided requests of a peer queued for answering at most
REFUSALS = {1: "unknown rkey", 2: "no remote right on that region", 3: "outside the registered region",
            4: "refused", 5: "not granted to this connection"}
_CLOSED = 255


def _refusal_code(err: RemoteAccessError) -> int:
    msg = str(err)
    return (1 if "rkey" in msg else 2 if "allow" in msg else 3 if "outside" in msg
            else 5 if "granted" in msg else 4)


async def recv_exactly(sock, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        k = await sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionClosed("peer closed the connection")
        got += k


async def send_all(sock, data) -> None:
    view = memoryview(data).cast("B")
    sent, n = 0, len(view)
    while sent < n:
        sent += await sock.send(view[sent:])


async def send_all_of(sock, first: bytes, second) -> None:
    """``first`` then ``second`` (a frame and its payload) with one sendmsg where the socket takes it all."""
    if not len(second):
        return await send_all(sock, first)
    if not hasattr(sock, "sendmsg"):      # a TLS stream (transport/tls.py): records, no scatter-gather
        await send_all(sock, first)
        return await send_all(sock, second)
    sent = await sock.sendmsg([first, second])
    if sent < len(first):
        await send_all(sock, memoryview(first)[sent:])
        sent = len(first)
    if sent - len(first) < len(second):
        await send_all(sock, memoryview(second).cast("B")[sent - len(first):])


class LeanSocket:
    """A connected stream socket for trio tasks without trio's per-call scheduler pass: each call tries the
    kernel first and parks the task (``wait_readable`` / ``wait_writable``) only when it would block.  So a
    call that completes at once is not a checkpoint (the caller's loop must yield by itself: ``_FrameReader``
    does); one that blocks is, and cancellation reaches it there.  One task may receive while another sends
    (the transport serialises its senders with a lock)."""

    __slots__ = ("sock",)

    def __init__(self, sock: _socket.socket):
        sock.setblocking(False)
        self.sock = sock

    @classmethod
    def take(cls, trio_sock) -> "LeanSocket":
        """Take over a connected ``trio.socket`` socket (it is detached: closing it afterwards is a no-op)."""
        return cls(_socket.socket(fileno=trio_sock.detach()))

    async def recv_into(self, view) -> int:
        while True:
            try:
                return self.sock.recv_into(view)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(self.sock)

    async def send(self, data) -> int:
        while True:
            try:
                return self.sock.send(data)
            except BlockingIOError:
                await trio.lowlevel.wait_writable(self.sock)

    async def sendmsg(self, buffers) -> int:
        while True:
            try:
                return self.sock.sendmsg(buffers)
            except BlockingIOError:
                await trio.lowlevel.wait_writable(self.sock)

    def getpeername(self):
        return self.sock.getpeername()

    def close(self) -> None:
        if self.sock.fileno() >= 0:
            trio.lowlevel.notify_closing(self.sock)     # wakes a task parked on it (ClosedResourceError)
            self.sock.close()


class _FrameReader:
    """The reader's side of the stream: frames cut from one buffer (``READ_BUFFER``), refilled with one
    ``recv_into`` of whatever the kernel holds; a body larger than what is buffered lands straight in the
    caller's memory (``into``)."""

    def __init__(self, sock):
        self._sock = sock
        # anonymous memory of its own: a page is resident only once the stream reached it (an idle connection
        # holds a page or two, not READ_BUFFER), and it goes back to the system with the connection (heap
        # buffers left the node's memory growing with every connection a flood opened and closed)
        self._buf = mmap.mmap(-1, READ_BUFFER)
        self._view = memoryview(self._buf)
        self._lo = self._hi = 0        # the unread bytes are _buf[_lo:_hi]
        self._cut = 0                  # frames cut since the reader last waited for the kernel

    async def frame(self) -> tuple:
        """The next frame header, unpacked."""
        if self._hi - self._lo < FSIZE:
            await self._fill(FSIZE)
        elif self._cut >= FAIR_FRAMES:
            self._cut = 0
            await trio.lowlevel.checkpoint()
        self._cut += 1
        lo = self._lo
        self._lo = lo + FSIZE
        return FRAME.unpack_from(self._buf, lo)

    async def _fill(self, need: int) -> None:
        left = self._hi - self._lo
        if left:
            self._buf[:left] = self._view[self._lo:self._hi]
        self._lo, self._hi = 0, left
        self._cut = 0
        while self._hi < need:
            k = await self._sock.recv_into(self._view[self._hi:])
            if k == 0:
                raise ConnectionClosed("peer closed the connection")
            self._hi += k

    async def into(self, dest: memoryview) -> None:
        """Fill ``dest`` with the next ``len(dest)`` bytes of the stream."""
        n = len(dest)
        k = min(n, self._hi - self._lo)
        if k:
            dest[:k] = self._view[self._lo:self._lo + k]
            self._lo += k
        if k < n:
            await recv_exactly(self._sock, dest[k:])

    async def take(self, n: int) -> bytearray:
        """The next ``n`` bytes, as a new bytearray."""
        if self._hi - self._lo >= n:
            lo = self._lo
            self._lo = lo + n
            return self._buf[lo:lo + n]
        out = bytearray(n)
        await self.into(memoryview(out))
        return out

    async def skip(self, n: int) -> None:
        k = min(n, self._hi - self._lo)
        self._lo += k
        n -= k
        if n:
            scratch = memoryview(bytearray(min(n, 1 << 16)))
            while n:
                step = min(n, len(scratch))
                await recv_exactly(self._sock, scratch[:step])
                n -= step


class _Held:
    """``async with`` for a lock already taken (``TcpConnection._sending``): releases it at the end."""
    __slots__ = ("lock",)

    def __init__(self, lock):
        self.lock = lock

    async def __aenter__(self):
        return None

    async def __aexit__(self, *exc):
        self.lock.release()


class _LandingGrants(KeyedGrants):
    """``KeyedGrants`` whose revocation also stops a one-sided WRITE that is landing under the grant right
    now.  The reader resolves a WRITE's target once, at its frame header, and then copies the payload in as
    the bytes arrive; a grant dropped in between (its request cancelled or timed out) would otherwise go on
    receiving them after the owner took the memory back -- into a block the pool gave to another request,
    or into a caller's own buffer after the call returned.  Half a payload cannot be skipped in the stream
    by anyone but the reader, so that drop ends the connection, at once: nothing lands after ``drop``
    returns (``settle`` has nothing left to wait for)."""

    def __init__(self, conn: "TcpConnection") -> None:
        super().__init__(conn.domain)
        self._conn = conn
        self.landing = 0         # the grant rkey a WRITE is landing under right now (0: none)

    def drop(self, token: int | None) -> None:
        key = self._key_of.get(token) if token is not None else None
        super().drop(token)
        if key is not None and key == self.landing:
            self._conn._shutdown("a grant was revoked while a one-sided write was landing in it")


@dataclass
class _Pending:
    view: memoryview | None       # READ: where the answer lands; None -> drain (the caller gave up)
    event: trio.Event
    status: int = 0
    landing: bool = False         # the reader is copying the answer into ``view`` right now


class TcpConnection(Connection):
    transport = "tcp"

    def __init__(self, sock, domain: Domain, peer: str, peer_slots: int, our_slots: int):
        super().__init__(our_slots)
        if isinstance(sock, trio.socket.SocketType):
            sock = LeanSocket.take(sock)     # (a TLS stream, transport/tls.py, keeps its own socket calls)
        self._sock = sock
        self.domain = domain
        self.peer = peer
        self.slots = peer_slots
        self.grants = _LandingGrants(self)    # one rkey per grant: a late answer cannot reach a newer one
        self._send_lock = trio.Lock()
        # one-sided requests waiting to be answered: bounded, so a peer that sends them without reading the
        # answers stalls its own connection (the reader waits here) instead of growing our memory
        self._serve_in, self._serve_out = trio.open_memory_channel(SERVE_QUEUE)
        self._pending: dict[int, _Pending] = {}
        self._ids = itertools.count(1)
        self._tasks: trio.Nursery | None = None     # run()'s: the rest of a message send_nowait began

    max_inline = INLINE_MAX

    # -- the interface ------------------------------------------------------------------------------
    async def send(self, header: bytes, payload=None) -> None:
        self._check_open()
        async with self._sending():     # sealed under the lock: messages leave in the order of their MACs
            frame, n = self._ctrl_frame(header, payload)
            await self._guarded(send_all_of(self._sock, frame, payload) if n else send_all(self._sock, frame))
        self.stats.sends += 1

    async def send_within(self, timeout: float, header: bytes, payload=None) -> bool:
        if self._send_lock.locked() or not isinstance(self._sock, LeanSocket):
            return await super().send_within(timeout, header, payload)
        frame, n = self._ctrl_frame(header, payload)
        if not await self._send_now(timeout, (frame, payload) if n else (frame,), len(frame) + n):
            return False
        self.stats.sends += 1
        return True

    def send_nowait(self, timeout: float, header: bytes) -> bool:
        if self._send_lock.locked() or not isinstance(self._sock, LeanSocket) or self._tasks is None:
            return False
        frame, _n = self._ctrl_frame(header, None)
        sent = self._to_kernel((frame,))
        if not sent:
            if self.session is not None:
                self.session.unseal()     # the caller sends it again (send_within): it must get this MAC
            return False
        if sent < len(frame):       # the rest goes before any other frame: the lock is held until it has
            self._send_lock.acquire_nowait()
            self._tasks.start_soon(self._send_rest, timeout, memoryview(frame)[sent:])
        self.stats.sends += 1
        return True

    def send_many_nowait(self, timeout: float, headers: list[bytes]) -> bool:
        if self._send_lock.locked() or not isinstance(self._sock, LeanSocket) or self._tasks is None:
            return False
        frames = [self._ctrl_frame(h, None)[0] for h in headers]
        sent = self._to_kernel(frames)
        if not sent:
            if self.session is not None:
                for _f in frames:
                    self.session.unseal()     # the caller sends them again: they must get these MACs
            return False
        total = sum(map(len, frames))
        if sent < total:            # the rest goes before any other frame: the lock is held until it has
            self._send_lock.acquire_nowait()
            self._tasks.start_soon(self._send_rest, timeout, memoryview(b"".join(frames))[sent:])
        self.stats.sends += len(frames)
        return True

    async def _send_rest(self, timeout: float, rest: memoryview) -> None:
        try:
            with trio.move_on_after(timeout) as scope:
                await self._guarded(send_all(self._sock, rest))
            if scope.cancelled_caught:
                self._shutdown(f"the peer did not read its answers for {timeout}s")
        except TransportError:
            pass                         # the connection ended (the reader says why)
        finally:
            self._send_lock.release()

    async def send_many_within(self, timeout: float, headers: list[bytes]) -> bool:
        if self._send_lock.locked() or not isinstance(self._sock, LeanSocket):
            return await super().send_many_within(timeout, headers)
        frames = [self._ctrl_frame(h, None)[0] for h in headers]
        if not await self._send_now(timeout, frames, sum(map(len, frames))):
            return False
        self.stats.sends += len(headers)
        return True

    async def _send_now(self, timeout: float, parts, total: int) -> bool:
        """``parts`` (frames, and a payload after its frame) with one ``sendmsg``, the rest -- if the kernel
        did not take it all -- within ``timeout`` (False: not sent in time; the connection is then cut).
        The caller checked that nobody holds the send lock: the common case, where the kernel takes it all,
        needs no timer and no lock -- nothing here awaits until the kernel has taken what it takes."""
        sock = self._sock
        sent = self._to_kernel(parts)
        if sent < total:
            self._send_lock.acquire_nowait()    # the rest must go before any other frame
            try:
                rest = memoryview(b"".join(parts))[sent:]
                with trio.move_on_after(timeout) as scope:
                    await self._guarded(send_all(sock, rest))
                if scope.cancelled_caught:
                    return False
            finally:
                self._send_lock.release()
        return True

    def _to_kernel(self, parts) -> int:
        """One ``sendmsg`` of ``parts`` on the lean socket: the bytes the kernel took (0: it had no room)."""
        try:
            return self._sock.sock.sendmsg(parts)
        except BlockingIOError:
            return 0
        except OSError as e:
            self._shutdown(f"send failed: {e}")
            raise ConnectionClosed(f"connection to {self.peer} lost: {e}") from None

    def _ctrl_frame(self, header: bytes, payload) -> tuple[bytes, int]:
        """A control message's frame header and the header after it; and the payload's length.  On a
        session, the message's MAC is taken here: the caller sends it before any other."""
        self._check_open()
        n = len(payload) if payload is not None else 0
        if len(header) + n > MAX_CTRL:
            raise ValueError("control message larger than MAX_CTRL")
        session = self.session
        if session is None:
            return FRAME.pack(CTRL, 0, 0, len(header) + n, 0, 0, 0, 0) + header, n
        return _CTRL_HEAD.pack(CTRL, 0, 0, len(header) + n) + session.seal(header) + _FRAME_TAIL + header, n

    def _sending(self):
        """The send lock, taken without a scheduler pass when it is free (the common case)."""
        lock = self._send_lock
        if not lock.locked():
            lock.acquire_nowait()
            return _Held(lock)
        return lock

    async def read(self, remote: RemoteBuf, local: memoryview, local_region: Region | None = None) -> None:
        if len(local) != remote.length:
            raise ValueError("local and remote lengths differ")
        op, p = self._new_op(local)
        try:
            async with self._sending():
                await self._guarded(send_all(self._sock, FRAME.pack(READ_REQ, 0, 0, remote.length, op,
                                                                    remote.addr, remote.rkey, 0)))
            await p.event.wait()
        finally:
            if not p.event.is_set():     # cancelled (or timed out): ``local`` must not be touched after this
                p.view = None            # an answer not yet begun is drained instead of landed
                if p.landing:            # one half-way in: only ending the connection stops it
                    self._shutdown("a one-sided read was abandoned while its answer was landing")
        self._raise_status(p, "read")
        self.stats.reads += 1
        self.stats.read_bytes += remote.length

    async def write(self, local: memoryview, local_region: Region | None, remote: RemoteBuf, *,
                    posted: bool = False, release=None) -> None:
        if len(local) != remote.length:
            raise ValueError("local and remote lengths differ")
        if posted:       # op 0: the peer answers only a refusal (the stream keeps our later frames behind it)
            self._check_open()
            async with self._sending():
                await self._guarded(self._send_frame_and(FRAME.pack(WRITE_REQ, 0, 0, remote.length, 0,
                                                                    remote.addr, remote.rkey, 0), local))
            self.stats.writes += 1
            self.stats.write_bytes += remote.length
            if release is not None:      # the bytes are in the socket: ``local`` is free again
                release()
            return
        op, p = self._new_op(None)
        async with self._sending():
            await self._guarded(self._send_frame_and(FRAME.pack(WRITE_REQ, 0, 0, remote.length, op,
                                                                remote.addr, remote.rkey, 0), local))
        await p.event.wait()
        self._raise_status(p, "write")
        self.stats.writes += 1
        self.stats.write_bytes += remote.length

    async def aclose(self) -> None:
        self._shutdown("closed locally")

    def info(self) -> dict:
        sock = getattr(self._sock, "sock", None)      # (a TLS stream, transport/tls.py: not asked)
        return {**super().info(), "congestion": congestion_of(sock) if sock is not None else None}

    # -- machinery ----------------------------------------------------------------------------------
    def _check_open(self):
        if self._closed:
            raise ConnectionClosed(f"connection to {self.peer} is closed: {self._closed}")

    def _new_op(self, view):
        self._check_open()
        op = next(self._ids)
        p = _Pending(view=view, event=trio.Event())
        self._pending[op] = p
        return op, p

    def _raise_status(self, p: _Pending, what: str):
        if p.status == _CLOSED:
            raise ConnectionClosed(f"{what} from {self.peer}: connection lost ({self._closed})")
        if p.status:
            raise RemoteAccessError(f"{what} refused by {self.peer}: {REFUSALS.get(p.status, 'refused')}")

    async def _send_frame_and(self, frame: bytes, payload: memoryview):
        await send_all_of(self._sock, frame, payload)

    async def _guarded(self, coro):
        try:
            return await coro
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as e:
            self._shutdown(f"send failed: {e}")
            raise ConnectionClosed(f"connection to {self.peer} lost: {e}") from None
        except trio.Cancelled:
            # a frame may be half on the wire: the stream can no longer be parsed by the peer
            self._shutdown("cancelled in the middle of a send")
            raise

    def _shutdown(self, why: str) -> None:
        if self._closed:
            return
        self._closed = why
        for p in self._pending.values():
            p.status = _CLOSED
            p.event.set()
        self._pending.clear()
        self._ctrl_in.close()
        self._serve_in.close()
        try:
            self._sock.close()
        except OSError:
            pass

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """The connection's own tasks; runs until the connection closes (started by open_connection)."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._serve_loop)
            self._tasks = nursery
            task_status.started()
            try:
                await self._read_loop()
            except (ConnectionClosed, OSError, trio.BrokenResourceError, trio.ClosedResourceError) as e:
                self._shutdown(str(e) or type(e).__name__)
            except TransportError as e:
                log.warning("connection to %s: %s", self.peer, e)
                self._shutdown(str(e))
            finally:
                self._shutdown("reader stopped")
                self._tasks = None

    async def _read_loop(self) -> None:
        reader = _FrameReader(self._sock)
        while True:
            ftype, status, _pad, length, op, addr, rkey, _r = await reader.frame()
            if ftype == CTRL:
                if length > MAX_CTRL:
                    raise TransportError(f"control message of {length} bytes")
                msg = await reader.take(length)
                if not self._land(msg, _TAG.pack(op, addr) if self.session is not None else None):
                    self.misbehaved = "more control messages than slots"
                    raise TransportError("peer sent more control messages than we have slots")
            elif ftype == READ_REQ:
                await self._serve_in.send((READ_REQ, op, addr, rkey, length))
            elif ftype == READ_RESP:
                # the op stays in _pending until its answer has landed: if the stream ends half-way,
                # _shutdown fails it (and so frees whoever waits for it)
                p = self._pending.get(op)
                if status == 0:
                    if p is not None and p.view is not None and len(p.view) == length:
                        p.landing = True
                        await reader.into(p.view)
                        p.landing = False
                    else:
                        if p is not None and p.view is not None:
                            status = 4           # an answer of the wrong length is a refusal, not data
                        await reader.skip(length)
                if p is not None:
                    del self._pending[op]
                    p.status = status
                    p.event.set()
            elif ftype == WRITE_REQ:
                if length > MAX_PAYLOAD:
                    raise TransportError(f"one-sided write of {length} bytes")
                try:
                    target = self.domain.resolve(addr, rkey, length, Access.REMOTE_WRITE, self.grants)
                    code = 0
                except RemoteAccessError as e:
                    target, code = None, _refusal_code(e)
                if target is not None:
                    self.grants.landing = rkey
                    try:
                        await reader.into(target)
                    finally:
                        self.grants.landing = 0
                    self.stats.served_writes += 1
                    self.stats.served_write_bytes += length
                else:
                    await reader.skip(length)
                    self.stats.refused += 1
                    log.warning("refused one-sided write from %s: %s", self.peer, REFUSALS[code])
                if op or code:           # a posted write (op 0) is answered only when refused
                    await self._serve_in.send((WRITE_RESP, op, code, 0, 0))
            elif ftype == WRITE_RESP:
                if not op:
                    self.stats.posted_refused += 1
                    log.debug("%s refused a posted one-sided write: %s", self.peer, REFUSALS.get(status, "refused"))
                    continue
                p = self._pending.pop(op, None)
                if p is not None:
                    p.status = status
                    p.event.set()
            else:
                raise TransportError(f"unknown frame type {ftype}")

    async def _serve_loop(self) -> None:
        """Answers the peer's one-sided requests (the part of the transport that plays the NIC)."""
        async for kind, op, a, b, length in self._serve_out:
            if kind == READ_REQ:
                addr, rkey = a, b
                try:
                    view = self.domain.resolve(addr, rkey, length, Access.REMOTE_READ, self.grants)
                    code = 0
                except RemoteAccessError as e:
                    view, code = None, _refusal_code(e)
                    self.stats.refused += 1
                    log.warning("refused one-sided read from %s: %s", self.peer, e)
                frame = FRAME.pack(READ_RESP, code, 0, length if view is not None else 0, op, 0, 0, 0)
                async with self._sending():
                    try:
                        if view is not None:
                            await self._send_frame_and(frame, view)
                            self.stats.served_reads += 1
                            self.stats.served_read_bytes += length
                        else:
                            await send_all(self._sock, frame)
                    except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as e:
                        self._shutdown(f"send failed: {e}")
                        return
            else:  # WRITE_RESP
                async with self._sending():
                    try:
                        await send_all(self._sock, FRAME.pack(WRITE_RESP, a, 0, 0, op, 0, 0, 0))
                    except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as e:
                        self._shutdown(f"send failed: {e}")
                        return


_TCP_INFO_RECEIVED = struct.Struct("=Q")   # struct tcp_info's tcpi_bytes_received (Linux 4.1+), at offset 128


def received_bytes(sock) -> int | None:
    """Bytes the kernel has received from the peer on a TCP socket (None where it does not say): whether a
    peer has sent something, without reading it."""
    try:
        info = sock.getsockopt(_socket.IPPROTO_TCP, _socket.TCP_INFO, 136)
    except (OSError, AttributeError):
        return None
    return _TCP_INFO_RECEIVED.unpack_from(info, 128)[0] if len(info) >= 136 else None


def congestion_of(sock) -> str | None:
    """The congestion control a TCP socket uses (None where the kernel does not say)."""
    try:
        return sock.getsockopt(_socket.IPPROTO_TCP, _socket.TCP_CONGESTION, 16).split(b"\0", 1)[0].decode()
    except (OSError, AttributeError):
        return None


def tune_socket(sock, congestion: str = TransportOptions.tcp_congestion) -> None:
    """Every connection we open or accept: no Nagle, large buffers, and ``congestion`` as its congestion
    control ("" keeps the system's default).  cubic by default: where the system's is BBR, the kernel paces each
    flow itself (from a per-socket timer, with no fq qdisc on the path) and a large payload leaves in many
    small sends, each waking both ends; BBR is built for a WAN's bottleneck, a cluster's LAN is better served
    by cubic.  A kernel without it, or a user not allowed to pick it, keeps the system's."""
    sock.setsockopt(_socket.IPPROTO_TCP, _socket.TCP_NODELAY, 1)
    if congestion and hasattr(_socket, "TCP_CONGESTION"):
        try:
            sock.setsockopt(_socket.IPPROTO_TCP, _socket.TCP_CONGESTION, congestion.encode())
        except OSError as e:     # not in this kernel (ENOENT), or not allowed to this user (EPERM)
            log.debug("TCP congestion control %r not taken (%s): the system's default stays", congestion, e)
    for opt in (_socket.SO_SNDBUF, _socket.SO_RCVBUF):
        try:
            sock.setsockopt(_socket.SOL_SOCKET, opt, 4 << 20)
        except OSError as e:  # pragma: no cover - depends on sysctl limits
            if e.errno != errno.EPERM:
                raise
