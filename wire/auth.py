"""Cluster credentials, the proofs exchanged in the connection hello, and the keys of the session after it.

Threat model: docs/security.md.  Against whom: any host that can open a TCP connection to a datanode
(a tenant's machine, a compromised client host holding only a ``client`` key, a stranger on the network).
Protected: without a key nobody gets past the hello; a ``client`` key moves data (append, read, create/delete
extents) but cannot administer partitions, forward writes, truncate, or trigger repair/scrub (FORBIDDEN);
a follower takes forwarded changes only from the authenticated identity of its partition's current leader,
and no node takes a view whose leader is not known to hold every acknowledged byte (datanode/viewguard.py);
on TCP a peer reaches our memory only inside a grant (the range a request in flight named to that very
connection); every admin body is validated before anything changes, and deleted data goes to the trash first;
a peer cannot starve the others (per-connection requests in flight, pool share, answer bytes, hello deadline,
idle and connection limits); a follower copy that differs from its leader's is reported within a heartbeat
and repaired.  A caller reaches the node it dialed or none: the hello names it, the node proves it (a relayed
hello fails), and every control message after it carries a MAC of the session (wire/session.py), so nobody on
the path injects, replays, reorders or alters a request or an answer.  With TLS (transport/tls.py) the stream
is also encrypted, its payloads integrity-protected, and the client checks the node's X.509 certificate.  Not
protected: without TLS an on-path attacker can read traffic and alter payloads (covered by CRC32C only);
a connection with a peer of a build before sessions is not a session;
every datanode holds the cluster secret, so a compromised datanode can act as any node or admin; a client key
holder can overwrite nothing but can append garbage to,
delete, or fill (to its share) any partition, a *volume key* the same on its volume's partitions only
(FORBIDDEN elsewhere: datanode/ops/admit.py); on verbs a grant is a
type-2 memory window bound per request on the peer's queue pair (the MR itself has no remote rights), but
rdma_rxe bounds a window by its MR, so during its own request a peer can reach the rest of that region, and a
device without type-2 windows falls back to MR-wide rkeys (transport/verbs.py); floods of connections are
bounded per address and in all (datanode/ops/admission.py), shared among addresses, not people.  Without a
secret a node takes peers on its own host only (unless ``insecure``), and every such peer is trusted.
Authentication, the checks and the frame MACs cost the data path little; TLS costs a lot (Python-level record
handling in trio.SSLStream): ``bench/trust_cost.py`` measures them.

Keys.  The *cluster secret* is a file of random bytes (``datanode gen-secret``) held by the datanodes and the
admin hosts.  Each role has its own key derived from it: ``K_role = HMAC-SHA256(secret, "datanode role key
v1/" + role)``.  A host that should only read and write data gets a *role key file* holding ``K_client`` alone
(``datanode derive-key --role client``): it cannot compute ``K_node`` or ``K_admin`` (HMAC is one-way), so it
can never claim those roles.  Where each lives:

    datanodes      the cluster secret (they verify every role, and act as ``node`` towards each other)
    admin hosts    the cluster secret, or an ``admin`` role key file (dnctl)
    client hosts   a ``client`` role key file (the SDK, a FUSE mount), or a *volume key file*: the client role
                   on one volume's partitions (``volume_key``; the hello names the volume as its identity)

Node keys.  Each datanode has an Ed25519 key of its own and a certificate binding it to its identity
(HOST:PORT), signed by the *node CA*; both keys are derived from the cluster secret (``NodeSigner``), so a node
makes its own at start.  A caller checks them with the node CA's public key alone: derived by holders of the
secret, carried by role and volume key files (``node-ca=``).  Why signatures: every client host holds
``K_client``, and whoever can check an HMAC proof can make it -- with HMAC alone a client key holder could play
any node to another client.  A key file without the field still works, without that check.

The hello (wire/transport/connect.py) is a mutual challenge-response: the client sends its role, a fresh
32-byte nonce, (role ``node``) its identity, the identity of the node it dialed (``server``) and an X25519 key
share; the server -- refusing a hello that names another node -- answers with its own nonce and share and
``HMAC(K_role, "server" | transcript)``; the client checks that, then sends ``HMAC(K_role, "client" |
transcript)``; the server checks that and answers with its verdict, then (a session) its node certificate and
its signature of the transcript (``protocol.NodeProof``), which the client checks where it holds the node CA's
public key.  The signature and the key exchange wait for the caller's proof, and the node's share is reused
for a while: a caller without a key costs the node HMACs only.  The transcript (``session_transcript``) binds the role, both nonces, the caller's identity, the
node dialed as each side knows it, both shares and both version ranges.  Neither side can replay an old
exchange (the other side's nonce is fresh), and the two proofs use different labels, so one is never usable as
the other.  The session's two keys (``session_keys``) come from the role key, the transcript and the shares'
shared secret, which nobody who only watched the hello can compute, a holder of the same role key included.

Upgrades.  With a peer whose newest protocol predates sessions (``protocol.SESSIONS_SINCE``) the hello is the
older one: transcript ``transcript`` (role, nonces, identity), no session.  A build that speaks sessions ends
its nonces with ``SESSION_MARK``; the older proofs cover the nonces, so a hello or answer lowered on the way to
an older protocol between two such builds is seen and refused.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import pathlib
import secrets

from .protocol import BodyError, Role, check_volume

NONCE_SIZE = 32
PROOF_SIZE = 32
MIN_SECRET = 16
KEY_FILE_MAGIC = "datanode-role-key"
VOLUME_KEY_MAGIC = "datanode-volume-key"
ROLE_NAMES = {r.name.lower(): r for r in Role}


class AuthConfigError(Exception):
    """A secret or key file that cannot be used (named in the message)."""


def role_key(secret: bytes, role: Role) -> bytes:
    return hmac.new(secret, b"datanode role key v1/" + role.name.lower().encode(), hashlib.sha256).digest()


def volume_key(admin_key: bytes, volume: str) -> bytes:
    """The key of volume ``volume``: ``HMAC-SHA256(K_admin, "datanode volume key v1/" + name)``.  Derived from
    the admin key (itself from the cluster secret) so that an admin host holding only an admin key file can
    issue volume keys, while a client or volume key can derive nothing (HMAC is one-way); the name is in the
    derivation, so a key for one volume proves no other."""
    return hmac.new(admin_key, b"datanode volume key v1/" + check_volume(volume).encode(), hashlib.sha256).digest()


def transcript(role: int, client_nonce: bytes, server_nonce: bytes, identity: str) -> bytes:
    return b"datanode hello v3|%d|" % role + client_nonce + b"|" + server_nonce + b"|" + identity.encode()


# A nonce sent by a build that speaks authenticated sessions ends with this mark (the other 24 bytes are random).
# The old hello's proofs cover both nonces, so nobody on the path can remove it: a node that speaks sessions
# and gets a marked hello offering only an older protocol, or a caller that gets a marked answer at an older
# protocol, knows that the versions were lowered on the way, and refuses (as TLS 1.3 marks its server random).
SESSION_MARK = b"DNsess09"
KX_SIZE = 32


def session_nonce() -> bytes:
    return secrets.token_bytes(NONCE_SIZE - len(SESSION_MARK)) + SESSION_MARK


def speaks_sessions(nonce: bytes) -> bool:
    return nonce[-len(SESSION_MARK):] == SESSION_MARK


def session_transcript(role: int, client_nonce: bytes, server_nonce: bytes, identity: str, server: str,
                       client_kx: bytes, server_kx: bytes, client_versions: tuple[int, int],
                       server_versions: tuple[int, int]) -> bytes:
    """What a session's proofs and keys cover: the role, both nonces, the caller's identity, the node it
    dialed (``server``: as the caller named it, and as the node knows itself -- a relay to another node makes
    the two differ), both key shares and both version ranges.  Each part length-prefixed."""
    parts = (b"datanode hello v4", b"%d" % role, client_nonce, server_nonce, identity.encode(), server.encode(),
             client_kx, server_kx, b"%d-%d" % client_versions, b"%d-%d" % server_versions)
    return b"".join(len(p).to_bytes(2, "big") + p for p in parts)


class KeyShare:
    """One end's ephemeral X25519 key for one hello: the session keys need the shared secret, which nobody
    who only watched the hello can compute -- also not another holder of the same role key."""

    def __init__(self) -> None:
        from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
        from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
        self._key = X25519PrivateKey.generate()
        self.public = self._key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)

    def shared(self, peer: bytes) -> bytes:
        """The shared secret with the peer's share; ValueError for a share that is not one (wrong size, a
        low-order point)."""
        from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey
        if len(peer) != KX_SIZE:
            raise ValueError(f"a key share is {KX_SIZE} bytes, got {len(peer)}")
        return self._key.exchange(X25519PublicKey.from_public_bytes(peer))


def session_keys(key: bytes, text: bytes, shared: bytes) -> tuple[bytes, bytes]:
    """The session's two keys (caller -> node, node -> caller) from the role key, the transcript and the
    key shares' shared secret."""
    root = hmac.digest(key, b"datanode session v1|" + shared + text, "sha256")
    return hmac.digest(root, b"caller to node", "sha256"), hmac.digest(root, b"node to caller", "sha256")


