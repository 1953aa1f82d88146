"""The wire codec (wire.protocol): round trips over every field, and fuzzing that may only ever produce
ProtocolError -- a malformed header must never crash the decoder with another exception."""
from __future__ import annotations

import dataclasses
import struct

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from wire.crc import crc32c
from wire.protocol import (BODY_OPS, BODY_REASONS, HEADER_SIZE, HELLO_SIZE, MAGIC, MAX_EPOCH, MAX_PAYLOAD,
                               PROTOCOL_REASONS, VERSION, BodyError, Header, Hello, Op, ProtocolError, Result,
                               INLINE_MAX, Flag, Transport, decode, decode_hello, decode_message, decode_view,
                               encode_message, peek_req_id)

U8, U16, U32, U64 = (st.integers(0, (1 << b) - 1) for b in (8, 16, 32, 64))
FIELDS = ["opcode", "partition", "extent", "offset", "length", "crc", "req_id", "epoch", "addr", "rkey", "rlen",
          "arg", "result", "flags", "version"]
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def as_dict(h: Header) -> dict:
    return {f: getattr(h, f) for f in FIELDS}


@st.composite
def requests(draw):
    """Any header a sender may legally put on the wire as a request."""
    op = draw(st.sampled_from(list(Op)))
    length = draw(st.integers(0, MAX_PAYLOAD))
    in_buffer = op in (Op.WRITE, Op.READ, *BODY_OPS)
    rlen = draw(st.integers(length, (1 << 32) - 1)) if in_buffer else draw(U32)
    return Header(opcode=op, partition=draw(U64), extent=draw(U64), offset=draw(U64), length=length,
                  crc=draw(U32), req_id=draw(U64), epoch=draw(st.integers(0, MAX_EPOCH)), addr=draw(U64),
                  rkey=draw(U32), rlen=rlen,
                  arg=draw(U64), result=0, flags=draw(U8) & ~Flag.INLINE)   # inline ones: inline_writes()


@st.composite
def inline_writes(draw):
    """An inline WRITE (Flag.INLINE) with its payload, as a client or a leader sends it."""
    payload = draw(st.binary(max_size=300)) if draw(st.booleans()) else bytes(draw(st.sampled_from(
        [0, 1, INLINE_MAX - 1, INLINE_MAX])))
    h = Header(opcode=Op.WRITE, partition=draw(U64), extent=draw(U64), offset=draw(U64), length=len(payload),
               crc=crc32c(payload), req_id=draw(U64), epoch=draw(st.integers(0, MAX_EPOCH)),
               flags=Flag.INLINE | (draw(U8) & ~Flag.INLINE))
    return h, payload


@st.composite
def responses(draw):
    return Header(opcode=draw(U8), partition=draw(U64), extent=draw(U64), offset=draw(U64), length=draw(U32),
                  crc=draw(U32), req_id=draw(U64), epoch=draw(U64), addr=draw(U64), rkey=draw(U32),
                  rlen=draw(U32), arg=draw(U64), result=draw(st.sampled_from(list(Result))), flags=draw(U8),
                  )


def seal(body: bytes) -> bytes:
    """Give 84 header bytes a correct header CRC (so the fuzz reaches the checks behind the CRC)."""
    assert len(body) == HEADER_SIZE - 4
    return body + struct.pack(">I", crc32c(body))


# -------------------------------------------------------------------------------------------- round trips
@FUZZ
@given(requests())
def test_request_round_trip(h):
    raw = h.encode()
    assert len(raw) == HEADER_SIZE
    assert as_dict(decode(raw)) == as_dict(h)
    assert as_dict(decode(bytearray(raw))) == as_dict(h)
    assert as_dict(decode(memoryview(raw))) == as_dict(h)
    assert peek_req_id(raw) == h.req_id


@FUZZ
@given(inline_writes())
def test_inline_write_round_trip(hp):
    """An inline WRITE decodes to its header and exactly its payload; a plain request has none."""
    h, payload = hp
    raw = encode_message(h, payload)
    assert len(raw) == HEADER_SIZE + len(payload)
    got, body = decode_message(raw)
    assert as_dict(got) == as_dict(h) and bytes(body) == payload
    plain = dataclasses.replace(h, flags=h.flags & ~Flag.INLINE, addr=1, rlen=len(payload))
    assert decode_message(plain.encode())[1] is None


