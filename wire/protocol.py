"""The wire protocol: a pure codec (no I/O), in the spirit of h11.

Every request and every response is one fixed-size header (``HEADER_SIZE`` bytes, big-endian), sent as one
message into one of the receiver's preposted control slots (RDMA SEND, or a control frame on TCP).
A payload normally does not travel inside a control message: a header *names* a buffer of its sender
(``addr``, ``rkey``, ``rlen``) and the receiver moves the bytes with a one-sided operation (RDMA READ to
fetch a write payload, RDMA WRITE to push read data or a JSON answer) -- the "rendezvous" way.  Admin
requests and answers (partition create, stats) use the same mechanism with a JSON body.  The one exception
is the "eager" way for a *small WRITE* on a transport whose control messages can carry it
(``Connection.max_inline``; TCP): the header has ``Flag.INLINE``, names no buffer, and its ``length``
payload bytes follow it in the same control message (``encode_message`` / ``decode_message``), saving the
round trip of the READ.  Large payloads always take the READ.

Layout (88 bytes):

    off size field
      0   2  magic      0xDA7A
      2   1  version    the connection's protocol version (its hello chose it)
      3   1  opcode     Op
      4   1  result     Result (0 in requests)
      5   1  flags      Flag bits
      6   2  pad        must be 0
      8   8  partition  data partition id
     16   8  extent     extent id
     24   8  offset     byte offset in the extent
     32   4  length     payload length
     36   4  crc        CRC32C of the payload
     40   8  req_id     request id, echoed by the response
     48   8  epoch      partition epoch of the sender's view; stale epochs are refused
     56   8  addr       remote descriptor: address of the sender's buffer
     64   4  rkey       remote descriptor: key of the region holding it
     68   4  rlen       remote descriptor: bytes exposed at addr
     72   8  arg        op specific (a response's arg: see ``Result``: extent end, failed replicas, ...)
     80   4  reserved   must be 0
     84   4  hcrc       CRC32C of bytes 0..83
"""
from __future__ import annotations

import dataclasses
import enum
import operator
import struct

from . import limits
from .crc import crc32c

MAGIC = 0xDA7A
# The protocol versions this build speaks, oldest to newest.  Each connection uses the highest both ends speak
# (the hello carries each end's range); every header on it carries that number.  What may change within a
# version and what needs a new one: docs/architecture.md, "Versions and skew".
VERSION = 11     # 2: BAD_REQUEST split into one result code per condition; 3: authenticated hello, roles;
                 # 4: small WRITE payloads inline (Flag.INLINE); 5: the hello carries a version range and
                 # extensions; 6: NODE_DRAIN; 7: volumes (PARTITION_CREATE's "volume", BAD_BODY bad_volume);
                 # 8: NODE_HEALTH, MAP_READ; 9: authenticated sessions (the hello names the node dialed and
                 # exchanges key shares; every control message carries a MAC: wire/session.py);
                 # 10: PARTITION_UPDATE_MANY; 11: REPLICA_STATES
MIN_VERSION = 5  # 4 and older send one version and accept only their own: no range to meet them in
SESSIONS_SINCE = 9  # an authenticated connection of this version or newer is a session (wire/auth.py)
HEADER_SIZE = 88
MAX_EXTENT = 128 << 20         # an extent is append-only, up to this size
MAX_PAYLOAD = 64 << 20          # no single request moves more than this
INLINE_MAX = 128 << 10          # an inline (eager) payload is at most this; larger ones take the READ (bench sweep: pays at 4-128 KiB)
_FMT = struct.Struct(">HBBBBHQQQIIQQQIIQI")  # everything but hcrc
assert _FMT.size + 4 == HEADER_SIZE
_U32 = struct.Struct(">I")


# Why a header was refused as malformed; a PROTOCOL result carries the index of the reason in ``arg``.
PROTOCOL_REASONS = ["other", "truncated", "oversized", "bad_magic", "bad_header_crc", "bad_version",
                    "bad_reserved", "unknown_opcode", "bad_result", "absurd_length", "short_buffer",
                    "field_range", "bad_transport", "bad_slots", "bad_inline", "inline_length"]


class ProtocolError(Exception):
    """Anything malformed on the wire. ``reason`` is one of PROTOCOL_REASONS."""

    def __init__(self, reason: str, detail: str = ""):
        assert reason in PROTOCOL_REASONS, reason
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}" if detail else reason)


