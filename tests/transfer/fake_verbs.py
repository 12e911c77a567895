"""A verbs emulator with pyverbs' class, method and enum names, as strict as hardware, for
hosts without RDMA NICs.

What it enforces, as an RC queue pair on a real NIC does (rdma-core's libibverbs + mlx5):
- devices have ports with a state (ACTIVE/DOWN), a link layer, an active MTU, a max message
  size and a GID table (RoCE: link-local and IPv4-mapped GIDs, each as RoCEv1 and RoCEv2);
  device limits (max_qp_wr, max_cqe, max_qp, read-atomic depths) refuse bigger requests;
- QPs go RESET -> INIT -> RTR -> RTS; RTR checks the PSN (24 bits), the path MTU against
  both ports, the GID entries and their types (a RoCEv1 GID cannot talk to a RoCEv2 one; a
  link-local GID and a hop limit of 1 do not cross a router: each device here sits on its
  own IPv4 subnet), and the read-atomic depths against the device;
- post_send takes a chain of work requests (SendWR.next_wr, which holds a pointer, not a
  reference: a link to a SendWR freed before the post is a use-after-free) and posts them
  in order; the first that finds no room fails the call with ENOMEM (past max_send_wr
  outstanding), the ones before it stay posted and `bad_wr` receives a copy of it;
- send_flags are honoured: a request without IBV_SEND_SIGNALED (and sq_sig_all=0) that
  succeeds produces no completion; one that fails, or is flushed, always does. Send queue
  slots come back in order when a completion is polled: its own and those of the
  unsignalled requests before it, so a QP that never signals runs out of slots;
- work runs on the device's own thread, so completions arrive asynchronously; a completion
  that finds its CQ full overruns it, which puts every QP on that CQ in the error state
  (its completion is lost, as on hardware);
- an error completion puts its QP in the error state; a QP in error completes everything
  outstanding or posted later with WR_FLUSH_ERR; destroying a QP drops its work requests
  and its completions still in the CQ (mlx5 cleans them out of the CQ);
- posting to a destroyed QP or polling a destroyed CQ is a use-after-free (a segfault in
  pyverbs): it raises VerbsCrash, a BaseException no `except Exception` swallows, and is
  recorded in CRASHES, which the tests' fixture checks; so is reading the lkey or rkey of
  a closed MR (pyverbs reads the freed ibv_mr), posting a work request whose lkey belongs
  to a closed MR, and (recorded only: the device thread goes on, the request fails with
  LOC_PROT_ERR) executing one whose MR was closed after it was posted: on hardware the
  key may belong to a new registration by then. Keys are never reused. An rkey of an MR
  the peer closed stays a REM_ACCESS_ERR, as on hardware: a peer may unregister a segment
  at any time and the initiator resolves its descriptor again;
- asynchronous events as pyverbs 44 has them: Context.get_async_event() blocks until one,
  AsyncEvent has event_type and ack(). set_port_state() takes a port down (its work fails
  with RETRY_EXC_ERR; PORT_ERR) or up (PORT_ACTIVE), fail_qp() is a QP fatal error (it
  flushes; QP_FATAL), a CQ overrun raises CQ_ERR; destroying a QP with an event not yet
  acked is recorded as a crash (ibv_destroy_qp waits for the ack forever);
- MRs are bound to their protection domain: an lkey of another PD fails the work request
  with LOC_PROT_ERR, an rkey of another PD than the remote QP's with REM_ACCESS_ERR; pinned
  bytes count against MEMLOCK_LIMIT (RLIMIT_MEMLOCK) and registration past it is ENOMEM.

One-sided READ/WRITE copy bytes between registered ranges of this process (ctypes) or of
another process through POSIX shared memory (the registering process records which /dev/shm
file backs the range, from /proc/self/maps). The "fabric" of QPs and MRs other processes see
is a directory of small JSON files (FAKE_VERBS_FABRIC, inherited by child processes).
Creating `fail-<device>` there makes every WR on that device fail with RETRY_EXC_ERR: a cut
link. Tests change DEVICES (specs) and FAIL_CALLS (make the next calls of a method fail).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import errno
import json
import mmap
import os
import secrets
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

FABRIC = os.environ.setdefault("FAKE_VERBS_FABRIC", tempfile.mkdtemp(prefix="fake-verbs-"))

# enum values of rdma-core (checked against pyverbs by test_pyverbs_api.py)
IBV_QPT_RC = 2
IBV_QPS_RESET, IBV_QPS_INIT, IBV_QPS_RTR, IBV_QPS_RTS, IBV_QPS_ERR = 0, 1, 2, 3, 6
IBV_QP_STATE = 1
IBV_ACCESS_LOCAL_WRITE, IBV_ACCESS_REMOTE_WRITE, IBV_ACCESS_REMOTE_READ = 1, 2, 4
IBV_WR_RDMA_WRITE, IBV_WR_RDMA_READ = 0, 4
IBV_SEND_SIGNALED = 2
IBV_WC_SUCCESS, IBV_WC_LOC_LEN_ERR, IBV_WC_LOC_QP_OP_ERR, IBV_WC_LOC_PROT_ERR = 0, 1, 2, 4
IBV_WC_WR_FLUSH_ERR, IBV_WC_LOC_ACCESS_ERR, IBV_WC_REM_INV_REQ_ERR = 5, 8, 9
IBV_WC_REM_ACCESS_ERR, IBV_WC_RETRY_EXC_ERR, IBV_WC_FATAL_ERR = 10, 12, 19
IBV_MTU_256, IBV_MTU_512, IBV_MTU_1024, IBV_MTU_2048, IBV_MTU_4096 = 1, 2, 3, 4, 5
IBV_PORT_DOWN, IBV_PORT_ACTIVE = 1, 4
IBV_LINK_LAYER_INFINIBAND, IBV_LINK_LAYER_ETHERNET = 1, 2
IBV_GID_TYPE_SYSFS_IB_ROCE_V1, IBV_GID_TYPE_SYSFS_ROCE_V2 = 0, 1
IBV_EVENT_CQ_ERR, IBV_EVENT_QP_FATAL, IBV_EVENT_PORT_ACTIVE, IBV_EVENT_PORT_ERR = 0, 1, 9, 10
ZERO_GID = "0000:0000:0000:0000:0000:0000:0000:0000"


class PyverbsError(Exception):
    pass


class PyverbsUserError(PyverbsError):
    pass


class PyverbsRDMAError(PyverbsError):
    def __init__(self, msg: str, error_code: int = -1):
        if error_code != -1:
            msg = f"{msg}. Errno: {error_code}, {os.strerror(error_code)}"
        super().__init__(msg)
        self.error_code = error_code


class VerbsCrash(BaseException):  # noqa: N818 - named for what it stands for
    """A use-after-free in libibverbs: the real process would segfault here."""


CRASHES: list[str] = []


def _crash(msg: str) -> None:
    CRASHES.append(msg)
    raise VerbsCrash(msg)


# -- devices ----------------------------------------------------------------------------------


@dataclass
class PortSpec:
    state: int = IBV_PORT_ACTIVE
    link_layer: int = IBV_LINK_LAYER_ETHERNET
    active_mtu: int = IBV_MTU_4096
    max_msg_sz: int = 1 << 30
    gid_tbl_len: int = 8


@dataclass
class DeviceSpec:
    subnet: int  # this device's netdev is on 10.0.<subnet>.0/24; other subnets are routed
    ports: dict[int, PortSpec] = field(default_factory=lambda: {1: PortSpec()})
    max_qp_wr: int = 1024
    max_cqe: int = 65536
    max_qp: int = 512
    max_qp_rd_atom: int = 16
    max_qp_init_rd_atom: int = 16
    open_error: str = ""  # Context() fails with this
    mr_error: int = 0  # errno every MR registration on this device fails with
    peermem: bool = True  # plain MRs of DEVICE_MEMORY work (nvidia-peermem loaded)
    dmabuf_type_error: bool = False  # DmaBufMR raises TypeError (an older pyverbs' fd type)
    wr_delay_s: float = 0.0  # seconds the device takes per work request (a slow link)


def default_devices() -> dict[str, DeviceSpec]:
    return {"fake_0": DeviceSpec(0), "fake_1": DeviceSpec(1)}


DEVICES: dict[str, DeviceSpec] = default_devices()
FAIL_CALLS: collections.Counter[str] = collections.Counter()  # "QP.to_rtr" -> next N fail
MEMLOCK_LIMIT = -1  # bytes a process may pin; -1 = unlimited
FORK = {"initialized": False, "after_mr": False}
STATS = {
    "max_sq": 0,
    "max_sq_depth": 0,
    "max_cq": 0,
    "max_cq_depth": 0,
    "overruns": 0,
    "dropped": 0,
}  # dropped: work requests of QPs destroyed before their completion
DEVICE_MEMORY: list[tuple[int, int]] = []  # [start, end) ranges standing for GPU memory
_pinned = [0]
_lock = threading.RLock()  # the emulator's own state (registries, QP states, CQs)
_QPS: dict[int, QP] = {}  # live QPs of this process by number
_MRS: dict[int, MR] = {}  # live MRs of this process by key
_CONTEXTS: list[Context] = []  # open device contexts of this process (they get port events)
_CLOSED_KEYS: set[int] = set()  # lkeys and rkeys of this process's closed MRs (never reused)


def reset() -> None:
    """Back to the default devices and an empty record (between tests)."""
    global DEVICES, MEMLOCK_LIMIT
    DEVICES, MEMLOCK_LIMIT = default_devices(), -1
    FAIL_CALLS.clear()
    CRASHES.clear()
    DEVICE_MEMORY.clear()
    _CLOSED_KEYS.clear()
    STATS.update(max_sq=0, max_sq_depth=0, max_cq=0, max_cq_depth=0, overruns=0, dropped=0)
    FORK.update(initialized=False, after_mr=False)


def _maybe_fail(call: str) -> None:
    with _lock:
        if FAIL_CALLS[call] > 0:
            FAIL_CALLS[call] -= 1
            raise PyverbsRDMAError(f"{call} failed (injected)", errno.EIO)


def _gids(name: str, port: int) -> list[tuple[str, int]]:
    """The port's GID table as (gid, sysfs type), as mlx5 fills it for one IPv4 address."""
    spec = DEVICES[name]
    dev = list(DEVICES).index(name) + 1
    link_local = f"fe80:0000:0000:0000:0000:0000:{port:04x}:{dev:04x}"
    if spec.ports[port].link_layer == IBV_LINK_LAYER_INFINIBAND:
        return [(link_local, IBV_GID_TYPE_SYSFS_IB_ROCE_V1)]
    ipv4 = f"0000:0000:0000:0000:0000:ffff:0a00:{spec.subnet:02x}{dev:02x}"
    v1, v2 = IBV_GID_TYPE_SYSFS_IB_ROCE_V1, IBV_GID_TYPE_SYSFS_ROCE_V2
    return [(link_local, v1), (link_local, v2), (ipv4, v1), (ipv4, v2)]


