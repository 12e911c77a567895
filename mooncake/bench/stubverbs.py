"""A stub RDMA device with pyverbs' names, for the stub ceiling of the Python RDMA path
(`mooncake bench transfer --stub-device`): every work request completes at once and no
byte moves, so what is measured is the project's own code per slice.

What each slice costs stays real: `SGE`, `SendWR` and `WC` are pyverbs' own classes when
pyverbs imports (with its enums), else small stand-ins with the same fields. Everything
else (device, PD, CQ, MR, QP and the attribute classes) is a stub: one ACTIVE RoCEv2 port
with an IPv4-mapped GID, MRs with increasing keys, QPs that accept any state change. A
`post_send` queues one completion per signalled request of its chain (`next_wr`).
"""

from __future__ import annotations

import collections
import itertools
from types import SimpleNamespace
from typing import Any

from mooncake.native import rdma as verbs_api

DEVICE = "stub0"
PORT_GID = "0000:0000:0000:0000:0000:ffff:7f00:0001"  # IPv4-mapped 127.0.0.1
# rdma-core's values (pyverbs' when it imports)
ENUMS = {
    "IBV_QPT_RC": 2,
    "IBV_QPS_INIT": 1,
    "IBV_QPS_RTR": 2,
    "IBV_QPS_RTS": 3,
    "IBV_QPS_ERR": 6,
    "IBV_QP_STATE": 1,
    "IBV_ACCESS_LOCAL_WRITE": 1,
    "IBV_ACCESS_REMOTE_WRITE": 2,
    "IBV_ACCESS_REMOTE_READ": 4,
    "IBV_WR_RDMA_WRITE": 0,
    "IBV_WR_RDMA_READ": 4,
    "IBV_SEND_SIGNALED": 2,
    "IBV_WC_SUCCESS": 0,
    "IBV_WC_LOC_LEN_ERR": 1,
    "IBV_WC_LOC_QP_OP_ERR": 2,
    "IBV_WC_LOC_PROT_ERR": 4,
    "IBV_WC_WR_FLUSH_ERR": 5,
    "IBV_WC_LOC_ACCESS_ERR": 8,
    "IBV_WC_REM_INV_REQ_ERR": 9,
    "IBV_WC_REM_ACCESS_ERR": 10,
    "IBV_PORT_ACTIVE": 4,
    "IBV_LINK_LAYER_ETHERNET": 2,
    "IBV_GID_TYPE_SYSFS_ROCE_V2": 1,
}


class PyverbsError(Exception):
    pass


class _Attrs(SimpleNamespace):
    """An attribute holder taking keyword arguments (QPAttr, QPInitAttr, AHAttr, ...)."""


class SGE:
    __slots__ = ("addr", "length", "lkey")

    def __init__(self, addr: int, length: int, lkey: int):
        self.addr, self.length, self.lkey = addr, length, lkey


class SendWR:
    __slots__ = ("wr_id", "opcode", "num_sge", "sg", "send_flags", "next_wr", "rkey", "addr")

    def __init__(
        self,
        wr_id: int = 0,
        opcode: int = 0,
        num_sge: int = 1,
        sg: list[SGE] | None = None,
        send_flags: int = 0,
        next_wr: SendWR | None = None,
    ):
        self.wr_id, self.opcode, self.num_sge, self.sg = wr_id, opcode, num_sge, sg
        self.send_flags, self.next_wr = send_flags, next_wr
        self.rkey = self.addr = 0

    def set_wr_rdma(self, rkey: int, addr: int) -> None:
        self.rkey, self.addr = rkey, addr


class WC:
    __slots__ = ("wr_id", "status", "vendor_err")

    def __init__(self, wr_id: int = 0, status: int = 0, vendor_err: int = 0):
        self.wr_id, self.status, self.vendor_err = wr_id, status, vendor_err


class GID:
    def __init__(self, val: str = PORT_GID):
        self.val = val

    def __str__(self) -> str:
        return self.val


class _Device:
    name = DEVICE.encode()


