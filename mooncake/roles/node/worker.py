"""What prefill and decode nodes share: loading the model (or this stage's layers) on its
device, the paged KV cache (sized in roles/node/kvsize.py), the tokenizer, the prefix
hasher and the pool (Store) connection."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import psutil
import torch

from mooncake.config.portrange import node_ports
from mooncake.config.settings import Config
from mooncake.config.sizes import format_size
from mooncake.errors import ConfigError, RpcTimeout
from mooncake.hw.ssdplace import place_ssd
from mooncake.kv.hashing import PrefixHasher
from mooncake.kv.object import DTYPE_BYTES, KVLayout
from mooncake.kv.pool import StoreKVPool
from mooncake.model.info import ModelInfo, kv_fingerprint, load_model_info, resolve_dtype
from mooncake.model.kvcache import PagedKVCache
from mooncake.model.llama import Model
from mooncake.model.parallel import TPGroup, resolve_tensor_parallel
from mooncake.model.tokenizer import BaseTokenizer, create_tokenizer
from mooncake.model.tprun import TensorParallel
from mooncake.model.weights import create_model
from mooncake.roles.node.common import NodeContext
from mooncake.roles.node.kvsize import Role, cache_blocks, kv_cache_bytes, measure_gpu, sizing_for
from mooncake.rpc import RpcClient
from mooncake.store.client.client import Store
from mooncake.store.node.node import StoreNode, TierSizes
from mooncake.transfer import EngineOptions

log = logging.getLogger(__name__)


@dataclass
class Worker:
    """A model (or one pipeline stage of it) with its cache, on this node's device."""

    info: ModelInfo
    dtype: str
    model: Model
    cache: PagedKVCache
    tokenizer: BaseTokenizer
    hasher: PrefixHasher
    fingerprint: bytes
    tp: TensorParallel | None = None  # the other ranks, under tensor parallelism

    @property
    def tensor_parallel(self) -> int:
        return 1 if self.tp is None else self.tp.size

    def close(self) -> None:
        """Stop the other tensor-parallel ranks, if any."""
        if self.tp is not None:
            self.tp.stop()
            self.tp = None

    @property
    def layout(self) -> KVLayout:
        s = self.info.spec
        return KVLayout(
            s.num_layers, self.cache.block_tokens, s.num_kv_heads, s.head_dim, self.dtype
        )

    @property
    def max_model_len(self) -> int:
        return self.info.spec.max_position_embeddings


def device_for(ctx: NodeContext) -> str:
    """ "cuda:0" when torch sees a CUDA device, else "cpu". A GPU that NVML does not report
    (nvidia-ml-py missing, NVML failing, a MIG instance) is used all the same, with an error
    logged that names the fix: serving on this node's CPU beside an idle GPU would be orders
    of magnitude slower while looking healthy, and what NVML adds (the GPU's NUMA node and
    nearest NICs, its memory in the master's figures) only refines placement."""
    if not torch.cuda.is_available():
        return "cpu"
    if not ctx.visible_gpus:
        gpus, notes = ctx.topology.gpus, "; ".join(n for n in ctx.topology.notes if "GPU" in n)
        why = (
            f"NVML reports {len(gpus)} GPUs but none is torch's cuda:0"
            if gpus
            else f"NVML reports no GPU ({notes or 'nvidia-ml-py missing or NVML failing'})"
        )
        log.error(
            "torch sees %d CUDA devices but %s: running on cuda:0 without NVML's facts (the "
            "GPU's NUMA node and nearest NICs, its memory for the master); install "
            "nvidia-ml-py (pip install nvidia-ml-py) and run `mooncake doctor`",
            torch.cuda.device_count(),
            why,
        )
    return "cuda:0"


