#!/usr/bin/env python3
"""pyverbs spike: facts the verbs transport needs, checked against a real kernel provider (rdma_rxe).

Run inside the Soft-RoCE VM:

    lab/softroce-vm run -- python lab/verbs_probe.py [--seconds 5] [--qd 8] [--ib-iters 1000]

One process, trio, two "peers" (each with its own Context/PD/CompChannel/CQ/QP, connected RC over rxe0,
GID index 1, RoCE v2).  Demonstrates:
  a) registering an existing anonymous-mmap arena (address via cffi) as an MR;
  b) RDMA READ peer arena -> local arena, checked through memoryviews (no MR.read());
  c) RDMA WRITE into a REMOTE_WRITE MR works; into an MR without REMOTE_WRITE gives a remote access error,
     and what that does to both QPs; then how to recover the QP pair (RESET -> INIT -> RTR -> RTS);
  d) SEND/RECV with pre-posted RECVs in a registered control region (incl. an INLINE send);
  e) completions through a CompChannel fd awaited with trio.lowlevel.wait_readable (no spinning thread);
  f) the INIT/RTR/RTS attribute recipe (printed);
and measures RDMA READ throughput (1 MiB, queue depth --qd) vs `ib_read_bw` in the same VM run.
Exit status 0 when every check passed.
"""
from __future__ import annotations

import errno
import mmap
import os
import random
import shutil
import subprocess
import sys
import time
import types

import cffi
import click
import trio

import pyverbs.enums as e
from pyverbs.addr import AHAttr, GID, GlobalRoute
from pyverbs.cq import CQ, CompChannel
from pyverbs.device import Context
from pyverbs.mr import MR
from pyverbs.pd import PD
from pyverbs.pyverbs_error import PyverbsRDMAError
from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
from pyverbs.wr import RecvWR, SendWR, SGE

ffi = cffi.FFI()
DEV = os.environ.get("DATANODE_RDMA_DEVICE", "rxe0")
GID_INDEX = int(os.environ.get("DATANODE_RDMA_GID_INDEX", "1"))
PORT = 1
MiB = 1 << 20
CTRL_SLOT = 4096
N_RECV = 16

FAILED: list[str] = []


def check(cond: bool, what: str) -> None:
    print(f"  [{'ok' if cond else 'FAIL'}] {what}")
    if not cond:
        FAILED.append(what)


def wc_status(s: int) -> str:
    return e.ibv_wc_status(s).name


def wc_opcode(o: int) -> str:
    try:
        return e.ibv_wc_opcode(o).name
    except ValueError:
        return str(o)


def qp_state(qp: QP) -> str:
    attr, _ = qp.query(e.IBV_QP_STATE)
    return e.ibv_qp_state(attr.qp_state).name


def addr_of(buf) -> tuple[int, object]:
    """Address of a writable buffer (mmap/bytearray) via cffi; keep the returned cdata alive while the
    address is in use (it pins the buffer export: mmap.close() raises BufferError until ffi.release())."""
    p = ffi.from_buffer(buf)
    return int(ffi.cast("uintptr_t", p)), p


def _fd_links() -> dict[int, str]:
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[int(fd)] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:        # the fd listdir itself used, already closed
            pass
    return out


def new_comp_channel(ctx: Context) -> tuple[CompChannel, int]:
    """pyverbs 44 does not expose ibv_comp_channel.fd; find it as the new fd CompChannel() opened
    (anon_inode:[infinibandevent]). Compare (fd, target) pairs: listdir's own fd number gets reused."""
    before = _fd_links()
    cc = CompChannel(ctx)
    after = _fd_links()
    new = [fd for fd, tgt in after.items() if before.get(fd) != tgt and "infinibandevent" in tgt]
    if len(new) != 1:
        raise RuntimeError(f"cannot identify the comp channel fd (candidates {new})")
    return cc, new[0]


