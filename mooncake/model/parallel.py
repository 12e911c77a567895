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
collectives. Besides forwards, rank 0 tells the others to (re)build their KV cache with so
many blocks (`KIND_CACHE`: the GPU warm-up's temporary cache, then the sized one), and,
on a prefill or decode node, to move it into the segments rank 0 registered with its
Transfer Engine (`KIND_ATTACH`, CPU: shared-memory arenas rank 0 allocated) or to export
it to rank 0 (`KIND_EXPORT`, GPU: CUDA IPC handles, which rank 0 registers where they
lie): rank 0's process then addresses every rank's KV, and a hand-off moves each rank's
heads between its memory and the NIC without passing through rank 0's (kv/heads.py).

Process groups: gloo on CPU (how tests run it); on GPUs NCCL for the tensors of a forward
and gloo beside it for the host-side messages ("cpu:gloo,cuda:nccl"). Has not run on GPUs
(NCCL, CUDA IPC) yet.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from mooncake.errors import ConfigError
from mooncake.model.attention.backend import StepPlan, select_backend
from mooncake.model.cpugemm import pack_linears
from mooncake.model.kvcache import PagedKVCache
from mooncake.model.llama import STEP_LAST_LOGITS, STEP_LOGITS, Model
from mooncake.model.shardplan import Cut, local_kv_heads, plan_cuts, vocab_rows
from mooncake.model.spec import ModelSpec
from mooncake.model.step import Layout, Step, StepBuilder, step_views_np
from mooncake.model.tpdegree import resolve_degree, shard_problem

log = logging.getLogger(__name__)

# besides llama's STEP_LOGITS, STEP_LAYERS and STEP_LAST_LOGITS (the forwards):
KIND_STOP = 8  # leave the loop
KIND_CACHE = 9  # (re)build the KV cache with header[1] blocks (0: none)
KIND_ATTACH = 10  # CPU: map the cache onto rank 0's arenas (a msgpack payload of header[6])
KIND_EXPORT = 11  # GPU: send rank 0 CUDA IPC handles of the cache's tensors
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
    """Rank 0's side: tells the other ranks each forward before running it, and what to
    do with their KV caches."""

    def __init__(self, tp: TPGroup):
        self.tp = tp

    def __call__(self, kind: int, step: Step) -> None:
        lay = step.layout
        assert lay is not None, "a tensor-parallel step carries its layout"
        header = [kind, lay.num_tokens, lay.num_seqs, lay.width]
        header += [lay.max_query_len, lay.max_seq_len, lay.flat.numel()]
        self._header(header)
        dist.broadcast(lay.flat, 0, group=self.tp.group)

    def command(self, kind: int, arg: int = 0, payload: bytes = b"") -> None:
        """A cache command (`KIND_CACHE`, `KIND_ATTACH`, `KIND_EXPORT`), with its bytes."""
        self._header([kind, arg, 0, 0, 0, 0, len(payload)])
        if payload:
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            dist.broadcast(data, 0, group=self.tp.group)

    def stop(self) -> None:
        self._header([KIND_STOP] + [0] * (HEADER - 1))

    def _header(self, values: list[int]) -> None:
        dist.broadcast(torch.tensor(values, dtype=torch.int64), 0, group=self.tp.group)


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


class Follower:
    """A rank > 0: runs every forward rank 0 announces on its slice and KV cache, until
    rank 0 says stop (`run`)."""

    def __init__(self, model: Model, block_tokens: int, num_blocks: int, tp: TPGroup):
        self.model, self.block_tokens, self.tp = model, block_tokens, tp
        self.cache: PagedKVCache | None = None
        self.arenas: list[Any] = []  # mapped arenas the cache lives in (KIND_ATTACH)
        self.steps = StepBuilder(model, block_tokens)
        self._resize(num_blocks)

    @torch.inference_mode()
    def run(self) -> None:
        device = self.model.inv_freq.device
        header = torch.empty(HEADER, dtype=torch.int64)
        while True:
            dist.broadcast(header, 0, group=self.tp.group)
            kind, num_tokens, num_seqs, width, max_q, max_seq, size = header.tolist()
            if kind == KIND_STOP:
                return
            if kind == KIND_CACHE:
                self._resize(num_tokens)
                continue
            if kind == KIND_ATTACH:
                self._attach(self._payload(size))
                continue
            if kind == KIND_EXPORT:
                self._export()
                continue
            flat = torch.empty(size, dtype=torch.int32, device=device)
            dist.broadcast(flat, 0, group=self.tp.group)
            layout = Layout(flat, num_tokens, num_seqs, width, max_q, max_seq)
            self._forward(kind, layout)

    def _forward(self, kind: int, layout: Layout) -> None:
        cache, model = self.cache, self.model
        assert cache is not None, "rank 0 announced a forward before sizing the KV cache"
        plan = None  # NOTE: read back to the host only for a backend that plans there
        if model.attention.plans_on_host:
            plan = plan_from_flat(
                layout.flat.cpu().numpy(), layout, self.block_tokens, self.steps.dtype
            )
        step = self.steps.derive(layout, plan)
        if kind == STEP_LOGITS:
            model(step, cache.layer)
        elif kind == STEP_LAST_LOGITS:  # NOTE: the LM head's all-gather, as on rank 0
            model.compute_logits(model.run_layers(step, cache.layer)[-1:])
        else:
            model.run_layers(step, cache.layer)

    def _payload(self, size: int) -> bytes:
        buf = torch.empty(size, dtype=torch.uint8)
        dist.broadcast(buf, 0, group=self.tp.group)
        return buf.numpy().tobytes()

    def _resize(self, num_blocks: int) -> None:
        self.cache, self.arenas = None, []
        if self.model.inv_freq.device.type == "cuda":
            torch.cuda.empty_cache()
        if num_blocks:
            self.cache = PagedKVCache.for_model(self.model, num_blocks, self.block_tokens)

    def _attach(self, payload: bytes) -> None:
        """Map the cache onto the shared-memory arenas rank 0 allocated for this rank
        (K then V of each layer, in order): rank 0 reads and writes them from now on."""
        from mooncake.native.shm import ShmArena

        cache = self.cache
        assert cache is not None, "rank 0 placed a KV cache that was never sized"
        names = msgspec.msgpack.decode(payload, type=dict[int, list[str]])[self.tp.rank]
        tensors = [t for pair in zip(cache.k, cache.v, strict=True) for t in pair]
        if len(names) != len(tensors):
            raise RuntimeError(f"rank 0 sent {len(names)} arenas for {len(tensors)} tensors")
        for i, (name, t) in enumerate(zip(names, tensors, strict=True)):
            arena = ShmArena.attach(name, t.numel() * t.element_size())
            self.arenas.append(arena)
            mapped = torch.from_numpy(arena.array[: t.numel() * t.element_size()])
            (cache.k if i % 2 == 0 else cache.v)[i // 2] = mapped.view(t.dtype).view(t.shape)

    def _export(self) -> None:
        """Send rank 0 CUDA IPC handles of the cache's tensors (K then V of each layer)."""
        cache = self.cache
        assert cache is not None, "rank 0 asked for a KV cache that was never sized"
        tensors = [t for pair in zip(cache.k, cache.v, strict=True) for t in pair]
        gather_bytes(msgspec.msgpack.encode([cuda_handle(t) for t in tensors]), self.tp)


def cuda_handle(t: Tensor) -> list[Any]:
    """What another process needs to map CUDA tensor `t` (torch.multiprocessing's IPC
    reduction, without pickle): the arguments of `rebuild_cuda_tensor` but the classes."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(t)
    _cls, size, stride, offset, _storage_cls, dtype, device, handle, *rest = args
    # rest: storage bytes and offset, requires_grad, ref counter handle and offset, event
    dtype_name = str(dtype).removeprefix("torch.")
    return [list(size), list(stride), offset, dtype_name, device, handle, *rest]


def map_cuda_handle(h: list[Any]) -> Tensor:
    """The tensor `cuda_handle` described, mapped into this process."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    size, stride, offset, dtype, device, handle, *rest = h
    return rebuild_cuda_tensor(
        torch.Tensor,
        torch.Size(size),
        tuple(stride),
        offset,
        torch.storage.TypedStorage,
        getattr(torch, dtype),
        device,
        handle,
        *rest,
    )


def gather_bytes(payload: bytes, tp: TPGroup) -> list[bytes]:
    """Every rank's `payload`, in rank order, on every rank (two all-gathers on the host)."""
    size = torch.tensor([len(payload)], dtype=torch.int64)
    sizes = [torch.empty_like(size) for _ in range(tp.size)]
    dist.all_gather(sizes, size, group=tp.group)
    longest = max(int(n) for n in sizes)
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    parts = [torch.empty_like(mine) for _ in range(tp.size)]
    dist.all_gather(parts, mine, group=tp.group)
    return [p[: int(n)].numpy().tobytes() for p, n in zip(parts, sizes, strict=True)]


class TensorParallel:
    """Rank 0's handle on its group: the follower processes and the process group."""

    def __init__(self, procs: list, tp: TPGroup, leader: Leader, model: Model, block_tokens: int):
        self.procs, self.tp, self.leader = procs, tp, leader
        self.model, self.block_tokens = model, block_tokens
        self.num_blocks = 0  # of the followers' caches (`resize`)

    @property
    def size(self) -> int:
        return self.tp.size

    def resize(self, num_blocks: int) -> None:
        """Every other rank (re)builds its KV cache with `num_blocks` blocks (0: none),
        as rank 0 does with its own."""
        self.leader.command(KIND_CACHE, num_blocks)
        self.num_blocks = num_blocks

    def place(self, engine: Any, prefix_of: Callable[[int], str]) -> list[PagedKVCache]:
        """Register ranks 1.. `size - 1`'s caches as `engine`'s segments (rank r's under
        `prefix_of(r)`, named as kv/handoff.py names them) and return them as this process
        addresses them: on CPU rank 0 allocates shared-memory arenas and the ranks move
        their caches into them; on GPUs the ranks export their caches (CUDA IPC) and rank
        0 registers them on their own GPUs. NOTE: the CUDA path has not run on GPUs."""
        from mooncake.kv.handoff import segment_name

        spec, model, bt = self.model.spec, self.model, self.block_tokens
        assert self.num_blocks, "resize() the followers' caches before placing them"
        layers = range(model.first_layer, model.end_layer)
        param = next(model.parameters())
        shape = (self.num_blocks, bt, model.num_kv_heads, spec.head_dim)
        num_bytes = int(np.prod(shape)) * param.element_size()
        caches: list[PagedKVCache] = []
        if param.device.type == "cpu":
            names: dict[int, list[str]] = {}
            for r in range(1, self.size):
                tensors, names[r] = [], []
                for layer in layers:
                    for half in ("k", "v"):
                        name = segment_name(prefix_of(r), layer, half)
                        arr = engine.allocate(name, num_bytes)
                        names[r].append(engine.segments.get(name).arena.name)
                        tensors.append(torch.from_numpy(arr).view(param.dtype).view(shape))
                caches.append(PagedKVCache.over(tensors[0::2], tensors[1::2], bt, layers))
            self.leader.command(KIND_ATTACH, payload=msgspec.msgpack.encode(names))
            return caches
        self.leader.command(KIND_EXPORT)
        handles = gather_bytes(b"", self.tp)
        for r in range(1, self.size):
            tensors = [map_cuda_handle(h) for h in msgspec.msgpack.decode(handles[r])]
            for i, t in enumerate(tensors):
                name = segment_name(prefix_of(r), layers[i // 2], "kv"[i % 2])
                engine.register(name, t, f"cuda:{t.device.index}")
            caches.append(PagedKVCache.over(tensors[0::2], tensors[1::2], bt, layers))
        return caches

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
        """Spawn ranks 1..size-1 (each loads its slice of the model and a KV cache of
        `num_blocks`, 0 = none until `resize`), join them in a process group and make
        `model`, rank 0's slice (`create_model(..., tp=TPGroup(0, size))`; a whole model
        created with cpu_gemm "torch" is cut here), announce each step."""
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
        group = cls(procs, tp, leader, model, block_tokens)
        group.num_blocks = num_blocks
        return group

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
    # NOTE: the step's header and the cache commands are host tensors: gloo carries them
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


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
    try:
        Follower(model, a.block_tokens, a.num_blocks, tp).run()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
