"""Verbs transport (pyverbs): one RC queue pair per connection, set up over the connection's TCP stream.

* One device context and protection domain per process (``Device``, cached); every registered region of
  the process's ``Domain`` becomes one MR on it (the server's whole pool arena: LOCAL_WRITE | REMOTE_READ).
* Per connection: a completion channel + CQ, an RC QP, and a registered control region of ``our_slots``
  receive slots, all preposted at connect and reposted as each completes.  Headers go by SEND (inline);
  payloads by RDMA READ / RDMA WRITE straight between registered regions -- except a small WRITE's payload
  (at most ``verbs_inline`` bytes, TransportOptions), which goes in the same SEND as its
  header (protocol.Flag.INLINE, as on TCP): the accepting side's slots are that much larger (its hello's
  ``slot_size`` says so; a peer whose hello says 88 gets headers only), and the sender copies header and
  payload into one of its registered send buffers.
* Completions reach trio without a spinning thread: the channel's fd is awaited with
  ``trio.lowlevel.wait_readable``; then get_cq_event, ack, re-arm, poll until empty.  With
  ``verbs_spin_us = N`` (default 0: off) the poller first busy-polls the CQ (yielding to trio between
  polls) while completions keep coming and N us after the last one; an idle connection costs no CPU either way.
* With ``verbs_unsignaled`` (default off) work requests nobody waits for (a header's SEND, a
  window's bind) are unsignaled: no completion to take; the send-queue entries they hold are retired by the
  next signaled completion (at most UNSIGNALED_MAX in a row).  A failed work request completes either way.
  Neither paid on Soft-RoCE, where a spinning poller takes the CPU rxe's own work needs.
* Credits: the requester side never has more requests outstanding than the peer has slots (``rpc``), and
  every request gets exactly one response, so SENDs never meet an empty receive queue.
* Errors: any failed completion (peer gone, retry exceeded, remote access error) moves the QP to the error
  state; everything in flight fails with ConnectionClosed / RemoteAccessError, the connection is torn down
  and the next request dials again.  The TCP stream stays open beside the QP: its EOF tells us at once that
  the peer process is gone.

Memory scoping on verbs: per-request type-2 memory windows.  The NIC serves RDMA READ/WRITE by rkey alone,
so the TCP transport's table of grants cannot be consulted; the device enforces the scoping instead:
* A *scoped* region (the datanode's pool and landing regions, the SDK's buffers) is registered, when the
  device has type-2 windows, with ``MW_BIND`` and NO remote rights on the MR: the MR's keys give a peer
  nothing (rxe gives such an MR rkey 0; the region is named by its lkey, which is what ``pool stats`` shows).
* A request naming such a buffer (``rpc._grant``, the one place a header's rkey is filled for the peer)
  goes through this connection's ``WindowGrants.grant``: a type-2 window from the connection's free list is
  bound by an ``IBV_WR_BIND_MW`` work request on *this connection's QP*, covering exactly the named range with
  exactly the right the request needs (REMOTE_READ for a payload or body the peer fetches, REMOTE_WRITE for
  an answer it pushes), posted ahead of the header's SEND on the same send queue, in the same ``post_send``
  (one doorbell); the header carries the window's rkey.  When the answer arrives, the request times out or
  fails, ``drop`` posts ``IBV_WR_LOCAL_INV``, and ``Pending.result`` returns only after it completed
  (``settle``), so the buffer is never reused while the window is live.  Each bind takes the window's next
  8-bit key, so a stale rkey (an answered request's) names nothing; a window is usable only through the QP it was bound on, so another
  connection (another peer, or the same peer's second QP) cannot use it.  A dead connection's QP is in the
  error state: nothing reaches its windows; they are deallocated with it.
* A peer's access that breaks these rules fails at the NIC with a remote access error; its QP (and ours to it)
  moves to the error state: that connection is torn down, everything else keeps going.
Limits.  ``rdma_rxe`` in our VM (kernel 6.1) checks a window's rkey, QP, state and rights but bounds an
access by the window's *MR*, not the window: while a peer's own request is in flight, that peer can reach the
whole region through its window (measured by the VM test, see docs/security.md); hardware that
implements the IB window bounds (C10-xx) confines it to the range.  A device without type-2 windows (or
``rdma_windows = false``) keeps the old behaviour: MRs carry REMOTE_READ (the pool; never REMOTE_WRITE)
and a peer with a QP that learns a region's rkey can read all of it; logged as a warning at start and shown
as ``rdma_windows`` in node status.  A QP exists only after an authenticated hello in both modes.
pyverbs (rdma-core 44) never records a bound rkey back into ``ibv_mw.rkey``; ``_mw_struct`` keeps it
current (a process where that cannot be done runs without windows, logged).
"""
from __future__ import annotations

import ctypes
import dataclasses
import errno
import logging
import mmap
import os
import random
import struct
import threading
import time

import trio

import pyverbs.enums as E
from pyverbs.addr import GID, AHAttr, GlobalRoute
from pyverbs.cq import CQ, CompChannel
from pyverbs.device import Context, get_device_list
from pyverbs.mr import MR, MW, MWBindInfo
from pyverbs.pd import PD
from pyverbs.pyverbs_error import PyverbsError, PyverbsRDMAError
from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
from pyverbs.wr import SGE, RecvWR, SendWR

from ..aio import Workers
from ..protocol import HEADER_SIZE, VerbsEndpoint
from ..session import TAG_SIZE
from .base import (Access, Connection, ConnectionClosed, Domain, Grants, Region, RemoteAccessError, TransportError,
                   TransportOptions, address_of)
from .tcp import recv_exactly, send_all

log = logging.getLogger(__name__)

PORT = 1
SLOT = 256                      # bytes per control slot without inline payloads (a header is 88)
RECV_TAG = 1 << 62              # wr_id of a receive = RECV_TAG | slot index
READY, FAILED = b"\x01", b"\x00"

UNSIGNALED_MAX = 16             # unsignaled work requests in a row at most; then one is signaled
# One-sided ops (RDMA READ / WRITE) of at least ``verbs_post_thread_min`` bytes are posted from a worker thread
# that lets go of the GIL (``_RawPost``; 0: never).  rxe moves an op's bytes inside the ``post_send`` call
# itself (its softirq work runs in the caller), and pyverbs holds the GIL through it: a large READ would stop
# the node's whole interpreter.  Where not set, on for software devices (rxe, siw) only; hardware returns at once.
POST_THREAD_SOFTWARE = 64 << 10


