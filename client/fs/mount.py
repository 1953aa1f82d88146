"""Running a mount: one trio loop holding the SDK client, the FUSE session and the deletion-queue worker.

The mount names itself ``dnfs-PID`` (the ``fsname`` in /proc/mounts) so ``dnfs umount`` can find the
process and wait for it to finish, and ``dnfs stats`` / ``dnfs sync`` its control socket
(:mod:`client.fs.control`).  SIGTERM/SIGINT end the session like an unmount: buffered data is flushed, the
deletion queue worked through once more, the metadata closed.

Who may use it: the kernel checks every access against the mode bits and ACLs (``default_permissions``,
always).  Root's mount is for every user (``allow_other``) unless told otherwise; an ordinary user's mount
(through the set-user-ID fusermount3) is its own unless it asks for ``allow_other``, which FUSE grants only
if /etc/fuse.conf says ``user_allow_other`` (:func:`mount_options`).
"""
from __future__ import annotations

import errno
import logging
import os
import signal
import subprocess
import time

import trio

from client.fs import control
from client.fs.fs import DnFS
from client.fs.fuse_session import Session, SessionError
from client.fs.engines import open_meta
from client.fs.meta import Meta
from client.fs.writeback import BUDGET, CHUNK, WRITE_RETRY_S
from client.sdk import ClientError, DataClient
from wire.protocol import Header, Op

log = logging.getLogger(__name__)


class MountError(Exception):
    pass


REQUEST_TIMEOUT_S = 30.0   # a request to the cluster fails (EIO) after this; a silent node is left sooner
FUSE_CONF = "/etc/fuse.conf"
FUSE_DEV = "/dev/fuse"


def user_allow_other(conf_text: str) -> bool:
    """Does fuse.conf let ordinary users mount with allow_other (a line ``user_allow_other`` of its own)?"""
    return any(line.split("#", 1)[0].strip() == "user_allow_other" for line in conf_text.splitlines())


def mount_options(pid: int, uid: int, allow_other: bool | None, conf_text: str | None) -> set[str]:
    """The FUSE mount options.  ``allow_other`` None: the default -- every user for root's mount, the
    mounting user only for anyone else's.  ``conf_text``: /etc/fuse.conf (None: there is none)."""
    if allow_other is None:
        allow_other = uid == 0
    opts = {"default_permissions", f"fsname=dnfs-{pid}", "subtype=dnfs"}
    if allow_other:
        if uid != 0 and not user_allow_other(conf_text or ""):
            raise MountError(f"other users cannot be given access to an ordinary user's mount unless {FUSE_CONF} "
                             f"has a line 'user_allow_other' (root can add it); or mount with --no-allow-other "
                             f"(only you can use it)")
        opts.add("allow_other")
    return opts


def fuse_conf() -> str | None:
    try:
        with open(FUSE_CONF) as f:
            return f.read()
    except OSError:
        return None


def login_error(e: ClientError, login: dict | None) -> MountError:
    """A refused hello (``ClientError.auth``) as one line saying what is missing and how to fix it."""
    creds = (login or {}).get("secret")
    if creds is None:
        return MountError(f"{e.node or 'the cluster'} requires authentication and no secret was given: pass the "
                          f"cluster secret or a client role key file with --secret-file FILE (a cluster made by "
                          f"`dnctl cluster up` keeps it in DIR/cluster.secret, which --cluster DIR uses)")
    if "does not authenticate" in str(e):
        return MountError(f"{e}: mount it without --secret-file (and without $DATANODE_SECRET_FILE)")
    return MountError(f"{e} -- the secret in {creds.source} is not this cluster's: pass the cluster's own with "
                      f"--secret-file FILE")


