"""Opening a connection: TCP stream, hello, transport negotiation, then TCP or verbs on top.

Every connection starts as a TCP stream.  The client sends a ``Hello`` (the transport it wants, whether it has
a working RDMA device, how many control slots it preposts); the server answers with the transport chosen:

    either side says tcp                     -> tcp      (error if the other side *requires* verbs)
    both have a device, neither says tcp     -> verbs    (endpoints exchanged on this same stream)
    otherwise                                -> tcp      (error if a side requires verbs)

If setting up the queue pair fails after verbs was chosen, both ends agree on it over the stream and the
connection stays on TCP, with a warning in the log.

Both hellos carry the protocol versions their sender speaks; the connection uses the highest both speak
(``Connection.version``, stamped on every header), and a server that shares none with its peer refuses it
with a line naming both ranges, in its log and in the dialer's error.

Authentication (wire/auth.py) happens in the same exchange, before any transport is brought up: the
client's hello carries its role, nonce and identity; a server that holds the cluster secret answers with its
nonce and proof, checks the client's proof (``AuthProof``) and says yes or no (``AuthVerdict``).  The
accepted connection carries the proven ``role`` and ``identity``; with no secret on the server the role is
unset and the identity is the one a node's hello names, unproven (authentication off: as the node warns at
start, it then serves every peer it accepts).
"""
from __future__ import annotations

import functools
import hmac
import logging
import time
from contextlib import asynccontextmanager
from typing import AsyncIterator

import trio

from .. import aio
from ..auth import (KX_SIZE, Credentials, DialAuth, KeyShare, NodeSigner, new_nonce, node_proves, proof, session_keys,
                    session_nonce, session_transcript, speaks_sessions, transcript, volume_key)
from .base import TransportChoice, TransportOptions
from ..protocol import (HEADER_SIZE, HELLO_SIZE, HELLO_STATUS, MIN_VERSION, SESSIONS_SINCE, STATUS_DOWNGRADE,
                        STATUS_NO_SHARE, STATUS_NOT_DIALED, STATUS_VERSION, VERSION, AuthProof, AuthVerdict, Hello,
                        NodeProof, ProtocolError, Role, Transport, decode_extensions, decode_hello, decode_identity,
                        negotiate, version_refusal)
from ..session import Session
from .base import Connection, ConnectionClosed, Domain, TransportError
from . import tls
from .tcp import TcpConnection, recv_exactly, send_all, tune_socket

log = logging.getLogger(__name__)

DEFAULT_SLOTS = 64
TRANSPORT_NAMES = {TransportChoice.AUTO: Transport.AUTO, TransportChoice.TCP: Transport.TCP,
                   TransportChoice.VERBS: Transport.VERBS}


class NegotiationError(TransportError):
    pass


class AuthError(NegotiationError):
    """The hello's authentication failed (either side); the message says which side and why."""


class NotAdmitted(AuthError):
    """The server's ``admit`` refused a peer (e.g. too many connections of its kind); it was told why.  A
    dialer gets it too when the node said "too many connections" or closed the connection before the hello
    completed (a flood's pre-auth budget): nothing about its credentials, so worth dialing again."""


def _status(code: int) -> str:
    return HELLO_STATUS[code] if 0 <= code < len(HELLO_STATUS) else f"refused ({code})"


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


@functools.cache
def software() -> str:
    """What this build calls itself in its hellos (the ``software`` extension): "datanode VERSION"."""
    from importlib import metadata
    try:
        return f"datanode {metadata.version('datanode')}"
    except metadata.PackageNotFoundError:       # run from a source tree that was never installed
        return "datanode (source)"


async def _read_hello(sock) -> Hello:
    buf = bytearray(HELLO_SIZE)
    await recv_exactly(sock, memoryview(buf))
    hello = decode_hello(buf)
    if hello.ident_len or hello.ext_len:
        tail = bytearray(hello.ident_len + hello.ext_len)
        await recv_exactly(sock, memoryview(tail))
        hello.identity = decode_identity(bytes(tail[:hello.ident_len]))
        decode_extensions(hello, bytes(tail[hello.ident_len:]))
    return hello


