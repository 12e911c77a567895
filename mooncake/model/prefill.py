"""Prefill: chunked, reusing prefix KV from the pool, streaming KV in and out layer by layer,
optionally as one stage of a chunked pipeline-parallel group.

One prefill on one stage (layers [a, b) of the model):

    start      hash the prompt's blocks; take the longest committed prefix from the source,
               validating every object (model, block hash, token ids, checksum): the first
               bad block ends the reuse, it and the rest are recomputed; allocate cache
               blocks; the loader thread starts copying reused KV, layer a first
    run_chunk  for each layer l in [a, b): (first chunk only) wait until reused layer l is
               loaded; compute; hand layer l of the blocks this chunk completed to the sink
               (asynchronous: the copy runs while layer l+1 computes)
    finish     put-end; wait for the store tail; return the last token's logits

`prefill()` runs the three steps in this process; `pipeline` runs them on a group of
stages, each owning a layer range, with chunks in flight on different stages.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from mooncake.errors import ApiError, StoreError
from mooncake.kv.hashing import PrefixHasher
from mooncake.kv.heads import gather_blocks
from mooncake.kv.layerio import BaseKVPut, BaseKVSink, BaseKVSource, LayerLoader
from mooncake.kv.object import KVLayout, KVObjectError, KVObjectView, decode_kv_object
from mooncake.model.kvcache import PagedKVCache
from mooncake.model.llama import STEP_LAST_LOGITS, STEP_LAYERS, Model
from mooncake.model.step import StepBuilder

if TYPE_CHECKING:  # the stream's transfer stack stays out of a bare engine's imports
    from mooncake.kv.stream import KVStreamer

log = logging.getLogger(__name__)
KV_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _kernel_event(t: Tensor) -> Any:
    """On a GPU, an event recorded after the kernels queued so far: a stream's writes of
    this layer wait for it (the NIC must not read KV still being written). None on CPU."""
    if not t.is_cuda:
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def check_token_ids(ids: Sequence[int], vocab_size: int) -> None:
    """Raise ApiError unless every id is in [0, vocab_size) (an embedding lookup would crash)."""
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        bad = next(t for t in ids if not 0 <= t < vocab_size)
        raise ApiError(f"token id {bad} is outside the model's vocabulary of {vocab_size}")


class ReuseMismatchError(StoreError):
    """A later pipeline stage could validate only `num_good_blocks` of the reused blocks."""

    def __init__(self, message: str, num_good_blocks: int):
        super().__init__(message)
        self.num_good_blocks = num_good_blocks


@dataclass
class PrefillStats:
    num_tokens: int = 0
    num_reused_tokens: int = 0  # prompt tokens whose KV came from the pool
    num_rejected_blocks: int = 0  # cached blocks that failed validation and were recomputed
    num_stored_blocks: int = 0  # new objects committed to the sink
    load_wait_s: float = 0.0  # compute time spent waiting for reused KV layers
    compute_s: float = 0.0  # prefix matching to the last chunk's last layer (this stage)
    store_tail_s: float = 0.0  # end of compute to the sink's commit
    seal_s: float = 0.0  # the hand-off to decode -> the pool objects sealed (a group's leader)


@dataclass
class PrefillResult:
    logits: Tensor | None  # (vocab,) float32 of the last prompt token; None on a middle stage
    block_ids: list[int]  # cache blocks now holding the prompt's KV (the caller frees them)
    stats: PrefillStats
    remote_kv: dict[int, tuple[Tensor, Tensor]] = field(default_factory=dict)  # layer -> K, V


@dataclass
class PrefillState:
    """A prefill in flight on this stage."""

    req_id: int
    token_ids: list[int]
    block_ids: list[int]
    owns_blocks: bool
    compute_start: int  # first token this stage computes
    loader: LayerLoader
    put: BaseKVPut | None
    first_store_block: int  # block index of put's first object
    fetched: list[int]  # block hashes fetched from the source (leases to release)
    stats: PrefillStats
    started: float
    hashes: list[int] = field(default_factory=list)  # chained hash of every full block
    logits: Tensor | None = None
    stream: KVStreamer | None = None  # where each finished layer's KV goes (kvstream.py)


class PrefillRunner:
    """Prefills prompts on the layers of `model`, with KV in `cache`."""

    def __init__(
        self,
        model: Model,
        cache: PagedKVCache,
        *,
        chunk_tokens: int = 1024,
        hasher: PrefixHasher | None = None,
        source: BaseKVSource | None = None,
        sink: BaseKVSink | None = None,
        fingerprint: bytes = b"",
    ):
        spec, bt = model.spec, cache.block_tokens
        assert hasher is None or hasher.block_tokens == bt, (hasher.block_tokens, bt)
        has_pool = source is not None or sink is not None
        assert not has_pool or (hasher is not None and len(fingerprint) == 16), (
            "pool I/O needs a hasher and fingerprint"
        )
        self.model, self.cache, self.chunk_tokens = model, cache, chunk_tokens
        self.hasher, self.source, self.sink, self.fingerprint = hasher, source, sink, fingerprint
        self.dtype = cache.k[0].dtype
        # every tensor-parallel rank's cache as this process addresses it (rank 0's first;
        # kv/handoff.py `place_cache_in_segments`): reused KV goes into each
        self.rank_caches: list[PagedKVCache] = [cache]
        self.steps = StepBuilder(model, bt)
        self.layout = KVLayout(
            spec.num_layers, bt, spec.num_kv_heads, spec.head_dim, KV_DTYPE_NAMES[self.dtype]
        )

    # -- the three steps --------------------------------------------------------------
    def start(
        self,
        token_ids: Sequence[int],
        *,
        req_id: int = 0,
        block_ids: list[int] | None = None,
        num_cached_tokens: int = 0,
        max_reuse_blocks: int | None = None,
        reuse_tokens: int | None = None,
        store: bool = True,
    ) -> PrefillState:
        """Match the prefix, allocate blocks (unless `block_ids` already hold the first
        `num_cached_tokens`), start loading. A later stage passes `reuse_tokens`, the first
        stage's decision, and raises ReuseMismatchError if it cannot reuse exactly that."""
        started = time.perf_counter()
        ids, bt, n = list(token_ids), self.cache.block_tokens, len(token_ids)
        assert 0 <= num_cached_tokens < n, (num_cached_tokens, n)
        check_token_ids(ids, self.model.spec.vocab_size)
        stats = PrefillStats(num_tokens=n)
        hashes = self.hasher.hash_blocks(ids) if self.hasher is not None else []
        objects: list[KVObjectView] = []
        fetched: list[int] = []
        if reuse_tokens is not None:
            want = reuse_tokens // bt
            objects, fetched = self._match(ids, hashes, want, stats)
            if len(objects) < want:
                self._release(fetched)
                raise ReuseMismatchError(
                    f"stage {self.model.first_layer}: {len(objects)} of {want} reused blocks valid",
                    len(objects),
                )
        elif num_cached_tokens == 0 and self.source is not None:
            limit = (n - 1) // bt  # NOTE: at least one token is computed, for the logits
            limit = limit if max_reuse_blocks is None else min(limit, max_reuse_blocks)
            objects, fetched = self._match(ids, hashes, limit, stats)
        stats.num_reused_tokens = len(objects) * bt
        owns = block_ids is None
        try:
            blocks = self.cache.allocate(n) if block_ids is None else block_ids
        except BaseException:
            self._release(fetched)
            raise
        assert len(blocks) * bt >= n, (len(blocks), n)
        compute_start = max(stats.num_reused_tokens, num_cached_tokens)
        first_store, num_full = compute_start // bt, n // bt
        put = None
        if self.sink is not None and store and num_full > first_store:
            tokens = [ids[b * bt : (b + 1) * bt] for b in range(first_store, num_full)]
            put = self.sink.begin(hashes[first_store:num_full], tokens)
        return PrefillState(
            req_id=req_id,
            token_ids=ids,
            block_ids=blocks,
            owns_blocks=owns,
            compute_start=compute_start,
            loader=LayerLoader(self.rank_caches, objects, blocks, self.model.layer_ids),
            put=put,
            first_store_block=first_store,
            fetched=fetched,
            stats=stats,
            started=started,
            hashes=hashes,
        )

    @torch.inference_mode()
    def run_chunk(
        self, st: PrefillState, start: int, end: int, hidden: Tensor | None = None
    ) -> Tensor:
        """Run tokens [start, end) through this stage's layers; returns the activations
        (T, hidden) for the next stage. On the last stage the final chunk sets st.logits."""
        model, bt = self.model, self.cache.block_tokens
        new_ids = st.token_ids[start:end] if model.is_first else None
        step = self.steps.build([st.block_ids], [end], [end - start], new_ids)
        if model.on_step is not None:  # tensor parallelism: the other ranks run it too
            if start == st.compute_start:  # NOTE: they read the reused KV from layer 0 on
                self._wait_loaded(st)
            last = model.is_last and end == len(st.token_ids)
            model.announce(STEP_LAST_LOGITS if last else STEP_LAYERS, step)
        if model.is_first:
            h = model.embed(step.tokens)
        else:  # activations from the previous stage arrive in host memory
            assert hidden is not None, "a later stage needs activations"
            h = hidden.to(model.inv_freq.device)
        assert h.shape[0] == end - start, "a later stage needs activations"
        done = [b for b in range(st.first_store_block, end // bt) if (b + 1) * bt > start]
        for layer in model.layer_ids:
            if start == st.compute_start:
                t0 = time.perf_counter()
                st.loader.wait(layer)
                st.stats.load_wait_s += time.perf_counter() - t0
            k, v = self.cache.layer(layer)
            h = model.layer(layer)(h, step, k, v)
            event = _kernel_event(k) if st.put is not None or st.stream is not None else None
            if st.put is not None and done:
                ks, vs = self._whole_blocks(layer, [st.block_ids[b] for b in done])
                st.put.write_layer(layer, [b - st.first_store_block for b in done], ks, vs, event)
            if st.stream is not None:  # the first chunk also carries the reused prefix
                lo = 0 if start == st.compute_start else start
                st.stream.layer_done(layer, lo, end, event)
        if model.is_last and end == len(st.token_ids):
            st.logits = model.compute_logits(h[-1:])[0]
        return h

    def finish(self, st: PrefillState, wait_store: bool = True) -> PrefillResult:
        """Put-end and (by default) wait for it. Without `wait_store` the caller must
        `st.put.wait()` before freeing or reusing the blocks."""
        st.loader.join()
        self._release(st.fetched)
        st.stats.compute_s = time.perf_counter() - st.started
        if st.put is not None:
            st.put.commit()
            if wait_store:
                t0 = time.perf_counter()
                st.stats.num_stored_blocks = st.put.wait()
                st.stats.store_tail_s = time.perf_counter() - t0
        return PrefillResult(st.logits, st.block_ids, st.stats)

    def abort(self, st: PrefillState) -> None:
        """Give up a prefill: nothing is committed; blocks this runner allocated are freed
        (once no write of its KV stream is on the wire)."""
        if st.stream is not None:
            st.stream.abort()
        st.loader.join()
        self._release(st.fetched)
        if st.owns_blocks:
            self.cache.free(st.block_ids)

    def prefill(
        self, token_ids: Sequence[int], *, req_id: int = 0, **start_kw: Any
    ) -> PrefillResult:
        """Prefill a whole prompt in chunks on this process (all layers, or the ones this
        model owns; `pipeline.prefill_pipelined` drives a multi-stage group)."""
        st = self.start(token_ids, req_id=req_id, **start_kw)
        try:
            for start in range(st.compute_start, len(st.token_ids), self.chunk_tokens):
                self.run_chunk(st, start, min(start + self.chunk_tokens, len(st.token_ids)))
            return self.finish(st)
        except BaseException:
            self.abort(st)
            raise

    # -- helpers ----------------------------------------------------------------------
    def _match(
        self, ids: list[int], hashes: list[int], limit: int, stats: PrefillStats
    ) -> tuple[list[KVObjectView], list[int]]:
        """Validated objects of the longest usable prefix (at most `limit` blocks)."""
        if self.source is None or limit <= 0 or not hashes:
            return [], []
        bt = self.cache.block_tokens
        hit = self.source.match_prefix(hashes[:limit])
        fetched = hashes[:hit]
        objects: list[KVObjectView] = []
        for i, buf in enumerate(self.source.fetch(fetched) if hit else []):
            if buf is None:
                break
            try:
                objects.append(
                    decode_kv_object(
                        buf,
                        self.layout,
                        self.fingerprint,
                        block_hash=hashes[i],
                        token_ids=ids[i * bt : (i + 1) * bt],
                    )
                )
            except KVObjectError as e:
                log.warning("prefix block %d not reused, recomputing from it: %s", i, e)
                stats.num_rejected_blocks += 1
                self.source.discard(hashes[i])
                break
        return objects, fetched

    def _whole_blocks(self, layer: int, ids: list[int]) -> tuple[list[Tensor], list[Tensor]]:
        """Blocks `ids` of `layer`, K and V, with every KV head (a copy gathered from the
        ranks under tensor parallelism, else views of the cache)."""
        if len(self.rank_caches) == 1:
            k, v = self.cache.layer(layer)
            return [k[i] for i in ids], [v[i] for i in ids]
        k, v = gather_blocks(self.rank_caches, layer, ids, self.layout.num_kv_heads)
        return list(k), list(v)

    def _wait_loaded(self, st: PrefillState) -> None:
        """Every layer of the reused KV in every rank's cache (tensor parallelism: the
        other ranks read it as soon as they run, with no loader to wait for)."""
        t0 = time.perf_counter()
        for layer in self.model.layer_ids:
            st.loader.wait(layer)
        for c in self.rank_caches:
            if c.k[0].device.type == "cuda":
                torch.cuda.synchronize(c.k[0].device)
        st.stats.load_wait_s += time.perf_counter() - t0

    def _release(self, fetched: list[int]) -> None:
        if fetched and self.source is not None:
            self.source.release(fetched)