class Op(enum.IntEnum):
    CREATE_EXTENT = 0x01
    MARK_DELETE = 0x02
    WRITE = 0x03
    READ = 0x04
    WATERMARKS = 0x07        # answer: JSON {extent_id: size} pushed into the request's buffer
    # -- repair and scrub (datanode/repair.py) --
    BLOCK_CRCS = 0x08        # answer: JSON {"size": n, "blocks": [[crc, covered], ...]} of one extent
    TRUNCATE = 0x09          # leader -> follower (FORWARDED): cut extent back to ``offset`` bytes
    REPLICA_STATE = 0x0A     # answer: JSON {"epoch", "replicas", "marks": {id: size}, "deleted": [ids]}
    SCRUB_EXTENT = 0x0B      # re-read every block of one extent, check CRCs; answer JSON {"size", "bad"}
    NODE_HEALTH = 0x0C       # a leader's one probe of a follower node per heartbeat: answer JSON {"tokens":
                             #   [[partition, token], ...], "next": id or null}, one change token for each
                             #   partition hosted there that the requester leads in its view, ids from ``arg``
                             #   up, at most a page (datanode/health.py)
    REPLICA_STATES = 0x0D    # REPLICA_STATE of many partitions in one answer (a failover or a hand-off checks
                             #   hundreds of new leaders at once): those of ids ``partition`` + i for each bit i
                             #   set in ``arg`` (a window of STATES_WINDOW ids); answer JSON {"states": {id:
                             #   REPLICA_STATE's answer}, "absent": [ids not hosted], "left": [ids that did not
                             #   fit the buffer: ask again]}; never a leader's confirmation
    PING = 0x10
    PARTITION_CREATE = 0x20  # body: JSON {"replicas": [...], "epoch": n[, "volume": name]} from the request's buffer
    PARTITION_LIST = 0x21    # answer: JSON list
    PARTITION_UPDATE = 0x22  # body: JSON {"replicas": [...], "epoch": n}; new epoch must be higher
    PARTITION_DELETE = 0x23
    POOL_STATS = 0x30        # answer: JSON
    NODE_STATUS = 0x31       # answer: JSON
    NODE_DRAIN = 0x32        # stop as on SIGTERM (hand off, finish in-flight, leave etcd, exit).  Request arg
                             #   0: answered once the node has stopped taking requests, with the drain's
                             #   report (JSON); 1: answered at once, arg = 1 if it was stopping already
    PARTITION_HEALTH = 0x24  # answer: JSON, the leader's view of its replicas, repair and scrub progress;
                             #   partition 0: {"partitions": {id: [epoch, {follower: state}, repairing]}} of
                             #   every partition it leads (HEALTH_SUMMARY_SINCE)
    REPAIR = 0x25            # ask the leader for a full repair pass now; arg in the answer = pass number
    SCRUB = 0x26             # ask the leader for a scrub pass now; arg in the answer = pass number
    # -- the trash of deleted partitions (datanode/partition.py), admin only --
    TRASH_LIST = 0x27        # answer: JSON [{"name", "partition", "deleted", "bytes", "purge_in_s"}]
    TRASH_RESTORE = 0x28     # body: JSON {"name": entry}; answer arg = the partition restored (now served)
    TRASH_PURGE = 0x29       # body: JSON {"names": [entry...]} | {"expired": true} | {"all": true};
                             #   answer arg = entries purged
    # -- the cluster map as a node holds it (datanode/mapcopy.py), for clients that need not each ask etcd --
    MAP_READ = 0x2A          # offset = an etcd revision; arg = how long to wait (ms) while nothing changed after
                             #   it; answer: JSON {"ready", "fresh", "rev", "more", "entries": [[key, value, mod_rev]]},
                             #   the ``parts/`` entries changed after ``offset`` as etcd holds them (sealed)
    PARTITION_UPDATE_MANY = 0x2B  # body: JSON {"views": [{"partition": id, "replicas": [...], "epoch": n}, ...]},
                             #   at most limits.MAX_VIEWS_PER_UPDATE, ids distinct: each installed as by
                             #   PARTITION_UPDATE, all made durable together before the answer; answer arg =
                             #   bitmask of the entries (by index) NOT installed -- ask those one at a time
                             #   (PARTITION_UPDATE) to learn why.  A view already held counts as installed.


class Result(enum.IntEnum):
    """One code per condition; what ``arg`` carries in the response is given for each."""
    OK = 0xF0
    NOT_LEADER = 0xF2           # this replica is not the partition's leader (or may not be: self-fenced, etcdmap.py)
    REPLICATION_FAILED = 0xF3   # followers down, slow or said no; arg = bitmask of their replica indexes
    WRONG_OFFSET = 0xF4         # an append not at the extent's end; arg = the extent's end
    CRC_MISMATCH = 0xF5         # bytes fail their CRC32C (a payload in transit, or a stored block on read)
    NOT_FOUND = 0xF6            # partition or extent does not exist (or was deleted)
    DISK_ERROR = 0xF7           # the disk failed an I/O (EIO, a failed fsync, a broken extent; the data dir is gone)
    ERROR = 0xF8                # a bug on the node (logged there with its traceback)
    RETRY = 0xF9                # transient: the node is starting or shutting down; try again
    NO_SPACE = 0xFA             # the node's disk is full (ENOSPC)
    STALE_EPOCH = 0xFB          # arg = the receiver's epoch
    DIVERGED = 0xFC             # replicas of this extent disagree: no more appends; use a new extent
    REMOTE_ACCESS = 0xFD        # the one-sided op on the sender's buffer failed (rkey, bounds, rights)
    PROTOCOL = 0xFE             # malformed header; arg = index in PROTOCOL_REASONS
    EXISTS = 0xE1               # the partition (arg = its epoch) or extent (arg = its id) already exists
    TOO_LARGE = 0xE2            # more than a limit allows; arg = the limit (max block, max extent size)
    OUT_OF_RANGE = 0xE3         # a read or truncate beyond the extent's end; arg = the extent's size
    SHORT_BUFFER = 0xE4         # the requester's buffer cannot hold the answer; arg = bytes needed
    BAD_BODY = 0xE5             # an admin request's JSON body is malformed; arg = index in BODY_REASONS
    WRONG_ROLE = 0xE6           # an op this replica does not take in its role (e.g. TRUNCATE on a leader)
    POOL_BUSY = 0xE7            # no pool block free within pool_wait (transient: back off and retry)
    FORBIDDEN = 0xE8            # the connection's authenticated role (or node identity) may not do this
    BUSY = 0xE9                 # this connection is over its share (pool bytes held, or requests in flight:
                                #   arg = max_inflight): retry after some finish
    LAST_COPY = 0xEA            # a view change refused: its leader is not known to hold every acknowledged byte
                                #   (it would leave no copy that does); arg = the receiver's epoch
    CONFIRM = 0xEB              # a destructive request needs its confirmation: send it again with this token
                                #   (arg; valid for a short while, for what was asked then, from this peer)
    PAYLOAD_TIMEOUT = 0xEC      # the request's payload (the node's one-sided READ of the sender's buffer) was
                                #   not served within payload_timeout: the request failed, the connection is closed


# Why an admin request's JSON body was refused; a BAD_BODY result carries the index in ``arg``.
BODY_REASONS = ["other", "missing", "too_large", "not_json", "not_an_object", "replicas_not_a_list",
                "replicas_empty", "too_many_replicas", "replica_not_an_address", "replicas_not_distinct",
                "epoch_not_an_integer", "epoch_out_of_range", "not_a_member", "unknown_key", "bad_trash_name",
                "purge_choice", "bad_volume"]     # appended only: a BAD_BODY's arg indexes this list


