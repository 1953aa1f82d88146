"""dnfs: mount the cluster as a filesystem, unmount it, check it.

\b
  dnfs mount --cluster /tmp/dn /mnt/dn        # metadata in /tmp/dn/dnfs.db (SQLite), returns once mounted
  dnfs stats /mnt/dn                          # what it buffers, its requests, its metadata engine
  dnfs sync /mnt/dn                           # write what it buffers, make the metadata durable
  dnfs umount /mnt/dn                         # flushes, waits for the mount process to exit
  dnfs fsck --cluster /tmp/dn [--repair]      # while unmounted
"""
from __future__ import annotations

import json
import logging
import os
import pathlib
import shutil
import subprocess
import sys
import time

import click
import trio

from client.fs.engines import open_meta
from client.fs.meta import MetaBusy
from client.fs.writeback import BUDGET, CHUNK, WRITE_RETRY_S
from client.fs.mount import (REQUEST_TIMEOUT_S, MountError, check_mountpoint, fuse_conf, login_error,
                             mount_options, mount_pid, not_mounted, serve, unmount)
from wire import aio, sdnotify
from wire.etcdmap import ACCESS_OPTIONS, EtcdAccess

KNOWN = (MountError, MetaBusy, ValueError, OSError)


def _run(fn, *args, **kw):
    """trio.run, with expected failures turned into one clear message (never a traceback)."""
    from client.sdk import ClientError
    try:
        return trio.run(lambda: fn(*args, **kw))
    except BaseException as e:     # noqa: BLE001 - sorted below
        leaves = [x for x in aio.leaves(e) if not isinstance(x, trio.Cancelled)]
        known = [x for x in leaves if isinstance(x, KNOWN + (ClientError,))]
        if known:
            raise click.ClickException(str(known[0])) from None
        if leaves and isinstance(leaves[0], KeyboardInterrupt):
            raise click.Abort() from None
        raise


def _need_fusermount() -> None:
    """fusermount3 (Debian's fuse3) mounts for users other than root and unmounts for everyone."""
    if shutil.which("fusermount3") is None:
        raise click.ClickException("fusermount3 not found: install FUSE 3 (Debian/Ubuntu: apt install fuse3)")


def _cluster_json(cluster_dir: str) -> dict:
    path = pathlib.Path(cluster_dir) / "cluster.json"
    try:
        info = json.loads(path.read_text())
        if not isinstance(info, dict) or not isinstance(info.get("config", {}), dict):
            raise ValueError("not a cluster description")
        return info
    except FileNotFoundError:
        raise click.ClickException(f"{cluster_dir} is not a cluster directory (no cluster.json); start one "
                                   f"with: dnctl cluster up --dir {cluster_dir}") from None
    except (OSError, ValueError) as e:
        raise click.ClickException(f"{path} is unreadable: {e}") from None


def _cluster(cluster_dir: str | None, node: tuple[str, ...], etcd: str | None = None,
             access: dict | None = None) -> tuple[list[str], list[str], str | None]:
    """(datanode addresses, node directories, etcd URL) from a cluster directory and/or --node (none needed
    with --etcd: the partition map is in etcd).  A cluster directory with its own etcd gives its URL (unless
    --etcd) and, in ``access`` (the --etcd-* options), its mount user (unless --etcd-credentials)."""
    addrs, dirs = list(node), []
    if cluster_dir:
        try:
            info = _cluster_json(cluster_dir)
            addrs += [n["addr"] for n in info["nodes"]]
            dirs += [n["dir"] for n in info["nodes"]]
            own = info.get("etcd") or {}
            etcd = etcd or own.get("url")
            if own.get("auth") and access is not None and not access.get("credentials"):
                access["credentials"] = str(pathlib.Path(own["auth"]) / "mount")
            if own.get("pki") and access is not None and not (access.get("cert") or access.get("key")):
                # its etcd requires a client certificate: the mount's, and the cluster's CA
                pki = pathlib.Path(own["pki"])
                access.update(cert=str(pki / "mount.pem"), key=str(pki / "mount.key"),
                              ca=access.get("ca") or str(pki / "ca.pem"))
        except (KeyError, TypeError) as e:
            raise click.ClickException(f"{cluster_dir}/cluster.json is unreadable: {e}") from None
    if not addrs and not etcd:
        raise click.UsageError("name the cluster: --cluster DIR, --node ADDR or --etcd URL")
    return addrs, dirs, etcd


