"""TCP transport: the same control messages and one-sided operations as verbs, carried on one stream.

Frames on the stream (after the hello), each a 32-byte frame header, big-endian (a frame and its payload
leave in one ``sendmsg``):

    type u8 | status u8 | pad u16 | length u32 | op_id u64 | addr u64 | rkey u32 | reserved u32

  CTRL        +length bytes: one control message (a protocol header; for an inline WRITE its payload
              after it, ``max_inline``) for the peer's slots
  READ_REQ    "send me [addr, +length) of region rkey"      -> answered by READ_RESP (+length bytes if ok)
  WRITE_REQ   +length bytes "put these at [addr, +length)"  -> answered by WRITE_RESP

One-sided requests are served here, by the transport layer of the memory's owner, never by request
handlers: ``Domain.resolve`` checks rkey, right and bounds, and a refusal reveals nothing.  Payload bytes go
straight between the socket and the registered memory (``recv_into`` / ``send`` on memoryviews).

One reader task reads every frame; it never sends (a reader blocked on sending while the peer does the
same would deadlock both), so answers to one-sided requests go through a small queue to a server task.
"""
from __future__ import annotations

import errno
import itertools
import logging
import socket as _socket
import struct
from dataclasses import dataclass

import trio

from ..protocol import HEADER_SIZE, INLINE_MAX, MAX_PAYLOAD, RemoteBuf
from .base import Access, Connection, ConnectionClosed, Domain, Region, RemoteAccessError, TransportError

log = logging.getLogger(__name__)

FRAME = struct.Struct(">BBHIQQII")
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
    sent = await sock.sendmsg([first, second])
    if sent < len(first):
        await send_all(sock, memoryview(first)[sent:])
        sent = len(first)
    if sent - len(first) < len(second):
        await send_all(sock, memoryview(second).cast("B")[sent - len(first):])


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
        self._sock = sock
        self.domain = domain
        self.peer = peer
        self.slots = peer_slots
        self._send_lock = trio.Lock()
        # one-sided requests waiting to be answered: bounded, so a peer that sends them without reading the
        # answers stalls its own connection (the reader waits here) instead of growing our memory
        self._serve_in, self._serve_out = trio.open_memory_channel(SERVE_QUEUE)
        self._pending: dict[int, _Pending] = {}
        self._ids = itertools.count(1)

    max_inline = INLINE_MAX

    # -- the interface ------------------------------------------------------------------------------
    async def send(self, header: bytes, payload=None) -> None:
        self._check_open()
        n = len(payload) if payload is not None else 0
        if len(header) + n > MAX_CTRL:
            raise ValueError("control message larger than MAX_CTRL")
        frame = FRAME.pack(CTRL, 0, 0, len(header) + n, 0, 0, 0, 0) + header
        async with self._send_lock:
            await self._guarded(send_all_of(self._sock, frame, payload) if n else send_all(self._sock, frame))
        self.stats.sends += 1

    async def read(self, remote: RemoteBuf, local: memoryview, local_region: Region | None = None) -> None:
        if len(local) != remote.length:
            raise ValueError("local and remote lengths differ")
        op, p = self._new_op(local)
        try:
            async with self._send_lock:
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

    async def write(self, local: memoryview, local_region: Region | None, remote: RemoteBuf) -> None:
        if len(local) != remote.length:
            raise ValueError("local and remote lengths differ")
        op, p = self._new_op(None)
        async with self._send_lock:
            await self._guarded(self._send_frame_and(FRAME.pack(WRITE_REQ, 0, 0, remote.length, op,
                                                                remote.addr, remote.rkey, 0), local))
        await p.event.wait()
        self._raise_status(p, "write")
        self.stats.writes += 1
        self.stats.write_bytes += remote.length

    async def aclose(self) -> None:
        self._shutdown("closed locally")

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

    async def _read_loop(self) -> None:
        fbuf = bytearray(FRAME.size)
        fview = memoryview(fbuf)
        sock = self._sock
        while True:
            await recv_exactly(sock, fview)
            ftype, status, _pad, length, op, addr, rkey, _r = FRAME.unpack(fbuf)
            if ftype == CTRL:
                if length > MAX_CTRL:
                    raise TransportError(f"control message of {length} bytes")
                msg = bytearray(length)
                await recv_exactly(sock, memoryview(msg))
                try:
                    self._ctrl_in.send_nowait(msg)
                except trio.WouldBlock:
                    self.misbehaved = "more control messages than slots"
                    raise TransportError("peer sent more control messages than we have slots") from None
            elif ftype == READ_REQ:
                await self._serve_in.send((READ_REQ, op, addr, rkey, length))
            elif ftype == READ_RESP:
                # the op stays in _pending until its answer has landed: if the stream ends half-way,
                # _shutdown fails it (and so frees whoever waits for it)
                p = self._pending.get(op)
                if status == 0:
                    if p is not None and p.view is not None and len(p.view) == length:
                        p.landing = True
                        await recv_exactly(sock, p.view)
                        p.landing = False
                    else:
                        if p is not None and p.view is not None:
                            status = 4           # an answer of the wrong length is a refusal, not data
                        await self._drain(length)
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
                    await recv_exactly(sock, target)
                    self.stats.served_writes += 1
                    self.stats.served_write_bytes += length
                else:
                    await self._drain(length)
                    self.stats.refused += 1
                    log.warning("refused one-sided write from %s: %s", self.peer, REFUSALS[code])
                await self._serve_in.send((WRITE_RESP, op, code, 0, 0))
            elif ftype == WRITE_RESP:
                p = self._pending.pop(op, None)
                if p is not None:
                    p.status = status
                    p.event.set()
            else:
                raise TransportError(f"unknown frame type {ftype}")

    async def _drain(self, length: int) -> None:
        scratch = memoryview(bytearray(min(length, 1 << 16) or 1))
        while length:
            k = min(length, len(scratch))
            await recv_exactly(self._sock, scratch[:k])
            length -= k

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
                async with self._send_lock:
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
                async with self._send_lock:
                    try:
                        await send_all(self._sock, FRAME.pack(WRITE_RESP, a, 0, 0, op, 0, 0, 0))
                    except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as e:
                        self._shutdown(f"send failed: {e}")
                        return


def tune_socket(sock) -> None:
    sock.setsockopt(_socket.IPPROTO_TCP, _socket.TCP_NODELAY, 1)
    for opt in (_socket.SO_SNDBUF, _socket.SO_RCVBUF):
        try:
            sock.setsockopt(_socket.SOL_SOCKET, opt, 4 << 20)
        except OSError as e:  # pragma: no cover - depends on sysctl limits
            if e.errno != errno.EPERM:
                raise
