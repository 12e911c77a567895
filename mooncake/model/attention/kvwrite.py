"""A step's new K/V into the paged cache, one Triton program per token, by slot mapping.

As nano-vllm's `store_kvcache` (nanovllm/layers/attention.py, read for its design):
token t's K/V (num_kv_heads, head_dim) go to block slot // block_tokens at offset
slot % block_tokens; a slot of -1 (a padding token of a CUDA-graph batch) is skipped.
Offsets are int64: a cache of > 2^31 elements is common on an H200.
`reference.write_kv_reference` is the same in torch (index_put).
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _write_kv_kernel(
    k_ptr,  # (T, num_kv_heads, head_dim)
    v_ptr,
    k_cache_ptr,  # (num_blocks, block_tokens, num_kv_heads, head_dim)
    v_cache_ptr,
    slot_mapping_ptr,  # (T,) int64
    stride_k_t,
    stride_k_h,
    stride_v_t,
    stride_v_h,
    stride_kc_blk,
    stride_kc_tok,
    stride_kc_head,
    stride_vc_blk,
    stride_vc_tok,
    stride_vc_head,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_TOKENS
    within = slot % BLOCK_TOKENS
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(k_ptr + token * stride_k_t + offs_h[:, None] * stride_k_h + offs_d[None, :], mask)
    v = tl.load(v_ptr + token * stride_v_t + offs_h[:, None] * stride_v_h + offs_d[None, :], mask)
    k_dst = block * stride_kc_blk + within * stride_kc_tok + offs_h[:, None] * stride_kc_head
    v_dst = block * stride_vc_blk + within * stride_vc_tok + offs_h[:, None] * stride_vc_head
    tl.store(k_cache_ptr + k_dst + offs_d[None, :], k, mask)
    tl.store(v_cache_ptr + v_dst + offs_d[None, :], v, mask)


def write_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Writes k[t], v[t] (T, num_kv_heads, head_dim) at slot_mapping[t] (T,) int64 of the
    caches (num_blocks, block_tokens, num_kv_heads, head_dim); slots of -1 are skipped."""
    num_tokens, num_kv_heads, head_dim = k.shape
    assert k.dtype == k_cache.dtype == v.dtype == v_cache.dtype, (k.dtype, k_cache.dtype)
    assert slot_mapping.shape[0] >= num_tokens, (slot_mapping.shape, k.shape)
    for t in (k, v, k_cache, v_cache):
        assert t.stride(-1) == 1, f"the last dim must be contiguous, strides {t.stride()}"
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        *k.stride()[:2],  # token, head
        *v.stride()[:2],
        *k_cache.stride()[:3],  # block, token, head
        *v_cache.stride()[:3],
        NUM_KV_HEADS=num_kv_heads,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_TOKENS=k_cache.shape[1],
    )