def _cluster_login(cluster_dir: str | None, secret_file: str | None,
                   tls_ca: str | None) -> tuple[str | None, str | None]:
    """(secret_file, tls_ca): what the command line left open, from a local cluster directory -- its secret
    (DIR/cluster.secret, made by `dnctl cluster up`) and its nodes' TLS CA."""
    if not cluster_dir:
        return secret_file, tls_ca
    cfg = _cluster_json(cluster_dir).get("config") or {}
    if not secret_file:
        own = pathlib.Path(cluster_dir) / "cluster.secret"
        secret_file = str(own) if own.is_file() else cfg.get("secret_file") or None
        if secret_file and not os.path.isfile(secret_file):
            raise click.ClickException(f"the cluster in {cluster_dir} authenticates with the secret "
                                       f"{secret_file} (its cluster.json says), and that file is gone: put it "
                                       f"back, or pass the secret with --secret-file FILE")
    return secret_file, tls_ca or cfg.get("tls_ca") or None


def _meta_url(meta: str | None, cluster_dir: str | None, etcd: str | None = None) -> str:
    if meta:
        if not (meta.startswith("sqlite:") and meta != "sqlite:") and not meta.startswith("etcd://"):
            raise click.BadParameter(f"{meta!r}: use sqlite:PATH or etcd://HOST:PORT[/VOLUME]",
                                     param_hint="--meta")
        return meta
    if etcd and not cluster_dir:
        first = etcd.split(",")[0].strip()
        return "etcd://" + first.split("://", 1)[-1].rstrip("/") + "/default"
    if not cluster_dir:
        raise click.UsageError("--meta sqlite:PATH is needed without --cluster")
    return "sqlite:" + str(pathlib.Path(cluster_dir).resolve() / "dnfs.db")


@click.group(help=__doc__, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="datanode", prog_name="dnfs")
def main():
    pass


cluster_opts = [
    click.option("--cluster", "cluster_dir", type=click.Path(file_okay=False),
                 help="Local cluster directory (from `dnctl cluster up --dir`): its nodes, its etcd (the "
                      "partition map is followed from there), its secret and TLS CA, unless given below."),
    click.option("--node", multiple=True, help="A datanode address HOST:PORT (repeatable), instead of --cluster."),
    click.option("--etcd", help="The cluster's etcd (http://HOST:PORT[,...]), when a cluster manager keeps "
                      "the partition map there: writes follow its changes (a dead replica is dropped within "
                      "seconds).  Without --cluster also the default metadata store (etcd://HOST:PORT/default)."),
    click.option("--meta", help="Metadata store: sqlite:PATH (one mount; default sqlite:CLUSTER_DIR/dnfs.db) or "
                      "etcd://HOST:PORT[/VOLUME] (shared by many mounts)."),
    click.option("--secret-file", type=click.Path(dir_okay=False), envvar="DATANODE_SECRET_FILE", show_envvar=True,
                 help="The cluster secret, a client role key file, or a volume key file (`dnctl volume key`: "
                      "files then go to that volume's partitions only, and only those are readable), for nodes "
                      "that have secret_file set (default with --cluster DIR: DIR/cluster.secret, if the "
                      "cluster has one)."),
    click.option("--tls-ca", type=click.Path(dir_okay=False), envvar="DATANODE_TLS_CA", show_envvar=True,
                 help="CA bundle (PEM): speak TLS to the nodes and check their certificates against it "
                      "(default with --cluster DIR: the nodes' tls_ca, if they have one)."),
] + [click.option(opt, arg, type=click.Path(dir_okay=False), envvar=env, show_envvar=True, help=text)
     for opt, env, arg, text in ACCESS_OPTIONS]     # etcd's user and TLS (with --cluster: DIR/etcd-auth/mount)


