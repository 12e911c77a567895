"""The seam between the model and paged attention: one object per model, two calls per
layer (write the new K/V by slot mapping, then attend over the paged cache), whatever
mix of decode rows and prefill chunks the step holds.

| backend  | where                        | how                                                 |
|----------|------------------------------|-----------------------------------------------------|
| `torch`  | the CPU default; reference   | per sequence: SDPA over its blocks (a view when     |
|          |                              | they are consecutive), a causal or prefix mask      |
| `triton` | the GPU default              | `triton_paged.paged_attention`: one launch per      |
|          |                              | layer for the whole batch, `kvwrite.write_kv`       |
| `flash`  | CUDA builds of torch that    | `torch.nn.attention.varlen.varlen_attn` with a      |
|          | have it (asked for by name)  | block table                                         |

`auto` takes `triton` on a GPU and `torch` on a CPU, where the per-sequence SDPA over
views of the cache is faster than any batched form that first copies the keys.

The Triton kernels are registered as torch custom ops (`mooncake::paged_attention`,
`mooncake::write_kv`): each is one dispatched op (so op counters see a launch as one
op), opaque to `torch.compile` (no graph break) and capturable in a CUDA graph. Every
host-side decision of a step (the kernel's cut, the per-sequence plan of the torch
backend) is taken once per step in `plan()`, from host integers, never by reading the
device.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from mooncake.errors import ConfigError
from mooncake.model.attention.metadata import AttentionMetadata

BACKENDS = ("auto", "torch", "triton", "flash")


class StepPlan:
    """What the host knows about a step: per sequence its block ids, context length and
    new tokens, in the order of the metadata (the torch backend reads these)."""

    def __init__(
        self,
        block_tables: list[list[int]],
        seq_lens: list[int],
        query_lens: list[int],
        block_tokens: int,
        dtype: torch.dtype,
        sliding_window: int | None = None,
    ):
        self.block_tables, self.seq_lens, self.query_lens = block_tables, seq_lens, query_lens
        self.block_tokens, self.dtype, self.sliding_window = block_tokens, dtype, sliding_window
        self.num_tokens = sum(query_lens)
        self.max_query_len = max(query_lens, default=0)
        self.max_seq_len = max(seq_lens, default=0)


class AttentionBackend:
    """Writes a step's new K/V and attends over the paged cache; `plan` runs once per step."""

    name = ""
    captures_graphs = False  # reads only device tensors: a decode step may be a CUDA graph
    plans_on_host = False  # `plan` needs the host's view of the step (a StepPlan)

    def plan(self, step: StepPlan | None, meta: AttentionMetadata, device: torch.device) -> Any:
        """Per-step decisions from the host's view of the step (None while a CUDA graph
        is captured, for a backend that `captures_graphs`)."""
        return None

    def write_kv(
        self, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata
    ) -> None:
        raise NotImplementedError

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        meta: AttentionMetadata,
        plan: Any,
        scale: float,
    ) -> Tensor:
        """(T, num_heads, head_dim) of the step's queries; k, v are its new keys/values
        (T, num_kv_heads, head_dim), already written to the caches."""
        raise NotImplementedError


# -- torch: the reference, and the CPU default ------------------------------------------


class _SeqWork:
    """One sequence of a torch-backend step: its query rows and where its keys are."""

    __slots__ = ("q_start", "q_end", "first_block", "num_blocks", "index", "kv_len", "mask")

    def __init__(self, q_start: int, q_end: int, kv_len: int):
        self.q_start, self.q_end, self.kv_len = q_start, q_end, kv_len
        self.first_block = self.num_blocks = 0
        self.index: Tensor | None = None  # block ids when not consecutive
        self.mask: Tensor | None = None  # additive (Q, kv_len), when not plain causal

    def read(self, cache: Tensor) -> Tensor:
        """(1, kv_len, kv_heads, head_dim) keys or values of this sequence."""
        if self.index is None:
            blocks = cache[self.first_block : self.first_block + self.num_blocks]
        else:  # NOTE: index_select on a 2-D view is ~2x faster than on the 4-D cache
            blocks = cache.view(cache.shape[0], -1).index_select(0, self.index)
        return blocks.view(1, -1, *cache.shape[2:])[:, : self.kv_len]


