"""A FUSE session on /dev/fuse in the mount's trio loop: mount, negotiate, read requests, run the handlers
(:mod:`client.fs.fs`), write the answers, unmount.

Mounting: root opens /dev/fuse and calls mount(2) with ``fd=N``; anyone else has the set-user-ID
``fusermount3`` mount it and pass the descriptor back over a Unix socket (``_FUSE_COMMFD``).

INIT: we take what the kernel offers of ASYNC_READ, ATOMIC_O_TRUNC, BIG_WRITES + MAX_PAGES (1 MiB writes),
AUTO_INVAL_DATA, READDIRPLUS, ASYNC_DIO, PARALLEL_DIROPS, CACHE_SYMLINKS, POSIX_ACL (when the handlers
enforce ACLs) and HANDLE_KILLPRIV_V2: the handlers clear set-user-ID/set-group-ID bits on write, truncate
and chown themselves when the kernel says so, so the kernel no longer asks for ``security.capability``
before each write (it remembers that the file has none).  WRITEBACK_CACHE only when asked for.  Root raises
the mount's readahead to 1 MiB after INIT.

The loop costs little Python per request: one readiness wait per wakeup, then every queued request read
(the descriptor is non-blocking) until EAGAIN.  Requests that need no I/O are answered inline -- FORGET,
BATCH_FORGET, INTERRUPT, INIT, unknown opcodes (ENOSYS), and those the handlers can answer at once: a WRITE
that only buffers, a close with nothing to write, a GETATTR or LOOKUP while the metadata engine's connection
is free (``*_now``: no task, no scheduler pass); the others each get a task that awaits the handler and
writes the answer with one ``writev``.  An INTERRUPT cancels a handler that only reads (lookup,
getattr, read, ...; it answers EINTR); handlers that change state run to the end, as the kernel's
non-interruptible requests do.  A request whose bytes make no sense is logged and answered EIO; the mount
goes on.  Unmounting (ENODEV on read) ends the loop once the handlers under way are done.
"""
from __future__ import annotations

import collections
import ctypes
import ctypes.util
import errno
import logging
import os
import socket
import stat
import subprocess
import time

import trio

from client.fs import fuse_proto as fp
from client.fs.fuse_types import EntryAttributes, FUSEError, RequestContext, SetattrFields

log = logging.getLogger(__name__)

FUSE_DEV = "/dev/fuse"
MAX_WRITE = 1 << 20                  # bytes of one WRITE (MAX_PAGES lets the kernel send that many)
PAGE = os.sysconf("SC_PAGE_SIZE")
BUFSIZE = MAX_WRITE + PAGE           # a WRITE's data plus its headers
READAHEAD_KB = MAX_WRITE >> 10     # the kernel's readahead of our files when root mounts: one READ per MiB
BURST = 256                          # requests read per wakeup at most before the others get a turn
MS_NOSUID, MS_NODEV = 2, 4
MNT_DETACH = 2

WANT = (fp.ASYNC_READ | fp.ATOMIC_O_TRUNC | fp.BIG_WRITES | fp.AUTO_INVAL_DATA | fp.DO_READDIRPLUS
        | fp.ASYNC_DIO | fp.PARALLEL_DIROPS | fp.MAX_PAGES | fp.CACHE_SYMLINKS | fp.HANDLE_KILLPRIV_V2
        | fp.INIT_EXT)
# handlers that only look: cancelled (EINTR) when the caller is interrupted
INTERRUPTIBLE = frozenset({fp.Op.LOOKUP, fp.Op.GETATTR, fp.Op.READLINK, fp.Op.READ, fp.Op.READDIR,
                           fp.Op.STATFS, fp.Op.GETXATTR, fp.Op.LISTXATTR})
_QUIET = (errno.ENOENT, errno.ENODEV, errno.EBADF)   # a reply nobody waits for any more: the caller is gone
                                                     # (interrupted), or the mount is


class SessionError(Exception):
    pass


_libc = None


def _c():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    return _libc