def _login(secret_file: str | None, tls_ca: str | None, access: dict) -> dict:
    """The credentials and TLS context for the cluster, and how to reach its etcd, loaded once (DataClient
    arguments)."""
    from wire.auth import AuthConfigError, Credentials
    from wire.transport.tls import TlsConfigError, client_context
    try:
        return {"secret": Credentials.load(secret_file) if secret_file else None,
                "tls_ca": client_context(tls_ca) if tls_ca else None, "etcd_access": EtcdAccess.load(**access)}
    except (AuthConfigError, TlsConfigError, ValueError) as e:
        raise click.ClickException(str(e)) from None


def _access_args(access: dict) -> list[str]:
    """The --etcd-* options again, for the mount's own process."""
    return [a for opt, _env, arg, _h in ACCESS_OPTIONS if access.get(arg)
            for a in (opt, os.path.abspath(access[arg]))]


def with_cluster(fn):
    for opt in reversed(cluster_opts):
        fn = opt(fn)
    return fn


@main.command("mount")
@with_cluster
@click.argument("mountpoint", type=click.Path(file_okay=False))
@click.option("--partition", type=click.IntRange(1), multiple=True,
              help="Data partition(s) files are written to (default: every partition of the cluster).")
@click.option("--buffer-mib", type=click.IntRange(4, 1 << 16), default=BUDGET >> 20, show_default=True,
              help="Write-back buffer budget of the whole mount.")
@click.option("--chunk-mib", type=click.IntRange(1, 1024), default=CHUNK >> 20, show_default=True,
              help="A file's buffered bytes are flushed in the background at this size; a writer faster than "
                   "the cluster waits for up to one such flush.")
@click.option("--timeout", type=click.FloatRange(1, 3600), default=REQUEST_TIMEOUT_S, show_default=True,
              help="Seconds a request to the cluster may take before it fails (EIO).  A node that answers "
                   "nothing at all (hung, paused) is given up on sooner: after a few of its usual answer "
                   "times (2-10 s), and the write goes on elsewhere or once the cluster manager moved the "
                   "partition.")
@click.option("--write-retry", type=click.FloatRange(0, 3600), default=WRITE_RETRY_S, show_default=True,
              help="Seconds a failed write is retried (in a new extent, on another partition or after the "
                   "replica set changed) before the application sees EIO.")
@click.option("--writeback", is_flag=True,
              help="close() returns once the file's bytes are in the mount's buffer; they are written to the "
                   "cluster right after, in the background (many small files -- tar, cp -r -- go faster).  "
                   "fsync() still waits for them, and unmounting writes them all first; but bytes of files "
                   "closed in the last moments are lost if the mount process dies (kill -9, out of memory), as "
                   "a local disk's unsynced writes are on a power cut, and `sync` does not reach them: `dnfs sync "
                   "MOUNTPOINT` does (`dnfs stats` shows what is still unwritten).  A failed background write is "
                   "logged and reported (EIO) by the file's next close or fsync here, and by `dnfs sync`.")
@click.option("--inline-kib", type=click.IntRange(0, 1024), default=None,
              help="With SQLite metadata: files of at most this many KiB keep their bytes in the metadata "
                   "database, committed with the rest of the file's metadata in one local transaction -- what a "
                   "close or fsync of a small file waits for -- instead of an append every replica acknowledges "
                   "(as safe: the file is reachable only through that database anyway).  0: never.  "
                   "[default: 64]")
@click.option("--allow-other/--no-allow-other", default=None,
              help="Whether users other than the one mounting may use the mount (the kernel checks each access "
                   "against the files' modes and ACLs either way).  Default: yes when root mounts, no when an "
                   "ordinary user does (--allow-other then needs 'user_allow_other' in /etc/fuse.conf).")
@click.option("--kernel-cache", is_flag=True,
              help="Let the kernel keep written pages and send them later, in larger writes (FUSE's write-back "
                   "cache).  Experimental: a file whose write the cluster refused (ENOSPC) may read back with "
                   "zeros where its bytes were, instead of ending where the stored bytes end.")
