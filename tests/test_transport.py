"""Transports over real sockets, in one process: both ends are the product's own dial/accept.

One-sided operations land exactly where they are aimed and only inside registered memory with the right; a
refusal does not take the connection down (TCP); a dying peer fails what is in flight promptly; control
messages keep their order; a requester that times out poisons its link; negotiation refuses what cannot work.
"""
from __future__ import annotations

import os
import pathlib
import socket
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from wire.pool import BuddyPool
from wire.protocol import Flag, Header, Op, Result, Transport, decode, decode_message
from wire.rpc import AnswerGroup, Requester, RequestTimeout
from wire.transport.base import (Access, ConnectionClosed, RemoteAccessError, TransportError, TransportOptions,
                                 address_of)
from wire.transport.connect import NegotiationError, accept, choose, dial, make_domain
from wire.transport.tcp import FRAME, WRITE_REQ, send_all
from tests.conftest import SLACK, TaskSteps, client_domain, open_client, pattern, run

KiB, MiB = 1 << 10, 1 << 20


class End:
    """One side: a domain with a readable region (``src``) and a writable one (``dst``)."""

    def __init__(self, transport: str, options: TransportOptions | None = None):
        self.domain = make_domain(transport, options) if options else client_domain(transport)
        self.src_pool, self.dst_pool = BuddyPool(8 * MiB, 8 * MiB), BuddyPool(8 * MiB, 8 * MiB)
        self.src = self.domain.register(self.src_pool.arena, self.src_pool.base_addr, Access.REMOTE_READ)
        self.dst = self.domain.register(self.dst_pool.arena, self.dst_pool.base_addr,
                                        Access.LOCAL_WRITE | Access.REMOTE_WRITE)
        self.conn = None


@asynccontextmanager
async def pair(transport: str, *, slots: int = 8, options: TransportOptions | None = None):
    """(client End, server End), connected through a real listening socket on 127.0.0.1; both domains made
    with ``options`` where given."""
    cli, srv = End(transport, options), End(transport, options)
    got = trio.Event()
    done = trio.Event()

    async def handler(stream):
        async with accept(stream.socket, "test-client", srv.domain, transport=transport, slots=slots) as conn:
            srv.conn = conn
            got.set()
            await done.wait()

    async with trio.open_nursery() as n:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = listeners[0].socket.getsockname()[1]
        n.start_soon(trio.serve_listeners, handler, listeners)
        async with dial("127.0.0.1", port, cli.domain, transport=transport, slots=slots) as conn:
            cli.conn = conn
            await got.wait()
            try:
                yield cli, srv
            finally:
                done.set()
        n.cancel_scope.cancel()


# ------------------------------------------------------------------------------------------- one-sided
@pytest.mark.parametrize("size", [1, 4095, 64 * KiB + 3, 4 * MiB])
@pytest.mark.parametrize("unlocked", [False, True], ids=["pyverbs-post", "unlocked-post"])
def test_one_sided_read_and_write_land_exactly(transport, size, unlocked):
    """On verbs both ways of posting: through pyverbs, and (DATANODE_VERBS_POST_THREAD_MIN) from a worker
    thread without the GIL for ops of at least 64 KiB."""
    if unlocked and transport != "verbs":
        pytest.skip("posting without the GIL is a verbs setting")

    async def body():
        async with pair(transport) as (cli, srv), tuned(srv, post_thread_min=64 * KiB if unlocked else 0):
            data = pattern(size, size)
            # READ: the server fetches from the client's readable region, at an odd offset
            cli.src.view[100:100 + size] = data
            srv.dst.view[:size + 2] = b"\xaa" * (size + 2)
            local = srv.dst.view[1:1 + size]
            await srv.conn.read(cli.src.remote(100, size), local, srv.dst)
            assert bytes(local) == data
            assert srv.dst.view[0] == 0xAA and srv.dst.view[size + 1] == 0xAA     # nothing around it touched
            # WRITE: the server pushes into the client's writable region
            cli.dst.view[:size + 20] = b"\x55" * (size + 20)
            await srv.conn.write(local, srv.dst, cli.dst.remote(10, size))
            assert bytes(cli.dst.view[10:10 + size]) == data
            assert bytes(cli.dst.view[:10]) == b"\x55" * 10
            assert bytes(cli.dst.view[10 + size:20 + size]) == b"\x55" * 10
            if transport == "tcp":
                assert srv.conn.stats.read_bytes == size and cli.conn.stats.served_read_bytes == size
                assert cli.conn.stats.served_write_bytes == size
            else:       # the READ and the WRITE went from a worker thread exactly when they were large
                assert srv.conn.info()["thread_posts"] == (2 if unlocked and size >= 64 * KiB else 0)
    run(body)


