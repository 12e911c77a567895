"""Which KV heads each tensor-parallel rank holds, and how a block's KV moves between
instances of different degrees.

Megatron-style tensor parallelism (model/parallel.py) gives rank r of n the KV heads its
query heads attend with: `num_kv_heads / n` of them from head `r * num_kv_heads // n` when
n divides the KV heads, else one, replicated (ranks 0 and 1 of 4 both hold head 0 of 2).
A cache block of rank r is (block_tokens, local heads, head_dim), token-major; a whole
(TP = 1) cache block and the pool object (kv/object.py) hold every head,
(block_tokens, num_kv_heads, head_dim). The object's bytes do not depend on the degree
that wrote them, so the block-hash fingerprint does not carry it (model/info.py
`kv_fingerprint`): a prefix stored at TP = 2 is a hit at TP = 1 or 4.

Between two degrees a block moves as runs of heads (`head_runs`): for each destination
rank, its heads cut where their source rank changes, each head read from the lowest source
rank holding it (a replicated head is written once). Within one token such a run is
contiguous on both sides; across tokens it is when it spans a whole token row on both
sides (equal degrees), and then a transfer covers whole blocks as at TP = 1. Otherwise
each token is its own transfer (kv/stream.py): correct at any pair of degrees, and many
small writes; a head-major cache layout (vLLM's "HND") would make them one per head run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from mooncake.model.kvcache import PagedKVCache


@dataclass(frozen=True)
class HeadShards:
    """The KV heads of each of `ranks` tensor-parallel ranks."""

    num_kv_heads: int
    ranks: int = 1

    def __post_init__(self) -> None:
        kv, n = self.num_kv_heads, self.ranks
        if kv < 1 or n < 1 or (kv % n and n % kv):
            raise ValueError(f"{kv} KV heads do not split over {n} ranks")

    @property
    def local(self) -> int:
        """Heads one rank holds."""
        return max(self.num_kv_heads // self.ranks, 1)

    def first(self, rank: int) -> int:
        """The first head rank `rank` holds."""
        return rank * self.num_kv_heads // self.ranks

    def owner(self, head: int) -> int:
        """The lowest rank holding `head`."""
        if self.ranks <= self.num_kv_heads:
            return head // self.local
        return -(-head * self.ranks // self.num_kv_heads)

    @property
    def owners(self) -> list[int]:
        """The ranks that are their heads' lowest holder, in head order: together they
        hold every head once."""
        return [r for r in range(self.ranks) if self.owner(self.first(r)) == r]


@dataclass(frozen=True)
class HeadRun:
    """Heads [src_head, src_head + count) of rank src_rank's blocks are heads
    [dst_head, dst_head + count) of rank dst_rank's (indices within each rank's heads)."""

    src_rank: int
    dst_rank: int
    src_head: int
    dst_head: int
    count: int


def head_runs(src: HeadShards, dst: HeadShards) -> list[HeadRun]:
    """What each destination rank receives from which source rank, in maximal runs."""
    if src.num_kv_heads != dst.num_kv_heads:
        raise ValueError(f"{src.num_kv_heads} KV heads cannot fill {dst.num_kv_heads}")
    runs: list[HeadRun] = []
    for d in range(dst.ranks):
        lo = dst.first(d)
        for head in range(lo, lo + dst.local):
            s = src.owner(head)
            sh, dh = head - src.first(s), head - lo
            last = runs[-1] if runs else None
            if (
                last is not None
                and (last.src_rank, last.dst_rank) == (s, d)
                and last.src_head + last.count == sh
                and last.dst_head + last.count == dh
            ):
                runs[-1] = HeadRun(s, d, last.src_head, last.dst_head, last.count + 1)
            else:
                runs.append(HeadRun(s, d, sh, dh, 1))
    return runs


def whole_heads(
    parts: Sequence[Tensor], shards: HeadShards, device: torch.device | str | None = None
) -> Tensor:
    """Every head (..., num_kv_heads, head_dim) from each rank's (..., local, head_dim)
    (`parts[r]`, rank order), on `device` (None: parts[0]'s). Several ranks' parts are
    copied there each from its own device (`device="cpu"`: the host, not rank 0's GPU);
    one rank's part is returned as it is."""
    if shards.ranks == 1:
        return parts[0]
    where = parts[0].device if device is None else torch.device(device)
    return torch.cat([parts[r].to(where) for r in shards.owners], dim=-2)


def gather_blocks(
    caches: Sequence[PagedKVCache],
    layer: int,
    block_ids: Sequence[int],
    num_kv_heads: int,
    device: torch.device | str | None = None,
) -> tuple[Tensor, Tensor]:
    """K and V of blocks `block_ids` of `layer` with every head, (n, block_tokens,
    num_kv_heads, head_dim) each: a copy, from every rank's cache (rank order), the ranks'
    parts meeting on `device` (`whole_heads`)."""
    shards = HeadShards(num_kv_heads, len(caches))
    halves = []
    for half in (0, 1):
        parts = []
        for cache in caches:
            t = cache.layer(layer)[half]
            parts.append(t.index_select(0, torch.tensor(list(block_ids), device=t.device)))
        halves.append(whole_heads(parts, shards, device))
    return halves[0], halves[1]


def rank_heads(whole: Tensor, shards: HeadShards, rank: int) -> Tensor:
    """Rank `rank`'s heads (a view) of `whole` (..., num_kv_heads, head_dim)."""
    if shards.ranks == 1:
        return whole
    first = shards.first(rank)
    return whole[..., first : first + shards.local, :]
