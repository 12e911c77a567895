"""A fake verbs provider with pyverbs' class and method names, for hosts without RDMA NICs.

It emulates the one-sided semantics the rdma transport relies on: memory regions with
lkey/rkey and access flags, RC queue pairs that must reach RTS and be paired with a live
remote QP, RDMA READ/WRITE that copy between registered ranges (range and rkey checked, as
a NIC does, else a REM_ACCESS_ERR completion), and completions polled from a CQ.

The "fabric" is a directory (FAKE_VERBS_FABRIC, shared by the processes of a test) of small
JSON files describing each MR and QP. Memory of the same process is copied with ctypes;
memory of another process is reached through POSIX shared memory: the registering process
records which /dev/shm file backs the range (from /proc/self/maps) and the peer maps it.
Creating the file `fail-<device>` in the fabric makes every WR posted on that device
complete with RETRY_EXC_ERR: a cut link.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import json
import mmap
import os
import secrets
import tempfile
import threading
from typing import Any

FABRIC = os.environ.setdefault("FAKE_VERBS_FABRIC", tempfile.mkdtemp(prefix="fake-verbs-"))
DEVICES = ["fake_0", "fake_1"]

IBV_QPT_RC = 2
IBV_QPS_RESET, IBV_QPS_INIT, IBV_QPS_RTR, IBV_QPS_RTS, IBV_QPS_ERR = 0, 1, 2, 3, 6
IBV_ACCESS_LOCAL_WRITE, IBV_ACCESS_REMOTE_WRITE, IBV_ACCESS_REMOTE_READ = 1, 2, 4
IBV_WR_RDMA_WRITE, IBV_WR_RDMA_READ = 0, 4
IBV_SEND_SIGNALED = 2
IBV_WC_SUCCESS, IBV_WC_LOC_PROT_ERR, IBV_WC_REM_ACCESS_ERR, IBV_WC_RETRY_EXC_ERR = 0, 4, 10, 12
IBV_MTU_1024 = 3


class PyverbsError(Exception):
    pass


class PyverbsRDMAError(PyverbsError):
    pass


def _path(kind: str, key: int | str) -> str:
    return os.path.join(FABRIC, f"{kind}-{key}")


def _publish(kind: str, key: int | str, info: dict[str, Any]) -> None:
    tmp = _path(kind, key) + ".tmp"
    with open(tmp, "w") as f:
        json.dump(info, f)
    os.replace(tmp, _path(kind, key))


def _unlink(kind: str, key: int | str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(_path(kind, key))


def _lookup(kind: str, key: int | str) -> dict[str, Any] | None:
    try:
        with open(_path(kind, key)) as f:
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
                return (
                    (path, int(parts[2], 16) + address - start)
                    if path.startswith("/dev/shm/")
                    else ("", 0)
                )
    return "", 0


class _Device:
    def __init__(self, name: str):
        self.name = name.encode()


def get_device_list() -> list[_Device]:
    return [_Device(n) for n in DEVICES]


class GID:
    def __init__(self, val: str | None = None):
        self.gid = val or ""

    def __str__(self) -> str:
        return self.gid


class GlobalRoute:
    def __init__(self, dgid: GID | None = None, sgid_index: int = 0, **_: Any):
        self.dgid, self.sgid_index = dgid, sgid_index


class AHAttr:
    def __init__(self, dlid: int = 0, is_global: int = 0, port_num: int = 1,
                 gr: GlobalRoute | None = None, **_: Any):  # fmt: skip
        self.dlid, self.is_global, self.port_num = dlid, is_global, port_num
        self.dgid = gr.dgid if gr else None


_PortAttr = collections.namedtuple("_PortAttr", "lid active_mtu")


class Context:
    def __init__(self, name: str = ""):
        if name not in DEVICES:
            raise PyverbsRDMAError(f"device {name} not found")
        self.name = name

    def query_port(self, port_num: int) -> _PortAttr:
        return _PortAttr(0, IBV_MTU_1024)

    def query_gid(self, port_num: int, index: int) -> GID:
        return GID(f"fe80:0000:0000:0000:0000:0000:0000:{DEVICES.index(self.name) + 1:04x}")

    def close(self) -> None:
        pass


class PD:
    def __init__(self, ctx: Context):
        self.ctx = ctx

    def close(self) -> None:
        pass


class MR:
    def __init__(self, pd: PD, length: int, access: int, address: int | None = None):
        if address is None:
            raise PyverbsError("fake MR only registers caller memory (address=...)")
        self.pd, self.length, self.access, self.address = pd, length, access, address
        self.lkey = self.rkey = secrets.randbits(31) | 1
        shm, offset = _shm_backing(address)
        _publish("mr", self.rkey, {"pid": os.getpid(), "address": address, "length": length,
                                   "access": access, "shm": shm, "offset": offset,
                                   "device": pd.ctx.name})  # fmt: skip

    def close(self) -> None:
        _unlink("mr", self.rkey)


_WC = collections.namedtuple("_WC", "wr_id status opcode")  # a work completion


class CQ:
    def __init__(self, ctx: Context, cqe: int, cq_context: Any = None, channel: Any = None,
                 comp_vector: int = 0):  # fmt: skip
        self.ctx, self.cqe = ctx, cqe
        self._wcs: collections.deque[_WC] = collections.deque()
        self._lock = threading.Lock()

    def push(self, wc: _WC) -> None:
        with self._lock:
            self._wcs.append(wc)

    def poll(self, num_entries: int = 1) -> tuple[int, list[_WC]]:
        with self._lock:
            out = [self._wcs.popleft() for _ in range(min(num_entries, len(self._wcs)))]
        return len(out), out

    def close(self) -> None:
        pass


class QPCap:
    def __init__(self, max_send_wr: int = 1, max_recv_wr: int = 10, max_send_sge: int = 1,
                 max_recv_sge: int = 1, max_inline_data: int = 0):  # fmt: skip
        self.max_send_wr, self.max_recv_wr = max_send_wr, max_recv_wr


class QPInitAttr:
    def __init__(self, qp_type: int = IBV_QPT_RC, qp_context: Any = None, scq: Any = None,
                 rcq: Any = None, srq: Any = None, cap: Any = None,
                 sq_sig_all: int = 1):  # fmt: skip
        self.qp_type, self.send_cq, self.cap = qp_type, scq, cap or QPCap()


class QPAttr:
    def __init__(self, qp_state: int = IBV_QPS_INIT, cur_qp_state: int = IBV_QPS_RESET):
        self.qp_state, self.cur_qp_state = qp_state, cur_qp_state
        self.dest_qp_num = self.rq_psn = self.sq_psn = self.port_num = self.qp_access_flags = 0
        self.ah_attr: AHAttr | None = None


class SGE:
    def __init__(self, addr: int, length: int, lkey: int):
        self.addr, self.length, self.lkey = addr, length, lkey


class SendWR:
    def __init__(self, wr_id: int = 0, opcode: int = IBV_WR_RDMA_WRITE, num_sge: int = 1,
                 imm_data: int = 0, sg: list[SGE] | None = None, send_flags: int = 0):  # fmt: skip
        self.wr_id, self.opcode, self.num_sge, self.sg_list = wr_id, opcode, num_sge, sg or []
        self.send_flags, self.rkey, self.remote_addr = send_flags, 0, 0

    def set_wr_rdma(self, rkey: int, addr: int) -> None:
        self.rkey, self.remote_addr = rkey, addr


class QP:
    def __init__(self, pd: PD, init_attr: QPInitAttr, qp_attr: QPAttr | None = None):
        if init_attr.qp_type != IBV_QPT_RC:
            raise PyverbsRDMAError("fake verbs support RC queue pairs only")
        self.pd, self.qp_type = pd, init_attr.qp_type
        self.cq: CQ = init_attr.send_cq
        self.qp_num = secrets.randbits(24) | 1
        self.qp_state, self.dest_qp_num = IBV_QPS_RESET, 0
        self._sync()

    def _sync(self) -> None:
        _publish("qp", self.qp_num, {"state": self.qp_state, "dest": self.dest_qp_num})

    def _move(self, attr: QPAttr, frm: tuple[int, ...], to: int) -> None:
        if self.qp_state not in frm:
            raise PyverbsRDMAError(
                f"QP {self.qp_num}: cannot go from state {self.qp_state} to {to}"
            )
        self.qp_state = to
        self._sync()

    def to_init(self, attr: QPAttr) -> None:
        self._move(attr, (IBV_QPS_RESET,), IBV_QPS_INIT)

    def to_rtr(self, attr: QPAttr) -> None:
        if not attr.dest_qp_num or attr.ah_attr is None or attr.ah_attr.dgid is None:
            raise PyverbsRDMAError("RTR needs dest_qp_num and an ah_attr with a GID")
        self.dest_qp_num = attr.dest_qp_num
        self._move(attr, (IBV_QPS_INIT,), IBV_QPS_RTR)

    def to_rts(self, attr: QPAttr) -> None:
        self._move(attr, (IBV_QPS_RTR,), IBV_QPS_RTS)

    def post_send(self, wr: SendWR, bad_wr: Any = None) -> None:
        if self.qp_state != IBV_QPS_RTS:
            raise PyverbsRDMAError(f"post_send on QP {self.qp_num} in state {self.qp_state}")
        self.cq.push(_WC(wr.wr_id, self._execute(wr), wr.opcode))

    def _execute(self, wr: SendWR) -> int:
        peer = _lookup("qp", self.dest_qp_num)
        if (os.path.exists(_path("fail", self.pd.ctx.name)) or peer is None
                or peer["state"] < IBV_QPS_RTR or peer["dest"] != self.qp_num):  # fmt: skip
            return IBV_WC_RETRY_EXC_ERR
        (sge,) = wr.sg_list
        mr = _lookup("mr", wr.rkey)
        need = IBV_ACCESS_REMOTE_WRITE if wr.opcode == IBV_WR_RDMA_WRITE else IBV_ACCESS_REMOTE_READ
        if (mr is None or not mr["access"] & need or wr.remote_addr < mr["address"]
                or wr.remote_addr + sge.length > mr["address"] + mr["length"]):  # fmt: skip
            return IBV_WC_REM_ACCESS_ERR
        local = _lookup("mr", sge.lkey)
        if local is None or not (
            local["address"] <= sge.addr <= local["address"] + local["length"] - sge.length
        ):
            return IBV_WC_LOC_PROT_ERR
        remote_addr, keep = wr.remote_addr, None
        if mr["pid"] != os.getpid():
            if not mr["shm"]:
                return IBV_WC_REM_ACCESS_ERR  # another process's private memory: unreachable
            keep = _map(mr["shm"])
            remote_addr = (
                ctypes.addressof(ctypes.c_char.from_buffer(keep))
                + mr["offset"]
                + wr.remote_addr
                - mr["address"]
            )
        src, dst = (
            (sge.addr, remote_addr) if wr.opcode == IBV_WR_RDMA_WRITE else (remote_addr, sge.addr)
        )
        ctypes.memmove(dst, src, sge.length)
        del keep
        return IBV_WC_SUCCESS

    def close(self) -> None:
        self.qp_state = IBV_QPS_ERR
        _unlink("qp", self.qp_num)


_maps: dict[str, mmap.mmap] = {}


def _map(path: str) -> mmap.mmap:
    if path not in _maps:
        with open(path, "r+b") as f:
            _maps[path] = mmap.mmap(f.fileno(), 0)
    return _maps[path]


def cut(device: str, is_cut: bool = True) -> None:
    """Make every WR posted on `device` fail (a cut link), or heal it."""
    _publish("fail", device, {}) if is_cut else _unlink("fail", device)
