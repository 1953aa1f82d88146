"""The directory handlers of dnfs: names, attributes and listings (lookup, create, link, rename, readdir, ...).
A mixin of :class:`client.fs.fs.DnFS`: the state it uses (``meta``, ``files``, ``lookups``, ``parents``,
``unlinked``) is the mount's."""
from __future__ import annotations

import errno
import stat
import time

from client.fs.fs_common import TIMEOUT, counted, fuse_op, killed_privs
from client.fs.fuse_types import RENAME_EXCHANGE, RENAME_NOREPLACE, EntryAttributes, FUSEError
from client.fs.meta import MetaError


class DirOps:
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

    def lookup_now(self, parent_inode, name):
        """``lookup`` answered at once when the engine can (no task: the session's inline path), else None."""
        t0 = time.perf_counter()
        try:
            a = self.meta.lookup_now(parent_inode, name)
        except MetaError as e:
            if e.errno != errno.ENOENT or not self.negative_cache:
                counted(self.ops, "lookup", t0, False)
                raise FUSEError(e.errno) from None
            neg = EntryAttributes()
            neg.st_ino = 0
            neg.entry_timeout = TIMEOUT
            counted(self.ops, "lookup", t0, True)
            return neg
        if a is None:
            return None
        counted(self.ops, "lookup", t0, True)
        return self._looked_up(a, parent_inode)

    def getattr_now(self, inode):
        """``getattr`` answered at once when the engine can, else None."""
        t0 = time.perf_counter()
        try:
            a = self.meta.getattr_now(inode)
        except MetaError as e:
            counted(self.ops, "getattr", t0, False)
            raise FUSEError(e.errno) from None
        if a is None:
            return None
        counted(self.ops, "getattr", t0, True)
        return self.entry(a)

    @fuse_op
    async def getattr(self, inode, ctx=None):
        return self.entry(await self.meta.getattr(inode))

    @fuse_op
    async def setattr(self, inode, attr, fields, fh, ctx):
        gone = self.removed.get(inode)
        if gone is not None:        # the kernel writing back the times of a file it just unlinked
            return self.entry(gone)
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
            if self.kernel_writes_back and self.lookups.get(a.ino, 0) > 0:
                self.removed[a.ino] = a
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

