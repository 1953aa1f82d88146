"""What one hop between two processes costs on this box, before any datanode code: the round trip of a
64-byte message over loopback TCP, with the serving and the asking end each either a plain blocking socket or
a trio task (our transport's lean way: try the kernel, ``wait_readable`` only when it would block -- as
wire/transport/tcp.py ``LeanSocket``), and trio's own ``SocketStream`` on both ends for comparison.

    python -m bench.hop_rtt                  # 3,000 round trips per variant, 0.5 ms apart (an idle peer)

The difference between the variants is what a trio wake-up adds to a hop; a replicated write at depth 1 makes
four such hops on its critical path (client -> leader -> follower -> leader -> client).
"""
from __future__ import annotations

import argparse
import os
import socket
import time

import trio

from bench.floors import loopback_pair


async def _lean_recv(s: socket.socket) -> bytes:
    while True:
        try:
            return s.recv(64)
        except BlockingIOError:
            await trio.lowlevel.wait_readable(s)


def _serve(s: socket.socket, how: str) -> None:
    if how == "blocking":
        while d := s.recv(64):
            s.send(d)
        return
    s.setblocking(False)

    async def lean():
        while d := await _lean_recv(s):
            s.send(d)

    async def stream():
        st = trio.SocketStream(trio.socket.from_stdlib_socket(s))
        while d := await st.receive_some(64):
            await st.send_all(d)
    trio.run(lean if how == "trio-lean" else stream)


def _ask(c: socket.socket, how: str, n: int, gap: float) -> list[float]:
    msg = b"x" * 64
    if how == "blocking":
        out = []
        for _ in range(n):
            t = time.perf_counter()
            c.send(msg)
            c.recv(64)
            out.append(time.perf_counter() - t)
            time.sleep(gap)
        return out
    c.setblocking(False)

    async def main():
        out = []
        st = trio.SocketStream(trio.socket.from_stdlib_socket(c)) if how == "trio-stream" else None
        for _ in range(n):
            t = time.perf_counter()
            if st is None:
                c.send(msg)
                await _lean_recv(c)
            else:
                await st.send_all(msg)
                await st.receive_some(64)
            out.append(time.perf_counter() - t)
            await trio.sleep(gap)
        return out
    return trio.run(main)


def one(server: str, client: str, n: int, gap: float) -> tuple[float, float]:
    c, s = loopback_pair()
    pid = os.fork()
    if pid == 0:
        c.close()
        try:
            _serve(s, server)
        finally:
            os._exit(0)
    s.close()
    try:
        rtts = sorted(_ask(c, client, n, gap))
    finally:
        c.close()
        os.waitpid(pid, 0)
    return rtts[len(rtts) // 2] * 1e3, rtts[len(rtts) // 10] * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=3000, help="round trips per variant")
    ap.add_argument("--gap-ms", type=float, default=0.5, help="pause between round trips (the peer goes idle)")
    ap.add_argument("--rounds", type=int, default=2, help="times each variant runs (interleaved)")
    a = ap.parse_args()
    variants = [("blocking", "blocking"), ("trio-lean", "blocking"), ("blocking", "trio-lean"),
                ("trio-lean", "trio-lean"), ("trio-stream", "trio-stream")]
    for r in range(a.rounds):
        for server, client in variants:
            p50, p10 = one(server, client, a.count, a.gap_ms / 1e3)
            print(f"round {r}  serving {server:11}  asking {client:11}  round trip p50 {p50:.3f} ms  p10 {p10:.3f} ms")


if __name__ == "__main__":
    main()