class CQPump:
    """Completion delivery: CompChannel fd (non-blocking) awaited by trio; get_cq_event -> ack -> re-arm
    -> poll until empty. Completions are handed to waiters by wr_id."""

    def __init__(self, ctx: Context, cqe: int, name: str):
        self.name = name
        self.cc, self.fd = new_comp_channel(ctx)
        os.set_blocking(self.fd, False)
        self.cq = CQ(ctx, cqe, None, self.cc, 0)
        self.cq.req_notify()           # arm before anything is posted
        self.done: dict[int, object] = {}
        self.waiters: dict[int, trio.Event] = {}
        self.events = 0
        self.spurious = 0
        self.polled = 0
        self.unacked = 0

    def _drain(self) -> None:
        while True:
            n, wcs = self.cq.poll(32)
            if n <= 0:
                return
            self.polled += n
            for wc in wcs[:n]:
                self.done[wc.wr_id] = wc
                ev = self.waiters.pop(wc.wr_id, None)
                if ev is not None:
                    ev.set()

    async def run(self) -> None:
        while True:
            await trio.lowlevel.wait_readable(self.fd)
            try:
                self.cc.get_cq_event(self.cq)   # non-blocking fd: raises (EAGAIN) if nothing is there
            except PyverbsRDMAError as ex:
                if ex.error_code in (errno.EAGAIN, errno.EWOULDBLOCK):
                    self.spurious += 1
                    continue
                raise
            self.events += 1
            self.cq.ack_events(1)               # may be batched; all events must be acked before CQ close
            self.cq.req_notify()                # re-arm BEFORE draining, so nothing is missed
            self._drain()

    async def wait(self, wr_id: int, timeout: float = 20.0):
        if wr_id not in self.done:
            ev = self.waiters.setdefault(wr_id, trio.Event())
            with trio.fail_after(timeout):
                await ev.wait()
        return self.done.pop(wr_id)


