"""Readiness for systemd's ``Type=notify`` units: one datagram to ``$NOTIFY_SOCKET``, as sd_notify(3) sends it.

A plain Unix socket, so the daemon needs no libsystemd.  Outside systemd (no ``$NOTIFY_SOCKET``) every call
does nothing: the same commands run by hand or by tests.
"""
from __future__ import annotations

import logging
import os
import socket
from typing import Callable

import trio

log = logging.getLogger(__name__)


def notify(*fields: str) -> bool:
    """Send ``fields`` ("READY=1", "STATUS=...") as one datagram.  False if there is nowhere to send or the
    send failed: readiness is news for the service manager, never a reason for the daemon to stop."""
    path = os.environ.get("NOTIFY_SOCKET", "")
    if not path:
        return False
    address = "\0" + path[1:] if path.startswith("@") else path      # "@": Linux's abstract namespace
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(address)
            s.send("\n".join(fields).encode())
    except OSError as e:
        log.warning("cannot notify the service manager at %s: %s", path, e)
        return False
    return True


def ready(status: str = "") -> bool:
    """This process does its job now (serving, joined, mounted): systemd starts the units ordered after it."""
    return notify("READY=1", *([f"STATUS={status}"] if status else []))


async def ready_when(test: Callable[[], bool], status: str = "", poll_s: float = 0.05) -> None:
    """``ready(status)`` once ``test()`` holds -- for a service whose readiness is a state its own tasks reach."""
    while not test():
        await trio.sleep(poll_s)
    ready(status)
