"""The wire protocol: a pure codec (no I/O), in the spirit of h11.

Every request and every response is one fixed-size header (``HEADER_SIZE`` bytes, big-endian), sent as one
message into one of the receiver's preposted control slots (RDMA SEND, or a control frame on TCP).
Payloads never travel inside a control message: a header *names* a buffer of its sender (``addr``, ``rkey``,
``rlen``) and the receiver moves the bytes with a one-sided operation (RDMA READ to fetch a write payload,
RDMA WRITE to push read data or a JSON answer).  Admin requests and answers (partition create, stats) use
the same mechanism with a JSON body, so there is exactly one way bytes move.

Layout (88 bytes):

    off size field
      0   2  magic      0xDA7A
      2   1  version    1
      3   1  opcode     Op
      4   1  result     Result (0 in requests)
      5   1  flags      Flag bits
      6   2  hops       replicas still to forward to (informational, like CubeFS's RemainingFollowers)
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
     72   8  arg        op specific (response: extent size, failed replica index, needed length, ...)
     80   4  reserved   must be 0
     84   4  hcrc       CRC32C of bytes 0..83
"""
from __future__ import annotations

import dataclasses
import enum
import struct

from .crc import crc32c

MAGIC = 0xDA7A
VERSION = 1
HEADER_SIZE = 88
MAX_PAYLOAD = 64 << 20          # no single request moves more than this
_FMT = struct.Struct(">HBBBBHQQQIIQQQIIQI")  # everything but hcrc
assert _FMT.size + 4 == HEADER_SIZE
_U32 = struct.Struct(">I")


# Why a header was refused as malformed; a PROTOCOL result carries the index of the reason in ``arg``.
PROTOCOL_REASONS = ["other", "truncated", "oversized", "bad_magic", "bad_header_crc", "bad_version",
                    "bad_reserved", "unknown_opcode", "bad_result", "absurd_length", "short_buffer",
                    "field_range", "bad_transport", "bad_slots"]


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
    PING = 0x10
    PARTITION_CREATE = 0x20  # body: JSON {"replicas": [...], "epoch": n} fetched from the request's buffer
    PARTITION_LIST = 0x21    # answer: JSON list
    PARTITION_UPDATE = 0x22  # body: JSON {"replicas": [...], "epoch": n}; new epoch must be higher
    PARTITION_DELETE = 0x23
    POOL_STATS = 0x30        # answer: JSON
    NODE_STATUS = 0x31       # answer: JSON
    PARTITION_HEALTH = 0x24  # answer: JSON, the leader's view of its replicas, repair and scrub progress
    REPAIR = 0x25            # ask the leader for a full repair pass now; arg in the answer = pass number
    SCRUB = 0x26             # ask the leader for a scrub pass now; arg in the answer = pass number


class Result(enum.IntEnum):
    OK = 0xF0
    NOT_LEADER = 0xF2           # this replica is not the partition's leader; arg = index of the leader
    REPLICATION_FAILED = 0xF3   # a follower is down, slow or said no; arg = index of the replica
    BAD_REQUEST = 0xF4          # bounds, offset not at the extent's end, bad JSON ...; arg may carry the size
    CRC_MISMATCH = 0xF5         # payload CRC wrong, or a stored block failed its CRC on read
    NOT_FOUND = 0xF6            # partition or extent does not exist
    DISK_ERROR = 0xF7
    ERROR = 0xF8                # anything else
    RETRY = 0xF9                # transient: try again
    NO_SPACE = 0xFA             # pool exhausted past the timeout, or extent full
    STALE_EPOCH = 0xFB          # arg = the receiver's epoch
    DIVERGED = 0xFC             # replicas of this extent disagree: no more appends; use a new extent
    REMOTE_ACCESS = 0xFD        # the one-sided op on the sender's buffer failed (rkey, bounds, rights)
    PROTOCOL = 0xFE             # malformed header (bad magic/version/CRC, truncated, unknown opcode, ...)


class Flag(enum.IntFlag):
    NONE = 0
    FORWARDED = 0x01    # leader -> follower: this is a replica write, do not forward further
    ANY_REPLICA = 0x02  # read: the client asks this replica directly (not only the leader)
    REPAIR = 0x04       # forwarded by the leader's repair: applies to a sealed extent on the follower too


# What a request is allowed to carry.  Checked by decode so handlers see only sane headers.
_NEEDS_PAYLOAD = {Op.WRITE}
DEFAULT_RESULT_TEXT = {
    Result.OK: "ok",
    Result.NOT_LEADER: "this node is not the partition's leader",
    Result.REPLICATION_FAILED: "replication to a follower failed",
    Result.BAD_REQUEST: "bad request",
    Result.CRC_MISMATCH: "CRC mismatch",
    Result.NOT_FOUND: "not found",
    Result.DISK_ERROR: "disk error",
    Result.ERROR: "error",
    Result.RETRY: "retry",
    Result.NO_SPACE: "no space (pool exhausted or extent full)",
    Result.STALE_EPOCH: "stale partition epoch",
    Result.DIVERGED: "extent replicas diverged; write to a new extent",
    Result.REMOTE_ACCESS: "remote buffer access refused (rkey/bounds/rights)",
    Result.PROTOCOL: "malformed header",
}


