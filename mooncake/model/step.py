"""A step's inputs on the device, built once per step from host lists: the tokens, their
positions and cache slots, and the attention metadata every layer reads.

Everything integer goes up in one int32 buffer, with one non-blocking copy from pinned
host memory (on a GPU; on a CPU the buffer is the tensor):

    [ tokens T | positions T | slots T | seq_lens B | query_start_loc B + 1 | tables B x W ]

A decode step padded to a CUDA-graph bucket of `pad_to` sequences adds padding sequences
of one token at position 0 whose slot is -1 (their K/V is never written) and whose block
table is all block 0 (they read one key of block 0 and their rows are dropped). With
`out`, the copy lands in a graph's static buffer laid out for that bucket.

RoPE's cos/sin are looked up by position in the model's tables (`Model.rope_tables`), so
no step computes a transcendental on the host or the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from mooncake.model.attention.backend import AttentionBackend, StepPlan
from mooncake.model.attention.metadata import AttentionMetadata

if TYPE_CHECKING:
    from mooncake.model.llama import Model


@dataclass
class Step:
    """One forward's batch, shared by every layer."""

    tokens: Tensor  # (T,) int32 token ids (unused on a later pipeline stage)
    positions: Tensor  # (T,) int32
    cos: Tensor  # (T, 1, head_dim)
    sin: Tensor  # (T, 1, head_dim)
    meta: AttentionMetadata
    backend: AttentionBackend
    plan: Any  # the backend's per-step decisions (kernel cut, per-sequence work)
    layout: Layout | None = None  # where its integers are (tensor parallelism sends them)


@dataclass
class Layout:
    """Where a step's integers went: the device buffer and the shape of its regions."""

    flat: Tensor  # int32 on the device
    num_tokens: int
    num_seqs: int
    width: int  # block table entries per sequence
    max_query_len: int
    max_seq_len: int


def flat_size(num_tokens: int, num_seqs: int, width: int) -> int:
    """int32 elements of the flat buffer of a step."""
    return 3 * num_tokens + 2 * num_seqs + 1 + num_seqs * width


