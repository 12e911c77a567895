"""The Conductor's loop keeps its load books straight through a request's whole life."""

import pytest

from mooncake.conductor import Conductor, ConductorParams, CostModel, ScheduleRequest
from mooncake.errors import SchedulingError
from tests.conductor.toy import BLOCK, toy_conductor, toy_cost_file


def test_a_request_is_booked_as_load_then_retired():
    c = toy_conductor(2, 2)
    d = c.schedule(ScheduleRequest(1, 500, [1, 2, 3, 4, 5]), now=0.0)
    assert d.is_accepted and d.prefill == "p0" and d.decode == "d0"
    assert c.prefill[0].queue_time(0.0) == pytest.approx(0.5)
    assert c.decode[0].reserved == {1: 500}
    c.check_integrity()
    # the next request sees p0 busy and goes to p1, and to the other decode instance
    d2 = c.schedule(ScheduleRequest(2, 500, [9]), now=0.0)
    assert (d2.prefill, d2.decode) == ("p1", "d1")
    c.on_prefill_started(1, 0.0)
    assert c.prefill[0].queue_time(0.3) == pytest.approx(0.2)
    c.on_prefill_finished(1, 0.5)
    c.on_decode_started(1, 0.5)
    assert c.decode[0].active == {1: 500} and c.decode[0].reserved == {}
    c.check_integrity()
    c.on_decode_finished(1, 3.5)
    c.on_request_dropped(2, 1.0)
    assert c.num_inflight == 0 and c.prefill[0].queue_time(4.0) == 0.0
    assert c.decode[0].active_tokens == 0 and c.decode[1].reserved_tokens == 0
    c.check_integrity()


def test_decode_placement_skips_instances_without_kv_room():
    c = toy_conductor(1, 2)
    c.decode[0].reserve("big", 9_900)
    d = c.schedule(ScheduleRequest(1, 500, [1]), now=0.0)
    assert d.decode == "d1"


def test_removed_instance_is_not_scheduled_and_its_blocks_are_forgotten():
    c = toy_conductor(2, 1)
    c.index.add("p1", [1, 2, 3])
    c.remove_instance("p1")
    d = c.schedule(ScheduleRequest(1, 300, [1, 2, 3]), now=0.0)
    assert (d.prefill, d.best_blocks) == ("p0", 0)
    c.check_integrity()


def test_no_instances_means_rejection_and_duplicates_are_errors():
    c = toy_conductor(0, 0)
    assert c.schedule(ScheduleRequest(1, 100, [1]), 0.0).reason == "no_instance"
    c.add_prefill_instance("p0")
    with pytest.raises(SchedulingError, match="already registered"):
        c.add_prefill_instance("p0")


def test_coupled_instances_decode_where_they_prefill_and_never_fetch():
    c = toy_conductor(0, 0)
    for name in ("c0", "c1"):
        c.add_coupled_instance(name, 10_000)
    c.index.add("c1", [1, 2, 3])
    c.prefill[1].add("busy", 10.0)
    d = c.schedule(ScheduleRequest(1, 400, [1, 2, 3, 4]), now=0.0)
    assert (d.prefill, d.decode, d.fetch_from, d.reused_blocks) == ("c0", "c0", "", 0)


def test_coupled_instances_fetch_from_the_pool_but_not_from_each_other():
    """vLLM instances behind the router: each reads its own cache and the pool (through a
    KV connector), never another instance's GPU cache."""
    c = toy_conductor(0, 0)
    for name in ("c0", "c1"):
        c.add_coupled_instance(name, 10_000)
    c.add_pool_node("s0")
    c.index.add("c1", [1, 2, 3])
    c.index.add("s0", [1, 2])
    c.prefill[1].add("busy", 10.0)
    d = c.schedule(ScheduleRequest(1, 400, [1, 2, 3, 4]), now=0.0)
    assert (d.prefill, d.fetch_from, d.reused_blocks, d.best_blocks) == ("c0", "s0", 2, 3)