@pytest.mark.parametrize("case, reason", [
    ("payload longer than length", "inline_length"),
    ("payload shorter than length", "inline_length"),
    ("bytes after a header without INLINE", "oversized"),
    ("INLINE on a READ", "bad_inline"),
    ("INLINE naming a buffer", "bad_inline"),
    ("INLINE beyond INLINE_MAX", "bad_inline"),
])
def test_bad_inline_messages_are_refused_each_with_its_reason(case, reason):
    w = Header(opcode=Op.WRITE, partition=1, extent=2, length=3, crc=crc32c(b"abc"), flags=Flag.INLINE)
    raw = {
        "payload longer than length": encode_message(w, b"abcd"),
        "payload shorter than length": encode_message(w, b"ab"),
        "bytes after a header without INLINE": dataclasses.replace(w, flags=0, addr=5, rlen=3).encode() + b"abc",
        "INLINE on a READ": encode_message(dataclasses.replace(w, opcode=Op.READ), b"abc"),
        "INLINE naming a buffer": encode_message(dataclasses.replace(w, addr=5, rkey=1, rlen=3), b"abc"),
        "INLINE beyond INLINE_MAX": encode_message(dataclasses.replace(w, length=INLINE_MAX + 1),
                                                   bytes(INLINE_MAX + 1)),
    }[case]
    with pytest.raises(ProtocolError) as e:
        decode_message(raw)
    assert e.value.reason == reason


@FUZZ
@given(responses())
def test_response_round_trip(h):
    got = decode(h.encode(), request=False)
    assert as_dict(got) == as_dict(h)


@FUZZ
@given(requests(), st.sampled_from(list(Result)), U64, st.integers(0, MAX_PAYLOAD), U32)
def test_reply_keeps_identity(h, result, arg, length, crc):
    r = decode(h.reply(result, arg=arg, length=length, crc=crc).encode(), request=False)
    assert (r.opcode, r.partition, r.extent, r.offset, r.req_id, r.epoch, r.flags) == \
        (h.opcode, h.partition, h.extent, h.offset, h.req_id, h.epoch, h.flags & ~Flag.INLINE)
    assert (r.result, r.arg, r.length, r.crc) == (result, arg, length, crc)


@pytest.mark.parametrize("field,value", [("partition", 1 << 64), ("length", 1 << 32), ("flags", 1 << 8),
                                         ("opcode", 256), ("rkey", -1), ("arg", -5)])
def test_encode_out_of_range_is_protocol_error(field, value):
    h = dataclasses.replace(Header(opcode=Op.PING), **{field: value})
    with pytest.raises(ProtocolError) as ei:
        h.encode()
    assert ei.value.reason == "field_range"


# --------------------------------------------------------------------------------- each malformation
def test_each_malformation_has_its_reason():
    good = Header(opcode=Op.READ, partition=3, extent=4, length=10, req_id=77, rlen=10).encode()
    body = bytearray(good[:-4])

    def variant(off, fmt, value):
        b = bytearray(body)
        struct.pack_into(fmt, b, off, value)
        return seal(bytes(b))

    cases = {
        "truncated": good[:-1],
        "oversized": good + b"\0",
        "bad_magic": variant(0, ">H", 0xBEEF),
        "bad_header_crc": good[:-1] + bytes([good[-1] ^ 1]),
        "bad_version": variant(2, ">B", VERSION + 1),
        "unknown_opcode": variant(3, ">B", 0x99),
        "bad_result": variant(4, ">B", Result.OK),
        "absurd_length": variant(32, ">I", MAX_PAYLOAD + 1),
        "bad_reserved": variant(80, ">I", 1),
    }
    for reason, raw in cases.items():
        with pytest.raises(ProtocolError) as ei:
            decode(raw)
        assert ei.value.reason == reason, (reason, ei.value)
    with pytest.raises(ProtocolError) as ei:                  # the 16-bit pad after the flags, too
        decode(variant(6, ">H", 1))
    assert ei.value.reason == "bad_reserved"
    # a write (or read, or admin body) whose descriptor exposes fewer bytes than it moves
    for op in (Op.WRITE, Op.READ, Op.PARTITION_CREATE, Op.PARTITION_UPDATE):
        short = Header(opcode=op, length=4096, rlen=4095).encode()
        with pytest.raises(ProtocolError) as ei:
            decode(short)
        assert ei.value.reason == "short_buffer", op
    # an epoch no node can ever be at (its STALE_EPOCH answer could not be encoded past +1)
    with pytest.raises(ProtocolError) as ei:
        decode(Header(opcode=Op.PING, epoch=MAX_EPOCH + 1).encode())
    assert ei.value.reason == "field_range"
    # a response must carry a known result code
    with pytest.raises(ProtocolError) as ei:
        decode(Header(opcode=Op.PING, result=0x01).encode(), request=False)
    assert ei.value.reason == "bad_result"