class Peer:
    def __init__(self, name: str, arena_size: int, max_wr: int = 64):
        self.name = name
        self.ctx = Context(name=DEV)
        self.dattr = self.ctx.query_device()
        self.pattr = self.ctx.query_port(PORT)
        self.pd = PD(self.ctx)
        self.pump = CQPump(self.ctx, 4 * max_wr, name)
        # data arena: an existing anonymous mmap registered in place (zero copy)
        self.arena = mmap.mmap(-1, arena_size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.arena_addr, self._arena_cdata = addr_of(self.arena)
        self.view = memoryview(self.arena)
        self.mr_ro = MR(self.pd, arena_size, e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ,
                        address=self.arena_addr)
        # second registration of the upper half with REMOTE_WRITE (same pages may be registered twice)
        half = arena_size // 2
        self.rw_addr = self.arena_addr + half
        self.rw_len = half
        self.mr_rw = MR(self.pd, half, e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE
                        | e.IBV_ACCESS_REMOTE_READ, address=self.rw_addr)
        # control region: N_RECV receive slots + N send slots
        self.ctrl = mmap.mmap(-1, 2 * N_RECV * CTRL_SLOT)
        self.ctrl_addr, self._ctrl_cdata = addr_of(self.ctrl)
        self.ctrl_mr = MR(self.pd, len(self.ctrl), e.IBV_ACCESS_LOCAL_WRITE, address=self.ctrl_addr)
        cap = QPCap(max_send_wr=max_wr, max_recv_wr=max_wr, max_send_sge=1, max_recv_sge=1,
                    max_inline_data=64)
        self.init_attr = QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.pump.cq, rcq=self.pump.cq, cap=cap,
                                    sq_sig_all=0)
        self.qp = QP(self.pd, self.init_attr)        # created in RESET
        self.psn = random.getrandbits(24)
        self.gid = self.ctx.query_gid(PORT, GID_INDEX)
        self.next_id = 1
        self.recv_slot: dict[int, int] = {}

    def wr_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def conn_info(self) -> dict:
        """What peers exchange out of band (over TCP in the real transport)."""
        return {"qpn": self.qp.qp_num, "psn": self.psn, "gid": self.gid.gid, "port": PORT,
                "mtu": int(self.pattr.active_mtu),
                "arena_addr": self.arena_addr, "arena_rkey": self.mr_ro.rkey, "arena_len": len(self.arena),
                "rw_addr": self.rw_addr, "rw_rkey": self.mr_rw.rkey, "rw_len": self.rw_len}

    def connect(self, remote: dict, verbose: bool = False) -> None:
        qp = self.qp
        rd_atom = min(16, self.dattr.max_qp_init_rd_atom, self.dattr.max_qp_rd_atom)
        # RESET -> INIT
        a = QPAttr(qp_state=e.IBV_QPS_INIT)
        a.pkey_index = 0
        a.port_num = PORT
        a.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE
        qp.modify(a, e.IBV_QP_STATE | e.IBV_QP_PKEY_INDEX | e.IBV_QP_PORT | e.IBV_QP_ACCESS_FLAGS)
        # INIT -> RTR
        a = QPAttr(qp_state=e.IBV_QPS_RTR)
        a.path_mtu = min(int(self.pattr.active_mtu), remote["mtu"])
        a.dest_qp_num = remote["qpn"]
        a.rq_psn = remote["psn"]
        a.max_dest_rd_atomic = rd_atom
        a.min_rnr_timer = 12          # 0.64 ms
        gr = GlobalRoute(dgid=GID(remote["gid"]), sgid_index=GID_INDEX, hop_limit=64)
        a.ah_attr = AHAttr(port_num=PORT, is_global=1, gr=gr, dlid=0, sl=0)
        qp.modify(a, e.IBV_QP_STATE | e.IBV_QP_AV | e.IBV_QP_PATH_MTU | e.IBV_QP_DEST_QPN | e.IBV_QP_RQ_PSN
                  | e.IBV_QP_MAX_DEST_RD_ATOMIC | e.IBV_QP_MIN_RNR_TIMER)
        # RTR -> RTS
        a = QPAttr(qp_state=e.IBV_QPS_RTS)
        a.sq_psn = self.psn
        a.timeout = 14                # 4.096us * 2^14 = 67 ms local ACK timeout
        a.retry_cnt = 7
        a.rnr_retry = 7               # 7 = infinite RNR retries
        a.max_rd_atomic = rd_atom
        qp.modify(a, e.IBV_QP_STATE | e.IBV_QP_SQ_PSN | e.IBV_QP_TIMEOUT | e.IBV_QP_RETRY_CNT
                  | e.IBV_QP_RNR_RETRY | e.IBV_QP_MAX_QP_RD_ATOMIC)
        if verbose:
            q, _ = qp.query(e.IBV_QP_STATE | e.IBV_QP_PATH_MTU | e.IBV_QP_MAX_QP_RD_ATOMIC
                            | e.IBV_QP_MAX_DEST_RD_ATOMIC | e.IBV_QP_TIMEOUT | e.IBV_QP_DEST_QPN)
            print(f"  {self.name}: qpn={qp.qp_num} -> dest {q.dest_qp_num} state={e.ibv_qp_state(q.qp_state).name}"
                  f" mtu={e.ibv_mtu(q.path_mtu).name} max_rd_atomic={q.max_rd_atomic}"
                  f" max_dest_rd_atomic={q.max_dest_rd_atomic} timeout={q.timeout}")

    def reset(self) -> None:
        a = QPAttr(qp_state=e.IBV_QPS_RESET)
        self.qp.modify(a, e.IBV_QP_STATE)
        self.psn = random.getrandbits(24)

    # ---- work requests
    def post_recvs(self, n: int) -> list[int]:
        ids = []
        for i in range(n):
            wid = self.wr_id()
            sge = SGE(self.ctrl_addr + i * CTRL_SLOT, CTRL_SLOT, self.ctrl_mr.lkey)
            self.qp.post_recv(RecvWR(wr_id=wid, num_sge=1, sg=[sge]))
            self.recv_slot[wid] = i
            ids.append(wid)
        return ids

    def post_send(self, payload: bytes, slot: int = 0, inline: bool = False) -> int:
        off = (N_RECV + slot) * CTRL_SLOT
        self.ctrl[off:off + len(payload)] = payload
        wid = self.wr_id()
        flags = e.IBV_SEND_SIGNALED | (e.IBV_SEND_INLINE if inline else 0)
        wr = SendWR(wr_id=wid, opcode=e.IBV_WR_SEND, num_sge=1,
                    sg=[SGE(self.ctrl_addr + off, len(payload), self.ctrl_mr.lkey)], send_flags=flags)
        self.qp.post_send(wr)
        return wid

    def post_rdma(self, opcode, local_addr: int, length: int, raddr: int, rkey: int) -> int:
        wid = self.wr_id()
        # mr_ro covers the whole arena with LOCAL_WRITE: fine as the local side of READs and WRITEs
        wr = SendWR(wr_id=wid, opcode=opcode, num_sge=1, sg=[SGE(local_addr, length, self.mr_ro.lkey)],
                    send_flags=e.IBV_SEND_SIGNALED)
        wr.set_wr_rdma(rkey, raddr)
        self.qp.post_send(wr)
        return wid