class Flag:
    """Header flag bits.  Plain ints, not an ``enum.IntFlag``: they are tested several times per request, and
    each IntFlag operator costs about a microsecond (an enum lookup) where an int's costs nothing."""
    NONE = 0
    FORWARDED = 0x01    # leader -> follower: this is a replica write, do not forward further
    ANY_REPLICA = 0x02  # read: served by any replica (without it, only the leader serves reads)
    REPAIR = 0x04       # forwarded by the leader's repair: applies to a sealed extent on the follower too
    INLINE = 0x08       # WRITE: the payload follows the header in the same control message (no buffer named)


class Role(enum.IntEnum):
    """Who authenticated a connection (in the hello), proven with the role's key (wire/auth.py)."""
    CLIENT = 1      # data ops: the hosts that mount
    NODE = 2        # another datanode: forwarded writes, repair, truncate, pushing a view it leads
    ADMIN = 3       # partition create/update/delete, replica changes, repair/scrub requests (and data ops)


_ANY = frozenset(Role)
_DATA = frozenset({Role.CLIENT, Role.ADMIN})
# The roles each opcode accepts (without FORWARDED; a forwarded request needs NODE, whatever the opcode).
OP_ROLES: dict[Op, frozenset] = {
    Op.PING: _ANY, Op.READ: _ANY, Op.WATERMARKS: _ANY, Op.PARTITION_LIST: _ANY, Op.NODE_STATUS: _ANY,
    Op.POOL_STATS: _ANY, Op.PARTITION_HEALTH: _ANY, Op.MAP_READ: _DATA,
    Op.WRITE: _DATA, Op.CREATE_EXTENT: _DATA, Op.MARK_DELETE: _DATA,
    Op.TRUNCATE: frozenset({Role.NODE}),
    Op.REPLICA_STATE: frozenset({Role.NODE, Role.ADMIN}), Op.BLOCK_CRCS: frozenset({Role.NODE, Role.ADMIN}),
    Op.SCRUB_EXTENT: frozenset({Role.NODE, Role.ADMIN}), Op.NODE_HEALTH: frozenset({Role.NODE, Role.ADMIN}),
    Op.REPLICA_STATES: frozenset({Role.NODE, Role.ADMIN}),
    Op.PARTITION_CREATE: frozenset({Role.ADMIN}), Op.PARTITION_DELETE: frozenset({Role.ADMIN}),
    Op.REPAIR: frozenset({Role.ADMIN}), Op.SCRUB: frozenset({Role.ADMIN}),
    Op.TRASH_LIST: frozenset({Role.ADMIN}), Op.TRASH_RESTORE: frozenset({Role.ADMIN}),
    Op.TRASH_PURGE: frozenset({Role.ADMIN}), Op.NODE_DRAIN: frozenset({Role.ADMIN}),
    # a node may push only a view in which it is the leader (checked by the handler)
    Op.PARTITION_UPDATE: frozenset({Role.ADMIN, Role.NODE}),
    Op.PARTITION_UPDATE_MANY: frozenset({Role.ADMIN}),
}
assert set(OP_ROLES) == set(Op), "every opcode declares its roles"
# opcodes newer than MIN_VERSION, with the version that brought them: sent only on connections of that
# version or newer (an older peer refuses them as unknown)
OP_SINCE: dict[Op, int] = {Op.NODE_DRAIN: 6, Op.NODE_HEALTH: 8, Op.MAP_READ: 8, Op.PARTITION_UPDATE_MANY: 10,
                           Op.REPLICA_STATES: 11}
# a PARTITION_CREATE naming a volume goes only to nodes of this version or newer: an older one would drop the
# key and make a copy in no volume (client/admin.py refuses instead).  A client's hello naming a volume needs
# such a node too -- an older one drops that hello, which names no HOST:PORT -- but it is sent before any
# version is agreed: the dialer says so in its error (transport/connect.py).
VOLUMES_SINCE = 7
# PARTITION_HEALTH of partition 0 -- every partition the node leads, in short (its replicas' states) -- goes
# only to nodes of this version or newer (an older one answers NOT_FOUND)
HEALTH_SUMMARY_SINCE = 11
STATES_WINDOW = 64       # the partition ids one REPLICA_STATES names: a bit each in the header's ``arg``
ADMIN_ACTIONS = frozenset({Op.PARTITION_CREATE, Op.PARTITION_UPDATE, Op.PARTITION_DELETE, Op.REPAIR, Op.SCRUB,
                           Op.TRASH_LIST, Op.TRASH_RESTORE, Op.TRASH_PURGE, Op.NODE_DRAIN,
                           Op.PARTITION_UPDATE_MANY})


_NODE_ONLY = frozenset({Role.NODE})


def roles_for(h: "Header") -> frozenset:
    """The roles that may send ``h`` (a decoded request)."""
    if h.flags & Flag.FORWARDED:
        return _NODE_ONLY
    return OP_ROLES[h.opcode]


# What a request is allowed to carry.  Checked by decode so handlers see only sane headers:
# these ops move ``length`` bytes through the requester's buffer, so it must expose at least that many.
# admin ops whose JSON body the node fetches from the requester's buffer (one-sided READ)
BODY_OPS = frozenset({Op.PARTITION_CREATE, Op.PARTITION_UPDATE, Op.PARTITION_UPDATE_MANY, Op.TRASH_RESTORE,
                      Op.TRASH_PURGE})
