"""The audit log: one JSON line per admin action (who, what, when, result), beside the daemon's log.

Written by the request wrapper (``ops.wrap.Wrap``) for every request of ``protocol.ADMIN_ACTIONS`` (partition
create, update, delete, repair and scrub requests, trash list, restore and purge), whatever its result --
refusals (FORBIDDEN, BAD_BODY) included -- before the answer is sent, so an answered action is on file, in the
order answered.  Each line:

    {"ts": 1700000000.123, "time": "2026-11-23T09:00:00Z", "node": "127.0.0.1:17310",
     "peer": "10.0.0.5:40112", "role": "admin", "identity": "", "op": "PARTITION_DELETE",
     "partition": 7, "epoch": 0, "result": "OK", "detail": ""}

The file is opened in append mode for each line, in a worker thread (admin actions are rare), so it can be
rotated by moving it away at any time.
"""
from __future__ import annotations

import contextvars
import json
import logging
import time

import trio

log = logging.getLogger(__name__)

# What a handler of an admin action says about it for the audit line's "detail" when it succeeds (e.g. which
# trash entries it restored or purged).  Each request runs in its own task, so a value set by its handler
# is seen by nobody else.
NOTE: contextvars.ContextVar[str] = contextvars.ContextVar("audit_note", default="")


class AuditLog:
    def __init__(self, path: str, node: str):
        self.path = path
        self.node = node
        self.lines = 0
        self.errors = 0

    def _append(self, line: str) -> None:
        with open(self.path, "a") as f:
            f.write(line)

    async def record(self, *, peer: str, role, identity: str, op: str, partition: int, epoch: int,
                     result: str, detail: str = "") -> None:
        now = time.time()
        rec = {"ts": round(now, 3), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
               "node": self.node, "peer": peer, "role": role.name.lower() if role is not None else None,
               "identity": identity, "op": op, "partition": partition, "epoch": epoch, "result": result,
               "detail": detail[:500]}
        try:
            await trio.to_thread.run_sync(self._append, json.dumps(rec) + "\n")
            self.lines += 1
        except OSError as e:
            self.errors += 1
            log.error("audit log %s: cannot append (%s): %s", self.path, e, json.dumps(rec))