def describe_device(p: Peer) -> None:
    d, pa = p.dattr, p.pattr
    print(f"device {DEV}: vendor_id={d.vendor_id:#x} max_qp_wr={d.max_qp_wr} max_sge={d.max_sge} "
          f"max_cqe={d.max_cqe} max_mr_size={d.max_mr_size} max_qp_rd_atom={d.max_qp_rd_atom} "
          f"max_qp_init_rd_atom={d.max_qp_init_rd_atom} page_size_cap={d.page_size_cap:#x}")
    print(f"port {PORT}: state={e.ibv_port_state(pa.state).name} active_mtu={e.ibv_mtu(pa.active_mtu).name} "
          f"max_mtu={e.ibv_mtu(pa.max_mtu).name} link_layer={pa.link_layer} gid_tbl_len={pa.gid_tbl_len} "
          f"max_msg_sz={pa.max_msg_sz}")
    for i in range(min(pa.gid_tbl_len, 4)):
        try:
            g = p.ctx.query_gid(PORT, i)
            t = p.ctx.query_gid_type(PORT, i)
            print(f"  gid[{i}] = {g.gid} type={t!r}")
        except PyverbsRDMAError as ex:
            print(f"  gid[{i}]: {ex.error_code}")
    print(f"comp channel fd = {p.pump.fd} -> {os.readlink(f'/proc/self/fd/{p.pump.fd}')}")