async def _check_login(dc: DataClient, pid: int) -> None:
    """With the map from etcd no node has been asked yet: refused credentials are said now, not as EIO on the
    first write (a node that is down is not the mount's problem: failover takes care of it)."""
    part = dc.partition(pid)
    try:
        await dc.request(part.replicas[0], Header(opcode=Op.PING, partition=pid))
    except ClientError as e:
        if e.auth:
            raise
        log.warning("partition %d: leader %s: %s", pid, part.replicas[0], e)


def mounts() -> dict[str, str]:
    """mountpoint -> fsname of every dnfs mount."""
    out = {}
    with open("/proc/mounts") as f:
        for line in f:
            dev, mnt, fstype = line.split()[:3]
            if fstype == "fuse.dnfs" or dev.startswith("dnfs-"):
                out[mnt.replace("\\040", " ")] = dev
    return out


def mount_pid(mountpoint: str) -> int | None:
    dev = mounts().get(os.path.realpath(mountpoint))
    if dev is None or not dev.startswith("dnfs-"):
        return None
    try:
        return int(dev[5:])
    except ValueError:
        return None


def check_mountpoint(mountpoint: str) -> None:
    try:
        st = os.stat(mountpoint)
    except OSError as e:
        if e.errno == errno.ENOTCONN:
            raise MountError(f"{mountpoint} is a dead mount (its process is gone): run "
                             f"`dnfs umount {mountpoint}` first") from None
        raise MountError(f"mount point {mountpoint}: {e.strerror}") from None
    import stat as stat_mod
    if not stat_mod.S_ISDIR(st.st_mode):
        raise MountError(f"mount point {mountpoint} is not a directory")
    if os.path.ismount(mountpoint):
        raise MountError(f"{mountpoint} is already a mount point")
    if os.getuid() != 0 and (not os.access(mountpoint, os.W_OK) or
                             (st.st_mode & stat_mod.S_ISVTX and st.st_uid != os.getuid())):
        raise MountError(f"mount point {mountpoint}: an ordinary user can mount only on a directory it owns "
                         f"(or may write to)")
    if os.getuid() != 0 and not os.access(FUSE_DEV, os.R_OK | os.W_OK):
        raise MountError(f"{FUSE_DEV} is not open to ordinary users here (Debian's fuse3 makes it mode 0666; "
                         f"root can: chmod 666 {FUSE_DEV}); or mount as root")


