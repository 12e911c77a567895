"""The Triton paged attention on a real GPU: correct, and how fast against the hardware.

    python -m mooncake.model.attention.gpucheck [--json] [--cpu-smoke]

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
  SDPA), the baseline;
- tuning: other cuts (rows per program / keys per step / warps) of a decode batch and of
  the prefill chunk, beside the ones `choose_config` takes.

One JSON document on stdout; exit 1 if a check failed. Without a CUDA GPU it says so and
exits 0. `--cpu-smoke` runs every path at tiny shapes in fp32 on the CPU under Triton's
interpreter (the test suite does), so the script is exercised where no GPU is.
Imports only torch, triton and this package; meant to take < 2 minutes and < 20 GB on an
H200 (most of it Triton compiling about 25 kernel variants). Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from mooncake.model.attention.timing import copy_gbps, graph_us, time_us

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
    decode_cuts: tuple[tuple[int, int, int], ...]  # (block_m, tile, num_warps) tried
    prefill_cuts: tuple[tuple[int, int, int], ...]
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
    decode_cuts=((16, 16, 4), (16, 32, 4), (16, 64, 4), (16, 64, 8)),
    prefill_cuts=((64, 64, 4), (64, 64, 8), (128, 32, 8), (128, 64, 8)),
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
    decode_cuts=((16, 16, 4), (16, 64, 4)),
    prefill_cuts=((64, 32, 4), (128, 64, 8)),
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
    from mooncake.model.attention.metadata import create_metadata

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


def kernel_config(b: Batch, **changes: int) -> Any:
    """`choose_config`'s KernelConfig for the batch, with `changes` to its fields."""
    from mooncake.model.attention.triton_paged import choose_config

    q, k = b.q, b.k_cache
    config = choose_config(b.meta, q.shape[1], k.shape[2], q.shape[2], q.element_size())
    return replace(config, **changes)


def _attention(b: Batch, config: Any = None) -> Callable[[], Any]:
    from mooncake.model.attention.triton_paged import paged_attention

    scale = b.q.shape[-1] ** -0.5
    return lambda: paged_attention(b.q, b.k_cache, b.v_cache, b.meta, scale, config)


def _reference(b: Batch, dtype: torch.dtype | None = None) -> Callable[[], Any]:
    from mooncake.model.attention.reference import attention_reference

    scale = b.q.shape[-1] ** -0.5
    return lambda: attention_reference(b.q, b.k_cache, b.v_cache, b.meta, scale, dtype)


def check_case(cfg: CheckConfig, case: dict[str, Any], b: Batch, config: Any) -> dict:
    """The Triton output's max abs error against the oracle, the torch reference's in
    cfg.dtype beside it, and whether the first is within tolerance."""
    oracle = _reference(b, cfg.oracle_dtype)().float()
    got = _attention(b, config)().float()
    ref = _reference(b)().float()
    err = (got - oracle).abs().max().item()
    ref_err = (ref - oracle).abs().max().item()
    ok = bool(err <= max(2 * ref_err, cfg.min_tolerance))
    config = asdict(config or kernel_config(b))
    return {**case, "config": config, "max_abs_err": err, "ref_max_abs_err": ref_err, "ok": ok}


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
                    results.append(check_case(cfg, case, b, kernel_config(b, num_splits=1)))
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


def decode_speed(cfg: CheckConfig, ceiling_gbps: float) -> list[dict]:
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
                    "config": asdict(kernel_config(b)),
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
    rows = []
    for context in cfg.time_contexts:
        b = decode_batch(cfg, cfg.time_block_tokens, 1, context)
        by_splits = {}
        for splits in cfg.split_choices:
            run = _attention(b, kernel_config(b, num_splits=splits))
            by_splits[str(splits)] = graph_us(run, cfg.device) or time_us(run, cfg.device)
        heuristic = kernel_config(b).num_splits
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


def tuning(cfg: CheckConfig) -> dict:
    """Other cuts (rows per program / keys per step / warps) of one decode batch and of the
    prefill chunk: the data for retuning `choose_config`."""
    batch, context = cfg.time_batches[len(cfg.time_batches) // 2], cfg.time_contexts[1]
    b = decode_batch(cfg, cfg.time_block_tokens, batch, context)
    decode_us = {}
    for block_m, tile, warps in cfg.decode_cuts:
        run = _attention(b, kernel_config(b, block_m=block_m, tile=tile, num_warps=warps))
        decode_us[f"{block_m}/{tile}/{warps}"] = graph_us(run, cfg.device) or time_us(
            run, cfg.device
        )
    chosen = {"decode": asdict(kernel_config(b))}
    del b
    seq_len = cfg.prefix_len + cfg.chunk_len
    b = make_batch(cfg, cfg.time_block_tokens, [seq_len], [cfg.chunk_len], seed=3)
    prefill_us = {}
    for block_m, tile, warps in cfg.prefill_cuts:
        run = _attention(b, kernel_config(b, block_m=block_m, tile=tile, num_warps=warps))
        prefill_us[f"{block_m}/{tile}/{warps}"] = time_us(run, cfg.device)
    return {
        "decode_batch": batch,
        "decode_context": context,
        "decode_us": decode_us,  # by a CUDA graph's replay on a GPU
        "prefill_us": prefill_us,
        "chosen": {**chosen, "prefill": asdict(kernel_config(b))},  # choose_config's
    }


def _section(report: dict, name: str, fn: Callable[[], Any]) -> None:
    """Runs one part; a failure is recorded in the report and the others still run.
    Progress goes to stderr, so a run cut short still shows how far it came."""
    start = time.perf_counter()
    try:
        report[name] = fn()
    except Exception as e:  # a report with the error beats no report on a leased GPU
        report[name] = {"error": f"{type(e).__name__}: {e}"}
        report["errors"].append(name)
    status = "failed" if name in report["errors"] else "done"
    print(f"gpucheck: {name} {status} in {time.perf_counter() - start:.1f} s", file=sys.stderr)


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
    _section(report, "copy_GBps", lambda: copy_gbps(cfg.copy_bytes, cfg.device))
    report["hbm_GBps"] = HBM_GBPS
    ceiling = report["copy_GBps"] if isinstance(report["copy_GBps"], float) else HBM_GBPS
    _section(report, "decode", lambda: decode_speed(cfg, ceiling))
    _section(report, "split_vs_not", lambda: split_vs_not(cfg))
    _section(report, "prefill", lambda: prefill_speed(cfg))
    _section(report, "tuning", lambda: tuning(cfg))
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