def _our_mount(mountpoint: str, fsname: str) -> bool:
    """Is ``mountpoint`` still mounted by us (its fsname)?  (Not someone's mount made there since.)"""
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                dev, mnt = line.split()[:2]
                if dev == fsname and mnt.replace("\\040", " ") == mountpoint:
                    return True
    except OSError:
        pass
    return False


class Session:
    """One mount: ``mount()``, then ``await run()`` until unmounted or ``terminate()``d, then ``close()``.
    ``ops``: the handlers (:class:`client.fs.fs.DnFS`'s methods and attributes)."""

    def __init__(self, ops, mountpoint: str, options: set[str], *, writeback_cache: bool = False):
        self.ops = ops
        self.mountpoint = os.path.realpath(mountpoint)
        self.options = set(options)
        self.writeback_cache = writeback_cache
        self.fd = -1
        self.fsname = next((o.split("=", 1)[1] for o in self.options if o.startswith("fsname=")), "dnfs")
        self.flags = 0                       # what INIT settled on
        self.proto_minor = 0
        self.running: dict[int, trio.CancelScope] = {}     # interruptible requests under way
        self._reader: trio.CancelScope | None = None
        self._closing = False
        self._gone = False                   # the kernel ended the session (unmounted)
        # requests waiting for a worker; a worker is a task serving them one after another (a task per
        # request would cost a spawn each); ``_free`` of them are parked in ``_lot``
        self._queue: collections.deque = collections.deque()
        self._lot = trio.lowlevel.ParkingLot()
        self._free = 0
        self._workers = 0
        self._stopping = False
        # one buffer for every read, each request copied out at its size: os.read would allocate (and
        # page-fault) a whole write's worth for every few-byte request
        self._buf = bytearray(BUFSIZE)
        self._view, self._into = memoryview(self._buf), [self._buf]
        self.counts = {"wakeups": 0, "requests": 0, "inline": 0, "malformed": 0, "interrupted": 0,
                       "after_reply": 0, "read_bytes": 0}
        self._handlers = {
            fp.Op.LOOKUP: self._lookup, fp.Op.GETATTR: self._getattr, fp.Op.SETATTR: self._setattr,
            fp.Op.READLINK: self._readlink, fp.Op.SYMLINK: self._symlink, fp.Op.MKNOD: self._mknod,
            fp.Op.MKDIR: self._mkdir, fp.Op.UNLINK: self._unlink, fp.Op.RMDIR: self._rmdir,
            fp.Op.RENAME: self._rename, fp.Op.RENAME2: self._rename, fp.Op.LINK: self._link,
            fp.Op.OPEN: self._open, fp.Op.READ: self._read, fp.Op.WRITE: self._write,
            fp.Op.STATFS: self._statfs, fp.Op.RELEASE: self._release, fp.Op.FSYNC: self._fsync,
            fp.Op.SETXATTR: self._setxattr, fp.Op.GETXATTR: self._getxattr, fp.Op.LISTXATTR: self._listxattr,
            fp.Op.REMOVEXATTR: self._removexattr, fp.Op.FLUSH: self._flush, fp.Op.OPENDIR: self._opendir,
            fp.Op.READDIR: self._readdir, fp.Op.READDIRPLUS: self._readdir, fp.Op.RELEASEDIR: self._releasedir,
            fp.Op.FSYNCDIR: self._fsyncdir, fp.Op.CREATE: self._create, fp.Op.FORGET: self._forget,
            fp.Op.BATCH_FORGET: self._forget, fp.Op.INTERRUPT: self._interrupt, fp.Op.INIT: self._init,
            fp.Op.DESTROY: self._destroy,
        }
        self._inline = {fp.Op.FORGET, fp.Op.BATCH_FORGET, fp.Op.INTERRUPT, fp.Op.INIT, fp.Op.DESTROY}
        # requests the handlers may be able to answer at once (no I/O): the answer, True (queued its rest
        # itself), or None -- not now, a task serves it
        self._now = {fp.Op.WRITE: self._write_now, fp.Op.GETATTR: self._getattr_now,
                     fp.Op.LOOKUP: self._lookup_now, fp.Op.FLUSH: self._flush_now}

    # -- mounting
    def mount(self) -> None:
        """Mount at ``mountpoint`` (raises SessionError saying why not)."""
        if os.getuid() == 0:
            self._mount_root()
        else:
            self._mount_fusermount()
        os.set_blocking(self.fd, False)

    def _kernel_options(self) -> list[str]:
        return sorted(o for o in self.options if o in ("default_permissions", "allow_other"))

    def _mount_root(self) -> None:
        try:
            fd = os.open(FUSE_DEV, os.O_RDWR | os.O_CLOEXEC)
        except OSError as e:
            raise SessionError(f"{FUSE_DEV}: {e.strerror}") from None
        st = os.stat(self.mountpoint)
        data = ",".join([f"fd={fd}", f"rootmode={stat.S_IFMT(st.st_mode):o}", f"user_id={os.getuid()}",
                         f"group_id={os.getgid()}", *self._kernel_options()])
        subtype = next((o.split("=", 1)[1] for o in self.options if o.startswith("subtype=")), None)
        fstype = f"fuse.{subtype}" if subtype else "fuse"
        if _c().mount(self.fsname.encode(), self.mountpoint.encode(), fstype.encode(),
                      ctypes.c_ulong(MS_NOSUID | MS_NODEV), data.encode()) != 0:
            err = ctypes.get_errno()
            os.close(fd)
            raise SessionError(f"mount({self.mountpoint}): {os.strerror(err)}")
        self.fd = fd

    def _mount_fusermount(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            env = {**os.environ, "_FUSE_COMMFD": str(theirs.fileno())}
            opts = ",".join(sorted(self.options))
            try:
                r = subprocess.run(["fusermount3", "-o", opts, "--", self.mountpoint], env=env,
                                   pass_fds=(theirs.fileno(),), capture_output=True, text=True, timeout=30)
            except (OSError, subprocess.TimeoutExpired) as e:
                raise SessionError(f"fusermount3: {e}") from None
            theirs.close()
            if r.returncode != 0:
                raise SessionError(r.stderr.strip() or f"fusermount3 exited with {r.returncode}")
            ours.settimeout(5)
            try:
                _msg, fds, _flags, _addr = socket.recv_fds(ours, 1, 1)
            except OSError as e:
                raise SessionError(f"fusermount3 passed no descriptor: {e}") from None
            if not fds:
                raise SessionError("fusermount3 passed no descriptor")
            self.fd = fds[0]
            os.set_inheritable(self.fd, False)
        finally:
            ours.close()
            theirs.close()

    def close(self, unmount: bool = True) -> None:
        """Let go of /dev/fuse and (``unmount``) detach the mount if it is still there."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)
        if not unmount or not _our_mount(self.mountpoint, self.fsname):
            return
        if os.getuid() == 0:
            if _c().umount2(self.mountpoint.encode(), MNT_DETACH) != 0:
                log.warning("unmounting %s: %s", self.mountpoint, os.strerror(ctypes.get_errno()))
        else:
            r = subprocess.run(["fusermount3", "-u", "-q", "-z", "--", self.mountpoint], capture_output=True,
                               text=True)
            if r.returncode != 0:
                log.warning("unmounting %s: %s", self.mountpoint, r.stderr.strip())

    def terminate(self) -> None:
        """Stop reading requests: ``run`` returns once the handlers under way are done."""
        self._closing = True
        if self._reader is not None:
            self._reader.cancel()

    # -- the loop
    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            with trio.CancelScope() as self._reader:
                if not self._closing:
                    await self._read_loop()
            self._stopping = True              # the workers finish what is queued, then end
            self._lot.unpark_all()

    async def _read_loop(self) -> None:
        fd, counts = self.fd, self.counts
        while not self._gone:
            await trio.lowlevel.wait_readable(fd)
            counts["wakeups"] += 1
            self._read_queued()
            self._wake(0)

    def _wake(self, keep: int) -> None:
        """A worker for every queued request beyond the ``keep`` the calling worker serves itself."""
        for _ in range(len(self._queue) - keep):
            if self._free:
                self._free -= 1
                self._lot.unpark()
            else:
                self._workers += 1
                self._nursery.start_soon(self._worker)

    async def _worker(self) -> None:
        q = self._queue
        while True:
            while q:
                req, fn = q.popleft()
                await self._serve(req, fn)
            if self._stopping:
                return
            self._free += 1
            await self._lot.park()

    def _read_queued(self) -> int:
        """Read and dispatch the requests waiting (BURST at most); returns how many.  Called by the loop when
        the descriptor is readable, and right after each answer: a caller that was waiting for it has often
        sent its next request by then, which is read without a trip through the event loop's poll."""
        fd, view, into = self.fd, self._view, self._into
        got = 0
        while got < BURST:
            try:
                n = os.readv(fd, into)
            except BlockingIOError:
                break
            except InterruptedError:
                continue
            except OSError as e:
                if e.errno == errno.ENOENT:          # interrupted before we got to it
                    continue
                if e.errno in (errno.ENODEV, errno.EBADF):   # unmounted (or closed)
                    self._gone = True
                    if self._reader is not None:
                        self._reader.cancel()
                    break
                raise
            got += 1
            self._dispatch(bytes(view[:n]))
        return got

    def _dispatch(self, buf: bytes) -> None:
        self.counts["requests"] += 1
        try:
            req = fp.parse(buf)
        except fp.Malformed as e:
            self.counts["malformed"] += 1
            log.error("FUSE request not understood (answered EIO): %s", e)
            if e.unique is not None and e.opcode not in (fp.Op.FORGET, fp.Op.BATCH_FORGET, fp.Op.INTERRUPT):
                self._send(fp.error(e.unique, errno.EIO))
            return
        fn = self._handlers.get(req.opcode) if req.args is not None else None
        if fn is None:
            self.counts["inline"] += 1
            self._send(fp.error(req.unique, errno.ENOSYS))
            return
        now = self._now.get(req.opcode)
        if now is not None:
            try:
                out = now(req)
            except FUSEError as e:
                out = fp.error(req.unique, e.errno)
            except Exception:
                log.exception("FUSE %s failed: %r", fp.NAMES.get(req.opcode), req)
                out = fp.error(req.unique, errno.EIO)
            if out is True:                    # queued what it still waits for
                return
            if out is not None:
                self.counts["inline"] += 1
                self._send(out)
                return
        if req.opcode in self._inline:
            self.counts["inline"] += 1
            try:
                out = fn(req)
            except Exception:
                log.exception("FUSE %s failed", fp.NAMES.get(req.opcode))
                out = fp.error(req.unique, errno.EIO)
            if out is not None:
                self._send(out)
            return
        self._queue.append((req, fn))

    async def _serve(self, req: fp.Request, fn) -> None:
        try:
            if req.opcode in INTERRUPTIBLE:
                with trio.CancelScope() as cs:
                    self.running[req.unique] = cs
                    try:
                        out = await fn(req)
                    finally:
                        del self.running[req.unique]
                if cs.cancelled_caught:
                    self.counts["interrupted"] += 1
                    out = fp.error(req.unique, errno.EINTR)
            else:
                out = await fn(req)
        except FUSEError as e:
            out = fp.error(req.unique, e.errno)
        except Exception:
            log.exception("FUSE %s failed: %r", fp.NAMES.get(req.opcode), req)
            out = fp.error(req.unique, errno.EIO)
        self._send(out)
        if not self._closing and not self._gone and self.fd >= 0:
            self.counts["after_reply"] += self._read_queued()
            self._wake(1)                      # this worker takes the next one itself

    def _send(self, out) -> None:
        fd = self.fd
        if fd < 0:
            return
        try:
            if isinstance(out, bytes):
                os.write(fd, out)
            else:
                os.writev(fd, out)
        except OSError as e:
            if e.errno not in _QUIET:
                log.warning("FUSE reply: %s", e)

    def invalidate_inode(self, ino: int) -> None:
        """Have the kernel drop its cached pages and attributes of ``ino``.  Blocks while the kernel holds
        pages of it: call it from a thread, never from the loop."""
        fd = self.fd
        if fd < 0:
            return
        try:
            os.write(fd, fp.notify_inval_inode(ino))
        except OSError as e:
            if e.errno not in _QUIET:
                raise

    @staticmethod
    def _ctx(req: fp.Request, umask: int = 0) -> RequestContext:
        return RequestContext(req.uid, req.gid, req.pid, umask)

    # -- inline
    def _init(self, req: fp.Request):
        a = req.args
        if a.major != fp.KERNEL_MAJOR:
            log.error("the kernel speaks FUSE %d.%d, we speak %d.x", a.major, a.minor, fp.KERNEL_MAJOR)
            return fp.error(req.unique, errno.EPROTO)
        want = WANT | (fp.POSIX_ACL if getattr(self.ops, "enable_acl", False) else 0) \
            | (fp.WRITEBACK_CACHE if self.writeback_cache else 0)
        self.flags = a.flags & want
        self.proto_minor = min(a.minor, fp.KERNEL_MINOR)
        log.info("FUSE %d.%d, flags %#x (offered %#x)", a.major, a.minor, self.flags, a.flags)
        if hasattr(self.ops, "kernel_kills_privs"):
            self.ops.kernel_kills_privs = not self.flags & fp.HANDLE_KILLPRIV_V2
        if hasattr(self.ops, "kernel_writes_back"):
            self.ops.kernel_writes_back = bool(self.flags & fp.WRITEBACK_CACHE)
        self._send(fp.reply(req.unique, fp.init_out(a.minor, a.max_readahead, self.flags, MAX_WRITE,
                                                    MAX_WRITE // PAGE)))
        self._raise_readahead()
        return None

    def _raise_readahead(self) -> None:
        """Have the kernel read ahead READAHEAD_KB of our files (its default is 128 KiB, and INIT can only
        lower it): a sequential reader then costs one READ per MiB instead of one per 128 or 256 KiB.  Only
        root may (the mount's read_ahead_kb in sysfs), and only after INIT, which would cap it again."""
        if os.getuid() != 0:
            return
        try:
            dev = None
            with open("/proc/self/mountinfo") as f:
                for line in f:                 # the last one mounted there is ours (it is being served)
                    fields = line.split()
                    if fields[4].replace("\\040", " ") == self.mountpoint and \
                            line.split(" - ")[1].startswith("fuse"):
                        dev = fields[2]
            if dev is not None:
                with open(f"/sys/class/bdi/{dev}/read_ahead_kb", "w") as ra:
                    ra.write(str(READAHEAD_KB))
        except (OSError, IndexError) as e:
            log.debug("readahead of %s not raised: %s", self.mountpoint, e)

    def _destroy(self, req: fp.Request):
        return fp.error(req.unique, 0)

    def _forget(self, req: fp.Request):
        items = [(req.nodeid, req.args.nlookup)] if req.opcode == fp.Op.FORGET else req.args.items
        gone = self.ops.forget_now(items)
        if gone:
            self._nursery.start_soon(self.ops.remove_forgotten, gone)
        return None                          # FORGET has no answer

    def _interrupt(self, req: fp.Request):
        cs = self.running.get(req.args.unique)
        if cs is not None:
            cs.cancel()
        return None                          # neither has INTERRUPT

    # -- handlers that await
    async def _lookup(self, req):
        e = await self.ops.lookup(req.nodeid, req.args.name, self._ctx(req))
        return fp.reply(req.unique, fp.entry_out(e))

    def _lookup_now(self, req):
        now = getattr(self.ops, "lookup_now", None)
        e = now(req.nodeid, req.args.name) if now is not None else None
        return None if e is None else fp.reply(req.unique, fp.entry_out(e))

    def _getattr_now(self, req):
        now = getattr(self.ops, "getattr_now", None)
        e = now(req.nodeid) if now is not None else None
        return None if e is None else fp.reply(req.unique, fp.attr_out(e))

    async def _getattr(self, req):
        e = await self.ops.getattr(req.nodeid, self._ctx(req))
        return fp.reply(req.unique, fp.attr_out(e))

    async def _setattr(self, req):
        a = req.args
        v = a.valid
        now = time.time_ns()
        attr = EntryAttributes()
        attr.st_mode, attr.st_uid, attr.st_gid, attr.st_size = a.mode, a.uid, a.gid, a.size
        attr.st_atime_ns = now if v & fp.FATTR_ATIME_NOW else a.atime * 1_000_000_000 + a.atimensec
        attr.st_mtime_ns = now if v & fp.FATTR_MTIME_NOW else a.mtime * 1_000_000_000 + a.mtimensec
        attr.st_ctime_ns = a.ctime * 1_000_000_000 + a.ctimensec
        fields = SetattrFields(update_mode=bool(v & fp.FATTR_MODE), update_uid=bool(v & fp.FATTR_UID),
                               update_gid=bool(v & fp.FATTR_GID), update_size=bool(v & fp.FATTR_SIZE),
                               update_atime=bool(v & (fp.FATTR_ATIME | fp.FATTR_ATIME_NOW)),
                               update_mtime=bool(v & (fp.FATTR_MTIME | fp.FATTR_MTIME_NOW)),
                               update_ctime=bool(v & fp.FATTR_CTIME),
                               kill_suidgid=bool(v & fp.FATTR_KILL_SUIDGID))
        e = await self.ops.setattr(req.nodeid, attr, fields, a.fh if v & fp.FATTR_FH else None, self._ctx(req))
        return fp.reply(req.unique, fp.attr_out(e))

    async def _readlink(self, req):
        return fp.reply(req.unique, await self.ops.readlink(req.nodeid, self._ctx(req)))

    async def _symlink(self, req):
        e = await self.ops.symlink(req.nodeid, req.args.name, req.args.target, self._ctx(req))
        return fp.reply(req.unique, fp.entry_out(e))

    async def _mknod(self, req):
        a = req.args
        e = await self.ops.mknod(req.nodeid, a.name, a.mode, a.rdev, self._ctx(req, a.umask))
        return fp.reply(req.unique, fp.entry_out(e))

    async def _mkdir(self, req):
        a = req.args
        e = await self.ops.mkdir(req.nodeid, a.name, a.mode, self._ctx(req, a.umask))
        return fp.reply(req.unique, fp.entry_out(e))

    async def _unlink(self, req):
        await self.ops.unlink(req.nodeid, req.args.name, self._ctx(req))
        return fp.error(req.unique, 0)

    async def _rmdir(self, req):
        await self.ops.rmdir(req.nodeid, req.args.name, self._ctx(req))
        return fp.error(req.unique, 0)

    async def _rename(self, req):
        a = req.args
        await self.ops.rename(req.nodeid, a.old, a.newdir, a.new, a.flags, self._ctx(req))
        return fp.error(req.unique, 0)

    async def _link(self, req):
        e = await self.ops.link(req.args.oldnodeid, req.nodeid, req.args.name, self._ctx(req))
        return fp.reply(req.unique, fp.entry_out(e))

    async def _open(self, req):
        a = req.args
        fi = await self.ops.open(req.nodeid, a.flags, self._ctx(req),
                                 kill_suidgid=bool(a.open_flags & fp.OPEN_KILL_SUIDGID))
        return fp.reply(req.unique, fp.open_out(fi))

    async def _create(self, req):
        a = req.args
        fi, e = await self.ops.create(req.nodeid, a.name, a.mode, a.flags, self._ctx(req, a.umask))
        return fp.reply(req.unique, fp.entry_out(e) + fp.open_out(fi))

    async def _read(self, req):
        a = req.args
        data = await self.ops.read(a.fh, a.offset, a.size)    # bytes, or a view of the mount's readahead
        self.counts["read_bytes"] += len(data)
        return [fp.reply_header(req.unique, len(data)), data]

    def _write_now(self, req):
        write_now = getattr(self.ops, "write_now", None)
        if write_now is None:
            return None
        a = req.args
        done = write_now(a.fh, a.offset, a.data, bool(a.write_flags & fp.WRITE_KILL_SUIDGID))
        if done is None:
            return None
        if not done:                          # buffered; what it waits for goes to a task, answered after
            self._queue.append((req, self._write_rest))
            return True
        return fp.reply(req.unique, fp.write_out(len(a.data)))

    async def _write_rest(self, req):
        await self.ops.write_rest(req.args.fh)
        return fp.reply(req.unique, fp.write_out(len(req.args.data)))

    async def _write(self, req):
        a = req.args
        n = await self.ops.write(a.fh, a.offset, a.data, kill_suidgid=bool(a.write_flags & fp.WRITE_KILL_SUIDGID))
        return fp.reply(req.unique, fp.write_out(n))

    async def _statfs(self, req):
        return fp.reply(req.unique, fp.statfs_out(await self.ops.statfs(self._ctx(req))))

    async def _release(self, req):
        await self.ops.release(req.args.fh)
        return fp.error(req.unique, 0)

    async def _fsync(self, req):
        await self.ops.fsync(req.args.fh, bool(req.args.fsync_flags & fp.FSYNC_FDATASYNC))
        return fp.error(req.unique, 0)

    async def _setxattr(self, req):
        await self.ops.setxattr(req.nodeid, req.args.name, req.args.value, self._ctx(req))
        return fp.error(req.unique, 0)

    async def _getxattr(self, req):
        value = await self.ops.getxattr(req.nodeid, req.args.name, self._ctx(req))
        return self._sized(req, req.args.size, value)

    async def _listxattr(self, req):
        names = await self.ops.listxattr(req.nodeid, self._ctx(req))
        return self._sized(req, req.args.size, b"".join(n + b"\0" for n in names))

    @staticmethod
    def _sized(req, size: int, value: bytes):
        if size == 0:                      # the caller asks how large a buffer it needs
            return fp.reply(req.unique, fp.xattr_size(len(value)))
        if len(value) > size:
            return fp.error(req.unique, errno.ERANGE)
        return [fp.reply_header(req.unique, len(value)), value]

    async def _removexattr(self, req):
        await self.ops.removexattr(req.nodeid, req.args.name, self._ctx(req))
        return fp.error(req.unique, 0)

    def _flush_now(self, req):
        now = getattr(self.ops, "flush_now", None)
        return fp.error(req.unique, 0) if now is not None and now(req.args.fh) else None

    async def _flush(self, req):
        await self.ops.flush(req.args.fh)
        return fp.error(req.unique, 0)

    async def _opendir(self, req):
        fh = await self.ops.opendir(req.nodeid, self._ctx(req))
        return fp.reply(req.unique, fp.OPEN_OUT.pack(fh, 0, 0))

    async def _readdir(self, req):
        a = req.args
        buf = fp.DirBuffer(a.size, req.opcode == fp.Op.READDIRPLUS)
        await self.ops.readdir(a.fh, a.offset, buf)
        return fp.reply(req.unique, buf.body())

    async def _releasedir(self, req):
        await self.ops.releasedir(req.args.fh)
        return fp.error(req.unique, 0)

    async def _fsyncdir(self, req):
        await self.ops.fsyncdir(req.args.fh, bool(req.args.fsync_flags & fp.FSYNC_FDATASYNC))
        return fp.error(req.unique, 0)

    def stats(self) -> dict:
        return {**self.counts, "workers": self._workers, "flags": hex(self.flags)}