async def serve(mountpoint: str, nodes: list[str], meta_url: str, *, partitions: list[int] | None = None,
                budget: int = BUDGET, chunk: int = CHUNK, timeout: float = REQUEST_TIMEOUT_S,
                write_retry_s: float = WRITE_RETRY_S, etcd: str | None = None, writeback: bool = False,
                inline_max: int | None = None, ready=None, login: dict | None = None,
                allow_other: bool | None = None, writeback_cache: bool = False) -> None:
    """Mount and serve until unmounted.  ``etcd``: the cluster's etcd (the partition map is read from it and
    followed, so a shrunk replica set or a new leader is known within a watch round-trip).  ``login``: the
    DataClient's credentials (``secret``, ``tls_ca``).  ``allow_other``: see :func:`mount_options`.
    ``inline_max``: files up to this size keep their bytes in the metadata (SQLite; None: its default)."""
    check_mountpoint(mountpoint)
    opts = mount_options(os.getpid(), os.getuid(), allow_other, fuse_conf())
    meta: Meta = await trio.to_thread.run_sync(open_meta, meta_url, (login or {}).get("etcd_access"), inline_max)
    mounted = False
    try:
        async with DataClient.from_env(nodes, timeout=timeout, etcd=etcd, **(login or {})) as dc:
            # a volume key writes files to its volume's partitions only (the nodes refuse the others)
            pids = partitions or dc.volume_partitions()
            if not pids:
                raise MountError((f"volume {dc.volume} has no data partition: create one with `dnctl partition "
                                  f"create --volume {dc.volume}`") if dc.volume else
                                 (f"the cluster ({', '.join(nodes) or etcd}) has no data partition: create one "
                                  f"with `dnctl partition create`"))
            missing = [p for p in pids if p not in dc.partitions]
            if missing:
                raise MountError(f"partition(s) {missing} unknown to the cluster (known: {sorted(dc.partitions)})")
            outside = [p for p in pids if p not in dc.volume_partitions()]
            if outside:
                raise MountError(f"partition(s) {outside} are not in volume {dc.volume} (its partitions: "
                                 f"{dc.volume_partitions()})")
            if not nodes:
                await _check_login(dc, pids[0])
            async with trio.open_nursery() as n:
                fs = DnFS(meta, dc, pids, n, budget=budget, chunk=chunk, write_retry_s=write_retry_s,
                          writeback=writeback)
                await fs.startup()
                session = Session(fs, mountpoint, opts, writeback_cache=writeback_cache)
                try:
                    session.mount()
                except SessionError as e:
                    raise MountError(f"cannot mount {mountpoint}: {e}") from None
                mounted = True
                fs.invalidate = session.invalidate_inode
                log.info("mounted %s (meta %s, partitions %s)", mountpoint, meta_url, pids)
                n.start_soon(fs.reclaimer.run)
                n.start_soon(meta.keep_session)
                n.start_soon(fs.run_sweeper)
                n.start_soon(_signals, session)

                async def stats():
                    return {**fs.stats(), "fuse": session.stats()}
                await n.start(control.serve, {"stats": stats, "sync": fs.sync_all})
                if ready is not None:
                    ready()
                try:
                    await session.run()
                finally:
                    session.close(unmount=True)
                    with trio.CancelScope(shield=True):
                        with trio.move_on_after(timeout):
                            await fs.flush_all()
                            await fs.reclaimer.drain()
                        left = fs.unwritten()
                        if left:
                            log.error("unmounting with %d buffered bytes of %d files not written: the cluster did "
                                      "not take them within %ss", left[0], left[1], timeout)
                    n.cancel_scope.cancel()
                log.info("unmounted %s", mountpoint)
    except ClientError as e:
        raise (login_error(e, login) if e.auth else MountError(f"cluster: {e}")) from None
    finally:
        with trio.CancelScope(shield=True):
            await meta.close()
        if not mounted:                # what a mount that never came up created holds nothing: not left behind
            for f in meta.created:
                try:
                    os.unlink(f)
                except FileNotFoundError:
                    pass
                except OSError as e:
                    log.warning("cannot remove %s: %s", f, e)


async def _signals(session: Session) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as sigs:
        async for sig in sigs:
            log.info("signal %d: unmounting", sig)
            session.terminate()
            return


def not_mounted(mountpoint: str) -> MountError:
    """The error for a path that is not a dnfs mount, saying why: a typo is not a foreign mount."""
    if not os.path.lexists(mountpoint):
        return MountError(f"{mountpoint}: no such file or directory")
    return MountError(f"{mountpoint} is not a dnfs mount")


def unmount(mountpoint: str, timeout: float = 60.0, lazy: bool = False) -> dict:
    """fusermount3 -u, then wait for the mount's process to exit (it flushes first)."""
    path = os.path.realpath(mountpoint)
    pid = mount_pid(path)
    if path not in mounts():
        raise not_mounted(mountpoint)
    cmd = ["fusermount3", "-u"] + (["-z"] if lazy else []) + [path]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        msg = r.stderr.strip() or f"fusermount3 exited with {r.returncode}"
        if "busy" in msg.lower():
            msg += " (files are open in it: close them, or use --lazy)"
        raise MountError(msg)
    waited = 0.0
    if pid is not None:
        t0 = time.monotonic()
        while _alive(pid) and time.monotonic() - t0 < timeout:
            time.sleep(0.05)
        if _alive(pid):
            raise MountError(f"unmounted, but the mount process {pid} did not exit within {timeout:g}s")
        waited = time.monotonic() - t0
    return {"mountpoint": path, "pid": pid, "seconds": round(waited, 2)}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][0] != "Z"
    except OSError:
        return False
