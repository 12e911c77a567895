"""The Triton paged attention on a real GPU: correct, and how fast against the hardware.

    python -m mooncake.engine.attention.gpucheck [--json] [--cpu-smoke]

At Llama-3-8B's attention shapes (32 query heads, 8 KV heads, head_dim 128, bf16):

- correctness: the Triton kernels against the torch reference computed in fp32 (an
  oracle), with the bf16 torch reference's own error beside for scale: decode B = 1, 32,
  128 at context 1k and 4k and a mixed batch (blocks of 16 and 512, scattered block
  tables, partial last blocks), and a 2k-token prefill chunk after an 8k prefix;
- decode speed, one layer: B = 1, 32, 128 x context 1k, 4k, 16k; microseconds per call
  launched eagerly and replayed from a CUDA graph, the KV bytes read per second as a share
  of the H200's 4.8 TB/s and of a device-to-device copy measured here (the practical
  ceiling, counting its reads and writes); split-KV against none at B = 1;
- the prefill chunk's TFLOP/s; the same calls through the torch reference (per-sequence
  SDPA), the baseline.

One JSON document on stdout; exit 1 if a check failed. Without a CUDA GPU it says so and
exits 0. `--cpu-smoke` runs every path at tiny shapes in fp32 on the CPU under Triton's
interpreter (the test suite does), so the script is exercised where no GPU is.
Imports only torch, triton and this package; about a minute and < 20 GB on an H200.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

HBM_GBPS = 4800.0  # H200 HBM3e, the vendor's datasheet


@dataclass(frozen=True)
class CheckConfig:
    """The shapes and sizes of one gpucheck run."""

    device: str
    dtype: torch.dtype
    num_heads: int
    num_kv_heads: int
    head_dim: int
    check_block_tokens: tuple[int, ...]  # block sizes checked for correctness
    check_batches: tuple[int, ...]  # decode batch sizes checked
    check_contexts: tuple[int, ...]  # tokens of context checked
    prefix_len: int  # tokens before the prefill chunk
    chunk_len: int  # tokens of the prefill chunk
    time_block_tokens: int
    time_batches: tuple[int, ...]
    time_contexts: tuple[int, ...]
    split_choices: tuple[int, ...]  # split-KV segments timed at B = 1
    copy_bytes: int  # bytes of the device-to-device copy
    oracle_dtype: torch.dtype  # what the reference computes in for the correctness oracle
    min_tolerance: float  # max abs error always accepted


LLAMA3_8B = CheckConfig(
    device="cuda",
    dtype=torch.bfloat16,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    check_block_tokens=(16, 512),
    check_batches=(1, 32, 128),
    check_contexts=(1024, 4096),
    prefix_len=8192,
    chunk_len=2048,
    time_block_tokens=16,
    time_batches=(1, 32, 128),
    time_contexts=(1024, 4096, 16384),
    split_choices=(1, 4, 16, 64),
    copy_bytes=2 << 30,
    oracle_dtype=torch.float32,
    min_tolerance=1e-2,
)
CPU_SMOKE = CheckConfig(
    device="cpu",
    dtype=torch.float32,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    check_block_tokens=(16, 32),
    check_batches=(1, 3),
    check_contexts=(40, 70),
    prefix_len=40,
    chunk_len=24,
    time_block_tokens=16,
    time_batches=(1, 3),
    time_contexts=(40, 130),
    split_choices=(1, 2),
    copy_bytes=1 << 20,
    oracle_dtype=torch.float64,
    min_tolerance=1e-5,
)


@dataclass
class Batch:
    """One paged batch: its queries, caches and metadata."""

    q: torch.Tensor  # (T, num_heads, head_dim)
    k_cache: torch.Tensor  # (num_blocks, block_tokens, num_kv_heads, head_dim)
    v_cache: torch.Tensor
    meta: Any  # AttentionMetadata

    @property
    def kv_bytes(self) -> int:
        """K and V bytes the batch's attention reads (each sequence's context once)."""
        k = self.k_cache
        per_token = k.shape[2] * k.shape[3] * k.element_size() * 2
        return int(self.meta.seq_lens.sum()) * per_token


def make_batch(
    cfg: CheckConfig, block_tokens: int, seq_lens: list[int], query_lens: list[int], seed: int
) -> Batch:
    """Random q and caches; each sequence's blocks drawn from a shuffled pool (scattered)."""
    from mooncake.engine.attention.metadata import create_metadata

    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // block_tokens) for n in seq_lens]
    order = torch.randperm(sum(need) + 1, generator=gen).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(order[at : at + n])
        at += n
    shape = (len(order), block_tokens, cfg.num_kv_heads, cfg.head_dim)
    torch.manual_seed(seed)
    k_cache = torch.randn(shape, dtype=cfg.dtype, device=cfg.device)
    v_cache = torch.randn(shape, dtype=cfg.dtype, device=cfg.device)
    q = torch.randn(
        sum(query_lens), cfg.num_heads, cfg.head_dim, dtype=cfg.dtype, device=cfg.device
    )
    meta = create_metadata(tables, seq_lens, query_lens, block_tokens, cfg.device)
    return Batch(q, k_cache, v_cache, meta)