def _version(hello: Hello) -> int | None:
    """The protocol version a connection with the sender of ``hello`` uses (None: they share none)."""
    return negotiate((MIN_VERSION, VERSION), (hello.min_version, hello.version))


async def _read(sock, n: int) -> bytes:
    buf = bytearray(n)
    await recv_exactly(sock, memoryview(buf))
    return bytes(buf)


@asynccontextmanager
async def _running(conn: Connection) -> AsyncIterator[Connection]:
    async with aio.nursery() as nursery:
        await nursery.start(conn.run)
        try:
            yield conn
        finally:
            await conn.aclose()
            nursery.cancel_scope.cancel()


async def _upgrade(sock, domain: Domain, peer: str, is_server: bool, peer_slots: int, our_slots: int,
                   peer_slot_size: int, our_slot_size: int = HEADER_SIZE):
    """Try to bring up verbs on this stream; None means both ends agreed to stay on TCP.  Slot sizes: what
    each end's hello said its receive slots take (a header, and an inline payload after it on the side that
    takes requests: ``verbs_slot_size``)."""
    from . import verbs  # imported only when a device is in play (pyverbs is optional)
    try:
        return await verbs.establish(sock, domain, peer, is_server=is_server, peer_slots=peer_slots,
                                     our_slots=our_slots, peer_slot_size=peer_slot_size,
                                     our_slot_size=our_slot_size)
    except verbs.SetupFailed as e:
        log.warning("verbs setup with %s failed (%s); this connection stays on TCP", peer, e)
        return None