class TorchAttention(AttentionBackend):
    """A sequence at a time through SDPA: a decode row over a view of its blocks (a copy
    only when they are scattered), a first prefill chunk causal over its own K/V, a
    chunk after a prefix (or under a sliding window) over its blocks with a mask."""

    name = "torch"
    plans_on_host = True

    def plan(self, step: StepPlan | None, meta: AttentionMetadata, device: torch.device) -> Any:
        assert step is not None, "the torch backend plans from the host's view of a step"
        works, start, bt = [], 0, step.block_tokens
        masks: dict[tuple[int, int], Tensor] = {}
        for table, seq_len, q_len in zip(
            step.block_tables, step.seq_lens, step.query_lens, strict=True
        ):
            w = _SeqWork(start, start + q_len, seq_len)
            start += q_len
            n = -(-seq_len // bt)
            ids = table[:n]
            w.first_block, w.num_blocks = ids[0], n
            if ids != list(range(ids[0], ids[0] + n)):
                w.index = torch.tensor(ids, device=device)
            if step.sliding_window is not None or (q_len > 1 and seq_len > q_len):
                key = (q_len, seq_len)
                if key not in masks:
                    masks[key] = _additive_mask(q_len, seq_len, step, device)
                w.mask = masks[key]
            works.append(w)
        return works

    def write_kv(
        self, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata
    ) -> None:
        kvh, d = k_cache.shape[2:]
        k_cache.view(-1, kvh, d).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, kvh, d).index_copy_(0, meta.slot_mapping, v)

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        meta: AttentionMetadata,
        plan: Any,
        scale: float,
    ) -> Tensor:
        gqa = q.shape[1] != k_cache.shape[2]
        works: list[_SeqWork] = plan
        outs = []
        for w in works:
            q_len = w.q_end - w.q_start
            if q_len == 1:  # a decode row: (1, heads, 1, head_dim) without copying q
                qs = q[w.q_start][None, :, None]
            else:
                qs = q[w.q_start : w.q_end].transpose(0, 1)[None]  # (1, heads, Q, head_dim)
            if q_len > 1 and w.mask is None:  # the chunk starts its sequence: own K/V suffice
                keys, values = k[None, w.q_start : w.q_end], v[None, w.q_start : w.q_end]
            else:
                keys, values = w.read(k_cache), w.read(v_cache)
            o = F.scaled_dot_product_attention(
                qs,
                keys.transpose(1, 2),
                values.transpose(1, 2),
                attn_mask=w.mask,
                is_causal=q_len > 1 and w.mask is None,
                scale=scale,
                enable_gqa=gqa,
            )
            outs.append(o if q_len == 1 else o[0].transpose(0, 1))
        if meta.max_query_len == 1:  # decode rows, each (1, heads, 1, head_dim)
            return torch.cat(outs).view(q.shape)
        return torch.cat([o[0].transpose(0, 1) if o.dim() == 4 else o for o in outs])


def _additive_mask(q_len: int, seq_len: int, step: StepPlan, device: torch.device) -> Tensor:
    """(Q, L) 0/-inf in the step's dtype: the keys each new token sees (causal from its
    position). Built once per step (SDPA converts a bool mask on every call)."""
    window = step.sliding_window
    query_pos = torch.arange(seq_len - q_len, seq_len, device=device)[:, None]
    key_pos = torch.arange(seq_len, device=device)[None, :]
    hidden = key_pos > query_pos
    if window is not None:
        hidden |= key_pos <= query_pos - window
    mask = torch.zeros(hidden.shape, dtype=step.dtype, device=device)
    return mask.masked_fill_(hidden, float("-inf"))


# -- triton: one launch per layer, as custom ops -----------------------------------------


@torch.library.custom_op("mooncake::paged_attention", mutates_args=())
def _paged_attention_op(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    window: int,
    block_m: int,
    tile: int,
    num_warps: int,
    num_splits: int,
) -> Tensor:
    from mooncake.model.attention.triton_paged import KernelConfig, paged_attention

    meta = AttentionMetadata(
        block_tables,
        seq_lens,
        query_start_loc,
        max_query_len,
        max_seq_len,
        seq_lens,  # NOTE: slot_mapping is not read by the attention kernel
        window if window > 0 else None,
    )
    config = KernelConfig(block_m, tile, num_warps, num_splits)
    return paged_attention(q, k_cache, v_cache, meta, scale, config)


@_paged_attention_op.register_fake
def _(q: Tensor, *args: Any) -> Tensor:
    return torch.empty_like(q)