class SetupFailed(Exception):
    """Verbs could not be brought up on this connection; both ends stay on TCP."""


def _access(a: Access) -> int:
    flags = 0
    if a & Access.LOCAL_WRITE:
        flags |= E.IBV_ACCESS_LOCAL_WRITE
    if a & Access.REMOTE_READ:
        flags |= E.IBV_ACCESS_REMOTE_READ
    if a & Access.REMOTE_WRITE:
        flags |= E.IBV_ACCESS_REMOTE_WRITE
    return flags


class Device:
    """The process's device context and protection domain, tuned by its TransportOptions."""

    def __init__(self, name: str, options: TransportOptions):
        self.name = name
        self.gid_index = gid_index = options.gid_index
        self.ctx = Context(name=name)
        self.pd = PD(self.ctx)
        self.port_attr = self.ctx.query_port(PORT)
        if self.port_attr.state != E.IBV_PORT_ACTIVE:
            raise RuntimeError(f"{name} port {PORT} is not active")
        self.gid = self.ctx.query_gid(PORT, gid_index)
        if not self.gid.gid or self.gid.gid.replace(":", "").strip("0") == "":
            raise RuntimeError(f"{name} has no GID at index {gid_index}")
        dattr = self.ctx.query_device()
        # RDMA READs one queue pair may have outstanding (ours) and serve at once (the peer's): ib_read_bw's 16
        self.rd_atomic = max(1, min(16, dattr.max_qp_init_rd_atom, dattr.max_qp_rd_atom))
        self.spin_s = options.verbs_spin_us / 1e6
        self.unsignaled = options.verbs_unsignaled
        self.inline_max = options.verbs_inline
        software = name.startswith(("rxe", "siw"))
        self.post_thread_min = (options.verbs_post_thread_min if options.verbs_post_thread_min >= 0
                                else POST_THREAD_SOFTWARE if software else 0)
        self.posters = Workers(most=options.verbs_posters, name="verbs-post")
        caps = dattr.device_cap_flags
        type2 = bool(caps & E.IBV_DEVICE_MEM_WINDOW) and bool(
            caps & (E.IBV_DEVICE_MEM_WINDOW_TYPE_2A | E.IBV_DEVICE_MEM_WINDOW_TYPE_2B))
        #: scoped regions are registered without remote rights and exposed per request by type-2 windows
        self.windows = type2 and options.rdma_windows
        why_not = ""
        if self.windows:
            try:
                _Window(self.pd).mw.close()      # allocates, and finds the struct we keep the rkey in
            except Exception as e:  # noqa: BLE001 - whatever it is, this process binds no windows
                self.windows, why_not = False, f"cannot use them: {e}"
        if self.windows:
            self.windows_state = "on"
            log.info("%s: memory windows on (type 2): a peer reaches our memory only through the window a "
                     "request bound for it on its queue pair", name)
        else:
            self.windows_state = ("off (%s)" % why_not if why_not else
                                  "off (rdma_windows = false)" if type2 else "off (device has no type-2 windows)")
            log.warning("%s: memory windows %s: a peer with a queue pair that learns a region's rkey can "
                        "reach the whole registered region", name, self.windows_state)

    @property
    def mtu(self) -> int:
        """The port's active MTU now (an ``ibv_mtu`` value: 3 = 1024 ... 5 = 4096).  Asked per connection:
        on RoCE it follows the netdev's MTU (rxe: 1500 gives 1024, 4200 and up 4096), which may change while
        we run; each queue pair uses the smaller of both ends' at its setup."""
        return int(self.ctx.query_port(PORT).active_mtu)

    def register(self, region: Region) -> None:
        access = _access(region.access)
        if region.scoped and self.windows and region.access & (Access.REMOTE_READ | Access.REMOTE_WRITE):
            # the MR itself gives a peer nothing: no remote rights, only the right to bind windows on it
            access = (access & ~(E.IBV_ACCESS_REMOTE_READ | E.IBV_ACCESS_REMOTE_WRITE)) | E.IBV_ACCESS_MW_BIND
            region.windows = True
        mr = MR(self.pd, region.length, access, address=region.addr)
        region.mr, region.rkey, region.lkey = mr, mr.rkey, mr.lkey
        if region.windows:
            # an MR without remote rights has no rkey (rxe gives 0 to all of them); the region is named by
            # its lkey, which gives a peer nothing: headers carry a window's rkey in its place (``grant``)
            region.rkey = mr.lkey

    def deregister(self, region: Region) -> None:
        if region.mr is not None:
            try:
                region.mr.close()
            except PyverbsError as e:      # a window still bound on a live QP holds it; freed with the PD
                log.warning("%s: deregistering a region failed: %s", self.name, e)
            region.mr = None


_devices: dict[tuple[str, TransportOptions], Device] = {}
_devices_lock = threading.Lock()


def attach(domain: Domain) -> None:
    """Give ``domain`` the device its options name (the first active one if none), opened once per process
    and set of verbs options, and shared."""
    opts = domain.options
    name = opts.rdma_device
    if not name:
        devs = [d.name.decode() if isinstance(d.name, bytes) else d.name for d in get_device_list()]
        if not devs:
            raise RuntimeError("no RDMA devices")
        name = devs[0]
    key = (name, dataclasses.replace(opts, rdma_device="", tcp_congestion="", trace=""))   # what a Device uses
    with _devices_lock:
        dev = _devices.get(key)
        if dev is None:
            dev = _devices[key] = Device(name, opts)
    domain.device = dev


def _comp_channel(ctx: Context) -> tuple[CompChannel, int]:
    """pyverbs (rdma-core 44) does not expose the channel's fd: find the fd CompChannel() opened."""
    def links():
        out = {}
        for fd in os.listdir("/proc/self/fd"):
            try:
                out[int(fd)] = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                pass
        return out
    with _devices_lock:            # no other thread may open fds in between (best effort)
        before = links()
        cc = CompChannel(ctx)
        after = links()
    new = [fd for fd, t in after.items() if before.get(fd) != t and "infinibandevent" in t]
    if len(new) != 1:
        cc.close()
        raise RuntimeError(f"cannot identify the completion channel fd ({new})")
    return cc, new[0]


