"""The shared metadata engine: etcd (v3, through its JSON gateway with the etcd3gw client), many mounts.

Keys live under ``dnfs/VOLUME/`` (its own prefix; the cluster manager may share the etcd):

    i INO                -> inode attributes (JSON)          d PARENT NAME -> {"ino", "seq"} (a dentry)
    s INO OFF            -> a slice (JSON)                   x INO NAME    -> an extended attribute
    c PID EXTENT         -> how many slices reference it     e PID EXTENT  -> the mount session that wrote it
    q PID EXTENT         -> deletion queue                   n             -> the inode / entry counter
    o INO SESSION        -> a mount has the inode open       z INO         -> the inode has no links left
    m SESSION            -> a live mount                     (o and m under the mount's lease)

(INO, OFF, EXTENT are 8-byte big-endian, PID 4 bytes, so keys sort numerically.)

Every change is one etcd transaction, optimistic: the keys it read are compared on their mod revision and
the whole change is retried when another mount got there first, so no update is lost.  Range reads (a
directory's entries, a file's slices) are guarded by the owning inode's key, which every change to them
also rewrites.  Blocking etcd3gw calls run in worker threads (one client per thread).

An extent is deleted on the datanodes only by the mount session that wrote it (another mount may still be
appending to it) -- or, once that session is gone (its ``m`` key expired with its lease), by any mount.

Open-file sessions: a mount holds an etcd lease (``SESSION_TTL`` seconds, kept alive by
:meth:`EtcdMeta.keep_session`) and puts an ``o`` key under it for every inode it has open.  An inode whose
last link is gone (``z``) is removed only when no ``o`` key of it is left: by the last mount to close it,
or -- when that mount died and its lease expired, taking its ``o`` keys along -- by any mount's periodic
:meth:`orphans` sweep.  The server must allow big transactions (``--max-txn-ops``, say 10000): a commit or a remove
touches every affected slice at once.
"""
from __future__ import annotations

import bisect
import dataclasses
import errno
import functools
import json
import logging
import os
import stat
import struct
import threading
import time
import uuid

import trio

from client.fs.meta import DIRENT, ROOT, Attr, Meta, MetaError, MetaTx, Slice
from wire.etcdmap import EtcdAccess, client as etcd_client

log = logging.getLogger(__name__)

SESSION_TTL = 10       # seconds a dead mount's open files stay protected
FIELDS = ("mode", "nlink", "uid", "gid", "rdev", "size", "atime_ns", "mtime_ns", "ctime_ns")


def u64(n: int) -> bytes:
    return struct.pack(">Q", n)


def _b64(b: bytes) -> str:
    import base64
    return base64.b64encode(b).decode()


def prefix_end(p: bytes) -> bytes:
    b = bytearray(p)
    while b and b[-1] == 0xFF:
        b.pop()
    b[-1] += 1
    return bytes(b)


class Conflict(Exception):
    pass


class Tx:
    """Reads remember their key's mod revision; commit writes everything if none of them changed."""

    def __init__(self, c):
        self.c = c
        self.reads: dict[bytes, int] = {}
        self.cache: dict[bytes, bytes | None] = {}
        self.writes: dict[bytes, bytes | None] = {}
        self.leases: dict[bytes, int] = {}

    def get(self, key: bytes) -> bytes | None:
        if key in self.writes:
            return self.writes[key]
        if key not in self.cache:
            res = self.c.get(key, metadata=True)
            if res:
                v, m = res[0]
                self.reads[key] = int(m.get("mod_revision", 0))
                self.cache[key] = bytes(v)
            else:
                self.reads[key] = 0
                self.cache[key] = None
        return self.cache[key]

    def range(self, start: bytes, end: bytes, limit: int | None = None) -> list[tuple[bytes, bytes]]:
        res = self.c.get(start, metadata=True, range_end=end, sort_order="ascend", sort_target="key",
                         limit=limit)
        out = {bytes(m["key"]): bytes(v) for v, m in res}
        for k, v in self.writes.items():
            if start <= k < end:
                if v is None:
                    out.pop(k, None)
                else:
                    out[k] = v
        return sorted(out.items())

    def put(self, key: bytes, value: bytes, lease: int | None = None) -> None:
        self.writes[key] = value
        if lease:
            self.leases[key] = lease

    def delete(self, key: bytes) -> None:
        self.writes[key] = None

    def commit(self) -> None:
        if not self.writes:
            return
        compare = [{"key": _b64(k), "result": "EQUAL", "target": "MOD", "mod_revision": rev}
                   for k, rev in self.reads.items()]
        success = [{"request_put": {"key": _b64(k), "value": _b64(v),
                                    **({"lease": self.leases[k]} if k in self.leases else {})}} if v is not None
                   else {"request_delete_range": {"key": _b64(k)}} for k, v in self.writes.items()]
        resp = self.c.transaction({"compare": compare, "success": success, "failure": []})
        if not resp.get("succeeded", False):
            raise Conflict()