class _Device:
    def __init__(self, name: str):
        self.name = name.encode()


def get_device_list() -> list[_Device]:
    return [_Device(n) for n in DEVICES]


def fork_init() -> None:
    with _lock:
        FORK["initialized"] = True
        FORK["after_mr"] = FORK["after_mr"] or bool(_MRS)


class GID:
    def __init__(self, val: str | None = None):
        self.gid = val or ZERO_GID

    def __str__(self) -> str:
        return self.gid


class GlobalRoute:
    def __init__(
        self,
        dgid: GID | None = None,
        flow_label: int = 0,
        sgid_index: int = 0,
        hop_limit: int = 1,
        traffic_class: int = 0,
    ):
        self.dgid, self.sgid_index, self.hop_limit = dgid, sgid_index, hop_limit
        self.traffic_class, self.flow_label = traffic_class, flow_label


class AHAttr:
    def __init__(
        self,
        dlid: int = 0,
        sl: int = 0,
        src_path_bits: int = 0,
        static_rate: int = 0,
        is_global: int = 0,
        port_num: int = 1,
        gr: GlobalRoute | None = None,
    ):
        self.dlid, self.sl, self.is_global, self.port_num = dlid, sl, is_global, port_num
        self.gr = gr
        self.dgid = gr.dgid if gr else None
        self.sgid_index = gr.sgid_index if gr else 0
        self.hop_limit = gr.hop_limit if gr else 1
        self.traffic_class = gr.traffic_class if gr else 0