class _Op:
    __slots__ = ("event", "status", "then")

    def __init__(self, then=None):
        self.event = trio.Event()
        self.status = None
        self.then = then                 # called with the completion's success (bool), from the pump


def _mw_struct(mw: MW) -> int:
    """Address of the ``struct ibv_mw`` a pyverbs MW wraps.

    pyverbs (rdma-core 44) sets a bind work request's new rkey to ``ibv_inc_rkey(mw->rkey)`` but never
    stores the bound rkey back in ``mw->rkey``, as a C consumer does after posting the bind: the second bind of
    the same window would name a stale rkey (the device refuses it) and every bind would give the same key.
    We keep ``mw->rkey`` current ourselves; this finds the struct (``{context, pd, rkey, handle, type}``)
    by its rkey and handle among the object's pointer-sized fields, or raises LookupError."""
    want = struct.pack("<II", mw.rkey, mw.handle)
    return _struct_behind(mw, lambda p: ctypes.string_at(p + 16, 8) == want)


def _struct_behind(obj, check) -> int:
    """Address of the C struct a pyverbs object wraps: the pointer-sized field of ``obj`` for which
    ``check(address)`` holds (it reads the candidate struct), or LookupError."""
    raw = ctypes.string_at(id(obj), type(obj).__basicsize__)
    for off in range(16, len(raw) - 7, 8):           # past the PyObject head
        (p,) = struct.unpack_from("<Q", raw, off)
        if p < 1 << 16 or p % 8 or p in (id(obj), id(type(obj))):
            continue
        try:
            if check(p):
                return p
        except (OSError, ValueError):
            continue
    raise LookupError(f"cannot find the C struct of a pyverbs {type(obj).__name__}")


_POST_SEND_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p))
# struct ibv_context: {struct ibv_device *device; struct ibv_context_ops ops; ...}; in the ops table (ABI,
# frozen in verbs.h with its _compat_ slots) post_send is the 26th pointer: what ibv_post_send() calls
_OPS_POST_SEND = 8 + 25 * 8
_QP_NUM = 6 * 8 + 4      # struct ibv_qp: context, qp_context, pd, send_cq, recv_cq, srq, handle, qp_num
_WR_OPCODE = 28          # struct ibv_send_wr: wr_id, next, sg_list, num_sge, opcode, send_flags, ...


class _RawPost:
    """``ibv_post_send`` on one QP without the GIL: the provider's post_send, called through ctypes (which
    lets go of the GIL for the call) on the ``struct ibv_send_wr`` inside a pyverbs SendWR.  Found and
    checked once per QP (the QP struct by its qp_num, the SendWR struct by a probe's wr_id and opcode); a
    process where that fails posts through pyverbs as before (``for_qp`` returns None, logged once)."""
    __slots__ = ("qp", "fn", "lock", "live")
    _broken = False
    wr_off: int | None = None            # where pyverbs keeps the struct in a SendWR: the process's, found once

    def __init__(self, qp: QP):
        num = qp.qp_num
        self.qp = _struct_behind(qp, lambda p: ctypes.c_uint32.from_address(p + _QP_NUM).value == num)
        ctx = ctypes.c_void_p.from_address(self.qp).value
        fn = ctypes.c_void_p.from_address(ctx + _OPS_POST_SEND).value if ctx else None
        if not fn:
            raise LookupError("no post_send in the device context")
        self.fn = _POST_SEND_FN(fn)
        if _RawPost.wr_off is None:
            _RawPost.wr_off = self._find_wr_off()
        self.lock = threading.Lock()     # held across a post: the QP is not destroyed under it
        self.live = True

    @staticmethod
    def _find_wr_off() -> int:
        """pyverbs embeds the struct in the SendWR object: where, found by a probe's wr_id and opcode."""
        probe = SendWR(wr_id=0x5E4D0C0B0A090807, opcode=E.IBV_WR_RDMA_READ, num_sge=1, sg=[SGE(0, 0, 0)])
        raw = ctypes.string_at(id(probe), type(probe).__basicsize__)
        offs = [off for off in range(16, len(raw) - _WR_OPCODE - 3, 8)
                if struct.unpack_from("<QI", raw, off)[0] == probe.wr_id
                and struct.unpack_from("<I", raw, off + _WR_OPCODE)[0] == E.IBV_WR_RDMA_READ]
        if len(offs) != 1:
            raise LookupError("cannot find the ibv_send_wr inside a pyverbs SendWR")
        return offs[0]

    @classmethod
    def for_qp(cls, qp: QP) -> "_RawPost | None":
        if cls._broken:
            return None
        try:
            return cls(qp)
        except Exception as e:  # noqa: BLE001 - any failure: post through pyverbs
            cls._broken = True
            log.warning("verbs: large one-sided ops post through pyverbs (holding the GIL): %s", e)
            return None

    def post(self, wr: SendWR) -> int:
        """Post ``wr`` (in a worker thread); 0, or the provider's errno."""
        bad = ctypes.c_void_p()
        with self.lock:
            if not self.live:
                return errno.ENOTCONN
            return self.fn(self.qp, id(wr) + self.wr_off, ctypes.byref(bad))

    def close(self) -> None:
        """Before the QP is destroyed: waits out a post under way; none starts after."""
        with self.lock:
            self.live = False


class _Window:
    """One type-2 memory window of a connection, reused: bound per request, invalidated after."""
    __slots__ = ("mw", "ptr")

    def __init__(self, pd: PD):
        self.mw = MW(pd, E.IBV_MW_TYPE_2)
        try:
            self.ptr = _mw_struct(self.mw)
        except BaseException:
            self.mw.close()
            raise

    @property
    def rkey(self) -> int:
        return self.mw.rkey

    def bound(self, rkey: int) -> None:
        ctypes.c_uint32.from_address(self.ptr + 16).value = rkey
        if self.mw.rkey != rkey:
            raise RuntimeError("could not record a memory window's rkey")


