"""The simulated pool: exact LRU eviction order, demotion to SSD, and index events."""

import pytest

from mooncake.conductor import PrefixIndex
from mooncake.sim.pool import LruTier, NodePool, global_lru_hit_rate
from mooncake.sim.trace import TraceRecord


def test_lru_evicts_the_least_recently_used_first():
    tier = LruTier("dram", 3)
    assert [tier.put(h) for h in (1, 2, 3)] == [[], [], []]
    tier.put(1)  # refresh: 2 is now the oldest
    assert tier.put(4) == [2]
    assert tier.put(5) == [3]
    assert tier.put(6) == [1]
    assert list(tier.blocks) == [4, 5, 6]


def test_dram_evictions_demote_to_ssd_and_report_to_the_index():
    idx = PrefixIndex()
    pool = NodePool("n", dram_blocks=2, ssd_blocks=2, index=idx)
    pool.store([1, 2, 3], 0.0)  # 1 is demoted
    assert pool.ssd is not None
    assert list(pool.top.blocks) == [2, 3] and list(pool.ssd.blocks) == [1]
    assert idx.holders(1) == {"n": "ssd"} and idx.holders(3) == {"n": "dram"}
    pool.store([4, 5], 0.0)  # 2, 3 demoted; SSD overflows and drops 1
    assert list(pool.ssd.blocks) == [2, 3] and idx.holders(1) == {}
    assert pool.num_evicted == 1
    assert pool.prefix_len([4, 5]) == 2 and pool.prefix_len([1, 2]) == 0
    pool.store([2], 0.0)  # read back from SSD: promoted (leaving room there), 4 demoted
    assert list(pool.top.blocks) == [5, 2] and list(pool.ssd.blocks) == [3, 4]
    assert idx.holders(2) == {"n": "dram"} and idx.holders(4) == {"n": "ssd"}
    pool.check_integrity()
    idx.check_integrity()


def test_a_request_longer_than_the_tier_keeps_its_tail():
    idx = PrefixIndex()
    pool = NodePool("n", dram_blocks=2, index=idx)
    pool.store([1, 2, 3, 4], 0.0)
    assert list(pool.top.blocks) == [3, 4] and len(idx) == 2
    idx.check_integrity()


def _rec(ids):
    return TraceRecord(0, 512 * len(ids), 1, ids)


def test_global_lru_hit_rate_by_hand():
    trace = [_rec([1, 2, 3]), _rec([1, 2, 4]), _rec([5]), _rec([1, 2, 3])]
    # unbounded: hits 0 + 2 + 0 + 3 over 10 blocks
    assert global_lru_hit_rate(trace, None) == pytest.approx(0.5)
    # 4 blocks: after request 3 the pool is [3, 1, 2, 4, 5] -> 3 evicted: 0 + 2 + 0 + 2
    assert global_lru_hit_rate(trace, 4) == pytest.approx(0.4)
    assert global_lru_hit_rate(trace, 0) == 0.0
