"""`sim/tracestats.py`: reuse distances, shared prefixes and hit rates, by hand and brute force."""

import random

import pytest

from mooncake.sim.lru import global_lru_hit_rate
from mooncake.sim.trace import TraceRecord, load_trace
from mooncake.sim.tracestats import reuse_distances, shared_prefixes, trace_stats
from tests.sim.toy import FIXTURE


def _rec(ids, t=0):
    return TraceRecord(t, 512 * len(ids), 1, ids)


def test_reuse_distance_by_hand():
    # 1 2 3 | 1 -> 2 distinct between; 2 -> 2 (3, 1); 1 -> 1 (2)
    trace = [_rec([1, 2, 3]), _rec([1]), _rec([2, 1])]
    assert reuse_distances(trace).tolist() == [2, 2, 1]


def test_reuse_distance_matches_brute_force():
    rng = random.Random(0)
    trace = [_rec([rng.randrange(30) for _ in range(rng.randrange(1, 6))]) for _ in range(200)]
    seq = [h for r in trace for h in r.hash_ids]
    want = []
    for i, h in enumerate(seq):
        prev = max((j for j in range(i) if seq[j] == h), default=None)
        if prev is not None:
            want.append(len(set(seq[prev + 1 : i])))
    assert reuse_distances(trace).tolist() == want


def test_shared_prefixes_are_the_branch_points():
    # a system prompt [0, 1] shared by three requests; two of them share [0, 1, 2, 3]
    trace = [_rec([0, 1, 2, 3, 4]), _rec([0, 1, 2, 3, 5]), _rec([0, 1, 6])]
    groups = shared_prefixes(trace)
    assert [(g.last_block, g.blocks, g.requests) for g in groups] == [(1, 2, 3), (3, 4, 2)]


def test_stats_of_the_fixture():
    recs = load_trace(FIXTURE)
    s = trace_stats(recs, [100, 1000])
    assert s.requests == 300 and s.blocks == sum(len(r.hash_ids) for r in recs)
    assert s.distinct_blocks == len({h for r in recs for h in r.hash_ids})
    assert s.reused_block_share == pytest.approx(1 - s.distinct_blocks / s.blocks)
    assert s.unbounded_hit_rate == global_lru_hit_rate(recs, None)
    assert [p.hit_rate for p in s.lru] == [global_lru_hit_rate(recs, c) for c in (100, 1000)]
    assert s.lru[0].hit_rate <= s.lru[1].hit_rate <= s.unbounded_hit_rate
    assert s.input_length.p50 <= s.input_length.p90 <= s.input_length.max
    assert s.arrival_rate_rps == pytest.approx(300 / s.duration_s)
