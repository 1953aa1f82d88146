"""What every command line of tools/ shares: option types, the cluster-dir option, output, errors, units,
progress lines.  Presentation only: the logic is in client/admin.py (and tools/cluster.py for local
processes).

Errors: a command raises ``click.ClickException`` (one line, exit status 1) or lets ``run`` turn a
``ClientError`` (the SDK's message: node, result text and the server's arg) into one.  ``Group`` is the
last net: an exception nobody expected is printed as one line naming its type, never as a traceback
(``DNCTL_TRACEBACK=1`` shows it for a bug report).
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import ssl
import sys
import time

import click
import trio

from client import admin
from client.sdk import ClientError
from wire import aio
from wire.auth import AuthConfigError, Credentials
from wire.etcdmap import ACCESS_OPTIONS, Etcd, EtcdAccess
from wire.protocol import Role

CTX = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


def refusal(exc: BaseException) -> str | None:
    """The one line a user sees for an expected failure (a ClientError -- its message already names the
    node, the result and the server's reason -- a refused input, a timeout; several concurrent ones each
    once), or None if ``exc`` is not one of those."""
    leaves = [e for e in aio.leaves(exc) if not isinstance(e, trio.Cancelled)]
    if not leaves or not all(isinstance(e, (ClientError, ValueError, trio.TooSlowError)) for e in leaves):
        return None
    texts = ["timed out" if isinstance(e, trio.TooSlowError) else str(e) for e in leaves]
    return "; ".join(dict.fromkeys(texts))


def _guarded(invoke, ctx):
    try:
        return invoke(ctx)
    except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException, SystemExit,
            KeyboardInterrupt):
        raise
    except Exception as e:  # noqa: BLE001 - the last net: one line, not a traceback
        text = refusal(e)
        if text is not None:
            raise click.ClickException(text) from None
        if os.environ.get("DNCTL_TRACEBACK"):
            raise
        raise click.ClickException(f"unexpected {type(e).__name__}: {e} (DNCTL_TRACEBACK=1 shows where)") \
            from None


class Group(click.Group):
    """A click group whose commands never show a Python traceback to the user."""

    def invoke(self, ctx):
        return _guarded(super().invoke, ctx)


class Command(click.Command):
    """A stand-alone click command (``python -m tools.X``) that never shows a Python traceback."""

    def invoke(self, ctx):
        return _guarded(super().invoke, ctx)


def version() -> str:
    """The installed package's version (pyproject.toml), for --version."""
    from importlib import metadata
    try:
        return metadata.version("datanode")
    except metadata.PackageNotFoundError:
        return "unknown (not installed: pip install -e .)"


def emit(obj, as_json: bool, text: str | None = None) -> None:
    """``--json``: the raw object (numbers unscaled); else ``text``."""
    if as_json:
        click.echo(json.dumps(obj, indent=2, sort_keys=True))
    else:
        click.echo(text if text is not None else json.dumps(obj, indent=2))


def run(fn, *args):
    """Run an async action; a ClientError (or a refused input: ValueError) becomes one clean line, exit 1."""
    try:
        return trio.run(fn, *args)
    except (ClientError, ValueError, trio.TooSlowError, BaseExceptionGroup) as e:
        text = refusal(e)
        if text is None:
            raise
        raise click.ClickException(text) from None


# -- option types ----------------------------------------------------------------------------------------
class AddrType(click.ParamType):
    name = "HOST:PORT"

    def convert(self, value, param, ctx):
        try:
            return admin.parse_addr(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)


class AddrListType(click.ParamType):
    name = "HOST:PORT,..."

    def convert(self, value, param, ctx):
        if isinstance(value, list):
            return value
        try:
            return admin.parse_addrs(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)


ADDR = AddrType()
ADDRS = AddrListType()


def cluster_option(required: bool = False, help: str = "A local cluster directory (dnctl cluster up)."):
    """``--cluster DIR`` (``--dir`` is the same option, kept for scripts)."""
    return click.option("--cluster", "--dir", "cluster", type=click.Path(file_okay=False), required=required,
                        metavar="DIR", help=help + " Alias: --dir.")


