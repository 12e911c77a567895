"""Several instances per node (`[node] instances`): how one host's GPUs, ports, DRAM and SSD
are split among the node processes `mooncake up` starts for it (pure: no I/O).

An instance is a prefill or decode node in its own right: its own id (`<id>-<k>`), its own
GPUs (CUDA_VISIBLE_DEVICES: the k-th equal share of the parent's visible GPUs, by UUID),
its own slice of `node.port_range`, its own KV cache. What the node computes from the
whole host is resolved once, here, and split equally: `store.dram_bytes` and
`store.ssd_bytes` (a percentage of what the host has free), and on a CPU node the KV cache
when given as a percentage of the host's RAM. Resolving in the parent matters: instances
that start together would each take a percentage of what is free at their own moment (the
first half the host, the second half the rest); and an equal share each, rather than all
of it on instance 0, keeps each share on its instance's NUMA node (its GPUs' node) and
gives every instance local tiers to place its new KV objects in first.

    n = resolve_instances(cfg.node, "decode", num_gpus=8)   # auto: 8 (one per GPU)
    resolve_instances(cfg.node, "decode", 8, tensor_parallel=2)  # auto: 4 (2 GPUs each)
    split_gpus(uuids, 2)                                    # [[4 uuids], [4 uuids]]
    plans = plan_instances(cfg, "decode", n, uuids, "node-a", host)   # InstancePlan each
"""

from __future__ import annotations

from dataclasses import dataclass

from mooncake.config.portrange import KEY as PORT_RANGE_KEY
from mooncake.config.portrange import PortRange
from mooncake.config.settings import Config, NodeConfig
from mooncake.errors import ConfigError

KEY = "node.instances"


@dataclass(frozen=True)
class HostShare:
    """What the parent found on the host, to be split (bytes; 0 = tier off)."""

    dram_free_bytes: int  # RAM available now
    ssd_bytes: int = 0  # the SSD tier's size (store.ssd_bytes resolved), 0 = off
    ssd_path: str = ""  # its directory (one tier file per node id in it)


@dataclass(frozen=True)
class InstancePlan:
    """One instance: its id, its GPUs and the settings that differ from its parent's."""

    node_id: str
    cuda_visible_devices: str | None  # GPU UUIDs, comma-separated; None = as the parent's
    sets: tuple[str, ...]  # `--set KEY=VALUE` overrides of the parent's config


def resolve_instances(node: NodeConfig, role: str, num_gpus: int, tensor_parallel: int = 1) -> int:
    """How many instances to start: `node.instances`, or for auto the visible GPUs over
    the GPUs an instance drives (its `tensor_parallel` degree, resolved: the setting or
    the automatic one; 1 on a CPU node, and for master and store). Raises ConfigError for
    a master or store asked for more than one."""
    wanted = node.num_instances
    if role in ("master", "store"):
        if wanted is not None and wanted > 1:
            raise ConfigError(
                f"{KEY} = {wanted}: only prefill and decode nodes run several instances; a "
                f"{role} node runs once per host (size a store node's share of the pool with "
                'store.dram_bytes and store.ssd_bytes); set node.instances = "auto" or 1'
            )
        return 1
    if wanted is not None:
        return wanted
    return max(1, num_gpus // tensor_parallel)


def split_gpus(gpu_ids: list[str], n: int) -> list[list[str]]:
    """`gpu_ids` in `n` equal consecutive shares; [[]] * n on a CPU node (no GPU ids).
    Raises ConfigError when they do not divide evenly: instances of one node run the same
    model and settings, and unequal shares would give unequal KV caches (and, with tensor
    parallelism, unequal shards)."""
    if not gpu_ids:
        return [[] for _ in range(n)]
    if len(gpu_ids) % n:
        divisors = [d for d in range(1, len(gpu_ids) + 1) if len(gpu_ids) % d == 0]
        raise ConfigError(
            f"{KEY} = {n}: the {len(gpu_ids)} visible GPUs do not split into {n} equal shares; "
            f"choose one of {', '.join(map(str, divisors))}, or narrow CUDA_VISIBLE_DEVICES"
        )
    size = len(gpu_ids) // n
    return [gpu_ids[k * size : (k + 1) * size] for k in range(n)]


def split_ports(ports: PortRange, n: int) -> list[PortRange]:
    """`ports` in `n` equal consecutive ranges (the remainder unused); any port stays any.
    Raises ConfigError when the range has fewer ports than instances."""
    if ports.is_any:
        return [ports] * n
    size = (ports.high - ports.low + 1) // n
    if size < 1:
        raise ConfigError(
            f"{PORT_RANGE_KEY} = {ports}: {n} instances ({KEY}) need a range of at least "
            f"{n} ports, a share each (each instance needs one port per listener)"
        )
    return [PortRange(ports.low + k * size, ports.low + (k + 1) * size - 1) for k in range(n)]


def plan_instances(
    config: Config, role: str, n: int, gpu_ids: list[str], base_id: str, host: HostShare
) -> list[InstancePlan]:
    """The `n` instances of a `role` node whose id is `base_id`. Raises ConfigError when
    the GPUs or the port range do not split."""
    gpu_shares = split_gpus(gpu_ids, n)
    port_shares = split_ports(PortRange.parse(config.node.port_range), n)
    common = [f"{KEY}=1"]
    dram = config.store.dram_bytes.resolve(host.dram_free_bytes) // n
    common.append(f"store.dram_bytes={dram}")
    if host.ssd_bytes:
        common += [f"store.ssd_bytes={host.ssd_bytes // n}", f"store.ssd_path={host.ssd_path}"]
    else:
        common.append("store.ssd_bytes=0")
    kv_key = f"{role}.kv_cache_bytes"
    kv = config.prefill.kv_cache_bytes if role == "prefill" else config.decode.kv_cache_bytes
    if not gpu_ids and kv.fraction is not None:  # NOTE: on a GPU, a share of its own GPUs
        common.append(f"{kv_key}={kv.resolve(host.dram_free_bytes) // n}")
    plans = []
    for k, (gpus, ports) in enumerate(zip(gpu_shares, port_shares, strict=True)):
        node_id = f"{base_id}-{k}"
        sets = [f"node.id={node_id}", f"node.port_range={'' if ports.is_any else ports}"]
        plans.append(InstancePlan(node_id, ",".join(gpus) if gpus else None, (*sets, *common)))
    return plans