def test_from_config_uses_the_scheduler_section():
    from mooncake.config.settings import SchedulerConfig

    cfg = SchedulerConfig(
        policy="cache_aware", rejection="basic", ttft_slo_s=12.0, forecast_sigmas=1.5
    )
    c = Conductor.from_config(cfg, model="llama3-70b", gpu="H100")
    p = c.params
    assert (p.policy, p.rejection, p.ttft_slo_s, p.forecast_sigmas) == (
        "cache_aware",
        "basic",
        12.0,
        1.5,
    )
    assert c.policy.name == "cache_aware" and c.cost.spec.model == "llama3-70b"


def test_blocks_on_a_pool_only_node_are_fetched_from_it():
    c = toy_conductor(2, 1)
    c.add_pool_node("store0")
    c.index.add("store0", [1, 2, 3])
    d = c.schedule(ScheduleRequest(1, 400, [1, 2, 3, 4]), now=0.0)
    assert (d.prefill, d.fetch_from, d.best_blocks, d.reused_blocks) == ("p0", "store0", 3, 3)
    assert d.replications[0].src == "store0"
    c.remove_instance("store0")
    assert c.schedule(ScheduleRequest(2, 400, [1, 2, 3, 4]), now=0.0).best_blocks == 0


def test_a_prefix_split_across_nodes_counts_whole_and_is_replicated_to_the_prefill():
    """The pool is global: blocks 0-1 on the prefill node and 2-4 on a decode node (the
    answer's blocks it stored) make a 5-block prefix, fetched (priced from the node
    holding the first missing block) and replicated to the prefill node."""
    c = toy_conductor(2, 1)
    c.index.add("p1", [1, 2])
    c.index.add("d0", [3, 4, 5])  # not a prefix of its own: block 1 is not on d0
    d = c.schedule(ScheduleRequest(1, 600, [1, 2, 3, 4, 5, 6]), now=0.0)
    assert (d.prefill, d.local_blocks, d.best_blocks, d.reused_blocks) == ("p1", 2, 5, 5)
    assert d.fetch_from == "d0"
    (order,) = d.replications
    assert (order.block_hashes, order.src, order.dst) == ((3, 4, 5), "d0", "p1")
    assert c.index.pool_prefix_len([1, 2, 3, 9, 5], c._match.full) == 3


def test_a_prefix_held_on_ssd_only_is_priced_at_the_ssds_read_cost():
    """SSD at 250 bytes/s (0.4 s per 100-byte block), links at 0.1 s per block. A prefix p0
    holds on SSD only costs its read; so p1, holding 3 of the 4 blocks in DRAM, is
    quicker (0.2 s: it recomputes one more block) than p0 (0.1 s + 0.4 s to read block
    4, the only one no node holds in memory); with the prefix in p0's DRAM p0 wins."""
    c = Conductor(
        ConductorParams(block_tokens=BLOCK), CostModel(toy_cost_file(ssd_read_bytes_per_s=250.0))
    )
    for name in ("p0", "p1"):
        c.add_prefill_instance(name)
    c.add_decode_instance("d0", 10_000)
    c.index.add("p0", [1, 2, 3, 4], "ssd")
    c.index.add("p1", [1, 2, 3], "dram")
    d = c.schedule(ScheduleRequest(1, 500, [1, 2, 3, 4, 5]), now=0.0)
    assert (d.prefill, d.reused_blocks) == ("p1", 3)
    assert d.ttft_s == pytest.approx(0.2)
    c.on_request_dropped(1, 0.0)
    c.index.add("p0", [4], "dram")  # promoted
    d = c.schedule(ScheduleRequest(2, 500, [1, 2, 3, 4, 5]), now=0.0)
    assert (d.prefill, d.reused_blocks) == ("p0", 4)
    assert d.ttft_s == pytest.approx(0.1)
    c.on_request_dropped(2, 0.0)
    c.index.add("p0", [1, 2, 3, 4], "ssd")
    c.remove_instance("p1")
    d = c.schedule(ScheduleRequest(3, 500, [1, 2, 3, 4, 5]), now=0.0)
    assert (d.prefill, d.reused_blocks) == ("p0", 4)
    assert d.ttft_s == pytest.approx(0.1 + 4 * 0.4)  # every block read off the SSD
    c.check_integrity()
