"""What a decode node checks and keeps of a request's KV: a submitted request's KV landed
on every layer (`missing_layers`), and a finished request's output KV goes into the pool
(`StoringDecodeRunner`, `store_output_kv`), so the conversation's next turn hits it."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from mooncake.kv.heads import gather_blocks
from mooncake.kv.pool import StoreKVPool
from mooncake.model.decode import DecodeRunner
from mooncake.model.kvcache import PagedKVCache
from mooncake.model.sequence import Sequence
from mooncake.roles.node.messages import DecodeSubmitMsg
from mooncake.roles.node.worker import Worker

log = logging.getLogger(__name__)


class StoringDecodeRunner(DecodeRunner):
    """A DecodeRunner that hands a finished request's blocks to `on_retire` before it
    frees them."""

    def __init__(self, *args: Any, on_retire: Callable[[Sequence], None], **kw: Any):
        super().__init__(*args, **kw)
        self.on_retire = on_retire

    def _retire(self, seq: Sequence) -> None:
        if seq.block_ids and seq.finish_reason in ("stop", "length"):
            try:
                self.on_retire(seq)
            except Exception:  # storing is an optimisation; the request already succeeded
                log.exception("req %d: storing its output KV failed", seq.seq_id)
        super()._retire(seq)


def store_output_kv(
    w: Worker, pool: StoreKVPool, seq: Sequence, rank_caches: list[PagedKVCache] | None = None
) -> None:
    """Put the full blocks the prefill node did not store (those holding output) into the
    pool; copies the blocks first, since they are freed right after. `rank_caches`: every
    tensor-parallel rank's cache (rank order), whose heads each object gathers."""
    bt = w.cache.block_tokens
    num_full = seq.num_cached_tokens // bt
    first = (seq.prompt_len - 1) // bt
    if num_full <= first:
        return
    ids = seq.token_ids[: num_full * bt]
    hashes = w.hasher.hash_blocks(ids)[first:]
    put = pool.begin(hashes, [ids[b * bt : (b + 1) * bt] for b in range(first, num_full)])
    caches = rank_caches or [w.cache]
    where = "cpu" if len(caches) > 1 else None  # NOTE: ranks' heads meet on the host
    blocks = seq.block_ids[first:num_full]
    positions = list(range(num_full - first))
    for layer in w.model.layer_ids:
        k, v = gather_blocks(caches, layer, blocks, w.info.spec.num_kv_heads, where)
        put.write_layer(layer, positions, list(k), list(v))
    put.commit()


def missing_layers(msg: DecodeSubmitMsg, num_layers: int) -> str:
    """What the submitted KV lacks ("" = every layer holds all num_cached_tokens)."""
    want = msg.num_cached_tokens
    if want == 0:
        return ""
    got = msg.layer_tokens
    if len(got) != num_layers:
        return f"tokens written for {len(got)} of {num_layers} layers"
    short = [f"layer {i}: {n}" for i, n in enumerate(got) if n != want]
    return f"tokens written of {want}: {', '.join(short[:4])}" if short else ""