def decode_batch(cfg: CheckConfig, block_tokens: int, batch: int, context: int) -> Batch:
    """`batch` decoding sequences of about `context` tokens, most with a partial last block."""
    seq_lens = [context - (7 * b) % block_tokens for b in range(batch)]
    return make_batch(cfg, block_tokens, seq_lens, [1] * batch, seed=batch * 131 + context)


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


def _attention(b: Batch, num_splits: int | None = None) -> Callable[[], Any]:
    from mooncake.engine.attention.triton_paged import paged_attention

    scale = b.q.shape[-1] ** -0.5
    return lambda: paged_attention(b.q, b.k_cache, b.v_cache, b.meta, scale, num_splits)


def _reference(b: Batch, dtype: torch.dtype | None = None) -> Callable[[], Any]:
    from mooncake.engine.attention.reference import attention_reference

    scale = b.q.shape[-1] ** -0.5
    return lambda: attention_reference(b.q, b.k_cache, b.v_cache, b.meta, scale, dtype)


def check_case(cfg: CheckConfig, case: dict[str, Any], b: Batch, num_splits: int | None) -> dict:
    """The Triton output's max abs error against the oracle, the torch reference's in
    cfg.dtype beside it, and whether the first is within tolerance."""
    from mooncake.engine.attention.triton_paged import choose_num_splits

    oracle = _reference(b, cfg.oracle_dtype)().float()
    got = _attention(b, num_splits)().float()
    ref = _reference(b)().float()
    err = (got - oracle).abs().max().item()
    ref_err = (ref - oracle).abs().max().item()
    splits = num_splits or choose_num_splits(b.meta, cfg.num_kv_heads)
    ok = bool(err <= max(2 * ref_err, cfg.min_tolerance))
    return {**case, "num_splits": splits, "max_abs_err": err, "ref_max_abs_err": ref_err, "ok": ok}