def _ed25519(seed: bytes):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    return Ed25519PrivateKey.from_private_bytes(seed)


def _raw_public(private) -> bytes:
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
    return private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


NODE_CERT_SIZE = 96        # the node's public key (32) and the node CA's signature of it with its identity (64)
NODE_SIG_SIZE = 64


def node_ca_seed(secret: bytes) -> bytes:
    return hmac.digest(secret, b"datanode node ca v1", "sha256")


def _cert_text(identity: str, node_public: bytes) -> bytes:
    return b"datanode node cert v1|" + identity.encode() + b"|" + node_public


def _sig_text(text: bytes) -> bytes:
    return b"datanode node proof v1|" + text


class NodeSigner:
    """A node's own key and its certificate: the node CA's signature binding the key to the node's identity
    (HOST:PORT).  Both derived from the cluster secret (the node CA's key is ``HMAC(secret, "datanode node ca
    v1")``, a node's ``HMAC(secret, "datanode node key v1/" + identity)``), so a datanode issues its own at
    start; what a caller needs to check them is the node CA's *public* key alone, which proves nothing else."""

    def __init__(self, secret: bytes, identity: str) -> None:
        ca = _ed25519(node_ca_seed(secret))
        self._key = _ed25519(hmac.digest(secret, b"datanode node key v1/" + identity.encode(), "sha256"))
        public = _raw_public(self._key)
        self.identity = identity
        self.cert = public + ca.sign(_cert_text(identity, public))

    def sign(self, text: bytes) -> bytes:
        """The node's signature of a session transcript (one naming this node as the one dialed)."""
        return self._key.sign(_sig_text(text))