_LENGTH_IN_BUFFER = frozenset({Op.WRITE, Op.READ, *BODY_OPS})
MAX_EPOCH = (1 << 63) - 1
DEFAULT_RESULT_TEXT = {
    Result.OK: "ok",
    Result.NOT_LEADER: "this node is not the partition's leader",
    Result.REPLICATION_FAILED: "replication to a follower failed",
    Result.WRONG_OFFSET: "append not at the extent's end",
    Result.CRC_MISMATCH: "CRC mismatch",
    Result.NOT_FOUND: "not found",
    Result.DISK_ERROR: "disk error",
    Result.ERROR: "internal error on the node (see its log)",
    Result.RETRY: "node busy starting or stopping: retry",
    Result.NO_SPACE: "no space left on the node's disk",
    Result.STALE_EPOCH: "stale partition epoch",
    Result.DIVERGED: "extent replicas diverged; write to a new extent",
    Result.REMOTE_ACCESS: "remote buffer access refused (rkey/bounds/rights)",
    Result.PROTOCOL: "malformed header",
    Result.EXISTS: "already exists",
    Result.TOO_LARGE: "too large",
    Result.OUT_OF_RANGE: "beyond the end of the extent",
    Result.SHORT_BUFFER: "buffer too small for the answer",
    Result.BAD_BODY: "malformed request body",
    Result.WRONG_ROLE: "not allowed in this replica's role",
    Result.POOL_BUSY: "node's buffer pool is busy: retry",
    Result.FORBIDDEN: "forbidden: this connection's role (or volume key) may not do that",
    Result.BUSY: "this connection is over its share of the node (pool bytes held or requests in flight): "
                 "retry when earlier requests finish",
    Result.LAST_COPY: "refused: the new view's leader is not known to hold every acknowledged byte "
                      "(it would leave no copy that does)",
    Result.CONFIRM: "needs confirmation: send the request again with the token the node gave",
    Result.PAYLOAD_TIMEOUT: "the node's read of this request's payload was not served in time (payload_timeout): "
                            "the request failed and the connection was closed",
}
# What a response's ``arg`` means, per result (for the human sentence).
_ARG_TEXT = {
    Result.WRONG_OFFSET: "the extent ends at {}",
    Result.STALE_EPOCH: "the node is at epoch {}",
    Result.EXISTS: "existing: {}",
    Result.TOO_LARGE: "the limit is {}",
    Result.OUT_OF_RANGE: "the extent holds {} bytes",
    Result.SHORT_BUFFER: "{} bytes needed",
    Result.LAST_COPY: "the node is at epoch {}",
}


@dataclasses.dataclass(frozen=True, slots=True)
class Header:
    """One request or response.  Immutable: derive copies with ``reply``, ``forwarded`` or
    ``dataclasses.replace``."""
    opcode: int
    partition: int = 0
    extent: int = 0
    offset: int = 0
    length: int = 0
    crc: int = 0
    req_id: int = 0
    epoch: int = 0
    addr: int = 0
    rkey: int = 0
    rlen: int = 0
    arg: int = 0
    result: int = 0
    flags: int = 0
    version: int = VERSION

    # -- encoding ---------------------------------------------------------------------------------
    def encode(self, req_id: int | None = None, version: int | None = None) -> bytes:
        """The header's bytes (``req_id``: with that request id instead of ours -- a requester numbering its
        requests, without a copy of the header; ``version``: stamped with that protocol version, the one of
        the connection it goes on)."""
        try:
            body = _FMT.pack(MAGIC, self.version if version is None else version, self.opcode, self.result,
                             self.flags, 0, self.partition, self.extent, self.offset, self.length, self.crc,
                             self.req_id if req_id is None else req_id,
                             self.epoch, self.addr, self.rkey, self.rlen, self.arg, 0)
        except struct.error as e:
            raise ProtocolError("field_range", str(e)) from None
        return body + _U32.pack(crc32c(body))

    def reply(self, result: int, *, arg: int = 0, length: int = 0, crc: int = 0) -> "Header":
        """The response header to this request: same identity fields and version, a result code."""
        return Header(self.opcode, self.partition, self.extent, self.offset, length, crc, self.req_id,
                      self.epoch, 0, 0, 0, arg, int(result), self.flags & _NOT_INLINE, self.version)

    def but(self, **changes) -> "Header":
        """A copy with ``changes`` applied: ``dataclasses.replace`` at a third of its cost (the hot path)."""
        values = list(_ALL_FIELDS(self))
        for name, value in changes.items():
            values[_FIELD_INDEX[name]] = value
        return Header(*values)

    def forwarded(self, **changes) -> "Header":
        """The copy a leader sends its followers (FORWARDED set), with ``changes`` applied."""
        return self.but(flags=changes.pop("flags", self.flags) | Flag.FORWARDED, **changes)

    def result_text(self) -> str:
        """A human sentence for a response's result."""
        try:
            res = Result(self.result)
        except ValueError:
            return f"unknown result {self.result:#04x}"
        text = DEFAULT_RESULT_TEXT[res]
        if res == Result.PROTOCOL and self.arg < len(PROTOCOL_REASONS):
            text += f" ({PROTOCOL_REASONS[self.arg]})"
        elif res == Result.BAD_BODY and self.arg < len(BODY_REASONS):
            text += f" ({BODY_REASONS[self.arg].replace('_', ' ')})"
        elif res == Result.REPLICATION_FAILED and self.arg:
            text += f" (replica {', '.join('#%d' % i for i in failed_replicas(self.arg))})"
        elif res in _ARG_TEXT:
            text += f" ({_ARG_TEXT[res].format(self.arg)})"
        return text

    @property
    def remote(self) -> "RemoteBuf":
        return RemoteBuf(self.addr, self.rkey, self.rlen)

    def describe(self) -> str:
        try:
            op = Op(self.opcode).name
        except ValueError:
            op = hex(self.opcode)
        return (f"{op} p{self.partition} e{self.extent} off={self.offset} len={self.length} "
                f"req={self.req_id} epoch={self.epoch}")


_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(Header))
_ALL_FIELDS = operator.attrgetter(*_FIELD_NAMES)
_FIELD_INDEX = {name: i for i, name in enumerate(_FIELD_NAMES)}
_NOT_INLINE = 0xFF & ~Flag.INLINE
_OPCODES = frozenset(op.value for op in Op)
_RESULTS = frozenset(r.value for r in Result)


def failed_replicas(mask: int) -> list[int]:
    """The replica indexes set in a REPLICATION_FAILED ``arg``."""
    return [i for i in range(64) if mask >> i & 1]


@dataclasses.dataclass(frozen=True, slots=True)
class RemoteBuf:
    """A buffer its owner exposes to one peer for one request: what verbs calls (addr, rkey, len)."""
    addr: int
    rkey: int
    length: int

    def slice(self, offset: int, length: int) -> "RemoteBuf":
        if offset < 0 or length < 0 or offset + length > self.length:
            raise ValueError(f"slice [{offset}, +{length}) outside remote buffer of {self.length} bytes")
        return RemoteBuf(self.addr + offset, self.rkey, length)


