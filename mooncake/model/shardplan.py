"""Which slice of each whole weight a tensor-parallel rank holds (the shard plan), so that
cutting a loaded model (`parallel.shard_model`), reading a checkpoint (`weights`: only the
rows or columns a rank needs, through `safe_open(...).get_slice`) and drawing dummy weights
all take exactly the same slice.

A `Cut` says how a rank's tensor comes from the whole (TP = 1) tensor of the same name:
the concatenation along `dim` of the whole's index ranges `spans`, then `pad` zero rows.
Rank r of n, with head_dim d, h = num_heads / n query heads, c = local KV heads
(`local_kv_heads`: num_kv_heads / n, or 1 replicated when there are fewer than ranks),
w = an MLP's (or an expert's) width / n and s = ceil(vocab / n) rows of the vocabulary:

| parameter                  | dim | spans of the whole                                 |
|----------------------------|-----|----------------------------------------------------|
| `qkv_proj.weight`, `.bias` | 0   | q rows [r h d, (r + 1) h d); k and v rows of heads |
|                            |     | [k0, k0 + c), k0 = r kv / n (each after the ones before) |
| `o_proj.weight`            | 1   | [r h d, (r + 1) h d)                               |
| `gate_up_proj.weight`      | 0   | gate [r w, r w + w), up I + [r w, r w + w)         |
| `down_proj.weight`         | 1   | [r w, (r + 1) w)                                   |
| `experts.gate_up_proj`     | 1   | as gate_up_proj, in every expert (E, 2I, H)        |
| `experts.down_proj`        | 2   | as down_proj, in every expert (E, H, I)            |
| `embed_tokens`, `lm_head`  | 0   | [r s, r s + s) cut at vocab; `lm_head` padded to s |
| norms, q/k norms, router   | -   | whole (replicated)                                 |
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from mooncake.model.spec import ModelSpec


@dataclass(frozen=True)
class Cut:
    """A rank's slice of a whole tensor: `whole`'s ranges `spans` along `dim`, concatenated,
    then `pad` zero rows (dim 0)."""

    shape: tuple[int, ...]  # the whole tensor's
    dim: int
    spans: tuple[tuple[int, int], ...]  # [start, end) along `dim`
    pad: int = 0  # zero rows appended (a vocab-parallel LM head's last shard)

    @property
    def local_shape(self) -> tuple[int, ...]:
        """The rank's tensor's shape."""
        shape = list(self.shape)
        shape[self.dim] = sum(b - a for a, b in self.spans)
        shape[0] += self.pad
        return tuple(shape)

    def apply(self, whole: Tensor) -> Tensor:
        """The rank's slice of `whole` (a new tensor, also on the meta device)."""
        assert tuple(whole.shape) == self.shape, (tuple(whole.shape), self.shape)
        assert not self.pad or self.dim == 0, self
        parts = [whole.narrow(self.dim, a, b - a) for a, b in self.spans]
        if self.pad:
            parts.append(whole.new_zeros(self.pad, *whole.shape[1:]))
        return torch.cat(parts, dim=self.dim)

    def inner(self) -> Cut:
        """The same cut of one expert's slab (the whole's first dimension dropped)."""
        assert self.dim > 0 and not self.pad, self
        return Cut(self.shape[1:], self.dim - 1, self.spans)


def local_kv_heads(num_kv_heads: int, size: int) -> int:
    """KV heads a rank holds: its share, or one (replicated) when they are fewer."""
    return max(num_kv_heads // size, 1)


def vocab_rows(vocab_size: int, rank: int, size: int) -> tuple[int, int, int]:
    """(first row, rows held, shard rows) of the vocabulary on `rank`: shards of
    ceil(vocab / size) rows, the last one short (padded by the LM head)."""
    shard = -(-vocab_size // size)
    lo = min(rank * shard, vocab_size)
    return lo, min(shard, vocab_size - lo), shard


def plan_cuts(
    spec: ModelSpec, names: Iterable[tuple[str, tuple[int, ...]]], rank: int, size: int
) -> dict[str, Cut]:
    """The cut of each parameter (local name, whole shape) of a model of `spec` that rank
    `rank` of `size` takes; parameters kept whole are absent."""
    d = spec.head_dim
    heads = spec.num_heads // size
    kv_heads = local_kv_heads(spec.num_kv_heads, size)
    kv_first = rank * spec.num_kv_heads // size  # the KV head of this rank's first query head
    q_size, kv_size = spec.num_heads * d, spec.num_kv_heads * d
    lo, count, shard = vocab_rows(spec.vocab_size, rank, size)

    def halves(i: int) -> tuple[tuple[int, int], ...]:  # gate rows, then up rows, of width i
        w = i // size
        return ((rank * w, rank * w + w), (i + rank * w, i + rank * w + w))

    def cols(i: int) -> tuple[tuple[int, int], ...]:
        w = i // size
        return ((rank * w, rank * w + w),)

    cuts = {}
    for name, shape in names:
        suffix = name.split(".", 2)[2] if name.startswith("layers.") else name
        if suffix.startswith("self_attn.qkv_proj."):
            q = (rank * heads * d, (rank + 1) * heads * d)
            k = (q_size + kv_first * d, q_size + (kv_first + kv_heads) * d)
            v = (k[0] + kv_size, k[1] + kv_size)
            cuts[name] = Cut(shape, 0, (q, k, v))
        elif suffix == "self_attn.o_proj.weight":
            cuts[name] = Cut(shape, 1, ((rank * heads * d, (rank + 1) * heads * d),))
        elif suffix == "mlp.gate_up_proj.weight":
            cuts[name] = Cut(shape, 0, halves(spec.intermediate_size))
        elif suffix == "mlp.down_proj.weight":
            cuts[name] = Cut(shape, 1, cols(spec.intermediate_size))
        elif suffix == "mlp.experts.gate_up_proj":
            cuts[name] = Cut(shape, 1, halves(spec.moe_intermediate_size))
        elif suffix == "mlp.experts.down_proj":
            cuts[name] = Cut(shape, 2, cols(spec.moe_intermediate_size))
        elif name == "embed_tokens.weight":
            cuts[name] = Cut(shape, 0, ((lo, lo + count),))
        elif name == "lm_head.weight":
            cuts[name] = Cut(shape, 0, ((lo, lo + count),), pad=shard - count)
        elif not name.endswith("norm.weight") and suffix != "mlp.gate.weight":
            raise AssertionError(f"no shard plan for parameter {name}")
    return cuts