def node_proves(ca_public: bytes, identity: str, cert: bytes, sig: bytes, text: bytes) -> bool:
    """Whether ``cert`` is the node CA's certificate for node ``identity`` and ``sig`` that node's signature of
    the transcript ``text``."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
    if len(cert) != NODE_CERT_SIZE or len(sig) != NODE_SIG_SIZE or len(ca_public) != 32:
        return False
    public, cert_sig = cert[:32], cert[32:]
    try:
        Ed25519PublicKey.from_public_bytes(ca_public).verify(cert_sig, _cert_text(identity, public))
        Ed25519PublicKey.from_public_bytes(public).verify(sig, _sig_text(text))
    except (InvalidSignature, ValueError):
        return False
    return True


def proof(key: bytes, side: bytes, text: bytes) -> bytes:
    return hmac.new(key, side + b"|" + text, hashlib.sha256).digest()


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_SIZE)


class Credentials:
    """The role keys this process holds: all of them (from the cluster secret) or one (a role key file, or a
    volume key file: the ``client`` role scoped to the partitions of ``volume``)."""

    def __init__(self, keys: dict[Role, bytes], source: str = "", master: bool = False, volume: str = "",
                 secret: bytes = b"", node_ca: bytes = b""):
        self.keys = dict(keys)
        self.source = source
        self.master = master
        self.volume = volume       # a volume key: the hello names the volume as the client's identity
        self._secret = secret      # the cluster secret (master only): a node's own key and certificate
        # the node CA's public key: with it a caller checks which node answered (key files made before it
        # existed lack it: their holders then rely on the node's proof with the role key alone)
        self.node_ca = node_ca or (_raw_public(_ed25519(node_ca_seed(secret))) if secret else b"")

    @classmethod
    def from_secret(cls, secret: bytes, source: str = "") -> "Credentials":
        if len(secret) < MIN_SECRET:
            raise AuthConfigError(f"{source or 'secret'}: the cluster secret is {len(secret)} bytes, "
                                  f"at least {MIN_SECRET} are needed (make one with: datanode gen-secret)")
        return cls({r: role_key(secret, r) for r in Role}, source, master=True, secret=secret)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Credentials":
        """A cluster secret file, or a role key file (first word ``datanode-role-key``)."""
        p = pathlib.Path(path)
        try:
            raw = p.read_bytes()
        except OSError as e:
            raise AuthConfigError(f"secret file {p}: {e.strerror or e}") from None
        text = raw.strip()
        if text.startswith(VOLUME_KEY_MAGIC.encode()):
            parts = text.decode(errors="replace").split()
            node_ca = _node_ca_field(p, parts)
            if len(parts) != 4 or parts[1] != "v1":
                raise AuthConfigError(f"volume key file {p}: expected '{VOLUME_KEY_MAGIC} v1 VOLUME HEX "
                                      f"[{NODE_CA_FIELD}HEX]'")
            try:
                name = check_volume(parts[2])
                key = bytes.fromhex(parts[3])
            except BodyError as e:
                raise AuthConfigError(f"volume key file {p}: {e.detail}") from None
            except ValueError:
                raise AuthConfigError(f"volume key file {p}: the key is not hex") from None
            if len(key) != 32:
                raise AuthConfigError(f"volume key file {p}: the key must be 32 bytes (64 hex digits)")
            return cls({Role.CLIENT: key}, str(p), volume=name, node_ca=node_ca)
        if text.startswith(KEY_FILE_MAGIC.encode()):
            parts = text.decode(errors="replace").split()
            node_ca = _node_ca_field(p, parts)
            if len(parts) != 4 or parts[1] != "v1" or parts[2] not in ROLE_NAMES:
                raise AuthConfigError(f"key file {p}: expected '{KEY_FILE_MAGIC} v1 ROLE HEX [{NODE_CA_FIELD}HEX]' "
                                      f"with ROLE one of {', '.join(ROLE_NAMES)}")
            try:
                key = bytes.fromhex(parts[3])
            except ValueError:
                raise AuthConfigError(f"key file {p}: the key is not hex") from None
            if len(key) != 32:
                raise AuthConfigError(f"key file {p}: the key must be 32 bytes (64 hex digits)")
            return cls({ROLE_NAMES[parts[2]]: key}, str(p), node_ca=node_ca)
        return cls.from_secret(text, str(p))

    def key(self, role: Role) -> bytes | None:
        return self.keys.get(role)

    def default_role(self) -> Role:
        """What a tool claims when not told: admin when it can (dnctl on an admin host), else its one role."""
        for r in (Role.ADMIN, Role.CLIENT, Role.NODE):
            if r in self.keys:
                return r
        raise AuthConfigError("no key")   # pragma: no cover - a Credentials always holds one

    def role_key_file(self, role: Role) -> str:
        """The text of a role key file for ``role`` (only from the cluster secret)."""
        if not self.master:
            raise AuthConfigError(f"{self.source}: a role key file cannot make other keys; use the cluster secret")
        return f"{KEY_FILE_MAGIC} v1 {role.name.lower()} {self.keys[role].hex()}{self._ca_field()}\n"

    def _ca_field(self) -> str:
        return f" {NODE_CA_FIELD}{self.node_ca.hex()}" if self.node_ca else ""

    def node_signer(self, identity: str) -> "NodeSigner | None":
        """This node's key and certificate for ``identity`` (None without the cluster secret)."""
        return NodeSigner(self._secret, identity) if self._secret else None


    def volume_key_file(self, volume: str) -> str:
        """The text of a volume key file for ``volume`` (from the cluster secret or an admin key file)."""
        admin = self.keys.get(Role.ADMIN)
        if admin is None:
            raise AuthConfigError(f"{self.source}: making a volume key needs the cluster secret or an admin key file")
        try:
            return f"{VOLUME_KEY_MAGIC} v1 {volume} {volume_key(admin, volume).hex()}{self._ca_field()}\n"
        except BodyError as e:
            raise AuthConfigError(e.detail) from None


