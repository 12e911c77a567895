"""Streaming a prefill's KV out layer by layer while the next layers compute.

As each layer of each chunk finishes on a stage, `KVStreamer.layer_done` queues one-sided
writes of that layer's new KV, straight from the stage's paged cache (registered with its
Transfer Engine: kv/handoff.py), to where the request's plan says:

    decode   the blocks its decode node reserved (`KVDest`): every token of the prompt
             written so far (the first chunk also carries the reused prefix, loaded
             from the pool into the cache)
    pool     the replicas of each new full block's pool object (`PoolTarget`, from the
             leader's put-start): this stage's layers, in place, at the object layout's
             offsets; with each layer's digest, so that the leader can seal the object
             (kvobject.object_head) once every stage reported

A writer thread (`StreamWriter`, one per node) builds and posts the writes, so compute
never waits on the network; on a GPU it first waits for the CUDA event recorded after the
layer's kernels (the NIC must not read KV the GPU has not finished writing). `finish`
waits for every write and returns a `StreamReport` (tokens written per layer, digests)
that the decode node checks before it decodes from those blocks: it never starts on a
timer. `abort` waits for writes still on the wire, so that released blocks are never
written after their release.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Sequence
from typing import Any

import msgspec
import torch
from torch import Tensor

from mooncake.errors import TransferError
from mooncake.kv.handoff import rank_prefix, segment_name
from mooncake.kv.heads import HeadShards, gather_blocks, head_runs
from mooncake.kv.object import KVLayout, layer_digest
from mooncake.model.kvcache import PagedKVCache
from mooncake.store.metadata.objects import ReplicaDesc
from mooncake.store.node.node import remote_name
from mooncake.transfer import TransferEngine, TransferRequest
from mooncake.transfer.batch import Batch
from mooncake.transfer.types import TransferOp

log = logging.getLogger(__name__)


class KVDest(msgspec.Struct, frozen=True, kw_only=True):
    """Blocks a decode node reserved for a request's KV."""

    endpoint: str  # host:port of the decode node's transfer server
    prefix: str  # layer l's K is segment f"{prefix}k{l}", V f"{prefix}v{l}"
    block_ids: list[int]
    num_tokens: int  # tokens of KV the decode node expects (the prompt but its last token)
    # its tensor-parallel degree: rank r's blocks are under handoff.rank_prefix(prefix, r, ranks)
    ranks: int = 1


class PoolTarget(msgspec.Struct, frozen=True, kw_only=True):
    """A new full block of the prompt and the replicas its pool object is written into."""

    block: int  # index of the block in the prompt
    replicas: list[ReplicaDesc]


class StreamPlan(msgspec.Struct, frozen=True, kw_only=True):
    """Where one request's KV goes; the leader sends it to every stage."""

    decode: KVDest | None = None
    pool: list[PoolTarget] = []


class StreamReport(msgspec.Struct, frozen=True, kw_only=True):
    """What one stage wrote: layer -> tokens of KV now in the decode node's blocks, and
    layer -> the digest of that layer of each pool target, in the plan's order."""

    layer_tokens: dict[int, int]
    digests: dict[int, list[int]]
    num_bytes: int = 0


