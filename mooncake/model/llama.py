"""LLaMA-family decoder in torch: RMSNorm, RoPE (linear / llama3 scaling), GQA over paged
KV, SwiGLU. A `Model` may own only a contiguous layer range (a pipeline stage): the first
stage embeds tokens, the last one holds the final norm and the LM head.

The runners drive the layer loop themselves (`model.layer(i)(h, batch, k, v)`), because
layer-wise KV loading and storing happen between layers.

Attention reads K/V from the paged cache (`kvcache.PagedKVCache`): a layer's cache is
(num_blocks, block_tokens, num_kv_heads, head_dim). A sequence whose blocks are consecutive
(the allocator hands out the lowest free ids, so they usually are) is read in place as a
view; scattered blocks are gathered with one `index_select` over the block table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mooncake.model.info import ModelInfo
from mooncake.model.spec import ModelSpec


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
    assert sc.rope_type == "llama3", sc
    old_len = sc.original_max_position_embeddings
    low_wavelen, high_wavelen = old_len / sc.low_freq_factor, old_len / sc.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / sc.factor, inv)
    smooth = (old_len / wavelen - sc.low_freq_factor) / (sc.high_freq_factor - sc.low_freq_factor)
    smoothed = (1 - smooth) * scaled / sc.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # x: (T, heads, head_dim); cos/sin: (T, 1, head_dim); rotate-half layout (HF Llama).
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


@dataclass(frozen=True)
class SeqSpan:
    """Where one sequence's keys live in a layer's cache: a run of consecutive blocks (read
    as a view, no copy) or scattered blocks (gathered with one `index_select`)."""

    first_block: int
    num_blocks: int
    index: Tensor | None  # (num_blocks,) block ids when they are not consecutive
    kv_len: int  # tokens to attend over

    def read(self, cache: Tensor) -> Tensor:
        """(1, kv_len, kv_heads, head_dim) keys or values of this sequence."""
        if self.index is None:
            blocks = cache[self.first_block : self.first_block + self.num_blocks]
        else:  # NOTE: index_select on a 2-D view is ~2x faster than on the 4-D cache
            blocks = cache.view(cache.shape[0], -1).index_select(0, self.index)
        return blocks.view(1, -1, *cache.shape[2:])[:, : self.kv_len]


def seq_span(block_ids: list[int], kv_len: int, block_tokens: int, device: torch.device) -> SeqSpan:
    n = -(-kv_len // block_tokens)
    ids = block_ids[:n]
    if ids == list(range(ids[0], ids[0] + n)):
        return SeqSpan(ids[0], n, None, kv_len)
    return SeqSpan(ids[0], n, torch.tensor(ids, device=device), kv_len)


@dataclass
class ForwardBatch:
    """Where one step's tokens sit in the paged cache; built once, shared by every layer."""

    slots: Tensor  # (T,) int64: flat cache slot (block_id * block_tokens + offset) of each token
    cos: Tensor  # (T, 1, head_dim)
    sin: Tensor  # (T, 1, head_dim)
    spans: list[SeqSpan]  # per sequence (one for prefill)
    attn_mask: Tensor | None  # prefill (T, kv_len) additive 0/-inf; None: causal from 0
    is_prefill: bool