def correctness(cfg: CheckConfig) -> list[dict]:
    results = []
    for block_tokens in cfg.check_block_tokens:
        for batch in cfg.check_batches:
            for context in cfg.check_contexts:
                b = decode_batch(cfg, block_tokens, batch, context)
                case = {"case": "decode", "block_tokens": block_tokens, "batch": batch}
                case["context"] = context
                results.append(check_case(cfg, case, b, None))
                if batch == 1:  # the heuristic splits there: check the plain kernel too
                    results.append(check_case(cfg, case, b, 1))
                del b
        seq_len = cfg.prefix_len + cfg.chunk_len
        b = make_batch(cfg, block_tokens, [seq_len], [cfg.chunk_len], seed=block_tokens)
        case = {"case": "prefill", "block_tokens": block_tokens, "prefix": cfg.prefix_len}
        results.append(check_case(cfg, {**case, "chunk": cfg.chunk_len}, b, None))
        decodes = [cfg.check_contexts[0]] * cfg.check_batches[-1]
        seq_lens = decodes + [cfg.check_contexts[0] + cfg.chunk_len // 4]
        query_lens = [1] * len(decodes) + [cfg.chunk_len // 4]
        b = make_batch(cfg, block_tokens, seq_lens, query_lens, seed=7)
        case = {"case": "mixed", "block_tokens": block_tokens, "batch": len(seq_lens)}
        results.append(check_case(cfg, case, b, None))
        del b
    return results


def copy_gbps(cfg: CheckConfig) -> float:
    """A device-to-device copy's GB/s, counting the bytes read and the bytes written."""
    src = torch.empty(cfg.copy_bytes, dtype=torch.uint8, device=cfg.device)
    dst = torch.empty_like(src)
    us = time_us(lambda: dst.copy_(src), cfg.device)
    return 2 * cfg.copy_bytes / us / 1e3


def decode_speed(cfg: CheckConfig, ceiling_gbps: float) -> list[dict]:
    from mooncake.engine.attention.triton_paged import choose_num_splits

    rows = []
    for batch in cfg.time_batches:
        for context in cfg.time_contexts:
            b = decode_batch(cfg, cfg.time_block_tokens, batch, context)
            us = time_us(_attention(b), cfg.device)
            us_graph = graph_us(_attention(b), cfg.device)
            ref_us = time_us(_reference(b), cfg.device)
            best = us_graph or us
            gbps = b.kv_bytes / best / 1e3
            rows.append(
                {
                    "batch": batch,
                    "context": context,
                    "num_splits": choose_num_splits(b.meta, cfg.num_kv_heads),
                    "kv_bytes": b.kv_bytes,
                    "us": us,
                    "us_graph": us_graph,
                    "GBps": gbps,  # by the graph's time where there is one
                    "share_of_hbm": gbps / HBM_GBPS,
                    "share_of_copy": gbps / ceiling_gbps,
                    "ref_us": ref_us,
                    "speedup_vs_ref": ref_us / us,
                }
            )
            del b
    return rows


def split_vs_not(cfg: CheckConfig) -> list[dict]:
    """Decode at B = 1: each split-KV choice's time, and which the heuristic takes."""
    from mooncake.engine.attention.triton_paged import choose_num_splits

    rows = []
    for context in cfg.time_contexts:
        b = decode_batch(cfg, cfg.time_block_tokens, 1, context)
        by_splits = {}
        for splits in cfg.split_choices:
            us_graph = graph_us(_attention(b, splits), cfg.device)
            by_splits[str(splits)] = us_graph or time_us(_attention(b, splits), cfg.device)
        heuristic = choose_num_splits(b.meta, cfg.num_kv_heads)
        rows.append({"context": context, "heuristic": heuristic, "us_by_splits": by_splits})
        del b
    return rows


def prefill_speed(cfg: CheckConfig) -> dict:
    """The chunk after its prefix: time and TFLOP/s (QK^T and PV over the visible keys)."""
    seq_len, chunk = cfg.prefix_len + cfg.chunk_len, cfg.chunk_len
    b = make_batch(cfg, cfg.time_block_tokens, [seq_len], [chunk], seed=3)
    pairs = chunk * cfg.prefix_len + chunk * (chunk + 1) // 2  # (query, visible key) pairs
    flops = 4 * cfg.num_heads * cfg.head_dim * pairs
    us = time_us(_attention(b), cfg.device)
    ref_us = time_us(_reference(b), cfg.device)
    return {
        "prefix": cfg.prefix_len,
        "chunk": chunk,
        "block_tokens": cfg.time_block_tokens,
        "us": us,
        "TFLOPs": flops / us / 1e6,
        "ref_us": ref_us,
        "ref_TFLOPs": flops / ref_us / 1e6,
    }


def _section(report: dict, name: str, fn: Callable[[], Any]) -> None:
    """Runs one part; a failure is recorded in the report and the others still run."""
    try:
        report[name] = fn()
    except Exception as e:  # a report with the error beats no report on a leased GPU
        report[name] = {"error": f"{type(e).__name__}: {e}"}
        report["errors"].append(name)


def run(cfg: CheckConfig) -> dict:
    import triton

    start = time.perf_counter()
    report: dict[str, Any] = {"errors": []}
    report["device"] = torch.cuda.get_device_name() if cfg.device == "cuda" else "cpu"
    report["versions"] = {"torch": torch.__version__, "triton": triton.__version__}
    report["shapes"] = {
        "num_heads": cfg.num_heads,
        "num_kv_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "dtype": str(cfg.dtype).removeprefix("torch."),
    }
    _section(report, "correctness", lambda: correctness(cfg))
    _section(report, "copy_GBps", lambda: copy_gbps(cfg))
    report["hbm_GBps"] = HBM_GBPS
    ceiling = report["copy_GBps"] if isinstance(report["copy_GBps"], float) else HBM_GBPS
    _section(report, "decode", lambda: decode_speed(cfg, ceiling))
    _section(report, "split_vs_not", lambda: split_vs_not(cfg))
    _section(report, "prefill", lambda: prefill_speed(cfg))
    if cfg.device == "cuda":
        report["peak_memory_GB"] = torch.cuda.max_memory_allocated() / 1e9
    report["wall_s"] = time.perf_counter() - start
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="one compact JSON line")
    parser.add_argument(
        "--cpu-smoke", action="store_true", help="tiny shapes on the CPU, Triton interpreted"
    )
    args = parser.parse_args(argv)
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are defined
        torch.set_num_threads(1)
        cfg = CPU_SMOKE
    elif not torch.cuda.is_available():
        print("gpucheck needs a CUDA GPU (torch sees none); --cpu-smoke runs it on the CPU")
        return 0
    else:
        cfg = LLAMA3_8B
    report = run(cfg)
    print(json.dumps(report, indent=None if args.json else 2))
    failed = any(not c["ok"] for c in report["correctness"] if isinstance(c, dict))
    return 1 if failed or report["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
