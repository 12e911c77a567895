"""Is the GPU engine right? Two checks, each with an `ok`:

- greedy tokens: `check_model` (`dummy:tiny`, float32) decodes a few prompts of
  different lengths in one batch through `DecodeRunner` on the CPU with the torch
  attention (the reference) and on the GPU with the Triton attention, eager and with
  CUDA graphs; the tokens must be equal. Random weights leave the top logits close, but
  float32 (the Triton kernels use IEEE dots for it) keeps the two within rounding, far
  below those gaps. In `--cpu-smoke` the candidate is the Triton path on the CPU.
- attention: `attention/gpucheck.py`'s correctness cases at Llama-3-8B's shapes in bf16
  (decode at B = 1, 32, 128, a 2k chunk after an 8k prefix, a mixed batch), against an
  fp32 oracle with the bf16 reference's own error for scale.
"""

from __future__ import annotations

from typing import Any

from mooncake.model.attention import gpucheck
from mooncake.model.decode import DecodeRunner
from mooncake.model.info import load_model_info
from mooncake.model.kvcache import PagedKVCache
from mooncake.model.params import SamplingParams
from mooncake.model.sequence import Sequence
from mooncake.model.weights import create_model

from .bed import progress
from .config import BenchConfig


def greedy_tokens(
    cfg: BenchConfig, device: str, backend: str, cuda_graphs: bool
) -> list[list[int]]:
    """Each prompt's greedy tokens, all the prompts decoded in one batch."""
    lens = cfg.check_prompt_lens
    model = create_model(
        load_model_info(cfg.check_model), "float32", device, attention_backend=backend
    )
    vocab = model.spec.vocab_size
    bt, max_len = cfg.block_tokens, max(lens) + cfg.check_tokens + 1
    cache = PagedKVCache.for_model(model, len(lens) * -(-max_len // bt), bt)
    runner = DecodeRunner(
        model, cache, max_batch=len(lens), cuda_graphs=cuda_graphs, max_model_len=max_len
    )
    params = SamplingParams(max_tokens=cfg.check_tokens, temperature=0, ignore_eos=True)
    for i, n in enumerate(lens):
        runner.add(Sequence(i, [(37 * i + 11 * j) % vocab for j in range(n)], params))
    events = runner.run_until_done()
    return [[e.token_id for e in events[i] if e.token_id is not None] for i in range(len(lens))]


def first_mismatches(got: list[list[int]], want: list[list[int]]) -> list[int | None]:
    """Per prompt, the index of the first token that differs (None: all equal)."""
    return [
        next((j for j, (a, b) in enumerate(zip(g, w, strict=False)) if a != b), None)
        if g != w
        else None
        for g, w in zip(got, want, strict=True)
    ]


def run_correctness(cfg: BenchConfig) -> dict[str, Any]:
    """Both checks; `ok` when every case passed."""
    want = greedy_tokens(cfg, "cpu", "torch", cuda_graphs=False)
    candidates = [(cfg.device, "triton", False)]
    if cfg.is_gpu:
        candidates.append((cfg.device, "triton", True))
    cases = []
    for device, backend, graphs in candidates:
        got = greedy_tokens(cfg, device, backend, graphs)
        mismatch = first_mismatches(got, want)
        ok = all(m is None for m in mismatch) and all(len(g) == cfg.check_tokens for g in got)
        cases.append(
            {
                "device": device,
                "backend": backend,
                "cuda_graphs": graphs,
                "ok": ok,
                "first_mismatch": mismatch,  # per prompt
            }
        )
        progress(f"greedy {device}/{backend} graphs={graphs}: {'equal' if ok else mismatch}")
    greedy = {
        "model": cfg.check_model,
        "reference": "cpu/torch float32",
        "prompt_lens": list(cfg.check_prompt_lens),
        "tokens": cfg.check_tokens,
        "reference_tokens": want,
        "cases": cases,
    }
    attention = gpucheck.correctness(cfg.attention)
    progress(f"attention: {sum(c['ok'] for c in attention)} of {len(attention)} cases ok")
    ok = all(c["ok"] for c in cases) and all(c["ok"] for c in attention)
    return {"ok": ok, "greedy": greedy, "attention": attention}