@click.option("--foreground", "-f", is_flag=True, help="Stay in the foreground (logs to stderr).")
@click.option("--log", "log_path", type=click.Path(dir_okay=False),
              help="Log file of the background mount (default: META_PATH.log).")
@click.option("--debug", is_flag=True, help="Log every request.")
@click.option("--json", "as_json", is_flag=True)
def mount_cmd(cluster_dir, node, etcd, meta, secret_file, tls_ca, mountpoint, partition, buffer_mib, chunk_mib,
              timeout, write_retry, writeback, inline_kib, allow_other, kernel_cache, foreground, log_path, debug,
              as_json, **access):
    """Mount the cluster at MOUNTPOINT.  Returns once the mount is up (the filesystem runs in a background
    process; `dnfs umount MOUNTPOINT` stops it).

    \b
    Example:
      dnctl cluster up --nodes 3 --dir /tmp/dn
      dnfs mount --cluster /tmp/dn /mnt/dn
      cp -r ~/src /mnt/dn/ && dnfs umount /mnt/dn
    """
    _need_fusermount()
    secret_file, tls_ca = _cluster_login(cluster_dir, secret_file, tls_ca)
    addrs, _, map_etcd = _cluster(cluster_dir, node, etcd, access)
    url = _meta_url(meta, cluster_dir, etcd)
    etcd = map_etcd
    mountpoint = os.path.abspath(mountpoint)
    login = _login(secret_file, tls_ca, access)
    try:                      # refused here in one line, not in the background process's log
        check_mountpoint(mountpoint)
        mount_options(os.getpid(), os.getuid(), allow_other, fuse_conf())
    except MountError as e:
        raise click.ClickException(str(e)) from None
    if foreground:
        logging.basicConfig(level=logging.DEBUG if debug else logging.INFO,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        _run(serve, mountpoint, addrs, url, partitions=list(partition) or None, budget=buffer_mib << 20,
             chunk=chunk_mib << 20, timeout=timeout, write_retry_s=write_retry, etcd=etcd, writeback=writeback,
             inline_max=None if inline_kib is None else inline_kib << 10, login=login, allow_other=allow_other,
             writeback_cache=kernel_cache, ready=lambda: sdnotify.ready(f"mounted {mountpoint}"))
        return
    if not log_path:
        log_path = (url.partition(":")[2] + ".log" if url.startswith("sqlite:") else
                    os.path.join(os.environ.get("TMPDIR", "/tmp"), f"dnfs-{os.getpid()}.log"))
    log_path = os.path.abspath(log_path)
    args = [sys.executable, "-m", "client.fs.cli", "mount", "--foreground", "--meta", url, "--buffer-mib",
            str(buffer_mib), "--chunk-mib", str(chunk_mib), "--timeout", str(timeout), "--write-retry",
            str(write_retry)]
    if etcd:
        args += ["--etcd", etcd]
    if secret_file:
        args += ["--secret-file", os.path.abspath(secret_file)]
    if tls_ca:
        args += ["--tls-ca", os.path.abspath(tls_ca)]
    args += _access_args(access)
    if cluster_dir:
        args += ["--cluster", cluster_dir]
    for a in node:
        args += ["--node", a]
    for p in partition:
        args += ["--partition", str(p)]
    if debug:
        args.append("--debug")
    if writeback:
        args.append("--writeback")
    if kernel_cache:
        args.append("--kernel-cache")
    if inline_kib is not None:
        args += ["--inline-kib", str(inline_kib)]
    if allow_other is not None:
        args.append("--allow-other" if allow_other else "--no-allow-other")
    args.append(mountpoint)
    env = os.environ.copy()
    src = pathlib.Path(__file__).resolve().parents[2]
    if (src / "pyproject.toml").exists():
        # run from a source checkout: the background process (its cwd is /) runs this checkout's code too, not
        # whatever the interpreter has installed
        env["PYTHONPATH"] = os.pathsep.join([str(src)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    with open(log_path, "ab") as logf:
        proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd="/", env=env)
    deadline = time.monotonic() + timeout + 30
    while mount_pid(mountpoint) != proc.pid:
        if proc.poll() is not None:
            raise click.ClickException(f"mount failed: {_tail(log_path)}")
        if time.monotonic() > deadline:
            proc.kill()
            raise click.ClickException(f"the mount did not come up within {timeout + 30:g}s; see {log_path}")
        time.sleep(0.05)
    res = {"mountpoint": mountpoint, "pid": proc.pid, "meta": url, "log": log_path, "nodes": addrs}
    click.echo(json.dumps(res) if as_json else
               f"mounted {mountpoint} (pid {proc.pid}, meta {url}, log {log_path}); unmount: dnfs umount {mountpoint}")


def _tail(path: str) -> str:
    try:
        lines = [ln for ln in pathlib.Path(path).read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return f"(no log at {path})"
    return lines[-1].split(": ", 1)[-1] if lines else f"(empty log {path})"


@main.command("umount")
@click.argument("mountpoint", type=click.Path(file_okay=False))
@click.option("--lazy", is_flag=True, help="Detach now even if files are open (fusermount3 -z).")
@click.option("--timeout", type=click.FloatRange(1, 3600), default=120.0, show_default=True,
              help="Seconds to wait for the mount process to flush and exit.")
@click.option("--json", "as_json", is_flag=True)
def umount_cmd(mountpoint, lazy, timeout, as_json):
    """Unmount a dnfs mount and wait until its process has flushed and exited."""
    _need_fusermount()
    try:
        res = unmount(mountpoint, timeout, lazy)
    except MountError as e:
        raise click.ClickException(str(e)) from None
    click.echo(json.dumps(res) if as_json else f"unmounted {res['mountpoint']}")


def _control(mountpoint: str, op: str, timeout: float) -> dict:
    from client.fs.control import ControlError, ask
    pid = mount_pid(mountpoint)
    if pid is None:
        raise click.ClickException(str(not_mounted(mountpoint)))
    try:
        return ask(pid, op, timeout)
    except ControlError as e:
        raise click.ClickException(str(e)) from None


def _size(n: float) -> str:
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024 or unit == "GiB":
            break
    return f"{n:.1f} {unit}"


def _control_command(name: str, timeout: float, timeout_help: str):
    """A command that asks a running mount (its MOUNTPOINT) over its control socket."""
    def deco(fn):
        fn = click.option("--json", "as_json", is_flag=True)(fn)
        fn = click.option("--timeout", type=click.FloatRange(0.1, 3600), default=timeout, show_default=True,
                          help=timeout_help)(fn)
        fn = click.argument("mountpoint", type=click.Path(file_okay=False))(fn)
        return main.command(name)(fn)
    return deco


@_control_command("stats", 10.0, "Seconds to wait for the mount's answer.")
def stats_cmd(mountpoint, timeout, as_json):
    """What a running mount holds and has done: bytes buffered and not yet written to the cluster (with
    --writeback, of closed files too), open files, background writes, files with a write failure not yet
    reported, FUSE requests by kind (count, answered with an error, seconds spent), and the metadata engine's
    counters.

    \b
      dnfs stats /mnt/dn
      dnfs stats /mnt/dn --json | jq .unwritten_bytes
    """
    st = _control(mountpoint, "stats", timeout)
    if as_json:
        click.echo(json.dumps(st))
        return
    wb = "on" if st["writeback"] else "off"
    click.echo(f"mount {os.path.abspath(mountpoint)} (pid {st['pid']}, write-back {wb})")
    click.echo(f"unwritten: {_size(st['unwritten_bytes'])} in {st['unwritten_files']} file(s) "
               f"(buffer budget {_size(st['buffer_budget'])}); background writes running: {st['background_flushes']}")
    click.echo(f"open files: {st['open_files']} (held: {st['files_held']}); files with an unreported write "
               f"failure: {st['files_failed']}")
    reqs = st["requests"]
    if reqs:
        click.echo(f"{'request':12} {'count':>10} {'failed':>8} {'ms avg':>8}")
        for k, r in sorted(reqs.items(), key=lambda kv: -kv[1]["seconds"]):
            click.echo(f"{k:12} {r['count']:10d} {r['failed']:8d} {1e3 * r['seconds'] / max(1, r['count']):8.3f}")
    if st.get("fuse"):
        fu = st["fuse"]
        click.echo(f"FUSE: {fu['requests']} requests ({fu['after_reply']} read right after an answer, the rest in "
                   f"{fu['wakeups']} wakeups), {fu['inline']} answered inline, {fu['interrupted']} interrupted, "
                   f"{fu['malformed']} not understood")
    if st["meta"]:
        click.echo("metadata: " + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in st["meta"].items()))


@_control_command("sync", 300.0, "Seconds to wait for the mount to write everything.")
def sync_cmd(mountpoint, timeout, as_json):
    """Write every byte the mount buffers (with --writeback, of closed files too) to the cluster, and make
    its metadata durable: what `sync` does for a local disk -- the kernel does not pass `sync` to the mount.
    Exit status 1 if some file's bytes could not be written (its inode is named; the file also reports EIO at
    its next close or fsync).

    \b
      tar xf src.tar -C /mnt/dn/ && dnfs sync /mnt/dn
    """
    r = _control(mountpoint, "sync", timeout)
    if as_json:
        click.echo(json.dumps(r))
    else:
        click.echo(f"wrote {_size(r['bytes'])} of {r['files']} file(s) and made the metadata durable in "
                   f"{r['seconds']:.2f}s" + (f"; NOT written: inode(s) {r['failed_inodes']}"
                                             if r["failed_inodes"] else ""))
    if r["failed_inodes"]:
        sys.exit(1)


@main.command("fsck")
@with_cluster
@click.option("--repair", is_flag=True, help="Fix what is safe to fix (see dnfs fsck --help).")
@click.option("--no-crc", is_flag=True, help="Do not read data back to check CRCs (metadata and sizes only).")
@click.option("--json", "as_json", is_flag=True)
def fsck_cmd(cluster_dir, node, etcd, meta, secret_file, tls_ca, repair, no_crc, as_json, **access):
    """Check the metadata against itself and the datanodes (run it while unmounted).  Exit status 1 if
    problems remain."""
    from client.fs.fsck import fsck
    from client.sdk import ClientError, DataClient
    secret_file, tls_ca = _cluster_login(cluster_dir, secret_file, tls_ca)
    addrs, _, map_etcd = _cluster(cluster_dir, node, etcd, access)
    url = _meta_url(meta, cluster_dir, etcd)
    etcd = map_etcd
    login = _login(secret_file, tls_ca, access)

    async def go():
        m = await trio.to_thread.run_sync(open_meta, url, login["etcd_access"])
        try:
            async with DataClient.from_env(addrs, etcd=etcd, **login) as dc:
                return await fsck(m, dc, repair=repair, verify_crc=not no_crc)
        except ClientError as e:
            raise login_error(e, login) if e.auth else e from None
        finally:
            await m.close()

    rep = _run(go)
    left = rep["problems"] if not repair else [p for p in rep["problems"]
                                               if p not in [{k: v for k, v in r.items() if k != "action"}
                                                            for r in rep["repaired"]]]
    if as_json:
        click.echo(json.dumps(rep))
    else:
        click.echo(f"{rep['slices']} slices ({rep['inline_slices']} inline), {rep['pieces_crc_checked']} pieces "
                   f"CRC-checked, deletion queue {rep['deletion_queue']}")
        for p in rep["problems"]:
            click.echo("problem: " + " ".join(f"{k}={v}" for k, v in p.items()))
        for r in rep["repaired"]:
            click.echo("repaired: " + " ".join(f"{k}={v}" for k, v in r.items()))
        if repair:
            click.echo(f"{rep['extents_released']} extent(s) released on the datanodes")
        click.echo("clean" if not left else f"{len(left)} problem(s) left")
    sys.exit(1 if left else 0)


if __name__ == "__main__":
    main()
