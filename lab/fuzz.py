"""Wire fuzzing of a live datanode, black box over the TCP transport.

A *case* is one connection played by a hostile or broken peer: random bytes instead of a hello, a hello and
then nothing, random frames, or a structurally valid request header with random fields whose one-sided ops
this peer then serves correctly, partly, wrongly or never -- and the connection ends at a random point, by
FIN, by RST or by going silent.  Every choice comes from a ``RandomDice`` on a seed: the soak
(``python -m lab fuzz --seed N --cases N``) and the suite's hypothesis test (which draws the case's kind, ending and
seed; the rest is not drawn from hypothesis directly, because later choices depend on what the node
answered, and a replay must draw the same).

After each batch, ``Checker.check`` asserts what a user would notice: the process is alive, a normal client
writes and reads back 1 MiB, the node's open connections and pool bytes are back at their baseline (within
``peer_timeout``), and its memory (RSS) does not grow batch after batch.

Only partitions ``FUZZ_PARTITIONS`` are ever created, updated or deleted by a case; the checker's partition is
left alone by the admin ops (data ops may hit it: appends to its extents are ordinary client behaviour).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import random
import socket
import struct
import tempfile
import time
import weakref

import click
import trio

from client.sdk import ClientError, DataClient
from wire.crc import crc32c
from wire.auth import (DialAuth, KeyShare, proof, session_keys, session_nonce, session_transcript,
                       transcript)
from wire.protocol import (HEADER_SIZE, HELLO_SIZE, HELLO_STATUS, MAX_EPOCH, MIN_VERSION, SESSIONS_SINCE, VERSION,
                           AuthProof, AuthVerdict, Flag, Header, Hello, NodeProof, Op, Result, Transport, decode,
                           decode_extensions, decode_hello)
from wire.session import Session
from wire.transport.tcp import CTRL, FRAME, READ_REQ, READ_RESP, WRITE_REQ, WRITE_RESP
from tools.clikit import ADDR, CTX, Command, ProgressLine, emit

FUZZ_PARTITIONS = range(1000, 1004)
CHECK_PARTITION = 1
KINDS = ("probe", "hello", "frames", "request")
ENDINGS = ("fin", "rst", "silent")
ADMIN_OPS = {Op.PARTITION_CREATE, Op.PARTITION_UPDATE, Op.PARTITION_DELETE, Op.TRUNCATE, Op.MARK_DELETE,
             Op.REPAIR, Op.SCRUB, Op.TRASH_LIST, Op.TRASH_RESTORE, Op.TRASH_PURGE}
SOCK_TIMEOUT = 0.1
# every opcode but the one an admin stops the node with (its checker needs the node alive)
FUZZ_OPS = [op for op in Op if op != Op.NODE_DRAIN]


# -- where the randomness comes from --------------------------------------------------------------------
class Dice:
    def int(self, lo: int, hi: int) -> int: ...
    def choice(self, seq): return seq[self.int(0, len(seq) - 1)]
    def bool(self, p_true: float = 0.5) -> bool: return self.int(0, 999) < p_true * 1000
    def bytes(self, n: int) -> bytes: ...


class RandomDice(Dice):
    def __init__(self, rng: random.Random):
        self.rng = rng

    def int(self, lo, hi):
        return self.rng.randint(lo, hi)

    def bytes(self, n):
        return self.rng.randbytes(n)


# -- a raw peer: we play the client's transport layer by hand ---------------------------------------------
def connect(addr: str, timeout: float = SOCK_TIMEOUT) -> socket.socket:
    host, _, port = addr.rpartition(":")
    s = socket.create_connection((host, int(port)), timeout=5)
    s.settimeout(timeout)
    return s


def end(sock: socket.socket, how: str) -> None:
    """End a connection: ``fin`` (orderly close), ``rst`` (abortive close) or ``silent`` (stop talking and
    close only after the node had time to notice nothing comes)."""
    with contextlib.suppress(OSError):
        if how == "rst":
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        elif how == "silent":
            time.sleep(SOCK_TIMEOUT)
        sock.close()


class Refused(ConnectionError):
    """The node refused our hello (the reason is HELLO_STATUS's sentence)."""


# the session of each raw connection that authenticated at a protocol with sessions (wire/session.py):
# ``send_ctrl`` MACs what it sends on it, ``recv_frame`` checks what it receives
_sessions: "weakref.WeakKeyDictionary[socket.socket, Session]" = weakref.WeakKeyDictionary()


def hello(sock: socket.socket, slots: int = 8, auth: DialAuth | None = None, server: str = "") -> Hello:
    """The client's side of the hello, by hand; with ``auth`` (credentials and role) the challenge-response
    too, naming ``server`` (default: the address dialed) as the node meant.  Raises Refused when the node says
    no."""
    key = auth.key if auth is not None else None
    share = KeyShare() if key else None
    nonce = session_nonce() if key else bytes(32)
    ident = auth.identity if auth is not None else ""
    role = int(auth.role) if auth is not None else 0
    server = server or "%s:%d" % sock.getpeername()[:2]
    sock.sendall(Hello(transport=Transport.TCP, has_device=False, slots=slots, auth=key is not None, role=role,
                       nonce=nonce, identity=ident, server=server if key else "",
                       kx=share.public if share else b"").encode())
    ans = decode_hello(recv_exactly(sock, HELLO_SIZE))
    if ans.ident_len or ans.ext_len:                  # its identity and extensions follow
        tail = recv_exactly(sock, ans.ident_len + ans.ext_len)
        decode_extensions(ans, tail[ans.ident_len:])
    if ans.status:
        raise Refused(HELLO_STATUS[ans.status] if ans.status < len(HELLO_STATUS) else str(ans.status))
    if key is not None and ans.auth:
        keys = None
        if ans.version >= SESSIONS_SINCE:
            text = session_transcript(role, nonce, ans.nonce, ident, server, share.public, ans.kx,
                                      (MIN_VERSION, VERSION), (ans.min_version, ans.version))
            keys = session_keys(key, text, share.shared(ans.kx))
        else:
            text = transcript(role, nonce, ans.nonce, ident)
        sock.sendall(AuthProof.encode(proof(key, b"client", text)))
        if keys is not None:
            _sessions[sock] = Session(keys[0], keys[1])
        verdict = AuthVerdict.decode(recv_exactly(sock, AuthVerdict.SIZE))
        if verdict:
            raise Refused(HELLO_STATUS[verdict] if verdict < len(HELLO_STATUS) else str(verdict))
        if keys is not None:
            NodeProof.decode(recv_exactly(sock, NodeProof.SIZE))      # (not checked: the node is ours)
    return ans


_TAG = struct.Struct(">QQ")


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("node closed the connection")
        buf += chunk
    return bytes(buf)


def ctrl_frame(sock: socket.socket, raw: bytes) -> bytes:
    """The next control frame to send on ``sock`` (with its session MAC, if it has a session)."""
    session = _sessions.get(sock)
    op = addr = 0
    if session is not None:
        op, addr = _TAG.unpack(session.seal(raw))
    return FRAME.pack(CTRL, 0, 0, len(raw), op, addr, 0, 0) + raw


def send_ctrl(sock: socket.socket, raw: bytes) -> None:
    sock.sendall(ctrl_frame(sock, raw))


def recv_frame(sock: socket.socket, *, body: bool = True):
    """(type, status, length, op, addr, rkey, payload) of the node's next frame (CTRL bodies read)."""
    ftype, status, _pad, length, op, addr, rkey, _r = FRAME.unpack(recv_exactly(sock, FRAME.size))
    payload = b""
    if body and (ftype == CTRL or ftype == WRITE_REQ or (ftype == READ_RESP and status == 0)):
        payload = recv_exactly(sock, length)
    session = _sessions.get(sock)
    if body and ftype == CTRL and session is not None:
        session.open(payload, _TAG.pack(op, addr))
    return ftype, status, length, op, addr, rkey, payload


def serve_until_answer(sock: socket.socket, buf: bytes, timeout: float = 10.0) -> Header:
    """Serve the node's one-sided READs of ``buf`` (and take its WRITEs) until the response arrives."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            ftype, status, length, op, addr, rkey, payload = recv_frame(sock)
        except socket.timeout:
            continue
        if ftype == READ_REQ:
            data = buf[:length].ljust(length, b"\0")
            sock.sendall(FRAME.pack(READ_RESP, 0, 0, length, op, 0, 0, 0) + data)
        elif ftype == WRITE_REQ:
            sock.sendall(FRAME.pack(WRITE_RESP, 0, 0, 0, op, 0, 0, 0))
        elif ftype == CTRL:
            return decode(payload, request=False)
    raise TimeoutError("no answer from the node")


def request(addr: str, h: Header, buf: bytes = b"", timeout: float = 10.0, auth: DialAuth | None = None) -> Header:
    """One request on a fresh raw connection, the peer's buffer ``buf`` served faithfully."""
    s = connect(addr)
    try:
        hello(s, auth=auth)
        send_ctrl(s, h.encode())
        return serve_until_answer(s, buf, timeout)
    finally:
        end(s, "fin")


# -- one case ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Target:
    addr: str
    epoch: int = 1                    # of CHECK_PARTITION
    extents: tuple = (1,)             # some extent ids that exist in CHECK_PARTITION
    max_block: int = 4 << 20


INTERESTING_U64 = (0, 1, 2, 3, 7, 1000, 4095, 4096, 131071, 131072, 131073, 1 << 20, 1 << 31, 1 << 32,
                   MAX_EPOCH, MAX_EPOCH + 1, (1 << 64) - 1)


def _u64(d: Dice, *common: int) -> int:
    pick = d.int(0, 3)
    if pick == 0 and common:
        return d.choice(common)
    if pick == 1:
        return d.choice(INTERESTING_U64)
    return d.int(0, (1 << 64) - 1) if pick == 2 else d.int(0, 1 << 20)


def _body(d: Dice) -> bytes:
    """An admin body: garbage, JSON of any shape, or a nearly valid view."""
    shape = d.int(0, 5)
    if shape == 0:
        return d.bytes(d.int(0, 64))
    if shape == 1:
        return json.dumps(d.choice(["x", None, 1, [1, 2], {"a": 1}, 2**70, -1.5, True])).encode()
    replicas = [d.choice(["127.0.0.1:1", "nohost", "h:0", "h:65536", "", None, 7, ["x"], "127.0.0.1:2",
                          "h:1", ":80", "a b:1", "x" * 300]) for _ in range(d.int(0, 4))]
    view: dict = {"replicas": replicas if shape != 2 else d.choice(["a:1", None, 3, {}]),
                  "epoch": d.choice([0, 1, 2, -1, 2**63, 2**64, "2", None, True, 1.5])}
    if shape == 3:
        view.pop(d.choice(["replicas", "epoch"]))
    return json.dumps(view).encode()


def _header(d: Dice, t: Target) -> tuple[Header, bytes]:
    op = d.choice(FUZZ_OPS)
    admin = op in ADMIN_OPS
    pid = d.choice(list(FUZZ_PARTITIONS)) if admin else d.choice([CHECK_PARTITION, FUZZ_PARTITIONS[0],
                                                                    _u64(d)])
    payload = b""
    if op in (Op.PARTITION_CREATE, Op.PARTITION_UPDATE):
        payload = _body(d)
    elif op == Op.WRITE:
        payload = d.bytes(d.choice([0, 1, 100, 4096, 131073, d.int(0, 1 << 20)]))
    length = len(payload) if d.bool(0.8) else d.choice([_u64(d) & 0xFFFFFFFF, t.max_block + 1, 64 << 20])
    rlen = d.choice([length, max(length - 1, 0), length + 1, _u64(d)]) & 0xFFFFFFFF
    h = Header(opcode=op, partition=pid, extent=d.choice([*t.extents, _u64(d)]), offset=_u64(d, 0),
               length=length, crc=crc32c(payload) if d.bool(0.8) else d.int(0, 0xFFFFFFFF),
               req_id=d.int(0, (1 << 64) - 1),
               epoch=d.choice([t.epoch, 1, 0, d.int(0, MAX_EPOCH)]) if d.bool(0.9) else MAX_EPOCH,
               addr=d.int(0, (1 << 64) - 1), rkey=d.int(0, 0xFFFFFFFF), rlen=rlen,
               flags=d.choice([0, int(Flag.FORWARDED), int(Flag.FORWARDED | Flag.REPAIR), d.int(0, 255)]))
    return h, payload


def _answer_read(sock: socket.socket, d: Dice, op_id: int, length: int, payload: bytes) -> bool:
    """Serve (or botch) one of the node's one-sided READs of our buffer; False: we ended the connection."""
    how = d.choice(["full", "full", "full", "partial", "refuse", "wrong_length", "never", "end"])
    data = payload[:length].ljust(length, b"\0") if length <= 8 << 20 else b""
    if how == "full" and len(data) == length:
        sock.sendall(FRAME.pack(READ_RESP, 0, 0, length, op_id, 0, 0, 0) + data)
    elif how == "partial":
        sock.sendall(FRAME.pack(READ_RESP, 0, 0, length, op_id, 0, 0, 0) + data[:d.int(0, len(data))])
        return False
    elif how == "refuse":
        sock.sendall(FRAME.pack(READ_RESP, d.int(1, 255), 0, 0, op_id, 0, 0, 0))
    elif how == "wrong_length":
        n = d.int(0, 2 * length + 1)
        sock.sendall(FRAME.pack(READ_RESP, 0, 0, n, op_id, 0, 0, 0) + bytes(n))
    elif how == "end":
        return False
    return True                        # "never": stay connected and silent for now


def play(addr: str, d: Dice, t: Target, kind: str | None = None, ending: str | None = None,
         auth: DialAuth | None = None) -> str:
    """One case against ``addr``.  Returns a short description (for the report).  Never raises for anything
    the node does (a closed or reset connection is an ordinary outcome); raises only on a local bug.
    ``auth``: how "frames" and "request" cases authenticate (mostly; one in ten tries without)."""
    if auth is not None and d.bool(0.1):
        auth = None
    kind = kind or d.choice(KINDS)
    ending = ending or d.choice(ENDINGS)
    try:
        s = connect(addr)
    except OSError as e:
        raise ConnectionError(f"cannot connect to {addr}: {e}") from None
    try:
        if kind == "probe":
            s.sendall(d.bytes(d.int(0, HELLO_SIZE + 8)))
        elif kind == "hello":
            raw = bytearray(Hello(transport=d.choice(list(Transport)), has_device=d.bool(),
                                  slots=d.choice([0, 1, 8, 64, 4097, d.int(0, 0xFFFFFFFF)])).encode())
            for _ in range(d.int(0, 3)):
                raw[d.int(0, len(raw) - 1)] = d.int(0, 255)
            s.sendall(raw[:d.int(0, len(raw))] if d.bool(0.3) else raw)
            if d.bool():
                s.recv(HELLO_SIZE)
        elif kind == "frames":
            hello(s, slots=d.int(1, 64), auth=auth)
            for _ in range(d.int(1, 6)):
                ftype = d.choice([CTRL, READ_REQ, READ_RESP, WRITE_REQ, WRITE_RESP, 0, 6, 255])
                length = d.choice([0, 1, HEADER_SIZE, 4096, 4097, d.int(0, 1 << 20), (1 << 32) - 1])
                frame = FRAME.pack(ftype, d.int(0, 255), 0, length, d.int(0, 100), _u64(d), d.int(0, 0xFFFFFFFF), 0)
                sent = min(length, d.choice([0, length, d.int(0, 1 << 16)])) if ftype in (CTRL, WRITE_REQ) else 0
                s.sendall(frame + d.bytes(min(sent, 1 << 16)))
        else:
            hello(s, slots=8, auth=auth)
            for _ in range(d.int(1, 3)):
                h, payload = _header(d, t)
                raw = bytearray(h.encode())
                if d.bool(0.1):                                   # a flipped bit behind a good CRC or not
                    raw[d.int(0, len(raw) - 1)] ^= 1 << d.int(0, 7)
                send_ctrl(s, bytes(raw[:d.int(0, len(raw))]) if d.bool(0.05) else bytes(raw))
                if not _converse(s, d, payload):
                    break
        kind = f"{kind}/{ending}"
    except (OSError, ConnectionError, ValueError) as e:   # the node closed or reset: fine
        kind = f"{kind}/closed-by-node({type(e).__name__})"
    finally:
        end(s, ending)
    return kind


def _converse(s: socket.socket, d: Dice, payload: bytes) -> bool:
    """Play the transport for one request until its answer (or until we decide to end); False: ended."""
    for _ in range(8):
        try:
            ftype, status, length, op_id, _a, _r, body = recv_frame(s, body=False)
        except socket.timeout:
            return d.bool(0.3)
        if ftype == READ_REQ:
            if not _answer_read(s, d, op_id, length, payload):
                return False
        elif ftype == WRITE_REQ:                   # the node pushes read data / a JSON answer to us
            take = length if d.bool(0.8) else d.int(0, length)
            recv_exactly(s, take)
            if take < length:
                return False
            if d.bool(0.9):
                s.sendall(FRAME.pack(WRITE_RESP, d.choice([0, 0, 0, 3]), 0, 0, op_id, 0, 0, 0))
        elif ftype == CTRL:
            recv_exactly(s, length)
            return True
        elif ftype == READ_RESP and status == 0:
            recv_exactly(s, length)
    return True


# -- after each batch: what a user would notice -------------------------------------------------------------
def rss_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class Checker:
    """A normal client of the node under fuzz: sets CHECK_PARTITION up, then checks health after batches."""

    def __init__(self, addr: str, *, settle: float = 15.0, secret=None):
        self.addr = addr
        self.secret = secret              # the cluster secret (file or Credentials) of an authenticating node
        self.settle = settle
        self.pid: int | None = None
        self.rss: list[int] = []
        self.round = 0

    def setup(self) -> Target:
        return trio.run(self._setup)

    def check(self) -> dict:
        """Raises AssertionError naming what a user would notice; returns the figures."""
        self.round += 1
        if self.pid is not None:
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                raise AssertionError(f"datanode {self.addr} (pid {self.pid}) is gone") from None
            except PermissionError:
                pass
        try:
            figures = trio.run(self._check)
        except ClientError as e:
            raise AssertionError(f"a normal client failed after the batch: {e}") from None
        rss = rss_kib(self.pid) if self.pid else None
        if rss is not None:
            self.rss.append(rss)
        return {**figures, "rss_kib": rss}

    async def _setup(self) -> Target:
        async with DataClient.from_env([], timeout=10.0, pool_mib=8, transport="tcp", secret=self.secret) as dc:
            try:
                await dc.admin(self.addr, Op.PARTITION_CREATE, partition=CHECK_PARTITION,
                               body={"replicas": [self.addr], "epoch": 1})
            except ClientError as e:
                if e.result != Result.EXISTS:
                    raise
            await dc.discover(self.addr)
            eid = await dc.create_extent(CHECK_PARTITION)
            st = await dc.admin(self.addr, Op.NODE_STATUS)
            self.pid = st["pid"]
            return Target(self.addr, epoch=dc.partition(CHECK_PARTITION).epoch, extents=(eid, eid + 1),
                          max_block=st["pool"]["max_block"])

    async def _check(self) -> dict:
        data = random.Random(self.round).randbytes(1 << 20)
        with trio.fail_after(self.settle + 30):           # a hang is a failure, not a wait
            async with DataClient.from_env([], timeout=10.0, pool_mib=8, transport="tcp", secret=self.secret) as dc:
                await dc.discover(self.addr)
                locs = await dc.write(CHECK_PARTITION, data)
                got = b"".join([await dc.read(CHECK_PARTITION, loc.extent, loc.offset, loc.length)
                                for loc in locs])
                assert got == data, "1 MiB read back differs from what was written"
                deadline = trio.current_time() + self.settle
                while True:
                    st = await dc.admin(self.addr, Op.NODE_STATUS)
                    conns, used = len(st["connections"]) - 1, st["pool"]["in_use_bytes"]   # -1: this client
                    if (conns <= 0 and used == 0) or trio.current_time() > deadline:
                        break
                    await trio.sleep(0.1)
        assert conns <= 0, f"{conns} connections left open on the node: {st['connections']}"
        assert used == 0, f"{used} pool bytes left in use on the node"
        return {"connections": conns, "pool_in_use": used}

    def rss_growth_kib(self) -> int:
        """RSS growth from the end of the first quarter of the run (allocator warm-up) to the end."""
        if len(self.rss) < 4:
            return 0
        return self.rss[-1] - self.rss[len(self.rss) // 4]


def soak(addr: str, *, seed: int, cases: int, batch: int = 500, parallel: int = 4, on_batch=None,
         secret=None) -> dict:
    """``cases`` seeded cases in batches (``parallel`` peers at once), a health check after each batch.
    Returns the figures; raises AssertionError at the first batch after which the node is not healthy.
    ``secret``: the node's cluster secret file; cases then authenticate as ``client`` (some do not)."""
    from concurrent.futures import ThreadPoolExecutor

    from wire.auth import Credentials
    from wire.protocol import Role
    auth = DialAuth(Credentials.load(secret), Role.CLIENT) if secret else None
    checker = Checker(addr, secret=secret)
    target = checker.setup()
    checker.check()
    kinds: dict[str, int] = {}
    t0 = time.monotonic()
    done = 0

    def worker(i: int, n: int) -> list[str]:
        rng = random.Random(f"{seed}/{done}/{i}")
        return [play(addr, RandomDice(rng), target, auth=auth) for _ in range(n)]

    with ThreadPoolExecutor(parallel) as ex:
        while done < cases:
            n = min(batch, cases - done)
            shares = [n // parallel + (1 if i < n % parallel else 0) for i in range(parallel)]
            for result in ex.map(worker, range(parallel), shares):
                for k in result:
                    kinds[k.split("/")[0]] = kinds.get(k.split("/")[0], 0) + 1
            done += n
            figures = checker.check()
            if on_batch:
                on_batch(done, figures)
    return {"cases": done, "seed": seed, "seconds": round(time.monotonic() - t0, 1), "kinds": kinds,
            "crashes": 0, "hangs": 0, "leftover_connections": 0, "leftover_pool_bytes": 0,
            "rss_kib_first": checker.rss[0] if checker.rss else None,
            "rss_kib_last": checker.rss[-1] if checker.rss else None,
            "rss_growth_kib": checker.rss_growth_kib(), "checks": checker.round}


@contextlib.contextmanager
def scratch_node(root, **cfg):
    """A throw-away single datanode under ``root`` (TCP, short peer timeout) for a soak; yields its address."""
    from tools.cluster import NodeProc, free_port
    node = NodeProc(pathlib.Path(root), f"127.0.0.1:{free_port()}",
                    **{"pool_mib": 64, "transport": "tcp", "peer_timeout": 2.0, "payload_timeout": 2.0,
                       "sync": "none", "penalty_max_s": 0.0, **cfg})
    node.start()
    try:
        yield node
    finally:
        node.stop()


def summary(res: dict) -> str:
    kinds = ", ".join(f"{k} {n}" for k, n in sorted(res["kinds"].items()))
    return (f"{res['cases']} cases (seed {res['seed']}: {kinds}) in {res['seconds']}s, {res['checks']} health "
            f"checks: 0 crashes, 0 hangs, 0 connections and 0 pool bytes left behind; RSS "
            f"{res['rss_kib_first']} -> {res['rss_kib_last']} KiB (growth after warm-up {res['rss_growth_kib']} KiB)")


@click.command("fuzz", cls=Command, context_settings=CTX)
@click.option("--node", "addr", type=ADDR, help="A running datanode to fuzz (default: a scratch node of its own).")
@click.option("--seed", type=int, default=1, show_default=True, help="Seed: the same seed plays the same cases.")
@click.option("--cases", type=click.IntRange(1), default=10_000, show_default=True)
@click.option("--batch", type=click.IntRange(1), default=1000, show_default=True,
              help="Cases between two health checks.")
@click.option("--parallel", type=click.IntRange(1, 64), default=4, show_default=True, help="Peers at once.")
@click.option("--auth", is_flag=True,
              help="The scratch node holds a fresh cluster secret and the cases authenticate as 'client' (one in "
                   "ten with none); with --node, give the node's secret with dnctl --secret-file.")
@click.option("--json", "as_json", is_flag=True)
def fuzz_command(addr, seed, cases, batch, parallel, auth, as_json):
    """Wire fuzz soak: broken and hostile peers (random bytes, cut hellos, random frames, valid headers with
    random fields, one-sided ops served partly, wrongly or never, FIN/RST at every point) against a live
    datanode; after each batch the node must be alive, round-trip 1 MiB for a normal client, and hold no
    leftover connection, pool byte or memory.  Exit status 1 at the first batch where it does not.

    Admin ops only touch partitions 1000-1003 (and create partition 1 if missing): do not point it at a
    production node.

    \b
    python -m lab fuzz --seed 7 --cases 100000
    python -m lab fuzz --node 127.0.0.1:17310 --cases 5000 --json
    """
    line = ProgressLine()

    def progress(done, fig):
        line.update(f"fuzz {done}/{cases} cases: {fig['connections']} connections, {fig['pool_in_use']} pool "
                    f"bytes left, RSS {fig['rss_kib']} KiB")

    try:
        if addr:
            secret = os.environ.get("DATANODE_SECRET_FILE") or None      # dnctl --secret-file sets it
            res = soak(addr, seed=seed, cases=cases, batch=batch, parallel=parallel, on_batch=progress,
                       secret=secret)
        else:
            with tempfile.TemporaryDirectory(prefix="dnfuzz-") as d:
                extra = {}
                if auth:
                    from wire.auth import gen_secret
                    secret = os.path.join(d, "cluster.secret")
                    with open(secret, "w", opener=lambda p, f: os.open(p, f, 0o600)) as f:
                        f.write(gen_secret())
                    extra["secret_file"] = secret
                with scratch_node(d, **extra) as node:
                    res = soak(node.addr, seed=seed, cases=cases, batch=batch, parallel=parallel,
                               on_batch=progress, secret=extra.get("secret_file"))
                    res["auth"] = bool(auth)
                    res["tracebacks_in_log"] = node.log_path.read_text(errors="replace").count("Traceback")
                    # is RSS growth data?  the extents the cases created (each holds open files and entries)
                    res["extents_on_disk"] = sum(1 for _ in pathlib.Path(d).rglob("extents/*.dat"))
    except AssertionError as e:
        line.close()
        raise click.ClickException(f"the node failed a health check (seed {seed}): {e}") from None
    line.close()
    emit(res, as_json, summary(res))