@asynccontextmanager
async def dial(host: str, port: int, domain: Domain, *, transport: str = "auto",
               slots: int = DEFAULT_SLOTS, timeout: float = 5.0,
               auth: DialAuth | None = None, server: str = "", source: str = "") -> AsyncIterator[Connection]:
    """Connect to a datanode; yields a running Connection.  ``auth``: the credentials and role to present
    (None or without credentials: authentication off, refused by a node that has a secret).  ``server``: the
    identity of the node meant (its HOST:PORT in the cluster map; default ``host:port``): with authentication
    the node proves it is that one, or the hello fails.  ``source``: the local IP address to connect from
    (empty: the kernel's choice) -- a host with several, or many clients on one host that the node's
    per-address limits should tell apart."""
    peer = f"{host}:{port}"
    server = server or peer
    auth = auth or DialAuth(None)
    key = auth.key
    share = KeyShare() if key is not None and VERSION >= SESSIONS_SINCE else None
    raw = sock = trio.socket.socket()
    device = has_device(domain) and auth.tls is None       # a TLS connection stays on TCP
    try:
        with trio.fail_after(timeout):
            tune_socket(sock, domain.options.tcp_congestion)
            try:
                if source:
                    await sock.bind((source, 0))
                await sock.connect((host, port))
            except OSError as e:
                raise TransportError(f"cannot connect to {peer}: {e.strerror or e}") from None
            if auth.tls is not None:
                try:
                    sock = await tls.wrap(sock, auth.tls, server_side=False, server_hostname=host)
                except TransportError as e:
                    raise TransportError(f"connecting to {peer}: {e}") from None
            nonce = (session_nonce() if share else new_nonce()) if key else bytes(32)
            await send_all(sock, Hello(transport=TRANSPORT_NAMES[transport], has_device=device,
                                       slots=slots, auth=key is not None, role=int(auth.role), nonce=nonce,
                                       identity=auth.identity, software=software(), server=server if share else "",
                                       kx=share.public if share else b"").encode())
            try:
                answer = await _read_hello(sock)
            except TransportError as e:
                if auth.creds is not None and auth.creds.volume:   # an older node drops a volume's hello
                    raise TransportError(f"{e} (with volume key {auth.creds.source}: does {peer} run a build "
                                         f"that knows volumes?)") from None
                raise
            version = _version(answer)
            if answer.status == STATUS_VERSION or version is None:
                raise NegotiationError(f"{peer} refused the connection: "
                                       f"{version_refusal((answer.min_version, answer.version))}")
            if answer.status == 1 or (answer.auth and key is None):
                raise AuthError(f"{peer} requires authentication: give a cluster secret or role key file "
                                f"(secret_file, $DATANODE_SECRET_FILE)")
            if answer.status == STATUS_NOT_DIALED:
                raise AuthError(f"{peer} refused the connection: it is node {answer.identity or '(unnamed)'}, not "
                                f"{server} (a relay, or a wrong address: dial a node by the address it "
                                f"registered, as the cluster map lists it)")
            if answer.status:
                raise (NotAdmitted if answer.status == 3 else AuthError)(
                    f"{peer} refused the connection: {_status(answer.status)}")
            if key is not None and not answer.auth:
                _unauthenticated_server(peer, auth)
            keys = None
            if key is not None and answer.auth:
                if version >= SESSIONS_SINCE:
                    text = session_transcript(int(auth.role), nonce, answer.nonce, auth.identity, server,
                                              share.public, answer.kx, (MIN_VERSION, VERSION),
                                              (answer.min_version, answer.version))
                else:
                    if share is not None and speaks_sessions(answer.nonce):
                        raise AuthError(f"{peer} speaks authenticated sessions but answered at protocol {version}: "
                                        f"the hello was altered on the way (a downgrade): refusing")
                    text = transcript(int(auth.role), nonce, answer.nonce, auth.identity)
                if not hmac.compare_digest(answer.proof, proof(key, b"server", text)):
                    raise AuthError(f"{peer} failed to prove it holds the cluster secret (a different secret?)")
                await send_all(sock, AuthProof.encode(proof(key, b"client", text)))
                verdict = AuthVerdict.decode(await _read(sock, AuthVerdict.SIZE))
                if verdict == 3:                  # too many connections: not about our credentials
                    raise NotAdmitted(f"{peer} refused the connection: {_status(verdict)}")
                if verdict:
                    raise AuthError(f"{peer} refused our credentials: {_status(verdict)}")
                if version >= SESSIONS_SINCE:
                    cert, sig = NodeProof.decode(await _read(sock, NodeProof.SIZE))
                    ca = auth.creds.node_ca
                    if ca and not node_proves(ca, server, cert, sig, text):
                        raise AuthError(f"{peer} failed to prove it is node {server}: its certificate or signature "
                                        f"does not check out against the cluster's node CA")
                    try:
                        keys = session_keys(key, text, share.shared(answer.kx))
                    except ValueError as e:
                        raise AuthError(f"{peer} sent no usable session key share: {e}") from None
            if answer.transport == Transport.AUTO:
                raise NegotiationError(f"{peer} refused the connection: transports cannot agree "
                                       f"(we asked for {transport}, device={device})")
            conn: Connection | None = None
            if answer.transport == Transport.VERBS:
                conn = await _upgrade(sock, domain, peer, False, answer.slots, slots, answer.slot_size)
            if conn is None:
                conn = TcpConnection(sock, domain, peer, answer.slots, slots)
            conn.tls = auth.tls is not None
            conn.version, conn.peer_software = version, answer.software
            if keys is not None:
                conn.bind_session(Session(keys[0], keys[1]))
    except trio.TooSlowError:
        raw.close()
        raise TransportError(f"connecting to {peer} timed out after {timeout}s") from None
    except (ConnectionClosed, ConnectionResetError, BrokenPipeError) as e:
        raw.close()            # connected, then closed before the hello completed
        raise NotAdmitted(f"{peer} closed the connection before the hello completed: {e}") from None
    except (ProtocolError, OSError) as e:
        raw.close()
        raise TransportError(f"connecting to {peer}: {e}") from None
    except BaseException:
        raw.close()
        raise
    async with _running(conn) as c:
        yield c


def _unauthenticated_server(peer: str, auth: DialAuth) -> None:
    """We hold a secret and ``peer`` does not authenticate: refused, unless we are switching a cluster to
    the secret (``auth.transition``: nodes without it are still about)."""
    if not auth.transition:
        raise AuthError(f"{peer} does not authenticate (no secret configured there) but we hold one: refusing "
                        f"to trust it")
    log.debug("%s does not authenticate (auth_transition): talking to it unauthenticated", peer)


