"""Where a write's time goes across processes: timestamps of each append's steps, opt-in.

Once ``start(DIR)`` is called (a datanode's ``trace`` key, a client's ``TransportOptions.trace``; both
$DATANODE_TRACE where not given) a process notes, for every append, when it reached each step -- ``(step,
extent, offset, time.perf_counter())``, CLOCK_MONOTONIC, so the times of processes on one machine compare --
and writes them to ``DIR/trace-PID.json`` when it exits.
``bench/write_timeline.py`` runs a local cluster and a bench that way and prints the median time from the
client's submit to every step on every process: the hops between processes, each node's own work and its
flush, side by side.  Until then nothing is noted (``ON`` is False; call sites test it first).

A read's steps are noted too, named ``read.STEP`` (one node serves a read): the client's ``read.submit`` and
``read.answered``; on the node ``read.arrived``, ``read.started`` (its answer's byte budget and pool block
taken), ``read.disk`` (the bytes are in the block, CRC-checked), ``read.sent`` (in the socket, or posted on
verbs) and ``read.replied``.

Steps of an append: the client's ``submit`` and ``answered``; on each node, as leader (``L``) or follower (``F``),
``arrived`` (the request was cut from the stream), ``started`` (its handler runs), ``forwarded`` (the
forwards go out: leader), ``written`` (in the page cache), ``durable``, ``acked`` (every follower
answered: leader), ``replied`` (its answer goes out).  A step that sends is noted just *before* the send: the
process it wakes may run and note its own next step before the sender's send call returns.
"""
from __future__ import annotations

import atexit
import json
import os
import sys
import time

DIR: str | None = None
ON = False
LIMIT = 1_000_000                      # steps kept at most (a long run keeps its first ones)

_steps: list[tuple[str, int, int, float]] = []


def mark(step: str, extent: int, offset: int, at: float | None = None) -> None:
    """Note ``step`` of the append (or read) at ``extent``/``offset``, reached now or ``at`` (perf_counter)."""
    if len(_steps) < LIMIT:
        _steps.append((step, extent, offset, time.perf_counter() if at is None else at))


def arrived(read: bool, forwarded) -> str:
    return "read.arrived" if read else "arrived.F" if forwarded else "arrived.L"


def replied(read: bool, forwarded) -> str:
    return "read.replied" if read else "replied.F" if forwarded else "replied.L"


def _dump() -> None:
    if not _steps:
        return
    path = os.path.join(DIR, f"trace-{os.getpid()}.json")
    try:
        os.makedirs(DIR, exist_ok=True)
        with open(path, "w") as f:
            json.dump(_steps, f)
    except OSError as e:               # at exit: one line, not a traceback
        sys.stderr.write(f"trace: cannot write {path}: {e}\n")


def start(directory: str) -> None:
    """Note this process's steps from now on, written to ``directory`` at exit.  Process-wide: a second call
    keeps the first directory."""
    global DIR, ON
    if not ON:
        DIR, ON = directory, True
        atexit.register(_dump)