def _rope_tables(inv_freq: Tensor, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    freqs = positions.float()[:, None] * inv_freq[None, :]  # (T, head_dim / 2)
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def prefill_batch(
    inv_freq: Tensor,
    block_ids: list[int],
    start: int,
    end: int,
    block_tokens: int,
    dtype: torch.dtype,
) -> ForwardBatch:
    """Tokens [start, end) of one sequence whose KV lives in `block_ids`."""
    device = inv_freq.device
    positions = torch.arange(start, end, device=device)
    table = torch.tensor(block_ids[: -(-end // block_tokens)], device=device)
    slots = table[positions // block_tokens] * block_tokens + positions % block_tokens
    mask = None
    if start > 0:  # NOTE: is_causal aligns top-left, wrong once keys precede the queries
        keys = torch.arange(end, device=device)
        # Additive float mask, built once per chunk: SDPA converts a bool one on every call.
        mask = torch.zeros((end - start, end), dtype=dtype, device=device)
        mask.masked_fill_(keys[None, :] > positions[:, None], float("-inf"))
    cos, sin = _rope_tables(inv_freq, positions, dtype)
    return ForwardBatch(
        slots, cos, sin, [seq_span(block_ids, end, block_tokens, device)], mask, True
    )


def decode_batch(
    inv_freq: Tensor,
    block_tables: list[list[int]],
    context_lens: list[int],
    block_tokens: int,
    dtype: torch.dtype,
) -> ForwardBatch:
    """One new token per sequence, at position context_len - 1 (its KV is written here)."""
    device = inv_freq.device
    slots, spans = [], []
    for table, n in zip(block_tables, context_lens, strict=True):
        pos = n - 1
        slots.append(table[pos // block_tokens] * block_tokens + pos % block_tokens)
        spans.append(seq_span(table, n, block_tokens, device))
    positions = torch.tensor(context_lens, device=device) - 1
    cos, sin = _rope_tables(inv_freq, positions, dtype)
    return ForwardBatch(torch.tensor(slots, device=device), cos, sin, spans, None, False)


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

    def forward(self, x: Tensor, fb: ForwardBatch, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        # x: (T, hidden); k_cache/v_cache: (num_blocks, block_tokens, kv_heads, head_dim)
        t = x.shape[0]
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        q = apply_rope(q.view(t, h, d), fb.cos, fb.sin)
        k = apply_rope(k.view(t, kvh, d), fb.cos, fb.sin)
        v = v.view(t, kvh, d)
        k_cache.view(-1, kvh, d).index_copy_(0, fb.slots, k)
        v_cache.view(-1, kvh, d).index_copy_(0, fb.slots, v)
        gqa = h != kvh
        if fb.is_prefill:
            if fb.attn_mask is None:  # the chunk starts the sequence: its own K/V suffice
                keys, values = k[None], v[None]  # (1, T, kv_heads, head_dim)
            else:
                keys, values = fb.spans[0].read(k_cache), fb.spans[0].read(v_cache)
            out = F.scaled_dot_product_attention(
                q[None].transpose(1, 2),
                keys.transpose(1, 2),
                values.transpose(1, 2),
                attn_mask=fb.attn_mask,
                is_causal=fb.attn_mask is None,
                enable_gqa=gqa,
            )
            return self.o_proj(out[0].transpose(0, 1).reshape(t, h * d))
        # Decode: one query per sequence, each over its own span of the cache. Per-sequence
        # calls read consecutive blocks in place; a padded batched call would first copy
        # every sequence's whole KV (the copy costs more than the attention on CPU).
        outs = [
            F.scaled_dot_product_attention(
                q[i][None, :, None],
                span.read(k_cache).transpose(1, 2),
                span.read(v_cache).transpose(1, 2),
                enable_gqa=gqa,
            )
            for i, span in enumerate(fb.spans)
        ]  # each (1, heads, 1, head_dim)
        return self.o_proj(torch.cat(outs).reshape(t, h * d))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, qkv_bias: bool):
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec, qkv_bias)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec)

    def forward(self, h: Tensor, fb: ForwardBatch, k_cache: Tensor, v_cache: Tensor) -> Tensor:
        h = h + self.self_attn(self.input_layernorm(h), fb, k_cache, v_cache)
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
        self.first_layer, self.end_layer = layer_range or (0, spec.num_layers)
        assert 0 <= self.first_layer < self.end_layer <= spec.num_layers, layer_range
        self.is_first = self.first_layer == 0
        self.is_last = self.end_layer == spec.num_layers
        num_local = self.end_layer - self.first_layer
        self.layers = nn.ModuleList(DecoderLayer(spec, info.qkv_bias) for _ in range(num_local))
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

    def compute_logits(self, h: Tensor) -> Tensor:
        # h: (T, hidden) -> (T, vocab) float32
        assert self.norm is not None and self.lm_head is not None, "only the last stage"
        return self.lm_head(self.norm(h)).float()