def test_one_sided_refusals_leave_memory_alone(transport):
    """Unknown rkey, out of bounds, or a right the region does not grant: RemoteAccessError, and the owner's
    memory is unchanged.  On TCP the connection survives each refusal."""
    async def body():
        async with pair(transport) as (cli, srv):
            n = 4096
            scratch = srv.dst.view[:n]
            scratch[:] = b"\x11" * n
            cli.src.view[:n] = b"\x22" * n
            cli.dst.view[:n] = b"\x33" * n
            src_len = cli.src.length
            attempts = {
                "read, unknown rkey": lambda: srv.conn.read(
                    Header(opcode=0, addr=cli.src.addr, rkey=cli.src.rkey ^ 0xFFFF, rlen=n).remote, scratch,
                    srv.dst),
                "read, past the end": lambda: srv.conn.read(
                    Header(opcode=0, addr=cli.src.addr + src_len - n // 2, rkey=cli.src.rkey, rlen=n).remote,
                    scratch, srv.dst),
                "read, write-only region": lambda: srv.conn.read(cli.dst.remote(0, n), scratch, srv.dst)
                if not (cli.dst.access & Access.REMOTE_READ) else None,
                "write, read-only region": lambda: srv.conn.write(scratch, srv.dst, cli.src.remote(0, n)),
                "write, before the start": lambda: srv.conn.write(
                    scratch, srv.dst, Header(opcode=0, addr=cli.dst.addr - n, rkey=cli.dst.rkey, rlen=n).remote),
            }
            refused = 0
            for what, attempt in attempts.items():
                op = attempt()
                if op is None:
                    continue
                refused += 1
                with trio.fail_after(10):
                    with pytest.raises((RemoteAccessError, ConnectionClosed)) as ei:
                        await op
                if transport != "tcp":
                    break          # verbs: the queue pair is in error after a remote access error
                assert isinstance(ei.value, RemoteAccessError), what
                assert bytes(scratch) == b"\x11" * n, what
                assert bytes(cli.src.view[:n]) == b"\x22" * n, what
                assert bytes(cli.dst.view[:n]) == b"\x33" * n, what
                # the connection is still good for legal operations
                await srv.conn.read(cli.src.remote(0, n), scratch, srv.dst)
                assert bytes(scratch) == b"\x22" * n
                scratch[:] = b"\x11" * n
            if transport == "tcp":
                assert refused >= 4 and cli.conn.stats.refused == refused
    run(body)


def test_a_posted_write_has_landed_before_the_next_control_message_and_a_refused_one_breaks_nothing(transport):
    """``write(posted=True)`` (a READ's answer) returns without waiting for the peer, but the peer lands its
    bytes before it handles the control message sent after it; a posted write the peer refuses raises
    nothing, lands nothing and leaves the connection working (TCP)."""
    async def body():
        async with pair(transport) as (cli, srv):
            for i, size in enumerate((1, 4 * KiB, MiB + 5)):
                data = pattern(i, size)
                srv.src.view[:size] = data
                cli.dst.view[:size] = b"\x00" * size
                await srv.conn.write(srv.src.view[:size], srv.src, cli.dst.remote(0, size), posted=True)
                await srv.conn.send(Header(opcode=Op.PING, arg=i).encode())
                with trio.fail_after(SLACK):
                    msg = decode(await cli.conn.recv())
                assert msg.arg == i and bytes(cli.dst.view[:size]) == data
            if transport != "tcp":
                return                  # verbs: a refused RDMA WRITE puts the queue pair in error
            cli.src.view[:100] = b"\x22" * 100
            await srv.conn.write(srv.src.view[:100], srv.src, cli.src.remote(0, 100), posted=True)  # read-only
            await srv.conn.send(Header(opcode=Op.PING, arg=9).encode())
            with trio.fail_after(SLACK):
                assert decode(await cli.conn.recv()).arg == 9
                while not srv.conn.stats.posted_refused:
                    await trio.sleep(0.01)
            assert bytes(cli.src.view[:100]) == b"\x22" * 100 and srv.conn.alive and cli.conn.alive
            await srv.conn.write(srv.src.view[:10], srv.src, cli.dst.remote(0, 10))     # still serves
            assert bytes(cli.dst.view[:10]) == bytes(srv.src.view[:10])
    run(body)


@pytest.mark.parametrize("unlocked", [False, True], ids=["pyverbs-post", "unlocked-post"])
def test_a_posted_write_hands_its_buffer_back_once_the_transport_is_done_with_it(transport, unlocked):
    """``write(posted=True, release=...)``: on verbs the call returns once the RDMA WRITE is posted (a READ's
    response goes out right behind it, not a completion later), and ``release`` runs once, on its completion
    -- the bytes are in the peer's memory by then; on TCP before the call returns.  A posted write the peer
    refuses (verbs: the queue pair fails) still hands its buffer back: a node's pool block is never lost.
    Posted from a worker thread without the GIL (verbs, >= 64 KiB: ``unlocked``), the completion may be
    taken while the post is awaited -- rxe moves the bytes inside the post -- so ``release`` may come first."""
    if unlocked and transport != "verbs":
        pytest.skip("posting without the GIL is a verbs setting")

    async def body():
        async with pair(transport) as (cli, srv), tuned(srv, post_thread_min=64 * KiB if unlocked else 0):
            for i, size in enumerate((4 * KiB, MiB + 5)):
                data = pattern(20 + i, size)
                srv.src.view[:size] = data
                cli.dst.view[:size] = b"\x00" * size
                seen = []

                def release():                        # verbs: completed, so the peer has the bytes
                    seen.append(transport == "tcp" or bytes(cli.dst.view[:size]) == data)
                await srv.conn.write(srv.src.view[:size], srv.src, cli.dst.remote(0, size), posted=True,
                                     release=release)
                if transport == "tcp":
                    assert seen == [True]             # copied into the socket: free at once
                elif unlocked and size >= 64 * KiB:
                    assert srv.conn.info()["thread_posts"] == 1
                else:
                    assert seen == []                 # posted, not waited for
                with trio.fail_after(SLACK):
                    while not seen:
                        await trio.sleep(0.001)
                await trio.sleep(0.05)
                assert seen == [True]                 # once, with the bytes already landed
            if transport == "tcp":
                return                                # TCP: a refusal is only counted (the test above)
            seen = []
            await srv.conn.write(srv.src.view[:100], srv.src, cli.src.remote(0, 100), posted=True,  # read-only
                                 release=lambda: seen.append("released"))
            with trio.fail_after(SLACK):
                while not seen:
                    await trio.sleep(0.01)
            assert seen == ["released"] and not srv.conn.alive
    run(body)


def test_a_grant_revoked_while_a_write_lands_under_it_takes_no_more_of_its_bytes():
    """TCP: the peer's one-sided WRITE into a granted range is half-way in when the grant is revoked (the
    request that named the range was cancelled or timed out, and its owner takes the memory back -- the
    SDK's read_into lands answers straight in the caller's buffer).  The rest of the payload must not land:
    the connection ends instead (half a payload cannot be skipped), and the memory keeps what it had."""
    async def body():
        async with pair("tcp") as (cli, srv):
            n = 256 * KiB
            buf = bytearray(b"\x5a" * n)
            mem = memoryview(buf)
            region = cli.domain.register(mem, address_of(mem), Access.LOCAL_WRITE | Access.REMOTE_WRITE,
                                         scoped=True)
            token, key = await cli.conn.grants.grant(region.addr, region.rkey, n, Access.REMOTE_WRITE)
            data = pattern(7, n)
            # the node's side of a WRITE, by hand, so that it can stop half-way: frame header, half the bytes
            await send_all(srv.conn._sock, FRAME.pack(WRITE_REQ, 0, 0, n, 1, region.addr, key, 0) + data[:n // 2])
            with trio.fail_after(SLACK):
                while bytes(mem[:n // 2]) != data[:n // 2]:
                    await trio.sleep(0.01)
            cli.conn.grants.drop(token)
            await cli.conn.grants.settle(token)
            try:
                await send_all(srv.conn._sock, data[n // 2:])
            except OSError:
                pass                          # the client may have closed its end already
            await trio.sleep(0.3)
            assert bytes(mem[n // 2:]) == b"\x5a" * (n - n // 2)
            assert not cli.conn.alive
            cli.domain.deregister(region)
    run(body)


# -------------------------------------------------------------------------------------------- control
def test_control_messages_keep_order_and_many_can_be_outstanding(transport):
    async def body():
        async with pair(transport, slots=16) as (cli, srv):
            for rnd in range(4):
                headers = [Header(opcode=Op.PING, req_id=rnd * 100 + i).encode() for i in range(16)]
                for h in headers:          # a full window: as many as the peer has slots
                    await cli.conn.send(h)
                with trio.fail_after(10):
                    got = [await srv.conn.recv() for _ in headers]
                assert got == headers
                for raw in got:            # and answers flow back the same way
                    await srv.conn.send(decode(raw).reply(Result.OK).encode())
                with trio.fail_after(10):
                    answers = [decode(await cli.conn.recv(), request=False) for _ in headers]
                assert [a.req_id for a in answers] == [decode(h).req_id for h in headers]
    run(body)


@asynccontextmanager
async def tuned(end, **settings):
    """Verbs: the process's device with other tuning (``spin_s``, ``unsignaled``) for one test."""
    dev = getattr(end.domain, "device", None)
    if dev is None:
        yield
        return
    saved = {k: getattr(dev, k) for k in settings}
    for k, v in settings.items():
        setattr(dev, k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(dev, k, v)


def test_inline_payloads_arrive_with_their_header(transport):
    """A small WRITE's payload travels in the same control message as its header (TCP: after it on the
    stream; verbs: in the same SEND, from the sender's registered send buffers, reused many times over);
    one larger than the connection's limit is refused before anything is sent, and the connection goes on."""
    async def body():
        async with pair(transport, slots=16) as (cli, srv):
            limit = cli.conn.max_inline
            assert limit >= 4 * KiB
            sizes = [1, 4095, limit] * 20                  # more messages than any ring of send buffers
            for rnd in range(0, len(sizes), 16):
                batch = sizes[rnd:rnd + 16]
                sent = []
                for i, n in enumerate(batch):
                    data = pattern(rnd + i, n)
                    h = Header(opcode=Op.WRITE, partition=1, extent=1, length=n, req_id=rnd + i,
                               flags=Flag.INLINE)
                    await cli.conn.send(h.encode(), memoryview(data))
                    sent.append((h, data))
                with trio.fail_after(10 * SLACK):
                    for h, data in sent:
                        got, payload = decode_message(await srv.conn.recv())
                        assert got.req_id == h.req_id and bytes(payload) == data
            with pytest.raises(ValueError):
                await cli.conn.send(Header(opcode=Op.WRITE, length=limit + 1, flags=Flag.INLINE).encode(),
                                    memoryview(bytes(limit + 1)))
            await cli.conn.send(Header(opcode=Op.PING, req_id=7).encode())
            with trio.fail_after(10 * SLACK):
                assert decode(await srv.conn.recv()).req_id == 7
    run(body)


@pytest.mark.parametrize("unsignaled", [False, True])
def test_many_messages_never_exhaust_the_send_queue(transport, unsignaled):
    """Far more messages than the send queue has entries (on verbs with unsignaled work requests most are: a
    later signaled completion must retire their entries, or the sender would wait for room forever)."""
    if unsignaled and transport != "verbs":
        pytest.skip("unsignaled work requests are a verbs setting")

    async def body():
        async with pair(transport, slots=16) as (cli, srv), tuned(cli, unsignaled=unsignaled):
            with trio.fail_after(120 * SLACK):
                for rnd in range(40):
                    headers = [Header(opcode=Op.PING, req_id=rnd * 16 + i).encode() for i in range(16)]
                    for h in headers:
                        await cli.conn.send(h)
                    got = [await srv.conn.recv() for _ in headers]
                    assert got == headers
                    for raw in got:
                        await srv.conn.send(decode(raw).reply(Result.OK).encode())
                    assert [decode(await cli.conn.recv(), request=False).req_id for _ in headers] == \
                        [decode(h).req_id for h in headers]
    run(body)


@pytest.mark.parametrize("transport", [pytest.param("verbs", marks=pytest.mark.verbs)], indirect=True)
def test_idle_verbs_connection_stops_polling(transport):
    """After traffic the completion poller busy-polls only briefly (DATANODE_VERBS_SPIN_US), then sleeps on
    the completion channel: an idle connection's poll count stands still."""
    async def body():
        async with pair(transport, slots=16) as (cli, srv), tuned(cli, spin_s=200e-6):
            for i in range(32):
                await cli.conn.send(Header(opcode=Op.PING, req_id=i).encode())
                await srv.conn.send(decode(await srv.conn.recv()).reply(Result.OK).encode())
                await cli.conn.recv()
            spins = lambda: cli.conn.info()["cq_spins"] + srv.conn.info()["cq_spins"]   # noqa: E731
            assert spins() > 0                       # it did poll while the messages came
            await trio.sleep(0.5 + cli.conn.info()["spin_us"] / 1e6)
            before = spins()
            await trio.sleep(1.0)
            assert spins() == before
    run(body)


@asynccontextmanager
async def requester(transport: str):
    """A Requester (its task running) on a fresh connection pair: ``(req, cli, srv)``; nothing answers it but
    the test, through ``srv``."""
    async with pair(transport) as (cli, srv):
        req = Requester(cli.conn)
        async with trio.open_nursery() as n:
            await n.start(req.run)
            yield req, cli, srv
            n.cancel_scope.cancel()


def test_peer_closing_fails_in_flight_operations_promptly(transport):
    async def body():
        async with requester(transport) as (req, cli, srv):
            pending = await req.submit(Header(opcode=Op.PING), timeout=30)   # never answered
            with trio.fail_after(SLACK):
                await srv.conn.aclose()
                with pytest.raises(TransportError):
                    await pending.result()
                with pytest.raises(TransportError):
                    await cli.conn.read(srv.src.remote(0, 10), cli.dst.view[:10], cli.dst)
            assert not req.alive
            with pytest.raises(TransportError):
                await req.submit(Header(opcode=Op.PING), timeout=30)
    run(body)


def test_request_timeout_poisons_the_link(transport):
    async def body():
        async with requester(transport) as (req, cli, srv):
            with trio.fail_after(0.5 + SLACK):
                with pytest.raises(RequestTimeout):
                    await req.call(Header(opcode=Op.PING), timeout=0.5)
            # its late answer could land in a slot nobody accounts for: the link is dead for good
            assert not req.alive
            with pytest.raises(TransportError):
                await req.call(Header(opcode=Op.PING), timeout=0.5)
    run(body)


def test_a_short_timeout_sent_after_a_long_one_still_fires_on_time(transport):
    """Requests keep no timer of their own -- the requester's task waits until the earliest deadline
    (rpc.Requester.run) --: a request with a short timeout sent after one with a long timeout still times out
    on time, and the long one fails with the link at once."""
    async def body():
        async with requester(transport) as (req, cli, srv):
            slow = await req.submit(Header(opcode=Op.PING, req_id=1), timeout=60)
            t0 = trio.current_time()
            with trio.fail_after(0.5 + SLACK):
                with pytest.raises(RequestTimeout):
                    await req.call(Header(opcode=Op.PING, req_id=2), timeout=0.5)
            assert trio.current_time() - t0 >= 0.5
            with trio.fail_after(SLACK):
                with pytest.raises(TransportError):
                    await slow.result()
            assert not req.alive
    run(body)


def test_answer_already_in_is_not_a_timeout(transport):
    """An answer that arrived before its deadline is delivered even if the caller looks late (a leader
    collects its followers' acks one after another)."""
    async def body():
        async with requester(transport) as (req, cli, srv):
            pending = await req.submit(Header(opcode=Op.PING, partition=5), timeout=0.5)
            raw = await srv.conn.recv()
            await srv.conn.send(decode(raw).reply(Result.OK, arg=42).encode())
            await trio.sleep(1.0)                   # past the deadline, answer long since in
            resp = await pending.result()
            assert (resp.result, resp.arg, resp.partition) == (Result.OK, 42, 5)
            assert req.alive
    run(body)


async def landed(pending) -> None:
    """Until a request's answer has been taken in by its requester (without waiting for it as a caller)."""
    with trio.fail_after(SLACK):
        while not pending.ended:
            await trio.sleep(0.001)


def test_a_group_of_requests_wakes_its_waiter_once_when_the_last_answer_is_in(transport):
    """A leader's forwards of one write, on two links, in one ``AnswerGroup``: the task collecting the acks
    is woken once, by the last one -- not by the first as it lands, to find the second still out."""
    async def body():
        async with requester(transport) as (req1, _c1, srv1), requester(transport) as (req2, _c2, srv2):
            group = AnswerGroup()
            p1 = await req1.submit(Header(opcode=Op.PING, partition=1), timeout=30, group=group)
            p2 = await req2.submit(Header(opcode=Op.PING, partition=2), timeout=30, group=group)
            group.seal()
            got = []

            async def collect(task_status=trio.TASK_STATUS_IGNORED):
                task_status.started(trio.lowlevel.current_task())
                got.append(await p1.result())
                got.append(await p2.result())

            async with trio.open_nursery() as n:
                steps = TaskSteps(await n.start(collect))
                trio.lowlevel.add_instrument(steps)
                await trio.testing.wait_all_tasks_blocked()
                before = steps.n
                raw = await srv1.conn.recv()
                await srv1.conn.send(decode(raw).reply(Result.OK).encode())
                await landed(p1)                          # the first answer is in ...
                await trio.testing.wait_all_tasks_blocked()
                assert got == [] and steps.n == before    # ... and woke nobody
                raw = await srv2.conn.recv()
                await srv2.conn.send(decode(raw).reply(Result.OK).encode())
            assert [r.partition for r in got] == [1, 2]
            assert steps.n == before + 1
    run(body)


def test_a_grouped_request_that_never_left_does_not_hold_up_the_others(transport):
    """A request of a group whose send fails (here: no credit before its timeout) is not waited for: the
    group's other answers still wake their waiter."""
    async def body():
        async with requester(transport) as (req1, _c1, srv1), requester(transport) as (req2, cli2, _s2):
            for _ in range(max(1, cli2.conn.slots)):       # every credit of link 2 taken, never answered
                await req2.submit(Header(opcode=Op.PING), timeout=30)
            group = AnswerGroup()
            p1 = await req1.submit(Header(opcode=Op.PING, partition=1), timeout=30, group=group)
            with trio.fail_after(0.3 + SLACK):
                with pytest.raises(RequestTimeout):
                    await req2.submit(Header(opcode=Op.PING, partition=2), timeout=0.3, group=group)
            group.seal()
            raw = await srv1.conn.recv()
            await srv1.conn.send(decode(raw).reply(Result.OK).encode())
            with trio.fail_after(SLACK):
                assert (await p1.result()).partition == 1
    run(body)


def test_an_answer_in_before_the_group_is_complete_does_not_end_the_wait_for_the_rest(transport):
    """The first forward's ack may land before the second forward is sent (a link being dialed): the group
    is not all in until it is sealed, so the second request is still waited for -- and answered."""
    async def body():
        async with requester(transport) as (req1, _c1, srv1), requester(transport) as (req2, _c2, srv2):
            group = AnswerGroup()
            p1 = await req1.submit(Header(opcode=Op.PING, partition=1), timeout=30, group=group)
            raw = await srv1.conn.recv()
            await srv1.conn.send(decode(raw).reply(Result.OK).encode())
            await landed(p1)
            p2 = await req2.submit(Header(opcode=Op.PING, partition=2), timeout=30, group=group)
            group.seal()
            assert (await p1.result()).partition == 1
            got = []

            async def second():
                got.append(await p2.result())

            with trio.fail_after(SLACK):
                async with trio.open_nursery() as n:
                    n.start_soon(second)
                    raw = await srv2.conn.recv()
                    await trio.sleep(0.05)
                    assert got == []                       # still waiting for its own answer
                    await srv2.conn.send(decode(raw).reply(Result.OK, arg=7).encode())
            assert [(r.partition, r.arg) for r in got] == [(2, 7)]
    run(body)


def test_send_nowait_sends_at_once_or_not_at_all(transport):
    """``send_nowait`` is how a node answers a request it did right where it arrived (no task may wait
    there): on TCP the answer is on its way at once when nobody else is sending; while another send holds
    the connection it sends nothing (False) and the caller sends it the usual way, behind the other one.  A
    transport with no such path (verbs) says False and sends nothing."""
    async def body():
        async with pair(transport) as (cli, srv):
            first = Header(opcode=Op.PING, req_id=1, partition=1).encode()
            assert cli.conn.send_nowait(5, first) == (transport == "tcp")
            if transport != "tcp":
                with trio.fail_after(SLACK):
                    with pytest.raises(trio.TooSlowError):       # nothing went
                        with trio.fail_after(0.2):
                            await srv.conn.recv()
                return
            with trio.fail_after(SLACK):
                assert decode(await srv.conn.recv()).req_id == 1
                async with cli.conn._sending():                   # another sender holds the connection
                    assert not cli.conn.send_nowait(5, Header(opcode=Op.PING, req_id=2).encode())
                assert await cli.conn.send_within(5, Header(opcode=Op.PING, req_id=3).encode())
                assert cli.conn.send_nowait(5, Header(opcode=Op.PING, req_id=4).encode())
                assert [decode(await srv.conn.recv()).req_id for _ in range(2)] == [3, 4]   # 2 never went
            assert cli.conn.alive and srv.conn.alive
    run(body)


# -------------------------------------------------------------------------------------------- negotiation
def test_choose_transport():
    A, T, V = Transport.AUTO, Transport.TCP, Transport.VERBS
    assert choose(A, A, True, True) == V
    assert choose(A, A, True, False) == T
    assert choose(A, T, True, True) == T
    assert choose(T, A, True, True) == T
    assert choose(V, A, True, True) == V
    for args in [(V, T, True, True), (T, V, True, True), (V, A, True, False), (A, V, False, True)]:
        with pytest.raises(NegotiationError):
            choose(*args)


def test_verbs_required_against_a_tcp_only_node_is_refused_cleanly(nodes):
    [node] = nodes(1, transport="tcp")
    host, port = node.addr.rsplit(":", 1)

    async def body():
        dom = client_domain("tcp")
        with trio.fail_after(10):
            with pytest.raises(TransportError) as ei:
                async with dial(host, int(port), dom, transport="verbs"):
                    pass
        assert "verbs" in str(ei.value) or "agree" in str(ei.value)
        async with open_client("tcp", [], domain=dom) as dc:          # the node is fine
            assert (await dc.admin(node.addr, Op.NODE_STATUS))["transport"] == "tcp"
    run(body)
    assert node.alive()


def test_garbage_instead_of_a_hello_costs_only_that_connection(nodes):
    [node] = nodes(1, transport="tcp")
    host, port = node.addr.rsplit(":", 1)
    for junk in [b"GET / HTTP/1.0\r\n\r\n" + b"x" * 64, os.urandom(200), b"DNHI"]:
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(junk)
            s.settimeout(10)
            try:
                s.shutdown(socket.SHUT_WR)    # the node may have cut it off already (ENOTCONN): fine
                while s.recv(4096):       # the node answers (or not) and closes; it must not hang
                    pass
            except (ConnectionResetError, OSError) as e:
                assert not isinstance(e, TimeoutError), "the node kept a garbage connection open"

    async def body():
        async with open_client("tcp", [node.addr]) as dc:
            assert (await dc.admin(node.addr, Op.NODE_STATUS))["pid"] == node.pid
    run(body)
    assert node.alive()


def test_a_peer_failing_the_same_way_again_and_again_does_not_fill_the_log(nodes):
    """Forty garbage hellos from one host in a row: each costs only its connection, and the node's log says
    so once (per host and kind of failure, every few seconds), not forty times."""
    [node] = nodes(1, transport="tcp")
    host, port = node.addr.rsplit(":", 1)
    for _ in range(40):
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(os.urandom(200))
            s.settimeout(10)
            try:
                s.shutdown(socket.SHUT_WR)
                while s.recv(4096):
                    pass
            except OSError:
                pass

    async def body():
        async with open_client("tcp", [node.addr]) as dc:
            assert (await dc.admin(node.addr, Op.NODE_STATUS))["pid"] == node.pid
    run(body)
    ended = [ln for ln in node.log_path.read_text().splitlines() if f"connection from {host}:" in ln
             and " ended: " in ln]
    assert 1 <= len(ended) <= 3, "\n".join(ended)


def test_oversized_control_frame_drops_only_that_connection(nodes):
    """A peer that sends a control message bigger than any slot is cut off; everybody else is served."""
    from lab.fuzz import recv_exactly
    from wire.protocol import HELLO_SIZE, Hello, decode_hello
    from wire.transport.tcp import CTRL, FRAME, MAX_CTRL
    [node] = nodes(1, transport="tcp")
    host, port = node.addr.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(Hello(transport=Transport.TCP, has_device=False, slots=4).encode())
        answer = decode_hello(recv_exactly(s, HELLO_SIZE))
        recv_exactly(s, answer.ident_len + answer.ext_len)
        s.sendall(FRAME.pack(CTRL, 0, 0, MAX_CTRL + 1, 0, 0, 0, 0) + b"\0" * (MAX_CTRL + 1))
        s.settimeout(10)
        try:
            assert s.recv(4096) == b""       # closed by the node, no answer
        except ConnectionResetError:
            pass

    async def body():
        async with open_client("tcp", [node.addr]) as dc:
            assert (await dc.admin(node.addr, Op.NODE_STATUS))["pid"] == node.pid
    run(body)
    assert node.alive()



_GC_SCRIPT = r"""
import gc
import trio
from wire.protocol import Header
from tests.test_transport import pair

async def refused_and_kept(transport):
    async with pair(transport) as (cli, srv):
        scratch = srv.dst.view[:4096]
        try:
            with trio.fail_after(10):
                await srv.conn.read(Header(opcode=0, addr=cli.src.addr, rkey=cli.src.rkey ^ 0xFFFF,
                                           rlen=4096).remote, scratch, srv.dst)
        except Exception as e:
            kept = e      # the traceback holds this frame, which holds kept: a reference cycle

for _ in range(10):
    trio.run(refused_and_kept, "verbs")
    gc.collect()
print("survived")
"""


@pytest.mark.verbs
def test_a_refused_one_sided_op_leaves_nothing_that_crashes_the_collector():
    """A refusal's traceback holds the frames of the failed op (its local buffer and whatever the transport
    kept for it).  Kept in a reference cycle, all of it reaches the cyclic garbage collector together; that
    must never crash the process (it did: a cffi buffer exported from the op's memoryview made CPython's
    memoryview tp_clear drop a buffer still in use, and pytest's final gc.collect segfaulted)."""
    from tests.conftest import _verbs_skip_reason
    if _verbs_skip_reason():
        pytest.skip(_verbs_skip_reason())
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-X", "faulthandler", "-c", _GC_SCRIPT], capture_output=True,
                       text=True, timeout=300, cwd=root)
    assert r.returncode == 0, (r.returncode, r.stdout[-2000:], r.stderr[-4000:])
    assert "survived" in r.stdout


def test_our_tcp_connections_use_cubic_where_the_kernel_lets_us_else_the_systems_default():
    """tune_socket (every connection a node or client opens or accepts): cubic by default
    (tcp_congestion, $DATANODE_TCP_CONGESTION; see transport/tcp.py for why not a BBR system default), the
    system's own where asked for "" or for a congestion control the kernel does not have."""
    from wire.transport import tcp
    proc = pathlib.Path("/proc/sys/net/ipv4")
    system = (proc / "tcp_congestion_control").read_text().strip()
    cubic_ok = "cubic" in (proc / "tcp_available_congestion_control").read_text().split() and (
        os.geteuid() == 0 or "cubic" in (proc / "tcp_allowed_congestion_control").read_text().split())
    assert TransportOptions().tcp_congestion == "cubic"
    assert TransportOptions.from_env(os.environ).tcp_congestion == os.environ.get("DATANODE_TCP_CONGESTION", "cubic")
    for asked, got in (("cubic", "cubic" if cubic_ok else system), ("", system), ("no-such-cc", system)):
        with socket.socket() as s:
            tcp.tune_socket(s, asked)
            assert tcp.congestion_of(s) == got, (asked, system)


@pytest.mark.parametrize("asked", ["reno", ""])
def test_a_domains_options_set_up_every_connection_it_dials_or_accepts(asked):
    """The congestion control a domain's TransportOptions name is the one its connections use, on both ends
    ("": the system's own)."""
    proc = pathlib.Path("/proc/sys/net/ipv4")
    if asked and asked not in (proc / "tcp_available_congestion_control").read_text().split():
        pytest.skip(f"this kernel has no {asked}")
    if asked and os.geteuid() != 0 and asked not in (proc / "tcp_allowed_congestion_control").read_text().split():
        pytest.skip(f"{asked} is not allowed to this user")
    want = asked or (proc / "tcp_congestion_control").read_text().strip()
    options = TransportOptions(tcp_congestion=asked)

    async def body():
        async with pair("tcp", options=options) as (cli, srv):
            assert cli.domain.options is srv.domain.options is options
            assert cli.conn.info()["congestion"] == srv.conn.info()["congestion"] == want
    run(body)
