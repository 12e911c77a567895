"""Tensor parallelism at run time: the ranks of one instance, one process each, running
every step together (the model's split across ranks is `parallel`).

Rank 0 schedules and samples; before each forward it broadcasts the step (`Leader`: a
header of seven integers, then the step's int32 buffer, `step.Layout`), and every other
rank (`Follower`) rebuilds the same step from it and runs the same forward, joining the
collectives. Besides forwards, rank 0 tells the others to (re)build their KV cache with so
many blocks (`KIND_CACHE`: the GPU warm-up's temporary cache, then the sized one), and,
on a prefill or decode node, to move it into the segments rank 0 registered with its
Transfer Engine (`KIND_ATTACH`, CPU: shared-memory arenas rank 0 allocated) or to export
it to rank 0 (`KIND_EXPORT`, GPU: CUDA IPC handles, which rank 0 registers where they
lie): rank 0's process then addresses every rank's KV, and a hand-off moves each rank's
heads between its memory and the NIC without passing through rank 0's (kv/heads.py).
`TensorParallel` is rank 0's handle: it spawns the others (`python -m
mooncake.model.tprun`), each loading only its slice.

Process groups: gloo on CPU (how tests run it); on GPUs NCCL for the tensors of a forward
and gloo beside it for the host-side messages ("cpu:gloo,cuda:nccl"). Has not run on GPUs
(NCCL, CUDA IPC) yet.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from mooncake.model.attention.backend import StepPlan
from mooncake.model.kvcache import PagedKVCache
from mooncake.model.llama import STEP_LAST_LOGITS, STEP_LOGITS, Model
from mooncake.model.parallel import TPGroup, check_shardable, shard_model
from mooncake.model.step import Layout, Step, StepBuilder, step_views_np

log = logging.getLogger(__name__)

# besides llama's STEP_LOGITS, STEP_LAYERS and STEP_LAST_LOGITS (the forwards):
KIND_STOP = 8  # leave the loop
KIND_CACHE = 9  # (re)build the KV cache with header[1] blocks (0: none)
KIND_ATTACH = 10  # CPU: map the cache onto rank 0's arenas (a msgpack payload of header[6])
KIND_EXPORT = 11  # GPU: send rank 0 CUDA IPC handles of the cache's tensors
HEADER = 7  # kind, num_tokens, num_seqs, width, max_query_len, max_seq_len, size


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
                [sys.executable, "-m", "mooncake.model.tprun", "--rank", str(r), *args],
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
    """A follower rank: `python -m mooncake.model.tprun --rank R ...` (rank 0 starts it)."""
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
