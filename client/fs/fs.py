"""The FUSE operations of dnfs (served by :mod:`client.fs.fuse_session` in the SDK's trio loop): POSIX calls -> metadata + data path.

Data path.  ``write`` hands the bytes to the mount's writer (:mod:`client.fs.writer`: write-back buffers,
flushes, retries, slices); ``flush`` (close), ``fsync`` and ``release`` flush synchronously -- with
``writeback`` (opt-in) a close only starts the flush: the closed file's state stays until its bytes are
written (``DataWriter.settle``), unmounting writes what is left.  ``read`` fetches the committed slices'
bytes (holes are zeros) with sequential readahead, then lays the unflushed bytes over them.  ``statfs``
reports what the files hold as used and the datanodes' free space (NODE_STATUS) divided by the replica count
as available; the size is their sum, as ``df`` expects.

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

import bisect
import errno
import functools
import logging
import os
import stat
import time
from collections import Counter

import trio

from client.fs import acl
from client.fs.fuse_types import (ENOATTR, RENAME_EXCHANGE, RENAME_NOREPLACE, EntryAttributes, FileInfo,
                                   FUSEError, StatvfsData)
from client.fs.meta import DIRENT, ROOT, Attr, Meta, MetaError, Slice
from client.fs.reclaim import DataLock, Reclaimer
from client.fs.writeback import BUDGET, CHUNK, WRITE_RETRY_S
from client.fs.writer import DataWriter, FileWriter, data_errno
from client.sdk import ClientError, DataClient
from wire.protocol import Op

log = logging.getLogger(__name__)

TIMEOUT = 1.0           # seconds the kernel may cache entries and attributes
READAHEAD = 4 << 20
COMPACT_SLICES = 256               # a file with this many slices is rewritten at its last close ...
COMPACT_MAX_BYTES = 256 << 20      # ... if it is no larger than this
STATFS_CACHE_S = 2.0               # statfs answers from the datanodes' figures this old at most
STATFS_TIMEOUT_S = 2.0             # a datanode that does not report its disk within this is left out
INODES = 1 << 32                   # statfs: the inode count reported as the total (the metadata sets no limit)
ORPHAN_SWEEP_S = 5.0               # shared engines: how often unlinked inodes of dead mounts are looked for
CAPS = b"security.capability"      # the kernel asks for it before every write to a file (see ``getxattr``)
_UNKNOWN = object()


def fuse_op(fn):
    """Turn metadata and cluster failures into the errno the kernel expects; never let a traceback out.
    Counts the requests in flight (``DnFS.inflight``), and each kind's requests, failures and time
    (``DnFS.ops``, shown by ``dnfs stats``)."""
    name = fn.__name__

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
            c = self.ops.get(name)
            if c is None:
                c = self.ops[name] = [0, 0, 0.0]
            c[0] += 1
            c[1] += not ok
            c[2] += time.perf_counter() - t0
    return wrapper


class FileState(FileWriter):
    """What the mount holds for a file that is open (or still has unflushed bytes): its write-back state
    (:class:`client.fs.writer.FileWriter`) and what its reads keep."""

    def __init__(self, ino: int, size: int, writer: DataWriter):
        super().__init__(ino, size, writer.budget)
        self.slices: list[Slice] | None = None
        self.starts: list[int] = []
        self.gen = 0                      # bumped whenever the committed content changes
        self.ra: tuple[int, bytearray] | None = None         # readahead: the current window ...
        self.ra_next: tuple[int, bytearray] | None = None    # ... the next one, fetched in the background
        self.prefetch: tuple[int, int, trio.Event] | None = None
        self.last_end = -1
        self.seen: tuple[int, int] = (0, 0)   # (mtime, ctime) of the last attributes we know
        self.committed_slices = 0             # slices committed since the last compaction check
        self.caps = _UNKNOWN                  # its security.capability (None: it has none), once asked ...
        self.caps_gen = 0                     # ... and the changes of it begun here (DnFS.getxattr)
        self.no_privs = False                 # known to have no set-user/group-ID bit (DnFS._kill_suidgid)

    def changed(self) -> None:
        self.gen += 1
        self.slices = None
        self.ra = self.ra_next = None

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


class DnFS:
    enable_writeback_cache = False
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
        self._cap_lock = trio.Lock()
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

    def _raise_error(self, st: FileState) -> None:
        err = st.take_error()
        if err is not None:
            raise FUSEError(err)

    def _forgotten(self, st: FileState) -> None:
        """The writer let go of a closed file: what it was at its close decides ``keep_cache`` at the next open."""
        if st.ino not in self.unlinked:
            self.seen[st.ino] = st.seen

    def _lost(self, st: FileState) -> None:
        """A failed flush let go of bytes the cluster does not hold: what we and the kernel cache of the file
        (its pages, its size) must not show them; its next open starts with an empty page cache."""
        st.changed()
        st.seen = (-1, -1)
        self.nursery.start_soon(self._uncache, st.ino)

    async def _uncache(self, ino: int) -> None:
        if self.invalidate is None:
            return
        try:        # in a thread, never in the request that failed: the kernel may hold the pages it writes
            await trio.to_thread.run_sync(self.invalidate, ino)
        except OSError as e:
            log.debug("invalidating inode %d: %s", ino, e)

    async def _kill_suidgid(self, ino: int, st: FileState | None = None) -> None:
        """What a write, truncate or chown by a caller without CAP_FSETID does to a file (the kernel leaves it
        to us, FUSE_HANDLE_KILLPRIV_V2): set-user-ID goes, and set-group-ID if the group may execute it.
        With a single-mount engine an open file known to have neither is not asked again."""
        if st is not None and st.no_privs:
            return
        a = await self.meta.getattr(ino)
        mode = killed_privs(a.mode)
        if mode != a.mode:
            a = await self.meta.setattr(ino, mode=mode, ctime_ns=time.time_ns())
            if st is not None:
                st.seen = (a.mtime_ns, a.ctime_ns)
        elif st is not None and self.meta.single_mount and not a.mode & (stat.S_ISUID | stat.S_ISGID):
            st.no_privs = True

    async def _truncate(self, st: FileState, size: int) -> Attr:
        await self._flush_checked(st)
        async with st.flush_lock:
            a = await self.meta.truncate(st.ino, size, time.time_ns())
            st.seen = (a.mtime_ns, a.ctime_ns)
            st.buf.truncate(size)
            st.size = size
            st.changed()
        return a

    async def _flush_checked(self, st: FileState) -> None:
        await self.writer.flush(st)
        self._raise_error(st)

    # -- attributes and names
    @fuse_op
    async def lookup(self, parent_inode, name, ctx=None):
        try:
            return self._looked_up(await self.meta.lookup(parent_inode, name), parent_inode)
        except MetaError as e:
            if e.errno != errno.ENOENT or not self.negative_cache:
                raise
            neg = EntryAttributes()     # inode 0: the kernel caches "no such name" for a while
            neg.st_ino = 0
            neg.entry_timeout = TIMEOUT
            return neg

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

    @fuse_op
    async def getattr(self, inode, ctx=None):
        return self.entry(await self.meta.getattr(inode))

    @fuse_op
    async def setattr(self, inode, attr, fields, fh, ctx):
        now = time.time_ns()
        mode = attr.st_mode if fields.update_mode else None
        st = self.files.get(inode)
        if st is not None and (fields.update_mode or fields.update_uid or fields.update_gid):
            st.no_privs = False
        if getattr(fields, "kill_suidgid", False) and mode is None:
            cur = await self.meta.getattr(inode)
            if killed_privs(cur.mode) != cur.mode:
                mode = killed_privs(cur.mode)
        if fields.update_size:
            st = self.files.get(inode)
            if st is not None:
                a = await self._truncate(st, attr.st_size)
            else:
                a = await self.meta.truncate(inode, attr.st_size, now)
            self.reclaimer.kick()
        if mode is not None or fields.update_uid or fields.update_gid or fields.update_atime \
                or fields.update_mtime or not fields.update_size:
            a = await self.meta.setattr(
                inode, mode=mode,
                uid=attr.st_uid if fields.update_uid else None, gid=attr.st_gid if fields.update_gid else None,
                atime_ns=attr.st_atime_ns if fields.update_atime else None,
                mtime_ns=attr.st_mtime_ns if fields.update_mtime else None, ctime_ns=now)
            st = self.files.get(inode)
            if st is not None:
                if fields.update_mtime:
                    st.mtime_ns = attr.st_mtime_ns
                st.seen = (a.mtime_ns, a.ctime_ns)
        return self.entry(a)

    @fuse_op
    async def readlink(self, inode, ctx):
        return await self.meta.readlink(inode)

    @fuse_op
    async def mknod(self, parent_inode, name, mode, rdev, ctx):
        return self._looked_up(await self.meta.create(parent_inode, name, mode, ctx.uid, ctx.gid, rdev),
                               parent_inode)

    @fuse_op
    async def mkdir(self, parent_inode, name, mode, ctx):
        return self._looked_up(await self.meta.create(parent_inode, name, stat.S_IFDIR | (mode & 0o7777),
                                                      ctx.uid, ctx.gid), parent_inode)

    @fuse_op
    async def symlink(self, parent_inode, name, target, ctx):
        return self._looked_up(await self.meta.create(parent_inode, name, stat.S_IFLNK | 0o777, ctx.uid,
                                                      ctx.gid, target=target), parent_inode)

    @fuse_op
    async def link(self, inode, new_parent_inode, new_name, ctx):
        return self._looked_up(await self.meta.link(inode, new_parent_inode, new_name), new_parent_inode)

    @fuse_op
    async def unlink(self, parent_inode, name, ctx):
        a, gone = await self.meta.unlink(parent_inode, name, held=self.files.__contains__)
        if gone:
            self.seen.pop(a.ino, None)
            self.reclaimer.kick()
        elif a.nlink <= 0:
            self.unlinked.add(a.ino)
            await self._maybe_remove(a.ino)

    @fuse_op
    async def rmdir(self, parent_inode, name, ctx):
        await self.meta.rmdir(parent_inode, name)

    @fuse_op
    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):
        replaced = await self.meta.rename(parent_inode_old, name_old, parent_inode_new, name_new,
                                          noreplace=bool(flags & RENAME_NOREPLACE),
                                          exchange=bool(flags & RENAME_EXCHANGE))
        if replaced is not None and replaced.nlink <= 0:
            self.unlinked.add(replaced.ino)
            await self._maybe_remove(replaced.ino)
        if parent_inode_old != parent_inode_new:       # a directory moved: its ".." is the new parent
            moved = [(parent_inode_new, name_new)]
            if flags & RENAME_EXCHANGE:
                moved.append((parent_inode_old, name_old))
            for p, n in moved:
                try:
                    a = await self.meta.lookup(p, n)
                except MetaError:
                    continue
                if a.is_dir and a.ino in self.parents:
                    self.parents[a.ino] = p

    # -- directories
    @fuse_op
    async def opendir(self, inode, ctx):
        a = await self.meta.getattr(inode)
        if not a.is_dir:
            raise FUSEError(errno.ENOTDIR)
        return inode

    @staticmethod
    def _dot(ino: int) -> EntryAttributes:
        """"." or "..": the kernel takes only the inode number and type (and counts no lookup of them)."""
        e = EntryAttributes()
        e.st_ino, e.st_mode = ino, stat.S_IFDIR
        return e

    @fuse_op
    async def readdir(self, fh, start_id, token):
        """"." (cookie 1) and ".." (cookie 2) first, then the entries, each cookie the engine's plus 2."""
        if start_id == 0 and not token.add(b".", self._dot(fh), 1):
            return
        if start_id <= 1 and not token.add(b"..", self._dot(self.parents.get(fh, fh)), 2):
            return
        after = max(start_id - 2, 0)
        while True:
            batch = await self.meta.readdir(fh, after, 512)
            if not batch:
                return
            for name, a, cookie in batch:
                if not token.add(name, self.entry(a), cookie + 2):
                    return
                if token.plus:                  # the kernel counts a lookup of each entry with attributes
                    self.lookups[a.ino] += 1
                    if a.is_dir:
                        self.parents[a.ino] = fh
                after = cookie

    async def releasedir(self, fh):
        pass

    @fuse_op
    async def fsyncdir(self, fh, datasync):
        await self.meta.sync()

    # -- files
    async def _open(self, a: Attr) -> FileInfo:
        st = self.files.get(a.ino)
        if st is None:
            st = self.files[a.ino] = FileState(a.ino, a.size, self.writer)
        elif not st.pending:
            st.size = a.size
        if st.opens == 0:
            await self.meta.opened(a.ino)
            st.changed()            # close-to-open: the slice list is read again
            st.seen = (a.mtime_ns, a.ctime_ns)
        st.opens += 1
        fh = self.next_fh
        self.next_fh += 1
        self.handles[fh] = a.ino
        keep = self.seen.get(a.ino) == (a.mtime_ns, a.ctime_ns)
        return FileInfo(fh=fh, keep_cache=keep)

    @fuse_op
    async def open(self, inode, flags, ctx, kill_suidgid=False):
        a = await self.meta.getattr(inode)
        if a.is_dir:
            raise FUSEError(errno.EISDIR)
        if flags & os.O_TRUNC and a.size:          # we ask for atomic O_TRUNC: it is ours to do
            st = self.files.get(inode)
            if st is not None:
                await self._truncate(st, 0)
            a = await self.meta.truncate(inode, 0, time.time_ns())
            self.reclaimer.kick()
        if flags & os.O_TRUNC and kill_suidgid and killed_privs(a.mode) != a.mode:
            a = await self.meta.setattr(inode, mode=killed_privs(a.mode), ctime_ns=time.time_ns())
        return await self._open(a)

    @fuse_op
    async def create(self, parent_inode, name, mode, flags, ctx):
        a = await self.meta.create(parent_inode, name, stat.S_IFREG | (mode & 0o7777), ctx.uid, ctx.gid)
        fi = await self._open(a)
        if self.meta.single_mount:
            self.files[a.ino].caps = None       # a new file has no xattrs: its first write need not ask
        return fi, self._looked_up(a, parent_inode)

    async def _slices(self, st: FileState) -> list[Slice]:
        while st.slices is None:
            gen = st.gen
            slices = await self.meta.slices(st.ino)
            if gen == st.gen:
                st.slices, st.starts = slices, [s.off for s in slices]
        return st.slices

    async def _committed(self, st: FileState, off: int, n: int) -> bytearray:
        """Bytes [off, off+n) as the committed slices have them (zeros in holes)."""
        out = bytearray(n)
        slices = await self._slices(st)
        i = max(bisect.bisect_right(st.starts, off) - 1, 0)
        pieces = []
        for s in slices[i:]:
            if s.off >= off + n:
                break
            if s.end > off:
                pieces.append(s.cut(off, off + n))

        async def fetch(p: Slice):
            data = await self.dc.read(p.partition, p.extent, p.ext_off, p.length)
            out[p.off - off:p.end - off] = data

        for p in pieces:
            if p.inline:
                out[p.off - off:p.end - off] = p.data
        pieces = [p for p in pieces if not p.inline]
        if len(pieces) == 1:
            await fetch(pieces[0])
        elif pieces:
            async with trio.open_nursery() as n_:
                for p in pieces:
                    n_.start_soon(fetch, p)
        return out

    @staticmethod
    def _cached(st: FileState, off: int, end: int) -> bytearray | None:
        """[off, end) from the readahead windows (the current one, and the next one, which becomes current)."""
        ra, nx = st.ra, st.ra_next
        if ra is not None and ra[0] <= off and end <= ra[0] + len(ra[1]):
            return bytearray(memoryview(ra[1])[off - ra[0]:end - ra[0]])
        if nx is not None and nx[0] <= end and end <= nx[0] + len(nx[1]):
            if nx[0] <= off:
                out = bytearray(memoryview(nx[1])[off - nx[0]:end - nx[0]])
            elif ra is not None and ra[0] + len(ra[1]) == nx[0] and ra[0] <= off:
                out = bytearray(memoryview(ra[1])[off - ra[0]:]) + memoryview(nx[1])[:end - nx[0]]
            else:
                return None
            st.ra, st.ra_next = nx, None
            return out
        return None

    async def _prefetch(self, st: FileState, start: int, n: int) -> None:
        gen = st.gen
        done = trio.Event()
        st.prefetch = (start, start + n, done)
        try:
            data = await self._committed(st, start, n)
            if gen == st.gen:
                st.ra_next = (start, data)
        except Exception as e:     # noqa: BLE001 - readahead is a hint: the read itself will report
            log.debug("readahead of inode %d at %d: %s", st.ino, start, e)
        finally:
            st.prefetch = None
            done.set()

    @fuse_op
    async def read(self, fh, off, size):
        st = self.files[self.handles[fh]]
        end = min(off + size, st.size)
        if off >= end:
            return b""
        while True:
            gen = st.gen
            out = self._cached(st, off, end)
            if out is not None:
                break
            pf = st.prefetch
            if pf is not None and pf[0] <= off < pf[1]:
                await pf[2].wait()
                continue
            window = end - off
            if off == st.last_end:
                window = max(window, min(READAHEAD, st.size - off))
            data = await self._committed(st, off, window)
            if gen == st.gen:
                st.ra, st.ra_next = ((off, data) if window > end - off else None), None
                out = data[:end - off]
                break
        st.last_end = end
        ra = st.ra
        if ra is not None and st.prefetch is None and st.ra_next is None and end > ra[0] + len(ra[1]) // 2:
            nxt = ra[0] + len(ra[1])
            if nxt < st.size:
                self.nursery.start_soon(self._prefetch, st, nxt, min(READAHEAD, st.size - nxt))
        st.buf.overlay(off, out)
        return bytes(out)

    @fuse_op
    async def write(self, fh, off, buf, kill_suidgid=False):
        st = self.files[self.handles[fh]]
        self._raise_error(st)
        if kill_suidgid:
            await self._kill_suidgid(st.ino, st)
        await self.writer.write(st, off, buf)
        return len(buf)

    @fuse_op
    async def flush(self, fh):
        """A close: its bytes are written before it returns -- or, with ``writeback``, right after, in the
        background (it reports a failure of the file's earlier background writes)."""
        st = self.files[self.handles[fh]]
        if self.writeback:
            self._raise_error(st)
            self.writer.flush_soon(st)
            return
        await self._flush_checked(st)

    @fuse_op
    async def fsync(self, fh, datasync):
        st = self.files[self.handles[fh]]
        committed = await self.writer.flush(st, durable=True)     # its commit made durable in the same step
        self._raise_error(st)
        if not committed:
            # nothing flushed here: an earlier commit (a close's, a background flush's) may not be durable yet
            await self.meta.sync()

    @fuse_op
    async def release(self, fh):
        ino = self.handles.pop(fh)
        st = self.files[ino]
        st.opens -= 1
        if st.opens == 0:          # each first open here told the engine (opened), each last close does
            try:
                if self.writeback:
                    self.writer.flush_soon(st)
                else:
                    await self.writer.flush(st)
                if st.committed_slices >= COMPACT_SLICES and self.meta.single_mount:
                    await self._compact(st)
            finally:
                if ino in self.unlinked:                 # gone from the tree: its bytes need not be written,
                    st.buf.drop()
                    async with st.flush_lock:            # and one being written commits before it goes
                        pass
                if await self.meta.closed(ino):          # its last link was gone: removed
                    self.unlinked.discard(ino)
                    self.seen.pop(ino, None)
                    self.reclaimer.kick()
                self.writer.settle(st)
                await self._maybe_remove(ino)

    async def _compact(self, st: FileState) -> None:
        """Rewrite a file whose slice list grew long (many small overwrites) as a few fresh slices, so reads
        touch fewer pieces and the fragments' extents can be released.  Holds the file's flush lock: a write or
        truncate meanwhile commits after it (and wins).  Only with a single-mount engine: another mount's
        commit could otherwise be overwritten by the rewritten old bytes."""
        st.committed_slices = 0
        async with st.flush_lock:
            slices = await self.meta.slices(st.ino)
            if len(slices) < COMPACT_SLICES:
                return
            a = await self.meta.getattr(st.ino)
            if a.size > COMPACT_MAX_BYTES or st.buf.dirty:
                return
            st.changed()
            data = await self._committed(st, 0, a.size)
            a, new = await self.writer.store(st.ino, [(0, a.size)], data, a.size, a.mtime_ns, whole=a.size)
            st.changed()
            st.seen = (a.mtime_ns, a.ctime_ns)
            log.info("compacted inode %d: %d slices -> %d", st.ino, len(slices), new)
            self.reclaimer.kick()

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
                "files_failed": sum(1 for st in held if st.error is not None),
                "requests": {k: {"count": c, "failed": f, "seconds": round(t, 3)}
                             for k, (c, f, t) in sorted(self.ops.items())},
                "meta": self.meta.stats()}

    def unwritten(self) -> tuple[int, int] | None:
        """(bytes, files) buffered and not yet written, if any."""
        return self.writer.unwritten()

    # -- file system
    async def capacity(self) -> tuple[int, int]:
        """(total, free) bytes a file can still use: the datanodes' reported disks (NODE_STATUS ``disk``)
        summed over the nodes holding our partitions, divided by the replica count (every byte is stored that
        many times).  Cached for ``STATFS_CACHE_S``; a node that does not answer is left out; with no answer
        at all the last known figures stand."""
        async with self._cap_lock:
            if self._cap is not None and trio.current_time() - self._cap[0] < STATFS_CACHE_S:
                return self._cap[1]
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
                return 0, 0
            return self._cap[1]

    async def usage(self) -> tuple[int, int]:
        """(inodes, bytes the files hold) from the metadata, cached as long as ``capacity``."""
        if self._usage is None or trio.current_time() - self._usage[0] >= STATFS_CACHE_S:
            self._usage = (trio.current_time(), await self.meta.usage())
        return self._usage[1]

    @fuse_op
    async def statfs(self, ctx):
        """Used: the files' bytes; available: what the datanodes' disks can still take, each byte stored once
        per replica; size: the two together (so ``df`` adds up, and an empty mount shows nothing used, whatever
        else shares the disks).  Inodes: the metadata sets no limit; 2^32 stands for it."""
        inodes, used = await self.usage()
        _total, free = await self.capacity()
        s = StatvfsData()
        s.f_bsize, s.f_frsize, s.f_namemax = 1 << 20, 4096, 255
        s.f_bfree = s.f_bavail = free // s.f_frsize
        s.f_blocks = s.f_bfree + -(-used // s.f_frsize)
        s.f_files = max(INODES, inodes)
        s.f_ffree = s.f_favail = s.f_files - inodes
        return s

    # -- extended attributes
    @fuse_op
    async def setxattr(self, inode, name, value, ctx):
        if name in acl.NAMES:
            if not self.enable_acl:
                raise FUSEError(errno.EOPNOTSUPP)
            await self._set_acl(inode, name, value, ctx)
            return
        change = self._caps_changing(inode, name)
        await self.meta.setxattr(inode, name, value)
        self._caps_changed(change, value)

    async def _set_acl(self, inode: int, name: bytes, value: bytes, ctx) -> None:
        """The kernel has checked the ACL and the caller's right to set it; an access ACL sets the mode's
        permission bits with it (and takes the set-group-ID bit from a caller outside the file's group), a
        default ACL is for directories only."""
        try:
            acl.parse(value)
        except acl.AclError as e:
            raise MetaError(errno.EINVAL, str(e)) from None
        a = await self.meta.getattr(inode)
        if stat.S_ISLNK(a.mode):
            raise FUSEError(errno.EOPNOTSUPP)
        if name == acl.DEFAULT:
            if not a.is_dir:
                raise FUSEError(errno.EACCES)
            await self.meta.setxattr(inode, name, value)
            return
        keep = not a.mode & stat.S_ISGID or keeps_sgid(ctx, a.gid)
        a = await self.meta.set_acl(inode, value, keep_sgid=keep, ctime_ns=time.time_ns())
        st = self.files.get(inode)
        if st is not None:
            st.seen = (a.mtime_ns, a.ctime_ns)

    @fuse_op
    async def getxattr(self, inode, name, ctx):
        """Before every write to a file the kernel asks for its ``security.capability`` (a write must strip
        file capabilities, and FUSE lets the kernel remember no answer), so each write cost a FUSE round trip
        and a metadata lookup more.  With a single-mount engine only this mount changes xattrs: an open
        file's answer is kept (``FileState.caps``), and this mount's own setxattr/removexattr of it (the
        kernel's stripping on write included) replace it.  A shared engine is asked every time: another
        mount may have set capabilities meanwhile."""
        st = self.files.get(inode) if name == CAPS and self.meta.single_mount else None
        if st is not None and st.caps is not _UNKNOWN:
            value = st.caps
        else:
            gen = st.caps_gen if st is not None else 0
            try:
                value = await self.meta.getxattr(inode, name)
            except MetaError as e:
                if e.errno != errno.ENODATA:
                    raise
                value = None
            if st is not None and st.caps_gen == gen:      # no change of it began meanwhile
                st.caps = value
        if value is None:
            raise FUSEError(ENOATTR)
        return value

    def _caps_changing(self, inode: int, name: bytes):
        """An xattr change is about to start: a kept ``security.capability`` answer is forgotten (and one
        being looked up meanwhile is not kept).  Returns what ``_caps_changed`` needs."""
        st = self.files.get(inode) if name == CAPS and self.meta.single_mount else None
        if st is None:
            return None
        st.caps = _UNKNOWN
        st.caps_gen += 1
        return st, st.caps_gen

    @staticmethod
    def _caps_changed(change, value: bytes | None) -> None:
        """The change went through: its value is the kept answer, unless another change began since."""
        if change is not None and change[0].caps_gen == change[1]:
            change[0].caps = value

    @fuse_op
    async def listxattr(self, inode, ctx):
        return await self.meta.listxattr(inode)

    @fuse_op
    async def removexattr(self, inode, name, ctx):
        change = self._caps_changing(inode, name)
        try:
            await self.meta.removexattr(inode, name)
            self._caps_changed(change, None)
        except MetaError as e:
            if e.errno == errno.ENODATA:
                raise FUSEError(ENOATTR) from None
            raise