@torch.library.custom_op("mooncake::write_kv", mutates_args=("k_cache", "v_cache"))
def _write_kv_op(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor) -> None:
    from mooncake.model.attention.kvwrite import write_kv

    write_kv(k, v, k_cache, v_cache, slots)


@_write_kv_op.register_fake
def _(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor) -> None:
    return None


class TritonAttention(AttentionBackend):
    """The whole step in one paged-attention launch per layer (two when split-KV)."""

    name = "triton"
    captures_graphs = True

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype_bytes: int):
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim, self.dtype_bytes = head_dim, dtype_bytes

    def plan(self, step: StepPlan | None, meta: AttentionMetadata, device: torch.device) -> Any:
        from mooncake.model.attention.triton_paged import choose_config

        return choose_config(
            meta, self.num_heads, self.num_kv_heads, self.head_dim, self.dtype_bytes
        )

    def write_kv(
        self, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata
    ) -> None:
        _write_kv_op(k, v, k_cache, v_cache, meta.slot_mapping)

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        meta: AttentionMetadata,
        plan: Any,
        scale: float,
    ) -> Tensor:
        return _paged_attention_op(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            scale,
            meta.max_query_len,
            meta.max_seq_len,
            meta.sliding_window or 0,
            plan.block_m,
            plan.tile,
            plan.num_warps,
            plan.num_splits,
        )


# -- flash: torch's varlen flash attention over the block table ----------------------------


def flash_unavailable(device: torch.device, dtype: torch.dtype, block_tokens: int) -> str:
    """Why torch's paged varlen flash attention cannot serve here ("" = it can)."""
    if device.type != "cuda":
        return "it needs a CUDA GPU"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"it computes in float16/bfloat16 only, the model is {dtype}"
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen"
    if "block_table" not in inspect.signature(varlen_attn).parameters:
        return f"torch {torch.__version__}'s varlen_attn takes no block_table"
    # NOTE: FlashAttention-2's paged KV takes pages of a multiple of 256 tokens
    if block_tokens and block_tokens % 256:
        return f"its paged KV needs model.block_tokens a multiple of 256, not {block_tokens}"
    return ""


class FlashAttention(TritonAttention):
    """`varlen_attn` with the block table (causal aligned to the end of each sequence);
    new K/V written by the Triton kernel. Reads host integers (max lengths) per step,
    so its decode steps are not captured in CUDA graphs."""

    name = "flash"
    captures_graphs = False

    def plan(self, step: StepPlan | None, meta: AttentionMetadata, device: torch.device) -> Any:
        return None

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        meta: AttentionMetadata,
        plan: Any,
        scale: float,
    ) -> Tensor:
        from torch.nn.attention.varlen import varlen_attn

        window = meta.sliding_window
        out = varlen_attn(
            q,
            k_cache,
            v_cache,
            meta.query_start_loc,
            None,
            meta.max_query_len,
            meta.max_seq_len,
            scale=scale,
            window_size=(-1 if window is None else window - 1, 0),
            enable_gqa=q.shape[1] != k_cache.shape[2],
            seqused_k=meta.seq_lens,
            block_table=meta.block_tables,
        )
        return out  # type: ignore[return-value]


def triton_unavailable(device: torch.device) -> str:
    """Why the Triton kernels cannot run here ("" = they can)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed (CUDA builds of torch bring it)"
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return "it needs a CUDA GPU (or TRITON_INTERPRET=1, Triton's interpreter, for tests)"
    return ""


def select_backend(
    name: str,
    device: torch.device,
    dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_tokens: int,
) -> AttentionBackend:
    """The backend `model.attention_backend` names; raises ConfigError for one that
    cannot run here, naming why."""
    if name not in BACKENDS:
        raise ConfigError(
            f"model.attention_backend = {name!r}; choose one of {', '.join(BACKENDS)}"
        )
    if name == "auto":
        name = "triton" if device.type == "cuda" and not triton_unavailable(device) else "torch"
    if name == "torch":
        return TorchAttention()
    why = triton_unavailable(device)
    if not why and name == "flash":
        why = flash_unavailable(device, dtype, block_tokens)
    if why:
        raise ConfigError(f"model.attention_backend = {name!r} cannot run here: {why}")
    cls = FlashAttention if name == "flash" else TritonAttention
    return cls(num_heads, num_kv_heads, head_dim, torch.empty((), dtype=dtype).element_size())
