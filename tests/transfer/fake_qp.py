"""The queue-pair half of the verbs emulator (tests/transfer/fake_verbs.py): RC QPs with
their state machine and RTR/RTS checks, posting (chains of work requests), and each
device's thread that runs posted work requests and delivers their completions: one per
signalled or failed request, none for an unsignalled one that succeeds. Everything shares
fake_verbs' one lock."""

from __future__ import annotations

import collections
import ctypes
import errno
import os
import secrets
import threading
import time
from typing import Any

from tests.transfer import fake_verbs as fv

VENDOR_ERR = {
    fv.IBV_WC_RETRY_EXC_ERR: 0x81,
    fv.IBV_WC_REM_ACCESS_ERR: 0x88,
    fv.IBV_WC_LOC_PROT_ERR: 0x68,
    fv.IBV_WC_LOC_LEN_ERR: 0x69,
}


def _einval(what: str) -> fv.PyverbsRDMAError:
    return fv.PyverbsRDMAError(what, errno.EINVAL)


class QP:
    def __init__(self, pd: Any, init_attr: Any, qp_attr: Any = None):
        fv._maybe_fail("QP")
        if init_attr.qp_type != fv.IBV_QPT_RC:
            raise _einval("the emulator supports RC queue pairs only")
        cq, spec = init_attr.send_cq, pd.ctx.spec
        if cq is None or cq.ctx is not pd.ctx or cq.closed:
            raise _einval("Failed to create QP: its CQ belongs to another device")
        depth = init_attr.cap.max_send_wr
        if not 1 <= depth <= spec.max_qp_wr:
            raise _einval(f"Failed to create QP: max_send_wr {depth} > max_qp_wr {spec.max_qp_wr}")
        with fv._lock:
            if fv.live_qps(pd.ctx.name) >= spec.max_qp:
                raise fv.PyverbsRDMAError("Failed to create QP", errno.ENOMEM)
            self.qp_num = secrets.randbits(24) | 1
            while self.qp_num in fv._QPS:
                self.qp_num = secrets.randbits(24) | 1
            fv._QPS[self.qp_num] = self
        self.pd, self.cq, self.depth, self.qp_type = pd, cq, depth, fv.IBV_QPT_RC
        self.state, self.port, self.dest, self.destroyed = fv.IBV_QPS_RESET, 0, 0, False
        self.sq: collections.deque[Any] = collections.deque()  # posted, not yet executed
        self.outstanding = 0  # posted and not yet freed by a polled completion: slots in use
        self.sig_all = bool(init_attr.sq_sig_all)  # every WR signalled, whatever its flags
        self.num_unsignalled = 0  # executed unsignalled WRs since the last completion
        self.num_unacked_events = 0  # async events of this QP not yet ack()ed
        self.err_status: int | None = None  # the status of the WR that moved it to error
        self.rtr: dict[str, Any] = {}
        cq.qps.append(self)
        pd.children.append(self)
        self._sync()

    @property
    def qp_state(self) -> int:
        return self.state

    def info(self) -> dict[str, Any]:
        table = fv._gids(self.pd.ctx.name, self.port) if self.port else []
        mtu = self.pd.ctx.spec.ports[self.port].active_mtu if self.port else 0
        return {
            "state": self.state,
            "dest": self.dest,
            "pd": self.pd.id,
            "stype": self.rtr.get("stype"),
            "gids": table,
            "subnet": self.pd.ctx.spec.subnet,
            "mtu": mtu,
        }

    def _sync(self) -> None:
        fv._publish("qp", self.qp_num, self.info())

    def to_init(self, attr: Any) -> None:
        fv._maybe_fail("QP.to_init")
        with fv._lock:
            if self.state != fv.IBV_QPS_RESET:
                raise _einval(f"QP {self.qp_num}: to_init from state {self.state}")
            self.pd.ctx._port(attr.port_num)
            self.port, self.state = attr.port_num, fv.IBV_QPS_INIT
        self._sync()

    def to_rtr(self, attr: Any) -> None:
        fv._maybe_fail("QP.to_rtr")
        ctx = self.pd.ctx
        port = ctx.spec.ports[self.port] if self.port else None
        if self.state != fv.IBV_QPS_INIT or port is None:
            raise _einval(f"QP {self.qp_num}: to_rtr from state {self.state}")
        if port.state != fv.IBV_PORT_ACTIVE:
            raise _einval(f"to_rtr: port {self.port} of {ctx.name} is not ACTIVE")
        if not attr.dest_qp_num or not 0 <= attr.rq_psn < 1 << 24:
            raise _einval("to_rtr: dest_qp_num and a 24-bit rq_psn are required")
        if attr.path_mtu > port.active_mtu:
            raise _einval(f"to_rtr: path_mtu {attr.path_mtu} > port MTU {port.active_mtu}")
        if attr.max_dest_rd_atomic > ctx.spec.max_qp_rd_atom:
            raise _einval(
                f"to_rtr: max_dest_rd_atomic {attr.max_dest_rd_atomic} > device "
                f"max_qp_rd_atom {ctx.spec.max_qp_rd_atom}"
            )
        ah = attr.ah_attr
        if ah is None or ah.port_num != self.port:
            raise _einval("to_rtr: ah_attr with this QP's port_num is required")
        if port.link_layer == fv.IBV_LINK_LAYER_ETHERNET:
            self._check_route(ah, attr.path_mtu, attr.dest_qp_num)
        with fv._lock:
            self.dest, self.state = attr.dest_qp_num, fv.IBV_QPS_RTR
            self.rtr = {
                "hop_limit": ah.hop_limit,
                "traffic_class": ah.traffic_class,
                "sl": ah.sl,
                "mtu": attr.path_mtu,
                "sgid_index": ah.sgid_index,
                "stype": fv._gids(ctx.name, self.port)[ah.sgid_index][1],
            }
        self._sync()

    def _check_route(self, ah: Any, mtu: int, dest: int) -> None:
        """RoCE: the GRH must name a valid local GID of the remote's type, routable to it."""
        table = fv._gids(self.pd.ctx.name, self.port)
        if not ah.is_global or ah.dgid is None or str(ah.dgid) == fv.ZERO_GID:
            raise _einval("to_rtr: RoCE needs is_global=1 and a destination GID")
        if ah.sgid_index >= len(table):
            raise _einval(f"to_rtr: sgid_index {ah.sgid_index} is an empty GID entry")
        sgid, stype = table[ah.sgid_index]
        peer = _peer(dest)
        if peer is None:
            return  # the remote is unknown to the emulator: nothing to check against
        dgid = str(ah.dgid)
        if peer.get("stype") is not None and peer["stype"] != stype:
            raise _einval(
                f"to_rtr: GID type mismatch: {'RoCEv2' if stype else 'RoCEv1'} here, "
                f"{'RoCEv2' if peer['stype'] else 'RoCEv1'} at the remote QP"
            )
        if (dgid, stype) not in [tuple(g) for g in peer["gids"]]:
            raise _einval(
                f"to_rtr: destination GID {dgid} has no entry of the source GID's "
                f"type ({'RoCEv2' if stype else 'RoCEv1'})"
            )
        if peer["subnet"] != self.pd.ctx.spec.subnet and (
            stype != fv.IBV_GID_TYPE_SYSFS_ROCE_V2 or dgid.startswith("fe80") or ah.hop_limit <= 1
        ):
            raise _einval(
                f"to_rtr: {dgid} is behind a router: it needs an IPv4 RoCEv2 GID "
                f"and hop_limit > 1 (got {sgid}, hop_limit {ah.hop_limit})"
            )
        if mtu > peer["mtu"]:
            raise _einval(f"to_rtr: path_mtu {mtu} > the remote port's MTU {peer['mtu']}")

    def to_rts(self, attr: Any) -> None:
        fv._maybe_fail("QP.to_rts")
        spec = self.pd.ctx.spec
        if self.state != fv.IBV_QPS_RTR or not 0 <= attr.sq_psn < 1 << 24:
            raise _einval(f"QP {self.qp_num}: to_rts from state {self.state} or bad sq_psn")
        if attr.max_rd_atomic > spec.max_qp_init_rd_atom:
            raise _einval(
                f"to_rts: max_rd_atomic {attr.max_rd_atomic} > device "
                f"max_qp_init_rd_atom {spec.max_qp_init_rd_atom}"
            )
        with fv._lock:
            self.state = fv.IBV_QPS_RTS
        self._sync()

    def modify(self, attr: Any, comp_mask: int) -> None:
        if self.destroyed:
            fv._crash("modify of a destroyed QP")
        if not comp_mask & fv.IBV_QP_STATE or attr.qp_state != fv.IBV_QPS_ERR:
            raise _einval("the emulator's modify() only moves a QP to the error state")
        self._to_error()

    def _to_error(self, status: int | None = None) -> None:
        with fv._lock:
            if self.state == fv.IBV_QPS_ERR or self.destroyed:
                return
            self.state, self.err_status = fv.IBV_QPS_ERR, status
            if self.sq:
                self.pd.ctx.engine.kick(self)
        self._sync()

    def post_send(self, wr: Any, bad_wr: Any = None) -> None:
        """Post `wr` and the WRs its next_wr links to, in order; the first that finds no
        room fails the call (ENOMEM), the ones before it stay posted, and `bad_wr`, if
        given, receives a copy of it (as ibv_post_send and pyverbs do)."""
        with fv._lock:
            if self.destroyed:
                fv._crash(f"post_send on destroyed QP {self.qp_num}")
            fv._maybe_fail("QP.post_send")
            if self.state not in (fv.IBV_QPS_RTS, fv.IBV_QPS_ERR):
                raise _einval(f"post_send on QP {self.qp_num} in state {self.state}")
            for w in wr.chain():
                closed = [g.lkey for g in w.sg_list if g.lkey in fv._CLOSED_KEYS]
                if closed:  # NOTE: on hardware the key may belong to a new MR by now
                    fv._crash(f"post_send of wr_id {w.wr_id}: lkey {closed[0]} of a closed MR")
                if self.outstanding >= self.depth:
                    if bad_wr is not None:
                        w.copy_to(bad_wr)
                    raise fv.PyverbsRDMAError("Failed to post send", errno.ENOMEM)
                self.outstanding += 1
                fv.STATS["max_sq"] = max(fv.STATS["max_sq"], self.outstanding)
                fv.STATS["max_sq_depth"] = max(fv.STATS["max_sq_depth"], self.depth)
                self.sq.append(w)
                self.pd.ctx.engine.kick(self)

    def close(self) -> None:
        with fv._lock:
            if self.destroyed:
                return
            if self.num_unacked_events:  # NOTE: ibv_destroy_qp waits for the acks forever
                fv.CRASHES.append(f"destroy of QP {self.qp_num} with an unacked async event")
            self.destroyed = True
            fv.STATS["dropped"] += self.outstanding
            self.sq.clear()
            self.cq.wcs = collections.deque(w for w in self.cq.wcs if w.qp_num != self.qp_num)
            fv._QPS.pop(self.qp_num, None)
            if self in self.cq.qps:
                self.cq.qps.remove(self)
        fv._unlink("qp", self.qp_num)