def decode(data: bytes | bytearray | memoryview, *, request: bool = True) -> Header:
    """Decode one header.  Raises ProtocolError (and only that) for anything malformed.

    ``request=True`` also checks what a request may carry (known opcode, zero result, length bounds,
    a payload descriptor that covers the payload)."""
    n = len(data)
    if n != HEADER_SIZE:
        raise ProtocolError("truncated" if n < HEADER_SIZE else "oversized",
                            f"header is {n} bytes, expected {HEADER_SIZE}")
    mv = memoryview(data)
    (magic, version, opcode, result, flags, pad, partition, extent, offset, length, crc, req_id, epoch,
     addr, rkey, rlen, arg, reserved) = _FMT.unpack_from(mv)
    if magic != MAGIC:
        raise ProtocolError("bad_magic", f"magic {magic:#06x}, expected {MAGIC:#06x}")
    (hcrc,) = _U32.unpack_from(mv, _FMT.size)
    if crc32c(mv[:_FMT.size]) != hcrc:
        raise ProtocolError("bad_header_crc", "header CRC does not match")
    if not MIN_VERSION <= version <= VERSION:
        raise ProtocolError("bad_version",
                            f"version {version}, this node speaks {versions_text(MIN_VERSION, VERSION)}")
    if reserved != 0 or pad != 0:
        raise ProtocolError("bad_reserved", "reserved field is not zero")
    h = Header(opcode, partition, extent, offset, length, crc, req_id, epoch, addr, rkey, rlen, arg, result,
               flags, version)
    if request:
        if opcode not in _OPCODES:
            raise ProtocolError("unknown_opcode", f"opcode {opcode:#04x}")
        if result != 0:
            raise ProtocolError("bad_result", "a request carries no result code")
        if length > MAX_PAYLOAD:
            raise ProtocolError("absurd_length", f"length {length} > {MAX_PAYLOAD}")
        if flags & Flag.INLINE:
            _check_inline(h)      # its payload bytes are checked by decode_message
        elif opcode in _LENGTH_IN_BUFFER and rlen < length:
            raise ProtocolError("short_buffer", f"descriptor exposes {rlen} bytes for a {length}-byte payload")
        if epoch > MAX_EPOCH:
            raise ProtocolError("field_range", f"epoch {epoch} > {MAX_EPOCH}")
    elif result not in _RESULTS:
        raise ProtocolError("bad_result", f"result {result:#04x}")
    return h


def encode_message(h: Header, payload=None) -> bytes:
    """One control message: the header, and for an inline WRITE (``Flag.INLINE``) its payload after it."""
    raw = h.encode()
    if payload is None:
        return raw
    return raw + bytes(payload)


def decode_message(data: bytes | bytearray | memoryview) -> tuple[Header, memoryview | None]:
    """Decode one request message: its header (``decode``) and, for an inline WRITE, the payload that
    follows it (else None).  ProtocolError for anything malformed, one reason per condition: bytes after
    the header of a request without ``Flag.INLINE`` (``oversized``), ``Flag.INLINE`` on another opcode or
    with a buffer named or beyond ``INLINE_MAX`` (``bad_inline``), payload bytes != ``length``
    (``inline_length``)."""
    mv = memoryview(data)
    if len(mv) < HEADER_SIZE or (len(mv) > HEADER_SIZE and not mv[5] & Flag.INLINE):
        return decode(mv), None          # raises "truncated" / "oversized"
    h = decode(mv[:HEADER_SIZE])
    if not h.flags & Flag.INLINE:
        return h, None
    payload = mv[HEADER_SIZE:]
    if len(payload) != h.length:
        raise ProtocolError("inline_length", f"{len(payload)} payload bytes for length {h.length}")
    return h, payload


def _check_inline(h: Header) -> None:
    if h.opcode != Op.WRITE or h.addr or h.rkey or h.rlen or h.length > INLINE_MAX:
        raise ProtocolError("bad_inline", "an inline payload goes only with a WRITE of at most "
                                          f"{INLINE_MAX} bytes that names no buffer")


# -- admin bodies (JSON, fetched from the requester's buffer) ------------------------------------------

class BodyError(Exception):
    """A malformed admin body; ``reason`` is one of BODY_REASONS (a BAD_BODY result carries its index)."""

    def __init__(self, reason: str, detail: str = ""):
        assert reason in BODY_REASONS, reason
        self.reason, self.detail = reason, detail
        super().__init__(f"{reason}: {detail}" if detail else reason)


MAX_REPLICAS = limits.MAX_REPLICAS


def check_address(addr) -> str:
    """``host:port`` with a port in 1..65535 (a replica's identity); raises BodyError."""
    if not isinstance(addr, str) or not 3 <= len(addr) <= 255:
        raise BodyError("replica_not_an_address", f"{addr!r} is not a host:port string")
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535 or any(c.isspace() for c in addr):
        raise BodyError("replica_not_an_address", f"{addr!r} is not host:port")
    return addr


def decode_view(obj) -> tuple[list[str], int]:
    """The body of PARTITION_CREATE / PARTITION_UPDATE (and a partition's meta): ``{"replicas": [addr...],
    "epoch": n}``, leader first.  Returns (replicas, epoch) or raises BodyError naming what is wrong."""
    if not isinstance(obj, dict):
        raise BodyError("not_an_object", f"body is a {type(obj).__name__}, expected an object")
    replicas, epoch = obj.get("replicas"), obj.get("epoch")
    if not isinstance(replicas, list):
        raise BodyError("replicas_not_a_list", "'replicas' must be a list of host:port strings")
    if not replicas:
        raise BodyError("replicas_empty", "'replicas' is empty")
    if len(replicas) > MAX_REPLICAS:
        raise BodyError("too_many_replicas", limits.replicas_error(len(replicas)))
    for r in replicas:
        check_address(r)
    if len(set(replicas)) != len(replicas):
        raise BodyError("replicas_not_distinct", "a replica is listed twice")
    if not isinstance(epoch, int) or isinstance(epoch, bool):
        raise BodyError("epoch_not_an_integer", f"'epoch' must be an integer, got {epoch!r}")
    if not 1 <= epoch <= MAX_EPOCH:
        raise BodyError("epoch_out_of_range", f"'epoch' must be in 1..{MAX_EPOCH}")
    return list(replicas), epoch


