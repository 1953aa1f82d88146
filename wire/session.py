"""An authenticated session's control messages: a MAC over each header and its place in the stream.

A pure codec (no I/O).  The hello (wire/auth.py, transport/connect.py) gives both ends two keys, one per
direction, that nobody else holds; from then on every control message carries a 16-byte tag:

    tag = BLAKE2b-128(key = the sending direction's key, seq u64 | the 88-byte header)

``seq`` counts the control messages sent in that direction since the hello (0, 1, 2, ...).  It is not sent:
each end counts for itself, so a message injected into the stream, dropped from it, replayed (from this
connection or another: another has other keys) or moved fails the receiver's check, and the connection is
closed.  A payload is covered through the header: an inline WRITE's and a one-sided transfer's bytes by the
CRC32C the MAC'd header carries (against accidents; against an attacker on the path payloads need TLS, the
encrypting mode: docs/security.md).  Keyed BLAKE2b runs in C (hashlib): about a microsecond per message.
"""
from __future__ import annotations

import hashlib
import hmac
import struct

from .protocol import HEADER_SIZE

TAG_SIZE = 16
KEY_SIZE = 32
_SEQ = struct.Struct(">Q")
_blake2b = hashlib.blake2b


class SessionError(Exception):
    """A control message that fails its session's MAC: injected, replayed, reordered, or altered."""


class Session:
    """One end's state: its sending key and count, its receiving key and count."""

    __slots__ = ("_send_key", "_recv_key", "sent", "received")

    def __init__(self, send_key: bytes, recv_key: bytes) -> None:
        if len(send_key) != KEY_SIZE or len(recv_key) != KEY_SIZE or send_key == recv_key:
            raise ValueError("a session needs two distinct 32-byte keys")
        self._send_key, self._recv_key = send_key, recv_key
        self.sent = self.received = 0

    def seal(self, header) -> bytes:
        """The tag of the next control message we send, whose header is ``header``; the caller sends it
        next, before any other (or calls ``unseal`` if it sent nothing)."""
        n = self.sent
        self.sent = n + 1
        return _blake2b(_SEQ.pack(n) + bytes(header[:HEADER_SIZE]), key=self._send_key,
                        digest_size=TAG_SIZE).digest()

    def unseal(self) -> None:
        """The message ``seal`` tagged last was not sent after all (nothing of it reached the stream)."""
        self.sent -= 1

    def open(self, message, tag) -> None:
        """Check the next control message received (its header first); SessionError if it is not the one
        our peer sent next."""
        n = self.received
        want = _blake2b(_SEQ.pack(n) + bytes(message[:HEADER_SIZE]), key=self._recv_key,
                        digest_size=TAG_SIZE).digest()
        if tag is None or not hmac.compare_digest(want, bytes(tag)):
            raise SessionError(f"control message #{n} fails the session's MAC (injected, replayed, reordered "
                               f"or altered on the way)")
        self.received = n + 1


def pair(client_to_server: bytes, server_to_client: bytes) -> tuple[Session, Session]:
    """The dialer's and the acceptor's sessions for the same two keys."""
    return (Session(client_to_server, server_to_client), Session(server_to_client, client_to_server))