def test_result_text_names_the_protocol_reason():
    for i, reason in enumerate(PROTOCOL_REASONS):
        text = Header(opcode=Op.PING, result=Result.PROTOCOL, arg=i).result_text()
        assert reason in text and "malformed" in text
    assert "0x01" in Header(opcode=Op.PING, result=0x01).result_text()
    assert Header(opcode=Op.PING, result=Result.CRC_MISMATCH).result_text() == "CRC mismatch"


def test_result_text_carries_the_arg_and_every_code_has_a_text():
    assert "1000" in Header(opcode=Op.READ, result=Result.OUT_OF_RANGE, arg=1000).result_text()
    assert "1000" in Header(opcode=Op.WRITE, result=Result.WRONG_OFFSET, arg=1000).result_text()
    assert "#1, #2" in Header(opcode=Op.WRITE, result=Result.REPLICATION_FAILED, arg=0b110).result_text()
    for i, reason in enumerate(BODY_REASONS):
        assert reason.replace("_", " ") in Header(opcode=Op.PING, result=Result.BAD_BODY, arg=i).result_text()
    for res in Result:
        assert Header(opcode=Op.PING, result=res).result_text()


GOOD_VIEW = {"replicas": ["127.0.0.1:1", "h:65535"], "epoch": 3}


@pytest.mark.parametrize("body,reason", [
    ("a string", "not_an_object"), (None, "not_an_object"), ([1, 2], "not_an_object"),
    ({"epoch": 1}, "replicas_not_a_list"), ({"replicas": "a:1", "epoch": 1}, "replicas_not_a_list"),
    ({"replicas": [], "epoch": 1}, "replicas_empty"),
    ({"replicas": [f"h:{i}" for i in range(1, 18)], "epoch": 1}, "too_many_replicas"),
    ({"replicas": [None], "epoch": 1}, "replica_not_an_address"),
    ({"replicas": [7], "epoch": 1}, "replica_not_an_address"),
    ({"replicas": ["nohost"], "epoch": 1}, "replica_not_an_address"),
    ({"replicas": ["h:0"], "epoch": 1}, "replica_not_an_address"),
    ({"replicas": ["h:65536"], "epoch": 1}, "replica_not_an_address"),
    ({"replicas": [":80"], "epoch": 1}, "replica_not_an_address"),
    ({"replicas": ["a b:80"], "epoch": 1}, "replica_not_an_address"),
    ({"replicas": ["h:1", "h:1"], "epoch": 1}, "replicas_not_distinct"),
    ({"replicas": ["h:1"]}, "epoch_not_an_integer"),
    ({"replicas": ["h:1"], "epoch": "2"}, "epoch_not_an_integer"),
    ({"replicas": ["h:1"], "epoch": True}, "epoch_not_an_integer"),
    ({"replicas": ["h:1"], "epoch": 0}, "epoch_out_of_range"),
    ({"replicas": ["h:1"], "epoch": 2**64}, "epoch_out_of_range"),
])
def test_view_body_validation_names_the_reason(body, reason):
    with pytest.raises(BodyError) as ei:
        decode_view(body)
    assert ei.value.reason == reason


def test_view_body_accepts_a_good_view():
    assert decode_view(GOOD_VIEW) == (GOOD_VIEW["replicas"], 3)