@dataclasses.dataclass
class Login:
    """What a command authenticates with, loaded once: --secret-file / --tls-ca / --etcd-* (click reads
    $DATANODE_SECRET_FILE, $DATANODE_TLS_CA, $DATANODE_ETCD_* for them), else a local cluster's own secret
    and etcd user (``load_cluster``).  Every client the command makes is given it (``credentials``); worker
    processes get the paths."""
    secret: Credentials | None = None
    tls: ssl.SSLContext | None = None
    secret_file: str | None = None
    tls_ca: str | None = None
    etcd_files: dict = dataclasses.field(default_factory=dict)   # EtcdAccess.load's arguments given

    def use_etcd(self, **files) -> None:
        """Reach etcd with these files (EtcdAccess.load's arguments)."""
        self.etcd_files = {**self.etcd_files, **{k: v for k, v in files.items() if v}}

    @property
    def etcd(self) -> EtcdAccess:
        try:
            return EtcdAccess.load(**self.etcd_files)
        except ValueError as e:
            raise click.UsageError(str(e)) from None

    def use_secret(self, path: str) -> None:
        """Authenticate with the secret or role key file at ``path`` (AuthConfigError if unusable)."""
        self.secret, self.secret_file = Credentials.load(path), os.path.abspath(path)

    def use_tls_ca(self, path: str) -> None:
        """Speak TLS, checking nodes against the CA bundle at ``path`` (TlsConfigError if unusable)."""
        from wire.transport.tls import client_context
        self.tls, self.tls_ca = client_context(path), os.path.abspath(path)

    def paths(self) -> dict:
        """The files it was loaded from (secret_file, tls_ca), for another process: a manager, a bench worker."""
        return {k: v for k, v in (("secret_file", self.secret_file), ("tls_ca", self.tls_ca)) if v}


def login() -> Login:
    """The running command's Login (click's context object), empty outside a command."""
    ctx = click.get_current_context(silent=True)
    return ctx.ensure_object(Login) if ctx is not None else Login()


def credentials() -> dict:
    """DataClient arguments for the running command's Login (None: the SDK's own default)."""
    lg = login()
    return {"secret": lg.secret, "tls_ca": lg.tls, "etcd_access": lg.etcd if lg.etcd_files else None}


def default_secret(path: str | None) -> None:
    """Authenticate with ``path`` (a local node's or cluster's own secret_file) unless --secret-file /
    $DATANODE_SECRET_FILE named one."""
    lg = login()
    if path and lg.secret is None:
        try:
            lg.use_secret(path)
        except AuthConfigError as e:
            raise click.ClickException(str(e)) from None


def use_cluster_secret(info: dict) -> None:
    """A local cluster names its secret in its config, and its etcd's admin user in its etcd record
    (``cluster up`` without --insecure): this command then authenticates with them (unless --secret-file,
    --etcd-credentials or their variables say otherwise)."""
    from tools.cluster import local_access_options
    default_secret(info.get("config", {}).get("secret_file"))
    lg = login()
    own = {k[len("etcd_"):]: v for k, v in local_access_options(info.get("etcd"), "admin").items()}
    # the directory's admin user and, where its etcd requires one, the admin's client certificate and the CA
    lg.use_etcd(**{k: v for k, v in own.items() if k not in lg.etcd_files
                   and not (k in ("cert", "key") and ("cert" in lg.etcd_files or "key" in lg.etcd_files))})


def load_cluster(cluster_dir: str) -> dict:
    from tools import cluster
    try:
        info = cluster.load(pathlib.Path(cluster_dir))
        use_cluster_secret(info)
        return info
    except FileNotFoundError as e:
        raise click.ClickException(str(e)) from None
    except (OSError, ValueError, KeyError) as e:
        raise click.ClickException(f"{cluster_dir}/cluster.json is unreadable: {e}") from None


def cluster_nodes(cluster_dir: str) -> list[str]:
    return [n["addr"] for n in load_cluster(cluster_dir)["nodes"]]


def etcd_access_options(fn):
    """--etcd-credentials / --etcd-ca / --etcd-cert / --etcd-key (wire/etcdmap.py ``ACCESS_OPTIONS``), loaded
    at once into the command's Login."""
    def load(ctx, param, value):
        if value:
            if not os.path.isfile(value):
                raise click.BadParameter(f"{value}: no such file")
            ctx.ensure_object(Login).use_etcd(**{param.name: value})
        return value
    for opt, env, name, text in reversed(ACCESS_OPTIONS):
        fn = click.option(opt, name, type=click.Path(dir_okay=False), callback=load, expose_value=False,
                          is_eager=True, envvar=env, show_envvar=True, help=text)(fn)
    return fn


