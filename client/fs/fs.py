"""The FUSE operations of dnfs (pyfuse3, in the SDK's trio loop): POSIX calls -> metadata + data path.

Data path.  ``write`` copies into the file's write-back buffer (:mod:`client.fs.writeback`); a buffer that
reaches ``chunk`` bytes is flushed in the background (one at a time per file, a second full chunk waits for
it), all buffers together are held under ``budget`` bytes, and ``flush`` (close), ``fsync`` and
``release`` flush synchronously -- with ``writeback`` (opt-in) a close only starts the flush: the closed
file's state stays until its bytes are written (``_settle``), unmounting writes what is left.  A flush is
one ``DataClient.write`` (pipelined appends, acknowledged by every replica) followed by one metadata commit
of the new slices (newer wins); ``fsync`` also makes the metadata durable.  ``read`` fetches the committed
slices' bytes (holes are zeros) with sequential readahead, then lays the unflushed bytes over them.

Faults: a flush whose append fails (a replica died, a timeout, a stale epoch) writes the part not yet
acknowledged again from the buffer -- in a new extent, on another writable partition when there is one,
else once the map changed -- for ``write_retry_s`` before the file reports EIO (logged with the reason).
A full datanode disk is ENOSPC (also when a follower's full disk shows only as a replication failure).
``statfs`` reports the datanodes' disks (NODE_STATUS) divided by the replica count, cached briefly.

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

import pyfuse3
import trio

from client.fs.meta import Attr, Meta, MetaError, Slice
from client.fs.reclaim import DataLock, Reclaimer
from client.fs.writeback import DirtyMap
from client.sdk import ClientError, DataClient, Location
from datanode.protocol import Op, Result

log = logging.getLogger(__name__)

TIMEOUT = 1.0           # seconds the kernel may cache entries and attributes
READAHEAD = 4 << 20
COMPACT_SLICES = 256               # a file with this many slices is rewritten at its last close ...
COMPACT_MAX_BYTES = 256 << 20      # ... if it is no larger than this
STATFS_CACHE_S = 2.0               # statfs answers from the datanodes' figures this old at most
STATFS_TIMEOUT_S = 2.0             # a datanode that does not report its disk within this is left out
FULL_BELOW = 2 << 20               # a datanode with less free disk than this counts as full
ORPHAN_SWEEP_S = 5.0               # shared engines: how often unlinked inodes of dead mounts are looked for
AVOID_S = 10.0                     # a partition a write just failed on is passed over this long when others can take it
RETRY_PAUSE = 1.0                  # a write that failed on every partition waits this long before the next try
BACKGROUND_FLUSHES = 16            # background flushes (a full chunk, a closed file's bytes) running at once
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
        except pyfuse3.FUSEError:
            raise
        except MetaError as e:
            raise pyfuse3.FUSEError(e.errno) from None
        except ClientError as e:
            raise pyfuse3.FUSEError(data_errno(e, fn.__name__)) from None
        except OSError as e:
            raise pyfuse3.FUSEError(e.errno or errno.EIO) from None
        except Exception:
            log.exception("%s failed", fn.__name__)
            raise pyfuse3.FUSEError(errno.EIO) from None
        finally:
            self.inflight -= 1
            c = self.ops.get(name)
            if c is None:
                c = self.ops[name] = [0, 0, 0.0]
            c[0] += 1
            c[1] += not ok
            c[2] += time.perf_counter() - t0
    return wrapper


def data_errno(e: ClientError, what: str) -> int:
    if e.result == Result.NO_SPACE:
        log.warning("%s: the datanodes are full: %s", what, e)
        return errno.ENOSPC
    log.error("%s: EIO: %s", what, e)
    return errno.EIO


class FileState:
    """What the mount holds for a file that is open (or still has unflushed bytes)."""

    def __init__(self, ino: int, size: int):
        self.ino = ino
        self.opens = 0
        self.size = size                  # including unflushed bytes
        self.dirty = DirtyMap()
        self.flushing: DirtyMap | None = None
        self.flush_lock = trio.Lock()
        self.background = False
        self.error: int | None = None     # errno of a failed background flush, reported once
        self.mtime_ns = 0
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

    @property
    def pending_end(self) -> int:
        return max(self.dirty.end, self.flushing.end if self.flushing else 0)

    def changed(self) -> None:
        self.gen += 1
        self.slices = None
        self.ra = self.ra_next = None


class DnFS(pyfuse3.Operations):
    enable_writeback_cache = False

    def __init__(self, meta: Meta, dc: DataClient, partitions: list[int], nursery: trio.Nursery, *,
                 budget: int = 256 << 20, chunk: int = 16 << 20, write_retry_s: float = 30.0,
                 writeback: bool = False):
        super().__init__()
        if not partitions:
            raise ValueError("no data partition to write to")
        self.meta, self.dc, self.partitions, self.nursery = meta, dc, partitions, nursery
        self.budget, self.chunk = budget, min(chunk, budget)
        self.writeback = writeback        # close returns before its bytes are written (``flush``)
        self._background = trio.Semaphore(BACKGROUND_FLUSHES)
        self._cap: tuple[float, tuple[int, int]] | None = None     # (when, (total, free)) for statfs
        self._cap_lock = trio.Lock()
        self.write_retry_s = write_retry_s
        self._avoid: dict[int, float] = {}     # partition -> until when writes prefer the others (a failure)
        self.lock = DataLock()
        self.reclaimer = Reclaimer(meta, dc, self.lock)
        self.files: dict[int, FileState] = {}
        self.handles: dict[int, int] = {}
        self.next_fh = 1
        self.lookups: Counter[int] = Counter()
        self.unlinked: set[int] = set()
        self.seen: dict[int, tuple[int, int]] = {}   # ino -> (mtime, ctime) at its last close
        self.dirty_total = 0
        self.negative_cache = meta.single_mount    # only this mount changes the tree: cache "no such name"
        self.inflight = 0                          # FUSE requests being served (``fuse_op``)
        self.ops: dict[str, list] = {}             # FUSE request kind -> [count, answered with an errno, seconds]
        meta.quiet = lambda: self.inflight <= 1    # the engine may block the loop for an fsync nobody waits behind
        self.timeout = TIMEOUT if meta.single_mount else 0.0   # shared: ask the metadata every time

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

    def entry(self, a: Attr) -> pyfuse3.EntryAttributes:
        st = self.files.get(a.ino)
        e = pyfuse3.EntryAttributes()
        e.st_ino = a.ino
        e.generation = 0
        e.entry_timeout = e.attr_timeout = self.timeout
        e.st_mode, e.st_nlink, e.st_uid, e.st_gid, e.st_rdev = a.mode, a.nlink, a.uid, a.gid, a.rdev
        e.st_size = max(a.size, st.size) if st is not None and (st.dirty or st.flushing) else a.size
        e.st_blksize = 1 << 20
        e.st_blocks = (e.st_size + 511) // 512
        e.st_atime_ns, e.st_mtime_ns, e.st_ctime_ns = a.atime_ns, a.mtime_ns, a.ctime_ns
        return e

    def _looked_up(self, a: Attr) -> pyfuse3.EntryAttributes:
        self.lookups[a.ino] += 1
        return self.entry(a)

    def _pid(self, ino: int) -> int:
        return self.partitions[ino % len(self.partitions)]

    async def _maybe_remove(self, ino: int) -> None:
        st = self.files.get(ino)
        if ino in self.unlinked and self.lookups[ino] <= 0 and (st is None or st.opens == 0):
            self.unlinked.discard(ino)
            if st is not None:
                self._drop_buffer(st)            # nobody can read them any more
                async with st.flush_lock:        # a flush under way commits first, then the inode goes
                    pass
            self.files.pop(ino, None)
            await self.meta.remove(ino)
            self.reclaimer.kick()

    def _drop_buffer(self, st: FileState) -> None:
        """The bytes of a file that is gone need not be written (write-back keeps closed files' bytes)."""
        if st.dirty:
            self.dirty_total -= st.dirty.nbytes
            st.dirty = DirtyMap()

    def _raise_error(self, st: FileState) -> None:
        if st.error is not None:
            err, st.error = st.error, None
            raise pyfuse3.FUSEError(err)

    # -- flushing
    async def _flush(self, st: FileState, *, durable: bool = False) -> bool:
        """Write the file's dirty bytes and commit their slices; ``durable`` (an fsync): the commit, and every
        one before it, durable on return.  Returns whether it committed (errors: ``st.error``)."""
        async with st.flush_lock:
            if not st.dirty:
                return False
            m = st.dirty
            st.dirty, st.flushing = DirtyMap(), m
            try:
                ranges = m.ranges()
                payload = ranges[0][1] if len(ranges) == 1 else b"".join(b for _, b in ranges)
                await self.lock.acquire_shared()
                try:
                    locs = await self._write_data(st.ino, payload)
                    slices = []
                    it = iter(ranges)
                    roff, rbuf = next(it)
                    rpos = 0        # payload position where the current range starts
                    q = 0           # payload position of the current location
                    for loc in locs:
                        x = q
                        while x < q + loc.length:
                            if x >= rpos + len(rbuf):
                                rpos += len(rbuf)
                                roff, rbuf = next(it)
                                continue
                            y = min(q + loc.length, rpos + len(rbuf))
                            slices.append(Slice(roff + x - rpos, y - x, loc.partition, loc.extent,
                                                loc.offset + x - q, loc.offset, loc.length, loc.crc))
                            x = y
                        q += loc.length
                    a = await self.meta.commit(st.ino, slices, m.end, st.mtime_ns or time.time_ns(),
                                               durable=durable)
                    st.seen = (a.mtime_ns, a.ctime_ns)
                    st.committed_slices += len(slices)
                finally:
                    await self.lock.release_shared()
                st.changed()
                return True
            except (ClientError, MetaError) as e:
                st.error = e.errno if isinstance(e, MetaError) else data_errno(e, "flush")
                log.error("flush of inode %d (%d bytes) failed: %s", st.ino, m.nbytes, e)
                return False
            finally:
                st.flushing = None
                self.dirty_total -= m.nbytes

    def _writable(self, pid: int) -> bool:
        """Can partition ``pid`` take writes, as far as the map says (without an etcd map: assume so)."""
        v = self.dc.views.get(pid)
        return v is None or v.state == "writable"

    async def _write_data(self, ino: int, payload) -> list[Location]:
        """Write ``payload`` into extents, acknowledged by every replica; returns its locations in order.

        A failed append (a replica died, a timeout, a lost connection, a stale epoch) is not the
        application's problem while the write-back buffer still holds the bytes: the part not yet
        acknowledged is written again, in a new extent, on another writable partition when there is one,
        else on the same one once the map has had time to change (the cluster manager shrinks a replica set
        within seconds; the SDK follows etcd).  Only after ``write_retry_s`` does the error reach the caller
        (EIO, logged with the reason).  A full disk (NO_SPACE) is reported at once (ENOSPC)."""
        mv = memoryview(payload).cast("B")
        out: list[Location] = []
        pos = 0
        home = self._pid(ino)
        failed: set[int] = set()
        full: set[int] = set()
        deadline = trio.current_time() + self.write_retry_s
        while True:
            now = trio.current_time()
            order = [p for p in [home] + [p for p in self.partitions if p != home] if p not in full]
            cands = [p for p in order if p not in failed and self._writable(p)]
            cands = [p for p in cands if self._avoid.get(p, 0) <= now] or cands
            pid = cands[0] if cands else order[0]
            try:
                out += await self.dc.write(pid, mv[pos:])
                if failed:
                    log.info("inode %d: write went through on partition %d after retrying", ino, pid)
                return out
            except ClientError as e:
                done = getattr(e, "done", [])
                out += done
                pos += sum(loc.length for loc in done)
                if e.result == Result.FORBIDDEN:
                    raise
                if e.result != Result.NO_SPACE and await self._replica_full(pid):
                    e = ClientError(f"partition {pid}: a replica's disk is full ({e})", Result.NO_SPACE, e.node)
                if e.result == Result.NO_SPACE:      # another partition may have room; else ENOSPC at once
                    full.add(pid)
                    if all(p in full for p in self.partitions):
                        raise e
                    log.warning("inode %d: partition %d is full; writing to another one", ino, pid)
                    continue
                left = deadline - trio.current_time()
                if left <= 0:
                    log.error("inode %d: giving up on a write of %d bytes after %.0fs of retries: %s", ino,
                              len(mv) - pos, self.write_retry_s, e)
                    raise
                log.warning("inode %d: write to partition %d failed (%s); %d bytes unacknowledged, retrying "
                            "for %.0fs more", ino, pid, e, len(mv) - pos, left)
                failed.add(pid)
                self._avoid[pid] = trio.current_time() + AVOID_S
                if not [p for p in self.partitions if p not in failed and self._writable(p)]:
                    failed.clear()                      # every partition failed: wait for the map to change
                    await trio.sleep(min(RETRY_PAUSE, left))

    async def _replica_full(self, pid: int) -> bool:
        """Does a replica of ``pid`` report a full disk?  (A follower's NO_SPACE reaches us only as a
        replication failure.)"""
        part = self.dc.partitions.get(pid)
        if part is None:
            return False
        for addr in part.replicas:
            with trio.move_on_after(STATFS_TIMEOUT_S):
                try:
                    d = (await self.dc.admin(addr, Op.NODE_STATUS)).get("disk") or {}
                except ClientError:
                    continue
                if "free" in d and d["free"] < FULL_BELOW:
                    log.warning("partition %d: %s reports a full disk (%d bytes free)", pid, addr, d["free"])
                    return True
        return False

    def _flush_soon(self, st: FileState) -> None:
        """Start a background flush of the file's buffered bytes (unless one is running)."""
        if st.dirty and not st.background:
            st.background = True
            self.nursery.start_soon(self._background_flush, st)

    async def _background_flush(self, st: FileState) -> None:
        try:
            async with self._background:
                await self._flush(st)
        except Exception:        # noqa: BLE001 - a task must not take the mount down; the file reports EIO
            log.exception("background flush of inode %d", st.ino)
            st.error = errno.EIO
        finally:
            st.background = False
        if st.opens == 0:        # closed meanwhile (write-back): more to write, or nothing left to keep
            if st.dirty and st.error is None:
                self._flush_soon(st)
            else:
                self._settle(st)

    def _settle(self, st: FileState) -> None:
        """Forget a closed file whose bytes are all written (its last failure, if any, is kept for the next
        open to report)."""
        if (st.opens == 0 and not st.dirty and not st.flushing and not st.background and st.error is None
                and self.files.get(st.ino) is st):
            self.files.pop(st.ino)
            if st.ino not in self.unlinked:
                self.seen[st.ino] = st.seen

    async def _truncate(self, st: FileState, size: int) -> Attr:
        await self._flush_checked(st)
        async with st.flush_lock:
            a = await self.meta.truncate(st.ino, size, time.time_ns())
            st.seen = (a.mtime_ns, a.ctime_ns)
            before = st.dirty.nbytes
            st.dirty.truncate(size)
            self.dirty_total += st.dirty.nbytes - before
            st.size = size
            st.changed()
        return a

    async def _flush_checked(self, st: FileState) -> None:
        await self._flush(st)
        self._raise_error(st)

    # -- attributes and names
    @fuse_op
    async def lookup(self, parent_inode, name, ctx=None):
        try:
            return self._looked_up(await self.meta.lookup(parent_inode, name))
        except MetaError as e:
            if e.errno != errno.ENOENT or not self.negative_cache:
                raise
            neg = pyfuse3.EntryAttributes()     # inode 0: the kernel caches "no such name" for a while
            neg.st_ino = 0
            neg.entry_timeout = TIMEOUT
            return neg

    @fuse_op
    async def forget(self, inode_list):
        for ino, n in inode_list:
            self.lookups[ino] -= n
            if self.lookups[ino] <= 0:
                del self.lookups[ino]
                await self._maybe_remove(ino)

    @fuse_op
    async def getattr(self, inode, ctx=None):
        return self.entry(await self.meta.getattr(inode))

    @fuse_op
    async def setattr(self, inode, attr, fields, fh, ctx):
        now = time.time_ns()
        if fields.update_size:
            st = self.files.get(inode)
            if st is not None:
                a = await self._truncate(st, attr.st_size)
            else:
                a = await self.meta.truncate(inode, attr.st_size, now)
            self.reclaimer.kick()
        if fields.update_mode or fields.update_uid or fields.update_gid or fields.update_atime \
                or fields.update_mtime or not fields.update_size:
            a = await self.meta.setattr(
                inode, mode=attr.st_mode if fields.update_mode else None,
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
        return self._looked_up(await self.meta.create(parent_inode, name, mode, ctx.uid, ctx.gid, rdev))

    @fuse_op
    async def mkdir(self, parent_inode, name, mode, ctx):
        return self._looked_up(await self.meta.create(parent_inode, name, stat.S_IFDIR | (mode & 0o7777),
                                                      ctx.uid, ctx.gid))

    @fuse_op
    async def symlink(self, parent_inode, name, target, ctx):
        return self._looked_up(await self.meta.create(parent_inode, name, stat.S_IFLNK | 0o777, ctx.uid,
                                                      ctx.gid, target=target))

    @fuse_op
    async def link(self, inode, new_parent_inode, new_name, ctx):
        return self._looked_up(await self.meta.link(inode, new_parent_inode, new_name))

    @fuse_op
    async def unlink(self, parent_inode, name, ctx):
        a = await self.meta.unlink(parent_inode, name)
        if a.nlink <= 0:
            self.unlinked.add(a.ino)
            await self._maybe_remove(a.ino)

    @fuse_op
    async def rmdir(self, parent_inode, name, ctx):
        await self.meta.rmdir(parent_inode, name)

    @fuse_op
    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):
        replaced = await self.meta.rename(parent_inode_old, name_old, parent_inode_new, name_new,
                                          noreplace=bool(flags & pyfuse3.RENAME_NOREPLACE),
                                          exchange=bool(flags & pyfuse3.RENAME_EXCHANGE))
        if replaced is not None and replaced.nlink <= 0:
            self.unlinked.add(replaced.ino)
            await self._maybe_remove(replaced.ino)

    # -- directories
    @fuse_op
    async def opendir(self, inode, ctx):
        a = await self.meta.getattr(inode)
        if not a.is_dir:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return inode

    @fuse_op
    async def readdir(self, fh, start_id, token):
        while True:
            batch = await self.meta.readdir(fh, start_id, 512)
            if not batch:
                return
            for name, a, cookie in batch:
                if not pyfuse3.readdir_reply(token, name, self.entry(a), cookie):
                    return
                self.lookups[a.ino] += 1
                start_id = cookie

    async def releasedir(self, fh):
        pass

    @fuse_op
    async def fsyncdir(self, fh, datasync):
        await self.meta.sync()

    # -- files
    async def _open(self, a: Attr) -> pyfuse3.FileInfo:
        st = self.files.get(a.ino)
        if st is None:
            st = self.files[a.ino] = FileState(a.ino, a.size)
        elif not (st.dirty or st.flushing):
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
        return pyfuse3.FileInfo(fh=fh, keep_cache=keep)

    @fuse_op
    async def open(self, inode, flags, ctx):
        a = await self.meta.getattr(inode)
        if a.is_dir:
            raise pyfuse3.FUSEError(errno.EISDIR)
        if flags & os.O_TRUNC and a.size:          # libfuse asks for atomic O_TRUNC: it is ours to do
            st = self.files.get(inode)
            if st is not None:
                await self._truncate(st, 0)
            a = await self.meta.truncate(inode, 0, time.time_ns())
            self.reclaimer.kick()
        return await self._open(a)

    @fuse_op
    async def create(self, parent_inode, name, mode, flags, ctx):
        a = await self.meta.create(parent_inode, name, stat.S_IFREG | (mode & 0o7777), ctx.uid, ctx.gid)
        fi = await self._open(a)
        if self.meta.single_mount:
            self.files[a.ino].caps = None       # a new file has no xattrs: its first write need not ask
        return fi, self._looked_up(a)

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
        if st.flushing:
            st.flushing.overlay(off, out)
        if st.dirty:
            st.dirty.overlay(off, out)
        return bytes(out)

    @fuse_op
    async def write(self, fh, off, buf):
        st = self.files[self.handles[fh]]
        self._raise_error(st)
        before = st.dirty.nbytes
        st.dirty.write(off, buf)
        self.dirty_total += st.dirty.nbytes - before
        st.size = max(st.size, off + len(buf))
        st.mtime_ns = time.time_ns()
        if st.dirty.nbytes >= self.chunk:
            if st.background or st.flush_lock.locked():
                if st.dirty.nbytes >= 2 * self.chunk:
                    await self._flush(st)                   # backpressure: one chunk in flight at most
            else:
                st.background = True
                self.nursery.start_soon(self._background_flush, st)
        if self.dirty_total > self.budget:
            for other in sorted(self.files.values(), key=lambda s: -s.dirty.nbytes):
                if self.dirty_total <= self.budget // 2:
                    break
                await self._flush(other)
        return len(buf)

    @fuse_op
    async def flush(self, fh):
        """A close: its bytes are written before it returns -- or, with ``writeback``, right after, in the
        background (it reports a failure of the file's earlier background writes)."""
        st = self.files[self.handles[fh]]
        if self.writeback:
            self._raise_error(st)
            self._flush_soon(st)
            return
        await self._flush_checked(st)

    @fuse_op
    async def fsync(self, fh, datasync):
        st = self.files[self.handles[fh]]
        committed = await self._flush(st, durable=True)     # its commit made durable in the same step
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
                    self._flush_soon(st)
                else:
                    await self._flush(st)
                if st.committed_slices >= COMPACT_SLICES and self.meta.single_mount:
                    await self._compact(st)
            finally:
                if ino in self.unlinked:                 # gone from the tree: its bytes need not be written,
                    self._drop_buffer(st)
                    async with st.flush_lock:            # and one being written commits before it goes
                        pass
                if await self.meta.closed(ino):          # its last link was gone: removed
                    self.unlinked.discard(ino)
                    self.seen.pop(ino, None)
                    self.reclaimer.kick()
                self._settle(st)
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
            if a.size > COMPACT_MAX_BYTES or st.dirty:
                return
            st.changed()
            data = await self._committed(st, 0, a.size)
            await self.lock.acquire_shared()
            try:
                locs = await self._write_data(st.ino, data)
                new, pos = [], 0
                for loc in locs:
                    new.append(Slice(pos, loc.length, loc.partition, loc.extent, loc.offset, loc.offset, loc.length,
                                     loc.crc))
                    pos += loc.length
                a = await self.meta.commit(st.ino, new, a.size, a.mtime_ns)
            finally:
                await self.lock.release_shared()
            st.changed()
            st.seen = (a.mtime_ns, a.ctime_ns)
            log.info("compacted inode %d: %d slices -> %d", st.ino, len(slices), len(new))
            self.reclaimer.kick()

    async def flush_all(self) -> list[int]:
        """Write every file's buffered bytes; returns the inodes whose bytes could not be (EIO at their next
        close or fsync here)."""
        failed = []
        for st in list(self.files.values()):
            await self._flush(st)
            if st.error is not None:
                failed.append(st.ino)
            self._settle(st)
        return failed

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
                "buffer_budget": self.budget, "background_flushes": BACKGROUND_FLUSHES - self._background.value,
                "files_failed": sum(1 for st in held if st.error is not None),
                "requests": {k: {"count": c, "failed": f, "seconds": round(t, 3)}
                             for k, (c, f, t) in sorted(self.ops.items())},
                "meta": self.meta.stats()}

    def unwritten(self) -> tuple[int, int] | None:
        """(bytes, files) buffered and not yet written, if any."""
        sts = [st for st in self.files.values() if st.dirty or st.flushing]
        if not sts:
            return None
        return sum(st.dirty.nbytes + (st.flushing.nbytes if st.flushing else 0) for st in sts), len(sts)

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

    @fuse_op
    async def statfs(self, ctx):
        files, _used = await self.meta.usage()
        total, free = await self.capacity()
        s = pyfuse3.StatvfsData()
        s.f_bsize, s.f_frsize, s.f_namemax = 1 << 20, 4096, 255
        s.f_blocks = total // s.f_frsize
        s.f_bfree = s.f_bavail = free // s.f_frsize
        s.f_files = files + (1 << 32)
        s.f_ffree = s.f_favail = 1 << 32
        return s

    # -- extended attributes
    @fuse_op
    async def setxattr(self, inode, name, value, ctx):
        change = self._caps_changing(inode, name)
        await self.meta.setxattr(inode, name, value)
        self._caps_changed(change, value)

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
            raise pyfuse3.FUSEError(pyfuse3.ENOATTR)
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
                raise pyfuse3.FUSEError(pyfuse3.ENOATTR) from None
            raise
