"""The extended-attribute handlers of dnfs, POSIX ACLs among them (the ACL rules are :mod:`client.fs.acl`'s).
A mixin of :class:`client.fs.fs.DnFS`."""
from __future__ import annotations

import errno
import stat
import time

from client.fs import acl
from client.fs.fs_common import CAPS, UNKNOWN, fuse_op, keeps_sgid
from client.fs.fuse_types import ENOATTR, FUSEError
from client.fs.meta import MetaError


class XattrOps:
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
        if st is not None and st.caps is not UNKNOWN:
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
        st.caps = UNKNOWN
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
