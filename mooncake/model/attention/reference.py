"""Paged attention in plain torch, a sequence at a time: the oracle the Triton kernels are
checked against, and the baseline they are timed against.

`write_kv_reference` puts a step's new K/V at their slots; `attention_reference` gathers
each sequence's keys from its block table and runs `scaled_dot_product_attention` with
the mask of `metadata.py` (causal from the prefix, optional sliding window). GQA: query
head h reads KV head h // (num_heads // num_kv_heads).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from mooncake.model.attention.metadata import AttentionMetadata


def write_kv_reference(
    k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor
) -> None:
    """Writes k[t], v[t] (T, num_kv_heads, head_dim) at slot_mapping[t] of the caches
    (num_blocks, block_tokens, num_kv_heads, head_dim); slots of -1 are skipped."""
    valid = slot_mapping >= 0  # (T,)
    slots = slot_mapping[valid]
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[valid]
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[valid]


def visible_mask(
    q_len: int, seq_len: int, sliding_window: int | None, device: torch.device
) -> Tensor:
    """(q_len, seq_len) bool: which keys each new token of a sequence sees."""
    query_pos = torch.arange(seq_len - q_len, seq_len, device=device)[:, None]  # (Q, 1)
    key_pos = torch.arange(seq_len, device=device)[None, :]  # (1, L)
    mask = key_pos <= query_pos
    if sliding_window is not None:
        mask &= key_pos > query_pos - sliding_window
    return mask


def attention_reference(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    meta: AttentionMetadata,
    scale: float,
    compute_dtype: torch.dtype | None = None,
) -> Tensor:
    """(T, num_heads, head_dim) attention of the step's queries q (T, num_heads, head_dim)
    over the paged caches; computed in `compute_dtype` (default q's), returned in q's.
    Rows past query_start_loc[-1] (padding) are zero. Reads the metadata on the host."""
    dtype = compute_dtype or q.dtype
    block_tokens = k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]  # query heads per KV head
    out = torch.zeros_like(q)
    starts = meta.query_start_loc.tolist()
    seq_lens = meta.seq_lens.tolist()
    for b, seq_len in enumerate(seq_lens):
        q_start, q_end = starts[b], starts[b + 1]
        q_len = q_end - q_start
        num_blocks = -(-seq_len // block_tokens)
        blocks = meta.block_tables[b, :num_blocks].long()  # (num_blocks,)
        keys = k_cache[blocks].flatten(0, 1)[:seq_len]  # (L, num_kv_heads, head_dim)
        values = v_cache[blocks].flatten(0, 1)[:seq_len]
        qs = q[q_start:q_end].transpose(0, 1).to(dtype)  # (num_heads, Q, head_dim)
        ks = keys.transpose(0, 1).to(dtype)  # (num_kv_heads, L, head_dim)
        vs = values.transpose(0, 1).to(dtype)
        mask = None
        if q_len > 1 or meta.sliding_window is not None:
            mask = visible_mask(q_len, seq_len, meta.sliding_window, q.device)
        o = F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=group > 1
        )
        out[q_start:q_end] = o.transpose(0, 1).to(q.dtype)
    return out
