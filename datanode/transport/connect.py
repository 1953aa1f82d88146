"""Opening a connection: TCP stream, hello, transport negotiation, then TCP or verbs on top.

Every connection starts as a TCP stream.  The client sends a ``Hello`` (the transport it wants, whether it has
a working RDMA device, how many control slots it preposts); the server answers with the transport chosen:

    either side says tcp                     -> tcp      (error if the other side *requires* verbs)
    both have a device, neither says tcp     -> verbs    (endpoints exchanged on this same stream)
    otherwise                                -> tcp      (error if a side requires verbs)

If setting up the queue pair fails after verbs was chosen, both ends agree on it over the stream and the
connection stays on TCP, with a warning in the log.
"""
from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from typing import AsyncIterator

import trio

from .. import aio
from ..protocol import HELLO_SIZE, Hello, ProtocolError, Transport, decode_hello
from .base import Connection, Domain, TransportError
from .tcp import TcpConnection, recv_exactly, send_all, tune_socket

log = logging.getLogger("datanode.connect")

DEFAULT_SLOTS = 64
TRANSPORT_NAMES = {"auto": Transport.AUTO, "tcp": Transport.TCP, "verbs": Transport.VERBS}


class NegotiationError(TransportError):
    pass


def choose(server_pref: int, client_pref: int, server_dev: bool, client_dev: bool) -> int:
    prefs = (server_pref, client_pref)
    if Transport.TCP in prefs:
        if Transport.VERBS in prefs:
            raise NegotiationError("one end requires verbs, the other allows only tcp")
        return Transport.TCP
    if server_dev and client_dev:
        return Transport.VERBS
    if Transport.VERBS in prefs:
        missing = "server" if not server_dev else "client"
        raise NegotiationError(f"verbs required but the {missing} has no working RDMA device")
    return Transport.TCP


def has_device(domain: Domain) -> bool:
    return domain.device is not None


async def _read_hello(sock) -> Hello:
    buf = bytearray(HELLO_SIZE)
    await recv_exactly(sock, memoryview(buf))
    return decode_hello(buf)


@asynccontextmanager
async def _running(conn: Connection) -> AsyncIterator[Connection]:
    async with aio.nursery() as nursery:
        await nursery.start(conn.run)
        try:
            yield conn
        finally:
            await conn.aclose()
            nursery.cancel_scope.cancel()


async def _upgrade(sock, domain: Domain, peer: str, is_server: bool, peer_slots: int, our_slots: int):
    """Try to bring up verbs on this stream; None means both ends agreed to stay on TCP."""
    from . import verbs   # imported only when a device is in play (pyverbs is optional)
    try:
        return await verbs.establish(sock, domain, peer, is_server=is_server, peer_slots=peer_slots,
                                     our_slots=our_slots)
    except verbs.SetupFailed as e:
        log.warning("verbs setup with %s failed (%s); this connection stays on TCP", peer, e)
        return None


@asynccontextmanager
async def dial(host: str, port: int, domain: Domain, *, transport: str = "auto",
               slots: int = DEFAULT_SLOTS, timeout: float = 5.0) -> AsyncIterator[Connection]:
    """Connect to a datanode; yields a running Connection."""
    peer = f"{host}:{port}"
    sock = trio.socket.socket()
    try:
        with trio.fail_after(timeout):
            tune_socket(sock)
            try:
                await sock.connect((host, port))
            except OSError as e:
                raise TransportError(f"cannot connect to {peer}: {e.strerror or e}") from None
            await send_all(sock, Hello(transport=TRANSPORT_NAMES[transport], has_device=has_device(domain),
                                       slots=slots).encode())
            answer = await _read_hello(sock)
            if answer.transport == Transport.AUTO:
                raise NegotiationError(f"{peer} refused the connection: transports cannot agree "
                                       f"(we asked for {transport}, device={has_device(domain)})")
            conn: Connection | None = None
            if answer.transport == Transport.VERBS:
                conn = await _upgrade(sock, domain, peer, False, answer.slots, slots)
            if conn is None:
                conn = TcpConnection(sock, domain, peer, answer.slots, slots)
    except trio.TooSlowError:
        sock.close()
        raise TransportError(f"connecting to {peer} timed out after {timeout}s") from None
    except (ProtocolError, OSError) as e:
        sock.close()
        raise TransportError(f"connecting to {peer}: {e}") from None
    except BaseException:
        sock.close()
        raise
    async with _running(conn) as c:
        yield c


@asynccontextmanager
async def accept(sock, peer: str, domain: Domain, *, transport: str = "auto", slots: int = DEFAULT_SLOTS,
                 timeout: float = 5.0) -> AsyncIterator[Connection]:
    """The server side of ``dial`` on an accepted socket."""
    tune_socket(sock)
    with trio.fail_after(timeout):
        hello = await _read_hello(sock)
        mine = TRANSPORT_NAMES[transport]
        try:
            chosen = choose(mine, hello.transport, has_device(domain), hello.has_device)
        except NegotiationError as e:
            await send_all(sock, Hello(transport=Transport.AUTO, has_device=has_device(domain),
                                       slots=slots).encode())
            raise NegotiationError(f"connection from {peer}: {e}") from None
        await send_all(sock, Hello(transport=chosen, has_device=has_device(domain), slots=slots).encode())
        conn: Connection | None = None
        if chosen == Transport.VERBS:
            conn = await _upgrade(sock, domain, peer, True, hello.slots, slots)
        if conn is None:
            conn = TcpConnection(sock, domain, peer, hello.slots, slots)
    log.debug("connection from %s on %s", peer, conn.transport)
    async with _running(conn) as c:
        yield c


def make_domain(transport: str = "auto", device: str | None = None, gid_index: int | None = None) -> Domain:
    """A Domain for this process, with the RDMA device attached when ``transport`` allows verbs and one is
    usable (``device``/``gid_index`` default to $DATANODE_RDMA_DEVICE / $DATANODE_RDMA_GID, else the first
    active device, GID index 1).  ``transport = verbs`` without a usable device raises TransportError."""
    import os
    domain = Domain()
    if transport == "tcp":
        return domain
    device = device or os.environ.get("DATANODE_RDMA_DEVICE") or None
    if gid_index is None:
        gid_index = int(os.environ.get("DATANODE_RDMA_GID", "1"))
    try:
        from . import verbs
        verbs.attach(domain, device, gid_index)
        log.info("RDMA device %s ready (gid index %d)", domain.device.name, gid_index)
    except Exception as e:  # noqa: BLE001 - whatever the reason, this process has no verbs
        if transport == "verbs":
            raise TransportError(f"transport 'verbs' needs a usable RDMA device: {e}") from None
        log.info("no usable RDMA device (%s); connections use TCP", e)
    return domain
