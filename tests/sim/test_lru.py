"""The simulator's LRU building blocks: a tier's exact eviction order, Table 1's hit rate."""

import pytest

from mooncake.sim.lru import LruTier, global_lru_hit_rate
from mooncake.sim.trace import TraceRecord


def test_lru_evicts_the_least_recently_used_first():
    tier = LruTier("dram", 3)
    assert [tier.put(h) for h in (1, 2, 3)] == [[], [], []]
    tier.put(1)  # refresh: 2 is now the oldest
    assert tier.put(4) == [2]
    assert tier.put(5) == [3]
    assert tier.put(6) == [1]
    assert list(tier.blocks) == [4, 5, 6]


def _rec(ids):
    return TraceRecord(0, 512 * len(ids), 1, ids)


def test_global_lru_hit_rate_by_hand():
    trace = [_rec([1, 2, 3]), _rec([1, 2, 4]), _rec([5]), _rec([1, 2, 3])]
    # unbounded: hits 0 + 2 + 0 + 3 over 10 blocks
    assert global_lru_hit_rate(trace, None) == pytest.approx(0.5)
    # 4 blocks: after request 3 the pool is [3, 1, 2, 4, 5] -> 3 evicted: 0 + 2 + 0 + 2
    assert global_lru_hit_rate(trace, 4) == pytest.approx(0.4)
    assert global_lru_hit_rate(trace, 0) == 0.0
