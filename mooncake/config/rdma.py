"""The RDMA keys of the [transfer] section (`transfer.rdma_*`): addressing on routed RoCEv2
fabrics, queue depths and the responder's quota. `TransferConfig` inherits them, and
`EngineOptions.rdma` carries them to the rdma transport, so one struct serves both.

No `from __future__ import annotations` here: configdoc reads these annotations as objects.
"""

from typing import Annotated, Literal

import msgspec

from mooncake.config.knob import knob


# NOTE: the struct options spelled out (not configknob.STRUCT): TransferConfig inherits
# this struct, and mypy must see that it is frozen
class RdmaConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """RDMA settings of the Transfer Engine."""

    rdma_gid_index: Annotated[
        int,
        knob(
            "GID table index of the RDMA port; -1 = choose: the port's "
            "IPv4-mapped RoCEv2 GID (what routed RoCEv2 fabrics need; InfiniBand: 0). "
            "`show_gids` lists a node's GIDs.",
            ge=-1,
            le=255,
        ),
    ] = -1
    rdma_hop_limit: Annotated[
        int,
        knob(
            "IP hop limit (TTL) of RoCEv2 packets; 1 never crosses a router.",
            ge=1,
            le=255,
        ),
    ] = 64
    rdma_traffic_class: Annotated[
        int,
        knob(
            "IP traffic class of RoCEv2 packets (DSCP << 2), e.g. 106 for the "
            "DSCP 26 lossless class many fabrics configure for RoCE.",
            ge=0,
            le=255,
        ),
    ] = 0
    rdma_service_level: Annotated[
        int, knob("InfiniBand service level (RoCE: the VLAN priority).", ge=0, le=15)
    ] = 0
    rdma_queue_depth: Annotated[
        int,
        knob(
            "RDMA work requests in flight per queue pair (clamped to the "
            "device's max_qp_wr); more slices wait their turn.",
            ge=1,
        ),
    ] = 256
    rdma_cq_depth: Annotated[
        int,
        knob(
            "Completion queue entries per RDMA NIC (clamped to the device's "
            "max_cqe); work in flight on one NIC never exceeds it. The C data "
            "loop gives each CQ this many entries and adds CQs (up to 64 per "
            "NIC) as queue pairs need room.",
            ge=16,
        ),
    ] = 4096
    rdma_max_qps_per_peer: Annotated[
        int,
        knob(
            "Queue pairs one peer engine may open to this node; more "
            "RDMA_CONNECT requests are refused, naming this key.",
            ge=1,
        ),
    ] = 256
    rdma_data_loop: Annotated[
        Literal["auto", "c", "python"],
        knob(
            "Who posts and completes RDMA work: c = the C data loop (native/_rdmaloop.c: "
            "a target's requests as one batch of arrays, chains of work requests, no "
            "Python per slice; an error when it is not built or does not open every NIC); "
            "python = pyverbs, one work request per call (the reference); auto = c when "
            "it works, else python. MOONCAKE_NATIVE_RDMALOOP=0 turns the C loop off.",
        ),
    ] = "python"
