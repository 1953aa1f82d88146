"""The FUSE operations of dnfs (served by :mod:`client.fs.fuse_session` in the SDK's trio loop): POSIX calls -> metadata + data path.

Data path.  ``write`` hands the bytes to the mount's writer (:mod:`client.fs.writer`: write-back buffers,
flushes, retries, slices); ``flush`` (close), ``fsync`` and ``release`` flush synchronously -- with
``writeback`` (opt-in) a close only starts the flush: the closed file's state stays until its bytes are
written (``DataWriter.settle``), unmounting writes what is left.  ``read`` fetches the committed slices'
bytes (holes are zeros) with sequential readahead, then lays the unflushed bytes over them.  ``statfs``
reports the datanodes' disks (NODE_STATUS: size and free space) divided by the replica count, refreshed in the
background so ``df`` does not wait on the network.

Permissions: the kernel checks every access against the mode bits and the POSIX ACLs (default_permissions,
FUSE_POSIX_ACL) -- sticky directories, chown/chmod/utimes rules and clearing set-user-ID bits on write,
truncate and chown included.  What it leaves to the filesystem is done here and in :class:`Meta`: a new
inode's group and set-group-ID bit in a set-group-ID directory, ACL inheritance and the ACL/mode coupling
(:mod:`client.fs.acl`), clearing the set-group-ID bit when an ACL is set by a non-member, ENAMETOOLONG on
lookup.

Caching: the kernel page cache is kept across opens (``keep_cache``) while the file's mtime/ctime are those
we saw at its last close.  Close-to-open: ``flush`` on close commits, ``open`` reloads the slice list.

Inodes whose last link goes are removed when nothing has them open and the kernel has forgotten them;
their extents go to the deletion queue (:mod:`client.fs.reclaim`).
"""
from __future__ import annotations

import logging
import os
import time
from collections import Counter

import trio

from client.fs import acl
from client.fs.fs_common import TIMEOUT, FileState, fuse_op
from client.fs.fs_dir import DirOps
from client.fs.fs_file import FileOps
from client.fs.fs_xattr import XattrOps
from client.fs.fuse_types import EntryAttributes, StatvfsData
from client.fs.meta import DIRENT, ROOT, Attr, Meta, MetaError
from client.fs.reclaim import DataLock, Reclaimer
from client.fs.writeback import BUDGET, CHUNK, WRITE_RETRY_S
from client.fs.writer import DataWriter
from client.sdk import ClientError, DataClient
from wire.protocol import Op

log = logging.getLogger(__name__)

STATFS_CACHE_S = 2.0               # statfs answers from the datanodes' figures this old at most
STATFS_TIMEOUT_S = 2.0             # a datanode that does not report its disk within this is left out
INODES = 1 << 32                   # statfs: the inode count reported as the total (the metadata sets no limit)
ORPHAN_SWEEP_S = 5.0               # shared engines: how often unlinked inodes of dead mounts are looked for


