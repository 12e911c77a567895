"""How an opened RDMA device is addressed: which port, which GID, and the device's limits.

- Port: the first ACTIVE one (a DOWN port's QPs never reach RTR).
- GID (RoCE): the GID table holds, per IP address of the port's netdev, one RoCEv1 and one
  RoCEv2 entry, and index 0 is the link-local RoCEv1 GID. Routed RoCEv2 fabrics need the
  IPv4-mapped (::ffff:a.b.c.d) RoCEv2 GID, as upstream Mooncake and NCCL pick it; failing
  that, any RoCEv2 GID, then anything non-zero (with a warning). `transfer.rdma_gid_index`
  overrides the choice. InfiniBand: index 0 (LID routing).
- Limits: read-atomic depths, queue and CQ sizes and the message size come from the device
  and port, and every request is clamped to them (an mlx5 refuses anything bigger).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from mooncake.errors import TransferError

log = logging.getLogger(__name__)

ZERO_GID = "0000:0000:0000:0000:0000:0000:0000:0000"
IPV4_MAPPED = "0000:0000:0000:0000:0000:ffff:"
WANT_RD_ATOMIC = 16  # read/atomic operations in flight per QP we ask for (mlx5 allows 16)


@dataclass(frozen=True)
class PortChoice:
    """The port and GID an RdmaNic uses."""

    port_num: int
    is_ethernet: bool  # RoCE (GRH on every packet) rather than InfiniBand
    gid_index: int
    gid: str
    lid: int
    mtu: int  # the port's active MTU (an ibv_mtu value: 1=256 ... 5=4096)
    max_msg_sz: int  # bytes one work request may move


@dataclass(frozen=True)
class DeviceLimits:
    max_qp_wr: int
    max_cqe: int
    max_rd_atomic: int  # initiator depth (max_qp_init_rd_atom)
    max_dest_rd_atomic: int  # responder resources (max_qp_rd_atom)


def device_limits(ctx: Any) -> DeviceLimits:
    attr = ctx.query_device()
    return DeviceLimits(
        int(attr.max_qp_wr),
        int(attr.max_cqe),
        min(WANT_RD_ATOMIC, int(attr.max_qp_init_rd_atom)),
        min(WANT_RD_ATOMIC, int(attr.max_qp_rd_atom)),
    )


def choose_port(verbs: Any, ctx: Any, name: str, gid_index: int) -> PortChoice:
    """The first ACTIVE port of device `name` and its GID (`gid_index` -1: choose one);
    raises TransferError naming each port's state when none is usable."""
    seen = []
    for port_num in range(1, int(ctx.query_device().phys_port_cnt) + 1):
        attr = ctx.query_port(port_num)
        if int(attr.state) != int(verbs.IBV_PORT_ACTIVE):
            seen.append(f"port {port_num} state {int(attr.state)}")
            continue
        ethernet = int(attr.link_layer) == int(verbs.IBV_LINK_LAYER_ETHERNET)
        index, gid = choose_gid(
            verbs, ctx, name, port_num, int(attr.gid_tbl_len), ethernet, gid_index
        )
        return PortChoice(
            port_num,
            ethernet,
            index,
            gid,
            int(attr.lid),
            int(attr.active_mtu),
            int(attr.max_msg_sz),
        )
    raise TransferError(
        f"RDMA device {name}: no ACTIVE port ({', '.join(seen) or 'no ports'}); check the "
        "cable and `ibv_devinfo`, or leave it out of transfer.nics"
    )


def choose_gid(
    verbs: Any, ctx: Any, name: str, port_num: int, table_len: int, ethernet: bool, override: int
) -> tuple[int, str]:
    """(index, gid) of the GID to use on `port_num` (see the module docstring)."""
    if override >= 0:
        gid = str(ctx.query_gid(port_num, override))
        if gid == ZERO_GID:
            raise TransferError(
                f"RDMA device {name} port {port_num}: GID index {override} "
                "(transfer.rdma_gid_index) is empty; see `show_gids`"
            )
        return override, gid
    if not ethernet:
        return 0, str(ctx.query_gid(port_num, 0))
    best: tuple[tuple[bool, bool, bool], int, str] | None = None
    v2 = int(verbs.IBV_GID_TYPE_SYSFS_ROCE_V2)
    for i in range(table_len):
        try:
            gid = str(ctx.query_gid(port_num, i))
            is_v2 = int(ctx.query_gid_type(port_num, i)) == v2
        except verbs.PyverbsError:  # NOTE: unused entries fail on some kernels
            continue
        if gid == ZERO_GID:
            continue
        rank = (is_v2, gid.startswith(IPV4_MAPPED), not gid.startswith("fe80"))
        if best is None or rank > best[0]:
            best = rank, i, gid
    if best is None:
        raise TransferError(
            f"RDMA device {name} port {port_num}: the GID table is empty; "
            "give its netdev an IP address"
        )
    if best[0] != (True, True, True):
        log.warning(
            "RDMA %s port %d: no IPv4 RoCEv2 GID, using index %d (%s); routed "
            "fabrics need one (set transfer.rdma_gid_index to override)",
            name,
            port_num,
            best[1],
            best[2],
        )
    return best[1], best[2]