NODE_CA_FIELD = "node-ca="


def _node_ca_field(path, parts: list[str]) -> bytes:
    """The optional last field of a key file, ``node-ca=HEX``: the node CA's public key (removed from
    ``parts``)."""
    if not parts or not parts[-1].startswith(NODE_CA_FIELD):
        return b""
    try:
        ca = bytes.fromhex(parts.pop()[len(NODE_CA_FIELD):])
    except ValueError:
        ca = b""
    if len(ca) != 32:
        raise AuthConfigError(f"key file {path}: {NODE_CA_FIELD} must be 32 bytes (64 hex digits)")
    return ca


class DialAuth:
    """What one side of ``connect.dial`` presents: credentials (or None: authentication off), the role it
    claims and, for a datanode, its identity (its listen address)."""

    def __init__(self, creds: Credentials | None, role: Role | None = None, identity: str = "", tls=None,
                 transition: bool = False):
        self.creds = creds
        self.tls = tls                       # ssl.SSLContext: speak TLS from the first byte (transport/tls.py)
        self.transition = transition         # holding a secret, still talk to a node without one (a cluster
                                             # being switched to the secret); else such a node is refused
        self.role = role if role is not None else (creds.default_role() if creds else Role.CLIENT)
        self.identity = identity
        if creds is not None and creds.volume and self.role == Role.CLIENT:
            self.identity = creds.volume     # bound into the proofs: the node derives the volume's key from it
        if creds is not None and creds.key(self.role) is None:
            raise AuthConfigError(f"{creds.source}: holds no key for role '{self.role.name.lower()}' "
                                  f"(it holds: {', '.join(r.name.lower() for r in creds.keys)})")

    @property
    def key(self) -> bytes | None:
        return self.creds.key(self.role) if self.creds else None


def gen_secret() -> str:
    """A new cluster secret (64 hex digits)."""
    return secrets.token_hex(32) + "\n"