class StreamWriter:
    """The node's writer thread: builds and posts the writes streamers queue."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[KVStreamer, int, int, int, Any] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._run, name="kv-stream", daemon=True)
        self._thread.start()

    def put(self, streamer: KVStreamer, layer: int, start: int, end: int, event: Any) -> None:
        self._queue.put((streamer, layer, start, end, event))

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            streamer, layer, start, end, event = item
            streamer._post(layer, start, end, event)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)


class KVStreamer:
    """Streams one request's KV from this stage's layers of `cache` (`src_block_ids`)."""

    def __init__(
        self,
        engine: TransferEngine,
        cache: PagedKVCache | Sequence[PagedKVCache],
        src_prefix: str,
        src_block_ids: Sequence[int],
        plan: StreamPlan,
        layout: KVLayout,
        writer: StreamWriter,
        timeout_s: float,
    ):
        """`cache`: this stage's cache, or every tensor-parallel rank's (rank order, each
        registered under `handoff.rank_prefix(src_prefix, rank, ranks)`)."""
        self.caches = [cache] if isinstance(cache, PagedKVCache) else list(cache)
        self.cache = self.caches[0]
        self.engine, self.src_prefix = engine, src_prefix
        self.src_shards = HeadShards(layout.num_kv_heads, len(self.caches))
        self.src_blocks, self.plan, self.layout = list(src_block_ids), plan, layout
        self.writer, self.timeout_s = writer, timeout_s
        bt = self.cache.block_tokens
        self._targets = {t.block: i for i, t in enumerate(plan.pool)}
        if plan.decode is not None:
            need = -(-plan.decode.num_tokens // bt)
            if len(plan.decode.block_ids) < need or len(self.src_blocks) < need:
                raise TransferError(
                    f"stream plan: {plan.decode.num_tokens} tokens need {need} blocks, got "
                    f"{len(plan.decode.block_ids)} reserved and {len(self.src_blocks)} local"
                )
        self._cond = threading.Condition()
        self._queued = 0
        self._batches: list[Batch] = []
        self._error: BaseException | None = None
        self._layer_tokens: dict[int, int] = {}
        self._digests: dict[int, list[int]] = {}

    # -- the compute thread -----------------------------------------------------------
    def layer_done(self, layer: int, start: int, end: int, event: Any = None) -> None:
        """Layer `layer` now holds the final KV of tokens [start, end): stream them.
        `event`: a CUDA event recorded after the layer's kernels (None on CPU)."""
        with self._cond:
            self._queued += 1
        self.writer.put(self, layer, start, end, event)

    def finish(self) -> StreamReport:
        """Wait for every write; raises TransferError if any failed."""
        self._drain()
        if self._error is not None:
            raise TransferError(f"streaming KV failed: {self._error}") from self._error
        total = 0
        for batch in self._batches:
            total += batch.check(timeout=self.timeout_s)
        return StreamReport(
            layer_tokens=dict(self._layer_tokens), digests=dict(self._digests), num_bytes=total
        )

    def abort(self) -> None:
        """Give up: wait until no write of this stream is queued or on the wire."""
        self._drain()
        for batch in self._batches:
            with contextlib.suppress(TransferError):  # abandoned: only its end matters
                batch.check(timeout=self.timeout_s)

    def _drain(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._queued == 0)

    # -- the writer thread ------------------------------------------------------------
    def _post(self, layer: int, start: int, end: int, event: Any) -> None:
        try:
            if self._error is None:
                if event is not None:
                    event.synchronize()
                reqs = self._decode_writes(layer, start, end) + self._pool_writes(layer, start, end)
                if reqs:
                    self._batches.append(self.engine.submit(reqs, timeout=self.timeout_s))
        except BaseException as e:  # reported by finish()
            self._error = e
        finally:
            with self._cond:
                self._queued -= 1
                self._cond.notify_all()

    def _decode_writes(self, layer: int, start: int, end: int) -> list[TransferRequest]:
        dest = self.plan.decode
        if dest is None:
            return []
        hi = min(end, dest.num_tokens)
        lo = min(start, hi)
        if self._layer_tokens.get(layer, 0) != lo:
            raise TransferError(
                f"layer {layer}: tokens [{lo}, {hi}) streamed after "
                f"{self._layer_tokens.get(layer, 0)}: chunks must come in order"
            )
        self._layer_tokens[layer] = hi
        bt, hb = self.cache.block_tokens, self._head_bytes()
        dst = HeadShards(self.layout.num_kv_heads, dest.ranks)
        src_row, dst_row = self.src_shards.local * hb, dst.local * hb
        first, last = lo // bt, -(-hi // bt)
        src_bases = [b * bt * src_row for b in self.src_blocks[:last]]
        dst_bases = [b * bt * dst_row for b in dest.block_ids[:last]]
        reqs: list[TransferRequest] = []
        for run in head_runs(self.src_shards, dst):
            for half in ("k", "v"):
                src = segment_name(self._src_prefix(run.src_rank), layer, half)
                name = segment_name(rank_prefix(dest.prefix, run.dst_rank, dest.ranks), layer, half)
                runs = copy_runs(
                    bt,
                    src_bases,
                    dst_bases,
                    range(first, last),
                    (lo, hi),
                    (src_row, dst_row),
                    (run.src_head * hb, run.dst_head * hb),
                    run.count * hb,
                )
                reqs += [
                    TransferRequest(TransferOp.WRITE, src, s, f"{name}@{dest.endpoint}", d, n)
                    for s, d, n in runs
                ]
        return reqs

    def _pool_writes(self, layer: int, start: int, end: int) -> list[TransferRequest]:
        bt, lay, hb = self.cache.block_tokens, self.layout, self._head_bytes()
        whole = HeadShards(lay.num_kv_heads)
        runs = head_runs(self.src_shards, whole)
        src_row, dst_row = self.src_shards.local * hb, lay.num_kv_heads * hb
        reqs: list[TransferRequest] = []
        for b in range(start // bt, end // bt):
            i = self._targets.get(b)
            if i is None or (b + 1) * bt <= start:
                continue
            blk = self.src_blocks[b]
            # NOTE: gathered on the host for the digest, never on rank 0's GPU
            k, v = gather_blocks(self.caches, layer, [blk], lay.num_kv_heads, "cpu")
            self._digests.setdefault(layer, [0] * len(self.plan.pool))[i] = layer_digest(
                _host_bytes(k[0]), _host_bytes(v[0])
            )
            for d in self.plan.pool[i].replicas:
                name = remote_name(d.segment, d.endpoint)
                for half, off in (("k", lay.k_offset(layer)), ("v", lay.v_offset(layer))):
                    for run in runs:
                        src = segment_name(self._src_prefix(run.src_rank), layer, half)
                        pieces = copy_runs(
                            bt,
                            [blk * bt * src_row],
                            [d.offset + off],
                            range(1),
                            (0, bt),
                            (src_row, dst_row),
                            (run.src_head * hb, run.dst_head * hb),
                            run.count * hb,
                        )
                        reqs += [
                            TransferRequest(TransferOp.WRITE, src, s, name, dst, n, d.token)
                            for s, dst, n in pieces
                        ]
        return reqs

    def _src_prefix(self, rank: int) -> str:
        return rank_prefix(self.src_prefix, rank, len(self.caches))

    def _head_bytes(self) -> int:
        """Bytes of one token's K (or V) of one head."""
        t = self.cache.k[0]
        return t.shape[-1] * t.element_size()


def copy_runs(
    block_tokens: int,
    src_bases: Sequence[int],
    dst_bases: Sequence[int],
    blocks: range,
    tokens: tuple[int, int],
    rows: tuple[int, int],
    offsets: tuple[int, int],
    size: int,
) -> list[list[int]]:
    """[source offset, destination offset, bytes] of the copies that move `size` bytes at
    `offsets` (source, destination) within each token's row of `rows` bytes, for tokens
    [lo, hi) = `tokens` of `blocks` (block i of the prompt starts at `src_bases[i]` and at
    `dst_bases[i]`; token t of it `t % block_tokens` rows further), coalesced. A copy of
    whole rows on both sides spans the tokens of a block; else each token is its own."""
    lo, hi = tokens
    (src_row, dst_row), (src_off, dst_off) = rows, offsets
    whole = size == src_row == dst_row
    runs: list[list[int]] = []
    for i in blocks:
        a, b = max(lo, i * block_tokens), min(hi, (i + 1) * block_tokens)
        if a >= b:
            continue
        s0 = src_bases[i] + (a - i * block_tokens) * src_row + src_off
        d0 = dst_bases[i] + (a - i * block_tokens) * dst_row + dst_off
        pieces = (
            [(s0, d0, (b - a) * size)]
            if whole
            else [(s0 + t * src_row, d0 + t * dst_row, size) for t in range(b - a)]
        )
        for s, d, n in pieces:
            if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
                runs[-1][2] += n
            else:
                runs.append([s, d, n])
    return runs


def merge_reports(
    reports: list[StreamReport], num_layers: int
) -> tuple[list[int], dict[int, list[int]], int]:
    """Every stage's report as one: tokens per layer (0 for a layer nobody wrote), the
    digests by layer, the bytes written."""
    tokens: dict[int, int] = {}
    digests: dict[int, list[int]] = {}
    for r in reports:
        tokens.update(r.layer_tokens)
        digests.update(r.digests)
    if len(tokens) > num_layers:
        raise TransferError(f"stream reports name {len(tokens)} layers of {num_layers}")
    return [tokens.get(i, 0) for i in range(num_layers)], digests, sum(r.num_bytes for r in reports)


def _host_bytes(t: Tensor) -> memoryview:
    """The bytes of a contiguous tensor (a copy to the host first for device memory)."""
    if t.device.type != "cpu":
        t = t.to("cpu")
    arr: Any = t.contiguous().view(torch.uint8).numpy()
    return memoryview(arr).cast("B")


__all__ = [
    "KVDest",
    "KVStreamer",
    "PoolTarget",
    "StreamPlan",
    "StreamReport",
    "StreamWriter",
    "merge_reports",
]
