"""What a GGUF checkpoint holds, as a `ModelInfo`: architecture, shapes, RoPE, special
tokens, and whether we can load every tensor. Torch-free (the master reads it too).

Accepted: `general.architecture` `llama` (Mistral's GGUFs say llama too), `qwen2`
(q/k/v biases) and `qwen3` (q/k norms: `attn_q_norm`, `attn_k_norm`); tensor types in
`SUPPORTED_TYPES` (`ggufweights` dequantizes them at load). Anything else is refused
here, before a node allocates memory for it.

The name is `gguf:<file stem>:<digest>`: the digest covers the metadata and tensor table
(every tensor's quantization type among them) and the first bytes of every tensor, so a
Q4_1 file and a full-precision checkpoint of the same shapes never share pooled KV.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import Any

import numpy as np

from mooncake.errors import ConfigError
from mooncake.model.ggufread import GGML_TYPES, GGUFFile, type_name
from mooncake.model.spec import ModelInfo, ModelSpec, RopeScaling, normalize_dtype

# architecture -> whether llama.cpp's converter permuted the q/k rows (see ggufweights)
ARCHITECTURES = {"llama": True, "qwen2": False, "qwen3": False}
# the tensor types `dequant` decodes
SUPPORTED_TYPES: tuple[str, ...] = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0")
SUPPORTED_TYPES += ("Q5_1", "Q4_K", "Q5_K", "Q6_K")
# our parameter suffix -> llama.cpp tensor names (fused along dim 0), per decoder layer
LAYER_SOURCES = {
    "self_attn.qkv_proj.weight": ("attn_q.weight", "attn_k.weight", "attn_v.weight"),
    "self_attn.qkv_proj.bias": ("attn_q.bias", "attn_k.bias", "attn_v.bias"),
    "self_attn.o_proj.weight": ("attn_output.weight",),
    "self_attn.q_norm.weight": ("attn_q_norm.weight",),  # qwen3 only
    "self_attn.k_norm.weight": ("attn_k_norm.weight",),
    "mlp.gate_up_proj.weight": ("ffn_gate.weight", "ffn_up.weight"),
    "mlp.down_proj.weight": ("ffn_down.weight",),
    "input_layernorm.weight": ("attn_norm.weight",),
    "post_attention_layernorm.weight": ("ffn_norm.weight",),
}
GLOBAL_TENSORS = ("token_embd.weight", "output_norm.weight", "output.weight", "rope_freqs.weight")
# end-of-turn tokens chat models stop at besides EOS, when the vocabulary has them
_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")
_CONTROL = 3  # tokenizer.ggml.token_type of a control token
_SAMPLE_BYTES = 4096  # per tensor, into the digest


def gguf_model_info(path: str, file: Path) -> ModelInfo:
    """The ModelInfo of the GGUF `file` (`path` is model.path as given); raises ConfigError
    for an architecture, a tensor or a tensor type we cannot load."""
    g = GGUFFile(file)
    arch = str(g.field("general.architecture", ""))
    if arch not in ARCHITECTURES:
        raise ConfigError(
            f"model.path: {file.name} is a {arch!r} GGUF; supported architectures: "
            f"{', '.join(ARCHITECTURES)}"
        )
    if g.field(f"{arch}.expert_count", 0):
        raise ConfigError(
            f"model.path: {file.name} is a mixture-of-experts GGUF, which is not supported; "
            "load its Hugging Face directory (Mixtral, Qwen3-MoE) instead"
        )
    _check_tensors(g, file.name, arch)

    def key(name: str, default: Any = None) -> Any:
        value = g.field(f"{arch}.{name}", default)
        if value is None:
            raise ConfigError(f"model.path: {file.name} lacks metadata {arch}.{name}")
        return value

    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", hidden // heads))
    rope_dims = int(key("rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ConfigError(
            f"model.path: {file.name} rotates {rope_dims} of {head_dim} head dims; "
            "only full-width RoPE is supported"
        )
    theta = float(key("rope.freq_base", 10000.0))
    embed = g.tensors["token_embd.weight"]
    spec = ModelSpec(
        name=f"gguf:{file.stem}:{_digest(g)}",
        num_layers=int(key("block_count")),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=int(key("attention.head_count_kv", heads)),
        head_dim=head_dim,
        intermediate_size=int(key("feed_forward_length")),
        vocab_size=embed.shape[0],
        rope_theta=theta,
        rope_scaling=_rope_scaling(g, arch, file.name, theta, head_dim),
        max_position_embeddings=int(key("context_length", 4096)),
        tie_word_embeddings="output.weight" not in g.tensors,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        qk_norm=arch == "qwen3",
    )
    bos = g.field("tokenizer.ggml.bos_token_id")
    return ModelInfo(
        spec=spec,
        path=path,
        is_dummy=False,
        qkv_bias="blk.0.attn_q.bias" in g.tensors,
        checkpoint_dtype=_checkpoint_dtype(g),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=_eos_ids(g),
        gguf_file=str(file.resolve()),
    )


def _check_tensors(g: GGUFFile, file_name: str, arch: str) -> None:
    layer_names = {n for names in LAYER_SOURCES.values() for n in names}
    if arch != "qwen3":
        layer_names -= {"attn_q_norm.weight", "attn_k_norm.weight"}
    for t in g.tensors.values():
        parts = t.name.split(".", 2)
        known = t.name in GLOBAL_TENSORS or (
            len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in layer_names
        )
        if not known:
            raise ConfigError(
                f"model.path: {file_name} has tensor {t.name!r}, which is no part of a "
                f"{arch} decoder (token_embd, blk.N.attn_*/ffn_*, output_norm, output)"
            )
        if t.type_name not in SUPPORTED_TYPES:
            raise ConfigError(
                f"model.path: {file_name}: tensor {t.name} is {t.type_name}; supported "
                f"tensor types: {', '.join(SUPPORTED_TYPES)}"
            )
        block = GGML_TYPES[t.ggml_type][1]
        if not t.shape or t.shape[-1] % block:
            raise ConfigError(
                f"model.path: {file_name}: tensor {t.name} of shape {t.shape} does not split "
                f"into {t.type_name} blocks of {block}"
            )
    if "token_embd.weight" not in g.tensors:
        raise ConfigError(f"model.path: {file_name} has no token_embd.weight tensor")


def _rope_scaling(
    g: GGUFFile, arch: str, file_name: str, theta: float, head_dim: int
) -> RopeScaling | None:
    kind = str(g.field(f"{arch}.rope.scaling.type", "none"))
    if kind == "linear":
        return RopeScaling(rope_type="linear", factor=float(g.field(f"{arch}.rope.scaling.factor")))
    if kind != "none":
        raise ConfigError(
            f"model.path: {file_name}: rope scaling {kind!r} is not supported (none, linear, "
            "llama3 as rope_freqs)"
        )
    if "rope_freqs.weight" not in g.tensors:
        return None
    # llama.cpp's converter bakes Llama 3.1's scaling into per-frequency divisors; we
    # accept them when Llama 3.1's parameters (with their largest divisor) reproduce them.
    freqs = g.raw(g.tensors["rope_freqs.weight"]).view(np.float32)
    scaling = RopeScaling(factor=float(freqs.max()))
    if freqs.shape != (head_dim // 2,) or not np.allclose(
        freqs, llama3_rope_divisors(scaling, theta, head_dim), rtol=1e-4
    ):
        raise ConfigError(
            f"model.path: {file_name}: its rope_freqs are not Llama 3.1's scaling "
            "(factor, low 1, high 4, 8192 original positions); no other is supported"
        )
    return scaling


def llama3_rope_divisors(sc: RopeScaling, theta: float, head_dim: int) -> np.ndarray:
    """(head_dim / 2,) what llama.cpp divides each RoPE frequency by for `sc` (rope_freqs)."""
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv
    old = sc.original_max_position_embeddings
    smooth = (old / wavelen - sc.low_freq_factor) / (sc.high_freq_factor - sc.low_freq_factor)
    medium = 1 / ((1 - smooth) / sc.factor + smooth)
    out = np.where(wavelen > old / sc.low_freq_factor, sc.factor, medium)
    return np.where(wavelen < old / sc.high_freq_factor, 1.0, out)


def _eos_ids(g: GGUFFile) -> tuple[int, ...]:
    ids = [
        int(g.field(k))
        for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
        if g.field(k) is not None
    ]
    tokens, types = g.field("tokenizer.ggml.tokens", []), g.field("tokenizer.ggml.token_type")
    for text in _END_OF_TURN:
        if text in tokens:
            i = tokens.index(text)
            if types is None or int(types[i]) == _CONTROL:
                ids.append(i)
    return tuple(dict.fromkeys(ids))


def _checkpoint_dtype(g: GGUFFile) -> str:
    """float32/float16/bfloat16 when the matrices are stored so; bfloat16 when quantized."""
    kinds = {t.type_name for t in g.tensors.values() if len(t.shape) == 2}
    if kinds == {"F32"}:
        return "float32"
    return normalize_dtype("float16" if kinds == {"F16"} else "bfloat16")


def _digest(g: GGUFFile) -> str:
    """8 hex digits over the metadata and tensor table, the types, and each tensor's head."""
    h = hashlib.blake2b(digest_size=4, person=b"mooncake-gguf")
    h.update(g.header_bytes())
    for t in g.tensors.values():
        h.update(f"{t.name}:{type_name(t.ggml_type)};".encode())
        h.update(g.raw(t)[:_SAMPLE_BYTES].tobytes())
    return h.hexdigest()
