"""The shared metadata engine: etcd (v3, through its JSON gateway with the etcd3gw client), many mounts.

Keys live under ``dnfs/VOLUME/`` (its own prefix; the cluster manager may share the etcd):

    i INO                -> inode attributes (JSON)          d PARENT NAME -> {"ino", "seq"} (a dentry)
    s INO OFF            -> a slice (JSON)                   x INO NAME    -> an extended attribute
    c PID EXTENT         -> how many slices reference it     e PID EXTENT  -> the mount session that wrote it
    q PID EXTENT         -> deletion queue                   n             -> the inode / entry counter

(INO, OFF, EXTENT are 8-byte big-endian, PID 4 bytes, so keys sort numerically.)

Every change is one etcd transaction, optimistic: the keys it read are compared on their mod revision and
the whole change is retried when another mount got there first, so no update is lost.  Range reads (a
directory's entries, a file's slices) are guarded by the owning inode's key, which every change to them
also rewrites.  Blocking etcd3gw calls run in worker threads (one client per thread).

An extent is deleted on the datanodes only by the mount session that wrote it (another mount may still be
appending to it); extents of a session that is gone are released by ``dnfs fsck --repair``.  Inodes left
with no links by a crashed mount are not purged at mount time (another mount may have them open): fsck
reports them.  The server must allow big transactions (``--max-txn-ops``, say 10000): a commit or a remove
touches every affected slice at once.
"""
from __future__ import annotations

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

from client.fs.meta import ROOT, Attr, Meta, MetaError, Slice, check_name, overlay

log = logging.getLogger(__name__)

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

    def put(self, key: bytes, value: bytes) -> None:
        self.writes[key] = value

    def delete(self, key: bytes) -> None:
        self.writes[key] = None

    def commit(self) -> None:
        if not self.writes:
            return
        compare = [{"key": _b64(k), "result": "EQUAL", "target": "MOD", "mod_revision": rev}
                   for k, rev in self.reads.items()]
        success = [{"request_put": {"key": _b64(k), "value": _b64(v)}} if v is not None
                   else {"request_delete_range": {"key": _b64(k)}} for k, v in self.writes.items()]
        resp = self.c.transaction({"compare": compare, "success": success, "failure": []})
        if not resp.get("succeeded", False):
            raise Conflict()


