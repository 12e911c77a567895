"""Decode steps replayed as CUDA graphs: a step's hundreds of launches become one.

As vLLM and nano-vllm do (nanovllm/engine/model_runner.py `capture_cudagraph`, read for
its design): at start, for each batch-size bucket (1, 2, 4, 8, then every 16 up to
`decode.max_batch`), largest first, in one memory pool, one eager warm-up (it compiles
the Triton kernels) and one capture of the whole forward, from the step's int32 buffer
to the logits. A step then packs its integers on the host, copies them into the bucket's
static buffer (one non-blocking copy, `StepBuilder.upload`) and replays the graph; its
rows past the batch are padding (slot -1, nothing written) and are dropped.

What the capture fixes: the buffers' addresses (one flat int32 buffer laid out per
bucket), RoPE's tables (sized for the longest context first), the block table width
(`max_model_len` in blocks) and the kernels' cut, chosen for the longest context (split-KV
segments a short context leaves empty cost a program each and are merged as empty).
Only a backend that reads nothing from the host per step (`captures_graphs`: triton)
is captured; a batch above the largest bucket runs eagerly.

Has not run on a GPU yet: CPU tests check the same function for graph breaks
(`torch.compile(fullgraph=True)`) and against the eager step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from mooncake.model.kvcache import PagedKVCache
from mooncake.model.llama import Model
from mooncake.model.step import Layout, StepBuilder, flat_size

log = logging.getLogger(__name__)


def graph_buckets(max_batch: int) -> list[int]:
    """Batch sizes captured: 1, 2, 4, 8, then every 16 up to max_batch (and max_batch)."""
    sizes = [b for b in (1, 2, 4, 8) if b <= max_batch]
    sizes += range(16, max_batch + 1, 16)
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sorted(set(sizes))


def bucket_for(batch: int, buckets: list[int]) -> int | None:
    """The smallest bucket holding `batch` sequences, or None (run eagerly)."""
    return next((b for b in buckets if b >= batch), None)


def decode_fn(
    model: Model, cache: PagedKVCache, steps: StepBuilder, layout: Layout
) -> Callable[[], Tensor]:
    """The forward of a decode step laid out as `layout` (a bucket), reading only its
    device buffer: what a graph captures (and `torch.compile` checks for breaks)."""

    def forward() -> Tensor:
        return model(steps.derive(layout, None), cache.layer)

    return forward


class DecodeGraphs:
    """The captured decode graphs of one runner, by bucket."""

    def __init__(
        self,
        model: Model,
        cache: PagedKVCache,
        steps: StepBuilder,
        max_batch: int,
        max_model_len: int,
    ):
        assert model.attention.captures_graphs, model.attention.name
        self.model, self.cache, self.steps = model, cache, steps
        bt = cache.block_tokens
        self.width = -(-max_model_len // bt)
        self.max_len = self.width * bt
        self.buckets = graph_buckets(max_batch)
        model.rope_tables(self.max_len)  # NOTE: before any capture; never grown after
        device = model.inv_freq.device
        largest = self.buckets[-1]
        self.flat = torch.zeros(
            flat_size(largest, largest, self.width), dtype=torch.int32, device=device
        )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, Tensor] = {}
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for b in reversed(self.buckets):
                self.graphs[b], self.logits[b] = self._capture(b, pool)
        torch.cuda.synchronize()
        log.info("decode CUDA graphs captured for batches %s", self.buckets)

    def _capture(self, bucket: int, pool: Any) -> tuple[torch.cuda.CUDAGraph, Tensor]:
        self.steps.upload([], [], [], [], pad_to=bucket, width=self.width, out=self.flat)
        forward = decode_fn(self.model, self.cache, self.steps, self._layout(bucket))
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            forward()  # compiles the kernels; writes nothing (every slot is -1)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            logits = forward()
        return graph, logits

    def _layout(self, bucket: int) -> Layout:
        return Layout(self.flat, bucket, bucket, self.width, 1, self.max_len)

    def run(
        self, block_tables: list[list[int]], seq_lens: list[int], token_ids: list[int]
    ) -> Tensor | None:
        """(batch, vocab) logits of a decode step by graph replay; None when the batch
        is above the largest bucket (the caller runs it eagerly)."""
        bucket = bucket_for(len(seq_lens), self.buckets)
        if bucket is None:
            return None
        self.steps.upload(
            block_tables,
            seq_lens,
            [1] * len(seq_lens),
            token_ids,
            pad_to=bucket,
            width=self.width,
            out=self.flat,
        )
        self.graphs[bucket].replay()
        return self.logits[bucket][: len(seq_lens)]