class Context:
    def __init__(self, name: str = DEVICE):
        self.name = name

    def query_device(self) -> _Attrs:
        return _Attrs(
            max_qp_wr=32768,
            max_cqe=1 << 22,
            max_qp=1 << 16,
            max_qp_rd_atom=16,
            max_qp_init_rd_atom=16,
            phys_port_cnt=1,
        )

    def query_port(self, port_num: int) -> _Attrs:
        return _Attrs(
            state=ENUMS["IBV_PORT_ACTIVE"],
            link_layer=ENUMS["IBV_LINK_LAYER_ETHERNET"],
            active_mtu=5,
            max_mtu=5,
            lid=0,
            gid_tbl_len=1,
            max_msg_sz=1 << 31,
        )

    def query_gid(self, port_num: int, index: int) -> GID:
        return GID()

    def query_gid_type(self, port_num: int, index: int) -> int:
        return ENUMS["IBV_GID_TYPE_SYSFS_ROCE_V2"]

    def close(self) -> None:
        pass


class PD:
    def __init__(self, ctx: Context):
        self.ctx = ctx

    def close(self) -> None:
        pass


_keys = itertools.count(1)
_qpns = itertools.count(1)


class MR:
    def __init__(self, pd: PD, length: int, access: int, address: int = 0):
        self.length, self.buf = length, address
        self.lkey = self.rkey = next(_keys)

    def close(self) -> None:
        pass


class CQ:
    def __init__(self, ctx: Context, depth: int, *_: Any):
        self.done: collections.deque[Any] = collections.deque()

    def poll(self, num_entries: int = 1) -> tuple[int, list[Any]]:
        out = []
        for _ in range(num_entries):
            try:
                out.append(self.done.popleft())
            except IndexError:
                break
        return len(out), out

    def close(self) -> None:
        pass


class QP:
    def __init__(self, pd: PD, init_attr: Any):
        self.cq: CQ = init_attr.scq
        self.qp_num = next(_qpns)
        self.signaled = 0  # set by stub_verbs: the provider's IBV_SEND_SIGNALED
        self.wc: Any = WC

    def to_init(self, attr: Any) -> None:
        pass

    def to_rtr(self, attr: Any) -> None:
        pass

    def to_rts(self, attr: Any) -> None:
        pass

    def modify(self, attr: Any, mask: int) -> None:
        pass

    def post_send(self, wr: Any, bad_wr: Any = None) -> None:
        done = self.cq.done
        while wr is not None:
            if wr.send_flags & self.signaled:
                done.append(self.wc(wr_id=wr.wr_id, status=0))
            wr = wr.next_wr

    def close(self) -> None:
        pass


def stub_verbs() -> SimpleNamespace:
    """The stub device as a `native.rdma.Verbs` namespace: pyverbs' SGE, SendWR, WC and
    enums when it imports (`.real` says which), the stand-ins above otherwise."""
    ns: dict[str, Any] = dict(ENUMS)
    ns.update(SGE=SGE, SendWR=SendWR, WC=WC, real=False)
    try:
        real = verbs_api.load_pyverbs()
        import pyverbs.cq

        ns.update({name: getattr(real, name) for name in ENUMS})
        ns.update(SGE=real.SGE, SendWR=real.SendWR, WC=pyverbs.cq.WC, real=True)
    except ImportError:
        pass
    signaled, wc = int(ns["IBV_SEND_SIGNALED"]), ns["WC"]

    class StubQP(QP):
        def __init__(self, pd: PD, init_attr: Any):
            super().__init__(pd, init_attr)
            self.signaled, self.wc = signaled, wc

    ns.update(
        Context=Context,
        get_device_list=lambda: [_Device()],
        fork_init=lambda: None,
        PD=PD,
        MR=MR,
        DmaBufMR=None,
        CQ=CQ,
        QP=StubQP,
        QPInitAttr=_Attrs,
        QPAttr=_Attrs,
        QPCap=_Attrs,
        GID=GID,
        AHAttr=_Attrs,
        GlobalRoute=_Attrs,
        PyverbsError=PyverbsError,
    )
    return SimpleNamespace(**ns)