class ServerAuth:
    """The accepting side's credentials (the cluster secret), or None for authentication off.  ``transition``:
    with a secret, peers without one are taken too (unauthenticated, as without a secret) -- while a running
    cluster is switched to the secret (docs/security.md)."""

    def __init__(self, creds: Credentials | None, tls=None, tls_required: bool = False, transition: bool = False,
                 identity: str = ""):
        if creds is not None and not creds.master:
            raise ValueError(f"{creds.source}: a datanode needs the cluster secret, not a role key file")
        self.creds = creds
        self.identity = identity             # HOST:PORT a caller must name as the node it dialed ("": the
                                             # address the connection was accepted on)
        self.tls = tls                       # ssl.SSLContext (server side): TLS offered (transport/tls.py)
        self.tls_required = tls_required     # plaintext hellos refused
        self.transition = transition


async def refuse(sock, domain: Domain, slots: int, status: int) -> None:
    await send_all(sock, Hello(transport=Transport.AUTO, has_device=has_device(domain), slots=slots,
                               status=status).encode())


def _claimed_identity(hello: Hello) -> str:
    """Without authentication: the node identity a peer's hello names (unproven).  A follower takes forwarded
    changes only from a peer naming its partition's leader, so a peer must at least pretend to be it."""
    return hello.identity if hello.role == Role.NODE else ""


async def _authenticate(sock, peer: str, hello: Hello, creds: Credentials | None, answer: Hello,
                        admit=None, transition: bool = False, version: int = VERSION, me: str = "") -> tuple:
    """The server's half of the hello's authentication; returns the (role, identity) proven -- identity: a
    node's HOST:PORT, or the volume a client's key belongs to ("": a plain client key) -- (None, "") when
    authentication is off, or raises AuthError after telling the peer why; and the session's keys (None: not
    a session).  ``admit(role, identity)``: 0 to let the proven peer in, else a HELLO_STATUS code to refuse it
    with (e.g. too many connections).  ``version``: the one agreed; ``me``: this node's identity."""
    if creds is None or (transition and not hello.auth):   # (a peer holding a secret refuses us itself)
        answer.nonce = bytes(32)
        claimed = _claimed_identity(hello)
        status = admit(None, claimed) if admit is not None else 0
        if status:
            answer.status, answer.transport = status, Transport.AUTO
            await send_all(sock, answer.encode())
            raise NotAdmitted(f"connection from {peer} refused: {_status(status)}")
        await send_all(sock, answer.encode())
        return None, claimed, None
    if not hello.auth:
        answer.status, answer.transport = 1, Transport.AUTO
        await send_all(sock, answer.encode())
        raise AuthError(f"connection from {peer} refused: it presents no credentials")
    try:
        role = Role(hello.role)
    except ValueError:
        answer.status, answer.transport = 2, Transport.AUTO
        await send_all(sock, answer.encode())
        raise AuthError(f"connection from {peer} refused: unknown role {hello.role}") from None
    if role == Role.NODE and not hello.identity:
        answer.status, answer.transport = 2, Transport.AUTO
        await send_all(sock, answer.encode())
        raise AuthError(f"connection from {peer} refused: role node without an identity")
    # a client naming a volume proves that volume's key (derived here from the secret), not K_client: the
    # name is in the transcript, so a key for one volume cannot claim another.  (A HOST:PORT identity on a
    # client's hello proves nothing and is ignored, as it always was.)
    volume = hello.identity if role == Role.CLIENT and ":" not in hello.identity else ""
    key = volume_key(creds.key(Role.ADMIN), volume) if volume else creds.key(role)
    if version >= SESSIONS_SINCE:
        if hello.server != me:        # the caller meant another node: its hello was relayed (or misaddressed)
            answer.status, answer.transport, answer.identity = STATUS_NOT_DIALED, Transport.AUTO, me
            await send_all(sock, answer.encode())
            raise AuthError(f"connection from {peer} refused: it dialed {hello.server or '(no node named)'}, "
                            f"this node is {me} (a relayed hello, or a wrong address)")
        if len(hello.kx) != KX_SIZE:
            answer.status, answer.transport = STATUS_NO_SHARE, Transport.AUTO
            await send_all(sock, answer.encode())
            raise AuthError(f"connection from {peer} refused: {_status(STATUS_NO_SHARE)}")
        # until the caller has proven its key the node does only HMACs: the key exchange and the signature
        # come after, and its key share is reused for a while (a caller without a key costs it no more work)
        share = _server_share()
        answer.kx = share.public
        text = session_transcript(int(role), hello.nonce, answer.nonce, hello.identity, me, hello.kx, share.public,
                                  (hello.min_version, hello.version), (MIN_VERSION, VERSION))
    else:
        if VERSION >= SESSIONS_SINCE and speaks_sessions(hello.nonce):
            answer.status, answer.transport = STATUS_DOWNGRADE, Transport.AUTO
            await send_all(sock, answer.encode())
            raise AuthError(f"connection from {peer} refused: its hello speaks authenticated sessions but offers "
                            f"protocol {hello.version} at most: altered on the way (a downgrade)")
        text = transcript(int(role), hello.nonce, answer.nonce, hello.identity)
    answer.auth, answer.proof = True, proof(key, b"server", text)
    await send_all(sock, answer.encode())
    got = AuthProof.decode(await _read(sock, AuthProof.SIZE))
    if not hmac.compare_digest(got, proof(key, b"client", text)):
        await send_all(sock, AuthVerdict.encode(4))
        raise AuthError(f"connection from {peer} refused: bad proof for role {role.name.lower()} "
                        f"(wrong secret or role key)")
    identity = hello.identity if role == Role.NODE else volume
    status = admit(role, identity) if admit is not None else 0
    if status:
        await send_all(sock, AuthVerdict.encode(status))
        raise NotAdmitted(f"connection from {peer} ({role.name.lower()}) refused: {_status(status)}")
    if version < SESSIONS_SINCE:
        await send_all(sock, AuthVerdict.encode(0))
        return role, identity, None
    try:
        keys = session_keys(key, text, share.shared(hello.kx))
    except ValueError as e:                # a share that is no point of the curve's group (low order)
        await send_all(sock, AuthVerdict.encode(STATUS_NO_SHARE))
        raise AuthError(f"connection from {peer} refused: {e}") from None
    signer = _signer(creds, me)
    await send_all(sock, AuthVerdict.encode(0) + NodeProof.encode(signer.cert, signer.sign(text)))
    return role, identity, keys


