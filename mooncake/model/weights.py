"""Weights: deterministic random ones for `dummy:*`, safetensors for HF directories, GGUF
files through `ggufweights`.

Dummy weights are drawn per tensor from a generator seeded with (seed, global tensor name),
so a pipeline stage that builds only layers 2-3 gets exactly the weights a whole model has
there, in any process. HF checkpoints are read tensor by tensor with `safe_open`, only for
the layers a stage owns; q/k/v and gate/up are fused on load (one GEMM each), and experts
stacked (`moe.checkpoint_sources`).

A tensor-parallel rank (`create_model(..., tp=TPGroup(rank, size))`) is built at its own
shapes on the meta device (`parallel.cut_model`) and filled with its slice only
(`shardplan.Cut`): from safetensors it reads just those rows or columns
(`get_slice(name)[...]`, counted in `_Checkpoint.bytes_read`); a dummy tensor is drawn
whole from its seeded generator and sliced, so TP = 1 and TP = N hold the same model
(exactly; with `fill_on_device` the whole tensor is drawn on the device, one at a time).
GGUF files are loaded whole and then cut (`parallel.shard_model`).
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from mooncake.errors import ConfigError
from mooncake.model.attention.backend import select_backend
from mooncake.model.cpugemm import pack_linears
from mooncake.model.info import ModelInfo
from mooncake.model.llama import Model, rope_inv_freq
from mooncake.model.moe import checkpoint_sources, is_moe_param
from mooncake.model.parallel import (
    TPGroup,
    check_shardable,
    cut_model,
    install_collectives,
    shard_model,
)
from mooncake.model.shardplan import Cut

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
    tp: TPGroup | None = None,
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

    `tp` (size > 1): rank `tp.rank`'s slice only, read or drawn as such, with its
    collectives installed (they run once the process group exists). Raises ConfigError
    when the model does not split over `tp.size` ranks.
    """
    if tp is not None and tp.size == 1:
        tp = None
    if tp is not None and info.gguf_file:  # NOTE: loaded whole, then cut
        whole = create_model(info, dtype, device, layer_range, seed, "torch", attention_backend)
        return shard_model(whole, tp, block_tokens, cpu_gemm).eval()
    with torch.device("meta"):
        model = Model(info, layer_range)
    torch_dtype = TORCH_DTYPES[dtype]
    model = model.to(dtype=torch_dtype)
    cuts: dict[str, Cut] = {}
    if tp is not None:
        check_shardable(model, tp.size)
        cuts = cut_model(model, tp)  # the rank's shapes, still on the meta device
    if device == "meta":
        return model.eval()
    model = model.to_empty(device=device)
    model.inv_freq = rope_inv_freq(info.spec).to(device)
    spec = info.spec
    model.attention = select_backend(
        attention_backend,
        torch.device(device),
        torch_dtype,
        spec.num_heads // model.tp_size,
        model.num_kv_heads,
        spec.head_dim,
        block_tokens,
    )
    if info.is_dummy:
        _fill_dummy(model, seed, fill_on_device, cuts)
    elif info.gguf_file:
        from mooncake.model.ggufweights import load_gguf

        load_gguf(model, info)
    else:
        _load_hf(model, info, cuts)
    if tp is not None:
        install_collectives(model, tp, cpu_gemm)
    elif device == "cpu":
        pack_linears(model, cpu_gemm)
    return model.eval()


def _global_name(model: Model, local: str) -> str:
    # "layers.0.mlp..." in a stage starting at layer 2 is "layers.2.mlp..." of the model.
    if local.startswith("layers."):
        _, idx, rest = local.split(".", 2)
        return f"layers.{int(idx) + model.first_layer}.{rest}"
    return local


@torch.no_grad()
def _fill_dummy(
    model: Model, seed: int, on_device: bool = False, cuts: dict[str, Cut] | None = None
) -> None:
    cuts = cuts or {}
    for local, param in model.named_parameters():
        name = _global_name(model, local)
        if name.endswith("norm.weight"):
            param.fill_(1.0)
            continue
        digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
        value = int.from_bytes(digest, "little") >> 1
        cut = cuts.get(local)
        shape = cut.shape if cut is not None else tuple(param.shape)
        if on_device:
            gen = torch.Generator(device=param.device).manual_seed(value)
            whole = torch.empty(shape, dtype=param.dtype, device=param.device)
            whole.normal_(0.0, DUMMY_STD, generator=gen)
        else:
            gen = torch.Generator().manual_seed(value)
            whole = (torch.randn(shape, generator=gen) * DUMMY_STD).to(param.dtype)
        param.copy_(cut.apply(whole) if cut is not None else whole)


