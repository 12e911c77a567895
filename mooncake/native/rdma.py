"""RDMA verbs through pyverbs: the only module that imports it.

`load_pyverbs()` gathers the pyverbs classes this project calls into one `Verbs` namespace,
so the transport can run on the real library or on a fake with the same names (tests).
`RdmaNic` wraps one opened device (its port, GID and limits: native/rdmaaddr.py):
protection domain, completion queue, memory registration, RC queue pairs and their
INIT -> RTR -> RTS transitions, posting one-sided READ/WRITE work requests, moving a QP to
the error state, and polling completions. Every pyverbs error becomes a TransferError naming
the device and the call. `open_nics` calls `fork_init` before anything is registered (the
engine's processes fork) and skips, with a warning, a device that does not open. The
`build_*` functions only construct attribute objects, so they can be checked against the
real pyverbs without a device.
"""

from __future__ import annotations

import errno
import importlib
import logging
import os
import resource
import sys
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from mooncake.config.rdma import RdmaConfig
from mooncake.errors import TransferError
from mooncake.native import cudadmabuf
from mooncake.native.rdmaaddr import choose_port, device_limits

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
    "pyverbs.fork": ("fork_init",),
}
USED_ENUMS = (
    "IBV_QPT_RC",
    "IBV_QPS_INIT",
    "IBV_QPS_RTR",
    "IBV_QPS_RTS",
    "IBV_ACCESS_LOCAL_WRITE",
    "IBV_ACCESS_REMOTE_READ",
    "IBV_ACCESS_REMOTE_WRITE",
    "IBV_WR_RDMA_READ",
    "IBV_WR_RDMA_WRITE",
    "IBV_SEND_SIGNALED",
    "IBV_WC_SUCCESS",
    "IBV_QPS_ERR",
    "IBV_QP_STATE",
    "IBV_PORT_ACTIVE",
    "IBV_LINK_LAYER_ETHERNET",
    "IBV_GID_TYPE_SYSFS_ROCE_V2",
    "IBV_WC_WR_FLUSH_ERR",
    "IBV_WC_LOC_LEN_ERR",
    "IBV_WC_LOC_QP_OP_ERR",
    "IBV_WC_LOC_PROT_ERR",
    "IBV_WC_LOC_ACCESS_ERR",
    "IBV_WC_REM_INV_REQ_ERR",
    "IBV_WC_REM_ACCESS_ERR",
)
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
    ns["DmaBufMR"] = getattr(importlib.import_module("pyverbs.mr"), "DmaBufMR", None)  # optional
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
    mtu: int  # our port's active MTU (ibv_mtu); the path uses the smaller of both
    rd_atomic: int  # RDMA READs we accept in flight on this QP (responder resources)


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


@dataclass(frozen=True)
class Route:
    """How our packets reach a peer: GRH fields (RoCE, routed IB), MTU and read depths."""

    port_num: int
    gid_index: int
    mtu: int  # negotiated: min of both ports' active MTU
    hop_limit: int = 64
    traffic_class: int = 0
    service_level: int = 0
    max_dest_rd_atomic: int = 16  # READs the peer may have in flight on our QP
    max_rd_atomic: int = 16  # READs we may have in flight (<= the peer's responder resources)


def build_rtr_attr(verbs: Verbs, remote: QpEndpoint, route: Route) -> Any:
    attr = verbs.QPAttr(qp_state=verbs.IBV_QPS_RTR)
    attr.path_mtu = route.mtu
    attr.dest_qp_num = remote.qpn
    attr.rq_psn = remote.psn
    attr.max_dest_rd_atomic = route.max_dest_rd_atomic
    attr.min_rnr_timer = 12
    gr = verbs.GlobalRoute(
        dgid=verbs.GID(remote.gid),
        sgid_index=route.gid_index,
        hop_limit=route.hop_limit,
        traffic_class=route.traffic_class,
    )
    attr.ah_attr = verbs.AHAttr(
        dlid=remote.lid, sl=route.service_level, is_global=1, port_num=route.port_num, gr=gr
    )
    return attr


def build_rts_attr(verbs: Verbs, rtr_attr: Any, local_psn: int, max_rd_atomic: int) -> Any:
    rtr_attr.timeout = 14  # 4.096 us * 2^14 = 67 ms per retry
    rtr_attr.retry_cnt = 7
    rtr_attr.rnr_retry = 7
    rtr_attr.sq_psn = local_psn
    rtr_attr.max_rd_atomic = max_rd_atomic
    return rtr_attr


