"""The store role: this node's memory (a VRAM share, DRAM, SSD) in the KV pool, no model.

Its tiers are sized from config, as bytes or a share of what the topology reports free
(the SSD tier's directory configured or found: mooncake/hw/ssdplace.py),
mounted with the master's Store service (which heartbeats them and sends demote/promote/
evict instructions), and unmounted cleanly on SIGTERM.
"""

from __future__ import annotations

import logging

import psutil

from mooncake.errors import ConfigError
from mooncake.hw.ssdplace import place_ssd
from mooncake.roles.node.common import (
    MasterLink,
    NodeContext,
    install_signal_handlers,
    report_ready,
)
from mooncake.roles.node.messages import NodeInfoMsg, NodeLoadMsg
from mooncake.roles.node.worker import new_store_node, start_store_node
from mooncake.store.node.node import TierSizes

log = logging.getLogger(__name__)


def tier_sizes(ctx: NodeContext) -> TierSizes:
    """Resolve [store] sizes against what this node has free."""
    cfg = ctx.config.store
    gpu = ctx.gpu("cuda:0")  # torch's device 0: NVML's index differs under CUDA_VISIBLE_DEVICES
    vram = cfg.vram_bytes.resolve(gpu.memory_free_bytes) if gpu else 0
    ssd = place_ssd(cfg, ctx.topology.filesystems)
    sizes = TierSizes(
        vram_bytes=vram,
        dram_bytes=cfg.dram_bytes.resolve(psutil.virtual_memory().available),
        ssd_bytes=ssd.num_bytes if ssd else 0,
        ssd_path=ssd.path if ssd else "",
        vram_device="cuda:0",
        dram_location=ctx.arena_location,
    )
    if not (sizes.vram_bytes or sizes.dram_bytes or sizes.ssd_bytes):
        raise ConfigError(
            "store: this store node would give the pool nothing; set "
            "store.dram_bytes, store.vram_bytes or store.ssd_bytes"
        )
    return sizes


def run_store(ctx: NodeContext) -> None:
    install_signal_handlers(ctx.stop)
    sizes = tier_sizes(ctx)
    node = new_store_node(ctx, sizes)
    capacity = sizes.vram_bytes + sizes.dram_bytes + sizes.ssd_bytes
    ep = node.engine.endpoints[0]  # a store node serves no RPC: status shows its data plane
    host = f"[{ep.host}]" if ":" in ep.host else ep.host
    info = NodeInfoMsg(
        ctx.node_id, "store", "", ctx.gpu_names, ctx.nic_names, data_address=f"{host}:{ep.port}"
    )
    link = MasterLink(
        ctx, info, lambda: NodeLoadMsg(transfer_bytes=node.engine.bytes_by_transport())
    )
    try:
        start_store_node(ctx, node)
        link.register()
        link.start()
        link.state = "ready"
        link.beat()  # NOTE: in the pool once its ready line is out, not a heartbeat later
        report_ready(node_id=ctx.node_id, role="store", capacity_bytes=capacity)
        log.info("store node %s serves %d bytes (%s)", ctx.node_id, capacity, ", ".join(node.tiers))
        ctx.stop.wait()
    finally:
        link.deregister()
        node.stop()
