"""The client SDK: what a mounted filesystem client calls for its write and read path.

``DataClient`` (trio) knows the partition map, creates extents, writes data of any size as a pipeline of
block-sized appends, reads ranges with CRC checks (failing over to another replica), and moves to a new
extent after a replication failure.  ``BlockingDataClient`` wraps it for callers that are not async.

With ``etcd=URL`` the partition map is etcd's (wire/etcdmap.py): read once, then kept current -- through the
datanodes given to ``open`` when the client holds the key that checks the map's MACs (``map_via="auto"``:
each node serves its watched copy of etcd's entries, so etcd's load does not grow with clients), else by a
watch of etcd -- so a new leader or replica set is known within one round-trip; a write that fails because a
replica died waits (within ``timeout``) for the manager's new view and goes on with it on a new extent.
``put(data)`` needs no partition: it picks a writable one from etcd's map for each new extent (spreading
over partitions and leaders) and, when a replica dies mid-write, writes the unacknowledged rest to another
partition within ``timeout``.

``DataClient`` is the face of four parts, each of one concern: ``channel.Channel`` sends one request over
the client's registered memory, ``routing.PartitionMap`` knows where each partition is, ``appends.Appender``
writes (extents, the append pipeline, failover), ``reads.Reader`` reads.

Credentials: ``secret=`` a cluster secret, role key file or volume key file, or the ``Credentials`` loaded
from one; ``role=`` the role to claim (default: admin when the file allows it, else client).  A volume key
reaches only its volume's partitions: ``put`` picks among those (``learn_volume``).  See wire/auth.py.  The etcd map:
``etcd_access=`` its user and client TLS (``wire.etcdmap.EtcdAccess``); with the secret or an admin key the
client also checks the MAC of every view it reads (wire/mapcheck.py).  TLS: ``tls_ca=``
a CA bundle or an ``ssl.SSLContext``: every connection then speaks TLS and checks the node's certificate
(wire/transport/tls.py).  Connections: ``options=`` a TransportOptions (congestion control, RDMA device and
tuning); ``source_address=`` the local IP address every connection is made from (a host with several
addresses; the datanodes' per-address limits count by it).  The client is configured by these arguments
only; a program configured by its environment opens it with ``DataClient.from_env`` instead, which fills
in what is not given from $DATANODE_SECRET_FILE, $DATANODE_TLS_CA, $DATANODE_ETCD_CREDENTIALS/_CA/_CERT/_KEY
and $DATANODE_<FIELD> for each option (``TransportOptions.from_env``), and starts tracing where
$DATANODE_TRACE asks.
"""
from __future__ import annotations

import logging
import os
import ssl
import threading
from contextlib import asynccontextmanager
from typing import AsyncIterator, Awaitable, Iterable, Mapping

import trio

from client.appends import Appender
from client.channel import ADMIN_ANSWER, Channel, ClientError, Location, PartitionInfo, ReplicationError, check
from client.reads import Reader
from client.routing import PartitionMap
from wire import aio, trace
from wire.auth import AuthConfigError, Credentials, DialAuth, ROLE_NAMES
from wire.transport.tls import TlsConfigError, client_context
from wire.etcdmap import ACCESS_OPTIONS, DEFAULT_PREFIX, Etcd, EtcdAccess, EtcdError
from wire.protocol import INLINE_MAX, Header, Op, Role
from wire.transport.base import Domain, TransportOptions
from wire.transport.connect import make_domain

__all__ = ["BlockingDataClient", "ClientError", "DataClient", "Location", "PartitionInfo", "ReplicationError",
           "check"]

log = logging.getLogger(__name__)
# where a client with etcd= follows the map: "auto" -- through the datanodes given to open() when it can check
# the views' MACs (it holds the secret or an admin key), else etcd; "nodes" -- only there; "etcd" -- its watch
MAP_VIA = ("auto", "nodes", "etcd")