@asynccontextmanager
async def accept(sock, peer: str, domain: Domain, *, transport: str = "auto", slots: int = DEFAULT_SLOTS,
                 timeout: float = 5.0, auth: ServerAuth | None = None, admit=None,
                 hold=None) -> AsyncIterator[Connection]:
    """The server side of ``dial`` on an accepted socket.  ``timeout`` bounds the whole hello (a peer that
    does not complete it in time is dropped).  ``admit``: see ``_authenticate`` (called once the peer's role
    is proven, or, without authentication, once its hello is read).  ``hold(conn)``: awaited after the hello
    (outside its deadline), before the connection reads anything of the peer's (e.g. a reconnect penalty)."""
    tune_socket(sock, domain.options.tcp_congestion)
    creds = auth.creds if auth is not None else None
    with trio.fail_after(timeout):
        secure = False
        if auth is not None and auth.tls is not None and await tls.starts_tls(sock):
            sock = await tls.wrap(sock, auth.tls, server_side=True)
            secure = True
        hello = await _read_hello(sock)
        if auth is not None and auth.tls_required and not secure:
            await refuse(sock, domain, slots, 6)
            raise AuthError(f"connection from {peer} refused: plaintext, and this node requires TLS")
        version = _version(hello)
        if version is None:
            await refuse(sock, domain, slots, STATUS_VERSION)      # (its hello carries our range)
            theirs = (hello.min_version, hello.version)
            raise NegotiationError(f"refused: {version_refusal(theirs, 'this node speaks')}")
        mine = TRANSPORT_NAMES[transport]
        device = has_device(domain) and not secure           # a TLS connection stays on TCP
        try:
            chosen = choose(mine, hello.transport, device, hello.has_device)
        except NegotiationError as e:
            await refuse(sock, domain, slots, 0)
            raise NegotiationError(f"connection from {peer}: {e}") from None
        # on verbs our slots take a small WRITE's payload after its header (the peer SENDs it inline)
        slot_size = verbs_slot_size(domain) if chosen == Transport.VERBS else HEADER_SIZE
        # a node that speaks sessions marks its nonce: a caller that gets it at an older protocol was downgraded
        answer = Hello(transport=chosen, has_device=device, slots=slots, slot_size=slot_size,
                       nonce=(session_nonce() if VERSION >= SESSIONS_SINCE else new_nonce()) if creds else bytes(32),
                       software=software())
        me = (auth.identity if auth is not None else "") or _local_identity(sock)
        role, identity, keys = await _authenticate(sock, peer, hello, creds, answer, admit,
                                                   auth is not None and auth.transition, version, me)
        conn: Connection | None = None
        if chosen == Transport.VERBS:
            conn = await _upgrade(sock, domain, peer, True, hello.slots, slots, hello.slot_size, slot_size)
        if conn is None:
            conn = TcpConnection(sock, domain, peer, hello.slots, slots)
        conn.role, conn.identity, conn.tls = role, identity, secure
        conn.volume = identity if role == Role.CLIENT else ""     # proven: scopes it (datanode/ops/admit.py)
        conn.version, conn.peer_software = version, hello.software
        if keys is not None:
            conn.bind_session(Session(keys[1], keys[0]))
    log.debug("connection from %s on %s%s (role %s, protocol %d, %s)", peer, conn.transport,
              "+tls" if secure else "", role.name.lower() if role is not None else "unauthenticated", version,
              hello.software or "software unknown")
    if hold is not None:        # before anything of the peer's is read: what it sends waits in the kernel
        try:
            await hold(conn)
        except BaseException:
            await conn.aclose()
            raise
    async with _running(conn) as c:
        yield c


