"""Weights: deterministic random ones for `dummy:*`, safetensors for HF directories, GGUF
files through `ggufweights`.

Dummy weights are drawn per tensor from a generator seeded with (seed, global tensor name),
so a pipeline stage that builds only layers 2-3 gets exactly the weights a whole model has
there, in any process. HF checkpoints are read tensor by tensor with `safe_open`, only for
the layers a stage owns; q/k/v and gate/up are fused on load (one GEMM each), and experts
stacked (`moe.checkpoint_tensor`).
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import torch
from torch import Tensor

from mooncake.errors import ConfigError
from mooncake.model.attention.backend import select_backend
from mooncake.model.cpugemm import pack_linears
from mooncake.model.info import ModelInfo
from mooncake.model.llama import Model, rope_inv_freq
from mooncake.model.moe import checkpoint_tensor, is_moe_param

log = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DUMMY_STD = 0.02  # std of random matrices (the HF initializer_range default)

# local parameter suffix -> HF tensor names (concatenated along dim 0), per decoder layer
_LAYER_SOURCES = {
    "self_attn.qkv_proj.weight": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.qkv_proj.bias": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj.weight": ("self_attn.o_proj",),
    "self_attn.q_norm.weight": ("self_attn.q_norm",),  # Qwen3
    "self_attn.k_norm.weight": ("self_attn.k_norm",),
    "mlp.gate_up_proj.weight": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj.weight": ("mlp.down_proj",),
    "input_layernorm.weight": ("input_layernorm",),
    "post_attention_layernorm.weight": ("post_attention_layernorm",),
}


def create_model(
    info: ModelInfo,
    dtype: str = "float32",
    device: str = "cpu",
    layer_range: tuple[int, int] | None = None,
    seed: int = 0,
    cpu_gemm: str = "onednn",
    attention_backend: str = "auto",
    block_tokens: int = 0,
    fill_on_device: bool = False,
) -> Model:
    """A model (or the stage owning `layer_range`) with its weights, in eval mode.

    `device="meta"` builds shapes only (no memory), for shape checks of the big specs. On
    CPU its linear layers are then packed for oneDNN unless `cpu_gemm` is "torch"
    (`cpugemm.pack_linears`). `attention_backend` names the paged attention
    (`attention.backend.select_backend`; `block_tokens`, when known, lets it check a
    backend's page-size limits). `fill_on_device` draws dummy weights with a generator on
    `device` (seconds for an 8B model on a GPU, against minutes through the host), seeded
    the same way: on a CPU the same values, on a GPU CUDA's generator's other ones, so
    such a model matches only models filled so on a GPU (benches use it).
    """
    with torch.device("meta"):
        model = Model(info, layer_range)
    torch_dtype = TORCH_DTYPES[dtype]
    model = model.to(dtype=torch_dtype)
    if device == "meta":
        return model.eval()
    model = model.to_empty(device=device)
    model.inv_freq = rope_inv_freq(info.spec).to(device)
    spec = info.spec
    model.attention = select_backend(
        attention_backend,
        torch.device(device),
        torch_dtype,
        spec.num_heads,
        spec.num_kv_heads,
        spec.head_dim,
        block_tokens,
    )
    if info.is_dummy:
        _fill_dummy(model, seed, fill_on_device)
    elif info.gguf_file:
        from mooncake.model.ggufweights import load_gguf

        load_gguf(model, info)
    else:
        _load_hf(model, info)
    if device == "cpu":
        pack_linears(model, cpu_gemm)
    return model.eval()


def _global_name(model: Model, local: str) -> str:
    # "layers.0.mlp..." in a stage starting at layer 2 is "layers.2.mlp..." of the model.
    if local.startswith("layers."):
        _, idx, rest = local.split(".", 2)
        return f"layers.{int(idx) + model.first_layer}.{rest}"
    return local


@torch.no_grad()
def _fill_dummy(model: Model, seed: int, on_device: bool = False) -> None:
    for local, param in model.named_parameters():
        name = _global_name(model, local)
        if name.endswith("norm.weight"):
            param.fill_(1.0)
            continue
        digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
        value = int.from_bytes(digest, "little") >> 1
        if on_device:
            gen = torch.Generator(device=param.device).manual_seed(value)
            param.normal_(0.0, DUMMY_STD, generator=gen)
            continue
        gen = torch.Generator().manual_seed(value)
        values = torch.randn(param.shape, generator=gen) * DUMMY_STD
        param.copy_(values.to(param.dtype))


class _Checkpoint:
    """Name -> tensor reader over a directory's safetensors files."""

    def __init__(self, info: ModelInfo):
        try:
            from safetensors import safe_open
        except ImportError as e:
            raise ConfigError("HF model directories need `pip install safetensors`") from e
        self._files = [
            safe_open(str(Path(info.path) / f), framework="pt") for f in info.weight_files
        ]
        self._where = {name: f for f in self._files for name in f.keys()}  # noqa: SIM118

    def has(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> Tensor:
        if name not in self._where:
            raise ConfigError(f"model checkpoint lacks tensor {name!r}")
        return self._where[name].get_tensor(name)


@torch.no_grad()
def _load_hf(model: Model, info: ModelInfo) -> None:
    ckpt = _Checkpoint(info)
    loaded: set[str] = set()

    def put(local: str, names: list[str], value: Tensor | None = None) -> None:
        param = model.get_parameter(local)
        if value is None:
            value = (
                torch.cat([ckpt.get(n) for n in names], dim=0)
                if len(names) > 1
                else ckpt.get(names[0])
            )
        if value.shape != param.shape:
            raise ConfigError(
                f"model checkpoint: {local} has shape {tuple(value.shape)}, "
                f"config.json implies {tuple(param.shape)}"
            )
        param.copy_(value.to(param.dtype))
        loaded.add(local)

    for local, _ in model.named_parameters():
        if local.startswith("layers."):
            _, idx, suffix = local.split(".", 2)
            prefix = f"model.layers.{int(idx) + model.first_layer}."
            if is_moe_param(suffix):
                n = info.spec.num_experts
                put(local, [], checkpoint_tensor(ckpt.has, ckpt.get, prefix, suffix, n))
                continue
            kind = suffix.rsplit(".", 1)[1]  # weight | bias
            names = [f"{prefix}{src}.{kind}" for src in _LAYER_SOURCES[suffix]]
        elif local == "lm_head.weight":
            tied = info.spec.tie_word_embeddings or not ckpt.has("lm_head.weight")
            names = ["model.embed_tokens.weight" if tied else "lm_head.weight"]
        else:  # embed_tokens.weight, norm.weight
            names = [f"model.{local}"]
        put(local, names)
    missing = {n for n, _ in model.named_parameters()} - loaded
    assert not missing, missing
    log.info("loaded %s layers %d-%d", info.path, model.first_layer, model.end_layer - 1)