# -------------------------------------------------------------------------------------------- fuzzing
def decode_or_protocol_error(raw: bytes, request: bool = True):
    try:
        return decode(raw, request=request)
    except ProtocolError as e:
        assert e.reason in PROTOCOL_REASONS
        return None


@FUZZ
@given(st.binary(min_size=0, max_size=2 * HEADER_SIZE), st.booleans())
@example(b"", True)
@example(b"\xda\x7a", True)
def test_random_bytes_only_protocol_error(raw, request):
    decode_or_protocol_error(raw, request)


@FUZZ
@given(st.binary(min_size=HEADER_SIZE - 4, max_size=HEADER_SIZE - 4), st.booleans())
def test_random_crc_valid_headers_only_protocol_error(body, request):
    """Random field values behind a correct magic and header CRC: the checks after the CRC are reached."""
    body = struct.pack(">HB", MAGIC, VERSION) + body[3:]
    h = decode_or_protocol_error(seal(body), request)
    if h is not None and request:
        assert h.opcode in set(Op) and h.result == 0 and h.length <= MAX_PAYLOAD


@FUZZ
@given(requests(), st.integers(0, HEADER_SIZE * 8 - 1))
def test_every_single_bit_flip_is_detected(h, bit):
    raw = bytearray(h.encode())
    raw[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(ProtocolError):
        decode(bytes(raw))


@FUZZ
@given(requests(), st.lists(st.integers(0, HEADER_SIZE * 8 - 1), min_size=1, max_size=16, unique=True))
def test_random_bit_flips_only_protocol_error(h, bits):
    raw = bytearray(h.encode())
    for bit in bits:
        raw[bit // 8] ^= 1 << (bit % 8)
    decode_or_protocol_error(bytes(raw))
    decode_or_protocol_error(bytes(raw), request=False)


# ---------------------------------------------------------------------------------------------- hello
hellos = st.builds(Hello, transport=st.sampled_from(list(Transport)), has_device=st.booleans(),
                   slots=st.integers(1, 4096), slot_size=st.integers(HEADER_SIZE, (1 << 32) - 1), node_id=U64)


@FUZZ
@given(hellos)
def test_hello_round_trip(hello):
    raw = hello.encode()
    assert len(raw) == HELLO_SIZE
    assert decode_hello(raw) == hello


@FUZZ
@given(st.binary(min_size=0, max_size=2 * HELLO_SIZE))
def test_hello_random_bytes_only_protocol_error(raw):
    try:
        decode_hello(raw)
    except ProtocolError as e:
        assert e.reason in PROTOCOL_REASONS


@FUZZ
@given(hellos, st.lists(st.integers(0, HELLO_SIZE * 8 - 1), min_size=1, max_size=8, unique=True))
def test_hello_bit_flips_only_protocol_error(hello, bits):
    raw = bytearray(hello.encode())
    for bit in bits:
        raw[bit // 8] ^= 1 << (bit % 8)
    try:
        got = decode_hello(bytes(raw))
    except ProtocolError as e:
        assert e.reason in PROTOCOL_REASONS
    else:   # the hello has no CRC: a surviving flip must still decode to something valid
        assert 1 <= got.slots <= 4096 and got.slot_size >= HEADER_SIZE and got.transport in set(Transport)


@pytest.mark.parametrize("mutate,reason", [
    (lambda b: b[:-1], "truncated"),
    (lambda b: b"XXXX" + b[4:], "bad_magic"),
    (lambda b: b[:10] + bytes([VERSION + 1]) + b[11:], "bad_version"),      # oldest spoken above the newest
    (lambda b: b[:5] + bytes([9]) + b[6:], "bad_transport"),
    (lambda b: b[:12] + struct.pack(">I", 0) + b[16:], "bad_slots"),       # slots at 12 (v3)
    (lambda b: b[:12] + struct.pack(">I", 4097) + b[16:], "bad_slots"),
    (lambda b: b[:16] + struct.pack(">I", HEADER_SIZE - 1) + b[20:], "bad_slots"),
])
def test_hello_malformations(mutate, reason):
    raw = Hello(transport=Transport.TCP, has_device=False, slots=64).encode()
    with pytest.raises(ProtocolError) as ei:
        decode_hello(mutate(raw))
    assert ei.value.reason == reason

