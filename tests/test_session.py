"""Authenticated sessions, the pure half: the frame MAC and its sequence (wire/session.py), the hello's
transcript, key shares and downgrade mark (wire/auth.py), and the hello's new fields -- no sockets."""
from __future__ import annotations

import os

import pytest

from wire.auth import (KeyShare, SESSION_MARK, new_nonce, session_keys, session_nonce, session_transcript,
                       speaks_sessions)
from wire.protocol import HELLO_SIZE, Header, Hello, Op, Transport, decode_extensions, decode_hello
from wire.session import Session, SessionError, pair


def _hdr(req_id: int, opcode=Op.PING, **kw) -> bytes:
    return Header(opcode=opcode, req_id=req_id, **kw).encode()


def _sessions():
    return pair(os.urandom(32), os.urandom(32))


def test_messages_in_order_pass():
    caller, node = _sessions()
    for i in range(5):
        h = _hdr(i)
        node.open(h, caller.seal(h))
        h = _hdr(100 + i)
        caller.open(h, node.seal(h))
    assert (caller.sent, caller.received, node.sent, node.received) == (5, 5, 5, 5)


def test_an_injected_message_is_refused():
    caller, node = _sessions()
    h = _hdr(1)
    node.open(h, caller.seal(h))
    with pytest.raises(SessionError, match="#1"):
        node.open(_hdr(2, Op.PARTITION_DELETE, partition=7), bytes(16))       # no key: any tag is a guess
    with pytest.raises(SessionError):
        node.open(_hdr(2), None)                                             # a frame without a MAC


def test_a_replayed_message_is_refused_within_and_across_connections():
    caller, node = _sessions()
    h = _hdr(1, Op.PARTITION_DELETE, partition=7)
    tag = caller.seal(h)
    node.open(h, tag)
    with pytest.raises(SessionError):
        node.open(h, tag)                         # the same bytes again on this connection
    _caller2, node2 = _sessions()
    with pytest.raises(SessionError):
        node2.open(h, tag)                        # on another connection (other keys), even as its first


def test_reordered_dropped_reflected_or_altered_messages_are_refused():
    caller, node = _sessions()
    a, b = _hdr(1), _hdr(2)
    ta, tb = caller.seal(a), caller.seal(b)
    with pytest.raises(SessionError):
        node.open(b, tb)                          # b before a (reordered), or a dropped
    caller, node = _sessions()
    ta = caller.seal(a)
    with pytest.raises(SessionError):
        caller.open(a, ta)                        # reflected back to its sender: the other direction's key
    with pytest.raises(SessionError):
        node.open(_hdr(1, Op.PING, arg=1), ta)    # one field changed
    node.open(a, ta)                              # a refused message moves nothing: the real one still passes


def test_the_mac_covers_the_header_only():
    """An inline payload follows the header in its message: it is covered by the header's CRC32C field."""
    caller, node = _sessions()
    h = _hdr(1, Op.WRITE, length=3, crc=0x1234, flags=0x08)
    node.open(h + b"abc", caller.seal(h))


def test_unseal_gives_the_sequence_number_back():
    caller, node = _sessions()
    caller.seal(_hdr(1))
    caller.unseal()                               # nothing of it was sent
    h = _hdr(2)
    node.open(h, caller.seal(h))


def test_a_session_needs_two_distinct_keys():
    k = os.urandom(32)
    with pytest.raises(ValueError):
        Session(k, k)
    with pytest.raises(ValueError):
        Session(k, b"short")


# ------------------------------------------------------------------------------------------------- the hello
def _transcript(**changes):
    args = dict(role=3, client_nonce=b"c" * 32, server_nonce=b"s" * 32, identity="", server="10.0.0.1:17310",
                client_kx=b"x" * 32, server_kx=b"y" * 32, client_versions=(5, 9), server_versions=(5, 9))
    args.update(changes)
    return session_transcript(**args)


@pytest.mark.parametrize("change", [dict(server="10.0.0.2:17310"), dict(role=1), dict(identity="10.0.0.3:1"),
                                   dict(client_kx=b"z" * 32), dict(server_kx=b"z" * 32), dict(client_nonce=b"d" * 32),
                                   dict(client_versions=(5, 8)), dict(server_versions=(9, 9))])
def test_the_transcript_covers_the_node_dialed_the_shares_and_the_ranges(change):
    assert _transcript(**change) != _transcript()


def test_the_transcript_is_unambiguous():
    """Length prefixes: moving bytes from one field to the next gives another transcript."""
    assert _transcript(identity="a", server="b:1") != _transcript(identity="ab", server=":1")