class WindowGrants(Grants):
    """A verbs connection's grants: for a region registered with windows (``Region.windows``: its MR has no
    remote rights), each grant binds a type-2 memory window on this connection's queue pair, covering exactly
    the granted range with exactly the granted right, and the peer gets the window's rkey.  The bind is
    posted ahead of the request's SEND on the same send queue, so it is in place when the peer acts on the
    header.  ``drop`` posts a local invalidate; ``settle`` waits for it to complete.  A window is bound to
    this QP: no other connection can use it, and once invalidated its rkey is dead (the next bind of the same
    window gets the next 8-bit key).  Windows are kept in a small free list (allocating one is a system call;
    binding is a work request).  A region without windows gets a plain grant: its MR-wide rkey."""

    def __init__(self, conn: "VerbsConnection"):
        super().__init__()
        self.conn = conn
        self._free: list[_Window] = []
        self._all: list[_Window] = []
        self._bound: dict[int, tuple[_Window, int]] = {}     # token -> (window, the rkey it was bound with)
        self._invalidating: dict[int, _Op] = {}
        self.binds = 0

    async def grant(self, addr: int, rkey: int, length: int, access: Access) -> tuple[int, int]:
        conn = self.conn
        region = conn.domain.region(rkey)
        if region is None or not region.windows or not (region.access & access) or length <= 0:
            return await super().grant(addr, rkey, length, access)     # MR-wide (or nothing, for the peer)
        await conn._reserve(2)                     # the bind, and the invalidate that will follow it
        try:
            w = self._free.pop() if self._free else self._new()
            wr = SendWR(opcode=E.IBV_WR_BIND_MW, send_flags=E.IBV_SEND_SIGNALED)
            wr.set_bind_wr(w.mw, MWBindInfo(region.mr, addr, length, _access(access)))
            new = wr.rkey                          # the window's next key: the old one dies with this bind
        except BaseException:
            conn._sq.release()
            conn._sq.release()
            raise
        if conn._closed:
            conn._sq.release()
            conn._sq.release()
            raise ConnectionClosed(f"connection to {conn.peer} is closed: {conn._closed}")
        # Not posted yet: it goes out in the same post_send as the next work request of this QP (the
        # request's SEND, which rpc posts right after the grant), ahead of it on the send queue -- so the
        # window is in place before the peer can see the header -- unsignaled with ``verbs_unsignaled``.
        # the provider names the window by its current key (``mw->rkey``) at post time: record the new one
        # only once the bind is posted
        conn._chain_bind(wr, lambda: w.bound(new))
        self.binds += 1
        token = self.add(addr, new, length, access)
        self._bound[token] = (w, new)
        return token, new

    def _new(self) -> _Window:
        w = _Window(self.conn.dev.pd)
        self._all.append(w)
        return w

    def drop(self, token: int | None) -> None:
        super().drop(token)
        w, key = self._bound.pop(token, (None, 0))
        if w is None:
            return
        conn = self.conn
        if conn._closed:                # the QP is in error: nothing reaches the window; freed at _destroy
            return
        wr = SendWR(opcode=E.IBV_WR_LOCAL_INV, send_flags=E.IBV_SEND_SIGNALED)
        wr.imm_data = key               # the union member invalidate_rkey (its bind may still be in the chain)

        def then(ok: bool) -> None:
            self._invalidating.pop(token, None)
            if ok:
                self._free.append(w)

        try:
            self._invalidating[token] = conn._post_reserved(wr, "invalidate", then, signaled=True)
        except ConnectionClosed:
            self._invalidating.pop(token, None)

    async def settle(self, token: int | None) -> None:
        op = self._invalidating.get(token)
        if op is None or op.event.is_set():
            return
        with trio.move_on_after(5):
            await op.event.wait()
        if not op.event.is_set():
            self.conn._shutdown("a memory window's invalidation did not complete")

    def close(self) -> None:
        """Deallocate every window (the QP is gone or in error)."""
        for w in self._all:
            try:
                w.mw.close()
            except PyverbsError as e:
                log.debug("closing a memory window: %s", e)
        self._all.clear()
        self._free.clear()
        self._bound.clear()


