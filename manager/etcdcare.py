"""etcd's database files kept near their use: the active manager defragments a member that is mostly free space.

Why: etcd frees the pages of compacted history for reuse but never gives them back to the file system; a
burst of rewrites (many partitions created or moved at once) leaves a file many times larger than what it
holds, and the quota (``--quota-backend-bytes``) counts the file.  Only a defragmentation returns the space.

What: every ``check_s`` the active manager asks each member (``/v3/cluster/member/list``, else the
configured endpoints) for its status (``/v3/maintenance/status``: ``dbSize``, ``dbSizeInUse``) and
defragments (``/v3/maintenance/defragment``) those whose free space is at least ``min_free_bytes`` and at
least half the file -- one member at a time, ``GAP_S`` apart, each at most once a pass: a member defragmenting
answers nothing until it is done (its followers' peers keep the quorum).  What it did, and why it did not,
goes to the log.

Permission: etcd 3.4 lets only a user with its ``root`` role defragment (status needs none): under etcd's
authentication the manager's own user cannot, so it takes a separate maintenance user
(``dnmanager --etcd-maintenance-credentials``; ``dnctl etcd setup-auth --maintenance`` makes one,
``dnctl cluster up`` does by default).  Without one it only warns (once an hour) what an operator should run.
"""
from __future__ import annotations

import logging
import time

import trio

from wire.etcdmap import Etcd, EtcdAccess, EtcdError, client

log = logging.getLogger(__name__)

GAP_S = 5.0                  # between two members' defragmentations
DEFRAG_TIMEOUT_S = 120.0     # one member's defragmentation (it rewrites the whole file)
WARN_EVERY_S = 3600.0        # the "cannot defragment" warning, at most this often
MIN_FREE_BYTES = 32 << 20    # default of ``min_free_bytes``


def needs_defrag(size: int, in_use: int, min_free: int) -> bool:
    """Worth defragmenting: the file's free space is at least ``min_free`` and at least half of the file."""
    free = size - in_use
    return free >= min_free and 2 * free >= size


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


class EtcdCare:
    """One per manager; ``run`` while it is active."""

    def __init__(self, etcd: Etcd, *, check_s: float = 300.0, min_free_bytes: int = MIN_FREE_BYTES,
                 maintenance: EtcdAccess | None = None):
        self.etcd = etcd
        self.check_s = check_s
        self.min_free_bytes = min_free_bytes
        self.access = maintenance or etcd.access
        self.can_defrag = maintenance is not None or not etcd.access.user    # no auth: anyone may
        self.defrags = 0                 # defragmentations done
        self.failures = 0                # and failed
        self._warned = -float("inf")
        self._by_url: dict = {}          # one client (one connection, one token) per member

    async def run(self) -> None:
        if self.check_s <= 0:
            return
        while True:
            await trio.sleep(self.check_s)
            try:
                await self.pass_once()
            except EtcdError as e:
                log.warning("etcd upkeep: %s", e)
            except Exception:                  # noqa: BLE001 -- upkeep must never take the manager down
                log.exception("etcd upkeep: unexpected error (the manager goes on)")

    def _client(self, url: str):
        if url not in self._by_url:
            if len(self._by_url) > 64:               # members replaced over a long life
                self._by_url.clear()
            self._by_url[url] = client(url, self.access, timeout=DEFRAG_TIMEOUT_S)
        return self._by_url[url]

    async def members(self) -> list[str]:
        """The members' client URLs (one each), as etcd lists them; the configured endpoints if it cannot."""
        try:
            r = await self.etcd.call(lambda c: c.post(c.get_url("/cluster/member/list"), json={}))
            out = [m["clientURLs"][0] for m in r.get("members", []) if m.get("clientURLs")]
            if out:
                return sorted(out)
        except (EtcdError, KeyError, TypeError) as e:
            log.debug("etcd member list: %s", e)
        return [c.base_url for c in self.etcd._clients]

    async def status(self, url: str) -> dict:
        def call():
            c = self._client(url)
            return c.post(c.get_url("/maintenance/status"), json={})
        r = await self._on(url, call)
        return {"url": url, "size": int(r.get("dbSize", 0)), "in_use": int(r.get("dbSizeInUse", 0))}

    async def defragment(self, url: str) -> None:
        def call():
            c = self._client(url)
            return c.post(c.get_url("/maintenance/defragment"), json={})
        await self._on(url, call)

    async def _on(self, url: str, fn):
        """``fn()`` in a worker thread; etcd3gw's and requests' errors become EtcdError naming ``url``."""
        import etcd3gw.exceptions as ex
        import requests
        try:
            return await trio.to_thread.run_sync(fn)
        except (ex.Etcd3Exception, requests.RequestException, ValueError) as e:
            why = getattr(e, "detail_text", "") or str(e) or type(e).__name__
            raise EtcdError(f"etcd {url}: {why.strip()[:200]}") from None

    async def pass_once(self) -> list[dict]:
        """Look at every member, defragment those that need it, one at a time; returns what it saw and did."""
        seen = []
        for url in await self.members():
            try:
                st = await self.status(url)
            except EtcdError as e:
                log.warning("etcd upkeep: status of %s", e)
                continue
            seen.append(st)
        todo = [s for s in seen if needs_defrag(s["size"], s["in_use"], self.min_free_bytes)]
        if todo and not self.can_defrag:
            now = time.monotonic()
            if now - self._warned >= WARN_EVERY_S:
                self._warned = now
                log.warning("etcd upkeep: %s mostly free space but this manager may not defragment (etcd allows "
                            "it to its root role only): give dnmanager --etcd-maintenance-credentials, or run "
                            "etcdctl defrag --endpoints %s",
                            ", ".join(f"{s['url']} {_mb(s['size'])} ({_mb(s['in_use'])} in use)" for s in todo),
                            ",".join(s["url"] for s in todo))
            return seen
        for i, st in enumerate(todo):
            if i:
                await trio.sleep(GAP_S)
            log.info("etcd upkeep: %s: database file %s, %s in use: defragmenting", st["url"], _mb(st["size"]),
                     _mb(st["in_use"]))
            t0 = time.monotonic()
            try:
                with trio.fail_after(DEFRAG_TIMEOUT_S + 5):
                    await self.defragment(st["url"])
                after = await self.status(st["url"])
            except (EtcdError, trio.TooSlowError) as e:
                self.failures += 1
                log.warning("etcd upkeep: defragmenting %s failed: %s", st["url"], e or "timed out")
                continue
            self.defrags += 1
            st["after"] = after["size"]
            log.info("etcd upkeep: %s defragmented in %.1f s: database file %s -> %s", st["url"],
                     time.monotonic() - t0, _mb(st["size"]), _mb(after["size"]))
        return seen
