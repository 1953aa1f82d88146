"""Optional TLS on the TCP stream (the standard library's ``ssl`` on ``trio.SSLStream``).

Negotiated per connection: a client configured with a CA (``tls_ca``; the SDK's ``tls_ca=``,
``dnctl --tls-ca``) starts TLS as the very first bytes of the connection, before the hello;
a node configured with a certificate (``tls_cert`` / ``tls_key``) looks at the first byte of every accepted
connection (``MSG_PEEK``): a TLS record (0x16) gets the TLS handshake, our hello magic gets plaintext -- unless
``tls_required``, which refuses it in the hello ("this node requires TLS").  Datanodes dial each other with TLS
when they have ``tls_ca``.  The client checks the node's certificate against the CA and the address it dialed
(so a node's certificate names its listen IP or host); the authentication (HMAC challenge-response, auth.py)
runs inside the TLS session as before.  TLS connections stay on TCP (no verbs upgrade: RDMA traffic would not
be covered).

``TlsSocket`` gives the TCP transport the few socket calls it uses (``recv_into``, ``send``, ``close``) on top
of the SSLStream, so frames, one-sided ops and the hello run unchanged over it.
"""
from __future__ import annotations

import socket
import ssl

import trio

from .base import TransportError

TLS_RECORD = 0x16        # the first byte of a TLS ClientHello


class TlsConfigError(ValueError):
    pass


def server_context(cert: str, key: str) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as e:
        raise TlsConfigError(f"tls_cert {cert} / tls_key {key}: {e}") from None
    return ctx


def client_context(ca: str) -> ssl.SSLContext:
    try:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
    except (OSError, ssl.SSLError) as e:
        raise TlsConfigError(f"TLS CA file {ca}: {e}") from None
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


class TlsSocket:
    """The socket calls of the TCP transport (and the hello), carried by a ``trio.SSLStream``.  One task may
    send while another receives (SSLStream allows that); sends are serialised by the transport's lock."""

    def __init__(self, stream: trio.SSLStream, raw):
        self.stream = stream
        self.raw = raw                       # the trio socket underneath (closed by close())

    async def recv_into(self, view: memoryview) -> int:
        try:
            data = await self.stream.receive_some(len(view))
        except trio.BrokenResourceError as e:
            raise OSError(f"TLS stream broken: {e.__cause__ or e}") from None
        n = len(data)
        view[:n] = data
        return n

    async def send(self, view) -> int:
        try:
            await self.stream.send_all(view)
        except trio.BrokenResourceError as e:
            raise OSError(f"TLS stream broken: {e.__cause__ or e}") from None
        return len(view)

    def close(self) -> None:
        self.raw.close()

    def getpeername(self):
        return self.raw.getpeername()


async def wrap(sock, ctx: ssl.SSLContext, *, server_side: bool, server_hostname: str | None = None) -> TlsSocket:
    """The TLS handshake on ``sock`` (a connected trio socket); the TlsSocket carrying what follows."""
    stream = trio.SSLStream(trio.SocketStream(sock), ctx, server_side=server_side,
                            server_hostname=None if server_side else server_hostname)
    try:
        await stream.do_handshake()
    except trio.BrokenResourceError as e:
        cause = e.__cause__
        raise TransportError(f"TLS handshake failed: {cause or e}") from None
    return TlsSocket(stream, sock)


async def starts_tls(sock) -> bool:
    """Whether the peer's first byte opens a TLS handshake (peeked: nothing is consumed)."""
    first = await sock.recv(1, socket.MSG_PEEK)
    return bool(first) and first[0] == TLS_RECORD