async def demo(args) -> None:
    a = Peer("A", args.arena_mib * MiB)
    b = Peer("B", args.arena_mib * MiB)
    describe_device(a)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(a.pump.run)
        nursery.start_soon(b.pump.run)

        print("\n(f) connect RC QPs: RESET->INIT->RTR->RTS")
        print(f"  A conn_info: {a.conn_info()}")
        ai, bi = a.conn_info(), b.conn_info()
        # RECVs may be posted in INIT or later; RTR is when they can match
        a.connect(bi, verbose=True)
        b.connect(ai, verbose=True)
        check(qp_state(a.qp) == "IBV_QPS_RTS" and qp_state(b.qp) == "IBV_QPS_RTS", "both QPs in RTS")

        print("\n(d) SEND/RECV with pre-posted RECVs in a registered control region")
        b_recvs = b.post_recvs(N_RECV)
        a_recvs = a.post_recvs(N_RECV)
        msg = b"hello from A " + bytes(range(200))
        sid = a.post_send(msg)
        wc = await a.pump.wait(sid)
        check(wc.status == e.IBV_WC_SUCCESS and wc.opcode == e.IBV_WC_SEND, f"A send wc {wc_status(wc.status)} {wc_opcode(wc.opcode)}")
        rwc = await b.pump.wait(b_recvs[0])
        slot = b.recv_slot[rwc.wr_id]
        got = bytes(b.ctrl[slot * CTRL_SLOT: slot * CTRL_SLOT + rwc.byte_len])
        check(rwc.status == e.IBV_WC_SUCCESS and rwc.opcode == e.IBV_WC_RECV and got == msg,
              f"B recv wc {wc_status(rwc.status)} {wc_opcode(rwc.opcode)} byte_len={rwc.byte_len} qp_num={rwc.qp_num} payload matches")
        sid = b.post_send(b"inline reply", inline=True)
        wc = await b.pump.wait(sid)
        rwc = await a.pump.wait(a_recvs[0])
        slot = a.recv_slot[rwc.wr_id]
        check(wc.status == e.IBV_WC_SUCCESS and rwc.byte_len == 12
              and bytes(a.ctrl[slot * CTRL_SLOT: slot * CTRL_SLOT + 12]) == b"inline reply",
              "IBV_SEND_INLINE send works (max_inline_data=64)")

        try:
            sub = MR(a.pd, 8192, e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ, address=a.arena_addr + 100)
            print(f"  note: MR on a non-page-aligned sub-range (arena+100, 8 KiB) works: lkey={sub.lkey} rkey={sub.rkey}")
            sub.close()
        except PyverbsRDMAError as ex:
            print(f"  note: MR on a non-page-aligned sub-range fails: {ex}")
        print("\n(a)+(b) RDMA READ from A's arena (MR LOCAL_WRITE|REMOTE_READ on an existing mmap) into B's arena")
        n = 4 * MiB
        pattern = os.urandom(n)
        a.view[:n] = pattern
        b.view[:n] = bytes(n)
        rid = b.post_rdma(e.IBV_WR_RDMA_READ, b.arena_addr, n, ai["arena_addr"], ai["arena_rkey"])
        wc = await b.pump.wait(rid)
        check(wc.status == e.IBV_WC_SUCCESS and wc.opcode == e.IBV_WC_RDMA_READ and wc.byte_len == n,
              f"READ wc {wc_status(wc.status)} {wc_opcode(wc.opcode)} byte_len={wc.byte_len}")
        check(b.view[:n] == a.view[:n], "B arena == A arena (memoryview compare over the mmaps, no MR.read())")

        print("\n(c) RDMA WRITE into the REMOTE_WRITE MR, then into the MR without REMOTE_WRITE")
        n = 1 * MiB
        b.view[:n] = os.urandom(n)
        wid = b.post_rdma(e.IBV_WR_RDMA_WRITE, b.arena_addr, n, ai["rw_addr"], ai["rw_rkey"])
        wc = await b.pump.wait(wid)
        off = a.rw_addr - a.arena_addr
        check(wc.status == e.IBV_WC_SUCCESS and wc.opcode == e.IBV_WC_RDMA_WRITE and a.view[off:off + n] == b.view[:n],
              f"WRITE (REMOTE_WRITE MR) wc {wc_status(wc.status)} {wc_opcode(wc.opcode)}; bytes landed in A's arena")
        wid = b.post_rdma(e.IBV_WR_RDMA_WRITE, b.arena_addr, 4096, ai["arena_addr"], ai["arena_rkey"])
        wc = await b.pump.wait(wid)
        check(wc.status == e.IBV_WC_REM_ACCESS_ERR,
              f"WRITE into MR without REMOTE_WRITE -> wc status {wc_status(wc.status)} ({wc.status}) "
              f"vendor_err={wc.vendor_err} opcode={wc.opcode}")
        await trio.sleep(0.3)
        sa, sb = qp_state(a.qp), qp_state(b.qp)
        print(f"  after the error: requester B qp_state={sb}, responder A qp_state={sa}")
        # the flushed WRs: B's pre-posted RECVs (and A's if A went to ERR) complete with WR_FLUSH_ERR
        await trio.sleep(0.2)
        fl_b = [w for w in list(b.pump.done.values()) if w.status == e.IBV_WC_WR_FLUSH_ERR]
        fl_a = [w for w in list(a.pump.done.values()) if w.status == e.IBV_WC_WR_FLUSH_ERR]
        print(f"  flushed completions (status IBV_WC_WR_FLUSH_ERR, opcode/byte_len undefined): B {len(fl_b)}, A {len(fl_a)}"
              f" (the pre-posted RECVs); flushed wr_ids are reported, so slots can be reclaimed by wr_id")
        try:
            b.post_send(b"after error")
            await trio.sleep(0.2)
            fl = [w for w in b.pump.done.values() if w.status == e.IBV_WC_WR_FLUSH_ERR and w.byte_len == 0]
            print(f"  post_send on an ERR QP: accepted, completes with WR_FLUSH_ERR ({len(fl)} flush wcs total)")
        except PyverbsRDMAError as ex:
            print(f"  post_send on an ERR QP raised: {ex}")
        a.pump.done.clear()
        b.pump.done.clear()

        print("\n    recovery: both QPs -> RESET, new PSNs, INIT/RTR/RTS again, repost RECVs")
        a.reset()
        b.reset()
        ai, bi = a.conn_info(), b.conn_info()
        a.connect(bi)
        b.connect(ai)
        b_recvs = b.post_recvs(4)
        sid = a.post_send(b"again")
        wc = await a.pump.wait(sid)
        rwc = await b.pump.wait(b_recvs[0])
        check(wc.status == e.IBV_WC_SUCCESS and rwc.status == e.IBV_WC_SUCCESS, "QP pair usable again after RESET+reconnect")

        print(f"\n(e) completion channel stats: A events={a.pump.events} spurious={a.pump.spurious} polled={a.pump.polled};"
              f" B events={b.pump.events} spurious={b.pump.spurious} polled={b.pump.polled}")

        print(f"\nthroughput: pyverbs RDMA READ, {args.size // 1024} KiB, queue depth {args.qd}, {args.seconds}s")
        size = args.size
        slots = max(1, (len(b.arena) // 2) // size)
        src_slots = max(1, (len(a.arena) // 2) // size)
        inflight: dict[int, int] = {}
        done = 0
        t0 = time.perf_counter()
        k = 0

        def post_one():
            nonlocal k
            i = k % slots
            wid = b.post_rdma(e.IBV_WR_RDMA_READ, b.arena_addr + i * size, size,
                              ai["arena_addr"] + (k % src_slots) * size, ai["arena_rkey"])
            inflight[wid] = i
            k += 1

        ev0 = b.pump.events
        for _ in range(args.qd):
            post_one()
        deadline = t0 + args.seconds
        while inflight:
            wid = next(iter(inflight))
            wc = await b.pump.wait(wid, timeout=60)
            del inflight[wid]
            if wc.status != e.IBV_WC_SUCCESS:
                check(False, f"READ failed: {wc_status(wc.status)}")
                break
            done += 1
            if time.perf_counter() < deadline:
                post_one()
        dt = time.perf_counter() - t0
        mbps = done * size / dt / 1e6
        print(f"  pyverbs: {done} reads x {size} B in {dt:.2f}s = {mbps:.1f} MB/s ({done * size / dt / MiB:.1f} MiB/s),"
              f" {b.pump.events - ev0} cq events")
        RESULTS["pyverbs_read_MBps"] = mbps
        nursery.cancel_scope.cancel()
    # teardown order: QP, MRs, then CQ (all events acked already), comp channel, PD, context
    for p in (a, b):
        p.qp.close()
        for mr in (p.mr_ro, p.mr_rw, p.ctrl_mr):
            mr.close()
        p.pump.cq.close()
        p.pump.cc.close()
        p.pd.close()
        p.ctx.close()
        p.view.release()
        ffi.release(p._arena_cdata)
        ffi.release(p._ctrl_cdata)
        p.arena.close()
        p.ctrl.close()


RESULTS: dict[str, float] = {}


def run_ib_read_bw(args) -> None:
    exe = shutil.which("ib_read_bw")
    if not exe:
        print("ib_read_bw not found (apt: perftest)")
        return
    base = [exe, "-d", DEV, "-x", str(GID_INDEX), "-F", "-s", str(args.size)]
    if args.ib_iters:
        base += ["-n", str(args.ib_iters)]
    print(f"\nthroughput: {' '.join(base[1:])} (server + client 10.0.0.1, same VM)")
    srv = subprocess.Popen(base, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(1.0)
    t0 = time.perf_counter()
    cli = subprocess.run(base + [os.environ.get("DATANODE_RDMA_ADDR", "10.0.0.1")], capture_output=True,
                         text=True, timeout=600)
    dt = time.perf_counter() - t0
    try:
        srv.wait(timeout=30)
    except subprocess.TimeoutExpired:
        srv.kill()
    lines = [ln for ln in cli.stdout.splitlines() if ln.strip()]
    for ln in lines[-4:]:
        print("  " + ln)
    # last line: #bytes #iterations BW peak[MB/sec] BW average[MB/sec] MsgRate[Mpps]
    try:
        avg = float(lines[-2].split()[3]) if lines[-1].startswith("---") else float(lines[-1].split()[3])
        RESULTS["ib_read_bw_MBps"] = avg
        print(f"  ib_read_bw average {avg:.1f} MB/sec (perftest 'MB' = 2^20 B), client wall {dt:.1f}s, rc={cli.returncode}")
    except (IndexError, ValueError):
        print(f"  could not parse ib_read_bw output (rc={cli.returncode}): {cli.stdout[-500:]} {cli.stderr[-500:]}")


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--seconds", type=float, default=5.0, show_default=True, help="pyverbs READ throughput run length")
@click.option("--qd", type=int, default=8, show_default=True, help="outstanding RDMA READs")
@click.option("--size", type=int, default=MiB, show_default=True, help="bytes per READ")
@click.option("--arena-mib", type=int, default=32, show_default=True)
@click.option("--ib-iters", type=int, default=0, show_default=True, help="ib_read_bw -n (0: its default, 1000)")
@click.option("--no-ib", is_flag=True, help="skip ib_read_bw")
def main(**opts) -> None:
    """Probe pyverbs on the Soft-RoCE device: the checks, READ throughput, and ib_read_bw beside it."""
    sys.exit(probe(types.SimpleNamespace(**opts)))


def probe(args) -> int:
    if not os.path.exists(f"/sys/class/infiniband/{DEV}"):
        print(f"no RDMA device {DEV}: run inside the VM (lab/softroce-vm run -- python lab/verbs_probe.py)")
        return 2
    t0 = time.perf_counter()
    trio.run(demo, args)
    if not args.no_ib:
        run_ib_read_bw(args)
    if "ib_read_bw_MBps" in RESULTS and "pyverbs_read_MBps" in RESULTS:
        # perftest reports MB as 2^20 bytes
        ib = RESULTS["ib_read_bw_MBps"] * MiB / 1e6
        print(f"\nratio pyverbs/ib_read_bw = {RESULTS['pyverbs_read_MBps'] / ib:.2f}"
              f" (pyverbs {RESULTS['pyverbs_read_MBps']:.1f} MB/s vs ib_read_bw {ib:.1f} MB/s, decimal MB)")
    print(f"\nprobe done in {time.perf_counter() - t0:.1f}s; {len(FAILED)} check(s) failed")
    for f in FAILED:
        print("  FAILED: " + f)
    return 1 if FAILED else 0


if __name__ == "__main__":
    main()
