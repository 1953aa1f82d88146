"""One open extent: its two files, what is known of them, and the locks that order readers and writers.

Concurrency: a per-extent mutation lock (``wlock``) serialises write/truncate/delete/close; reads run
concurrently with each other and with appends (they snapshot size + entries and only read bytes below the
snapshot, which are never rewritten); truncate/delete wait for in-flight reads to drain and block new ones
(``begin_exclusive``).
"""
from __future__ import annotations

import logging
import os
import pathlib
import threading

from .crcfile import ENTRY_SIZE, Entry
from .errors import StoreError, WouldBlock
from .files import O_CLOEXEC, O_DIRECT

log = logging.getLogger(__package__)


def extent_paths(d: pathlib.Path, eid: int) -> tuple[pathlib.Path, pathlib.Path, pathlib.Path]:
    """An extent's data file, CRC file and tombstone in the store's ``extents`` directory ``d``."""
    return d / f"{eid}.dat", d / f"{eid}.crc", d / f"{eid}.deleted"


class Extent:
    __slots__ = ("id", "dat", "crc", "size", "entries", "bad", "mu", "cond", "wlock", "readers",
                 "exclusive", "dead", "broken", "gen", "flock", "dirty_from", "durable", "direct", "filled",
                 "crc_filled", "slot_seq", "synced", "crc_synced")

    def __init__(self, eid: int, dat_fd: int, crc_fd: int, size: int, entries: list[Entry],
                 bad: set[int]):
        self.id = eid
        self.dat = dat_fd
        self.crc = crc_fd
        self.size = size
        self.entries = entries          # [(crc, covered)] per block; replaced/appended only under mu
        self.bad = bad                  # block indexes known to fail their CRC
        self.mu = threading.Lock()      # guards size/entries/readers/exclusive/dead (short holds only)
        self.cond = threading.Condition(self.mu)
        self.wlock = threading.Lock()   # serialises mutations (write / truncate / delete / close)
        self.readers = 0
        self.exclusive = False
        self.dead = False               # deleted or closed: fds are gone
        self.broken = None              # str: a failed fdatasync/rollback; writes refused until reopen
        self.gen = 0                    # bumped by every change of size/entries (the digest cache's key)
        # group commit (sync=always): appends leave their CRC entries in memory (``entries``) and mark the
        # first changed one in ``dirty_from``; ``flush`` syncs the data, then writes and syncs the entries,
        # and moves ``durable`` (bytes acknowledged-safe) up.  ``flock`` is held by a flush of this extent
        # and by truncate/delete/close, so no stale entry lands after them.
        self.flock = threading.Lock()
        self.dirty_from: int | None = None
        self.durable = size
        self.direct: int | None = None  # the data file opened O_DIRECT (on the first I/O that can use it); -1: cannot
        self.filled = size              # bytes the data file has (zero-filled ahead of size: prefill_bytes)
        self.crc_filled = len(entries) * ENTRY_SIZE   # bytes the CRC file has (below the slots)
        self.slot_seq: int | None = None    # the durable tail slot that describes ``durable`` (None: none does)
        self.synced = size                  # the data file's length known durable (its last fdatasync)
        self.crc_synced: int | None = None  # crc_filled at this process's last fdatasync of the CRC file (the
        #                                     slots' block included); None: none since open, truncate, sync=none

    # -- reader side ------------------------------------------------------------------------------------
    def begin_read(self, b0: int, b1: int, nowait: bool = False):
        with self.mu:
            while self.exclusive:
                if nowait:
                    raise WouldBlock(self.id)
                self.cond.wait()
            if self.dead:
                raise StoreError("not_found", f"extent {self.id} does not exist")
            self.readers += 1
            return self.size, self.entries[b0:b1 + 1]

    def end_read(self) -> None:
        with self.mu:
            self.readers -= 1
            if self.readers == 0 and self.exclusive:
                self.cond.notify_all()

    # -- exclusive side (caller holds wlock) ------------------------------------------------------------
    def begin_exclusive(self) -> None:
        with self.mu:
            self.exclusive = True
            while self.readers:
                self.cond.wait()

    def end_exclusive(self) -> None:
        with self.mu:
            self.exclusive = False
            self.cond.notify_all()

    def direct_fd(self) -> int:
        """The data file opened with O_DIRECT (the same inode as ``dat``), or -1 where the file system
        refuses O_DIRECT.  Called by a reader (between begin_read and end_read) or the writer (holding
        ``wlock``): the fds stay open meanwhile."""
        with self.mu:
            if self.direct is None:
                try:
                    self.direct = os.open(f"/proc/self/fd/{self.dat}", os.O_RDWR | O_DIRECT | O_CLOEXEC)
                except OSError as e:
                    log.info("extent %d: no O_DIRECT I/O (%s): through the page cache", self.id, e)
                    self.direct = -1
            return self.direct

    def close_fds(self) -> None:
        for fd in (self.dat, self.crc, self.direct):
            if fd is None or fd < 0:
                continue
            try:
                os.close(fd)
            except OSError:
                pass
        self.dat = self.crc = -1
        self.direct = None