_PortAttr = collections.namedtuple(
    "_PortAttr", "state link_layer active_mtu max_mtu lid gid_tbl_len max_msg_sz"
)
_DeviceAttr = collections.namedtuple(
    "_DeviceAttr", "max_qp_wr max_cqe max_qp max_qp_rd_atom max_qp_init_rd_atom phys_port_cnt"
)


class Context:
    def __init__(self, name: str = ""):
        spec = DEVICES.get(name)
        if spec is None or spec.open_error:
            raise PyverbsRDMAError(f"Failed to open device {name}: {spec and spec.open_error}")
        self.name, self.spec = name, spec
        self.children: list[Any] = []
        self.closed = False
        self.events: collections.deque[AsyncEvent] = collections.deque()  # not yet got
        self.events_cond = threading.Condition(_lock)
        self.engine = _Engine(self)
        with _lock:
            _CONTEXTS.append(self)

    def get_async_event(self) -> AsyncEvent:
        """The next asynchronous event of this device, blocking until there is one (as
        ibv_get_async_event on a blocking fd); it must be ack()ed."""
        with self.events_cond:
            while not self.events and not self.closed:
                self.events_cond.wait()
            if not self.events:
                raise PyverbsRDMAError("Failed to get async event", errno.EBADF)
            return self.events.popleft()

    def _raise_event(self, event_type: int, qp: Any = None) -> None:  # under _lock
        self.events.append(AsyncEvent(event_type, qp))
        if qp is not None:
            qp.num_unacked_events += 1
        self.events_cond.notify_all()

    def query_device(self) -> _DeviceAttr:
        s = self.spec
        return _DeviceAttr(
            s.max_qp_wr, s.max_cqe, s.max_qp, s.max_qp_rd_atom, s.max_qp_init_rd_atom, len(s.ports)
        )

    def _port(self, port_num: int) -> PortSpec:
        port = self.spec.ports.get(port_num)
        if port is None:
            raise PyverbsRDMAError(f"Failed to query port {port_num}", errno.EINVAL)
        return port

    def query_port(self, port_num: int) -> _PortAttr:
        p = self._port(port_num)
        return _PortAttr(
            p.state, p.link_layer, p.active_mtu, IBV_MTU_4096, 0, p.gid_tbl_len, p.max_msg_sz
        )

    def query_gid(self, port_num: int, index: int) -> GID:
        if not 0 <= index < self._port(port_num).gid_tbl_len:
            raise PyverbsRDMAError(f"Failed to query gid {index}", errno.EINVAL)
        table = _gids(self.name, port_num)
        return GID(table[index][0] if index < len(table) else ZERO_GID)

    def query_gid_type(self, port_num: int, index: int) -> int:
        table = _gids(self.name, port_num)
        if index >= len(table):
            raise PyverbsRDMAError(f"Failed to query gid type of index {index}", errno.EINVAL)
        return table[index][1]

    def close(self) -> None:  # as pyverbs: closes what was made from it first
        for child in reversed(self.children):
            child.close()
        self.engine.stop()
        with self.events_cond:
            self.closed = True
            self.events_cond.notify_all()
            if self in _CONTEXTS:
                _CONTEXTS.remove(self)