def build_send_wr(
    verbs: Verbs,
    wr_id: int,
    is_write: bool,
    local_addr: int,
    length: int,
    lkey: int,
    remote_addr: int,
    rkey: int,
) -> Any:
    sge = verbs.SGE(local_addr, length, lkey)
    opcode = verbs.IBV_WR_RDMA_WRITE if is_write else verbs.IBV_WR_RDMA_READ
    wr = verbs.SendWR(
        wr_id=wr_id, opcode=opcode, num_sge=1, sg=[sge], send_flags=verbs.IBV_SEND_SIGNALED
    )
    wr.set_wr_rdma(rkey, remote_addr)
    return wr


def open_nics(
    verbs: Verbs, names: list[str], settings: RdmaConfig, data_plane: bool = True
) -> dict[str, RdmaNic]:
    """The devices of `names` that open, by name; the others are skipped with a warning.
    Calls fork_init first: memory registered before it is corrupted in forked children.
    `data_plane` False: discovery only (RdmaNic)."""
    try:
        verbs.fork_init()
    except verbs.PyverbsError as e:  # NOTE: fails once memory is registered; harmless after
        log.warning("ibv_fork_init failed (%s); forked children may corrupt RDMA memory", e)
    nics = {}
    for name in names:
        try:
            nics[name] = RdmaNic(verbs, name, settings, data_plane)
        except TransferError as e:
            log.warning("RDMA device %s skipped: %s", name, e)
    return nics


