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

Rank 0 schedules and samples; before each forward it broadcasts the step (`Leader`: a
header of seven integers, then the step's int32 buffer, `step.Layout`), and every other
rank (`follow`) rebuilds the same step from it and runs the same forward, joining the
collectives. Process groups: gloo on CPU (how tests run it), NCCL on GPUs. Has not run on
GPUs (NCCL) yet.
"""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from mooncake.errors import ConfigError
from mooncake.model.attention.backend import StepPlan, select_backend
from mooncake.model.cpugemm import pack_linears
from mooncake.model.kvcache import PagedKVCache
from mooncake.model.llama import STEP_LOGITS, Model
from mooncake.model.shardplan import Cut, local_kv_heads, plan_cuts, vocab_rows
from mooncake.model.spec import ModelSpec
from mooncake.model.step import Layout, Step, StepBuilder, step_views_np
from mooncake.model.tpdegree import resolve_degree, shard_problem

log = logging.getLogger(__name__)

KIND_STOP = 3  # besides llama.STEP_LOGITS and STEP_LAYERS
HEADER = 7  # kind, num_tokens, num_seqs, width, max_query_len, max_seq_len, size


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


class Leader:
    """Rank 0's side: tells the other ranks each forward before running it."""

    def __init__(self, tp: TPGroup):
        self.tp = tp

    def __call__(self, kind: int, step: Step) -> None:
        lay = step.layout
        assert lay is not None, "a tensor-parallel step carries its layout"
        header = [kind, lay.num_tokens, lay.num_seqs, lay.width]
        header += [lay.max_query_len, lay.max_seq_len, lay.flat.numel()]
        dist.broadcast(torch.tensor(header, dtype=torch.int64), 0, group=self.tp.group)
        dist.broadcast(lay.flat, 0, group=self.tp.group)

    def stop(self) -> None:
        header = torch.tensor([KIND_STOP] + [0] * (HEADER - 1), dtype=torch.int64)
        dist.broadcast(header, 0, group=self.tp.group)


def plan_from_flat(
    flat: np.ndarray, layout: Layout, block_tokens: int, dtype: torch.dtype
) -> StepPlan:
    """The host's view of a step, read back from its int32 buffer."""
    _, _, _, lens, starts, tables = step_views_np(
        flat, layout.num_tokens, layout.num_seqs, layout.width
    )
    seq_lens = lens.tolist()
    query_lens = np.diff(starts).tolist()
    block_lists = [tables[b, : -(-n // block_tokens)].tolist() for b, n in enumerate(seq_lens)]
    return StepPlan(block_lists, seq_lens, query_lens, block_tokens, dtype)


@torch.inference_mode()
def follow(model: Model, cache: PagedKVCache, tp: TPGroup) -> None:
    """A rank > 0: run every forward rank 0 announces, until it says stop."""
    steps = StepBuilder(model, cache.block_tokens)
    device = model.inv_freq.device
    header = torch.empty(HEADER, dtype=torch.int64)
    while True:
        dist.broadcast(header, 0, group=tp.group)
        kind, num_tokens, num_seqs, width, max_q, max_seq, size = header.tolist()
        if kind == KIND_STOP:
            return
        flat = torch.empty(size, dtype=torch.int32, device=device)
        dist.broadcast(flat, 0, group=tp.group)
        layout = Layout(flat, num_tokens, num_seqs, width, max_q, max_seq)
        plan = None  # NOTE: read back to the host only for a backend that plans there
        if model.attention.plans_on_host:
            plan = plan_from_flat(flat.cpu().numpy(), layout, cache.block_tokens, steps.dtype)
        step = steps.derive(layout, plan)
        if kind == STEP_LOGITS:
            model(step, cache.layer)
        else:
            model.run_layers(step, cache.layer)


class TensorParallel:
    """Rank 0's handle on its group: the follower processes and the process group."""

    def __init__(self, procs: list, tp: TPGroup, leader: Leader):
        self.procs, self.tp, self.leader = procs, tp, leader

    @classmethod
    def start(
        cls,
        model: Model,
        size: int,
        *,
        model_path: str,
        dtype: str,
        num_blocks: int,
        block_tokens: int,
        cpu_gemm: str = "onednn",
    ) -> TensorParallel:
        """Spawn ranks 1..size-1 (each loads the model and keeps its slice), join them in
        a process group, cut `model` (created with cpu_gemm "torch") to rank 0's slice and
        make it announce each step."""
        import socket
        import subprocess
        import sys

        check_shardable(model, size)
        device = model.inv_freq.device
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        init = f"tcp://127.0.0.1:{port}"
        args = ["--world", str(size), "--init", init, "--model", model_path]
        args += ["--dtype", dtype, "--num-blocks", str(num_blocks)]
        args += ["--block-tokens", str(block_tokens), "--attention-backend", model.attention.name]
        args += ["--cpu-gemm", cpu_gemm, "--device", device.type]
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "mooncake.model.parallel", "--rank", str(r), *args],
                env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")},
            )
            for r in range(1, size)
        ]
        try:
            dist.init_process_group(_backend(device), init_method=init, rank=0, world_size=size)
        except BaseException:
            for p in procs:
                p.kill()
            raise
        tp = TPGroup(0, size)
        shard_model(model, tp, block_tokens, cpu_gemm)
        leader = Leader(tp)
        model.on_step = leader
        log.info("tensor parallel over %d ranks (%s)", size, _backend(device))
        return cls(procs, tp, leader)

    def stop(self) -> None:
        """Tell the followers to stop, reap them, leave the group."""
        try:
            self.leader.stop()
        finally:
            for p in self.procs:
                try:
                    p.wait(timeout=30)
                except Exception:
                    p.kill()
                    p.wait()
            dist.destroy_process_group()


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def main(argv: list[str] | None = None) -> None:
    """A follower rank: `python -m mooncake.model.parallel --rank R ...` (rank 0 starts it)."""
    from mooncake.model.info import load_model_info
    from mooncake.model.weights import create_model

    ap = argparse.ArgumentParser(description="a tensor-parallel follower rank")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--init", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", required=True)
    ap.add_argument("--num-blocks", type=int, required=True)
    ap.add_argument("--block-tokens", type=int, required=True)
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--cpu-gemm", default="onednn")
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args(argv)
    logging.basicConfig(level=os.environ.get("MOONCAKE_LOG_LEVEL", "WARNING").upper())
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    device = f"cuda:{a.rank}" if a.device == "cuda" else "cpu"
    if a.device == "cuda":
        torch.cuda.set_device(a.rank)
    info = load_model_info(a.model)
    tp = TPGroup(a.rank, a.world)
    model = create_model(  # NOTE: this rank's slice only
        info,
        a.dtype,
        device,
        cpu_gemm=a.cpu_gemm,
        attention_backend=a.attention_backend,
        block_tokens=a.block_tokens,
        tp=tp,
    )
    dist.init_process_group(
        _backend(torch.device(device)), init_method=a.init, rank=a.rank, world_size=a.world
    )
    cache = PagedKVCache.for_model(model, a.num_blocks, a.block_tokens)
    try:
        follow(model, cache, tp)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
