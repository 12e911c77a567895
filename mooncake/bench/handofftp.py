"""`mooncake bench engine --parts handoff-tp`: one prompt's KV moved from a prefill instance
at one tensor-parallel degree into a decode instance's blocks at another, against the same
bytes between two instances of one rank, in the same run.

The ranks' caches are paged caches in this process, each registered with the sending or
the receiving Transfer Engine under its rank's prefix (kv/handoff.py), holding its heads of
one random whole cache (kv/heads.py); the KV is computed already, so what is timed is the
stream alone: `KVStreamer` told every layer is done, until `finish` (every write landed).
Once per pair of degrees the receiver's blocks are checked against the source, head by
head. Between equal degrees each copy spans whole blocks; between different ones each
token's run of heads is its own copy, which is what the ratio shows.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from mooncake.bench.engine import SECRET, Timing, interleave
from mooncake.kv.handoff import place_cache_in_segments, rank_prefix
from mooncake.kv.heads import HeadShards, gather_blocks, rank_heads
from mooncake.kv.object import KVLayout
from mooncake.kv.stream import KVDest, KVStreamer, StreamPlan, StreamWriter
from mooncake.model.info import ModelInfo
from mooncake.model.kvcache import PagedKVCache
from mooncake.model.weights import TORCH_DTYPES
from mooncake.transfer import TransferEngine
from mooncake.transfer.types import EngineOptions

DEFAULT_PAIRS = ((1, 1), (2, 2), (2, 1), (1, 2))  # (prefill degree, decode degree)


class _Ranks:
    """Every rank's cache of an instance at `degree`, registered under `prefix`."""

    def __init__(
        self,
        engine: TransferEngine,
        prefix: str,
        whole: list[torch.Tensor],
        shards: HeadShards,
        block_tokens: int,
    ):
        self.prefix = prefix
        layers = range(len(whole) // 2)
        self.caches = []
        for r in range(shards.ranks):
            k = [rank_heads(whole[2 * i], shards, r).contiguous() for i in layers]
            v = [rank_heads(whole[2 * i + 1], shards, r).contiguous() for i in layers]
            cache = PagedKVCache.over(k, v, block_tokens, layers)
            place_cache_in_segments(engine, cache, rank_prefix(prefix, r, shards.ranks))
            self.caches.append(cache)


def run(
    info: ModelInfo,
    dtype: str,
    block_tokens: int,
    length: int,
    protocol: str,
    repeat: int,
    pairs: tuple[tuple[int, int], ...] = DEFAULT_PAIRS,
) -> dict[str, Any]:
    """Timings of each (prefill, decode) degree pair of `pairs` and their figures."""
    spec = info.spec
    heads = spec.num_kv_heads
    pairs = tuple(p for p in pairs if all(n % heads == 0 or heads % n == 0 for n in p))
    opts = EngineOptions(protocol=protocol)  # type: ignore[arg-type]
    src_engine = TransferEngine("bench-tp-prefill", SECRET, opts)
    dst_engine = TransferEngine("bench-tp-decode", SECRET, opts)
    writer = StreamWriter()
    num_blocks = -(-length // block_tokens)
    shape = (num_blocks, block_tokens, heads, spec.head_dim)
    gen = torch.Generator().manual_seed(3)
    torch_dtype = TORCH_DTYPES[dtype]
    whole = [torch.randn(shape, generator=gen).to(torch_dtype) for _ in range(2 * spec.num_layers)]
    empty = [torch.zeros(shape, dtype=torch_dtype) for _ in whole]
    layout = KVLayout(spec.num_layers, block_tokens, heads, spec.head_dim, dtype)
    ep = dst_engine.endpoints[0]
    src_blocks = list(range(num_blocks))
    dst_blocks = list(reversed(range(num_blocks)))  # NOTE: not the identity, as in serving
    try:
        senders = {
            n: _Ranks(src_engine, f"p{n}.", whole, HeadShards(heads, n), block_tokens)
            for n in {s for s, _ in pairs}
        }
        receivers = {
            n: _Ranks(dst_engine, f"d{n}.", empty, HeadShards(heads, n), block_tokens)
            for n in {d for _, d in pairs}
        }

        def stream(src: int, dst: int) -> None:
            dest = KVDest(
                endpoint=f"{ep.host}:{ep.port}",
                prefix=f"d{dst}.",
                block_ids=dst_blocks,
                num_tokens=length,
                ranks=dst,
            )
            s = senders[src]
            streamer = KVStreamer(
                src_engine,
                s.caches,
                s.prefix,
                src_blocks,
                StreamPlan(decode=dest),
                layout,
                writer,
                60.0,
            )
            for layer in range(spec.num_layers):
                streamer.layer_done(layer, 0, length)
            report = streamer.finish()
            assert set(report.layer_tokens.values()) == {length}, report.layer_tokens

        variants: dict[str, Callable[[], object]] = {
            f"TP {s} -> TP {d}": partial(stream, s, d) for s, d in pairs
        }
        timings = interleave(variants, repeat)
        for s, d in pairs:  # every head of every token landed where it belongs
            for layer in range(spec.num_layers):
                for half in (0, 1):
                    got = gather_blocks(receivers[d].caches, layer, dst_blocks, heads)[half]
                    want = whole[2 * layer + half][src_blocks]
                    tokens = (-1, heads, spec.head_dim)
                    assert torch.equal(
                        got.reshape(tokens)[:length], want.reshape(tokens)[:length]
                    ), (s, d, layer, half)
    finally:
        writer.close()
        src_engine.close()
        dst_engine.close()
    num_bytes = length * spec.kv_bytes_per_token(whole[0].element_size())
    return {"timings": timings, "bytes": num_bytes, "pairs": pairs}


def figures(result: dict[str, Any]) -> dict[str, Any]:
    """GB/s of each pair and its time against TP 1 -> TP 1's (best runs)."""
    timings: dict[str, Timing] = result["timings"]
    base = timings.get("TP 1 -> TP 1")
    out: dict[str, Any] = {"bytes": result["bytes"]}
    for name, t in timings.items():
        out[name] = {
            "best_s": t.best,
            "median_s": t.median,
            "GBps": result["bytes"] / t.best / 1e9,
            "vs_one_rank": t.best / base.best if base is not None else None,
        }
    return out