class _Checkpoint:
    """Name -> tensor reader over a directory's safetensors files; reads only the slices
    asked for, counting their bytes in `bytes_read`."""

    def __init__(self, info: ModelInfo):
        try:
            from safetensors import safe_open
        except ImportError as e:
            raise ConfigError("HF model directories need `pip install safetensors`") from e
        self._files = [
            safe_open(str(Path(info.path) / f), framework="pt") for f in info.weight_files
        ]
        self._where = {name: f for f in self._files for name in f.keys()}  # noqa: SIM118
        self.bytes_read = 0  # bytes of the tensors and slices read so far

    def has(self, name: str) -> bool:
        return name in self._where

    def _slice(self, name: str) -> Any:
        if name not in self._where:
            raise ConfigError(f"model checkpoint lacks tensor {name!r}")
        return self._where[name].get_slice(name)

    def _get(self, name: str, index: tuple[slice, ...]) -> Tensor:
        t = self._slice(name)[index] if index else self._where[name].get_tensor(name)
        self.bytes_read += t.numel() * t.element_size()
        return t

    def read(self, names: list[str], cut: Cut | None = None) -> Tensor:
        """The tensors `names` concatenated along dim 0, or just `cut` of that (reading
        only the rows or columns it takes). Raises ConfigError for a missing tensor or one
        whose shape differs from the cut's."""
        if cut is None:
            parts = [self._get(n, ()) for n in names]
            return torch.cat(parts) if len(parts) > 1 else parts[0]
        shapes = [tuple(self._slice(n).get_shape()) for n in names]
        whole = (sum(s[0] for s in shapes), *shapes[0][1:])
        if whole != cut.shape or any(s[1:] != shapes[0][1:] for s in shapes):
            raise ConfigError(
                f"model checkpoint: {'+'.join(names)} have shapes {shapes}, "
                f"config.json implies {cut.shape} in all"
            )
        parts = []
        if cut.dim == 0:
            for a, b in cut.spans:  # the sources' rows in [a, b)
                offset = 0
                for n, s in zip(names, shapes, strict=True):
                    lo, hi = max(a, offset), min(b, offset + s[0])
                    if lo < hi:
                        parts.append(self._get(n, (slice(lo - offset, hi - offset),)))
                    offset += s[0]
        else:
            lead = (slice(None),) * cut.dim
            for n in names:
                cols = [self._get(n, (*lead, slice(a, b))) for a, b in cut.spans]
                parts.append(torch.cat(cols, dim=cut.dim))
        if cut.pad:
            parts.append(parts[0].new_zeros(cut.pad, *whole[1:]))
        return torch.cat(parts)


@torch.no_grad()
def _load_hf(model: Model, info: ModelInfo, cuts: dict[str, Cut] | None = None) -> None:
    cuts = cuts or {}
    ckpt = _Checkpoint(info)
    loaded: set[str] = set()
    for local, param in model.named_parameters():
        cut = cuts.get(local)
        if local.startswith("layers."):
            _, idx, suffix = local.split(".", 2)
            prefix = f"model.layers.{int(idx) + model.first_layer}."
            if is_moe_param(suffix):
                n = info.spec.num_experts
                groups, is_per_expert = checkpoint_sources(ckpt.has, prefix, suffix, n)
                value = (
                    torch.stack([ckpt.read(g, cut.inner() if cut else None) for g in groups])
                    if is_per_expert
                    else ckpt.read(groups[0], cut)
                )
                _put(local, param, value)
                loaded.add(local)
                continue
            kind = suffix.rsplit(".", 1)[1]  # weight | bias
            names = [f"{prefix}{src}.{kind}" for src in _LAYER_SOURCES[suffix]]
        elif local == "lm_head.weight":
            tied = info.spec.tie_word_embeddings or not ckpt.has("lm_head.weight")
            names = ["model.embed_tokens.weight" if tied else "lm_head.weight"]
        else:  # embed_tokens.weight, norm.weight
            names = [f"model.{local}"]
        _put(local, param, ckpt.read(names, cut))
        loaded.add(local)
    missing = {n for n, _ in model.named_parameters()} - loaded
    assert not missing, missing
    log.info(
        "loaded %s layers %d-%d (rank %d of %d): %d bytes read",
        info.path,
        model.first_layer,
        model.end_layer - 1,
        model.tp_rank,
        model.tp_size,
        ckpt.bytes_read,
    )


def _put(local: str, param: Tensor, value: Tensor) -> None:
    if value.shape != param.shape:
        raise ConfigError(
            f"model checkpoint: {local} has shape {tuple(value.shape)}, "
            f"config.json implies {tuple(param.shape)}"
        )
    param.copy_(value.to(param.dtype))