def etcd_option(fn):
    """``--etcd URL[,URL...]``: the cluster map in etcd (instead of, or besides, --cluster DIR)."""
    return click.option("--etcd", metavar="URL[,URL...]",
                        help="etcd endpoints of the cluster map, e.g. http://127.0.0.1:2379 (default: the one "
                             "recorded by `dnctl cluster up` in --cluster DIR).")(fn)


def etcd_url(etcd: str | None, cluster: str | None, *, what: str = "this command") -> str:
    """The etcd endpoints: --etcd URL, else the cluster directory's own etcd; a clear error otherwise."""
    if etcd:
        from wire.etcdmap import parse_urls
        try:
            parse_urls(etcd)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--etcd") from None
        return etcd
    if cluster:
        url = (load_cluster(cluster).get("etcd") or {}).get("url")
        if url:
            return url
        raise click.UsageError(f"{what} needs the cluster map in etcd, and {cluster} was started without etcd "
                               f"(`dnctl cluster up --no-etcd`); give --etcd URL")
    raise click.UsageError(f"{what} needs the cluster map in etcd: give --etcd URL or --cluster DIR")


def etcd_map(etcd: str | None, cluster: str | None, *, what: str = "this command") -> Etcd:
    """The cluster map in etcd as this command reaches it (``etcd_url``, the Login's etcd user and TLS, and
    its admin key for the entries' MACs)."""
    url = etcd_url(etcd, cluster, what=what)
    lg = login()
    return Etcd(url, access=lg.etcd, admin_key=lg.secret.key(Role.ADMIN) if lg.secret is not None else None)


def seeds(via: str | None, cluster: str | None) -> list[str]:
    """Nodes to ask about a partition: --via ADDR, or every node of --cluster DIR."""
    if via and cluster:
        raise click.UsageError("give only one of --via ADDR or --cluster DIR")
    out = [via] if via else cluster_nodes(cluster) if cluster else []
    if not out:
        raise click.UsageError("say where the partition is: --via ADDR (any of its replicas) or --cluster DIR")
    return out


# -- units -------------------------------------------------------------------------------------------------
def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, k in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= k:
            return f"{n / k:.1f} {unit}"
    return f"{int(n)} B"


def fmt_seconds(s: float | None) -> str:
    if s is None:
        return "-"
    s = float(s)
    if s < 60:
        return f"{s:.1f}s"
    if s < 3600:
        return f"{int(s // 60)}m{int(s % 60):02d}s"
    if s < 86400:
        return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"
    return f"{int(s // 86400)}d{int(s % 86400 // 3600):02d}h"


def fmt_count(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, k in (("G", 10 ** 9), ("M", 10 ** 6), ("k", 10 ** 3)):
        if abs(n) >= k:
            return f"{n / k:.1f}{unit}"
    return str(n)


# -- progress ------------------------------------------------------------------------------------------------
class ProgressLine:
    """One status line on stderr while a long operation waits: rewritten in place on a terminal, otherwise
    one line when the phase changes and every ``every`` seconds (logs stay readable).  ``update(text)`` shows it; ``close()`` ends it."""

    def __init__(self, stream=None, every: float = 2.0):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.every = every
        self.last = 0.0
        self.phase: list[str] = []
        self.shown = False

    def update(self, text: str) -> None:
        now = time.monotonic()
        phase = text.split(" ", 2)[:2]          # e.g. "ADDR repairing" / "repair running": a new phase shows at once
        if self.tty:
            self.stream.write("\r" + text.ljust(100)[:max(100, len(text))])
        elif now - self.last >= self.every or phase != self.phase:
            self.stream.write(text + "\n")
            self.last = now
        else:
            return
        self.phase = phase
        self.stream.flush()
        self.shown = True

    def close(self) -> None:
        if self.tty and self.shown:
            self.stream.write("\n")
            self.stream.flush()


def bar(done: float, total: float, width: int = 30) -> str:
    frac = min(max(done / total, 0.0), 1.0) if total > 0 else 0.0
    fill = int(width * frac)
    return f"[{'#' * fill}{'.' * (width - fill)}] {100 * frac:5.1f}%"