SHARE_REUSE_S = 60.0      # a node's key share serves the hellos of this long (the sessions' keys differ: nonces)
_share: list = [None, 0.0]


def _server_share() -> KeyShare:
    now = time.monotonic()
    if _share[0] is None or now - _share[1] > SHARE_REUSE_S:
        _share[:] = [KeyShare(), now]
    return _share[0]


@functools.lru_cache(maxsize=16)
def _signer(creds: Credentials, identity: str) -> NodeSigner:
    """This node's key and certificate for ``identity`` (made once: two Ed25519 key derivations and a
    signature)."""
    return creds.node_signer(identity)


def _local_identity(sock) -> str:
    """HOST:PORT this connection was accepted on (a node without a configured identity)."""
    try:
        host, port = sock.getsockname()[:2]
    except (OSError, AttributeError):
        return ""
    return f"{host}:{port}"


def verbs_slot_size(domain: Domain) -> int:
    """The receive slot size a verbs server offers: a header, and the device's inline payload limit."""
    dev = getattr(domain, "device", None)
    return HEADER_SIZE + (getattr(dev, "inline_max", 0) or 0)


def make_domain(transport: str = "auto", options: TransportOptions | None = None) -> Domain:
    """A Domain for this process, set up by ``options`` (default: TransportOptions()), with its RDMA device
    (``options.rdma_device``, else the first active one) attached when ``transport`` allows verbs and the
    device is usable.  ``transport = verbs`` without a usable device raises TransportError."""
    domain = Domain(options)
    if transport == TransportChoice.TCP:
        return domain
    try:
        from . import verbs
        verbs.attach(domain)
        log.info("RDMA device %s ready (gid index %d)", domain.device.name, domain.options.gid_index)
    except Exception as e:  # noqa: BLE001 - whatever the reason, this process has no verbs
        if transport == TransportChoice.VERBS:
            raise TransportError(f"transport 'verbs' needs a usable RDMA device: {e}") from None
        log.info("no usable RDMA device (%s); connections use TCP", e)
    return domain
