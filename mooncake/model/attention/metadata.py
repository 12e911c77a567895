"""What one engine step tells every attention layer: which sequences, where their KV lives.

Built once per step (`create_metadata` from Python lists, or by the engine's own buffers)
and read by every layer, as vLLM v1's `FlashAttentionMetadata`. A step's query tokens are
the sequences' new tokens laid end to end: a decoding sequence brings 1, a prefill chunk
many; sequence b owns rows `query_start_loc[b] : query_start_loc[b + 1]` of q.

    query token i of a sequence with context L (seq_lens[b]) and Q new tokens sits at
    absolute position L - Q + i and sees keys [0, L - Q + i]; with a sliding window W
    only the last W of those: [L - Q + i - W + 1, L - Q + i]

A slot is a token's place in the flat cache: `block_id * block_tokens + offset`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class AttentionMetadata:
    """One step's batch for paged attention; tensors on the cache's device."""

    block_tables: Tensor  # (B, max_blocks) int32: block ids of each sequence, unused tail 0
    seq_lens: Tensor  # (B,) int32: tokens of context incl. this step's new ones
    query_start_loc: Tensor  # (B + 1,) int32: cumulative new tokens, [0] = 0, [B] = T
    max_query_len: int  # the most new tokens of one sequence (1 = a decode-only step)
    max_seq_len: int  # the longest context in tokens
    slot_mapping: Tensor  # (T,) int64: slot of each new token's K/V; -1 = padding, skipped
    sliding_window: int | None = None  # tokens a query sees, itself included; None = all

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


def create_metadata(
    block_tables: list[list[int]],
    seq_lens: list[int],
    query_lens: list[int],
    block_tokens: int,
    device: str | torch.device = "cpu",
    sliding_window: int | None = None,
) -> AttentionMetadata:
    """The metadata of a batch given per sequence its block ids, its context length
    (incl. new tokens) and its number of new tokens; the new tokens' slots follow."""
    assert len(block_tables) == len(seq_lens) == len(query_lens), (
        len(block_tables),
        len(seq_lens),
        len(query_lens),
    )
    slots: list[int] = []
    starts = [0]
    for table, seq_len, q_len in zip(block_tables, seq_lens, query_lens, strict=True):
        assert 0 < q_len <= seq_len <= len(table) * block_tokens, (q_len, seq_len, len(table))
        for pos in range(seq_len - q_len, seq_len):
            slots.append(table[pos // block_tokens] * block_tokens + pos % block_tokens)
        starts.append(starts[-1] + q_len)
    width = max((len(t) for t in block_tables), default=1)
    padded = [t + [0] * (width - len(t)) for t in block_tables]
    return AttentionMetadata(
        block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        sliding_window=sliding_window,
    )