@dataclasses.dataclass(slots=True)
class Header:
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
    hops: int = 0
    version: int = VERSION

    # -- encoding ---------------------------------------------------------------------------------
    def encode(self) -> bytes:
        try:
            body = _FMT.pack(MAGIC, self.version, self.opcode, self.result, self.flags, self.hops,
                             self.partition, self.extent, self.offset, self.length, self.crc, self.req_id,
                             self.epoch, self.addr, self.rkey, self.rlen, self.arg, 0)
        except struct.error as e:
            raise ProtocolError("field_range", str(e)) from None
        return body + _U32.pack(crc32c(body))

    def reply(self, result: int, *, arg: int = 0, length: int = 0, crc: int = 0) -> "Header":
        """The response header to this request: same identity fields, a result code."""
        return Header(opcode=self.opcode, partition=self.partition, extent=self.extent, offset=self.offset,
                      length=length, crc=crc, req_id=self.req_id, epoch=self.epoch, result=int(result),
                      arg=arg, flags=self.flags)

    def result_text(self) -> str:
        """A human sentence for a response's result."""
        try:
            res = Result(self.result)
        except ValueError:
            return f"unknown result {self.result:#04x}"
        text = DEFAULT_RESULT_TEXT[res]
        if res == Result.PROTOCOL and self.arg < len(PROTOCOL_REASONS):
            text += f" ({PROTOCOL_REASONS[self.arg]})"
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
    (magic, version, opcode, result, flags, hops, partition, extent, offset, length, crc, req_id, epoch,
     addr, rkey, rlen, arg, reserved) = _FMT.unpack_from(mv)
    if magic != MAGIC:
        raise ProtocolError("bad_magic", f"magic {magic:#06x}, expected {MAGIC:#06x}")
    (hcrc,) = _U32.unpack_from(mv, _FMT.size)
    if crc32c(mv[:_FMT.size]) != hcrc:
        raise ProtocolError("bad_header_crc", "header CRC does not match")
    if version != VERSION:
        raise ProtocolError("bad_version", f"version {version}, this node speaks {VERSION}")
    if reserved != 0:
        raise ProtocolError("bad_reserved", "reserved field is not zero")
    h = Header(opcode=opcode, partition=partition, extent=extent, offset=offset, length=length, crc=crc,
               req_id=req_id, epoch=epoch, addr=addr, rkey=rkey, rlen=rlen, arg=arg, result=result,
               flags=flags, hops=hops, version=version)
    if request:
        try:
            op = Op(opcode)
        except ValueError:
            raise ProtocolError("unknown_opcode", f"opcode {opcode:#04x}") from None
        if result != 0:
            raise ProtocolError("bad_result", "a request carries no result code")
        if length > MAX_PAYLOAD:
            raise ProtocolError("absurd_length", f"length {length} > {MAX_PAYLOAD}")
        if op in _NEEDS_PAYLOAD and rlen < length:
            raise ProtocolError("short_buffer", f"descriptor exposes {rlen} bytes for a {length}-byte payload")
    else:
        try:
            Result(result)
        except ValueError:
            raise ProtocolError("bad_result", f"result {result:#04x}") from None
    return h


def peek_req_id(data: bytes | bytearray | memoryview) -> int | None:
    """Best effort: the request id of a header that failed to decode, so the error reply can be matched."""
    if len(data) >= 48:
        return int.from_bytes(bytes(data[40:48]), "big")
    return None


# -- connection hello (first bytes on every TCP stream) -------------------------------------------------
#
#   magic "DNHI" | version u8 | transport u8 | flags u8 | pad u8 | slots u32 | slot_size u32 | node_id u64
#
# ``transport`` in the client's hello is what it wants (auto/verbs/tcp); in the server's answer it is what
# was chosen.  flags bit 0: "I have a working RDMA device".  When verbs is chosen, both ends then exchange
# their queue-pair endpoint (``VerbsEndpoint``) on the same stream, so both belong to the same peer.

HELLO_MAGIC = b"DNHI"
_HELLO = struct.Struct(">4sBBBBIIQ")
HELLO_SIZE = _HELLO.size


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

    def encode(self) -> bytes:
        return _HELLO.pack(HELLO_MAGIC, self.version, self.transport, 1 if self.has_device else 0, 0,
                           self.slots, self.slot_size, self.node_id)


def decode_hello(data: bytes | bytearray | memoryview) -> Hello:
    if len(data) != HELLO_SIZE:
        raise ProtocolError("truncated", f"hello is {len(data)} bytes, expected {HELLO_SIZE}")
    magic, version, transport, flags, _pad, slots, slot_size, node_id = _HELLO.unpack(bytes(data))
    if magic != HELLO_MAGIC:
        raise ProtocolError("bad_magic", "not a datanode connection hello")
    if version != VERSION:
        raise ProtocolError("bad_version", f"peer speaks version {version}, this node {VERSION}")
    try:
        Transport(transport)
    except ValueError:
        raise ProtocolError("bad_transport", f"transport {transport}") from None
    if not (1 <= slots <= 4096) or slot_size < HEADER_SIZE:
        raise ProtocolError("bad_slots", f"{slots} slots of {slot_size} bytes")
    return Hello(transport=transport, has_device=bool(flags & 1), slots=slots, slot_size=slot_size,
                 node_id=node_id, version=version)


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
