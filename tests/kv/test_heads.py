"""KV heads across tensor-parallel degrees (kv/heads.py) and the copies a hand-off posts
between them (kv/stream.py `copy_runs`): moving every rank's blocks by the runs, byte by
byte, gives each destination rank exactly its heads of the whole KV, at any pair of
degrees, KV heads split or replicated."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

pytest.importorskip("torch", reason="the KV tests need torch")
import torch  # noqa: E402

from mooncake.kv.heads import HeadShards, head_runs, rank_heads, whole_heads  # noqa: E402
from mooncake.kv.stream import copy_runs  # noqa: E402


def test_heads_of_each_rank() -> None:
    s = HeadShards(8, 2)
    assert (s.local, s.first(0), s.first(1), s.owner(3), s.owner(4)) == (4, 0, 4, 0, 1)
    r = HeadShards(2, 4)  # replicated: ranks 0, 1 hold head 0; ranks 2, 3 head 1
    assert r.local == 1 and [r.first(i) for i in range(4)] == [0, 0, 1, 1]
    assert [r.owner(h) for h in range(2)] == [0, 2] and r.owners == [0, 2]
    with pytest.raises(ValueError, match="do not split"):
        HeadShards(6, 4)


def test_runs_are_maximal() -> None:
    assert [
        (x.src_rank, x.dst_rank, x.count) for x in head_runs(HeadShards(8, 2), HeadShards(8))
    ] == [
        (0, 0, 4),
        (1, 0, 4),
    ]
    same = head_runs(HeadShards(8, 2), HeadShards(8, 2))
    assert [(x.src_rank, x.dst_rank, x.src_head, x.dst_head, x.count) for x in same] == [
        (0, 0, 0, 0, 4),
        (1, 1, 0, 0, 4),
    ]


DEGREES = [(kv, a, b) for kv in (2, 4) for a, b in itertools.product((1, 2, 4), repeat=2)]


@pytest.mark.parametrize(("kv", "src_n", "dst_n"), DEGREES)
def test_copies_deliver_each_rank_its_heads(kv: int, src_n: int, dst_n: int) -> None:
    bt, d, blocks, tokens = 4, 3, 5, 13  # 13 tokens: the last block partly filled
    gen = torch.Generator().manual_seed(kv * 100 + src_n * 10 + dst_n)
    whole = torch.randn(blocks, bt, kv, d, generator=gen)  # a TP = 1 cache, blocks in order
    src, dst = HeadShards(kv, src_n), HeadShards(kv, dst_n)
    src_blocks, dst_blocks = [4, 0, 2, 1], [1, 3, 0, 4]  # prompt block i -> cache block
    src_caches = [torch.zeros(blocks, bt, src.local, d) for _ in range(src_n)]
    for r, cache in enumerate(src_caches):
        for i, b in enumerate(src_blocks):
            cache[b] = rank_heads(whole[i], src, r)
    dst_caches = [torch.zeros(blocks, bt, dst.local, d) for _ in range(dst_n)]
    hb = d * 4
    src_row, dst_row = src.local * hb, dst.local * hb
    used = range(-(-tokens // bt))
    for run in head_runs(src, dst):
        src_bytes = src_caches[run.src_rank].numpy().view(np.uint8).reshape(-1)
        dst_bytes = dst_caches[run.dst_rank].numpy().view(np.uint8).reshape(-1)
        for s, t, n in copy_runs(
            bt,
            [b * bt * src_row for b in src_blocks],
            [b * bt * dst_row for b in dst_blocks],
            used,
            (0, tokens),
            (src_row, dst_row),
            (run.src_head * hb, run.dst_head * hb),
            run.count * hb,
        ):
            dst_bytes[t : t + n] = src_bytes[s : s + n]
    for r, cache in enumerate(dst_caches):
        got = torch.cat([cache[b] for b in dst_blocks]).reshape(-1, dst.local, d)[:tokens]
        want = rank_heads(whole, dst, r)[: len(dst_blocks)].reshape(-1, dst.local, d)[:tokens]
        assert torch.equal(got, want), r
    # and gathered back, every head once
    parts = [c[src_blocks[0]] for c in src_caches]
    assert torch.equal(whole_heads(parts, src), whole[0])


def test_whole_rows_coalesce_across_a_block() -> None:
    """Equal degrees: one copy per run of consecutive blocks, as at TP = 1."""
    runs = copy_runs(4, [0, 64, 128], [0, 64, 512], range(3), (0, 12), (16, 16), (0, 0), 16)
    assert runs == [[0, 0, 128], [128, 512, 64]]
