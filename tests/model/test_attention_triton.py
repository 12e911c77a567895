"""The Triton paged attention equals the torch reference on randomized paged batches, and
the Triton KV write equals index_put. Without a GPU the kernels run in Triton's interpreter
(TRITON_INTERPRET=1, set here), so every shape is tiny."""

from __future__ import annotations

import dataclasses
import json
import os
import random

import pytest

pytest.importorskip("torch", reason="the attention tests need torch")
import torch  # noqa: E402

if not torch.cuda.is_available():  # NOTE: before triton's import, which reads it
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="the Triton attention tests need triton (pip install triton)")

from mooncake.model.attention import gpucheck  # noqa: E402
from mooncake.model.attention.kvwrite import write_kv  # noqa: E402
from mooncake.model.attention.metadata import AttentionMetadata, create_metadata  # noqa: E402
from mooncake.model.attention.reference import (  # noqa: E402
    attention_reference,
    write_kv_reference,
)
from mooncake.model.attention.triton_paged import (  # noqa: E402
    KernelConfig,
    choose_config,
    paged_attention,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HEAD_DIM = 16
NUM_KV_HEADS = 2


def make_batch(
    seed: int,
    seq_lens: list[int],
    query_lens: list[int],
    group: int,
    block_tokens: int = 16,
    window: int | None = None,
    dtype: torch.dtype = torch.float32,
    num_padding: int = 0,
    head_dim: int = HEAD_DIM,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """q (T + num_padding, heads, head_dim), caches with each sequence's blocks scattered
    over a shuffled pool (spare blocks in between), and the batch's metadata."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // block_tokens) for n in seq_lens]
    num_blocks = sum(need) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for n in need:
        tables.append(order[:n])
        order = order[n:]
    shape = (num_blocks, block_tokens, NUM_KV_HEADS, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    v_cache = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    num_tokens = sum(query_lens) + num_padding
    q = torch.randn(num_tokens, NUM_KV_HEADS * group, head_dim, generator=gen)
    meta = create_metadata(tables, seq_lens, query_lens, block_tokens, DEVICE, window)
    return q.to(dtype).to(DEVICE), k_cache, v_cache, meta


def check(q, k_cache, v_cache, meta, num_splits=None, atol=1e-5) -> None:
    """The kernel with `choose_config`'s cut, or with `num_splits` forced, against an fp64
    reference on the real rows."""
    scale = q.shape[-1] ** -0.5
    want = attention_reference(q, k_cache, v_cache, meta, scale, compute_dtype=torch.float64)
    config = choose_config(meta, q.shape[1], k_cache.shape[2], q.shape[-1], q.element_size())
    if num_splits is not None:
        config = dataclasses.replace(config, num_splits=num_splits)
    got = paged_attention(q, k_cache, v_cache, meta, scale, config)
    num_tokens = int(meta.query_start_loc[-1])
    err = (got[:num_tokens].double() - want[:num_tokens].double()).abs().max().item()
    assert err <= atol, f"max abs error {err} > {atol}"


CASES = {
    # name: (seq_lens, query_lens, group, block_tokens, window, num_splits)
    "decode_mha_partial_blocks": ([1, 17, 40], [1, 1, 1], 1, 16, None, 1),
    "decode_gqa4_split4": ([5, 70], [1, 1], 4, 32, None, 4),
    "decode_gqa8_split_auto": ([150], [1], 8, 16, None, None),
    "prefill_no_prefix_gqa4": ([20, 7], [20, 7], 4, 16, None, None),
    "prefill_after_prefix_gqa8": ([30, 50], [9, 18], 8, 16, None, None),
    "mixed_gqa1": ([33, 16, 40, 1], [1, 1, 12, 1], 1, 16, None, None),
    "mixed_window_gqa4": ([33, 70, 40], [1, 20, 1], 4, 16, 10, None),
    "mixed_split2": ([33, 45], [1, 13], 4, 16, None, 2),
    "decode_window_split4": ([90, 3], [1, 1], 4, 16, 20, 4),
    "decode_block512": ([600, 70], [1, 1], 4, 512, None, 1),
}


@pytest.mark.parametrize("name", list(CASES))
def test_triton_matches_reference_fp32(name: str) -> None:
    """Every kind of batch (decode, prefill with and without a prefix, mixed, windows,
    split-KV on and off, GQA 1/4/8, blocks of 16/32/512) gives the reference's output."""
    seq_lens, query_lens, group, block_tokens, window, num_splits = CASES[name]
    batch = make_batch(list(CASES).index(name), seq_lens, query_lens, group, block_tokens, window)
    check(*batch, num_splits=num_splits)


@pytest.mark.parametrize("seed", range(6))
def test_triton_matches_reference_on_random_batches(seed: int) -> None:
    """Batches drawn at random: 1-4 sequences, each decoding or a chunk after a prefix
    of any length (partial last blocks), GQA 1/4/8, blocks of 8/16/32, a window or none."""
    rng = random.Random(seed)
    num_seqs = rng.randint(1, 4)
    seq_lens = [rng.randint(1, 90) for _ in range(num_seqs)]
    query_lens = [1 if rng.random() < 0.5 else rng.randint(1, n) for n in seq_lens]
    group = rng.choice((1, 4, 8))
    window = rng.choice((None, rng.randint(1, 40)))
    batch = make_batch(100 + seed, seq_lens, query_lens, group, rng.choice((8, 16, 32)), window)
    check(*batch)


def test_padding_rows_and_strided_q() -> None:
    """A q that is a strided view of a fused projection, with padding rows behind the real
    tokens (slot -1), still gives the reference's output on the real rows."""
    q, k_cache, v_cache, meta = make_batch(7, [20, 35], [1, 6], 4, num_padding=3)
    fused = torch.zeros(q.shape[0], q.shape[1] + 3, HEAD_DIM, device=DEVICE)
    fused[:, : q.shape[1]] = q
    check(fused[:, : q.shape[1]], k_cache, v_cache, meta)


def test_group_and_head_dim_not_powers_of_two() -> None:
    """3 query heads per KV head (rows padded to 4) and head_dim 24 (padded to 32)."""
    check(*make_batch(13, [40, 29], [1, 11], 3, head_dim=24))
    check(*make_batch(14, [70], [1], 3, head_dim=24), num_splits=2)


def test_triton_matches_reference_fp16() -> None:
    """fp16 caches and queries: equal to an fp64 reference to fp16's precision."""
    batch = make_batch(3, [40, 25], [1, 9], 4, dtype=torch.float16)
    check(*batch, atol=3e-3)


def test_choose_config() -> None:
    """Split-KV only for decode-only steps with few sequences, never beyond a segment per
    tile of the longest context; prefill steps take tall programs."""
    decode = make_batch(1, [150], [1], 8)[3]
    assert choose_config(decode, 64, 8, 128) == KernelConfig(16, 64, 4, num_splits=2)
    decode.max_seq_len = 4096  # 64 tiles: 256 programs / 8 KV heads
    assert choose_config(decode, 64, 8, 128).num_splits == 32
    mixed = make_batch(1, [30, 40], [1, 5], 1)[3]
    assert choose_config(mixed, 32, 8, 128) == KernelConfig(128, 64, 8)
    assert choose_config(mixed, 32, 8, 256).block_m == 64
    assert choose_config(mixed, 32, 8, 128, dtype_bytes=4) == KernelConfig(64, 32, 8)
    many = create_metadata([[0]] * 32, [4] * 32, [1] * 32, 16)
    many.max_seq_len = 4096
    assert choose_config(many, 32, 8, 128).num_splits == 1


def test_other_cuts_agree() -> None:
    """Narrow key tiles, short programs and split-KV on a prefill batch give the same
    output: the cut changes the speed, never the result."""
    q, k_cache, v_cache, meta = make_batch(11, [45, 20], [13, 1], 4)
    want = paged_attention(q, k_cache, v_cache, meta, 0.25)
    for config in (KernelConfig(16, 16, 4), KernelConfig(64, 32, 4, num_splits=4)):
        got = paged_attention(q, k_cache, v_cache, meta, 0.25, config)
        assert (got[:14] - want[:14]).abs().max().item() <= 1e-5, config


def test_write_kv_matches_index_put_and_skips_padding() -> None:
    """K/V land at their slots (scattered blocks, mid-block offsets), slots of -1 leave
    the cache untouched, and strided k/v views are read right."""
    gen = torch.Generator().manual_seed(5)
    shape = (6, 16, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=gen).to(DEVICE)
    v_cache = torch.randn(shape, generator=gen).to(DEVICE)
    kv = torch.randn(5, 2 * NUM_KV_HEADS, HEAD_DIM, generator=gen).to(DEVICE)
    k, v = kv[:, :NUM_KV_HEADS], kv[:, NUM_KV_HEADS:]  # views of a fused projection
    slots = torch.tensor([37, -1, 0, 95, -1], dtype=torch.int64, device=DEVICE)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    write_kv_reference(k, v, want_k, want_v, slots)
    write_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    assert torch.equal(k_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)[95], k[3])


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="on a GPU the kernels here are compiled, not interpreted"
)
def test_gpucheck_cpu_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    """gpucheck's every path (correctness, timings, baselines) runs at tiny shapes on the
    CPU and prints one JSON document with its sections."""
    assert gpucheck.main(["--cpu-smoke", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["errors"] == [], report
    assert report["correctness"] and all(c["ok"] for c in report["correctness"])
    assert len(report["decode"]) == 4 and report["decode"][0]["ref_us"] > 0
    assert report["split_vs_not"] and report["prefill"]["TFLOPs"] > 0