class DataClient:
    def __init__(self, nursery: trio.Nursery, *, transport: str = "auto", timeout: float = 15.0,
                 block_size: int = 1 << 20, depth: int = 8, pool_mib: int = 64, domain: Domain | None = None,
                 etcd: str | None = None, etcd_prefix: str = DEFAULT_PREFIX, etcd_access: EtcdAccess | None = None,
                 secret: "str | Credentials | None" = None, role: str | None = None,
                 tls_ca: "str | ssl.SSLContext | None" = None, options: TransportOptions | None = None,
                 inline_max: int = INLINE_MAX, read_from: str = "leader", map_via: str = "auto",
                 source_address: str = ""):
        if block_size & (block_size - 1) or not (4096 <= block_size <= 4 << 20):
            raise ValueError("block_size must be a power of two between 4 KiB and 4 MiB")
        if role is not None and role not in ROLE_NAMES:
            raise ValueError(f"role must be one of {', '.join(ROLE_NAMES)}, not {role!r}")
        try:
            creds = Credentials.load(secret) if isinstance(secret, (str, os.PathLike)) else secret
            tls = client_context(tls_ca) if isinstance(tls_ca, (str, os.PathLike)) else tls_ca
            self.auth = DialAuth(creds, ROLE_NAMES[role] if role else None, tls=tls)
        except (AuthConfigError, TlsConfigError, ValueError) as e:
            raise ClientError(str(e)) from None
        options = options or TransportOptions()
        self.timeout = timeout
        # appends of at most this many bytes travel inline with their header where the connection allows it
        # (TCP: no READ round trip); 0 turns that off
        self.inline_max = max(0, min(inline_max, INLINE_MAX))
        if read_from not in ("leader", "spread"):
            raise ValueError(f"read_from must be 'leader' or 'spread', not {read_from!r}")
        self.read_from = read_from       # "leader" or "spread" (reads.Reader)
        if map_via not in MAP_VIA:
            raise ValueError(f"map_via must be one of {', '.join(MAP_VIA)}, not {map_via!r}")
        self.map_via = map_via
        self.block_size = block_size
        self.depth = depth
        self.domain = domain or make_domain(transport, options)
        channel = self._channel = Channel(nursery, self.domain, self.auth, transport=transport, timeout=timeout,
                                          max_block=max(block_size, 1 << 20), pool_mib=pool_mib,
                                          inline_max=self.inline_max, source=source_address)
        self.links, self.metrics = channel.links, channel.metrics
        self.wpool, self.rpool, self.wregion, self.rregion = (channel.wpool, channel.rpool, channel.wregion,
                                                              channel.rregion)
        # the map's MACs are checked with the admin key (the secret or an admin key file; a client key has none)
        self._routes = PartitionMap(channel, Etcd(etcd, etcd_prefix, access=etcd_access,
                                                  admin_key=creds.key(Role.ADMIN) if creds else None)
                                    if etcd else None)
        self.metrics.etcd = self._routes.etcd
        if map_via == "nodes" and (self._routes.etcd is None or self._routes.etcd.mac_key is None):
            raise ClientError("map_via='nodes' needs etcd= and the cluster secret or an admin key: a view from a "
                              "node is taken only with its MAC checked")
        self.map = self._routes.etcd                            # the cluster map in etcd, if any
        self.partitions = self._routes.partitions
        self.views = self._routes.views                         # etcd's views (state, want, ...)
        self._writes = Appender(channel, self._routes, block_size=block_size, depth=depth)
        # a volume key reaches only its volume's partitions: put() picks among those (learn_volume)
        self.volume = self._writes.volume = creds.volume if creds else ""
        self._routes.on_stale = self._writes.drop_extents
        self._reads = Reader(channel, self._routes, block_size=block_size, depth=depth, read_from=read_from)

    @staticmethod
    def env_kwargs(environ: Mapping[str, str] | None = None, **kw) -> dict:
        """``kw`` with what it does not give read from the environment (``os.environ`` by default):
        ``secret`` from $DATANODE_SECRET_FILE, ``tls_ca`` from $DATANODE_TLS_CA, ``options`` from
        $DATANODE_<FIELD> (``TransportOptions.from_env``) and, with ``etcd``, ``etcd_access`` from
        $DATANODE_ETCD_CREDENTIALS/_CA/_CERT/_KEY.  ClientError names a variable that does not parse."""
        env = os.environ if environ is None else environ
        kw["secret"] = kw.get("secret") or env.get("DATANODE_SECRET_FILE") or None
        kw["tls_ca"] = kw.get("tls_ca") or env.get("DATANODE_TLS_CA") or None
        try:
            kw["options"] = kw.get("options") or TransportOptions.from_env(env)
            if kw.get("etcd") and kw.get("etcd_access") is None:
                kw["etcd_access"] = EtcdAccess.load(**{arg: env.get(var) for _o, var, arg, _h in ACCESS_OPTIONS})
        except (AuthConfigError, TlsConfigError, ValueError) as e:
            raise ClientError(str(e)) from None
        return kw

    @classmethod
    def from_env(cls, nodes: Iterable[str] = (), *, environ: Mapping[str, str] | None = None, **kw):
        """``open(nodes, **kw)`` for a program configured by its environment (a CLI, a script): what ``kw``
        does not give comes from it (``env_kwargs``), and its $DATANODE_TRACE starts this process's tracing
        (wire/trace.py) -- a program's choice, which the SDK itself never makes."""
        kw = cls.env_kwargs(environ, **kw)
        if kw["options"].trace:
            trace.start(kw["options"].trace)
        return cls.open(nodes, **kw)

    @classmethod
    @asynccontextmanager
    async def open(cls, nodes: Iterable[str] = (), **kw) -> AsyncIterator["DataClient"]:
        """A client whose partition map is loaded from ``nodes`` (any datanodes of the cluster)."""
        dc = None
        try:
            async with aio.nursery() as nursery:
                opened = trio.current_time()       # the open's deadline is the client's timeout from here
                dc = cls(nursery, **kw)
                try:
                    nodes = list(nodes)
                    node_map = (dc.map is not None and bool(nodes) and dc.map_via != "etcd"
                                and dc.map.mac_key is not None)
                    if dc.map is not None and nodes and not node_map:
                        await dc._channel.hello(nodes[0])   # refused credentials first: they also check the map
                    via_nodes = False
                    if node_map:
                        try:
                            # (the nodes' time is the open's but a share: etcd, the fallback, gets the rest)
                            await dc._routes.load_nodes(nodes, opened + dc.timeout * 2 / 3)
                            via_nodes = True
                            nursery.start_soon(dc._routes.follow_nodes)
                        except ClientError as e:
                            if e.auth:                 # our credentials, not the nodes: that one reason
                                raise
                            if dc.map_via == "nodes":
                                raise ClientError(f"partition map: {e}") from None
                            log.warning("partition map: %s; following etcd's", e)
                    if dc.map is not None and not via_nodes:
                        dc._routes.map_nodes = []
                        try:
                            rev = await dc._routes.load_by(opened + dc.timeout)
                        except EtcdError as e:
                            raise ClientError(f"partition map: {e}") from None
                        nursery.start_soon(dc._routes.follow, rev)
                    errors = []
                    # the map came from a node: its partition list on the same connection, no hello to the others
                    # (a crowd of clients opening at once would meet the nodes' limits on hellos in progress)
                    for addr in [dc._routes.map_node] if via_nodes else nodes:
                        try:
                            await dc.discover(addr)
                        except ClientError as e:       # one node down must not stop the client
                            errors.append(e)
                    if nodes and not via_nodes and len(errors) == len(nodes):
                        refused = [e for e in errors if e.auth]
                        if refused:                    # our credentials, not the nodes: that one reason
                            raise refused[0]
                        raise ClientError("no datanode answered: " + "; ".join(map(str, errors)))
                    for e in errors:
                        log.warning("partition map from %s: %s", e.node, e)
                    if dc.volume:
                        await dc.learn_volume(nodes)
                    yield dc
                finally:
                    nursery.cancel_scope.cancel()
        finally:
            if dc is not None:
                dc._channel.release()       # once the links are gone (on verbs their windows hold the MRs)

    @property
    def put_failovers(self) -> int:
        """Times put() went on with another partition after a failure."""
        return self._writes.put_failovers

    # what the writer holds (tests look inside): open extents, and extents a failed put left empty
    @property
    def _idle(self) -> dict[int, list[tuple[int, int]]]:
        return self._writes.idle

    @property
    def _abandoned(self) -> dict[tuple[int, int], int]:
        return self._writes.abandoned

    # -- requests ---------------------------------------------------------------------------------
    async def request(self, addr: str, h: Header, *, body: bytes | None = None, answer: int = 0,
                      sink: memoryview | None = None, timeout: float | None = None) -> tuple[Header, bytes]:
        """Send one request to ``addr`` (``channel.Channel.request``): ``body`` is exposed for the server to
        READ, ``answer`` bytes of landing memory for it to WRITE.  Returns (response, answer bytes) -- or,
        with ``sink``, puts the answer into it and returns b"" in its place."""
        return await self._channel.request(addr, h, body=body, answer=answer, sink=sink, timeout=timeout)

    async def admin(self, addr: str, op: Op, *, partition: int = 0, body=None, answer: int = ADMIN_ANSWER,
                    epoch: int = 0):
        """An admin request with an optional JSON body and JSON answer; raises ClientError on failure."""
        return await self._channel.admin(addr, op, partition=partition, body=body, answer=answer, epoch=epoch)

    # -- the partition map ------------------------------------------------------------------------
    async def discover(self, addr: str) -> list[PartitionInfo]:
        """Learn the partitions ``addr`` holds (a newer epoch replaces what we knew); returns them."""
        return await self._routes.discover(addr)

    async def load_map(self) -> int:
        """Read every partition's view from etcd; returns the revision it was read at."""
        return await self._routes.load()

    def partition(self, pid: int) -> PartitionInfo:
        return self._routes.partition(pid)

    async def learn_volume(self, nodes: Iterable[str] = ()) -> list[int]:
        """Which partitions are in our volume: etcd's map does not say, their nodes do (``PARTITION_LIST``,
        which a volume key may send), so ask the leaders of the partitions we know not yet listed, and
        ``nodes``.  Returns ``volume_partitions()``; a node that does not answer is skipped."""
        asked = set(nodes)
        todo = {info.replicas[0] for pid, info in self.partitions.items()
                if pid not in self._routes.volumes and info.replicas} - asked
        for addr in sorted(todo):
            try:
                await self.discover(addr)
            except ClientError as e:
                if e.auth:                        # our key, not the node: say so, not "no partition"
                    raise
                log.info("volume %s: partitions of %s unknown: %s", self.volume, addr, e)
        return self.volume_partitions()

    def volume_partitions(self) -> list[int]:
        """The known partitions of our volume (every known partition without a volume key)."""
        return sorted(p for p in self.partitions if not self.volume or self._routes.volumes.get(p) == self.volume)

    async def refresh(self, pid: int) -> PartitionInfo:
        """Re-read the partition's replicas and epoch: from etcd when the map lives there, else from its
        members (after a replica change)."""
        return await self._routes.refresh(pid)

    # -- writing ----------------------------------------------------------------------------------
    async def create_extent(self, pid: int) -> int:
        return await self._writes.create_extent(pid)

    async def append(self, pid: int, extent: int, offset: int, data) -> Location:
        """One append (``len(data)`` <= the datanode's max block) at the extent's current end."""
        return await self._writes.append(pid, extent, offset, data)

    async def submit_append(self, part: PartitionInfo, extent: int, offset: int, data) -> "Awaitable[Location]":
        """Send one append without waiting for it; returns an awaitable for its Location (so a caller --
        a benchmark, a pipeline -- can keep ``depth`` appends in flight, as ``write`` does).  ``data`` must
        not change until that awaitable is done: where every link is TCP the leader reads it from there."""
        return await self._writes.submit_append(part, extent, offset, data)

    async def write(self, pid: int, data, *, on_progress=None, elsewhere=None) -> list[Location]:
        """Write ``data`` (any size) into partition ``pid``, as pipelined block-sized appends.

        Returns where it went.  A replication failure seals that extent on the leader: the unacknowledged
        blocks are written again to a new extent, so the returned locations are all on every replica.
        A ClientError raised here carries ``done``: the locations acknowledged before it (a prefix of
        ``data``), so a caller can retry only the rest.

        ``elsewhere(node)``: while the write waits for a new view of the partition because replica ``node``
        failed (with the map in etcd), asked whenever the map changes -- True: stop waiting and raise the
        failure (the caller writes the rest to another partition it has, without that node)."""
        return await self._writes.write(pid, data, on_progress=on_progress, elsewhere=elsewhere)

    def writable(self, avoid: dict[int, tuple[int, float]] | None = None) -> list[int]:
        """Partitions a new extent may go to now, best first: etcd says it takes writes (``writable``, else
        ``degraded``/``recovering`` with its view installed), it was not just failed on (``avoid``: pid ->
        (view revision, until); a new view of it lifts that), and -- to spread load -- its leader has the
        fewest of our puts in flight and we started the fewest extents in it."""
        return self._writes.writable(avoid)

    async def put(self, data, *, on_progress=None, timeout: float | None = None) -> list[Location]:
        """Write ``data`` (any size) to partitions the client picks from etcd's map; returns where it went
        (the locations may span partitions).

        Each new extent goes to the best writable partition (``writable``).  When a write fails because a
        replica died or the map changed (REPLICATION_FAILED, a timeout or lost connection, NOT_LEADER,
        STALE_EPOCH, ...), the unacknowledged part is written again on another writable partition, until
        ``timeout`` (default: the client's) -- the caller sees an error only when that runs out (or for a
        failure no other partition cures).  Every returned location is on every replica of its partition.
        With a volume key: on that volume's partitions only."""
        if self.volume and not self.volume_partitions():
            await self.learn_volume()             # (partitions made since we opened)
        return await self._writes.put(data, on_progress=on_progress, timeout=timeout)

    def forget_extent(self, pid: int, extent: int) -> None:
        """Never append to ``extent`` again (call before deleting an extent this client wrote to)."""
        self._writes.forget_extent(pid, extent)

    async def delete_extent(self, pid: int, extent: int) -> None:
        await self._writes.delete_extent(pid, extent)

    # -- reading ----------------------------------------------------------------------------------
    async def read(self, pid: int, extent: int, offset: int, length: int, *,
                   replica: str | None = None) -> bytes:
        """Read a range; each block's CRC is checked; a failing replica is skipped for the next one."""
        out = bytearray(length)
        await self._reads.read_into(pid, extent, offset, out, replica=replica)
        return bytes(out)

    async def read_into(self, pid: int, extent: int, offset: int, buf, *, replica: str | None = None) -> int:
        """``read`` into ``buf`` (any writable buffer: its length is the range's length), with no buffer of
        our own and no copy -- for a caller that reads many ranges into buffers it reuses.  Returns the
        bytes read.  On an error ``buf`` holds no unverified bytes of the failed piece."""
        return await self._reads.read_into(pid, extent, offset, buf, replica=replica)

    async def read_location(self, loc: Location, replica: str | None = None) -> bytes:
        return await self.read(loc.partition, loc.extent, loc.offset, loc.length, replica=replica)

    async def watermarks(self, pid: int, addr: str | None = None) -> dict[int, int]:
        part = self.partition(pid)
        marks = await self.admin(addr or part.replicas[0], Op.WATERMARKS, partition=pid)
        return {int(k): v for k, v in marks.items()}


