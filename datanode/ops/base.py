"""What every request handler uses: the request as the wrapper hands it over (``Request``), ``Reply`` (raised
to answer with a result code), the node's request counters, and the store off the event loop.  Anything a
handler cannot answer (the peer is gone) is a ``TransportError``; ``PeerTimeout`` drops the peer."""
from __future__ import annotations

import dataclasses
from typing import Awaitable, Callable

from wire.aio import Workers
from wire.protocol import BODY_REASONS, BodyError, Header, Result
from wire.transport.base import Connection, TransportError
from ..partition import EarlierWriteFailed, ExtentLane
from ..store import StoreCode, StoreError, WouldBlock, io_error
from .run import AppendRun
from .stages import Stages

LOOP_IO = 128 << 10       # appends and reads up to this size run in the event loop (page cache; no thread hop)
DISK = Workers(name="disk")   # the threads store calls run in (the process's; aio.Workers: a lean hand-over)
STORE_RESULTS = {StoreCode.NOT_FOUND: Result.NOT_FOUND, StoreCode.DELETED: Result.NOT_FOUND,
                 StoreCode.EXISTS: Result.EXISTS, StoreCode.WRONG_OFFSET: Result.WRONG_OFFSET,
                 StoreCode.OUT_OF_RANGE: Result.OUT_OF_RANGE, StoreCode.TOO_LARGE: Result.TOO_LARGE,
                 StoreCode.CRC: Result.CRC_MISMATCH, StoreCode.NO_SPACE: Result.NO_SPACE,
                 StoreCode.DISK: Result.DISK_ERROR}
assert set(STORE_RESULTS) == set(StoreCode)


class Reply(Exception):
    """Raised inside a handler to answer with a result code (and arg)."""

    def __init__(self, result: Result, arg: int = 0, why: str = ""):
        self.result, self.arg, self.why = result, arg, why
        super().__init__(why or result.name)


class PeerTimeout(TransportError):
    """The peer did not serve a one-sided op on its buffer in time: its connection is dropped -- after the
    request is answered ``result``, where there is one (a payload not fetched within ``payload_timeout``)."""

    def __init__(self, why: str, result: Result | None = None):
        super().__init__(why)
        self.result = result


def bad_body(e: BodyError) -> Reply:
    return Reply(Result.BAD_BODY, arg=BODY_REASONS.index(e.reason), why=str(e))


def store_reply(e: StoreError) -> Reply:
    return Reply(STORE_RESULTS[e.code], arg=e.arg, why=str(e))


class Request:
    """One request as its handler sees it, made by the wrapper (ops/wrap.py) when the request arrives: the
    connection, the header, the extent lane's ticket taken at arrival (WRITE, TRUNCATE; None if the extent
    does not exist), an inline payload, how many requests it answers (a run of appends: ``AppendRun``), and
    the recorder its handler notes its steps in."""

    __slots__ = ("conn", "h", "ticket", "payload", "run", "t0", "requests", "stages")

    def __init__(self, conn: Connection, h: Header, ticket: tuple[ExtentLane, int] | None, payload,
                 run: AppendRun | None, t0: float):
        self.conn, self.h, self.ticket, self.payload, self.run, self.t0 = conn, h, ticket, payload, run, t0
        self.requests = 1
        self.stages = Stages()


Handler = Callable[[Request], Awaitable[Header]]


@dataclasses.dataclass
class RequestCounters:
    requests: int = 0
    protocol_errors: int = 0
    forbidden: int = 0             # requests refused for the connection's role or node identity
    fenced: int = 0                # leader requests refused while self-fenced (etcd lease expired)
    busy_inflight: int = 0         # requests answered BUSY because their connection had max_inflight in flight
    penalties: int = 0             # peers dropped for breaking the rules (their host's next connections wait)
    views_refused: int = 0         # view changes refused: their leader not known to hold every acknowledged byte
    synced_confirms: int = 0       # follower: its leader confirmed this copy complete (ops/repair.py)
    writes: int = 0                # client appends acknowledged (as leader)
    replica_writes: int = 0        # forwarded appends applied (as follower)
    joined_writes: int = 0         # of both, those that went in the same append as the one before (AppendRun)
    appends_now: int = 0           # of replica_writes, those done right where they arrived (Appends.now)
    lean_writes: int = 0           # of writes and replica_writes, those done by their connection's thread (ops/lean.py)
    write_bytes: int = 0
    reads: int = 0
    read_bytes: int = 0
    answers_refused: int = 0       # READ answers (posted one-sided writes) the peer refused, of ended connections
    # follower: bytes READ from leaders' pools, by the leader's connection (its node identity, or its address
    # when authentication is off; not by rkey: on verbs every forward carries a fresh window rkey); a bounded
    # table, whatever peers send
    forward_fetch_bytes_by_leader: dict = dataclasses.field(default_factory=dict)

    def count_forward_fetch(self, leader: str, n: int, *, keys: int = 16) -> None:
        t = self.forward_fetch_bytes_by_leader
        k = leader if leader in t or len(t) < keys else "other"
        t[k] = t.get(k, 0) + n


# -- the store off the event loop ---------------------------------------------------------------------------
async def store_call(fn, *args):
    """A blocking store call in a worker thread (``DISK``); its failure as the one matching result code."""
    try:
        return await DISK.run_sync(fn, *args)
    except StoreError as e:
        raise store_reply(e) from None
    except OSError as e:
        raise store_reply(io_error(getattr(fn, "__name__", "disk"), e)) from None


async def appended(lane: ExtentLane, handed) -> int:
    """The extent's new size once a handed-over append is written; its failure as the matching result code
    (DIVERGED when an earlier write of the extent failed and this one was not done)."""
    try:
        return await handed.result()
    except EarlierWriteFailed as e:
        raise Reply(Result.DIVERGED, why=str(e)) from None
    except StoreError as e:
        raise store_reply(e) from None
    except OSError as e:
        raise store_reply(io_error("append", e)) from None
    finally:
        lane.handed_back()


async def read_into(store, extent: int, offset: int, length: int, view) -> int:
    """``store.read_into``: right here when the bytes are in the page cache and the extent is not being
    truncated (RWF_NOWAIT: no thread hop, never blocks the loop), else in a worker thread -- so a read waits
    neither for a thread when it need not, nor behind the disk when another read must."""
    if length <= LOOP_IO:
        try:
            return store.read_into(extent, offset, length, view, nowait=True)
        except WouldBlock:
            pass
        except StoreError as e:
            raise store_reply(e) from None
        except OSError as e:
            raise store_reply(io_error("read", e)) from None
    return await store_call(store.read_into, extent, offset, length, view)
