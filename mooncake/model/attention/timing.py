"""Timing on a GPU for the engine's kernel checks: mean microseconds per call with the L2
flushed between calls (triton's do_bench), per replay of a CUDA graph (the kernel without
Python's launch cost), and a device-to-device copy's GB/s (the practical ceiling of a
memory-bound kernel). On the CPU (gpucheck's --cpu-smoke) one timed call stands in.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch


def time_us(fn: Callable[[], Any], device: str) -> float:
    """Mean microseconds per call: triton's do_bench (L2 flushed between calls) on a GPU,
    one timed call after a warm-up on the CPU."""
    if device == "cpu":
        fn()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=40)) * 1e3


def graph_us(fn: Callable[[], Any], device: str) -> float | None:
    """Microseconds per call replayed from a CUDA graph (no Python launch cost); None on
    the CPU."""
    if device == "cpu":
        return None
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return time_us(graph.replay, device)


def copy_gbps(num_bytes: int, device: str) -> float:
    """A device-to-device copy's GB/s, counting the bytes read and the bytes written."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    us = time_us(lambda: dst.copy_(src), device)
    return 2 * num_bytes / us / 1e3