def step_views(
    flat: Tensor, num_tokens: int, num_seqs: int, width: int
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(tokens, positions, slots, seq_lens, query_start_loc, block_tables) of a flat buffer."""
    t, b = num_tokens, num_seqs
    tables = flat[3 * t + 2 * b + 1 : 3 * t + 2 * b + 1 + b * width].view(b, width)
    return (
        flat[:t],
        flat[t : 2 * t],
        flat[2 * t : 3 * t],
        flat[3 * t : 3 * t + b],
        flat[3 * t + b : 3 * t + 2 * b + 1],
        tables,
    )


class StepBuilder:
    """Builds `Step`s for one runner on one model; owns the pinned upload buffers."""

    NUM_HOST_BUFFERS = 2  # one fills while the previous one's copy may still run

    def __init__(self, model: Model, block_tokens: int):
        self.model, self.block_tokens = model, block_tokens
        self.sliding_window = model.sliding_window  # the model's: its logits depend on it
        self.device = model.inv_freq.device
        self.dtype = next(model.parameters()).dtype
        self._is_cuda = self.device.type == "cuda"
        self._host: list[tuple[Tensor, np.ndarray] | None] = [None] * self.NUM_HOST_BUFFERS
        self._events: list[Any] = [None] * self.NUM_HOST_BUFFERS
        self._turn = 0

    def build(
        self,
        block_tables: list[list[int]],
        seq_lens: list[int],
        query_lens: list[int],
        token_ids: list[int] | None,
    ) -> Step:
        """The step of sequences given by block ids, context lengths (incl. new tokens)
        and new tokens; `token_ids` are the new tokens laid end to end (None on a later
        pipeline stage). A CUDA graph's steps are `upload`ed into its buffer instead."""
        layout = self.upload(block_tables, seq_lens, query_lens, token_ids)
        plan = StepPlan(
            block_tables, seq_lens, query_lens, self.block_tokens, self.dtype, self.sliding_window
        )
        return self.derive(layout, plan)

    def upload(
        self,
        block_tables: list[list[int]],
        seq_lens: list[int],
        query_lens: list[int],
        token_ids: list[int] | None,
        *,
        pad_to: int = 0,
        width: int = 0,
        out: Tensor | None = None,
    ) -> Layout:
        """Pack the step's integers on the host and start their copy to the device: padded
        to `pad_to` sequences (decode only), block tables `width` wide (default: the
        longest needed), into `out` (a graph's buffer) if given."""
        bt = self.block_tokens
        num_real = len(seq_lens)
        num_seqs = max(num_real, pad_to)
        num_tokens = sum(query_lens) + (num_seqs - num_real)
        need = max((-(-n // bt) for n in seq_lens), default=1)
        width = width or need
        assert need <= width, (need, width)
        size = flat_size(num_tokens, num_seqs, width)
        host, arr = self._host_buffer(size)
        tok, pos, slot, lens, starts, tables = step_views_np(arr, num_tokens, num_seqs, width)
        tables[:] = 0
        t = 0
        for b, (table, n, q) in enumerate(zip(block_tables, seq_lens, query_lens, strict=True)):
            blocks = -(-n // bt)
            tables[b, :blocks] = table[:blocks]
            if q == 1:
                p = n - 1
                pos[t] = p
                slot[t] = table[p // bt] * bt + p % bt
            else:
                p_arr = np.arange(n - q, n, dtype=np.int64)
                pos[t : t + q] = p_arr
                slot[t : t + q] = tables[b, p_arr // bt].astype(np.int64) * bt + p_arr % bt
            lens[b] = n
            starts[b] = t
            t += q
        pad = num_seqs - num_real
        if pad:
            assert all(q == 1 for q in query_lens), "only decode steps are padded"
            pos[t:] = 0
            slot[t:] = -1
            lens[num_real:] = 1
            starts[num_real:num_seqs] = np.arange(t, t + pad)
        starts[num_seqs] = num_tokens
        tok[:] = 0
        if token_ids is not None:
            assert len(token_ids) == num_tokens - pad, (len(token_ids), num_tokens, pad)
            tok[: num_tokens - pad] = token_ids
        flat = self._upload(host, out)
        return Layout(
            flat,
            num_tokens,
            num_seqs,
            width,
            max(query_lens, default=1),
            max(seq_lens, default=1),
        )

    def derive(self, layout: Layout, plan: StepPlan | None) -> Step:
        """The step's tensors (views of the uploaded buffer, the slots in int64, RoPE's
        cos/sin) and the backend's plan (from `plan`, the host's view of the step; None
        when a CUDA graph is captured: the backend plans from the metadata alone)."""
        d_tok, d_pos, d_slot, d_lens, d_starts, d_tables = step_views(
            layout.flat, layout.num_tokens, layout.num_seqs, layout.width
        )
        meta = AttentionMetadata(
            block_tables=d_tables,
            seq_lens=d_lens,
            query_start_loc=d_starts,
            max_query_len=layout.max_query_len,
            max_seq_len=layout.max_seq_len,
            slot_mapping=d_slot.long(),
            sliding_window=self.sliding_window,
        )
        cos, sin = self.model.rope_lookup(d_pos, layout.max_seq_len)
        backend = self.model.attention
        plan_ = backend.plan(plan, meta, self.device)
        return Step(d_tok, d_pos, cos, sin, meta, backend, plan_, layout)

    def _host_buffer(self, size: int) -> tuple[Tensor, np.ndarray]:
        """A host buffer of `size` int32 as a tensor and a numpy view of it."""
        if not self._is_cuda:  # NOTE: a fresh array: the step's tensors are views of it
            arr = np.empty(size, dtype=np.int32)
            return torch.from_numpy(arr), arr
        i = self._turn = (self._turn + 1) % self.NUM_HOST_BUFFERS
        if self._events[i] is not None:  # its last upload has long finished in practice
            self._events[i].synchronize()
        held = self._host[i]
        if held is None or held[0].numel() < size:
            num = max(size, 2 * (held[0].numel() if held is not None else 0))
            buf = torch.empty(num, dtype=torch.int32, pin_memory=True)
            held = self._host[i] = buf, buf.numpy()
        return held[0][:size], held[1][:size]

    def _upload(self, host: Tensor, out: Tensor | None) -> Tensor:
        if not self._is_cuda:
            return host
        if out is None:
            flat = host.to(self.device, non_blocking=True)
        else:
            flat = out[: host.numel()]
            flat.copy_(host, non_blocking=True)
        event = self._events[self._turn] = torch.cuda.Event()
        event.record()
        return flat


def step_views_np(
    arr: np.ndarray, num_tokens: int, num_seqs: int, width: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`step_views` of a numpy array (the host side)."""
    t, b = num_tokens, num_seqs
    base = 3 * t + 2 * b + 1
    return (
        arr[:t],
        arr[t : 2 * t],
        arr[2 * t : 3 * t],
        arr[3 * t : 3 * t + b],
        arr[3 * t + b : base],
        arr[base : base + b * width].reshape(b, width),
    )
