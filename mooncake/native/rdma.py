"""RDMA verbs through pyverbs: the only module that imports it.

`load_pyverbs()` gathers the pyverbs classes this project calls into one `Verbs` namespace,
so the transport can run on the real library or on a fake with the same names (tests).
`RdmaNic` wraps one opened device: protection domain, completion queue, memory
registration, RC queue pairs and their INIT -> RTR -> RTS transitions, posting one-sided
READ/WRITE work requests, and polling completions. The `build_*` functions only construct
attribute objects, so they can be checked against the real pyverbs without a device.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

log = logging.getLogger(__name__)

DEBIAN_DIST_PACKAGES = "/usr/lib/python3/dist-packages"  # where python3-pyverbs installs
# what this module uses from pyverbs: (module, names)
USED = {
    "pyverbs.device": ("Context", "get_device_list"),
    "pyverbs.pd": ("PD",),
    "pyverbs.mr": ("MR",),
    "pyverbs.cq": ("CQ",),
    "pyverbs.qp": ("QP", "QPInitAttr", "QPAttr", "QPCap"),
    "pyverbs.wr": ("SendWR", "SGE"),
    "pyverbs.addr": ("GID", "AHAttr", "GlobalRoute"),
    "pyverbs.pyverbs_error": ("PyverbsError",),
}
USED_ENUMS = (
    "IBV_QPT_RC", "IBV_QPS_INIT", "IBV_QPS_RTR", "IBV_QPS_RTS", "IBV_ACCESS_LOCAL_WRITE",
    "IBV_ACCESS_REMOTE_READ", "IBV_ACCESS_REMOTE_WRITE", "IBV_WR_RDMA_READ", "IBV_WR_RDMA_WRITE",
    "IBV_SEND_SIGNALED", "IBV_WC_SUCCESS",
)  # fmt: skip
Verbs = SimpleNamespace  # the classes of USED and the enums of USED_ENUMS, flat


def load_pyverbs() -> Verbs:
    """The pyverbs API as one namespace; raises ImportError when pyverbs is unavailable.

    Debian's python3-pyverbs installs outside a virtualenv's path; if the plain import
    fails, its directory is appended (last, so it shadows nothing) and the import retried.
    """
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        return _import_pyverbs()
    finally:  # NOTE: pyverbs calls logging.basicConfig(level=INFO) on import; undo that
        root.handlers[:] = handlers
        root.setLevel(level)


def _import_pyverbs() -> Verbs:
    try:
        importlib.import_module("pyverbs")
    except ImportError:
        if not os.path.isdir(os.path.join(DEBIAN_DIST_PACKAGES, "pyverbs")):
            raise
        sys.path.append(DEBIAN_DIST_PACKAGES)
        log.debug("pyverbs: using %s", DEBIAN_DIST_PACKAGES)
    ns: dict[str, Any] = {}
    for module, names in USED.items():
        mod = importlib.import_module(module)
        ns.update({n: getattr(mod, n) for n in names})
    try:  # newer rdma-core renamed the enums module
        enums = importlib.import_module("pyverbs.libibverbs_enums")
    except ImportError:
        enums = importlib.import_module("pyverbs.enums")
    ns.update({n: getattr(enums, n) for n in USED_ENUMS})
    return SimpleNamespace(**ns)


def list_devices(verbs: Verbs) -> list[str]:
    """Names of the RDMA devices present ([] when there are none or verbs fails)."""
    try:
        devices = verbs.get_device_list()
    except verbs.PyverbsError as e:
        log.info("no RDMA devices: %s", e)
        return []
    return [d.name.decode() if isinstance(d.name, bytes) else str(d.name) for d in devices]


@dataclass(frozen=True)
class QpEndpoint:
    """What the other side needs to connect an RC queue pair to this one."""

    gid: str  # "fe80:0000:...": the port's GID at our gid_index
    lid: int  # port LID (InfiniBand; 0 on RoCE)
    qpn: int  # queue pair number
    psn: int  # first packet sequence number we send


def access_flags(verbs: Verbs) -> int:
    return int(
        verbs.IBV_ACCESS_LOCAL_WRITE | verbs.IBV_ACCESS_REMOTE_READ | verbs.IBV_ACCESS_REMOTE_WRITE
    )


def build_qp_init_attr(verbs: Verbs, cq: Any, max_send_wr: int) -> Any:
    cap = verbs.QPCap(max_send_wr=max_send_wr, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
    return verbs.QPInitAttr(qp_type=verbs.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap, sq_sig_all=0)


def build_init_attr(verbs: Verbs, port_num: int) -> Any:
    attr = verbs.QPAttr(qp_state=verbs.IBV_QPS_INIT)
    attr.pkey_index = 0
    attr.port_num = port_num
    attr.qp_access_flags = access_flags(verbs)
    return attr


def build_rtr_attr(
    verbs: Verbs, remote: QpEndpoint, port_num: int, gid_index: int, mtu: int
) -> Any:
    attr = verbs.QPAttr(qp_state=verbs.IBV_QPS_RTR)
    attr.path_mtu = mtu
    attr.dest_qp_num = remote.qpn
    attr.rq_psn = remote.psn
    attr.max_dest_rd_atomic = 16
    attr.min_rnr_timer = 12
    gr = verbs.GlobalRoute(dgid=verbs.GID(remote.gid), sgid_index=gid_index)
    attr.ah_attr = verbs.AHAttr(dlid=remote.lid, is_global=1, port_num=port_num, gr=gr)
    return attr


def build_rts_attr(verbs: Verbs, rtr_attr: Any, local_psn: int) -> Any:
    rtr_attr.timeout = 14  # 4.096 us * 2^14 = 67 ms per retry
    rtr_attr.retry_cnt = 7
    rtr_attr.rnr_retry = 7
    rtr_attr.sq_psn = local_psn
    rtr_attr.max_rd_atomic = 16
    return rtr_attr


def build_send_wr(verbs: Verbs, wr_id: int, is_write: bool, local_addr: int, length: int,
                  lkey: int, remote_addr: int, rkey: int) -> Any:  # fmt: skip
    sge = verbs.SGE(local_addr, length, lkey)
    opcode = verbs.IBV_WR_RDMA_WRITE if is_write else verbs.IBV_WR_RDMA_READ
    wr = verbs.SendWR(
        wr_id=wr_id, opcode=opcode, num_sge=1, sg=[sge], send_flags=verbs.IBV_SEND_SIGNALED
    )
    wr.set_wr_rdma(rkey, remote_addr)
    return wr


class RdmaNic:
    """One opened RDMA device (port `port_num`, GID `gid_index`) with one shared CQ."""

    def __init__(self, verbs: Verbs, name: str, port_num: int = 1, gid_index: int = 0,
                 cq_depth: int = 4096):  # fmt: skip
        self.verbs = verbs
        self.name = name
        self.port_num = port_num
        self.gid_index = gid_index
        self.ctx = verbs.Context(name=name)
        self.pd = verbs.PD(self.ctx)
        self.cq = verbs.CQ(self.ctx, cq_depth, None, None, 0)
        port = self.ctx.query_port(port_num)
        self.lid = int(port.lid)
        self.mtu = port.active_mtu
        self.gid = str(self.ctx.query_gid(port_num, gid_index).gid)

    def register(self, address: int, length: int) -> Any:
        """Register [address, address+length) for local and remote read/write; an MR."""
        return self.verbs.MR(self.pd, length, access_flags(self.verbs), address)

    def create_qp(self, max_send_wr: int) -> Any:
        """A new RC queue pair in INIT state."""
        qp = self.verbs.QP(self.pd, build_qp_init_attr(self.verbs, self.cq, max_send_wr))
        qp.to_init(build_init_attr(self.verbs, self.port_num))
        return qp

    def endpoint(self, qp: Any, psn: int) -> QpEndpoint:
        return QpEndpoint(self.gid, self.lid, int(qp.qp_num), psn)

    def connect(self, qp: Any, remote: QpEndpoint, local_psn: int) -> None:
        """Move `qp` to RTR (toward `remote`) and then RTS."""
        attr = build_rtr_attr(self.verbs, remote, self.port_num, self.gid_index, self.mtu)
        qp.to_rtr(attr)
        qp.to_rts(build_rts_attr(self.verbs, attr, local_psn))

    def post(self, qp: Any, wr_id: int, is_write: bool, local_addr: int, length: int,
             lkey: int, remote_addr: int, rkey: int) -> None:  # fmt: skip
        """Post one signalled RDMA READ or WRITE; raises verbs.PyverbsError if refused."""
        qp.post_send(build_send_wr(self.verbs, wr_id, is_write, local_addr, length, lkey,
                                   remote_addr, rkey))  # fmt: skip

    def poll(self, max_entries: int = 32) -> list[tuple[int, int]]:
        """Completed work requests as (wr_id, status); status == IBV_WC_SUCCESS if fine."""
        num, wcs = self.cq.poll(max_entries)
        return [(int(wc.wr_id), int(wc.status)) for wc in wcs[:num]]

    def close(self) -> None:
        for obj in (self.cq, self.pd, self.ctx):
            try:
                obj.close()
            except self.verbs.PyverbsError as e:  # pragma: no cover - device gone
                log.warning("closing %s on %s: %s", type(obj).__name__, self.name, e)
