"""LLaMA-family decoder in torch: RMSNorm, RoPE (linear / llama3 / yarn scaling), GQA over
paged KV (Qwen3's per-head q/k RMSNorm, a sliding window when the spec has one), SwiGLU.
A `Model` may own only a contiguous layer range (a pipeline stage): the first stage embeds
tokens, the last one holds the final norm and the LM head.

The runners drive the layer loop themselves (`model.layer(i)(h, step, k, v)`), because
layer-wise KV loading and storing happen between layers; `step.Step` is the batch every
layer reads (built once per step by `step.StepBuilder`).

Attention writes the new K/V into the paged cache (`kvcache.PagedKVCache`; a layer's cache
is (num_blocks, block_tokens, num_kv_heads, head_dim)) and attends over it through the
model's `attention.backend.AttentionBackend`: per sequence through SDPA (torch, the CPU
default) or the whole step in one Triton launch per layer (the GPU default).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mooncake.model.attention.backend import AttentionBackend, TorchAttention
from mooncake.model.info import ModelInfo
from mooncake.model.moe import SparseMoE
from mooncake.model.spec import ModelSpec, RopeScaling

if TYPE_CHECKING:
    from mooncake.model.step import Step

# the kinds of whole-model forward (`Model.on_step`): every token's logits (decode), the
# layers only (KV written), the layers and the last token's logits (a prompt's last chunk)
STEP_LOGITS, STEP_LAYERS, STEP_LAST_LOGITS = 1, 2, 3


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in float32 as transformers does, so bf16 models match it.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(spec: ModelSpec) -> Tensor:
    """(head_dim / 2,) float32 rotary frequencies, with the spec's scaling applied."""
    d = spec.head_dim
    # NOTE: on CPU even inside a meta-device context (meta ops import torch._dynamo)
    inv = 1.0 / (
        spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device="cpu").float() / d)
    )
    sc = spec.rope_scaling
    if sc is None:
        return inv
    if sc.rope_type == "linear":
        return inv / sc.factor
    if sc.rope_type == "yarn":
        return _yarn_inv_freq(inv, spec.rope_theta, d, sc)
    assert sc.rope_type == "llama3", sc
    old_len = sc.original_max_position_embeddings
    low_wavelen, high_wavelen = old_len / sc.low_freq_factor, old_len / sc.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / sc.factor, inv)
    smooth = (old_len / wavelen - sc.low_freq_factor) / (sc.high_freq_factor - sc.low_freq_factor)
    smoothed = (1 - smooth) * scaled / sc.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(inv: Tensor, theta: float, d: int, sc: RopeScaling) -> Tensor:
    """YaRN as transformers' `_compute_yarn_parameters`: dimensions turning fewer than
    beta_slow times over the original context are interpolated (/ factor), more than
    beta_fast times kept, a linear ramp between."""

    def dim_of(rotations: float) -> float:  # the dimension turning `rotations` times
        turns = sc.original_max_position_embeddings / (rotations * 2 * math.pi)
        return d * math.log(turns) / (2 * math.log(theta))

    low, high = dim_of(sc.beta_fast), dim_of(sc.beta_slow)
    if sc.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    dims = torch.arange(d // 2, dtype=torch.float32, device="cpu")  # NOTE: as inv, on CPU
    ramp = ((dims - low) / (high - low)).clamp(0, 1)
    return inv / sc.factor * ramp + inv * (1 - ramp)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # x: (T, heads, head_dim); cos/sin: (T, 1, head_dim); rotate-half layout (HF Llama).
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, qkv_bias: bool):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            spec.num_heads,
            spec.num_kv_heads,
            spec.head_dim,
        )
        q_size, kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        self.sizes = [q_size, kv_size, kv_size]
        self.qkv_proj = nn.Linear(spec.hidden_size, q_size + 2 * kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(q_size, spec.hidden_size, bias=False)
        self.scale = spec.head_dim**-0.5
        # Qwen3: q and k normalised per head (over head_dim) before RoPE
        self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None

    def forward(self, x: Tensor, step: Step, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        # x: (T, hidden); k_cache/v_cache: (num_blocks, block_tokens, kv_heads, head_dim)
        t = x.shape[0]
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        q, k = q.view(t, h, d), k.view(t, kvh, d)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, step.cos, step.sin)
        k = apply_rope(k, step.cos, step.sin)
        v = v.view(t, kvh, d)
        backend = step.backend
        backend.write_kv(k, v, k_cache, v_cache, step.meta)
        out = backend.attend(q, k, v, k_cache, v_cache, step.meta, step.plan, self.scale)
        return self.o_proj(out.reshape(t, h * d))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, qkv_bias: bool, layer: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec, qkv_bias)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp: MLP | SparseMoE = SparseMoE(spec) if spec.is_moe_layer(layer) else MLP(spec)

    def forward(self, h: Tensor, step: Step, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        h = h + self.self_attn(self.input_layernorm(h), step, k_cache, v_cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Model(nn.Module):
    """Layers [first_layer, end_layer) of a LLaMA-family decoder (all of it by default).

    Built on the meta device; `weights.create_model` materialises and fills it.
    """

    inv_freq: Tensor  # (head_dim / 2,) float32 RoPE frequencies (a buffer)
    spec: ModelSpec

    def __init__(self, info: ModelInfo, layer_range: tuple[int, int] | None = None):
        super().__init__()
        spec = info.spec
        self.spec = spec
        self.sliding_window = spec.sliding_window  # every runner's steps attend through it
        self.first_layer, self.end_layer = layer_range or (0, spec.num_layers)
        assert 0 <= self.first_layer < self.end_layer <= spec.num_layers, layer_range
        self.is_first = self.first_layer == 0
        self.is_last = self.end_layer == spec.num_layers
        self.layers = nn.ModuleList(
            DecoderLayer(spec, info.qkv_bias, i) for i in range(self.first_layer, self.end_layer)
        )
        # NOTE: `_weight` skips Embedding's random init, which on the meta device goes
        # through torch._refs and imports torch._dynamo (~2 s per process start)
        self.embed_tokens = (
            nn.Embedding(
                spec.vocab_size,
                spec.hidden_size,
                _weight=torch.empty(spec.vocab_size, spec.hidden_size),
            )
            if self.is_first
            else None
        )
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps) if self.is_last else None
        self.lm_head = (
            nn.Linear(spec.hidden_size, spec.vocab_size, bias=False) if self.is_last else None
        )
        self.register_buffer("inv_freq", rope_inv_freq(spec), persistent=False)
        self.attention: AttentionBackend = TorchAttention()  # `weights.create_model` chooses
        self.num_kv_heads = spec.num_kv_heads  # of this rank (`parallel.shard_model`)
        self.tp_rank, self.tp_size = 0, 1  # this slice's tensor-parallel rank and ranks
        # called before each whole-model forward: tensor parallelism's rank 0 tells the
        # other ranks the step (`parallel.Leader`)
        self.on_step: Callable[[int, Step], None] | None = None
        self._rope: tuple[Tensor, Tensor] | None = None  # cos, sin (positions, head_dim)

    @property
    def layer_ids(self) -> range:
        """Global indices of the layers this model owns."""
        return range(self.first_layer, self.end_layer)

    def layer(self, global_index: int) -> DecoderLayer:
        return self.layers[global_index - self.first_layer]  # type: ignore[return-value]

    def embed(self, token_ids: Tensor) -> Tensor:
        # token_ids: (T,) int64 -> (T, hidden)
        assert self.embed_tokens is not None, "only the first stage embeds tokens"
        return self.embed_tokens(token_ids)

    def forward(self, step: Step, layer_kv: Callable[[int], tuple[Tensor, Tensor]]) -> Tensor:
        """(T, vocab) float32 logits of a whole model's step, each layer's K/V caches
        from `layer_kv(global_layer)` (decode; prefill drives the layers itself)."""
        self.announce(STEP_LOGITS, step)
        return self.compute_logits(self._layers(step, layer_kv))

    def run_layers(self, step: Step, layer_kv: Callable[[int], tuple[Tensor, Tensor]]) -> Tensor:
        """(T, hidden) after the last layer of a whole model's step (its K/V written)."""
        self.announce(STEP_LAYERS, step)
        return self._layers(step, layer_kv)

    def announce(self, kind: int, step: Step) -> None:
        """Tell `on_step` (tensor parallelism's other ranks) the forward of `kind` about to
        run; a runner that drives the layers itself (`prefill.PrefillRunner`) calls it."""
        if self.on_step is not None:
            self.on_step(kind, step)

    def _layers(self, step: Step, layer_kv: Callable[[int], tuple[Tensor, Tensor]]) -> Tensor:
        h = self.embed(step.tokens)
        for layer in self.layer_ids:
            h = self.layer(layer)(h, step, *layer_kv(layer))
        return h

    def compute_logits(self, h: Tensor) -> Tensor:
        # h: (T, hidden) -> (T, vocab) float32
        assert self.norm is not None and self.lm_head is not None, "only the last stage"
        return self.lm_head(self.norm(h)).float()

    def rope_tables(self, length: int) -> tuple[Tensor, Tensor]:
        """cos, sin (>= length, head_dim) in the model's dtype for positions [0, length),
        computed once (grown by doubling); a CUDA-graph owner sizes them first, for good."""
        if self._rope is None or self._rope[0].shape[0] < length:
            old = 0 if self._rope is None else self._rope[0].shape[0]
            size = max(length, 2 * old, 1024)
            positions = torch.arange(size, device=self.inv_freq.device).float()
            freqs = positions[:, None] * self.inv_freq[None, :]  # (size, head_dim / 2)
            emb = torch.cat((freqs, freqs), dim=-1)
            dtype = self._dtype()
            sc = self.spec.rope_scaling
            scale = sc.attention_factor if sc is not None else 1.0  # YaRN's; 1 otherwise
            self._rope = (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)
        return self._rope

    def rope_lookup(self, positions: Tensor, max_len: int) -> tuple[Tensor, Tensor]:
        """cos, sin (T, 1, head_dim) of `positions` (T,), all below `max_len`."""
        cos, sin = self.rope_tables(max_len)
        return cos.index_select(0, positions)[:, None], sin.index_select(0, positions)[:, None]

    def _dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype
