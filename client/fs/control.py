"""A mount's control socket: ``dnfs stats`` and ``dnfs sync`` ask the running mount process.

The kernel passes neither ``sync`` nor a question like "how much is still buffered?" to a FUSE file system, so
the mount answers them on a Unix socket of its own, ``RUN_DIR/PID.sock`` (PID: the mount's process, found from
its fsname, :func:`client.fs.mount.mount_pid`); RUN_DIR is /run/dnfs for root, the user's runtime directory
(or /tmp/dnfs-UID) for an ordinary user's own mount.  The directory is created with mode 0700 and the socket
0600: only the mount's own user reaches it.  One request per connection: a JSON line ``{"op": "stats"}`` or
``{"op": "sync"}``; one JSON line back (``{"error": "..."}`` when it failed).
"""
from __future__ import annotations

import json
import logging
import os
import socket

import trio

log = logging.getLogger(__name__)



def run_dir() -> str:
    if "DNFS_RUN_DIR" in os.environ:
        return os.environ["DNFS_RUN_DIR"]
    if os.getuid() == 0:
        return "/run/dnfs"
    user = os.environ.get("XDG_RUNTIME_DIR") or f"/run/user/{os.getuid()}"
    return os.path.join(user, "dnfs") if os.path.isdir(user) else f"/tmp/dnfs-{os.getuid()}"


MAX_REQUEST = 4096            # bytes of a request line at most
REQUEST_TIMEOUT = 10.0        # seconds a peer may take to send its request


class ControlError(Exception):
    pass


def sock_path(pid: int) -> str:
    return os.path.join(run_dir(), f"{pid}.sock")


async def serve(ops: dict, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Answer requests on this process's control socket until cancelled; ``ops``: name -> async function
    returning a JSON-able dict.  A socket that cannot be made is logged, not fatal: the mount serves files
    without it."""
    path = sock_path(os.getpid())
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        if os.stat(os.path.dirname(path)).st_uid != os.getuid():     # /tmp: someone else's, made in our way
            raise PermissionError(f"{os.path.dirname(path)} belongs to another user")
        try:
            os.unlink(path)               # a previous process with our pid (a reboot since) left it
        except FileNotFoundError:
            pass
        await sock.bind(path)
        os.chmod(path, 0o600)
        sock.listen(8)
    except OSError as e:
        sock.close()
        log.warning("no control socket (%s: %s): `dnfs stats` and `dnfs sync` will not reach this mount", path, e)
        task_status.started()
        return
    try:
        task_status.started()
        await trio.serve_listeners(lambda stream: _answer(stream, ops), [trio.SocketListener(sock)])
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass


async def _answer(stream: trio.SocketStream, ops: dict) -> None:
    try:
        line = b""
        with trio.move_on_after(REQUEST_TIMEOUT):
            while not line.endswith(b"\n") and len(line) < MAX_REQUEST:
                chunk = await stream.receive_some(MAX_REQUEST)
                if not chunk:
                    break
                line += chunk
        try:
            req = json.loads(line)
            fn = ops[req["op"]]
        except (ValueError, KeyError, TypeError):
            out = {"error": f"not a request: {line[:100]!r} (ops: {', '.join(sorted(ops))})"}
        else:
            try:
                out = await fn()
            except Exception as e:      # noqa: BLE001 - the asker hears what went wrong; the mount goes on
                log.exception("control request %s failed", req["op"])
                out = {"error": f"{type(e).__name__}: {e}"}
        await stream.send_all(json.dumps(out).encode() + b"\n")
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        pass                             # the asker went away


def ask(pid: int, op: str, timeout: float) -> dict:
    """Send ``op`` to the mount process ``pid`` and return its answer (blocking; for the CLI)."""
    path = sock_path(pid)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        try:
            s.connect(path)
        except (FileNotFoundError, ConnectionRefusedError):
            raise ControlError(f"the mount process {pid} has no control socket ({path}): it is older than this "
                               f"dnfs, or could not make one (see its log)") from None
        s.sendall(json.dumps({"op": op}).encode() + b"\n")
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = s.recv(1 << 16)
            if not chunk:
                break
            buf += chunk
    except socket.timeout:
        raise ControlError(f"the mount process {pid} did not answer {op!r} within {timeout:g}s") from None
    except OSError as e:
        raise ControlError(f"control socket {path}: {e}") from None
    finally:
        s.close()
    try:
        out = json.loads(buf)
    except ValueError:
        raise ControlError(f"the mount process {pid} answered {op!r} with {buf[:100]!r}") from None
    if "error" in out:
        raise ControlError(f"the mount process {pid}: {out['error']}")
    return out