def decode_views(obj) -> list[tuple[int, list[str], int]]:
    """The body of PARTITION_UPDATE_MANY: ``{"views": [{"partition": id, "replicas": [...], "epoch": n}]}``,
    1..``MAX_VIEWS_PER_UPDATE`` entries, each partition once.  Returns [(id, replicas, epoch)] or raises
    BodyError naming what is wrong (and which entry)."""
    obj = _only_keys(obj, {"views"})
    views = obj.get("views")
    if not isinstance(views, list) or not views:
        raise BodyError("missing", "'views' must be a non-empty list")
    if len(views) > limits.MAX_VIEWS_PER_UPDATE:
        raise BodyError("too_large", limits.views_error(len(views)))
    out, seen = [], set()
    for i, v in enumerate(views):
        if not isinstance(v, dict):
            raise BodyError("not_an_object", f"views[{i}] is a {type(v).__name__}, expected an object")
        pid = v.get("partition")
        if not isinstance(pid, int) or isinstance(pid, bool) or not 1 <= pid < 1 << 63 or pid in seen:
            raise BodyError("other", f"views[{i}]: 'partition' must be a distinct id in 1..2^63-1, got {pid!r}")
        seen.add(pid)
        try:
            replicas, epoch = decode_view(_only_keys(v, {"partition", "replicas", "epoch"}))
        except BodyError as e:
            raise BodyError(e.reason, f"views[{i}] (partition {pid}): {e.detail}") from None
        out.append((pid, replicas, epoch))
    return out


MAX_VOLUME_NAME = 64
_VOLUME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


def check_volume(name) -> str:
    """A volume's name: 1..64 of letters, digits, '.', '_', '-' (no ':' -- a hello's identity is a volume
    name or a node's HOST:PORT -- and nothing a shell or a file name would mangle); raises BodyError."""
    if (not isinstance(name, str) or not 1 <= len(name) <= MAX_VOLUME_NAME or not set(name) <= _VOLUME_CHARS
            or name[0] in ".-"):
        raise BodyError("bad_volume", f"{str(name)[:80]!r} is not a volume name (1-{MAX_VOLUME_NAME} letters, "
                                      f"digits, '.', '_', '-'; not starting with '.' or '-')")
    return name


def decode_volume(obj) -> str:
    """The optional ``"volume"`` of a PARTITION_CREATE body (and a partition's meta): the volume the
    partition belongs to, "" for none.  Older nodes ignore the key (they admit no volume key either)."""
    if not isinstance(obj, dict) or obj.get("volume") in (None, ""):
        return ""
    return check_volume(obj["volume"])


MAX_TRASH_NAMES = 1024


def check_trash_name(name) -> str:
    """A trash entry's name as the node makes them: ``<partition id>.<unix ns deleted>`` (digits only)."""
    if not isinstance(name, str):
        raise BodyError("bad_trash_name", f"a trash entry name must be a string, got {type(name).__name__}")
    pid, dot, ns = name.partition(".")
    if not (dot and pid.isascii() and pid.isdigit() and ns.isascii() and ns.isdigit() and len(name) <= 48):
        raise BodyError("bad_trash_name", f"{name[:60]!r} is not a trash entry name (PARTITION.NANOSECONDS)")
    return name


def _only_keys(obj, allowed: set) -> dict:
    if not isinstance(obj, dict):
        raise BodyError("not_an_object", f"body is a {type(obj).__name__}, expected an object")
    extra = set(obj) - allowed
    if extra:
        raise BodyError("unknown_key", f"unknown key(s) {', '.join(sorted(map(str, extra)))[:200]}; "
                                       f"expected {', '.join(sorted(allowed))}")
    return obj


def decode_trash_restore(obj) -> str:
    """The body of TRASH_RESTORE: ``{"name": entry}``; returns the entry name or raises BodyError."""
    obj = _only_keys(obj, {"name"})
    if "name" not in obj:
        raise BodyError("bad_trash_name", "'name' is missing")
    return check_trash_name(obj["name"])


TOKEN_HEX = 16


def decode_trash_purge(obj) -> tuple[str, list[str], int | None]:
    """The body of TRASH_PURGE: exactly one of ``{"names": [entry...]}``, ``{"expired": true}``,
    ``{"all": true}``, and the confirmation ``"token"`` (hex) the node gave for it, if any; returns
    ("names", names, token) | ("expired", [], token) | ("all", [], token) (token None: not given)."""
    obj = _only_keys(obj, {"names", "expired", "all", "token"})
    token = obj.pop("token", None)
    if token is not None:
        if not (isinstance(token, str) and len(token) == TOKEN_HEX
                and all(c in "0123456789abcdef" for c in token)):
            raise BodyError("purge_choice", f"'token' must be {TOKEN_HEX} hex digits, as the node gave it")
        token = int(token, 16)
    return (*_purge_choice(obj), token)


def _purge_choice(obj: dict) -> tuple[str, list[str]]:
    if len(obj) != 1:
        raise BodyError("purge_choice", "say exactly one of 'names', 'expired' or 'all'")
    (key, value), = obj.items()
    if key == "names":
        if not isinstance(value, list) or not value:
            raise BodyError("purge_choice", "'names' must be a non-empty list of trash entry names")
        if len(value) > MAX_TRASH_NAMES:
            raise BodyError("purge_choice", f"{len(value)} names, at most {MAX_TRASH_NAMES}")
        return "names", [check_trash_name(n) for n in value]
    if value is not True:
        raise BodyError("purge_choice", f"'{key}' must be true")
    return key, []


def peek_req_id(data: bytes | bytearray | memoryview) -> int | None:
    """Best effort: the request id of a header that failed to decode, so the error reply can be matched."""
    if len(data) >= 48:
        return int.from_bytes(bytes(data[40:48]), "big")
    return None