class DnFS(DirOps, FileOps, XattrOps):
    """The mount's handlers: the superblock's part here (the inodes the kernel knows, statfs, sync, stats),
    directories, files and xattrs in their mixins."""
    enable_acl = acl.kernel_enforces(os.uname().release)   # the kernel enforces POSIX ACLs; Meta keeps the
                                                            # mode in step (without: ACLs are refused)

    def __init__(self, meta: Meta, dc: DataClient, partitions: list[int], nursery: trio.Nursery, *,
                 budget: int = BUDGET, chunk: int = CHUNK, write_retry_s: float = WRITE_RETRY_S,
                 writeback: bool = False):
        if not partitions:
            raise ValueError("no data partition to write to")
        self.meta, self.dc, self.partitions, self.nursery = meta, dc, partitions, nursery
        self.writeback = writeback        # close returns before its bytes are written (``flush``)
        self._cap: tuple[float, tuple[int, int]] | None = None     # (when, (total, free)) for statfs
        self._cap_refresh: trio.Event | None = None                # set when the running refresh ends
        self._usage: tuple[float, tuple[int, int]] | None = None   # (when, meta.usage()) for statfs
        self.lock = DataLock()
        self.reclaimer = Reclaimer(meta, dc, self.lock)
        self.writer = DataWriter(meta, dc, partitions, nursery, self.lock, budget=budget, chunk=chunk,
                                 write_retry_s=write_retry_s, forgotten=self._forgotten, lost=self._lost)
        self.files: dict[int, FileState] = self.writer.files     # open, or holding bytes not yet written
        self.handles: dict[int, int] = {}
        self.next_fh = 1
        self.lookups: Counter[int] = Counter()
        self.parents: dict[int, int] = {ROOT: ROOT}    # directory -> its parent, while the kernel knows it ("..")
        self.unlinked: set[int] = set()
        self.seen: dict[int, tuple[int, int]] = {}   # ino -> (mtime, ctime) at its last close
        self.negative_cache = meta.single_mount    # only this mount changes the tree: cache "no such name"
        self.inflight = 0                          # FUSE requests being served (``fuse_op``)
        # WRITEBACK_CACHE: the kernel writes a file's times back itself -- also right after unlinking a file
        # (its ctime): what an inode removed at its unlink was is kept for that until the kernel forgets it
        self.kernel_writes_back = False
        self.removed: dict[int, Attr] = {}
        self.read_fetched = 0                      # bytes reads fetched from the cluster (readahead included)
        self.ops: dict[str, list] = {}             # FUSE request kind -> [count, answered with an errno, seconds]
        meta.quiet = lambda: self.inflight <= 1    # the engine may block the loop for an fsync nobody waits behind
        self.timeout = TIMEOUT if meta.single_mount else 0.0   # shared: ask the metadata every time
        self.invalidate = None                     # ino -> None: drop the kernel's cache of it (the session's)

    # -- helpers
    async def startup(self) -> None:
        """Remove inodes a previous mount left unlinked but open (it crashed before their last close)."""
        await self.sweep_orphans()

    async def sweep_orphans(self) -> None:
        """Remove the inodes with no links left that no live mount has open any more."""
        removed = 0
        for ino in await self.meta.orphans():
            if ino not in self.files and await self.meta.remove(ino):
                removed += 1
                log.info("removed orphan inode %d (unlinked, and no mount has it open)", ino)
        if removed:
            self.reclaimer.kick()

    async def run_sweeper(self) -> None:
        """With a shared engine: a mount that died with unlinked files open leaves them to the others, once its
        session expired."""
        if self.meta.single_mount:
            return
        while True:
            await trio.sleep(ORPHAN_SWEEP_S)
            try:
                await self.sweep_orphans()
            except MetaError as e:
                log.warning("orphan sweep: %s", e)

    def entry(self, a: Attr) -> EntryAttributes:
        st = self.files.get(a.ino)
        e = EntryAttributes()
        e.st_ino = a.ino
        e.generation = 0
        e.entry_timeout = e.attr_timeout = self.timeout
        e.st_mode, e.st_nlink, e.st_uid, e.st_gid, e.st_rdev = a.mode, a.nlink, a.uid, a.gid, a.rdev
        e.st_size = max(a.size, st.size) if st is not None and st.pending else a.size
        if a.is_dir:
            e.st_size = max(e.st_size, 2 * DIRENT)     # a directory written before sizes were kept
        e.st_blksize = 1 << 20
        e.st_blocks = (e.st_size + 511) // 512
        e.st_atime_ns, e.st_mtime_ns, e.st_ctime_ns = a.atime_ns, a.mtime_ns, a.ctime_ns
        return e

    def _looked_up(self, a: Attr, parent: int) -> EntryAttributes:
        self.lookups[a.ino] += 1
        if a.is_dir:
            self.parents[a.ino] = parent
        return self.entry(a)

    async def _maybe_remove(self, ino: int) -> None:
        st = self.files.get(ino)
        if ino in self.unlinked and self.lookups[ino] <= 0 and (st is None or st.opens == 0):
            self.unlinked.discard(ino)
            if st is not None:
                st.buf.drop()                    # nobody can read them any more
                async with st.flush_lock:        # a flush under way commits first, then the inode goes
                    pass
            self.files.pop(ino, None)
            await self.meta.remove(ino)
            self.reclaimer.kick()

    def forget_now(self, inode_list) -> list[int]:
        """The kernel forgot inodes (FORGET, BATCH_FORGET: answered inline, no I/O); returns those that may go
        now (unlinked, and nothing has them open: ``remove_forgotten``)."""
        t0 = time.perf_counter()
        gone = []
        lookups = self.lookups
        for ino, n in inode_list:
            left = lookups[ino] - n
            if left > 0:
                lookups[ino] = left
                continue
            lookups.pop(ino, None)
            if ino != ROOT:
                self.parents.pop(ino, None)
                self.removed.pop(ino, None)
            if ino in self.unlinked:
                gone.append(ino)
        c = self.ops.get("forget")
        if c is None:
            c = self.ops["forget"] = [0, 0, 0.0]
        c[0] += 1
        c[2] += time.perf_counter() - t0
        return gone

    @fuse_op
    async def remove_forgotten(self, inos: list[int]) -> None:
        for ino in inos:
            await self._maybe_remove(ino)

    async def forget(self, inode_list):
        await self.remove_forgotten(self.forget_now(inode_list))

    async def flush_all(self) -> list[int]:
        """Write every file's buffered bytes; returns the inodes whose bytes could not be (EIO at their next
        close or fsync here)."""
        return await self.writer.flush_all()

    async def sync_all(self) -> dict:
        """What ``sync`` does for a local disk -- the kernel does not pass it to us (``dnfs sync``): every
        buffered byte written (write-back: closed files' too), and the metadata durable."""
        t0 = time.monotonic()
        before = self.unwritten() or (0, 0)
        failed = await self.flush_all()
        await self.meta.sync()
        return {"bytes": before[0], "files": before[1], "failed_inodes": failed,
                "seconds": round(time.monotonic() - t0, 3)}

    def stats(self) -> dict:
        """What the mount holds and has done (``dnfs stats``)."""
        held = list(self.files.values())
        left = self.unwritten() or (0, 0)
        return {"pid": os.getpid(), "writeback": self.writeback, "open_files": sum(1 for st in held if st.opens),
                "files_held": len(held), "unwritten_bytes": left[0], "unwritten_files": left[1],
                "buffer_budget": self.writer.budget.limit, "background_flushes": self.writer.background_flushes,
                "read_fetched_bytes": self.read_fetched,
                "files_failed": sum(1 for st in held if st.error is not None),
                "requests": {k: {"count": c, "failed": f, "seconds": round(t, 3)}
                             for k, (c, f, t) in sorted(self.ops.items())},
                "meta": self.meta.stats()}

    def unwritten(self) -> tuple[int, int] | None:
        """(bytes, files) buffered and not yet written, if any."""
        return self.writer.unwritten()

    # -- file system
    async def capacity(self) -> tuple[int, int]:
        """(total, free) bytes for files: the datanodes' reported disks (NODE_STATUS ``disk``) summed over the
        nodes holding our partitions, divided by the replica count (every byte is stored that many times).
        Answered from the last figures; figures older than ``STATFS_CACHE_S`` are refreshed in the background
        (a ``df`` never waits on a slow node) -- only the first call waits, at most ``STATFS_TIMEOUT_S``."""
        if self._cap is None or trio.current_time() - self._cap[0] >= STATFS_CACHE_S:
            if self._cap_refresh is None:
                self._cap_refresh = trio.Event()
                self.nursery.start_soon(self._refresh_capacity, self._cap_refresh)
            if self._cap is None:
                with trio.move_on_after(STATFS_TIMEOUT_S):
                    await self._cap_refresh.wait()
        return self._cap[1] if self._cap is not None else (0, 0)

    async def _refresh_capacity(self, done: trio.Event) -> None:
        """Asks every node holding our partitions for its disk (a node that does not answer within
        ``STATFS_TIMEOUT_S`` is left out, its share estimated from the others); with no answer at all the
        last known figures stand."""
        try:
            parts = [self.dc.partitions[p] for p in self.partitions if p in self.dc.partitions]
            addrs = sorted({a for p in parts for a in p.replicas})
            copies = max((len(p.replicas) for p in parts), default=1) or 1
            disks: dict[str, dict] = {}

            async def ask(addr):
                with trio.move_on_after(STATFS_TIMEOUT_S):
                    try:
                        st = await self.dc.admin(addr, Op.NODE_STATUS)
                    except ClientError as e:
                        log.debug("statfs: %s: %s", addr, e)
                        return
                    d = st.get("disk") or {}
                    if "total" in d:
                        disks[addr] = d

            async with trio.open_nursery() as n:
                for a in addrs:
                    n.start_soon(ask, a)
            if disks:
                total = sum(d["total"] for d in disks.values()) * len(addrs) // len(disks) // copies
                free = sum(d["free"] for d in disks.values()) * len(addrs) // len(disks) // copies
                self._cap = (trio.current_time(), (total, free))
            elif self._cap is None:
                log.warning("statfs: no datanode reported its disk (%s)", ", ".join(addrs) or "no nodes")
        finally:
            self._cap_refresh = None
            done.set()

    async def usage(self) -> tuple[int, int]:
        """(inodes, bytes the files hold) from the metadata, cached as long as ``capacity``."""
        if self._usage is None or trio.current_time() - self._usage[0] >= STATFS_CACHE_S:
            self._usage = (trio.current_time(), await self.meta.usage())
        return self._usage[1]

    @fuse_op
    async def statfs(self, ctx):
        """The cluster's capacity as the datanodes report it, each byte stored once per replica: size, what
        their disks can still take (available) and the rest (used -- whatever fills the disks, so a full
        cluster shows full).  Inodes: the metadata sets no limit; 2^32 stands for it."""
        inodes, _held = await self.usage()
        total, free = await self.capacity()
        s = StatvfsData()
        s.f_bsize, s.f_frsize, s.f_namemax = 1 << 20, 4096, 255
        s.f_bfree = s.f_bavail = free // s.f_frsize
        s.f_blocks = max(total // s.f_frsize, s.f_bfree)
        s.f_files = max(INODES, inodes)
        s.f_ffree = s.f_favail = s.f_files - inodes
        return s

