"""What a trace holds: its size and pace, its lengths, and how much of it a cache can reuse.

- *reused blocks*: block occurrences whose id appeared earlier in the trace, over all;
- *shared prefixes*: a block id stands for the prefix ending at it (the ids are
  prefix-chained), so the requests holding it share that prefix; a shared prefix is one
  held by two requests or more and extended by no longer prefix of the same requests
  (a branch point of the prefix tree); the number of them and the most shared ones
  (requests, length in blocks);
- *reuse distance* of a reused block: the number of distinct blocks used since its
  previous use (the LRU stack distance: an LRU of more blocks than that still holds it);
- *unbounded hit rate*: the paper's Table 1 measure with an infinite LRU (the longest
  prefix of each request already seen, over all blocks requested), and the same with one
  global LRU of a few capacities (`global_lru_hit_rate`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import msgspec
import numpy as np

from mooncake.sim.lru import global_lru_hit_rate
from mooncake.sim.trace import TraceRecord, trace_span_s

PCTS = (50, 90, 99)


class Percentiles(msgspec.Struct):
    mean: float
    p50: float
    p90: float
    p99: float
    max: float


class PrefixGroup(msgspec.Struct):
    last_block: int  # the block id the prefix ends with
    blocks: int  # its length
    requests: int  # requests that hold it
    share: float  # of all requests


class LruPoint(msgspec.Struct):
    pool_blocks: int | None  # None: unbounded
    hit_rate: float


class TraceStats(msgspec.Struct, kw_only=True):
    requests: int
    duration_s: float
    arrival_rate_rps: float
    input_length: Percentiles
    output_length: Percentiles
    blocks: int  # block occurrences over all requests
    distinct_blocks: int
    reused_block_share: float  # occurrences of a block seen before / blocks
    shared_prefixes: int  # branch points of the prefix tree held by >= 2 requests
    top_prefixes: list[PrefixGroup]
    reuse_distance: Percentiles  # distinct blocks between two uses of a block
    unbounded_hit_rate: float
    lru: list[LruPoint]


def _percentiles(values: Sequence[float] | np.ndarray) -> Percentiles:
    a = np.asarray(values, dtype=float)
    if not len(a):
        return Percentiles(0.0, 0.0, 0.0, 0.0, 0.0)
    p50, p90, p99 = (float(x) for x in np.percentile(a, PCTS))
    return Percentiles(float(a.mean()), p50, p90, p99, float(a.max()))


def reuse_distances(records: Sequence[TraceRecord]) -> np.ndarray:
    """For each reuse of a block, the distinct blocks used since its previous use.

    NOTE: a Fenwick tree over access positions marks each block's latest use; the
    distinct blocks between two uses of b are the marks strictly between them.
    """
    n = sum(len(r.hash_ids) for r in records)
    tree = [0] * (n + 1)
    last: dict[int, int] = {}
    out: list[int] = []
    marks = 0  # marks set so far (one per distinct block)
    pos = 0
    for rec in records:
        for h in rec.hash_ids:
            pos += 1
            prev = last.get(h)
            if prev is not None:
                i, before = prev, 0  # marks at positions <= prev
                while i:
                    before += tree[i]
                    i &= i - 1
                out.append(marks - before)  # marks after prev, all before pos
                i = prev
                while i <= n:
                    tree[i] -= 1
                    i += i & -i
                marks -= 1
            i = pos
            while i <= n:
                tree[i] += 1
                i += i & -i
            marks += 1
            last[h] = pos
    return np.asarray(out, dtype=float)


def shared_prefixes(records: Sequence[TraceRecord]) -> list[PrefixGroup]:
    """Every shared prefix (module docstring), most requests first, then longest."""
    count: Counter[int] = Counter()
    parent: dict[int, int] = {}
    depth: dict[int, int] = {}
    for rec in records:
        ids = rec.hash_ids
        count.update(set(ids))
        for k, h in enumerate(ids):
            if h not in depth:
                depth[h] = k + 1
                if k:
                    parent[h] = ids[k - 1]
    extended = {p for h, p in parent.items() if count[h] == count[p]}
    n = len(records) or 1
    groups = [
        PrefixGroup(h, depth[h], c, c / n) for h, c in count.items() if c > 1 and h not in extended
    ]
    groups.sort(key=lambda g: (-g.requests, -g.blocks, g.last_block))
    return groups


def trace_stats(
    records: Sequence[TraceRecord], sizes: Sequence[int | None], top: int = 5
) -> TraceStats:
    """Everything `mooncake trace stats` prints, for `records` in trace order."""
    recs = list(records)
    span = trace_span_s(recs)
    blocks = sum(len(r.hash_ids) for r in recs)
    distinct = len({h for r in recs for h in r.hash_ids})
    shared = shared_prefixes(recs)
    return TraceStats(
        requests=len(recs),
        duration_s=span,
        arrival_rate_rps=len(recs) / span,
        input_length=_percentiles([r.input_length for r in recs]),
        output_length=_percentiles([r.output_length for r in recs]),
        blocks=blocks,
        distinct_blocks=distinct,
        reused_block_share=(blocks - distinct) / blocks if blocks else 0.0,
        shared_prefixes=len(shared),
        top_prefixes=shared[:top],
        reuse_distance=_percentiles(reuse_distances(recs)),
        unbounded_hit_rate=global_lru_hit_rate(recs, None),
        lru=[LruPoint(c, global_lru_hit_rate(recs, c)) for c in sizes if c is not None],
    )
