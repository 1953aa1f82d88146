"""Running a mount: one trio loop holding the SDK client, the FUSE session and the deletion-queue worker.

The mount names itself ``dnfs-PID`` (the ``fsname`` in /proc/mounts) so ``dnfs umount`` can find the
process and wait for it to finish, and ``dnfs stats`` / ``dnfs sync`` its control socket
(:mod:`client.fs.control`).  SIGTERM/SIGINT end the session like an unmount: buffered data is flushed, the
deletion queue worked through once more, the metadata closed.
"""
from __future__ import annotations

import errno
import logging
import os
import signal
import subprocess
import time

import pyfuse3
import trio

from client.fs import control
from client.fs.fs import DnFS
from client.fs.engines import open_meta
from client.fs.meta import Meta
from client.sdk import ClientError, DataClient

log = logging.getLogger(__name__)


class MountError(Exception):
    pass


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


async def serve(mountpoint: str, nodes: list[str], meta_url: str, *, partitions: list[int] | None = None,
                budget: int = 256 << 20, chunk: int = 16 << 20, timeout: float = 30.0,
                write_retry_s: float = 30.0, etcd: str | None = None, writeback: bool = False,
                ready=None) -> None:
    """Mount and serve until unmounted.  ``etcd``: the cluster's etcd (the partition map is read from it and
    followed, so a shrunk replica set or a new leader is known within a watch round-trip)."""
    check_mountpoint(mountpoint)
    meta: Meta = await trio.to_thread.run_sync(open_meta, meta_url)
    try:
        async with DataClient.open(nodes, timeout=timeout, etcd=etcd) as dc:
            pids = partitions or sorted(dc.partitions)
            if not pids:
                raise MountError(f"the cluster ({', '.join(nodes) or etcd}) has no data partition: create one with "
                                 f"`dnctl partition create`")
            missing = [p for p in pids if p not in dc.partitions]
            if missing:
                raise MountError(f"partition(s) {missing} unknown to the cluster (known: {sorted(dc.partitions)})")
            async with trio.open_nursery() as n:
                fs = DnFS(meta, dc, pids, n, budget=budget, chunk=chunk, write_retry_s=write_retry_s,
                          writeback=writeback)
                await fs.startup()
                opts = set(pyfuse3.default_options) | {f"fsname=dnfs-{os.getpid()}", "subtype=dnfs"}
                try:
                    pyfuse3.init(fs, mountpoint, opts)
                except RuntimeError as e:
                    raise MountError(f"cannot mount {mountpoint}: {e}") from None
                log.info("mounted %s (meta %s, partitions %s)", mountpoint, meta_url, pids)
                n.start_soon(fs.reclaimer.run)
                n.start_soon(meta.keep_session)
                n.start_soon(fs.run_sweeper)
                n.start_soon(_signals)

                async def stats():
                    return fs.stats()
                await n.start(control.serve, {"stats": stats, "sync": fs.sync_all})
                if ready is not None:
                    ready()
                try:
                    await pyfuse3.main()
                finally:
                    pyfuse3.close(unmount=True)
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
        raise MountError(f"cluster: {e}") from None
    finally:
        with trio.CancelScope(shield=True):
            await meta.close()


async def _signals() -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as sigs:
        async for sig in sigs:
            log.info("signal %d: unmounting", sig)
            pyfuse3.terminate()
            return


def unmount(mountpoint: str, timeout: float = 60.0, lazy: bool = False) -> dict:
    """fusermount3 -u, then wait for the mount's process to exit (it flushes first)."""
    path = os.path.realpath(mountpoint)
    pid = mount_pid(path)
    if path not in mounts():
        raise MountError(f"{mountpoint} is not a dnfs mount")
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
