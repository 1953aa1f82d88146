"""Nothing a peer does can end the datanode process, leave state behind, or reach the log as a traceback.

Each test plays a broken or hostile peer by hand over the TCP transport (lab/fuzz.py has the raw-peer
helpers), then checks what a user would notice (``lab.fuzz.Checker``): the process is alive, a normal
client writes and reads back 1 MiB, and the node's open connections and pool bytes are back at baseline.
"""
from __future__ import annotations

import json
import os
import random
import socket
import struct
import time

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from wire.auth import DialAuth
from wire.crc import crc32c
from wire.protocol import (BODY_REASONS, HELLO_SIZE, MAX_EPOCH, PROTOCOL_REASONS, Flag, Header, Hello, Op,
                               Result, Role, Transport)
from wire.transport.tcp import CTRL, FRAME, READ_REQ, READ_RESP, WRITE_REQ
from tests.conftest import open_client
from lab import fuzz

PEER_TIMEOUT = 2.0
SLACK = 5.0


@pytest.fixture
def node(nodes):
    [n] = nodes(1, transport="tcp", peer_timeout=PEER_TIMEOUT, payload_timeout=PEER_TIMEOUT, penalty_max_s=0.0)   # raw peers reconnect at once
    return n


@pytest.fixture
def checker(node):
    c = fuzz.Checker(node.addr)
    c.target = c.setup()
    return c


def no_tracebacks(node) -> None:
    text = node.log_path.read_text(errors="replace")
    assert "Traceback" not in text, text[text.index("Traceback") - 300:][:3000]


def healthy(node, checker) -> None:
    assert node.alive(), f"the datanode exited with status {node.proc.returncode}"
    checker.check()
    no_tracebacks(node)


# -- the reproduction from the issue, and every way a connection can end --------------------------------------
def test_reset_while_the_node_reads_the_hello(node, checker):
    host, _, port = node.addr.rpartition(":")
    for _ in range(5):
        s = socket.create_connection((host, int(port)))
        s.send(os.urandom(3))
        time.sleep(0.05)                              # the daemon is now reading the hello
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()                                     # RST
    time.sleep(0.2)
    healthy(node, checker)


def _write_header(t: fuzz.Target, extent: int, data: bytes, offset: int = 0) -> Header:
    return Header(opcode=Op.WRITE, partition=fuzz.CHECK_PARTITION, extent=extent, offset=offset, length=len(data),
                  crc=crc32c(data), epoch=t.epoch, addr=0x10000, rkey=77, rlen=len(data), req_id=5)