class RdmaNic:
    """One opened RDMA device: its ACTIVE port and GID, one PD and one shared CQ."""

    def __init__(self, verbs: Verbs, name: str, settings: RdmaConfig, data_plane: bool = True):
        """`data_plane` False: discovery only (port, GID, limits), no PD and no CQ: the C
        data loop (transfer/rdmaloop.py) opens the device again for those."""
        self.verbs = verbs
        self.name = name
        self.settings = settings
        self.ctx = self.call("open (ibv_open_device)", verbs.Context, name=name)
        self.pd: Any = None  # the data plane's (None: discovery only)
        self.cq: Any = None
        try:
            self.limits = self.call("query_device", device_limits, self.ctx)
            self.port = self.call(
                "query_port", choose_port, verbs, self.ctx, name, settings.rdma_gid_index
            )
            self.cq_depth = min(settings.rdma_cq_depth, self.limits.max_cqe)
            if data_plane:
                self.pd = self.call("alloc_pd", verbs.PD, self.ctx)
                self.cq = self.call("create_cq", verbs.CQ, self.ctx, self.cq_depth, None, None, 0)
        except BaseException:
            self.ctx.close()
            raise
        self.queue_depth = min(settings.rdma_queue_depth, self.limits.max_qp_wr)

    @property
    def gid(self) -> str:
        return self.port.gid

    def call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """fn(*args, **kwargs), a pyverbs error raised as TransferError naming NIC and call."""
        try:
            return fn(*args, **kwargs)
        except self.verbs.PyverbsError as e:
            raise TransferError(f"RDMA {self.name}: {what} failed: {e}") from e

    def register(self, address: int, length: int, device: bool = False) -> tuple[Any, int]:
        """Register [address, address+length) for local and remote read/write: (MR, the
        address work requests name its first byte by). Device memory goes through
        nvidia-peermem (a plain MR), else as a dma-buf (its addresses start at the offset)."""
        try:
            return self.verbs.MR(self.pd, length, access_flags(self.verbs), address), address
        except self.verbs.PyverbsError as e:
            if device:
                return self._register_dmabuf(address, length, e)
            hint = ""
            if getattr(e, "error_code", 0) in (errno.ENOMEM, errno.EPERM):
                soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
                shown = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft} bytes"
                hint = (
                    f"; pinning {length} bytes hit the locked-memory limit ({shown}): "
                    "raise it (`ulimit -l unlimited`, LimitMEMLOCK=infinity in a systemd "
                    "unit, --ulimit memlock=-1 for docker)"
                )
            raise TransferError(
                f"RDMA {self.name}: reg_mr of {length} bytes failed: {e}{hint}"
            ) from e

    def _register_dmabuf(self, address: int, length: int, peermem: Exception) -> tuple[Any, int]:
        if getattr(self.verbs, "DmaBufMR", None) is None:
            raise TransferError(
                f"RDMA {self.name}: reg_mr of GPU memory failed ({peermem}) and "
                "this pyverbs has no DmaBufMR: load nvidia-peermem"
            )
        fd, offset = cudadmabuf.export_dmabuf(address, length)
        try:
            mr = self.call(
                "reg_dmabuf_mr",
                self.verbs.DmaBufMR,
                self.pd,
                length,
                access_flags(self.verbs),
                dmabuf=fd,
                offset=offset,
            )
        finally:
            os.close(fd)
        log.info(
            "RDMA %s: GPU memory registered as dma-buf (no nvidia-peermem: %s)", self.name, peermem
        )
        return mr, offset  # NOTE: pyverbs registers it at iova = offset

    def create_qp(self) -> Any:
        """A new RC queue pair in INIT state (closed again if INIT fails)."""
        attr = build_qp_init_attr(self.verbs, self.cq, self.queue_depth)
        qp = self.call("create_qp", self.verbs.QP, self.pd, attr)
        try:
            self.call(
                "modify_qp(INIT)", qp.to_init, build_init_attr(self.verbs, self.port.port_num)
            )
        except TransferError:
            qp.close()
            raise
        return qp

    def endpoint(self, qp: Any, psn: int) -> QpEndpoint:
        return QpEndpoint(
            self.gid,
            self.port.lid,
            int(qp.qp_num),
            psn,
            self.port.mtu,
            self.limits.max_dest_rd_atomic,
        )

    def connect(self, qp: Any, remote: QpEndpoint, local_psn: int) -> None:
        """Move `qp` to RTR (toward `remote`, MTU the smaller of both) and then RTS."""
        route = self.route_to(remote)
        attr = build_rtr_attr(self.verbs, remote, route)
        self.call("modify_qp(RTR)", qp.to_rtr, attr)
        rts = build_rts_attr(self.verbs, attr, local_psn, route.max_rd_atomic)
        self.call("modify_qp(RTS)", qp.to_rts, rts)

    def route_to(self, remote: QpEndpoint) -> Route:
        """Our port, GID and settings toward `remote`: the smaller MTU and read depth."""
        s = self.settings
        return Route(
            self.port.port_num,
            self.port.gid_index,
            min(self.port.mtu, remote.mtu),
            s.rdma_hop_limit,
            s.rdma_traffic_class,
            s.rdma_service_level,
            self.limits.max_dest_rd_atomic,
            max(1, min(self.limits.max_rd_atomic, remote.rd_atomic)),
        )

    def post(
        self,
        qp: Any,
        wr_id: int,
        is_write: bool,
        local_addr: int,
        length: int,
        lkey: int,
        remote_addr: int,
        rkey: int,
    ) -> None:
        """Post one signalled RDMA READ or WRITE; raises TransferError if refused."""
        wr = build_send_wr(self.verbs, wr_id, is_write, local_addr, length, lkey, remote_addr, rkey)
        self.call("post_send", qp.post_send, wr)

    def to_error(self, qp: Any) -> None:
        """Move `qp` to the error state: its outstanding work completes with WR_FLUSH_ERR."""
        attr = self.verbs.QPAttr(qp_state=self.verbs.IBV_QPS_ERR)
        self.call("modify_qp(ERR)", qp.modify, attr, self.verbs.IBV_QP_STATE)

    def poll(self, max_entries: int = 32) -> list[tuple[int, int, int]]:
        """Completed work requests as (wr_id, status, vendor_err)."""
        num, wcs = self.call("poll_cq", self.cq.poll, max_entries)
        return [(int(wc.wr_id), int(wc.status), int(wc.vendor_err)) for wc in wcs[:num]]

    def close(self) -> None:
        """Close the CQ, PD and device (pyverbs closes their QPs and MRs first)."""
        for obj in (self.cq, self.pd, self.ctx):
            if obj is None:
                continue
            try:
                obj.close()
            except self.verbs.PyverbsError as e:  # pragma: no cover - device gone
                log.warning("closing %s on %s: %s", type(obj).__name__, self.name, e)
