"""The node's copy of etcd's ``parts/`` entries, as etcd holds them, served to clients (``MAP_READ``).

Every datanode already reads ``parts/`` and follows it by a watch (datanode/etcdagent.py); this keeps what
that brings in raw -- each key's sealed value and mod revision -- so SDK clients can follow the map from
a node instead of each logging in to etcd and holding a watch there: etcd's load stays one watch per node
whatever the number of clients.  The values are passed on unchanged, MAC and all: a client checks each
one as it checks etcd's (wire/mapcheck.py), so a node can withhold or delay a view but not forge one that
a client holding the cluster's key accepts.  How it fits: docs/architecture.md, "The map from the nodes".
"""
from __future__ import annotations

import json

import trio

PAGE_BYTES = 256 << 10      # an answer's entries stop near this size (well under a client's answer buffer)
WAIT_MAX_S = 10.0           # a long poll waits at most this long for a change (clients wait less)
ANSWERS_KEPT = 32           # encoded answers kept for the copy's current state (a large map's pages, ...)


class MapCopy:
    """``parts/`` as etcd holds it: key -> (raw value, mod revision, the revision it is served at), complete
    up to ``rev``.  An entry is served at its mod revision, except one a full re-read found that the watch had
    missed: that one at the re-read's revision, so a client already past its mod revision still gets it."""

    def __init__(self, fresh=lambda: True):
        self.fresh = fresh                   # () -> whether the node is in touch with etcd now (registered)
        self.kv: dict[str, tuple[bytes, int, int]] = {}
        self.gone: dict[str, int] = {}       # deleted key -> its deletion's revision (an older put is stale)
        self.rev = 0                         # etcd's revision this copy has every change up to
        self.ready = False                   # read from etcd at least once
        self.closed = False                  # the node stops: waiters answer at once
        self._ev = trio.Event()
        self._answers: dict[tuple, bytes] = {}   # (from rev, page, fresh) -> encoded answer, at self.rev

    def event(self, typ: str, key: str, value: bytes, rev: int, served: int = 0) -> None:
        """One watch event (``PUT`` or ``DELETE``) at mod revision ``rev`` (served at ``served`` if later)."""
        cur = self.kv.get(key)
        if (cur is not None and rev <= cur[1]) or rev <= self.gone.get(key, 0):
            return
        if typ == "PUT":
            self.kv[key] = (value, rev, max(rev, served))
            self.gone.pop(key, None)
        elif cur is not None:
            del self.kv[key]
            self.gone[key] = rev
        self._answers.clear()
        self._advance(rev)

    def reload(self, kvs: list[tuple[str, bytes, int]], rev: int) -> None:
        """A full read of ``parts/`` at store revision ``rev``."""
        seen, before = set(), self.rev
        for key, value, mod in kvs:
            seen.add(key)
            self.event("PUT", key, value, mod, served=rev if mod <= before else 0)
        for key, (_v, mod, _s) in list(self.kv.items()):
            if key not in seen and mod <= rev:
                self.event("DELETE", key, b"", rev)
        self.ready = True
        self._answers.clear()
        self._advance(rev)

    def _advance(self, rev: int) -> None:
        if rev > self.rev:
            self.rev = rev
            self._ev.set()
            self._ev = trio.Event()

    def close(self) -> None:
        self.closed = True
        self._ev.set()

    def since(self, rev: int, page: int = PAGE_BYTES) -> dict:
        """The entries changed after ``rev`` (oldest first), as a MAP_READ answer.  A page ends between two
        revisions only (entries of one revision are never split): ``rev`` then says how far it got and
        ``more`` that the rest follows from there."""
        changed = sorted(((served, key, value, mod) for key, (value, mod, served) in self.kv.items()
                          if served > rev))
        out, size, through = [], 0, self.rev
        for i, (served, key, value, mod) in enumerate(changed):
            if size >= page and served != changed[i - 1][0]:
                through = changed[i - 1][0]
                break
            text = value.decode("utf-8", "replace")
            out.append([key, text, mod])
            size += len(key) + len(text) + 32
        return {"ready": self.ready, "fresh": bool(self.fresh()), "rev": through, "more": len(out) < len(changed),
                "entries": out}

    def answer(self, rev: int, page: int = PAGE_BYTES) -> bytes:
        """``since(rev, page)`` encoded, as a MAP_READ answer.  Clients ask from the same few revisions -- 0 at
        their open, the copy's last revision once a change wakes their long polls -- so each answer is
        encoded once per revision of the copy and served to all of them: a thousand clients opening or
        woken together cost the node one pass over the map, not one each."""
        key = (rev, page, bool(self.fresh()))
        data = self._answers.get(key)
        if data is None:
            data = json.dumps(self.since(rev, page)).encode()
            if len(self._answers) >= ANSWERS_KEPT:
                self._answers.pop(next(iter(self._answers)))
            self._answers[key] = data
        return data

    async def wait_past(self, rev: int, timeout: float) -> None:
        """Until the copy is past ``rev``, ``timeout`` ran out, or the node stops."""
        with trio.move_on_after(min(timeout, WAIT_MAX_S)):
            while self.rev <= rev and not self.closed:
                await self._ev.wait()
