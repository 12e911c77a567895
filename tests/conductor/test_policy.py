"""Algorithm 1 and the other policies choose exactly the instance a hand computation gives.

Toy costs (tests/conductor/toy.py): prefill 1 ms per new token, 0.1 s per fetched block.
"""

import pytest

from mooncake.conductor import ScheduleRequest
from mooncake.conductor.policy import POLICY_REGISTRY, create_policy, prefix_ratio
from mooncake.errors import ConfigError
from tests.conductor.toy import toy_conductor


def _req(num_blocks: int, req_id: int = 1) -> ScheduleRequest:
    return ScheduleRequest(req_id, num_blocks * 100, list(range(1, num_blocks + 1)))


def _busy(c, idx: int, seconds: float) -> None:
    c.prefill[idx].add(f"busy{idx}", seconds)


def test_fetch_from_best_instance_when_its_queue_is_long():
    # p0 none, p1 blocks 1-4 (busy 10 s), p2 block 1. TTFT: p0 0.4+0.2, p1 10+0.2, p2 0.3+0.2
    c = toy_conductor(3)
    c.index.add("p1", [1, 2, 3, 4])
    c.index.add("p2", [1])
    _busy(c, 1, 10.0)
    d = c.schedule(_req(6), now=0.0)
    assert (d.prefill, d.local_blocks, d.best_blocks, d.reused_blocks) == ("p2", 1, 4, 4)
    assert d.fetch_from == "p1" and d.fetch_blocks == 3
    assert d.ttft_s == pytest.approx(0.5)
    assert [(r.block_hashes, r.src, r.dst) for r in d.replications] == [((2, 3, 4), "p1", "p2")]


def test_recompute_on_best_instance_when_it_is_idle():
    c = toy_conductor(3)
    c.index.add("p1", [1, 2, 3, 4])
    d = c.schedule(_req(6), now=0.0)
    assert (d.prefill, d.reused_blocks, d.fetch_from, d.replications) == ("p1", 4, "", ())
    assert d.ttft_s == pytest.approx(0.2)


def test_ratio_equal_to_threshold_fetches_but_does_not_replicate():
    # p0 holds 2, best 3 on busy p1: 3/2 = 1.5 is not < 1.5, so p0 fetches 1 block (0.1 s)
    c = toy_conductor(3, balancing_threshold=1.5)
    c.index.add("p0", [1, 2])
    c.index.add("p1", [1, 2, 3])
    _busy(c, 1, 10.0)
    d = c.schedule(_req(4), now=0.0)
    assert (d.prefill, d.fetch_from, d.reused_blocks, d.replications) == ("p0", "p1", 3, ())
    assert d.ttft_s == pytest.approx(0.1 + 0.1)


def test_ratio_below_threshold_recomputes_locally():
    c = toy_conductor(3, balancing_threshold=1.6)
    c.index.add("p0", [1, 2])
    c.index.add("p1", [1, 2, 3])
    _busy(c, 1, 10.0)
    d = c.schedule(_req(4), now=0.0)
    assert (d.prefill, d.fetch_from, d.reused_blocks) == ("p0", "", 2)
    assert d.ttft_s == pytest.approx(0.2)


def test_zero_local_prefix_counts_as_remote_better_and_replicates():
    c = toy_conductor(2)
    c.index.add("p1", [1, 2])
    _busy(c, 1, 10.0)
    d = c.schedule(_req(3), now=0.0)
    assert (d.prefill, d.fetch_from, d.local_blocks, d.reused_blocks) == ("p0", "p1", 0, 2)
    assert d.replications[0].block_hashes == (1, 2)
    assert prefix_ratio(2, 0) == float("inf") and prefix_ratio(0, 0) == 1.0


def test_nothing_cached_anywhere_recomputes_on_the_shortest_queue():
    c = toy_conductor(3)
    _busy(c, 0, 1.0)
    d = c.schedule(_req(3), now=0.0)
    assert (d.prefill, d.reused_blocks, d.fetch_from) == ("p1", 0, "")


def test_congested_path_makes_recompute_win():
    c = toy_conductor(2)
    c.index.add("p1", [1, 2, 3, 4])
    _busy(c, 1, 1.0)
    assert c.schedule(_req(6, 1), now=0.0).prefill == "p0"  # fetch 0.4 + 0.2 < 1 + 0.2
    c2 = toy_conductor(2)
    c2.index.add("p1", [1, 2, 3, 4])
    _busy(c2, 1, 1.0)
    c2.network.reserve("p1", "d0", 5000, now=0.0)  # 5 s of bytes queued on p1's egress
    d = c2.schedule(_req(6, 1), now=0.0)
    assert (d.prefill, d.fetch_from) == ("p1", "")


def test_load_balance_takes_the_shortest_queue_and_its_local_prefix():
    c = toy_conductor(3, policy="load_balance")
    c.index.add("p0", [1, 2, 3])
    c.index.add("p1", [1])
    for i, q in enumerate((2.0, 1.0, 3.0)):
        _busy(c, i, q)
    d = c.schedule(_req(4), now=0.0)
    assert (d.prefill, d.reused_blocks, d.fetch_from) == ("p1", 1, "")


def test_cache_aware_takes_the_longest_local_prefix_ties_by_queue():
    c = toy_conductor(3, policy="cache_aware")
    c.index.add("p0", [1, 2])
    c.index.add("p1", [1])
    c.index.add("p2", [1, 2])
    _busy(c, 0, 5.0)
    _busy(c, 2, 1.0)
    d = c.schedule(_req(4), now=0.0)
    assert (d.prefill, d.reused_blocks, d.fetch_from) == ("p2", 2, "")


def test_random_policy_is_reproducible_for_a_seed():
    picks = []
    for _ in range(2):
        c = toy_conductor(4, policy="random", seed=7, ttft_slo_s=1e9)
        picks.append([c.schedule(_req(2, i), now=0.0).prefill for i in range(20)])
    assert picks[0] == picks[1] and len(set(picks[0])) > 1


def test_registry_names_and_unknown_policy():
    assert set(POLICY_REGISTRY) == {
        "random",
        "round_robin",
        "load_balance",
        "cache_aware",
        "kvcache_centric",
    }
    with pytest.raises(ConfigError, match="unknown scheduling policy"):
        create_policy("fastest", 1.5)