class VerbsConnection(Connection):
    transport = "verbs"

    def __init__(self, sock, domain: Domain, peer: str, peer_slots: int, our_slots: int,
                 peer_slot_size: int = SLOT, our_slot_size: int = SLOT):
        super().__init__(our_slots)
        dev: Device = domain.device
        self.dev = dev
        self.domain = domain
        self._sock = sock
        self.peer = peer
        self.slots = peer_slots
        self.our_slots = our_slots
        self._owns_sock = False          # True once established: then closing us closes the stream
        self._ids = 0
        self._ops: dict[int, _Op] = {}
        # receive slots: ours take ``our_slot_size`` bytes (a header, and an inline payload after it where
        # we accept them: the server side); the peer's take ``peer_slot_size`` (its hello said so)
        self.slot = -(-max(SLOT, our_slot_size) // 64) * 64
        self.peer_slot = max(SLOT, peer_slot_size)
        #: payload bytes a SEND may carry after its header (protocol.Flag.INLINE): the peer's slots and ours
        self.max_inline = min(dev.inline_max, max(0, peer_slot_size - HEADER_SIZE)) if dev.inline_max else 0
        self._eager = None               # (mmap, MR, free buffer indexes, Semaphore), made on first use
        self.eager_sends = 0
        self.spins = 0
        # unsignaled work requests: the send queue entries they hold are retired by the next signaled one's
        # completion (``_carry``: its wr_id -> how many it retires besides itself)
        self._unsig = 0
        self._carry: dict[int, int] = {}
        self._chain: list = []           # (bind, posted) waiting to go out ahead of the next post (``_chain_bind``)
        # each request of ours may hold a window bind and its invalidate besides the SEND
        self.sq_depth = (4 if dev.windows else 2) * peer_slots + 2 * our_slots + 16
        self._sq = trio.Semaphore(self.sq_depth)
        # resources, released in _destroy (QP, MR, CQ, channel); a partial set is released at once, never
        # left to the garbage collector (which would free them in any order)
        self._destroyed = False
        self.qp = self.ctrl_mr = self.cq = self.cc = self.ctrl = self.ctrl_view = None
        self._raw: _RawPost | None = None    # large one-sided ops posted without the GIL (POST_THREAD_ENV)
        self.thread_posts = 0
        self.grants = WindowGrants(self)
        try:
            self._create(dev, our_slots)
        except BaseException:
            self._destroy()
            raise
        self.qpn = self.qp.qp_num
        self.psn = random.getrandbits(24)
        self.mtu = self.path_mtu = 0     # ibv_mtu values, set by endpoint() and bring_up()

    def _create(self, dev: Device, our_slots: int) -> None:
        self.cc, self.fd = _comp_channel(dev.ctx)
        os.set_blocking(self.fd, False)
        self.cq = CQ(dev.ctx, self.sq_depth + our_slots + 8, None, self.cc, 0)
        self.cq.req_notify()
        self.ctrl = mmap.mmap(-1, max(mmap.PAGESIZE, our_slots * self.slot))
        self.ctrl_view = memoryview(self.ctrl)
        self.ctrl_addr = address_of(self.ctrl)
        self.ctrl_mr = MR(dev.pd, len(self.ctrl), E.IBV_ACCESS_LOCAL_WRITE, address=self.ctrl_addr)
        cap = QPCap(max_send_wr=self.sq_depth, max_recv_wr=our_slots, max_send_sge=1, max_recv_sge=1,
                    max_inline_data=SLOT)
        # sq_sig_all=0: a work request makes a completion only when it asks (IBV_SEND_SIGNALED); failures always do
        self.qp = QP(dev.pd, QPInitAttr(qp_type=E.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap, sq_sig_all=0))
        self._raw = _RawPost.for_qp(self.qp) if dev.post_thread_min else None

    # -- setup ----------------------------------------------------------------------------------------
    def endpoint(self) -> VerbsEndpoint:
        self.mtu = self.dev.mtu
        return VerbsEndpoint(qpn=self.qpn, psn=self.psn, gid=_gid_bytes(self.dev.gid.gid), mtu=self.mtu)

    def bring_up(self, remote: VerbsEndpoint) -> None:
        dev = self.dev
        a = QPAttr(qp_state=E.IBV_QPS_INIT)
        a.pkey_index = 0
        a.port_num = PORT
        a.qp_access_flags = E.IBV_ACCESS_LOCAL_WRITE | E.IBV_ACCESS_REMOTE_READ | E.IBV_ACCESS_REMOTE_WRITE
        self.qp.modify(a, E.IBV_QP_STATE | E.IBV_QP_PKEY_INDEX | E.IBV_QP_PORT | E.IBV_QP_ACCESS_FLAGS)
        for i in range(self.our_slots):
            self._post_recv(i)
        a = QPAttr(qp_state=E.IBV_QPS_RTR)
        self.path_mtu = a.path_mtu = min(self.mtu or self.dev.mtu, remote.mtu)
        a.dest_qp_num = remote.qpn
        a.rq_psn = remote.psn
        a.max_dest_rd_atomic = dev.rd_atomic
        a.min_rnr_timer = 12
        gr = GlobalRoute(dgid=GID(_gid_str(remote.gid)), sgid_index=dev.gid_index, hop_limit=64)
        a.ah_attr = AHAttr(port_num=PORT, is_global=1, gr=gr, dlid=0, sl=0)
        self.qp.modify(a, E.IBV_QP_STATE | E.IBV_QP_AV | E.IBV_QP_PATH_MTU | E.IBV_QP_DEST_QPN
                       | E.IBV_QP_RQ_PSN | E.IBV_QP_MAX_DEST_RD_ATOMIC | E.IBV_QP_MIN_RNR_TIMER)
        a = QPAttr(qp_state=E.IBV_QPS_RTS)
        a.sq_psn = self.psn
        a.timeout = 14           # 4.096 us * 2^14 = 67 ms per try
        a.retry_cnt = 7
        a.rnr_retry = 7
        a.max_rd_atomic = dev.rd_atomic
        self.qp.modify(a, E.IBV_QP_STATE | E.IBV_QP_SQ_PSN | E.IBV_QP_TIMEOUT | E.IBV_QP_RETRY_CNT
                       | E.IBV_QP_RNR_RETRY | E.IBV_QP_MAX_QP_RD_ATOMIC)

    def _post_recv(self, slot: int) -> None:
        sge = SGE(self.ctrl_addr + slot * self.slot, self.slot, self.ctrl_mr.lkey)
        self.qp.post_recv(RecvWR(wr_id=RECV_TAG | slot, num_sge=1, sg=[sge]))

    def bind_session(self, session) -> None:
        super().bind_session(session)
        # every SEND carries the MAC after its bytes: an inline payload has that much less room in a slot
        self.max_inline = max(0, min(self.max_inline, self.peer_slot - HEADER_SIZE - TAG_SIZE))

    # -- the interface --------------------------------------------------------------------------------
    async def send(self, header: bytes, payload=None) -> None:
        if payload is not None and len(payload):
            await self._send_eager(header, payload)
            return
        session = self.session
        seal = None
        if session is not None:
            # The session's MAC goes after the message, taken once the send queue has room, right before the
            # post (``_post``'s ``seal``): messages leave in the order of their MACs.  ``msg`` lives, and
            # never moves (not resized), until the post has copied it into the work request.
            n = len(header)
            header = msg = bytearray(header) + bytes(TAG_SIZE)

            def seal():
                msg[n:] = session.seal(msg[:n])
        if len(header) > self.peer_slot:
            raise ValueError("control message larger than a slot")
        # inline: the bytes are copied into the WQE at post time (``header`` lives until then), no lkey
        wr = SendWR(opcode=E.IBV_WR_SEND, num_sge=1, sg=[SGE(address_of(header), len(header), 0)],
                    send_flags=E.IBV_SEND_INLINE)
        # Lean: an inline SEND's bytes are in the work request once it is posted, so we do not wait for its
        # completion (one trip through the event loop less per message, as TCP returns once the bytes are in
        # the socket), nor ask for one (``signaled=False``: a later signaled completion retires its
        # send-queue entry).  A failed one still completes, and ends the connection: the request it carried
        # then fails like every other one in flight.
        await self._post(wr, "send", wait=False, signaled=False, seal=seal)
        self.stats.sends += 1

    async def _send_eager(self, header: bytes, payload) -> None:
        """A header with a small payload after it in one SEND (an inline WRITE, protocol.Flag.INLINE): the
        bytes are copied into one of this connection's registered send buffers, which is free again once
        the SEND completed (the peer's NIC has them).  Costs one copy, as the staging copy a READ needs, and
        saves the READ's round trip and the memory window."""
        n = len(payload)
        if n > self.max_inline:
            raise ValueError(f"inline payload of {n} bytes: this connection carries at most {self.max_inline}")
        if self._closed:
            raise ConnectionClosed(f"connection to {self.peer} is closed: {self._closed}")
        if self._eager is None:
            self._make_eager()
        buf, mr, free, avail, size = self._eager
        await avail.acquire()
        i = free.pop()
        wr = None
        try:
            base = i * size
            end = base + len(header) + n
            buf[base:base + len(header)] = header
            buf[base + len(header):end] = payload
            session = self.session
            seal = None
            if session is not None:      # the header's MAC after the payload, taken right before the post
                def seal(at=end):
                    buf[at:at + TAG_SIZE] = session.seal(header)
                end += TAG_SIZE
            wr = SendWR(opcode=E.IBV_WR_SEND, num_sge=1,
                        sg=[SGE(self._eager_addr + base, end - base, mr.lkey)])

            def then(ok: bool, i=i) -> None:
                free.append(i)
                avail.release()

            await self._post(wr, "send", wait=False, signaled=True, then=then, seal=seal)
        except BaseException:
            if wr is None or wr.wr_id not in self._ops:     # not posted: ``then`` will never run
                free.append(i)
                avail.release()
            raise
        self.eager_sends += 1
        self.stats.sends += 1

    def _make_eager(self) -> None:
        size = -(-(HEADER_SIZE + self.max_inline + TAG_SIZE) // 64) * 64
        count = max(1, min(self.slots, 16))
        buf = mmap.mmap(-1, max(mmap.PAGESIZE, count * size))
        self._eager_view = memoryview(buf)
        self._eager_addr = address_of(buf)
        mr = MR(self.dev.pd, len(buf), E.IBV_ACCESS_LOCAL_WRITE, address=self._eager_addr)
        self._eager_mmap = buf
        self._eager = (self._eager_view, mr, list(range(count)), trio.Semaphore(count), size)

    async def read(self, remote, local: memoryview, local_region: Region | None = None) -> None:
        await self._rdma(E.IBV_WR_RDMA_READ, remote, local, local_region, "read")
        self.stats.reads += 1
        self.stats.read_bytes += remote.length

    async def write(self, local: memoryview, local_region: Region | None, remote, *, posted: bool = False,
                    release=None) -> None:
        # The NIC reads ``local`` until the work request completes.  Posted with ``release``: return once it
        # is posted -- RC delivers it ahead of anything we send after it -- and hand ``local`` back on the
        # completion (a failed or flushed one too; ``_fail_all`` runs every ``then`` left); otherwise wait.
        then = (lambda ok: release()) if posted and release is not None else None
        await self._rdma(E.IBV_WR_RDMA_WRITE, remote, local, local_region, "write", then=then)
        self.stats.writes += 1
        self.stats.write_bytes += remote.length

    async def aclose(self) -> None:
        self._shutdown("closed locally")

    # -- machinery ------------------------------------------------------------------------------------
    async def _rdma(self, opcode, remote, local: memoryview, region: Region | None, what: str,
                    then=None) -> None:
        """Post a one-sided op and wait for its completion -- or, with ``then``, return once it is posted;
        ``then(ok)`` runs on its completion (never if this raises)."""
        if len(local) != remote.length:
            raise ValueError("local and remote lengths differ")
        if remote.length == 0:
            if then is not None:
                then(True)
            return
        addr = address_of(local)          # ``local`` is the caller's, alive until we return
        if region is None or not (region.addr <= addr and addr + len(local) <= region.addr + region.length):
            region = self.domain.find_local(addr, len(local))
        wr = SendWR(opcode=opcode, num_sge=1, sg=[SGE(addr, len(local), region.lkey)],
                    send_flags=E.IBV_SEND_SIGNALED)
        wr.set_wr_rdma(remote.rkey, remote.addr)
        await self._post(wr, what, wait=then is None, then=then, nbytes=remote.length)

    async def _reserve(self, n: int) -> None:
        """Take ``n`` send-queue entries for work requests posted later with ``_post_reserved``."""
        got = 0
        try:
            while got < n:
                await self._sq.acquire()
                got += 1
        except BaseException:
            for _ in range(got):
                self._sq.release()
            raise
        if self._closed:
            for _ in range(got):
                self._sq.release()
            raise ConnectionClosed(f"connection to {self.peer} is closed: {self._closed}")

    def _post_reserved(self, wr: SendWR, what: str, then=None, signaled: bool = True) -> _Op | None:
        """Post on an entry ``_reserve`` took, without waiting for the completion (which releases it)."""
        if self._closed:
            raise ConnectionClosed(f"connection to {self.peer} is closed: {self._closed}")
        self._ids += 1
        wr.wr_id = self._ids
        op = None
        if signaled:
            op = self._ops[wr.wr_id] = _Op(then)
        self._post_send(wr, what, signaled)
        return op

    def _chain_bind(self, wr: SendWR, posted) -> None:
        """Queue a bind (on entries ``_reserve`` took) to be posted, unsignaled, ahead of the next work
        request in the same ``post_send``; ``posted()`` runs once it is."""
        self._ids += 1
        wr.wr_id = self._ids
        self._chain.append((wr, posted))

    def _sign(self, wr: SendWR, signaled: bool) -> None:
        """Ask for a completion or not.  Unsignaled work requests hold their send-queue entries until a
        later signaled one completes; at most UNSIGNALED_MAX go in a row, so the queue always drains."""
        if signaled or not self.dev.unsignaled or self._unsig >= UNSIGNALED_MAX - 1:
            wr.send_flags = wr.send_flags | E.IBV_SEND_SIGNALED
            if self._unsig:
                self._carry[wr.wr_id] = self._unsig
            self._unsig = 0
        else:
            wr.send_flags = wr.send_flags & ~E.IBV_SEND_SIGNALED
            self._unsig += 1

    def _post_send(self, wr: SendWR, what: str, signaled: bool) -> None:
        """Post ``wr``, after any binds waiting in the chain, in one ``post_send`` (one doorbell)."""
        first = wr
        chain = self._chain
        if chain:
            self._chain = []
            wrs = [c[0] for c in chain]
            for w in wrs:
                self._sign(w, False)
            for a, b in zip(wrs, wrs[1:] + [wr]):
                a.next_wr = b
            first = wrs[0]
        self._sign(wr, signaled)
        try:
            self.qp.post_send(first)
        except PyverbsError as e:
            raise self._post_failed(wr, what, str(e)) from None
        for _, posted in chain:
            posted()

    def _post_failed(self, wr: SendWR, what: str, why: str) -> ConnectionClosed:
        """``wr`` was not posted: its op and send-queue entry go back, the connection goes down; the error
        to raise."""
        self._ops.pop(wr.wr_id, None)
        self._sq.release()
        self._shutdown(f"post_send failed: {why}")
        return ConnectionClosed(f"{what} to {self.peer}: {why}")

    async def _post_send_unlocked(self, wr: SendWR, what: str, signaled: bool) -> None:
        """``_post_send`` for a large one-sided op (nothing chained ahead of it), from a worker thread
        without the GIL: the event loop and the node's other requests go on while rxe moves the bytes.
        Returns once it is posted (RC keeps it ahead of anything posted after that)."""
        self._sign(wr, signaled)
        self.thread_posts += 1
        with trio.CancelScope(shield=True):     # taken entries and bookkeeping: it must be posted now
            rc = await self.dev.posters.run_sync(self._raw.post, wr)
        if rc:
            raise self._post_failed(wr, what, os.strerror(rc))

    async def _post(self, wr: SendWR, what: str, wait: bool = True, signaled: bool = True, then=None,
                    nbytes: int = 0, seal=None) -> None:
        """Post ``wr`` once the send queue has room; ``seal()`` (a session's MAC for a SEND) runs after that
        wait and before the post, with no checkpoint between: MACs are taken in the order messages leave."""
        if self._closed:
            raise ConnectionClosed(f"connection to {self.peer} is closed: {self._closed}")
        try:
            self._sq.acquire_nowait()      # the common case: room in the send queue, no checkpoint
        except trio.WouldBlock:
            await self._sq.acquire()
            if self._closed:             # it died while we waited for room in the send queue
                self._sq.release()
                raise ConnectionClosed(f"connection to {self.peer} is closed: {self._closed}")
        if seal is not None:
            seal()
        self._ids += 1
        wr_id = self._ids
        wr.wr_id = wr_id
        if wait:
            signaled = True
        op = None
        if wait or then is not None:     # only what someone waits for is tracked (unsignaled: no completion)
            op = self._ops[wr_id] = _Op(then)
        if self._raw is not None and 0 < self.dev.post_thread_min <= nbytes and not self._chain:
            await self._post_send_unlocked(wr, what, signaled)
        else:
            self._post_send(wr, what, signaled)
        if not wait:
            return
        try:
            await op.event.wait()
        except trio.Cancelled:
            # The NIC may still touch the buffer: kill the QP and wait (bounded) for the flush before the
            # caller frees it.
            self._shutdown(f"{what} cancelled")
            with trio.CancelScope(shield=True), trio.move_on_after(5):
                await op.event.wait()
            raise
        if op.status != E.IBV_WC_SUCCESS:
            status = _wc_name(op.status)
            if op.status in (E.IBV_WC_REM_ACCESS_ERR, E.IBV_WC_REM_INV_REQ_ERR, E.IBV_WC_LOC_PROT_ERR):
                raise RemoteAccessError(f"{what} refused by {self.peer}: {status} (connection reset)")
            raise ConnectionClosed(f"{what} to {self.peer} failed: {status} ({self._closed})")

    def _complete(self, wc) -> None:
        if wc.wr_id & RECV_TAG:
            if wc.status != E.IBV_WC_SUCCESS:
                if not self._closed:
                    self._shutdown(f"receive failed: {_wc_name(wc.status)}")
                return
            slot = wc.wr_id & ~RECV_TAG
            msg = bytes(self.ctrl_view[slot * self.slot: slot * self.slot + wc.byte_len])
            try:
                self._post_recv(slot)
            except PyverbsError as e:
                self._shutdown(f"repost failed: {e}")
                return
            try:
                if self.session is not None:        # the session's MAC is the message's last bytes
                    landed = self._land(msg[:-TAG_SIZE], msg[-TAG_SIZE:])
                else:
                    landed = self._land(msg)
            except trio.ClosedResourceError:
                landed = False
            except TransportError as e:          # failed the session's MAC (``misbehaved`` says why)
                log.warning("connection from %s: %s", self.peer, e)
                self._shutdown(str(e))
                return
            if not landed:
                self.misbehaved = "more control messages than slots"
                self._shutdown("peer sent more control messages than we have slots")
            return
        op = self._ops.pop(wc.wr_id, None)
        for _ in range(1 + self._carry.pop(wc.wr_id, 0)):     # its entry, and the unsignaled ones before it
            self._sq.release()
        if wc.status != E.IBV_WC_SUCCESS and not self._closed:
            self._shutdown(f"{_wc_name(wc.status)}")
        if op is not None:
            op.status = wc.status
            op.event.set()
            if op.then is not None:
                op.then(wc.status == E.IBV_WC_SUCCESS)

    def _drain_cq(self) -> int:
        got = 0
        while True:
            n, wcs = self.cq.poll(32)
            if n <= 0:
                return got
            got += n
            for wc in wcs[:n]:
                self._complete(wc)

    async def _pump(self) -> None:
        """Completions to trio.  Asleep, it waits for the completion channel's fd (no CPU while idle);
        woken, with ``spin_s`` > 0 (default 0: off), it busy-polls the CQ -- yielding to our other tasks
        between polls -- for as long as completions keep coming and then ``spin_s`` more (as ib_read_bw polls,
        bounded), so a stream of completions costs one CQ poll each instead of a wakeup, an event read, an ack and a re-arm (system
        calls: slow in a VM); then it re-arms the CQ, polls once more (what landed before the arming) and
        sleeps again."""
        clock = time.monotonic
        while True:
            await trio.lowlevel.wait_readable(self.fd)
            try:
                self.cc.get_cq_event(self.cq)
            except PyverbsRDMAError as e:
                if e.error_code in (errno.EAGAIN, errno.EWOULDBLOCK):
                    continue
                raise
            self.cq.ack_events(1)
            spin = self.dev.spin_s
            if spin > 0:
                last = clock()
                while True:
                    if self._drain_cq():
                        last = clock()
                    elif clock() - last >= spin:
                        break
                    await trio.lowlevel.checkpoint()
                    self.spins += 1
            self.cq.req_notify()
            self._drain_cq()

    async def _watch_stream(self) -> None:
        """The TCP stream carries nothing after setup; EOF means the peer is gone."""
        buf = bytearray(1)
        try:
            n = await self._sock.recv_into(buf)
        except (OSError, trio.ClosedResourceError) as e:
            n = 0
            log.debug("stream to %s: %s", self.peer, e)
        if n == 0:
            self._shutdown("peer closed the connection")

    def _shutdown(self, why: str) -> None:
        if self._closed:
            return
        self._closed = why
        log.debug("verbs connection to %s down: %s", self.peer, why)
        if not self._destroyed:
            try:
                self.qp.modify(QPAttr(qp_state=E.IBV_QPS_ERR), E.IBV_QP_STATE)   # flushes every WR
            except PyverbsError:
                pass
        self._ctrl_in.close()
        if self._owns_sock:
            try:
                self._sock.close()
            except OSError:
                pass

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        try:
            async with trio.open_nursery() as n:
                n.start_soon(self._pump)
                task_status.started()
                await self._watch_stream()
                # give the flush completions a moment to arrive, then stop the pump
                with trio.move_on_after(2):
                    while self._ops:
                        await trio.sleep(0.01)
                n.cancel_scope.cancel()
        finally:
            self._shutdown("connection ended")
            self._fail_all()
            self._destroy()

    def _fail_all(self) -> None:
        ops = [op for op in self._ops.values() if op is not None]
        self._ops.clear()
        for op in ops:
            op.status = E.IBV_WC_WR_FLUSH_ERR
            op.event.set()
            if op.then is not None:          # e.g. an eager send buffer: a sender waiting for one goes on
                op.then(False)

    def _destroy(self) -> None:
        """Release the QP, control MR, CQ and channel, in that order (once; the pump is stopped)."""
        if self._destroyed:
            return
        self._destroyed = True
        if self._raw is not None:
            self._raw.close()           # a worker thread's post under way ends before the QP goes
        self.grants.close()             # windows first: they are bound to the QP and hold the MRs
        eager_mr = self._eager[1] if self._eager is not None else None
        for res in (self.qp, self.ctrl_mr, eager_mr, self.cq, self.cc):
            if res is None:
                continue
            try:
                res.close()
            except PyverbsError as e:
                log.debug("closing %s: %s", type(res).__name__, e)
        if self.ctrl_view is not None:
            self.ctrl_view.release()
        if self.ctrl is not None:
            self.ctrl.close()
        if self._eager is not None:
            self._eager_view.release()
            self._eager_mmap.close()

    def info(self) -> dict:
        return {**super().info(), "device": self.dev.name, "qpn": self.qpn,
                "path_mtu": _MTU_BYTES.get(self.path_mtu, self.path_mtu), "windows": self.dev.windows_state,
                "window_binds": self.grants.binds, "windows_allocated": len(self.grants._all),
                "rd_atomic": self.dev.rd_atomic, "spin_us": round(self.dev.spin_s * 1e6),
                "cq_spins": self.spins, "unsignaled": self.dev.unsignaled, "max_inline": self.max_inline,
                "slot_bytes": self.slot, "eager_sends": self.eager_sends,
                "post_thread_min": self.dev.post_thread_min if self._raw is not None else 0,
                "thread_posts": self.thread_posts}


_MTU_BYTES = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}


def _wc_name(status) -> str:
    try:
        return E.ibv_wc_status(status).name
    except ValueError:
        return f"wc status {status}"


def _gid_bytes(gid: str) -> bytes:
    return bytes.fromhex(gid.replace(":", ""))


def _gid_str(raw: bytes) -> str:
    h = raw.hex()
    return ":".join(h[i:i + 4] for i in range(0, 32, 4))


async def establish(sock, domain: Domain, peer: str, *, is_server: bool, peer_slots: int,
                    our_slots: int, peer_slot_size: int = SLOT, our_slot_size: int = SLOT) -> VerbsConnection:
    """Create our QP, swap endpoints with the peer on ``sock``, bring the QP to RTS, confirm both ends are
    ready.  On any failure both ends learn it and raise SetupFailed (the caller stays on TCP)."""
    conn = None
    try:
        conn = VerbsConnection(sock, domain, peer, peer_slots, our_slots, peer_slot_size, our_slot_size)
        mine = READY + conn.endpoint().encode()
    except Exception as e:  # noqa: BLE001 - report and fall back
        log.warning("cannot create a queue pair for %s: %s", peer, e)
        mine = FAILED + bytes(VerbsEndpoint.SIZE)
    try:
        return await _agree(sock, conn, mine, peer)
    except BaseException:
        # timeout, cancellation, peer gone, or SetupFailed: the queue pair must not outlive this
        if conn is not None and not conn._owns_sock:
            conn._shutdown("setup failed")
            conn._destroy()
        raise


async def _agree(sock, conn: VerbsConnection | None, mine: bytes, peer: str) -> VerbsConnection:
    await send_all(sock, mine)
    theirs = bytearray(1 + VerbsEndpoint.SIZE)
    await recv_exactly(sock, memoryview(theirs))
    ok = mine[:1] == READY and theirs[:1] == READY
    if ok:
        try:
            conn.bring_up(VerbsEndpoint.decode(bytes(theirs[1:])))
        except Exception as e:  # noqa: BLE001
            log.warning("bringing up the queue pair with %s failed: %s", peer, e)
            ok = False
    # second round: both QPs are in RTS with receives posted (or one end failed)
    await send_all(sock, READY if ok else FAILED)
    other = bytearray(1)
    await recv_exactly(sock, memoryview(other))
    if ok and other == READY:
        conn._owns_sock = True
        return conn
    raise SetupFailed("queue pair setup did not complete on both ends")