# -- connection hello (first bytes on every TCP stream) -------------------------------------------------
#
#   magic "DNHI" | version u8 | transport u8 | flags u8 | role u8 | status u8 | ident_len u8 | min_version u8 |
#   ext_len u8 | slots u32 | slot_size u32 | node_id u64 | nonce 32 | proof 32
#   then ``ident_len`` bytes of identity, then ``ext_len`` bytes of extensions
#
# ``transport`` in the client's hello is what it wants (auto/verbs/tcp); in the server's answer it is what
# was chosen.  flags bit 0: "I have a working RDMA device"; bit 1: "I authenticate" (hold the cluster's keys).
# ``role`` (Role) is what the client claims; ``identity`` a node's listen address (HOST:PORT), or for a
# client proving a volume key the volume's name (wire/auth.py: both bound into the proofs).  With
# authentication on both sides, the server's answer carries its nonce and proof, then the client sends
# ``AuthProof`` and the server answers ``AuthVerdict`` (wire/auth.py, transport/connect.py).  A server
# refusing a connection says why in ``status`` (HELLO_STATUS).  When verbs is chosen, both ends then exchange
# their queue-pair endpoint (``VerbsEndpoint``) on the same stream, so both belong to the same peer.
#
# ``min_version``..``version``: the protocol versions the sender speaks (a hello of version 4 or older has 0
# there: it speaks only ``version``); both ends use the highest both speak (``negotiate``).  This fixed part
# keeps its layout in every version, so two builds that share no version still tell each other why.  New
# hello fields are *extensions*: items of tag u8 | length u8 | value, one per field of HELLO_EXTENSIONS.  A
# receiver skips a tag it does not know (an older peer ignores a newer field) and a field an older peer did
# not send keeps its default (a newer peer works without it).

HELLO_MAGIC = b"DNHI"
_HELLO = struct.Struct(">4sBBBBBBBBIIQ32s32s")
HELLO_SIZE = _HELLO.size          # the fixed part; the identity and the extensions follow
HELLO_AUTH = 0x02
HELLO_STATUS = ["ok", "authentication required: this node needs a cluster secret (secret file)",
                "unknown role", "too many connections", "bad proof (wrong secret or role key)",
                "this node does not authenticate but the peer holds a secret",
                "this node requires TLS (give the client a CA: tls_ca, $DATANODE_TLS_CA, dnctl --tls-ca)",
                "no protocol version in common",
                "this node has no secret and takes peers on its own host only (give it one: secret_file; or "
                "insecure = true)",
                "this node is not the one dialed (a relayed hello, or a wrong address)",
                "the hello lacks a session key share",
                "the hello was altered on the way (a downgrade to a protocol without sessions)"]
STATUS_VERSION = 7                # the refusal's hello carries the refusing side's range
STATUS_NOT_DIALED = 9             # the refusal's hello carries the refusing node's identity
STATUS_NO_SHARE = 10
STATUS_DOWNGRADE = 11
# Extension tag -> the Hello field it carries (at most 255 bytes: a UTF-8 string, or raw bytes for the tags in
# HELLO_BINARY).  Tags are never reused.  2: the node the caller dialed (its HOST:PORT identity, bound into the
# proofs); 3: the sender's X25519 key share (wire/auth.py).
HELLO_EXTENSIONS = {1: "software", 2: "server", 3: "kx"}
HELLO_BINARY = frozenset({3})


class Transport(enum.IntEnum):
    AUTO = 0
    TCP = 1
    VERBS = 2


@dataclasses.dataclass(slots=True)
class Hello:
    transport: int
    has_device: bool
    slots: int
    slot_size: int = HEADER_SIZE
    node_id: int = 0
    version: int = VERSION
    min_version: int = MIN_VERSION
    auth: bool = False
    role: int = 0
    status: int = 0
    nonce: bytes = bytes(32)
    proof: bytes = bytes(32)
    identity: str = ""
    ident_len: int = 0
    ext_len: int = 0
    software: str = ""            # extension 1: the sender's build ("datanode 0.1.0"), for operators
    server: str = ""              # extension 2: the node the caller dialed (HOST:PORT)
    kx: bytes = b""               # extension 3: the sender's session key share

    def encode(self) -> bytes:
        ident = self.identity.encode()
        if len(ident) > 255:
            raise ProtocolError("field_range", "identity longer than 255 bytes")
        ext = bytearray()
        for tag, name in HELLO_EXTENSIONS.items():
            value = getattr(self, name)
            value = value if tag in HELLO_BINARY else value.encode()
            if len(value) > 255:
                raise ProtocolError("field_range", f"hello extension {name!r} longer than 255 bytes")
            if value:
                ext += bytes((tag, len(value))) + value
        if len(ext) > 255:
            raise ProtocolError("field_range", "hello extensions longer than 255 bytes")
        flags = (1 if self.has_device else 0) | (HELLO_AUTH if self.auth else 0)
        return _HELLO.pack(HELLO_MAGIC, self.version, self.transport, flags, self.role, self.status, len(ident),
                           self.min_version, len(ext), self.slots, self.slot_size, self.node_id, self.nonce,
                           self.proof) + ident + ext


def decode_hello(data: bytes | bytearray | memoryview) -> Hello:
    """The fixed part of a hello (``HELLO_SIZE`` bytes); ``ident_len`` bytes of identity and ``ext_len`` bytes
    of extensions follow it on the stream (``decode_identity``, ``decode_extensions``).  Any version range
    decodes: whether it meets ours is ``negotiate``'s to say."""
    if len(data) != HELLO_SIZE:
        raise ProtocolError("truncated", f"hello is {len(data)} bytes, expected {HELLO_SIZE}")
    (magic, version, transport, flags, role, status, ident_len, min_version, ext_len, slots, slot_size, node_id,
     nonce, proof) = _HELLO.unpack(bytes(data))
    if magic != HELLO_MAGIC:
        raise ProtocolError("bad_magic", "not a datanode connection hello")
    min_version = min_version or version          # a hello before ranges: its one version
    if min_version > version:
        raise ProtocolError("bad_version", f"version range {min_version}-{version} is empty")
    try:
        Transport(transport)
    except ValueError:
        raise ProtocolError("bad_transport", f"transport {transport}") from None
    # slot_size: the largest control message the sender's slots take.  Every control message is one header,
    # so a peer whose slots cannot take one is refused here; senders never send anything larger.
    if not (1 <= slots <= 4096) or slot_size < HEADER_SIZE:
        raise ProtocolError("bad_slots", f"{slots} slots of {slot_size} bytes")
    return Hello(transport=transport, has_device=bool(flags & 1), slots=slots, slot_size=slot_size,
                 node_id=node_id, version=version, min_version=min_version, auth=bool(flags & HELLO_AUTH),
                 role=role, status=status, nonce=nonce, proof=proof, ident_len=ident_len, ext_len=ext_len)


