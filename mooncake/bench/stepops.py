"""Ops dispatched and host syncs of one decode step, counted on a CPU.

A GPU step's cost at small batches is its launches and its waits for the host, and both
can be counted without a GPU: every aten op a step dispatches passes a
`TorchDispatchMode` (a Triton kernel, registered as a custom op, counts as one), and a
host sync is a read of a device value on the host: `aten._local_scalar_dense` (`.item()`,
`int(t)`, `bool(t)`), `.tolist()`, `.numpy()`, `aten.nonzero`/`masked_select` (their
output size needs the host), or a blocking copy from another device. On a CPU the device
is the host, so the counter also wraps the Python-level reads (`Tensor.tolist` and
friends) that never reach the dispatcher. What runs inside one counted op (the Triton
interpreter's own reads, an op's decomposition) is not counted again.

`python -m mooncake.bench.stepops --batches 1,8,32` prints
`{"step_ops": {"1": {"ops": N, "syncs": N}, ...}}` for `dummy:tiny` decode steps with
scattered block tables; `mooncake bench engine --parts step-ops` runs it in a child
process with TRITON_INTERPRET=1, so the Triton kernels run in Triton's interpreter.
"""

from __future__ import annotations

import argparse
import json
import os
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SYNC_OPS = {"aten._local_scalar_dense", "aten.nonzero", "aten.masked_select"}
HOST_READS = ("tolist", "item", "numpy", "__bool__", "__int__", "__float__", "__index__")


class StepCounter(TorchDispatchMode):
    """Counts dispatched ops and host syncs while active (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.syncs: Counter[str] = Counter()
        self._depth = 0  # > 0 inside a counted op or host read

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self._depth == 0:
            name = str(func.overloadpacket)
            name = name if name.startswith(("aten.", "mooncake.")) else f"aten.{name}"
            self.ops[name] += 1
            if name in SYNC_OPS or _is_blocking_copy(func, args, kwargs):
                self.syncs[name] += 1
        self._depth += 1
        try:
            return func(*args, **kwargs)
        finally:
            self._depth -= 1

    @contextmanager
    def host_reads(self) -> Iterator[None]:
        """Count `Tensor.tolist()` and the other Python-level reads of values."""
        originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}

        def wrap(name: str, orig: Callable[..., Any]) -> Callable[..., Any]:
            def read(t: torch.Tensor, *a: Any, **kw: Any) -> Any:
                if self._depth == 0:
                    self.syncs[f"Tensor.{name}"] += 1
                self._depth += 1
                try:
                    return orig(t, *a, **kw)
                finally:
                    self._depth -= 1

            return read

        for name, orig in originals.items():
            setattr(torch.Tensor, name, wrap(name, orig))
        try:
            yield
        finally:
            for name, orig in originals.items():
                setattr(torch.Tensor, name, orig)

    @property
    def num_ops(self) -> int:
        return sum(self.ops.values())

    @property
    def num_syncs(self) -> int:
        return sum(self.syncs.values())


def _is_blocking_copy(func: Any, args: Any, kwargs: dict[str, Any]) -> bool:
    """A copy between devices that the host waits for."""
    name = str(func.overloadpacket)
    if name not in ("aten._to_copy", "aten.copy_", "_to_copy", "copy_"):
        return False
    if kwargs.get("non_blocking") or (len(args) > 2 and args[2] is True):
        return False
    src = args[1] if name.endswith("copy_") else args[0]
    dst_device = args[0].device if name.endswith("copy_") else kwargs.get("device", src.device)
    return isinstance(src, torch.Tensor) and torch.device(dst_device) != src.device


def count(fn: Callable[[], Any]) -> StepCounter:
    """Run `fn` once under a fresh counter."""
    counter = StepCounter()
    with counter, counter.host_reads():
        fn()
    return counter


def decode_step_counts(
    batches: list[int],
    model_path: str = "dummy:tiny",
    backend: str = "auto",
    context: int = 64,
    block_tokens: int = 16,
    tensor_parallel: int = 1,
) -> dict[str, dict[str, Any]]:
    """{batch: {"ops", "syncs", ...}} of one decode step of `batch` sequences of about
    `context` tokens (their KV random, already in the cache) whose blocks are scattered
    (every other block of the cache is held by another owner), after a first step; with
    `tensor_parallel` > 1, rank 0's (follower processes run the other ranks)."""
    from mooncake.model.info import load_model_info
    from mooncake.model.weights import create_model

    info = load_model_info(model_path)
    if backend == "auto":
        backend = "triton" if os.environ.get("TRITON_INTERPRET") == "1" else "torch"
    model = create_model(info, "float32", "cpu", cpu_gemm="torch", attention_backend=backend)
    blocks_per_seq = -(-(context + 4) // block_tokens)
    num_blocks = 2 * max(batches) * blocks_per_seq + 2
    group = None
    if tensor_parallel > 1:
        from mooncake.model.tprun import TensorParallel

        group = TensorParallel.start(
            model,
            tensor_parallel,
            model_path=model_path,
            dtype="float32",
            num_blocks=num_blocks,
            block_tokens=block_tokens,
            cpu_gemm="torch",
        )
    try:
        return _counts(model, batches, context, block_tokens, num_blocks)
    finally:
        if group is not None:
            group.stop()


def _counts(
    model: Any, batches: list[int], context: int, block_tokens: int, num_blocks: int
) -> dict[str, dict[str, Any]]:
    from mooncake.model.decode import DecodeRunner
    from mooncake.model.kvcache import PagedKVCache
    from mooncake.model.params import SamplingParams
    from mooncake.model.sequence import Sequence

    vocab = model.spec.vocab_size
    out: dict[str, dict[str, Any]] = {}
    for batch in batches:
        cache = PagedKVCache.for_model(model, num_blocks, block_tokens)
        for t in cache.k + cache.v:
            t.normal_()  # stands in for the prompts' KV: what is counted never reads values
        held = cache.allocator.allocate(cache.num_blocks)
        assert held is not None
        cache.free(held[::2])  # the runner gets blocks 0, 2, 4, ...: none consecutive
        runner = DecodeRunner(model, cache, max_batch=batch)
        for i in range(batch):
            prompt = [(7 * i + j) % vocab for j in range(context - i % 3)]
            params = SamplingParams(
                max_tokens=8,
                temperature=0.0 if i % 2 else 0.8,
                top_p=0.9,
                seed=i,
                ignore_eos=True,
                logprobs=2 if i % 4 == 0 else None,
            )
            blocks = cache.allocate(len(prompt))
            runner.add(
                Sequence(i, prompt, params, block_ids=blocks, num_cached_tokens=len(prompt) - 1)
            )
        runner.step()  # admits everyone (their KV is "in the cache"), then one step
        assert len(runner.running) == batch, (len(runner.running), batch)
        c = count(runner.step)
        out[str(batch)] = {
            "ops": c.num_ops,
            "syncs": c.num_syncs,
            "sync_sites": dict(c.syncs),
            "backend": model.attention.name,
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--model", default="dummy:tiny")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--tensor-parallel", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(1)
    batches = [int(b) for b in args.batches.split(",")]
    counts = decode_step_counts(
        batches, args.model, args.backend, tensor_parallel=args.tensor_parallel
    )
    print(json.dumps({"step_ops": counts}))


if __name__ == "__main__":
    main()