class AsyncEvent:
    """An asynchronous event as pyverbs 44 exposes it: its type only (which QP or port
    it concerns is not readable; query the port or the QPs' states)."""

    def __init__(self, event_type: int = 0, qp: Any = None):
        self.event_type = event_type
        self._qp, self._acked = qp, False

    def ack(self) -> None:
        with _lock:
            if not self._acked and self._qp is not None:
                self._qp.num_unacked_events -= 1
            self._acked = True


def set_port_state(device: str, port_num: int, state: int) -> None:
    """Take a port of `device` down (IBV_PORT_DOWN: its work fails with RETRY_EXC_ERR) or
    up (IBV_PORT_ACTIVE); every open context of the device gets PORT_ERR or PORT_ACTIVE."""
    with _lock:
        DEVICES[device].ports[port_num].state = state
        event = IBV_EVENT_PORT_ACTIVE if state == IBV_PORT_ACTIVE else IBV_EVENT_PORT_ERR
        for ctx in _CONTEXTS:
            if ctx.name == device:
                ctx._raise_event(event)


class PD:
    def __init__(self, ctx: Context):
        self.ctx, self.children, self.id = ctx, [], f"{os.getpid()}:{secrets.token_hex(4)}"
        ctx.children.append(self)

    def close(self) -> None:
        for child in reversed(self.children):
            child.close()