def enc_attr(a: Attr, target: bytes | None = None) -> bytes:
    d = {f: getattr(a, f) for f in FIELDS}
    if target:
        d["target"] = target.hex()
    return json.dumps(d).encode()


def enc_slice(s: Slice) -> bytes:
    if s.inline:         # this engine keeps no bytes (its inline_max is 0)
        raise ValueError("an inline slice cannot be stored in etcd")
    return json.dumps([s.off, s.length, s.partition, s.extent, s.ext_off, s.wpos, s.wlen, s.crc]).encode()


class EtcdTx(MetaTx):
    """The storage primitives on one optimistic etcd transaction (:class:`Tx`).  A file's slice list is read
    once per transaction and kept current here as slices come and go."""

    def __init__(self, m: "EtcdMeta", tx: Tx):
        self.m, self.tx = m, tx
        self._slices: dict[int, list[Slice]] = {}

    def attr(self, ino):
        raw = self.tx.get(self.m.k_ino(ino))
        if raw is None:
            return None
        d = json.loads(raw)
        return Attr(ino, *(d[f] for f in FIELDS))

    def put_attr(self, a):
        raw = self.tx.get(self.m.k_ino(a.ino))
        target = bytes.fromhex(json.loads(raw).get("target", "")) if raw else b""
        self.tx.put(self.m.k_ino(a.ino), enc_attr(a, target))

    def _next(self) -> int:
        k = self.m.p + b"n"
        n = int(self.tx.get(k) or b"1") + 1
        self.tx.put(k, str(n).encode())
        return n

    def new_inode(self, a, target):
        a = dataclasses.replace(a, ino=self._next())
        self.tx.put(self.m.k_ino(a.ino), enc_attr(a, target))
        return a

    def target(self, ino):
        return bytes.fromhex(json.loads(self.tx.get(self.m.k_ino(ino))).get("target", ""))

    def child(self, parent, name):
        raw = self.tx.get(self.m.k_dir(parent) + name)
        return json.loads(raw)["ino"] if raw else None

    def has_children(self, ino):
        k = self.m.k_dir(ino)
        return bool(self.tx.range(k, prefix_end(k), limit=1))

    def add_entry(self, parent, name, ino):
        self.tx.put(self.m.k_dir(parent) + name, json.dumps({"ino": ino, "seq": self._next()}).encode())

    def set_entry(self, parent, name, ino):
        k = self.m.k_dir(parent) + name
        self.tx.put(k, json.dumps({"ino": ino, "seq": json.loads(self.tx.get(k))["seq"]}).encode())

    def move_entry(self, p1, n1, p2, n2, ino):
        self.tx.delete(self.m.k_dir(p1) + n1)
        self.add_entry(p2, n2, ino)

    def del_entry(self, parent, name):
        self.tx.delete(self.m.k_dir(parent) + name)

    def drop_inode(self, ino):
        for s in list(self.slices(ino)):
            self.drop_slice(ino, s)
        k = self.m.p + b"x" + u64(ino)
        for key, _ in self.tx.range(k, prefix_end(k)):
            self.tx.delete(key)
        self.tx.delete(self.m.k_ino(ino))
        self.tx.delete(self.m.p + b"z" + u64(ino))

    def unlinked(self, ino):
        self.tx.put(self.m.p + b"z" + u64(ino), b"")

    def is_open(self, ino):
        k = self.m.k_open(ino)
        return bool(self.tx.range(k, prefix_end(k), limit=1))

    def slices(self, ino, start=0, end=None):
        if ino not in self._slices:
            k = self.m.k_slices(ino)
            self._slices[ino] = [Slice(*json.loads(v)) for _, v in self.tx.range(k, prefix_end(k))]
        return self._slices[ino]

    def _ref(self, s: Slice, delta: int) -> None:
        k = self.m.k_ext(b"c", s.partition, s.extent)
        n = int(self.tx.get(k) or b"0") + delta
        if n > 0:
            self.tx.put(k, str(n).encode())
        else:
            self.tx.delete(k)
            self.tx.put(self.m.k_ext(b"q", s.partition, s.extent), b"")

    def add_slice(self, ino, s):
        self.tx.put(self.m.k_slices(ino) + u64(s.off), enc_slice(s))
        self._ref(s, +1)
        cur = self.slices(ino)
        cur.insert(bisect.bisect_left([x.off for x in cur], s.off), s)

    def drop_slice(self, ino, s):
        self.tx.delete(self.m.k_slices(ino) + u64(s.off))
        self._ref(s, -1)
        cur = self.slices(ino)
        self._slices[ino] = [x for x in cur if x.off != s.off]

    def wrote_extent(self, partition, extent):
        ek = self.m.k_ext(b"e", partition, extent)
        if self.tx.get(ek) is None:
            self.tx.put(ek, self.m.session.encode())

    def xattr(self, ino, name):
        return self.tx.get(self.m.p + b"x" + u64(ino) + name)

    def put_xattr(self, ino, name, value):
        k = self.m.p + b"x" + u64(ino) + name
        if value is None:
            self.tx.delete(k)
        else:
            self.tx.put(k, bytes(value))