class EtcdMeta(Meta):
    single_mount = False

    def __init__(self, url: str, volume: str = "default"):
        import etcd3gw
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
        self._etcd3gw = etcd3gw
        self._local = threading.local()
        self._limiter = trio.CapacityLimiter(8)
        c = self._client()
        try:
            c.status()
        except Exception as e:   # noqa: BLE001 - any failure to reach etcd is one clear message
            raise ValueError(f"etcd at {self.host}:{self.port} does not answer: {e}") from None

        def init(tx: Tx):
            if tx.get(self.k_ino(ROOT)) is None:
                now = time.time_ns()
                tx.put(self.k_ino(ROOT), self._enc(Attr(ROOT, stat.S_IFDIR | 0o755, 2, os.getuid(), os.getgid(),
                                                        0, 0, now, now, now)))
                tx.put(self.p + b"n", b"1")
        self._tx(init)

    def _client(self):
        c = getattr(self._local, "c", None)
        if c is None:
            c = self._local.c = self._etcd3gw.client(host=self.host, port=self.port, timeout=30)
        return c

    # -- keys
    def k_ino(self, ino: int) -> bytes:
        return self.p + b"i" + u64(ino)

    def k_dir(self, parent: int) -> bytes:
        return self.p + b"d" + u64(parent)

    def k_slices(self, ino: int) -> bytes:
        return self.p + b"s" + u64(ino)

    def k_ext(self, kind: bytes, pid: int, extent: int) -> bytes:
        return self.p + kind + struct.pack(">IQ", pid, extent)

    @staticmethod
    def _enc(a: Attr, target: bytes | None = None) -> bytes:
        d = {f: getattr(a, f) for f in FIELDS}
        if target:
            d["target"] = target.hex()
        return json.dumps(d).encode()

    @staticmethod
    def _slice_enc(s: Slice) -> bytes:
        return json.dumps([s.off, s.length, s.partition, s.extent, s.ext_off, s.wpos, s.wlen, s.crc]).encode()

    # -- plumbing
    async def _run(self, fn, *args):
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

    def _get(self, tx: Tx, ino: int) -> Attr:
        raw = tx.get(self.k_ino(ino))
        if raw is None:
            raise MetaError(errno.ENOENT, f"inode {ino}")
        d = json.loads(raw)
        return Attr(ino, *(d[f] for f in FIELDS))

    def _put(self, tx: Tx, a: Attr) -> None:
        raw = tx.get(self.k_ino(a.ino))
        target = bytes.fromhex(json.loads(raw).get("target", "")) if raw else b""
        tx.put(self.k_ino(a.ino), self._enc(a, target))

    def _dir(self, tx: Tx, ino: int) -> Attr:
        a = self._get(tx, ino)
        if not a.is_dir:
            raise MetaError(errno.ENOTDIR)
        return a

    def _child(self, tx: Tx, parent: int, name: bytes) -> int | None:
        raw = tx.get(self.k_dir(parent) + name)
        return json.loads(raw)["ino"] if raw else None

    def _next(self, tx: Tx) -> int:
        n = int(tx.get(self.p + b"n") or b"1") + 1
        tx.put(self.p + b"n", str(n).encode())
        return n

    def _touch(self, tx: Tx, ino: int, now: int, nlink: int = 0) -> None:
        a = self._get(tx, ino)
        a.mtime_ns = a.ctime_ns = now
        a.nlink += nlink
        self._put(tx, a)

    async def close(self) -> None:
        pass

    async def sync(self) -> None:
        pass        # an etcd commit is durable (raft log fsynced on a quorum) when it returns

    # -- tree
    async def lookup(self, parent, name):
        def go(tx):
            ino = self._child(tx, parent, name)
            if ino is None:
                self._dir(tx, parent)
                raise MetaError(errno.ENOENT)
            return self._get(tx, ino)
        return await self._run(go)

    async def getattr(self, ino):
        return await self._run(self._get, ino)

    async def setattr(self, ino, *, mode=None, uid=None, gid=None, atime_ns=None, mtime_ns=None, ctime_ns):
        def go(tx):
            a = self._get(tx, ino)
            if mode is not None:
                a.mode = (a.mode & ~0o7777) | (mode & 0o7777)
            for k, v in (("uid", uid), ("gid", gid), ("atime_ns", atime_ns), ("mtime_ns", mtime_ns)):
                if v is not None:
                    setattr(a, k, v)
            a.ctime_ns = ctime_ns
            self._put(tx, a)
            return a
        return await self._run(go)

    async def create(self, parent, name, mode, uid, gid, rdev=0, target=b""):
        check_name(name)

        def go(tx):
            self._dir(tx, parent)
            if self._child(tx, parent, name) is not None:
                raise MetaError(errno.EEXIST)
            now = time.time_ns()
            ino = self._next(tx)
            is_dir = stat.S_ISDIR(mode)
            a = Attr(ino, mode, 2 if is_dir else 1, uid, gid, rdev, len(target), now, now, now)
            tx.put(self.k_ino(ino), self._enc(a, target))
            tx.put(self.k_dir(parent) + name, json.dumps({"ino": ino, "seq": ino}).encode())
            self._touch(tx, parent, now, 1 if is_dir else 0)
            return a
        return await self._run(go)

    async def link(self, ino, parent, name):
        check_name(name)

        def go(tx):
            a = self._get(tx, ino)
            if a.is_dir:
                raise MetaError(errno.EPERM)
            self._dir(tx, parent)
            if self._child(tx, parent, name) is not None:
                raise MetaError(errno.EEXIST)
            now = time.time_ns()
            tx.put(self.k_dir(parent) + name, json.dumps({"ino": ino, "seq": self._next(tx)}).encode())
            a.nlink += 1
            a.ctime_ns = now
            self._put(tx, a)
            self._touch(tx, parent, now)
            return a
        return await self._run(go)

    def _drop_entry(self, tx: Tx, parent: int, name: bytes, ino: int, now: int) -> Attr:
        a = self._get(tx, ino)
        tx.delete(self.k_dir(parent) + name)
        if a.is_dir:
            a.nlink = 0
            self._touch(tx, parent, now, -1)
        else:
            a.nlink -= 1
            self._touch(tx, parent, now)
        a.ctime_ns = now
        self._put(tx, a)
        return a

    def _empty(self, tx: Tx, ino: int) -> bool:
        k = self.k_dir(ino)
        return not tx.range(k, prefix_end(k), limit=1)

    async def unlink(self, parent, name):
        def go(tx):
            ino = self._child(tx, parent, name)
            if ino is None:
                self._dir(tx, parent)
                raise MetaError(errno.ENOENT)
            if self._get(tx, ino).is_dir:
                raise MetaError(errno.EISDIR)
            return self._drop_entry(tx, parent, name, ino, time.time_ns())
        return await self._run(go)

    async def rmdir(self, parent, name):
        def go(tx):
            ino = self._child(tx, parent, name)
            if ino is None:
                self._dir(tx, parent)
                raise MetaError(errno.ENOENT)
            self._dir(tx, ino)
            if not self._empty(tx, ino):
                raise MetaError(errno.ENOTEMPTY)
            self._drop_entry(tx, parent, name, ino, time.time_ns())
            self._remove(tx, ino)
        await self._run(go)

    async def rename(self, p1, n1, p2, n2, *, noreplace=False, exchange=False):
        check_name(n2)

        def go(tx):
            src = self._child(tx, p1, n1)
            if src is None:
                self._dir(tx, p1)
                raise MetaError(errno.ENOENT)
            self._dir(tx, p2)
            dst = self._child(tx, p2, n2)
            if src == dst:
                return None
            now = time.time_ns()
            sa = self._get(tx, src)
            k1, k2 = self.k_dir(p1) + n1, self.k_dir(p2) + n2
            if exchange:
                if dst is None:
                    raise MetaError(errno.ENOENT)
                da = self._get(tx, dst)
                e1, e2 = json.loads(tx.get(k1)), json.loads(tx.get(k2))
                tx.put(k1, json.dumps({"ino": dst, "seq": e1["seq"]}).encode())
                tx.put(k2, json.dumps({"ino": src, "seq": e2["seq"]}).encode())
                if p1 != p2 and sa.is_dir != da.is_dir:
                    moved = 1 if sa.is_dir else -1
                    self._touch(tx, p1, now, -moved)
                    self._touch(tx, p2, now, moved)
                else:
                    self._touch(tx, p1, now)
                    self._touch(tx, p2, now)
                return None
            replaced = None
            if dst is not None:
                if noreplace:
                    raise MetaError(errno.EEXIST)
                da = self._get(tx, dst)
                if sa.is_dir and not da.is_dir:
                    raise MetaError(errno.ENOTDIR)
                if da.is_dir and not sa.is_dir:
                    raise MetaError(errno.EISDIR)
                if da.is_dir and not self._empty(tx, dst):
                    raise MetaError(errno.ENOTEMPTY)
                replaced = self._drop_entry(tx, p2, n2, dst, now)
                if da.is_dir:
                    self._remove(tx, dst)
                    replaced = None
            tx.delete(k1)
            tx.put(k2, json.dumps({"ino": src, "seq": self._next(tx)}).encode())
            sa = self._get(tx, src)
            sa.ctime_ns = now
            self._put(tx, sa)
            moved = 1 if sa.is_dir and p1 != p2 else 0
            self._touch(tx, p1, now, -moved)
            self._touch(tx, p2, now, moved)
            return replaced
        return await self._run(go)

    async def readdir(self, ino, after, limit):
        def go(tx):
            self._dir(tx, ino)
            k = self.k_dir(ino)
            ents = [(json.loads(v), key[len(k):]) for key, v in tx.range(k, prefix_end(k))]
            ents = sorted((e["seq"], name, e["ino"]) for e, name in ents if e["seq"] > after)[:limit]
            out = []
            for seq, name, child in ents:
                try:
                    out.append((name, self._get(tx, child), seq))
                except MetaError:
                    continue
            return out
        return await self._run(go)

    async def readlink(self, ino):
        def go(tx):
            a = self._get(tx, ino)
            if not stat.S_ISLNK(a.mode):
                raise MetaError(errno.EINVAL)
            return bytes.fromhex(json.loads(tx.get(self.k_ino(ino))).get("target", ""))
        return await self._run(go)

    # -- slices and extents
    def _slices(self, tx: Tx, ino: int) -> list[Slice]:
        k = self.k_slices(ino)
        return [Slice(*json.loads(v)) for _, v in tx.range(k, prefix_end(k))]

    def _ref(self, tx: Tx, s: Slice, delta: int) -> None:
        k = self.k_ext(b"c", s.partition, s.extent)
        n = int(tx.get(k) or b"0") + delta
        if n > 0:
            tx.put(k, str(n).encode())
        else:
            tx.delete(k)
            tx.put(self.k_ext(b"q", s.partition, s.extent), b"")

    def _add(self, tx: Tx, ino: int, s: Slice) -> None:
        tx.put(self.k_slices(ino) + u64(s.off), self._slice_enc(s))
        self._ref(tx, s, +1)

    def _drop(self, tx: Tx, ino: int, s: Slice) -> None:
        tx.delete(self.k_slices(ino) + u64(s.off))
        self._ref(tx, s, -1)

    def _remove(self, tx: Tx, ino: int) -> None:
        for s in self._slices(tx, ino):
            self._drop(tx, ino, s)
        k = self.p + b"x" + u64(ino)
        for key, _ in tx.range(k, prefix_end(k)):
            tx.delete(key)
        tx.delete(self.k_ino(ino))

    async def remove(self, ino):
        def go(tx):
            raw = tx.get(self.k_ino(ino))
            if raw is not None and json.loads(raw)["nlink"] <= 0:
                self._remove(tx, ino)
        await self._run(go)

    async def orphans(self):
        return []          # another mount may still have them open: fsck reports them

    async def slices(self, ino):
        def go(tx):
            self._get(tx, ino)
            return self._slices(tx, ino)
        return await self._run(go)

    def _lay(self, tx: Tx, ino: int, current: list[Slice], new: Slice) -> list[Slice]:
        kept, touched = overlay(current, new)
        for s in touched:
            self._drop(tx, ino, s)
        for s in kept:
            self._add(tx, ino, s)
        gone = {s.off for s in touched}
        return sorted([s for s in current if s.off not in gone] + kept, key=lambda s: s.off)

    async def commit(self, ino, new, size, mtime_ns):
        def go(tx):
            a = self._get(tx, ino)
            current = self._slices(tx, ino)
            for s in new:
                current = self._lay(tx, ino, current, s)
                self._add(tx, ino, s)
                current = sorted(current + [s], key=lambda x: x.off)
                ek = self.k_ext(b"e", s.partition, s.extent)
                if tx.get(ek) is None:
                    tx.put(ek, self.session.encode())
            a.size = max(a.size, size)
            a.mtime_ns = a.ctime_ns = mtime_ns
            self._put(tx, a)
            return a
        return await self._run(go)

    async def truncate(self, ino, size, mtime_ns):
        def go(tx):
            a = self._get(tx, ino)
            if a.is_dir:
                raise MetaError(errno.EISDIR)
            if size < a.size:
                self._lay(tx, ino, self._slices(tx, ino), Slice(size, (1 << 62) - size, 0, 0, 0, 0, 0, 0))
            a.size, a.mtime_ns, a.ctime_ns = size, mtime_ns, mtime_ns
            self._put(tx, a)
            return a
        return await self._run(go)

    # -- deletion queue: this session's extents only (another mount may be appending to its own)
    async def queued(self, limit, *, any_session: bool = False):
        def go(tx):
            k = self.p + b"q"
            out = []
            for key, _ in tx.range(k, prefix_end(k)):
                pid, extent = struct.unpack(">IQ", key[len(k):])
                owner = tx.get(self.k_ext(b"e", pid, extent))
                if any_session or self.reclaim_all or owner is None or owner.decode() == self.session:
                    out.append((pid, extent))
                if len(out) >= limit:
                    break
            return out
        return await self._run(go)

    async def referenced(self, partition, extent):
        return await self._run(lambda tx: tx.get(self.k_ext(b"c", partition, extent)) is not None)

    async def dequeue(self, partition, extent):
        def go(tx):
            tx.delete(self.k_ext(b"q", partition, extent))
            if tx.get(self.k_ext(b"c", partition, extent)) is None:
                tx.delete(self.k_ext(b"e", partition, extent))
        await self._run(go)

    async def usage(self):
        def go(tx):
            k = self.p + b"i"
            files = size = 0
            for _, v in tx.range(k, prefix_end(k)):
                d = json.loads(v)
                if stat.S_ISREG(d["mode"]):
                    files += 1
                    size += d["size"]
            return files, size
        return await self._run(go)

    # -- xattrs
    async def getxattr(self, ino, name):
        def go(tx):
            self._get(tx, ino)
            v = tx.get(self.p + b"x" + u64(ino) + name)
            if v is None:
                raise MetaError(errno.ENODATA)
            return v
        return await self._run(go)

    async def setxattr(self, ino, name, value):
        def go(tx):
            a = self._get(tx, ino)
            tx.put(self.p + b"x" + u64(ino) + name, bytes(value))
            a.ctime_ns = time.time_ns()
            self._put(tx, a)
        await self._run(go)

    async def listxattr(self, ino):
        def go(tx):
            k = self.p + b"x" + u64(ino)
            return [key[len(k):] for key, _ in tx.range(k, prefix_end(k))]
        return await self._run(go)

    async def removexattr(self, ino, name):
        def go(tx):
            if tx.get(self.p + b"x" + u64(ino) + name) is None:
                raise MetaError(errno.ENODATA)
            tx.delete(self.p + b"x" + u64(ino) + name)
        await self._run(go)

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
        return await self._run(go)

    async def all_slices(self):
        def go(tx):
            k = self.p + b"s"
            return [(struct.unpack(">Q", key[len(k):len(k) + 8])[0], Slice(*json.loads(v)))
                    for key, v in tx.range(k, prefix_end(k))]
        return await self._run(go)

    async def known_extents(self):
        def go(tx):
            k = self.p + b"e"
            return {struct.unpack(">IQ", key[len(k):]) for key, _ in tx.range(k, prefix_end(k))}
        return await self._run(go)

    async def repair(self, problems):
        done = []
        for p in problems:
            def go(tx, p=p):
                if p["kind"] == "dangling_entry":
                    tx.delete(self.k_dir(p["parent"]) + p["name"].encode(errors="surrogateescape"))
                    return "entry removed"
                if p["kind"] == "orphan_inode":
                    self._remove(tx, p["ino"])
                    return "inode removed, its extents queued for deletion"
                if p["kind"] == "wrong_nlink":
                    a = self._get(tx, p["ino"])
                    a.nlink = p["entries"]
                    self._put(tx, a)
                    return f"nlink set to {p['entries']}"
                if p["kind"] == "unreferenced_extent":
                    tx.put(self.k_ext(b"q", p["partition"], p["extent"]), b"")
                    tx.put(self.k_ext(b"e", p["partition"], p["extent"]), self.session.encode())
                    return "queued for deletion"
                return None
            action = await self._run(go)
            if action:
                done.append({**p, "action": action})
        return done