def _publish(kind: str, key: int | str, info: dict[str, Any]) -> None:
    path = os.path.join(FABRIC, f"{kind}-{key}")
    with open(path + ".tmp", "w") as f:
        json.dump(info, f)
    os.replace(path + ".tmp", path)


def _unlink(kind: str, key: int | str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(FABRIC, f"{kind}-{key}"))


def _lookup(kind: str, key: int | str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(FABRIC, f"{kind}-{key}")) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def _shm_backing(address: int) -> tuple[str, int]:
    """(/dev/shm file, file offset) backing `address` in this process, or ("", 0)."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            start, end = (int(x, 16) for x in parts[0].split("-"))
            if start <= address < end:
                path = parts[5] if len(parts) > 5 else ""
                if path.startswith("/dev/shm/"):
                    return path, int(parts[2], 16) + address - start
                return "", 0
    return "", 0


class MR:
    def __init__(
        self, pd: PD, length: int, access: int, address: int | None = None, host: int | None = None
    ):
        if address is None:
            raise PyverbsError("the emulator only registers caller memory (address=...)")
        if host is None:  # a plain MR (a DmaBufMR passes host)
            _maybe_fail("MR")
            if pd.ctx.spec.mr_error:
                raise PyverbsRDMAError("Failed to register a MR", pd.ctx.spec.mr_error)
            if not pd.ctx.spec.peermem and any(a <= address < b for a, b in DEVICE_MEMORY):
                raise PyverbsRDMAError("Failed to register a MR", errno.EFAULT)
        with _lock:
            if MEMLOCK_LIMIT >= 0 and _pinned[0] + length > MEMLOCK_LIMIT:
                raise PyverbsRDMAError("Failed to register a MR", errno.ENOMEM)
            _pinned[0] += length
            self.fork_safe = FORK["initialized"]
            self._lkey, self._rkey = _new_key(), _new_key()
            _MRS[self._lkey] = _MRS[self._rkey] = self
        self.pd, self.length, self.access, self.address = pd, length, access, address
        self.host = address if host is None else host  # where address (the iova) really is
        self.closed = False
        pd.children.append(self)
        shm, offset = _shm_backing(self.host)
        _publish(
            "mr",
            self._rkey,
            {
                "pid": os.getpid(),
                "address": address,
                "length": length,
                "access": access,
                "shm": shm,
                "offset": offset,
                "pd": pd.id,
            },
        )

    @property
    def lkey(self) -> int:
        if self.closed:  # NOTE: pyverbs reads the freed ibv_mr: a NULL dereference
            _crash("lkey of a closed MR")
        return self._lkey

    @property
    def rkey(self) -> int:
        if self.closed:
            _crash("rkey of a closed MR")
        return self._rkey

    def close(self) -> None:
        with _lock:
            if self.closed:
                return
            self.closed = True
            _pinned[0] -= self.length
            _MRS.pop(self._lkey, None)
            _MRS.pop(self._rkey, None)
            _CLOSED_KEYS.update((self._lkey, self._rkey))
        _unlink("mr", self._rkey)


def _new_key() -> int:
    """Under _lock: a key no live or closed MR of this process has had."""
    while (key := secrets.randbits(31) | 1) in _MRS or key in _CLOSED_KEYS:
        pass
    return key


DMABUFS: dict[int, int] = {}  # emulated dma-buf fd -> host address of its first byte


def export_dmabuf(address: int, length: int) -> tuple[int, int]:
    """What native/cudadmabuf.export_dmabuf returns, for emulated device memory: a real
    (closable) fd standing for the pages around [address, address+length)."""
    fd = os.open(os.devnull, os.O_RDONLY)
    offset = address % 4096
    DMABUFS[fd] = address - offset
    return fd, offset


class DmaBufMR(MR):
    """An MR of a dma-buf: work requests address it from iova = offset (as pyverbs does)."""

    def __init__(
        self,
        pd: PD,
        length: int,
        access: int,
        dmabuf: Any = None,
        offset: int = 0,
        gpu: int = 0,
        gtt: int = 0,
    ):
        if pd.ctx.spec.dmabuf_type_error:
            DMABUFS.pop(dmabuf, None)
            raise TypeError("an integer is required (got type int)")  # as older rdma-core
        if not isinstance(dmabuf, int) or dmabuf not in DMABUFS:
            raise PyverbsRDMAError("Failed to register a dma-buf MR", errno.EBADF)
        super().__init__(pd, length, access, offset, host=DMABUFS.pop(dmabuf) + offset)


# sq_slots: send queue slots this completion frees (itself and the unsignalled WRs before it)
_WC = collections.namedtuple("_WC", "wr_id status opcode vendor_err qp_num sq_slots", defaults=(1,))


class CQ:
    def __init__(
        self,
        ctx: Context,
        cqe: int,
        cq_context: Any = None,
        channel: Any = None,
        comp_vector: int = 0,
    ):
        if not 1 <= cqe <= ctx.spec.max_cqe:
            raise PyverbsRDMAError(f"Failed to create CQ of {cqe} entries", errno.EINVAL)
        self.ctx, self.cqe = ctx, cqe
        self.wcs: collections.deque[_WC] = collections.deque()
        self.qps: list[QP] = []
        self.closed = self.overrun = False
        self.poll_delay_s = 0.0  # a test widens the race window of poll vs close with it
        ctx.children.append(self)

    def push(self, wc: _WC) -> None:  # the device, under _lock
        if self.closed:
            return
        if len(self.wcs) >= self.cqe or self.overrun:
            if not self.overrun:
                self.ctx._raise_event(IBV_EVENT_CQ_ERR)
            self.overrun = True
            STATS["overruns"] += 1
            for qp in self.qps:
                qp._to_error()
            return
        self.wcs.append(wc)
        STATS["max_cq"] = max(STATS["max_cq"], len(self.wcs))
        STATS["max_cq_depth"] = max(STATS["max_cq_depth"], self.cqe)

    def poll(self, num_entries: int = 1) -> tuple[int, list[_WC]]:
        if self.closed:
            _crash("poll of a destroyed CQ")
        if self.poll_delay_s:
            time.sleep(self.poll_delay_s)
        with _lock:
            if self.closed:
                _crash("CQ destroyed while being polled")
            out = [self.wcs.popleft() for _ in range(min(num_entries, len(self.wcs)))]
            for wc in out:
                qp = _QPS.get(wc.qp_num)
                if qp is not None and qp.cq is self:
                    qp.outstanding -= wc.sq_slots  # their send queue slots are free again
        return len(out), out

    def close(self) -> None:
        for qp in list(self.qps):
            qp.close()
        with _lock:
            self.closed = True


class QPCap:
    def __init__(
        self,
        max_send_wr: int = 1,
        max_recv_wr: int = 10,
        max_send_sge: int = 1,
        max_recv_sge: int = 1,
        max_inline_data: int = 0,
    ):
        self.max_send_wr, self.max_recv_wr = max_send_wr, max_recv_wr


class QPInitAttr:
    def __init__(
        self,
        qp_type: int = IBV_QPT_RC,
        qp_context: Any = None,
        scq: Any = None,
        rcq: Any = None,
        srq: Any = None,
        cap: Any = None,
        sq_sig_all: int = 1,
    ):
        self.qp_type, self.send_cq, self.cap = qp_type, scq, cap or QPCap()
        self.max_send_wr = self.cap.max_send_wr
        self.sq_sig_all = sq_sig_all


class QPAttr:
    def __init__(self, qp_state: int = IBV_QPS_INIT, cur_qp_state: int = IBV_QPS_RESET):
        self.qp_state, self.cur_qp_state = qp_state, cur_qp_state
        self.dest_qp_num = self.rq_psn = self.sq_psn = self.port_num = self.qp_access_flags = 0
        self.path_mtu, self.max_dest_rd_atomic, self.max_rd_atomic = IBV_MTU_1024, 0, 0
        self.ah_attr: AHAttr | None = None
        self.pkey_index = self.timeout = self.retry_cnt = self.rnr_retry = 0
        self.min_rnr_timer = 0


class SGE:
    def __init__(self, addr: int, length: int, lkey: int):
        self.addr, self.length, self.lkey = addr, length, lkey


class SendWR:
    def __init__(
        self,
        wr_id: int = 0,
        opcode: int = IBV_WR_RDMA_WRITE,
        num_sge: int = 1,
        imm_data: int = 0,
        sg: list[SGE] | None = None,
        send_flags: int = 0,
    ):
        self.wr_id, self.opcode, self.num_sge, self.sg_list = wr_id, opcode, num_sge, sg or []
        self.send_flags, self.rkey, self.remote_addr = send_flags, 0, 0
        self._next: weakref.ref[SendWR] | None = None

    def set_wr_rdma(self, rkey: int, addr: int) -> None:
        self.rkey, self.remote_addr = rkey, addr

    @property
    def next_wr(self) -> None:
        """None when unset. NOTE: rdma-core 44's getter of a set next_wr builds a SendWR
        without an SGE and raises PyverbsUserError; the emulator does the same."""
        if self._next is not None:
            raise PyverbsUserError("A WR needs at least one SGE")
        return None

    @next_wr.setter
    def next_wr(self, val: SendWR) -> None:
        # NOTE: pyverbs stores a pointer to val's ibv_send_wr and no reference to val: the
        # caller keeps every WR of a chain alive until post_send returns
        if not isinstance(val, SendWR):
            raise TypeError(
                f"Argument 'val' has incorrect type (expected pyverbs.wr.SendWR, got "
                f"{type(val).__name__})"
            )
        self._next = weakref.ref(val)

    def chain(self) -> list[SendWR]:
        """This WR and the ones its next_wr links to, as ibv_post_send walks them; a link to
        a freed SendWR is a use-after-free."""
        out, wr = [self], self
        while wr._next is not None:
            nxt = wr._next()
            if nxt is None:
                _crash(f"post_send follows next_wr of wr_id {wr.wr_id} to a freed SendWR")
            assert nxt is not None
            if len(out) > 1 << 16 or nxt in out:
                _crash("post_send: a chain of work requests that loops")
            out.append(nxt)
            wr = nxt
        return out

    def copy_to(self, other: SendWR) -> None:
        """What pyverbs copies into `bad_wr` (the ibv_send_wr, its next pointer included)."""
        other.wr_id, other.opcode, other.num_sge = self.wr_id, self.opcode, self.num_sge
        other.sg_list, other.send_flags = list(self.sg_list), self.send_flags
        other.rkey, other.remote_addr, other._next = self.rkey, self.remote_addr, self._next


from tests.transfer.fake_qp import QP, _Engine  # noqa: E402 - the QP half of the emulator


def live_qps(device: str) -> int:
    """QPs of this process on `device` not yet destroyed."""
    with _lock:
        return sum(1 for qp in _QPS.values() if qp.pd.ctx.name == device)


def fail_qp(qp: QP) -> None:
    """A QP fatal error (the NIC found its context broken): it moves to the error state,
    its work flushes, and its device gets IBV_EVENT_QP_FATAL (to ack before destroying it)."""
    with _lock:
        qp._to_error()
        qp.pd.ctx._raise_event(IBV_EVENT_QP_FATAL, qp)


def break_qps(device: str, count: int = 1) -> list[int]:
    """Move `count` busy RTS QPs of `device` to the error state (a transport error in
    flight): their outstanding work completes with WR_FLUSH_ERR. Returns their numbers."""
    with _lock:
        busy = [
            q for q in _QPS.values() if q.pd.ctx.name == device and q.sq and q.state == IBV_QPS_RTS
        ][:count]
        for qp in busy:
            qp._to_error(IBV_WC_RETRY_EXC_ERR)
        return [qp.qp_num for qp in busy]


_maps: dict[str, mmap.mmap] = {}


def _map(path: str) -> mmap.mmap:
    if path not in _maps:
        with open(path, "r+b") as f:
            _maps[path] = mmap.mmap(f.fileno(), 0)
    return _maps[path]


def copy(dst: int, src: int, length: int) -> None:
    ctypes.memmove(dst, src, length)


def cut(device: str, is_cut: bool = True) -> None:
    """Make every WR posted on `device` fail (a cut link), or heal it."""
    _publish("fail", device, {}) if is_cut else _unlink("fail", device)


def is_cut(device: str) -> bool:
    return os.path.exists(os.path.join(FABRIC, f"fail-{device}"))