def test_both_ends_derive_the_same_keys_and_only_they():
    a, b = KeyShare(), KeyShare()
    key, text = os.urandom(32), _transcript()
    ka, kb = session_keys(key, text, a.shared(b.public)), session_keys(key, text, b.shared(a.public))
    assert ka == kb and ka[0] != ka[1]
    eve = KeyShare()                          # the role key and the transcript, but not a share's secret
    assert session_keys(key, text, eve.shared(a.public)) != ka
    assert session_keys(key, _transcript(server="10.0.0.2:17310"), a.shared(b.public)) != ka


def test_a_bad_key_share_is_refused():
    with pytest.raises(ValueError):
        KeyShare().shared(b"short")
    with pytest.raises(ValueError):
        KeyShare().shared(bytes(32))            # a low-order point: no shared secret


def test_the_downgrade_mark():
    n = session_nonce()
    assert speaks_sessions(n) and n.endswith(SESSION_MARK) and len(n) == 32
    assert session_nonce() != n
    assert not speaks_sessions(new_nonce())


def test_the_hello_carries_the_node_dialed_and_a_binary_key_share():
    share = KeyShare().public
    raw = Hello(transport=Transport.TCP, has_device=False, slots=8, software="datanode 9", server="10.0.0.1:17310",
                kx=share).encode()
    got = decode_hello(raw[:HELLO_SIZE])
    decode_extensions(got, raw[HELLO_SIZE + got.ident_len:])
    assert (got.server, got.kx, got.software) == ("10.0.0.1:17310", share, "datanode 9")


# ------------------------------------------------------------------------------ node keys and certificates
def test_a_node_proves_its_own_identity_only():
    from wire.auth import Credentials, node_proves
    creds = Credentials.from_secret(b"s" * 32)
    me = creds.node_signer("10.0.0.1:17310")
    text = _transcript()
    sig = me.sign(text)
    assert node_proves(creds.node_ca, "10.0.0.1:17310", me.cert, sig, text)
    assert not node_proves(creds.node_ca, "10.0.0.2:17310", me.cert, sig, text)      # another node's name
    assert not node_proves(creds.node_ca, "10.0.0.1:17310", me.cert, sig, _transcript(server="x:1"))
    other = Credentials.from_secret(b"t" * 32)                                       # another cluster's CA
    assert not node_proves(other.node_ca, "10.0.0.1:17310", me.cert, sig, text)
    forged = other.node_signer("10.0.0.1:17310")
    assert not node_proves(creds.node_ca, "10.0.0.1:17310", forged.cert, forged.sign(text), text)
    assert not node_proves(creds.node_ca, "10.0.0.1:17310", b"", b"", text)           # an older node: nothing


def test_key_files_carry_the_node_ca_and_older_ones_still_load(tmp_path):
    from wire.auth import AuthConfigError, Credentials
    from wire.protocol import Role
    master = Credentials.from_secret(b"s" * 32)
    assert len(master.node_ca) == 32
    new = tmp_path / "client.key"
    new.write_text(master.role_key_file(Role.CLIENT))
    got = Credentials.load(new)
    assert got.node_ca == master.node_ca and got.key(Role.CLIENT) == master.key(Role.CLIENT)
    assert got.node_signer("10.0.0.1:1") is None                                     # a key file issues nothing
    old = tmp_path / "old.key"
    old.write_text(" ".join(new.read_text().split()[:4]) + "\n")                     # made before the field
    got = Credentials.load(old)
    assert got.node_ca == b"" and got.key(Role.CLIENT) == master.key(Role.CLIENT)
    vol = tmp_path / "vol.key"
    vol.write_text(master.volume_key_file("photos"))
    assert Credentials.load(vol).node_ca == master.node_ca
    bad = tmp_path / "bad.key"
    bad.write_text(" ".join(new.read_text().split()[:4]) + " node-ca=abcd\n")
    with pytest.raises(AuthConfigError, match="node-ca"):
        Credentials.load(bad)


def test_the_node_proof_message():
    from wire.protocol import NodeProof, ProtocolError
    cert, sig = os.urandom(96), os.urandom(64)
    raw = NodeProof.encode(cert, sig)
    assert len(raw) == NodeProof.SIZE and NodeProof.decode(raw) == (cert, sig)
    with pytest.raises(ProtocolError):
        NodeProof.decode(b"XXXX" + raw[4:])
    with pytest.raises(ProtocolError):
        NodeProof.encode(cert[:95], sig)
