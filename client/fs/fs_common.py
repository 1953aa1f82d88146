"""What the FUSE handlers share: the request wrapper (errors -> errno, ``dnfs stats`` counts), an open file's
state, and the set-ID rules of writes and ACLs."""
from __future__ import annotations

import errno
import functools
import logging
import stat
import time

import trio

from client.fs import acl
from client.fs.fuse_types import FUSEError
from client.fs.meta import Attr, MetaError, Slice
from client.fs.writer import DataWriter, FileWriter, data_errno
from client.sdk import ClientError

log = logging.getLogger("client.fs.fs")

TIMEOUT = 1.0           # seconds the kernel may cache entries and attributes
CAPS = b"security.capability"      # the kernel asks for it before every write to a file (see ``getxattr``)
UNKNOWN = object()


def fuse_op(fn=None, *, name: str | None = None):
    """Turn metadata and cluster failures into the errno the kernel expects; never let a traceback out.
    Counts the requests in flight (``DnFS.inflight``), and each kind's requests, failures and time
    (``DnFS.ops``, shown by ``dnfs stats``; ``name``: the kind, if not the method's name)."""
    if fn is None:
        return functools.partial(fuse_op, name=name)
    name = name or fn.__name__

    @functools.wraps(fn)
    async def wrapper(self, *args, **kw):
        self.inflight += 1
        t0 = time.perf_counter()
        ok = False
        try:
            out = await fn(self, *args, **kw)
            ok = True
            return out
        except FUSEError:
            raise
        except MetaError as e:
            raise FUSEError(e.errno) from None
        except ClientError as e:
            raise FUSEError(data_errno(e, fn.__name__)) from None
        except OSError as e:
            raise FUSEError(e.errno or errno.EIO) from None
        except Exception:
            log.exception("%s failed", fn.__name__)
            raise FUSEError(errno.EIO) from None
        finally:
            self.inflight -= 1
            counted(self.ops, name, t0, ok)
    return wrapper


def counted(ops: dict, name: str, t0: float, ok: bool) -> None:
    """One request of kind ``name`` that started at ``t0`` (``perf_counter``) ended (``ok``: no errno), in
    ``dnfs stats``'s counts."""
    c = ops.get(name)
    if c is None:
        c = ops[name] = [0, 0, 0.0]
    c[0] += 1
    c[1] += not ok
    c[2] += time.perf_counter() - t0


class FileState(FileWriter):
    """What the mount holds for a file that is open (or still has unflushed bytes): its write-back state
    (:class:`client.fs.writer.FileWriter`) and what its reads keep."""

    def __init__(self, ino: int, size: int, writer: DataWriter):
        super().__init__(ino, size, writer.budget)
        self.slices: list[Slice] | None = None
        self.starts: list[int] = []
        self.gen = 0                      # bumped whenever the committed content changes
        # readahead: windows of committed bytes fetched (start, bytes; never changed once stored, so a read
        # answers with a view of one), the newest last, and the fetches under way (start, end, gen, done)
        self.windows: list[tuple[int, bytearray]] = []
        self.fetching: list[tuple[int, int, int, trio.Event]] = []
        self.last_end = -1                    # where the last read ended (a read starting near it is sequential)
        self.seen: tuple[int, int] = (0, 0)   # (mtime, ctime) of the last attributes we know
        self.committed_slices = 0             # slices committed since the last compaction check
        self.caps = UNKNOWN                  # its security.capability (None: it has none), once asked ...
        self.caps_gen = 0                     # ... and the changes of it begun here (DnFS.getxattr)
        self.no_privs = False                 # known to have no set-user/group-ID bit (DnFS._kill_suidgid)

    def changed(self) -> None:
        self.gen += 1
        self.slices = None
        self.windows = []

    def committed(self, attr: Attr, nslices: int) -> None:
        self.seen = (attr.mtime_ns, attr.ctime_ns)
        self.committed_slices += nslices
        self.changed()


def killed_privs(mode: int) -> int:
    """``mode`` without what a write, truncate or chown takes away."""
    mode &= ~stat.S_ISUID
    return mode & ~stat.S_ISGID if mode & stat.S_IXGRP else mode


def keeps_sgid(ctx, gid: int) -> bool:
    """May the caller of a request keep the set-group-ID bit of a file of group ``gid``?  (Asked of its
    /proc/PID/status: the request names only its fs uid and gid; a caller gone meanwhile may not.)"""
    try:
        with open(f"/proc/{ctx.pid}/status") as f:
            status = f.read()
    except OSError:
        return False
    return acl.in_group_or_capable(status, gid)

