"""The file handlers of dnfs: open, read (with readahead), write, flush, fsync, release, and rewriting a
fragmented file.  A mixin of :class:`client.fs.fs.DnFS`: the state it uses (``meta``, ``dc``, ``writer``,
``files``, ``handles``, ``seen``) is the mount's."""
from __future__ import annotations

import bisect
import errno
import logging
import os
import stat
import time

import trio

from client.fs.fs_common import FileState, counted, fuse_op, killed_privs
from client.fs.fuse_types import FileInfo, FUSEError
from client.fs.meta import Attr, Slice, coalesce

log = logging.getLogger("client.fs.fs")

READAHEAD = 4 << 20                # bytes a sequential reader's fetch from the cluster takes at once
RA_WINDOWS = 3                     # windows of them a file keeps: the one read, the next, one for stragglers
COMPACT_SLICES = 256               # a file with this many slices is rewritten at its last close ...
COMPACT_MAX_BYTES = 256 << 20      # ... if it is no larger than this


class FileOps:
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
        """Bytes [off, off+n) as the committed slices have them (zeros in holes), each extent's range read
        straight into its place."""
        out = bytearray(n)
        view = memoryview(out)
        slices = await self._slices(st)
        i = max(bisect.bisect_right(st.starts, off) - 1, 0)
        pieces = []
        for s in slices[i:]:
            if s.off >= off + n:
                break
            if s.end > off:
                pieces.append(s.cut(off, off + n))

        async def fetch(p: Slice):
            await self.dc.read_into(p.partition, p.extent, p.ext_off, view[p.off - off:p.end - off])

        for p in pieces:
            if p.inline:
                out[p.off - off:p.end - off] = p.data
        pieces = coalesce([p for p in pieces if not p.inline])
        if len(pieces) == 1:
            await fetch(pieces[0])
        elif pieces:
            async with trio.open_nursery() as n_:
                for p in pieces:
                    n_.start_soon(fetch, p)
        return out

    @staticmethod
    def _cached(st: FileState, off: int, end: int):
        """[off, end) from the fetched windows: a view of one window (no copy), the bytes of two adjoining
        ones, or None when they do not hold it all."""
        for start, data in reversed(st.windows):
            wend = start + len(data)
            if start <= off < wend:
                if end <= wend:
                    return memoryview(data)[off - start:end - start]
                for s2, d2 in st.windows:
                    if s2 == wend and end <= s2 + len(d2):
                        return bytes(memoryview(data)[off - start:]) + memoryview(d2)[:end - s2]
                return None
        return None

    @staticmethod
    def _begin(st: FileState, start: int, n: int) -> tuple[int, int, int, trio.Event]:
        """Say that [start, start+n) is being fetched (before the fetch's task runs): a read wanting bytes of
        it meanwhile waits for it rather than fetching them again -- the kernel sends a sequential reader's
        READs several at once, and they are served concurrently."""
        under_way = (start, start + n, st.gen, trio.Event())
        st.fetching.append(under_way)
        return under_way

    async def _fetch(self, st: FileState, under_way) -> bytearray:
        """Fetch what ``_begin`` announced from the cluster and keep it as a window (unless the file changed
        meanwhile)."""
        start, end, gen, done = under_way
        try:
            data = await self._committed(st, start, end - start)
            self.read_fetched += end - start
            if gen == st.gen:
                st.windows.append((start, data))
                del st.windows[:-RA_WINDOWS]
            return data
        finally:
            st.fetching.remove(under_way)
            done.set()

    async def _prefetch(self, st: FileState, under_way) -> None:
        try:
            await self._fetch(st, under_way)
        except Exception as e:     # noqa: BLE001 - readahead is a hint: the read itself will report
            log.debug("readahead of inode %d at %d: %s", st.ino, under_way[0], e)

    @staticmethod
    def _under_way(st: FileState, off: int):
        return next((f for f in st.fetching if f[0] <= off < f[1]), None)

    @fuse_op
    async def read(self, fh, off, size):
        st = self.files[self.handles[fh]]
        end = min(off + size, st.size)
        if off >= end:
            return b""
        # near where the last read ended (the kernel's READs of one reader arrive out of order), or at the start
        sequential = off == 0 or (st.last_end >= 0 and abs(off - st.last_end) <= READAHEAD)
        while True:
            gen = st.gen
            out = self._cached(st, off, end)
            if out is not None:
                break
            f = self._under_way(st, off)
            if f is not None:
                await f[3].wait()
                continue
            n = end - off
            if sequential:
                later = min((f[0] for f in st.fetching if f[0] > off), default=st.size)
                n = max(n, min(READAHEAD, later - off, st.size - off))
            data = await self._fetch(st, self._begin(st, off, n))
            if gen == st.gen:
                out = memoryview(data)[:end - off]
                break
        st.last_end = end
        if sequential:                 # past the middle of its window: the next one is fetched behind it
            for start, data in st.windows:
                nxt = start + len(data)
                if start < end <= nxt and end > start + len(data) // 2:
                    if (nxt < st.size and self._under_way(st, nxt) is None
                            and not any(s <= nxt < s + len(d) for s, d in st.windows)):
                        self.nursery.start_soon(self._prefetch, st,
                                                self._begin(st, nxt, min(READAHEAD, st.size - nxt)))
                    break
        if st.buf.pending:             # bytes written and not yet committed read as written
            out = bytearray(out)
            st.buf.overlay(off, out)
        return out

    @fuse_op
    async def write(self, fh, off, buf, kill_suidgid=False):
        st = self.files[self.handles[fh]]
        self._raise_error(st)
        if kill_suidgid:
            await self._kill_suidgid(st.ino, st)
        await self.writer.write(st, off, buf)
        return len(buf)

    def write_now(self, fh, off, buf, kill_suidgid=False) -> bool | None:
        """A write served without a task when it need not wait (the session answers it at once): True, done;
        None, nothing done -- :meth:`write` serves it; False, buffered, :meth:`write_rest` waits for the
        rest.  (Whatever may raise or await -- an error to report, set-ID bits to clear -- is left to them.)"""
        ino = self.handles.get(fh)
        st = self.files.get(ino) if ino is not None else None
        if st is None or st.error is not None or (kill_suidgid and not st.no_privs):
            return None
        t0 = time.perf_counter()
        done = self.writer.write_now(st, off, buf)
        if done:
            counted(self.ops, "write", t0, True)
        return done

    @fuse_op(name="write")
    async def write_rest(self, fh):
        await self.writer.write_rest(self.files[self.handles[fh]])

    def flush_now(self, fh) -> bool:
        """A close with nothing to write or wait for (no buffered bytes, no flush under way, no error to
        report) answered at once: True; else False, :meth:`flush` serves it."""
        ino = self.handles.get(fh)
        st = self.files.get(ino) if ino is not None else None
        if st is None or st.buf.dirty or st.error is not None or st.flush_lock.locked():
            return False
        counted(self.ops, "flush", time.perf_counter(), True)
        return True

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
            st.windows = []
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