class BlockingDataClient:
    """The same client for code that is not async: runs a trio loop in a helper thread."""

    def __init__(self, nodes: Iterable[str] = (), **kw):
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._stop = None
        self._thread = threading.Thread(target=self._main, args=(list(nodes), kw), daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error:
            raise self._error

    def _main(self, nodes, kw):
        async def run():
            try:
                async with DataClient.open(nodes, **kw) as dc:
                    self.dc = dc
                    self._token = trio.lowlevel.current_trio_token()
                    self._stop = trio.Event()
                    self._ready.set()
                    await self._stop.wait()
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                self._error = e
                self._ready.set()
        trio.run(run)

    def _call(self, fn, *args, **kw):
        return trio.from_thread.run(lambda: fn(*args, **kw), trio_token=self._token)

    def write(self, pid, data):
        return self._call(self.dc.write, pid, data)

    def put(self, data, timeout=None):
        return self._call(self.dc.put, data, timeout=timeout)

    def read(self, pid, extent, offset, length, replica=None):
        return self._call(self.dc.read, pid, extent, offset, length, replica=replica)

    def read_location(self, loc, replica=None):
        return self._call(self.dc.read_location, loc, replica)

    def create_extent(self, pid):
        return self._call(self.dc.create_extent, pid)

    def close(self):
        if self._stop is not None:
            trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
        self._thread.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