def decode_identity(raw: bytes) -> str:
    """A hello's identity: empty, a node's HOST:PORT, or (role client) the name of the volume whose key the
    client proves (``check_volume``: never HOST:PORT-shaped, so the two cannot be confused)."""
    if not raw:
        return ""
    try:
        text = raw.decode("ascii")
        return check_volume(text) if ":" not in text else check_address(text)
    except (UnicodeDecodeError, BodyError):
        raise ProtocolError("field_range", "the hello's identity is neither HOST:PORT nor a volume name") from None


def decode_extensions(hello: Hello, raw: bytes) -> None:
    """Set ``hello``'s extension fields from its ``ext_len`` bytes of extensions; tags this build does not
    know are skipped.  ProtocolError for an item that runs past the end, a known tag twice, a value that is
    not UTF-8."""
    seen, i = set(), 0
    while i < len(raw):
        if i + 2 > len(raw) or i + 2 + raw[i + 1] > len(raw):
            raise ProtocolError("truncated", "a hello extension runs past the end of the extensions")
        tag, n = raw[i], raw[i + 1]
        name = HELLO_EXTENSIONS.get(tag)
        if name is not None:
            if tag in seen:
                raise ProtocolError("field_range", f"hello extension {name!r} given twice")
            seen.add(tag)
            value = bytes(raw[i + 2:i + 2 + n])
            try:
                setattr(hello, name, value if tag in HELLO_BINARY else value.decode())
            except UnicodeDecodeError:
                raise ProtocolError("field_range", f"hello extension {name!r} is not UTF-8") from None
        i += 2 + n


def versions_text(lo: int, hi: int) -> str:
    """A range of protocol versions for a person: "5", "5-6"."""
    return str(hi) if lo == hi else f"{lo}-{hi}"


def negotiate(ours: tuple[int, int], theirs: tuple[int, int]) -> int | None:
    """The protocol version a connection uses: the highest in both (oldest, newest) ranges; None if they share
    none."""
    version = min(ours[1], theirs[1])
    return version if version >= max(ours[0], theirs[0]) else None


def version_refusal(theirs: tuple[int, int], we: str = "we speak",
                    ours: tuple[int, int] = (MIN_VERSION, VERSION)) -> str:
    """Why a peer speaking ``theirs`` (oldest, newest) cannot talk to us: both ranges, and which side to
    upgrade."""
    older = "it" if theirs[1] < ours[0] else "this side"
    return (f"it speaks protocol {versions_text(*theirs)}, {we} {versions_text(*ours)}: no version in common "
            f"(upgrade {older})")


class AuthProof:
    """Client -> server after the server's answer: ``"DNAU" | proof 32``."""
    MAGIC = b"DNAU"
    SIZE = 36

    @staticmethod
    def encode(proof: bytes) -> bytes:
        return AuthProof.MAGIC + proof

    @staticmethod
    def decode(raw: bytes) -> bytes:
        if len(raw) != AuthProof.SIZE or raw[:4] != AuthProof.MAGIC:
            raise ProtocolError("bad_magic", "not an authentication proof")
        return bytes(raw[4:])


class AuthVerdict:
    """Server -> client: ``"DNOK" | status u8 | pad 3`` (status: index in HELLO_STATUS, 0 = accepted)."""
    SIZE = 8

    @staticmethod
    def encode(status: int) -> bytes:
        return b"DNOK" + bytes([status, 0, 0, 0])

    @staticmethod
    def decode(raw: bytes) -> int:
        if len(raw) != AuthVerdict.SIZE or raw[:4] != b"DNOK":
            raise ProtocolError("bad_magic", "not an authentication verdict")
        return raw[4]


class NodeProof:
    """Server -> client after an accepting ``AuthVerdict``, on a session only: ``"DNNP" | node certificate 96 |
    signature 64`` -- the node's key signed by the node CA, and its signature of the transcript (wire/auth.py).
    Sent once the caller has proven its key: a caller without one costs the node no signature."""
    MAGIC = b"DNNP"
    SIZE = 4 + 96 + 64

    @staticmethod
    def encode(cert: bytes, sig: bytes) -> bytes:
        if len(cert) != 96 or len(sig) != 64:
            raise ProtocolError("field_range", "a node proof is a 96-byte certificate and a 64-byte signature")
        return NodeProof.MAGIC + cert + sig

    @staticmethod
    def decode(raw: bytes) -> tuple[bytes, bytes]:
        if len(raw) != NodeProof.SIZE or raw[:4] != NodeProof.MAGIC:
            raise ProtocolError("bad_magic", "not a node proof")
        return bytes(raw[4:100]), bytes(raw[100:])


@dataclasses.dataclass(slots=True)
class VerbsEndpoint:
    """What one end of an RC queue pair tells the other (exchanged over the TCP stream)."""
    qpn: int
    psn: int
    gid: bytes          # 16 bytes
    lid: int = 0
    mtu: int = 1024

    _S = struct.Struct(">4sII16sHH")
    SIZE = _S.size

    def encode(self) -> bytes:
        return self._S.pack(b"DNQP", self.qpn, self.psn, self.gid, self.lid, self.mtu)

    @classmethod
    def decode(cls, data: bytes) -> "VerbsEndpoint":
        if len(data) != cls.SIZE:
            raise ProtocolError("truncated", "verbs endpoint")
        magic, qpn, psn, gid, lid, mtu = cls._S.unpack(data)
        if magic != b"DNQP":
            raise ProtocolError("bad_magic", "not a verbs endpoint")
        return cls(qpn=qpn, psn=psn, gid=gid, lid=lid, mtu=mtu)
