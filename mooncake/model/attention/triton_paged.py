"""Paged attention for a whole step in one Triton launch per layer, and the KV write.

`paged_attention` serves decode rows and prefill chunks (with cached prefixes) together,
as vLLM's unified kernel does (vllm/attention/ops/triton_unified_attention.py, Apache-2.0,
read for its design; this code is our own). A program owns one query block of one
sequence and one KV head:

    rows of a program   BLOCK_M = BLOCK_Q query tokens x G_PAD query heads of the KV head
                        (row m: token m // G_PAD, head m % G_PAD; GQA reads each K/V once)
    program id 0        query block, numbered per sequence from query_start_loc[b] // BLOCK_Q + b
                        (a binary search over query_start_loc finds b; surplus ids exit)
    program id 1        KV head
    program id 2        split-KV segment (1 unless split)

It walks the sequence's keys TILE at a time, looking each key's block up in the block
table (so any block size works: 16, 512, ...), with an online softmax in fp32 in the
log2 domain. The split-KV variant (decode with few sequences, where B x num_kv_heads
programs cannot fill the GPU) gives each of NUM_SEGMENTS programs a share of the tiles;
it stores unnormalized partial outputs with their running max and sum, and
`_reduce_segments_kernel` merges them. Offsets into the caches are int64 (a cache of
> 2^31 elements is common on an H200). New K/V reach the cache through `kvwrite.write_kv`.

Use `paged_attention`; `choose_config` picks how a step is cut (`KernelConfig`: rows per
program, keys per step, warps, split-KV), and a config passed in overrides it (tests,
tuning in gpucheck).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from torch import Tensor

from mooncake.model.attention.metadata import AttentionMetadata

LOG2E = 1.4426950408889634
SPLIT_TARGET_PROGRAMS = 256  # about 2 programs per SM of an H100/H200 (132 SMs)
MAX_SPLITS = 64


@dataclass(frozen=True)
class KernelConfig:
    """How one launch is cut into programs; `choose_config` picks it per step."""

    block_m: int  # rows per program: query tokens x query heads of one KV head; >= 16
    tile: int  # keys per inner step; >= 16, a power of two
    num_warps: int
    num_splits: int = 1  # split-KV segments per query block (1 = none), a power of two


@triton.jit
def _find_seq(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence whose query blocks hold global query block `q_block`."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if start <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """a @ b accumulated in fp32; IEEE (fp32 inputs) keeps full precision, not TF32."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _paged_attention_kernel(
    q_ptr,  # (T, num_heads, head_dim)
    k_cache_ptr,  # (num_blocks, block_tokens, num_kv_heads, head_dim)
    v_cache_ptr,
    out_ptr,  # (T, num_heads, head_dim); unused when split
    part_out_ptr,  # (T, num_heads, NUM_SEGMENTS, HEAD_DIM_PAD) fp32, when split
    part_max_ptr,  # (T, num_heads, NUM_SEGMENTS) fp32, log2 domain, when split
    part_sum_ptr,  # (T, num_heads, NUM_SEGMENTS) fp32, when split
    block_tables_ptr,  # (B, max_blocks) int32
    seq_lens_ptr,  # (B,) int32
    query_start_loc_ptr,  # (B + 1,) int32
    qk_scale,  # softmax scale * log2(e)
    num_seqs,
    window,  # keys a query sees, itself included (when USE_WINDOW)
    stride_q_t,
    stride_q_h,
    stride_o_t,
    stride_o_h,
    stride_k_blk,
    stride_k_tok,
    stride_k_head,
    stride_v_blk,
    stride_v_tok,
    stride_v_head,
    stride_bt,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    G_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr,
    TILE: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    IEEE: tl.constexpr,  # fp32 inputs: exact fp32 dots, not TF32
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)
    seq = _find_seq(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block_local = q_block - (q_start // BLOCK_Q + seq)
    if q_block_local * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len  # keys before this step's first new token

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_valid = offs_d < HEAD_DIM
    q_index = q_block_local * BLOCK_Q + offs_m // G_PAD  # (BLOCK_M,) within the sequence
    head_in_group = offs_m % G_PAD
    row_valid = (q_index < q_len) & (head_in_group < GROUP)
    token = (q_start + q_index).to(tl.int64)  # row of q
    q_head = kv_head * GROUP + head_in_group
    query_pos = context_len + q_index  # absolute position of each row's token
    q_offs = token[:, None] * stride_q_t + q_head[:, None] * stride_q_h + offs_d[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_valid[:, None] & d_valid[None, :], other=0.0)

    # the keys this query block sees: [kv_lo, kv_hi), cut into tiles, then into segments
    last_q = tl.minimum(q_block_local * BLOCK_Q + BLOCK_Q, q_len) - 1
    kv_hi = context_len + last_q + 1
    kv_lo = 0
    if USE_WINDOW:
        kv_lo = tl.maximum(context_len + q_block_local * BLOCK_Q - window + 1, 0)
    tile_lo = kv_lo // TILE
    tile_hi = tl.cdiv(kv_hi, TILE)
    if NUM_SEGMENTS > 1:
        per_segment = tl.cdiv(tile_hi - tile_lo, NUM_SEGMENTS)
        tile_lo = tile_lo + segment * per_segment
        tile_hi = tl.minimum(tile_lo + per_segment, tile_hi)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile in range(tile_lo, tile_hi):
        kv_pos = tile * TILE + tl.arange(0, TILE)  # (TILE,)
        kv_valid = kv_pos < kv_hi
        block = tl.load(table + kv_pos // BLOCK_TOKENS, mask=kv_valid, other=0).to(tl.int64)
        within = kv_pos % BLOCK_TOKENS
        k_offs = block * stride_k_blk + within * stride_k_tok + kv_head * stride_k_head
        v_offs = block * stride_v_blk + within * stride_v_tok + kv_head * stride_v_head
        k_mask = d_valid[:, None] & kv_valid[None, :]
        v_mask = kv_valid[:, None] & d_valid[None, :]
        k = tl.load(k_cache_ptr + k_offs[None, :] + offs_d[:, None], mask=k_mask, other=0.0)
        v = tl.load(v_cache_ptr + v_offs[:, None] + offs_d[None, :], mask=v_mask, other=0.0)
        s = _dot(q, k, IEEE) * qk_scale  # (BLOCK_M, TILE)
        visible = (kv_pos[None, :] <= query_pos[:, None]) & kv_valid[None, :]
        if USE_WINDOW:
            visible = visible & (kv_pos[None, :] > query_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees no key yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
        m_i = m_new

    if NUM_SEGMENTS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_offs = token[:, None] * stride_o_t + q_head[:, None] * stride_o_h + offs_d[None, :]
        o_mask = row_valid[:, None] & d_valid[None, :]
        tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        part = (token * NUM_HEADS + q_head) * NUM_SEGMENTS + segment  # (BLOCK_M,) int64
        tl.store(part_max_ptr + part, m_i, mask=row_valid)
        tl.store(part_sum_ptr + part, l_i, mask=row_valid)
        p_offs = part[:, None] * HEAD_DIM_PAD + offs_d[None, :]
        tl.store(part_out_ptr + p_offs, acc, mask=row_valid[:, None])


@triton.jit
def _reduce_segments_kernel(
    out_ptr,  # (T, num_heads, head_dim)
    part_out_ptr,  # (T, num_heads, NUM_SEGMENTS, HEAD_DIM_PAD) fp32
    part_max_ptr,  # (T, num_heads, NUM_SEGMENTS) fp32
    part_sum_ptr,  # (T, num_heads, NUM_SEGMENTS) fp32
    query_start_loc_ptr,  # (B + 1,) int32: rows past [B] are padding, left alone
    num_seqs,
    stride_o_t,
    stride_o_h,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if token >= tl.load(query_start_loc_ptr + num_seqs):
        return
    part = (token * NUM_HEADS + head) * NUM_SEGMENTS + tl.arange(0, NUM_SEGMENTS)
    m = tl.load(part_max_ptr + part)  # (NUM_SEGMENTS,)
    m_all = tl.max(m, 0)
    weight = tl.exp2(m - tl.where(m_all == float("-inf"), 0.0, m_all))  # empty segment: 0
    total = tl.sum(tl.load(part_sum_ptr + part) * weight, 0)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    acc = tl.load(part_out_ptr + part[:, None] * HEAD_DIM_PAD + offs_d[None, :])
    out = tl.sum(acc * weight[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    o_offs = token * stride_o_t + head * stride_o_h + offs_d
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


def _pow2(n: int) -> int:
    return triton.next_power_of_2(n)


def choose_config(
    meta: AttentionMetadata, num_heads: int, num_kv_heads: int, head_dim: int, dtype_bytes: int = 2
) -> KernelConfig:
    """Decode-only steps: 16-row programs (one token's query heads), split-KV when B x KV
    heads programs are too few for the GPU (at most a segment per tile of the longest
    context). Steps with prefill chunks: 128-row programs, so that each K/V tile serves
    many queries; 64 for head_dim > 128 or fp32 (whose dots also take 32-key tiles).
    Sizes from register counts of sm_90 builds at head_dim 128, none spilling: 16/64/4
    warps about 120 registers, 128/64/8 about 180 (bf16), 64/32/8 about 150 (fp32)."""
    g_pad = _pow2(num_heads // num_kv_heads)
    if not meta.is_decode_only:
        block_m = 64 if head_dim > 128 or dtype_bytes > 2 else 128
        tile = 32 if dtype_bytes > 2 else 64
        return KernelConfig(block_m=max(block_m, g_pad), tile=tile, num_warps=8)
    config = KernelConfig(block_m=max(16, g_pad), tile=64, num_warps=4)
    programs = meta.num_seqs * num_kv_heads
    if programs >= SPLIT_TARGET_PROGRAMS // 2:
        return config
    splits = min(_pow2(-(-SPLIT_TARGET_PROGRAMS // programs)), MAX_SPLITS)
    tiles = -(-meta.max_seq_len // config.tile)
    while splits > 1 and splits > tiles:
        splits //= 2
    return replace(config, num_splits=splits)


def _check_last_dim(*tensors: Tensor) -> None:
    for t in tensors:
        assert t.stride(-1) == 1, f"the last dim must be contiguous, strides {t.stride()}"


def paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    meta: AttentionMetadata,
    scale: float,
    config: KernelConfig | None = None,
) -> Tensor:
    """(T, num_heads, head_dim) attention of the step's queries q (T, num_heads, head_dim)
    over the paged caches (num_blocks, block_tokens, num_kv_heads, head_dim) in one launch
    (two when split). Rows past query_start_loc[-1] (padding) are left undefined.
    `config` None: `choose_config`'s. Reads nothing back to the host (CUDA-graph safe)."""
    num_tokens, num_heads, head_dim = q.shape
    _, block_tokens, num_kv_heads, _ = k_cache.shape
    assert q.dtype == k_cache.dtype == v_cache.dtype, (q.dtype, k_cache.dtype, v_cache.dtype)
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    _check_last_dim(q, k_cache, v_cache)
    group = num_heads // num_kv_heads
    g_pad = _pow2(group)
    config = config or choose_config(meta, num_heads, num_kv_heads, head_dim, q.element_size())
    block_q = config.block_m // g_pad
    head_dim_pad = max(_pow2(head_dim), 16)
    splits = config.num_splits
    assert block_q >= 1 and config.block_m >= 16 and config.tile >= 16, config
    assert splits >= 1 and splits == _pow2(splits), f"num_splits {splits}: a power of two"
    num_seqs = meta.num_seqs
    out = torch.empty_like(q)
    part_shape = (num_tokens, num_heads, splits)
    part_out = part_max = part_sum = out  # unused placeholders when not split
    if splits > 1:
        part_out = torch.empty((*part_shape, head_dim_pad), dtype=torch.float32, device=q.device)
        part_max = torch.empty(part_shape, dtype=torch.float32, device=q.device)
        part_sum = torch.empty(part_shape, dtype=torch.float32, device=q.device)
    window = meta.sliding_window
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, splits)
    _paged_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        part_out,
        part_max,
        part_sum,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        scale * LOG2E,
        num_seqs,
        window or 0,
        *q.stride()[:2],  # token, head
        *out.stride()[:2],
        *k_cache.stride()[:3],  # block, token, head
        *v_cache.stride()[:3],
        meta.block_tables.stride(0),
        NUM_HEADS=num_heads,
        GROUP=group,
        G_PAD=g_pad,
        BLOCK_Q=block_q,
        BLOCK_M=config.block_m,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_TOKENS=block_tokens,
        TILE=config.tile,
        NUM_SEGMENTS=splits,
        USE_WINDOW=window is not None,
        IEEE=q.dtype == torch.float32,
        num_warps=config.num_warps,
    )
    if splits > 1:
        _reduce_segments_kernel[(num_tokens, num_heads)](
            out,
            part_out,
            part_max,
            part_sum,
            meta.query_start_loc,
            num_seqs,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            NUM_SEGMENTS=splits,
        )
    return out