def _stage(s: socket.socket, stage: str, t: fuzz.Target, pool: dict, end: int) -> None:
    """Bring connection ``s`` to ``stage`` (the moment it is then ended); ``end``: the extent's size."""
    if stage == "before_hello":
        return
    if stage == "partial_hello":
        s.sendall(Hello(transport=Transport.TCP, has_device=False, slots=8).encode()[:HELLO_SIZE // 2])
        return
    if stage == "hello_unread":
        s.sendall(Hello(transport=Transport.TCP, has_device=False, slots=8).encode())
        return
    fuzz.hello(s)
    if stage == "after_hello":
        return
    if stage == "partial_frame_header":
        s.sendall(FRAME.pack(CTRL, 0, 0, 88, 0, 0, 0, 0)[:10])
    elif stage == "partial_control_frame":
        s.sendall(FRAME.pack(CTRL, 0, 0, 88, 0, 0, 0, 0) + Header(opcode=Op.PING).encode()[:40])
    elif stage in ("during_payload_read", "payload_read_unanswered"):
        # aimed at the extent's real end: were it not given up, it would hold up the extent's next append
        data = os.urandom(300_000)
        fuzz.send_ctrl(s, _write_header(t, t.extents[0], data, end).encode())
        ftype, _st, length, op, *_ = fuzz.recv_frame(s)
        assert ftype == READ_REQ and length == len(data)
        if stage == "during_payload_read":       # the one-sided READ's answer is cut
            s.sendall(FRAME.pack(READ_RESP, 0, 0, length, op, 0, 0, 0) + data[:length // 3])
    elif stage == "during_read_data_push":       # the node one-sided WRITEs read data to us; we cut it
        fuzz.send_ctrl(s, Header(opcode=Op.READ, partition=fuzz.CHECK_PARTITION, extent=t.extents[0], offset=0,
                                 length=256 * 1024, epoch=t.epoch, addr=0x20000, rkey=78, rlen=256 * 1024).encode())
        ftype, *_ = fuzz.recv_frame(s, body=False)
        assert ftype == WRITE_REQ
        fuzz.recv_exactly(s, 1000)
    elif stage == "while_node_serves_our_read":  # we one-sided READ the node's pool: nothing granted us, refused
        s.sendall(FRAME.pack(READ_REQ, 0, 0, 1 << 20, 9, pool["base_addr"], pool["rkey"], 0))
        ftype, status, length, *_ = fuzz.recv_frame(s, body=False)
        assert (ftype, length) == (READ_RESP, 0) and status != 0, "the node served its pool to a stranger"
    elif stage == "while_answer_is_sent":
        fuzz.send_ctrl(s, Header(opcode=Op.NODE_STATUS, addr=0x30000, rkey=79, rlen=1 << 16).encode())
    else:
        raise AssertionError(stage)


STAGES = ["before_hello", "partial_hello", "hello_unread", "after_hello", "partial_frame_header",
          "partial_control_frame", "during_payload_read", "payload_read_unanswered", "during_read_data_push",
          "while_node_serves_our_read", "while_answer_is_sent"]


def _pool_of(addr: str) -> dict:
    async def go():
        async with open_client("tcp", []) as dc:
            return await dc.admin(addr, Op.POOL_STATS)
    return trio.run(go)


def test_every_way_a_connection_can_end(node, checker):
    """FIN or RST at every stage of a connection's life: the node lives, nothing is left behind.  The
    checker's extent is the one the cut writes aimed at: its next append must go through at once."""
    pool = _pool_of(node.addr)
    ext = checker.target.extents[0]
    trio.run(_append_at_end, node.addr, ext, 256 * 1024)        # so the READ stage has something to read
    for stage in STAGES:
        for how in ("fin", "rst"):
            end = trio.run(_marks, node.addr)[ext]
            s = fuzz.connect(node.addr, timeout=5)
            try:
                _stage(s, stage, checker.target, pool, end)
            finally:
                fuzz.end(s, how)
            if stage in ("during_payload_read", "payload_read_unanswered"):
                t0 = time.monotonic()
                trio.run(_append_at_end, node.addr, ext)
                assert time.monotonic() - t0 < PEER_TIMEOUT, f"{stage}/{how}: the extent's next append waited"
        healthy(node, checker)


async def _marks(addr):
    async with open_client("tcp", [addr]) as dc:
        await dc.discover(addr)
        return await dc.watermarks(fuzz.CHECK_PARTITION)


async def _append_at_end(addr, extent, n: int = 11):
    async with open_client("tcp", [addr]) as dc:
        await dc.discover(addr)
        end = (await dc.watermarks(fuzz.CHECK_PARTITION))[extent]
        with trio.fail_after(PEER_TIMEOUT + SLACK):
            await dc.append(fuzz.CHECK_PARTITION, extent, end, os.urandom(n))


def test_a_peer_that_never_serves_its_payload_is_dropped(node, checker):
    """A WRITE whose buffer is never served: within payload_timeout the request is given up, its pool block
    freed, its place in the extent's order released and the silent peer's connection dropped."""
    sizes = trio.run(_marks, node.addr)
    ext = checker.target.extents[0]
    s = fuzz.connect(node.addr, timeout=PEER_TIMEOUT + SLACK)
    try:
        fuzz.hello(s)
        data = os.urandom(1 << 20)
        fuzz.send_ctrl(s, _write_header(checker.target, ext, data, sizes[ext]).encode())
        assert fuzz.recv_frame(s)[0] == READ_REQ
        # meanwhile another client appends to the same extent: it is served once the silent one is given up
        trio.run(_append_at_end, node.addr, ext)
        # the node hung up on the silent peer
        with pytest.raises((ConnectionError, OSError)):
            while True:
                fuzz.recv_frame(s)
    finally:
        fuzz.end(s, "fin")
    healthy(node, checker)


# -- bodies and fields a peer can get wrong: each a precise refusal, never a traceback ------------------------
def _admin(addr, op, body: bytes, **kw) -> Header:
    h = Header(opcode=op, length=len(body), addr=0x40000, rkey=80, rlen=kw.pop("rlen", len(body)), **kw)
    return fuzz.request(addr, h, body)


@pytest.mark.parametrize("body,reason", [
    (b"\xff\xfe", "not_json"), (b'"a string"', "not_an_object"), (b"null", "not_an_object"),
    (b'{"replicas": [null], "epoch": 2}', "replica_not_an_address"),
    (b'{"replicas": ["127.0.0.1:1", 5], "epoch": 2}', "replica_not_an_address"),
    (b'{"replicas": ["nohost"], "epoch": 2}', "replica_not_an_address"),
    (b'{"replicas": ["h:1"], "epoch": 18446744073709551616}', "epoch_out_of_range"),
    (b'{"replicas": ["h:1"], "epoch": "2"}', "epoch_not_an_integer"),
])
def test_bad_admin_bodies_are_precise_refusals(node, checker, body, reason):
    for op, pid in ((Op.PARTITION_CREATE, 1001), (Op.PARTITION_UPDATE, fuzz.CHECK_PARTITION)):
        r = _admin(node.addr, op, body, partition=pid, epoch=checker.target.epoch)
        assert (r.result, BODY_REASONS[r.arg]) == (Result.BAD_BODY, reason), r.result_text()
        assert reason.replace("_", " ") in r.result_text()
    healthy(node, checker)
    # the node still starts (nothing bad was saved)
    node.stop()
    node.start()
    checker.pid = node.pid
    healthy(node, checker)


def test_short_buffers_and_huge_fields_are_refused(node, checker):
    t = checker.target
    # a body whose buffer is one byte shorter than the body
    body = json.dumps({"replicas": [node.addr], "epoch": 2}).encode()
    r = _admin(node.addr, Op.PARTITION_CREATE, body, partition=1002, rlen=len(body) - 1)
    assert (r.result, PROTOCOL_REASONS[r.arg]) == (Result.PROTOCOL, "short_buffer")
    # an answer larger than the buffer the requester offers
    r = fuzz.request(node.addr, Header(opcode=Op.NODE_STATUS, addr=0x50000, rkey=81, rlen=10))
    assert r.result == Result.SHORT_BUFFER and r.arg > 10, r.result_text()
    # an epoch past 63 bits
    r = fuzz.request(node.addr, Header(opcode=Op.PING, epoch=MAX_EPOCH + 1))
    assert (r.result, PROTOCOL_REASONS[r.arg]) == (Result.PROTOCOL, "field_range")
    # a forwarded create of the largest id (from a peer naming the leader: without a secret nothing is proven,
    # but forwards are taken only from a peer that says it leads): refused, and later creates still work
    as_leader = DialAuth(None, Role.NODE, identity=node.addr)
    r = fuzz.request(node.addr, Header(opcode=Op.CREATE_EXTENT, partition=fuzz.CHECK_PARTITION, epoch=t.epoch,
                                       extent=(1 << 64) - 1, flags=Flag.FORWARDED), auth=as_leader)
    assert r.result == Result.OUT_OF_RANGE, r.result_text()
    # a read beyond the end names the extent's size
    r = fuzz.request(node.addr, Header(opcode=Op.READ, partition=fuzz.CHECK_PARTITION, epoch=t.epoch,
                                       extent=t.extents[0], offset=990, length=100, addr=0x60000, rkey=82,
                                       rlen=100))
    assert r.result == Result.OUT_OF_RANGE and "holds" in r.result_text(), r.result_text()
    healthy(node, checker)


# -- the wire fuzz, bounded for the suite (the soak is `python -m lab fuzz --seed N --cases N`) ------------------------
def test_wire_fuzz(node, checker):
    @settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", "250")), deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.sampled_from(fuzz.KINDS), st.sampled_from(fuzz.ENDINGS), st.integers(0, 2**32))
    def case(kind, ending, seed):
        fuzz.play(node.addr, fuzz.RandomDice(random.Random(seed)), checker.target, kind, ending)

    case()
    healthy(node, checker)
