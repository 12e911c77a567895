"""Miss attribution on the master: why each prefill did not reuse blocks it could have,
with the causes and the bounded ledger of `conductor/misses.py` (the simulator's code).

    placed    the request's prompt blocks and the placement's view (pool prefix seen,
              blocks planned for reuse), at each placement (event loop)
    started   the pool as it is for those blocks, as the prefill starts (`PoolView`)
    finished  the prefill's report (blocks reused, a failed token check): each block's
              cause, counted in the totals and handed back for the API's usage
    event     every store event, after the prefix index applied it: blocks written
              refresh their last use, blocks whose last copy went are evicted (with age)

A request could reuse the full blocks of its prompt but the last token (which the decode
node computes): `(prompt_len - 2) // block_tokens` blocks. Counted per cause in /metrics
(`mooncake_kv_blocks_total{cause}`, the elsewhere parts in
`mooncake_kv_blocks_elsewhere_total{part}`, ages in `mooncake_kv_evicted_age_seconds`) and
in `mooncake status` (`kv_blocks`: the shares).

NOTE: `placed` and `forget` are single dict operations (atomic under the GIL) from the
event loop; every other call runs under the master's lock, which guards the prefix index.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence

import msgspec
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from mooncake.api.status import KVBlockShares
from mooncake.conductor.index import PrefixIndex
from mooncake.conductor.misses import (
    CAUSES,
    DEFAULT_MEMORY_BLOCKS,
    ELSEWHERE_PARTS,
    MissCounts,
    MissLedger,
    PoolView,
    classify,
)
from mooncake.conductor.types import Decision

AGE_BUCKETS_S = (1.0, 10.0, 60.0, 300.0, 1800.0, 3600.0, 4 * 3600.0, 24 * 3600.0)


class _Pending(msgspec.Struct):
    hashes: list[int]  # the blocks it could reuse
    best_seen: int  # the pool's prefix when it was placed
    planned: int  # the blocks its placement meant to reuse
    view: PoolView | None = None  # the pool as its prefill started


class Attribution:
    """The master's miss attribution (module docstring)."""

    def __init__(self, index: PrefixIndex, block_tokens: int):
        self.block_tokens = block_tokens
        self.ledger = MissLedger(index, DEFAULT_MEMORY_BLOCKS)
        self._pending: dict[int, _Pending] = {}  # req_id -> its placement, until reported
        self.num_requests = 0
        self.totals = dict.fromkeys((*CAUSES, *ELSEWHERE_PARTS), 0)  # blocks by cause
        self.age_counts = [0] * (len(AGE_BUCKETS_S) + 1)  # evicted blocks by age bucket
        self.age_sum_s = 0.0

    def configure(self, memory_blocks: int) -> None:
        """Remember at most `memory_blocks` evictions (`scheduler.miss_memory_blocks`)."""
        self.ledger.memory_blocks = memory_blocks

    def placed(self, req_id: int, prompt_len: int, hashes: Sequence[int], d: Decision) -> None:
        num = max(0, min(len(hashes), (prompt_len - 2) // self.block_tokens))
        best = min(d.best_blocks, num)
        self._pending[req_id] = _Pending(list(hashes[:num]), best, min(d.reused_blocks, best))

    def forget(self, req_id: int) -> None:
        """The request ended or was placed again under a new id: no report will count."""
        self._pending.pop(req_id, None)

    def started(self, req_id: int) -> None:
        p = self._pending.get(req_id)
        if p is not None:
            p.view = self.ledger.snapshot(p.hashes)

    def finished(
        self, req_id: int, num_reused_tokens: int, is_unverified: bool, now: float
    ) -> MissCounts | None:
        """Each block's cause (None: a request we did not see start); counted."""
        p = self._pending.pop(req_id, None)
        if p is None or p.view is None:
            return None
        n = len(p.hashes)
        hit = min(num_reused_tokens // self.block_tokens, n)
        counts = classify(p.view, hit, p.best_seen, p.planned, is_unverified and hit < n)
        assert counts.total == n, (counts, n)
        self.ledger.read(p.hashes[:hit], now)  # NOTE: a read is a use
        self.num_requests += 1
        for name in self.totals:
            self.totals[name] += getattr(counts, name)
        for age in counts.evicted_age_s:
            self.age_counts[bisect.bisect_left(AGE_BUCKETS_S, age)] += 1
            self.age_sum_s += age
        return counts

    def event(self, kind: str, h: int | None, now: float) -> None:
        """One store event (index kinds: added, evicted, demoted, node_gone), applied to the
        index already; `h` the block's hash (None for node_gone)."""
        if kind == "node_gone":
            self.ledger.node_lost(now)
        elif h is None:
            return
        elif kind == "evicted":
            self.ledger.dropped((h,), now)
        elif kind == "added":
            self.ledger.used((h,), now)

    def shares(self) -> KVBlockShares:
        blocks = sum(self.totals[c] for c in CAUSES)
        return KVBlockShares(
            requests=self.num_requests,
            blocks=blocks,
            counts=dict(self.totals),
            shares={k: v / blocks if blocks else 0.0 for k, v in self.totals.items()},
        )


class AttributionCollector(Collector):
    """The totals as Prometheus counters and the ages as a histogram, read on each scrape
    (plain ints: a torn read is off by one request at most)."""

    def __init__(self, attribution: Attribution):
        self.attribution = attribution

    def collect(self) -> Iterator[Metric]:
        a = self.attribution
        causes = CounterMetricFamily(
            "mooncake_kv_blocks",
            "Prompt blocks prefills could have reused, by cause: hit (reused), cold (never "
            "stored), evicted, elsewhere (in the pool, not reused), unverified (token check "
            "failed).",
            labels=["cause"],
        )
        for cause in CAUSES:
            causes.add_metric([cause], a.totals[cause])
        yield causes
        parts = CounterMetricFamily(
            "mooncake_kv_blocks_elsewhere",
            "Blocks missed while in the pool, by part: priced_out (the placement chose to "
            "recompute them), plan_lost (meant to be reused, lost or not fetched by the "
            "start), after_placement (not in the placement's view of the pool).",
            labels=["part"],
        )
        for part in ELSEWHERE_PARTS:
            parts.add_metric([part], a.totals[part])
        yield parts
        cum, buckets = 0, []
        for le, count in zip((*AGE_BUCKETS_S, float("inf")), a.age_counts, strict=True):
            cum += count
            buckets.append(("+Inf" if le == float("inf") else repr(le), cum))
        yield HistogramMetricFamily(
            "mooncake_kv_evicted_age_seconds",
            "Age at eviction (last use to last copy dropped) of each evicted block a prefill "
            "missed.",
            buckets=buckets,
            sum_value=a.age_sum_s,
        )