def load_worker(ctx: NodeContext, role: Role, layers: tuple[int, int] | None = None) -> Worker:
    """Build the model's layers [a, b) (all by default) and a KV cache of the role's
    `kv_cache_bytes`, sized after a warm-up on a GPU (roles/node/kvsize.py)."""
    cfg = ctx.config
    device = device_for(ctx)
    info = load_model_info(cfg.model.path)
    dtype = resolve_dtype(info, cfg.model.dtype, device)
    first, end = layers or (0, info.spec.num_layers)
    bt, s = cfg.model.block_tokens, info.spec
    stage = (first, end) != (0, s.num_layers)
    # NOTE: automatic on a pipeline stage: one rank (the stages split the layers instead)
    auto_one = stage and cfg.model.tensor_parallel == 0
    ranks = 1 if auto_one else resolve_tensor_parallel(cfg.model.tensor_parallel, device, s, dtype)
    if ranks > 1 and stage:
        raise ConfigError(
            f"model.tensor_parallel = {ranks}: a prefill node that is one stage of a "
            "pipeline group (prefill.pipeline_group_size > 1) runs one rank; use tensor "
            "parallelism or pipeline groups, not both"
        )
    model = create_model(
        info,
        dtype,
        device,
        (first, end),
        cpu_gemm=cfg.model.cpu_gemm,
        attention_backend=cfg.model.attention_backend,
        block_tokens=bt,
        tp=TPGroup(0, ranks) if ranks > 1 else None,  # NOTE: rank 0's slice only
    )
    tp = None
    if ranks > 1:
        tp = TensorParallel.start(
            model,
            ranks,
            model_path=cfg.model.path,
            dtype=dtype,
            num_blocks=0,  # NOTE: sized below, then `resize`d
            block_tokens=bt,
            cpu_gemm=cfg.model.cpu_gemm,
        )
    try:
        sizing = sizing_for(cfg, role, bt)
        if device == "cpu":
            num_bytes = kv_cache_bytes(sizing, psutil.virtual_memory().available, 0, on_gpu=False)
        else:
            mem = measure_gpu(model, sizing, bt, tp.resize if tp is not None else None)
            num_bytes = kv_cache_bytes(
                sizing, mem.free_bytes, mem.activation_peak_bytes, on_gpu=True
            )
        # NOTE: on a CPU node the ranks share the host's memory: the setting is all of theirs
        per_rank = num_bytes // ranks if device == "cpu" else num_bytes
        layer_bytes = PagedKVCache.block_bytes_per_layer(
            bt, model.num_kv_heads, s.head_dim, DTYPE_BYTES[dtype]
        )
        num_blocks = cache_blocks(per_rank, layer_bytes * (end - first), bt, sizing.key)
        cache = PagedKVCache.for_model(model, num_blocks, bt)
        if tp is not None:
            tp.resize(num_blocks)
    except BaseException:
        if tp is not None:
            tp.stop()
        raise
    fingerprint = kv_fingerprint(info, dtype)
    hasher = PrefixHasher(bt, ctx.secret, fingerprint)
    tokenizer = create_tokenizer(cfg.model.path, info.eos_token_ids)
    log.info(
        "model %s layers [%d, %d) on %s x %d, %s, %s attention, KV %s (%s): %d blocks of %d tokens",
        s.name,
        first,
        end,
        device,
        ranks,
        dtype,
        model.attention.name,
        format_size(num_bytes),
        sizing.size,
        num_blocks,
        bt,
    )
    return Worker(info, dtype, model, cache, tokenizer, hasher, fingerprint, tp)


def engine_options(cfg: Config) -> EngineOptions:
    return EngineOptions.from_config(cfg.transfer, ports=node_ports(cfg))


def mount_local_tiers(ctx: NodeContext) -> StoreNode | None:
    """This node's own share of the pool (DRAM, SSD) as a store node, or None if it gives
    nothing; mounted with the master before the node reports ready."""
    cfg = ctx.config.store
    vm = psutil.virtual_memory()
    ssd = place_ssd(cfg, ctx.topology.filesystems)
    sizes = TierSizes(
        vram_bytes=0,  # NOTE: prefill/decode VRAM holds their own KV caches
        dram_bytes=cfg.dram_bytes.resolve(vm.available),
        ssd_bytes=ssd.num_bytes if ssd else 0,
        ssd_path=ssd.path if ssd else "",
        dram_location=ctx.arena_location,
    )
    if not (sizes.dram_bytes or sizes.ssd_bytes):
        return None
    node = new_store_node(ctx, sizes)
    start_store_node(ctx, node)
    return node


def new_store_node(ctx: NodeContext, sizes: TierSizes) -> StoreNode:
    """This node's Store node (not mounted yet): its tiers, data plane and NICs."""
    return StoreNode(
        ctx.node_id,
        ctx.master_rpc,
        ctx.secret,
        sizes,
        host=ctx.host,
        engine_options=engine_options(ctx.config),
        nic_preference=ctx.nic_preference,
    )


def start_store_node(ctx: NodeContext, node: StoreNode) -> None:
    """Mount `node`'s tiers with the master, waiting up to `ctx.master_wait_s` for it to
    answer; raises RpcTimeout naming `cluster.master` and its value when it never does."""
    try:
        node.start(wait_s=ctx.master_wait_s)
    except RpcTimeout as e:
        raise RpcTimeout(f"cluster.master = {ctx.config.cluster.master}: {e}") from e


def connect_pool(
    ctx: NodeContext, worker: Worker, store_node: StoreNode | None
) -> tuple[Store, StoreKVPool]:
    """A Store client and the KV source/sink over it. With local tiers the client shares the
    store node's Transfer Engine (one engine per process and node id), so this node's own
    replicas are read in place and new objects are placed here first."""
    timeout_s = ctx.config.cluster.store_call_timeout_s
    wait_s, retry_s = ctx.config.store.put_wait_s, ctx.config.store.put_retry_s
    if store_node is None:
        store = Store.connect(
            ctx.master_rpc,
            ctx.secret,
            node_id=ctx.node_id,
            host=ctx.host,
            engine_options=engine_options(ctx.config),
            timeout_s=timeout_s,
            nic_preference=ctx.nic_preference,
            put_wait_s=wait_s,
            put_retry_s=retry_s,
        )
    else:
        master = RpcClient(
            ctx.master_rpc, ctx.secret, timeout_s=timeout_s, max_frame_bytes=64 << 20
        )
        store = Store(
            master, store_node.engine, timeout_s, 16 << 20, put_wait_s=wait_s, put_retry_s=retry_s
        )
    return store, StoreKVPool(store, worker.layout, worker.fingerprint)


def close_pool(store: Store, pool: StoreKVPool, store_node: StoreNode | None) -> None:
    """Stop the KV writer, then the client, then (if any) this node's tiers and engine."""
    pool.close()
    if store_node is None:
        store.close()
        return
    store.master.close()
    store_node.stop()