def _peer(qp_num: int) -> dict[str, Any] | None:
    qp = fv._QPS.get(qp_num)
    return qp.info() if qp is not None else fv._lookup("qp", qp_num)


class _Engine:
    """A device's execution unit: runs posted work requests in order per QP, round-robin
    over QPs, and pushes their completions to the CQ, from its own thread."""

    def __init__(self, ctx: Any):
        self.ctx = ctx
        self.ready: collections.deque[QP] = collections.deque()
        self.cond = threading.Condition(fv._lock)
        self.stopped = False
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"fake-{ctx.name}")
        self.thread.start()

    def kick(self, qp: QP) -> None:  # under fv._lock
        if qp not in self.ready:
            self.ready.append(qp)
        self.cond.notify()

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify()
        if threading.current_thread() is not self.thread:
            self.thread.join(5)

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.ready and not self.stopped:
                    self.cond.wait()
                if self.stopped:
                    return
                qp = self.ready.popleft()
                if qp.destroyed or not qp.sq:
                    continue
                wr = qp.sq.popleft()
                if qp.sq:
                    self.ready.append(qp)
                status = None
                if qp.state == fv.IBV_QPS_ERR:
                    status, qp.err_status = qp.err_status or fv.IBV_WC_WR_FLUSH_ERR, None
            if status is None:
                if self.ctx.spec.wr_delay_s:
                    time.sleep(self.ctx.spec.wr_delay_s)
                status = _execute(qp, wr)
            with self.cond:
                if qp.destroyed:
                    continue
                if status not in (fv.IBV_WC_SUCCESS, fv.IBV_WC_WR_FLUSH_ERR):
                    qp._to_error()
                signalled = qp.sig_all or wr.send_flags & fv.IBV_SEND_SIGNALED
                if status == fv.IBV_WC_SUCCESS and not signalled:
                    qp.num_unsignalled += 1  # NOTE: its slot frees with the next completion
                    continue
                vendor_err = VENDOR_ERR.get(status, 0)
                slots, qp.num_unsignalled = 1 + qp.num_unsignalled, 0
                qp.cq.push(fv._WC(wr.wr_id, status, wr.opcode, vendor_err, qp.qp_num, slots))


