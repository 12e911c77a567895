"""Tensor parallelism inside a node: each rank holds a slice of every layer, and one step
runs on all ranks in lockstep (Megatron-LM's split of a transformer layer, as vLLM and
nano-vllm apply it):

    qkv_proj      column-parallel: rank r computes its query heads and their KV heads
                  (KV heads replicated when there are fewer of them than ranks)
    o_proj        row-parallel: a partial sum per rank, all-reduced
    gate_up_proj  column-parallel (its slice of the gate and of the up rows)
    down_proj     row-parallel, all-reduced
    experts       each expert split by width as gate_up/down; router replicated; all-reduced
    embed_tokens  vocab-parallel: rank r looks up ids in its rows, zeros else, all-reduced
    lm_head       vocab-parallel: rank r's logits of its rows, all-gathered

`shardplan` says which slice of each weight a rank holds. `weights.create_model(...,
tp=TPGroup(r, n))` loads rank r's slice only (what the followers and `mooncake serve`'s
rank 0 do); `shard_model` cuts a whole model already loaded (GGUF files; weights loaded or
drawn as at TP = 1, so TP = 1 and TP = N hold the same model) by the same plan, in place.
The paged KV cache of a rank holds its KV heads only (`local_kv_heads`). The degree:
`resolve_tensor_parallel` (`tpdegree`).

How the ranks run a step together (one process each, rank 0 leading) is `tprun`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from mooncake.errors import ConfigError
from mooncake.model.attention.backend import select_backend
from mooncake.model.cpugemm import pack_linears
from mooncake.model.llama import Model
from mooncake.model.shardplan import Cut, local_kv_heads, plan_cuts, vocab_rows
from mooncake.model.spec import ModelSpec
from mooncake.model.tpdegree import resolve_degree, shard_problem

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TPGroup:
    """This process's place in a tensor-parallel group."""

    rank: int
    size: int
    group: dist.ProcessGroup | None = None  # None: the default group

    def all_reduce(self, t: Tensor) -> Tensor:
        dist.all_reduce(t, group=self.group)
        return t

    def all_gather_cols(self, t: Tensor) -> Tensor:
        """(T, n * size) from every rank's (T, n), in rank order."""
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


def check_shardable(model: Model, size: int) -> None:
    """ConfigError unless `model` splits over `size` ranks (`tpdegree.shard_problem`)."""
    if why := shard_problem(model.spec, size):
        raise ConfigError(f"model.tensor_parallel = {size} does not divide {why}")


def resolve_tensor_parallel(setting: int, device: str, spec: ModelSpec, dtype: str) -> int:
    """Ranks of `model.tensor_parallel` = `setting` for a model of `spec` in `dtype` on
    `device` (0 = automatic: 1 on a CPU; on a GPU as `tpdegree.resolve_degree` sizes it by
    the visible GPUs' memory). Raises ConfigError when no degree fits."""
    gpu_bytes = []
    if device.startswith("cuda"):
        count = torch.cuda.device_count()
        gpu_bytes = [torch.cuda.get_device_properties(i).total_memory for i in range(count)]
    return resolve_degree(setting, spec, dtype, gpu_bytes)


class VocabParallelEmbedding(nn.Module):
    """Rows [lo, hi) of the embedding; the others' ids give zeros, summed over ranks."""

    def __init__(self, weight: Tensor, lo: int, tp: TPGroup):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.lo, self.hi, self.tp = lo, lo + weight.shape[0], tp

    def forward(self, ids: Tensor) -> Tensor:
        mine = (ids >= self.lo) & (ids < self.hi)
        local = torch.where(mine, ids - self.lo, torch.zeros_like(ids))
        out = nn.functional.embedding(local, self.weight) * mine[:, None].to(self.weight.dtype)
        return self.tp.all_reduce(out)