class EtcdMeta(Meta):
    single_mount = False

    def __init__(self, url: str, volume: str = "default", access=None):
        """``access``: etcd's user and client TLS (wire.etcdmap.EtcdAccess; with a CA: https)."""
        from urllib.parse import urlparse
        u = urlparse(url if "://" in url else "http://" + url)
        if not u.hostname:
            raise ValueError(f"bad etcd URL {url!r}: use etcd://HOST:PORT[/VOLUME]")
        self.host, self.port = u.hostname, u.port or 2379
        vol = u.path.strip("/") or volume
        if "/" in vol:
            raise ValueError(f"bad volume name {vol!r} in {url!r}")
        self.p = f"dnfs/{vol}/".encode()
        self.session = uuid.uuid4().hex
        self._opens: dict[int, int] = {}       # inode -> how many opens here (its ``o`` key is in etcd)
        self._access = access or EtcdAccess()
        self._url = f"{'https' if self._access.ca else 'http'}://{self.host}:{self.port}"
        self._local = threading.local()
        self._limiter = trio.CapacityLimiter(8)
        c = self._client()
        try:
            c.status()
        except Exception as e:   # noqa: BLE001 - any failure to reach etcd is one clear message
            raise ValueError(f"etcd at {self.host}:{self.port} does not answer: {e}") from None

        self.lease = c.lease(SESSION_TTL)
        self._mark_live()

        def init(tx: Tx):
            if tx.get(self.k_ino(ROOT)) is None:
                now = time.time_ns()
                tx.put(self.k_ino(ROOT), enc_attr(Attr(ROOT, stat.S_IFDIR | 0o755, 2, os.getuid(), os.getgid(),
                                                        0, 2 * DIRENT, now, now, now)))
                tx.put(self.p + b"n", b"1")
        self._tx(init)

    def _client(self):
        c = getattr(self._local, "c", None)
        if c is None:
            c = self._local.c = etcd_client(self._url, self._access, timeout=30)    # authenticates, TLS
        return c

    # -- keys
    def k_ino(self, ino: int) -> bytes:
        return self.p + b"i" + u64(ino)

    def k_dir(self, parent: int) -> bytes:
        return self.p + b"d" + u64(parent)

    def k_slices(self, ino: int) -> bytes:
        return self.p + b"s" + u64(ino)

    def k_open(self, ino: int) -> bytes:
        return self.p + b"o" + u64(ino)

    def k_ext(self, kind: bytes, pid: int, extent: int) -> bytes:
        return self.p + kind + struct.pack(">IQ", pid, extent)

    # -- plumbing
    async def _run(self, fn, *args):
        """``fn(EtcdTx, *args)`` as one transaction (run again whole on a conflict)."""
        return await self._raw(lambda tx: fn(EtcdTx(self, tx), *args))

    async def _raw(self, fn, *args):
        """``fn(Tx, *args)`` on the raw key-value transaction (the engine's own queries)."""
        return await trio.to_thread.run_sync(functools.partial(self._tx, fn, *args), limiter=self._limiter)

    def _tx(self, fn, *args):
        for attempt in range(200):
            tx = Tx(self._client())
            out = fn(tx, *args)
            try:
                tx.commit()
                return out
            except Conflict:
                time.sleep(min(0.001 * (attempt + 1), 0.05))
        raise MetaError(errno.EAGAIN, "etcd: too many conflicting transactions")

    async def close(self) -> None:
        try:
            await trio.to_thread.run_sync(self.lease.revoke)      # our open-file keys go with it
        except Exception as e:     # noqa: BLE001 - it expires by itself
            log.warning("etcd: revoking the session lease: %s", e)

    async def sync(self) -> None:
        pass        # an etcd commit is durable (raft log fsynced on a quorum) when it returns

    # -- open-file sessions
    def _mark_live(self) -> None:
        self._client().put(self.p + b"m" + self.session.encode(), b"", lease=self.lease)

    def _mark_open(self, ino: int) -> None:
        self._client().put(self.k_open(ino) + self.session.encode(), b"", lease=self.lease)

    async def opened(self, ino):
        self._opens[ino] = self._opens.get(ino, 0) + 1
        if self._opens[ino] == 1:
            await trio.to_thread.run_sync(self._mark_open, ino, limiter=self._limiter)

    async def closed(self, ino):
        n = self._opens.pop(ino, 0) - 1
        if n > 0:
            self._opens[ino] = n
            return False

        def go(tx):
            tx.tx.delete(self.k_open(ino) + self.session.encode())
            return self._remove(tx, ino)
        return await self._run(go)

    async def keep_session(self) -> None:
        """Refresh the lease every third of its TTL; if it expired anyway (etcd unreachable for that long), take
        a new one and mark the open inodes again."""
        while True:
            await trio.sleep(SESSION_TTL / 3)
            try:
                ttl = await trio.to_thread.run_sync(self.lease.refresh, limiter=self._limiter)
                if ttl <= 0:
                    log.warning("etcd: the session lease expired; taking a new one")
                    self.lease = await trio.to_thread.run_sync(self._client().lease, SESSION_TTL,
                                                               limiter=self._limiter)
                    await trio.to_thread.run_sync(self._mark_live, limiter=self._limiter)
                    for ino in list(self._opens):
                        await trio.to_thread.run_sync(self._mark_open, ino, limiter=self._limiter)
            except Exception as e:     # noqa: BLE001 - etcd away for a moment: try again next round
                log.warning("etcd: keeping the session alive: %s", e)

    async def orphans(self):
        def go(tx):
            k = self.p + b"z"
            out = []
            for key, _ in tx.range(k, prefix_end(k)):
                ino = struct.unpack(">Q", key[len(k):])[0]
                ko = self.k_open(ino)
                if not tx.range(ko, prefix_end(ko), limit=1):
                    out.append(ino)
            return out
        return await self._raw(go)

    async def readdir(self, ino, after, limit):
        def go(tx):
            self._dir(EtcdTx(self, tx), ino)
            k = self.k_dir(ino)
            ents = [(json.loads(v), key[len(k):]) for key, v in tx.range(k, prefix_end(k))]
            ents = sorted((e["seq"], name, e["ino"]) for e, name in ents if e["seq"] > after)[:limit]
            out = []
            for seq, name, child in ents:
                try:
                    out.append((name, self._get(EtcdTx(self, tx), child), seq))
                except MetaError:
                    continue
            return out
        return await self._raw(go)

    # -- deletion queue: this session's extents only (another mount may be appending to its own)
    async def queued(self, limit, *, any_session: bool = False):
        def go(tx):
            k = self.p + b"q"
            out = []
            for key, _ in tx.range(k, prefix_end(k)):
                pid, extent = struct.unpack(">IQ", key[len(k):])
                owner = tx.get(self.k_ext(b"e", pid, extent))
                if any_session or self.reclaim_all or owner is None or owner.decode() == self.session \
                        or tx.get(self.p + b"m" + owner) is None:
                    out.append((pid, extent))
                if len(out) >= limit:
                    break
            return out
        return await self._raw(go)

    async def referenced(self, partition, extent):
        return await self._raw(lambda tx: tx.get(self.k_ext(b"c", partition, extent)) is not None)

    async def dequeue(self, partition, extent):
        def go(tx):
            tx.delete(self.k_ext(b"q", partition, extent))
            if tx.get(self.k_ext(b"c", partition, extent)) is None:
                tx.delete(self.k_ext(b"e", partition, extent))
        await self._raw(go)

    async def usage(self):
        def go(tx):
            k = self.p + b"i"
            files = size = 0
            for _, v in tx.range(k, prefix_end(k)):
                d = json.loads(v)
                files += 1
                if stat.S_ISREG(d["mode"]):
                    size += d["size"]
            return files, size
        return await self._raw(go)

    # -- xattrs
    async def getxattr(self, ino, name):
        def go(tx):
            self._get(EtcdTx(self, tx), ino)
            v = tx.get(self.p + b"x" + u64(ino) + name)
            if v is None:
                raise MetaError(errno.ENODATA)
            return v
        return await self._raw(go)

    async def setxattr(self, ino, name, value):
        def go(tx):
            a = self._get(EtcdTx(self, tx), ino)
            tx.put(self.p + b"x" + u64(ino) + name, bytes(value))
            a.ctime_ns = time.time_ns()
            EtcdTx(self, tx).put_attr(a)
        await self._raw(go)

    async def listxattr(self, ino):
        def go(tx):
            k = self.p + b"x" + u64(ino)
            return [key[len(k):] for key, _ in tx.range(k, prefix_end(k))]
        return await self._raw(go)

    async def removexattr(self, ino, name):
        def go(tx):
            if tx.get(self.p + b"x" + u64(ino) + name) is None:
                raise MetaError(errno.ENODATA)
            tx.delete(self.p + b"x" + u64(ino) + name)
        await self._raw(go)

    # -- fsck
    async def check(self):
        def go(tx):
            out = []
            ki, kd = self.p + b"i", self.p + b"d"
            inodes = {struct.unpack(">Q", k[len(ki):])[0]: json.loads(v) for k, v in tx.range(ki, prefix_end(ki))}
            links: dict[int, int] = {}
            for k, v in tx.range(kd, prefix_end(kd)):
                parent = struct.unpack(">Q", k[len(kd):len(kd) + 8])[0]
                ino = json.loads(v)["ino"]
                if ino not in inodes:
                    out.append({"kind": "dangling_entry", "parent": parent,
                                "name": k[len(kd) + 8:].decode(errors="replace"), "ino": ino})
                links[ino] = links.get(ino, 0) + 1
            for ino, d in inodes.items():
                if ino == ROOT or stat.S_ISDIR(d["mode"]):
                    continue
                n = links.get(ino, 0)
                if d["nlink"] != n or n == 0:
                    out.append({"kind": "orphan_inode" if n == 0 else "wrong_nlink", "ino": ino,
                                "nlink": d["nlink"], "entries": n})
            return out
        return await self._raw(go)

    async def all_slices(self):
        def go(tx):
            k = self.p + b"s"
            return [(struct.unpack(">Q", key[len(k):len(k) + 8])[0], Slice(*json.loads(v)))
                    for key, v in tx.range(k, prefix_end(k))]
        return await self._raw(go)

    async def known_extents(self):
        def go(tx):
            k = self.p + b"e"
            return {struct.unpack(">IQ", key[len(k):]) for key, _ in tx.range(k, prefix_end(k))}
        return await self._raw(go)

    async def repair(self, problems):
        done = []
        for p in problems:
            def go(tx, p=p):
                if p["kind"] == "dangling_entry":
                    tx.delete(self.k_dir(p["parent"]) + p["name"].encode(errors="surrogateescape"))
                    return "entry removed"
                if p["kind"] == "orphan_inode":
                    EtcdTx(self, tx).drop_inode(p["ino"])
                    return "inode removed, its extents queued for deletion"
                if p["kind"] == "wrong_nlink":
                    a = self._get(EtcdTx(self, tx), p["ino"])
                    a.nlink = p["entries"]
                    EtcdTx(self, tx).put_attr(a)
                    return f"nlink set to {p['entries']}"
                if p["kind"] == "unreferenced_extent":
                    tx.put(self.k_ext(b"q", p["partition"], p["extent"]), b"")
                    tx.put(self.k_ext(b"e", p["partition"], p["extent"]), self.session.encode())
                    return "queued for deletion"
                return None
            action = await self._raw(go)
            if action:
                done.append({**p, "action": action})
        return done