def _execute(qp: QP, wr: Any) -> int:
    """Run one RDMA READ/WRITE as the NIC would; its completion status."""
    peer = _peer(qp.dest)
    if (
        fv.is_cut(qp.pd.ctx.name)
        or qp.pd.ctx.spec.ports[qp.port].state != fv.IBV_PORT_ACTIVE
        or peer is None
        or peer["state"] < fv.IBV_QPS_RTR
        or (peer["dest"] != qp.qp_num)
    ):
        return fv.IBV_WC_RETRY_EXC_ERR
    (sge,) = wr.sg_list
    if sge.length > qp.pd.ctx.spec.ports[qp.port].max_msg_sz:
        return fv.IBV_WC_LOC_LEN_ERR
    local = fv._MRS.get(sge.lkey)
    if local is None and sge.lkey in fv._CLOSED_KEYS:
        fv.CRASHES.append(f"wr_id {wr.wr_id} executed with lkey {sge.lkey} of a closed MR")
        return fv.IBV_WC_LOC_PROT_ERR  # NOTE: recorded, not raised: the device thread goes on
    if (
        local is None
        or local._lkey != sge.lkey
        or local.pd is not qp.pd
        or not (local.address <= sge.addr <= local.address + local.length - sge.length)
    ):
        return fv.IBV_WC_LOC_PROT_ERR
    mine = fv._MRS.get(wr.rkey)
    if mine is not None and mine._rkey == wr.rkey:
        mr = {
            "pid": os.getpid(),
            "address": mine.address,
            "length": mine.length,
            "access": mine.access,
            "pd": mine.pd.id,
            "host": mine.host,
        }
    else:
        mr = fv._lookup("mr", wr.rkey)
    need = (
        fv.IBV_ACCESS_REMOTE_WRITE
        if wr.opcode == fv.IBV_WR_RDMA_WRITE
        else (fv.IBV_ACCESS_REMOTE_READ)
    )
    if (
        mr is None
        or mr["pd"] != peer["pd"]
        or not mr["access"] & need
        or wr.remote_addr < mr["address"]
        or wr.remote_addr + sge.length > mr["address"] + mr["length"]
    ):
        return fv.IBV_WC_REM_ACCESS_ERR
    remote_addr, keep = wr.remote_addr - mr["address"] + mr.get("host", mr["address"]), None
    if mr["pid"] != os.getpid():
        if not mr.get("shm"):
            return fv.IBV_WC_REM_ACCESS_ERR  # another process's private memory: unreachable
        keep = fv._map(mr["shm"])
        base = ctypes.addressof(ctypes.c_char.from_buffer(keep))
        remote_addr = base + mr["offset"] + wr.remote_addr - mr["address"]
    local_addr = local.host + sge.addr - local.address
    if wr.opcode == fv.IBV_WR_RDMA_WRITE:
        fv.copy(remote_addr, local_addr, sge.length)
    else:
        fv.copy(local_addr, remote_addr, sge.length)
    del keep
    return fv.IBV_WC_SUCCESS