class VocabParallelHead(nn.Module):
    """Logits of rows [lo, lo + shard) per rank (the last shard padded with zero rows: its
    `Cut`), all-gathered."""

    def __init__(self, weight: Tensor, vocab: int, tp: TPGroup):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.vocab, self.tp = vocab, tp

    def forward(self, h: Tensor) -> Tensor:
        logits = nn.functional.linear(h, self.weight)
        return self.tp.all_gather_cols(logits)[:, : self.vocab]


@torch.no_grad()
def shard_model(model: Model, tp: TPGroup, block_tokens: int = 0, cpu_gemm: str = "torch") -> Model:
    """Cut `model` (whole, on its device, its CPU linears not packed: `create_model(...,
    cpu_gemm="torch")`) to rank `tp.rank`'s slice in place, then pack them as `cpu_gemm`
    says; returns it. A model already cut (`create_model(..., tp=...)` loads a rank's
    slice directly) is returned as it is."""
    if tp.size == 1 or model.tp_size > 1:
        return model
    check_shardable(model, tp.size)
    cut_model(model, tp)
    install_collectives(model, tp, cpu_gemm)
    param = next(model.parameters())
    model.attention = select_backend(
        model.attention.name,
        param.device,
        param.dtype,
        model.spec.num_heads // tp.size,
        model.num_kv_heads,
        model.spec.head_dim,
        block_tokens,
    )
    return model


def cut_model(model: Model, tp: TPGroup) -> dict[str, Cut]:
    """Replace each parameter of `model` (whole; real or on the meta device) by rank
    `tp.rank`'s `Cut` of it, the embedding and LM head by their vocab-parallel modules,
    and set the heads each attention computes; returns the cuts by parameter name (what
    `weights` fills a meta model's slices by). Changes `model`."""
    spec = model.spec
    shapes = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    cuts = plan_cuts(spec, shapes, tp.rank, tp.size)
    for name, cut in cuts.items():
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner)
        value = cut.apply(getattr(module, leaf))
        setattr(module, leaf, nn.Parameter(value, requires_grad=False))
    heads = spec.num_heads // tp.size
    kv_heads = local_kv_heads(spec.num_kv_heads, tp.size)
    d = spec.head_dim
    for layer in model.layers:
        attn: Any = layer.self_attn
        attn.num_heads, attn.num_kv_heads = heads, kv_heads
        attn.sizes = [heads * d, kv_heads * d, kv_heads * d]
    lo, _, _ = vocab_rows(spec.vocab_size, tp.rank, tp.size)
    if model.embed_tokens is not None:
        weight = model.embed_tokens.weight
        model.embed_tokens = VocabParallelEmbedding(weight, lo, tp)  # type: ignore[assignment]
    if model.lm_head is not None:
        weight = model.lm_head.weight
        model.lm_head = VocabParallelHead(weight, spec.vocab_size, tp)  # type: ignore[assignment]
    model.num_kv_heads = kv_heads
    model.tp_rank, model.tp_size = tp.rank, tp.size
    return cuts


def install_collectives(model: Model, tp: TPGroup, cpu_gemm: str) -> None:
    """Finish a cut model (its weights in place): pack its CPU linears as `cpu_gemm` says
    and all-reduce each attention's and MLP's (or experts') partial output. Changes
    `model`."""
    if next(model.parameters()).device.type == "cpu":
        pack_linears(model, cpu_gemm)
    for layer in model.layers:
        # NOTE: on the attention and MLP modules, which packing keeps (it swaps the
        # linears inside them): their outputs are o_proj's and down_proj's (or the
        # experts' summed) partial sums
        parts: list[Any] = [layer.self_attn, layer.mlp]
        for part in parts:
            part.register_forward_hook(lambda _m, _i, out: tp.all_reduce(out))


__all__ = [
    "TPGroup",
    "VocabParallelEmbedding",
    "VocabParallelHead",
    "check_shardable",
    "cut_model",
    "install_collectives",
    "local_kv_heads",
    "resolve_tensor_parallel",
    "shard_model",
]
