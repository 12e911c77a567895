"""Each model family the engine serves, at its real per-layer shapes with few layers: a
decode step against its roofline, and the prefill of one chunk (issue 34).

| family          | what differs                | layers | hidden | heads/kv | ffn      | vocab  |
|-----------------|-----------------------------|-------:|-------:|---------:|---------:|-------:|
| `llama3-8b`     | (the base)                  | 32     | 4096   | 32/8     | 14336    | 128256 |
| `qwen2.5-7b`    | q/k/v biases                | 28     | 3584   | 28/4     | 18944    | 152064 |
| `qwen3-8b`      | RMSNorm on q and k heads    | 36     | 4096   | 32/8     | 12288    | 151936 |
| `mistral-7b`    | sliding window of 4096      | 32     | 4096   | 32/8     | 14336    | 32000  |
| `mixtral-8x7b`  | MoE, top-2 of 8             | 32     | 4096   | 32/8     | 8x 14336 | 32000  |
| `qwen3-30b-a3b` | MoE, top-8 of 128, q/k norm | 48     | 2048   | 32/4     | 128x 768 | 151936 |

Every head is 128 wide. Sources: the `config.json` on Hugging Face of
meta-llama/Meta-Llama-3-8B, Qwen/Qwen2.5-7B, Qwen/Qwen3-8B, mistralai/Mistral-7B-v0.1,
mistralai/Mixtral-8x7B-v0.1 and Qwen/Qwen3-30B-A3B (its `norm_topk_prob` true, every layer
sparse); Llama 3 and Mixtral are `mooncake.model.spec`'s, the others are built here from
them (a bench's shapes, not names the engine's registry offers).

Each family runs with `family_layers` decoder layers (4 on a GPU: each is drawn on the
device in seconds), so the embedding table and the LM head weigh more in its step than in
the whole model's; the roofline counts what this model reads, whatever its depth. The
decode step is `decode.py`'s (`time_modes`: eager, and CUDA graphs on a GPU, at each of
`family_batches` with `family_context` tokens of random KV), its weight bytes those of the
experts the batch is expected to route to (`bed.experts_touched`, uniform routing), with
the all-experts bound beside them. Random weights route roughly uniformly: each MoE row
also carries `experts_routed`, the distinct experts per layer one eager step of that batch
did route to (a replayed graph runs no hooks, so this is counted apart). The prefill is
`prefill.py`'s, one chunk of `family_prefill_tokens`, its FLOPs `ModelSpec.prefill_flops`
(full causal attention: a window shorter than the chunk, in --cpu-smoke only, computes
less than it counts).

`--cpu-smoke` runs `TINY`: the same features at `dummy:tiny`'s and `dummy:mixtral-tiny`'s
shapes (Qwen2.5's 7 query heads per KV head kept: a group the kernels pad to 8), the window
(16) shorter than the context (24), so every path runs in seconds.

Has not run on a GPU yet. On a CPU (float32, one layer, B = 1 and 4, context 24, Triton
interpreted) every real family ran without error, and at B = 4 a step routed to 6 and 27
distinct experts per layer where uniform routing expects 5.5 and 29.1 (Mixtral, Qwen3-30B-A3B).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import msgspec
import torch

from mooncake.model.decode import DecodeRunner
from mooncake.model.kvcache import PagedKVCache
from mooncake.model.llama import Model
from mooncake.model.moe import Experts
from mooncake.model.prefill import PrefillRunner
from mooncake.model.spec import ModelInfo, ModelSpec, get_model_spec

from .bed import load_model, progress, random_cache, release_memory, seat, unseat
from .config import BenchConfig
from .decode import runner_len, time_modes
from .limits import Limits
from .prefill import time_prefill

_replace = msgspec.structs.replace
_LLAMA3_8B = get_model_spec("dummy:llama3-8b")
_QWEN3_8B = _replace(
    _LLAMA3_8B,
    name="dummy:qwen3-8b",
    num_layers=36,
    intermediate_size=12288,
    vocab_size=151936,
    rope_theta=1e6,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    qk_norm=True,
)


def _info(spec: ModelSpec, qkv_bias: bool = False) -> ModelInfo:
    return ModelInfo(spec=spec, path=spec.name, is_dummy=True, qkv_bias=qkv_bias)


# family -> its real shapes (all its layers; `with_layers` cuts them)
REAL: dict[str, ModelInfo] = {
    "llama3-8b": _info(_LLAMA3_8B),
    "qwen2.5-7b": _info(
        ModelSpec(
            name="dummy:qwen2.5-7b",
            num_layers=28,
            hidden_size=3584,
            num_heads=28,
            num_kv_heads=4,
            head_dim=128,
            intermediate_size=18944,
            vocab_size=152064,
            rope_theta=1e6,
            max_position_embeddings=131072,
            rms_norm_eps=1e-6,
        ),
        qkv_bias=True,
    ),
    "qwen3-8b": _info(_QWEN3_8B),
    "mistral-7b": _info(
        _replace(
            _LLAMA3_8B,
            name="dummy:mistral-7b-v0.1",
            vocab_size=32000,
            rope_theta=10000.0,
            max_position_embeddings=32768,
            sliding_window=4096,
        )
    ),
    "mixtral-8x7b": _info(get_model_spec("dummy:mixtral-8x7b")),
    "qwen3-30b-a3b": _info(
        _replace(
            _QWEN3_8B,
            name="dummy:qwen3-30b-a3b",
            num_layers=48,
            hidden_size=2048,
            num_kv_heads=4,
            intermediate_size=6144,  # a dense layer's; every layer is sparse
            num_experts=128,
            num_experts_per_tok=8,
            moe_intermediate_size=768,
            norm_topk_prob=True,
        )
    ),
}

_TINY = get_model_spec("dummy:tiny")
_MOE_TINY = get_model_spec("dummy:mixtral-tiny")
# family -> the same features at tiny shapes (--cpu-smoke)
TINY: dict[str, ModelInfo] = {
    "llama3-8b": _info(_TINY),
    "qwen2.5-7b": _info(
        _replace(_TINY, name="dummy:qwen2.5-tiny", num_heads=7, num_kv_heads=1), qkv_bias=True
    ),
    "qwen3-8b": _info(_replace(_TINY, name="dummy:qwen3-tiny", qk_norm=True)),
    "mistral-7b": _info(_replace(_TINY, name="dummy:mistral-tiny", sliding_window=16)),
    "mixtral-8x7b": _info(_MOE_TINY),
    "qwen3-30b-a3b": _info(
        _replace(
            _MOE_TINY,
            name="dummy:qwen3-moe-tiny",
            num_experts=16,
            num_experts_per_tok=4,
            moe_intermediate_size=32,
            qk_norm=True,
        )
    ),
}


def with_layers(info: ModelInfo, num_layers: int) -> ModelInfo:
    """`info` with its first `num_layers` decoder layers only (all if it has fewer)."""
    spec = info.spec
    layers = min(num_layers, spec.num_layers)
    dense = tuple(i for i in spec.dense_layers if i < layers)
    return _replace(info, spec=_replace(spec, num_layers=layers, dense_layers=dense))


def experts_routed(cfg: BenchConfig, model: Model, cache: PagedKVCache, batch: int) -> float:
    """Distinct experts per MoE layer (mean over layers) one eager step of `batch` seated
    sequences routes to; the runner is left empty."""
    counts: list[int] = []

    def count(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
        counts.append(args[1].unique().numel())  # args: x, expert_ids (T, k), weights

    runner = DecodeRunner(
        model,
        cache,
        max_batch=batch,
        cuda_graphs=False,
        max_model_len=runner_len(cfg, cfg.family_context),
    )
    hooks = [m.register_forward_hook(count) for m in model.modules() if isinstance(m, Experts)]
    try:
        seat(runner, batch, cfg.family_context, 1, seed=batch * 7919 + cfg.family_context)
        runner.step()
    finally:
        for hook in hooks:
            hook.remove()
        unseat(runner)
    assert counts, "an MoE model ran no experts"
    return statistics.mean(counts)


def prefill_row(
    cfg: BenchConfig, model: Model, cache: PagedKVCache, limits: Limits
) -> dict[str, Any]:
    """TTFT, TFLOP/s and MFU of one chunk of `family_prefill_tokens` random tokens."""
    n = cfg.family_prefill_tokens
    runner = PrefillRunner(model, cache, chunk_tokens=n)
    tokens = torch.randint(model.spec.vocab_size, (n,), generator=torch.Generator().manual_seed(2))
    times, _, _ = time_prefill(runner, tokens.tolist(), 0, cfg.device, cfg.prefill_repeats)
    seconds = statistics.median(times)
    flops = model.spec.prefill_flops(n)
    tflops = flops / seconds / 1e12
    peak = limits.bf16_TFLOPs
    return {
        "tokens": n,
        "ttft_s": seconds,  # median
        "flops": flops,
        "TFLOPs": tflops,
        "mfu": None if peak is None else tflops / peak,
    }


def family_rows(cfg: BenchConfig, model: Model, limits: Limits, name: str) -> list[dict[str, Any]]:
    """The decode rows (MoE: with the experts routed to) and the prefill row of one family."""
    bt, num_steps = cfg.block_tokens, cfg.warmup_steps + cfg.timed_steps
    seq_blocks = -(-(cfg.family_context + num_steps + 1) // bt)
    num_blocks = max(max(cfg.family_batches) * seq_blocks, -(-cfg.family_prefill_tokens // bt))
    cache = random_cache(model, num_blocks, bt)
    cases = [(b, cfg.family_context) for b in cfg.family_batches]
    rows, _ = time_modes(cfg, model, limits, cache, cases, {}, label=f"families {name}")
    rows = [{"family": name, "case": "decode", **row} for row in rows]
    if model.spec.num_experts:
        routed: dict[int, dict[str, Any]] = {}  # batch -> the count, or why not
        for batch in cfg.family_batches:
            try:
                routed[batch] = {"experts_routed": experts_routed(cfg, model, cache, batch)}
            except Exception as e:  # NOTE: a check of the assumption; the timed rows stay
                routed[batch] = {"experts_routed": None, "experts_routed_error": repr(e)}
        for row in rows:
            row.update(routed[row["batch"]])
    if cfg.family_prefill_tokens:
        row = {"family": name, "case": "prefill"}
        try:
            row.update(prefill_row(cfg, model, cache, limits))
            progress(f"families {name} prefill {row['tokens']}: {row['ttft_s'] * 1e3:.1f} ms")
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"
        rows.append(row)
    return rows


def run_families(cfg: BenchConfig, limits: Limits) -> dict[str, Any]:
    """Every family of `cfg.family_shapes`, one model at a time (each freed before the
    next): its spec as run, load seconds, and its decode and prefill rows."""
    infos = REAL if cfg.family_shapes == "real" else TINY
    families: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    for name, full in infos.items():
        info = with_layers(full, cfg.family_layers)
        start = time.perf_counter()
        try:
            model = load_model(cfg, info)
        except Exception as e:  # NOTE: the next family still runs
            rows.append({"family": name, "case": "load", "error": f"{type(e).__name__}: {e}"})
            release_memory(cfg.device)
            continue
        families[name] = {
            "spec": msgspec.to_builtins(info.spec),
            "qkv_bias": info.qkv_bias,
            "full_num_layers": full.spec.num_layers,
            "weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "load_s": time.perf_counter() - start,
        }
        try:
            rows += family_rows(cfg, model, limits, name)
        except Exception as e:  # out of memory for its cache, say; the next family runs
            rows.append({"family": name, "case": "decode", "error": f"{type(e).__name__}: {e}"})
        families[name]["seconds"] = time.perf_counter() - start
        del model
        release_memory(cfg.device)
    return {
        "num_layers": cfg.family_layers,
        "context": cfg.family_context,
        "block_tokens": cfg.block_tokens,
        "families": families,
        "rows": rows,
    }
