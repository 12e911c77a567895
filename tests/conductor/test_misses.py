"""Miss attribution (`conductor/misses.py`) in the simulator: causes by hand, a bounded
ledger, and every request's blocks add up."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mooncake.conductor import PrefixIndex
from mooncake.conductor.misses import MissLedger
from mooncake.sim.cluster import SimConfig
from mooncake.sim.pool import NodePool
from mooncake.sim.simulator import Simulator
from mooncake.sim.synth import LengthDist, SynthParams, synthesize
from tests.sim.toy import FIXTURE


def _pool():
    idx = PrefixIndex()
    ledger = MissLedger(idx)
    a = NodePool("a", dram_blocks=3, index=idx, ledger=ledger)
    b = NodePool("b", dram_blocks=3, index=idx, ledger=ledger)
    return ledger, a, b


def test_cold_evicted_and_elsewhere_by_hand():
    ledger, a, b = _pool()
    a.store([1, 2, 3], 1.0)
    b.store([7, 8], 2.0)
    a.store([4, 5, 6], 5.0)  # drops 1, 2, 3 (their last copies) at 5 s
    # request [7, 8, 1, 2, 9] reusing nothing: 7, 8 held on b -> elsewhere;
    # 1, 2 stored before, gone -> evicted (age 4 s each); 9 never stored -> cold
    c = ledger.attribute([7, 8, 1, 2, 9], hit=0, best_seen=2, planned=0)
    assert (c.hit, c.elsewhere, c.evicted, c.cold, c.unverified) == (0, 2, 2, 1, 0)
    assert c.priced_out == 2  # the placement saw both held blocks and recomputed them
    assert c.evicted_age_s == (4.0, 4.0) and c.total == 5
    ledger.check_integrity()
    c = ledger.attribute([7, 8, 1], hit=0, best_seen=0, planned=0)
    assert (c.elsewhere, c.after_placement, c.evicted) == (2, 2, 1)  # stored since placed


def test_a_block_past_the_break_takes_the_breaks_cause():
    ledger, a, b = _pool()
    a.store([1, 2, 3], 0.0)
    a.store([4, 5], 1.0)  # drops 1, 2; 3 stays
    c = ledger.attribute([1, 2, 3, 9], hit=0, best_seen=0, planned=0)
    assert (c.elsewhere, c.evicted, c.cold) == (0, 3, 1)  # 3 is held but unreachable
    assert c.evicted_age_s == (1.0, 1.0)  # only the blocks actually dropped
    c = ledger.attribute([20, 3], hit=0, best_seen=0, planned=0)
    assert (c.cold, c.evicted) == (2, 0)


def test_a_copy_left_elsewhere_is_not_an_eviction():
    ledger, a, b = _pool()
    a.store([1, 2], 0.0)
    b.store([1, 2], 3.0)
    a.store([5, 6, 7], 4.0)  # a drops 1, 2; b still holds them
    c = ledger.attribute([1, 2], hit=1, best_seen=2, planned=2)
    assert (c.hit, c.elsewhere, c.plan_lost, c.evicted) == (1, 1, 1, 0)
    b.store([8, 9, 10], 10.0)  # the last copies go: last used at 3 s
    c = ledger.attribute([1, 2], hit=0, best_seen=0, planned=0)
    assert c.evicted == 2 and c.evicted_age_s == (7.0, 7.0)
    ledger.check_integrity()


def test_the_ledger_forgets_the_oldest_evictions_past_its_cap():
    """Memory stays bounded: past `memory_blocks` evictions the oldest is forgotten and,
    requested again, counts as cold; a block stored again is no longer an eviction."""
    idx = PrefixIndex()
    ledger = MissLedger(idx, memory_blocks=2)
    a = NodePool("a", dram_blocks=2, index=idx, ledger=ledger)
    a.store([1, 2], 0.0)
    a.store([3, 4], 1.0)  # drops 1, 2
    a.store([5], 2.0)  # drops 3: 1 is forgotten
    assert list(ledger.evicted) == [2, 3] and len(ledger.last_use) == 2
    c = ledger.attribute([1, 2, 3], hit=0, best_seen=0, planned=0)
    assert (c.cold, c.evicted, c.evicted_age_s) == (1, 2, (1.0, 1.0))  # 1 forgotten: cold
    a.store([2], 3.0)  # stored again: held, not evicted
    assert 2 not in ledger.evicted
    ledger.check_integrity()


def _check_every_request_adds_up(sim):
    started = 0
    for r in sim.requests:
        if r.misses is None:
            assert r.status in ("rejected_early", "rejected_start")  # never started
            continue
        started += 1
        m = r.misses
        assert min(m.hit, m.cold, m.evicted, m.elsewhere, m.priced_out) >= 0
        assert m.hit + m.cold + m.evicted + m.elsewhere + m.unverified == len(r.hashes)
        assert m.hit == r.reused_blocks and m.unverified == 0
        assert min(m.priced_out, m.plan_lost, m.after_placement) >= 0
        assert m.priced_out + m.plan_lost + m.after_placement == m.elsewhere
    return started


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kinds=st.sampled_from(["conversation", "agent", "docqa", "conversation,agent,docqa"]),
    seed=st.integers(0, 1000),
    pool_blocks=st.integers(4, 400),
    prefill=st.integers(1, 4),
    policy=st.sampled_from(["kvcache_centric", "cache_aware", "random"]),
    ssd=st.booleans(),
    reserve=st.booleans(),
)
def test_attribution_adds_up_for_every_request(
    kinds, seed, pool_blocks, prefill, policy, ssd, reserve
):
    params = SynthParams(
        mix=dict.fromkeys(kinds.split(","), 1.0),
        sessions=25,
        rate=2.0,
        turns=3,
        think_s=2.0,
        docs=5,
        agent_prompts=2,
        system_len=LengthDist(800),
        tools_len=LengthDist(1500),
        doc_len=LengthDist(2000),
        seed=seed,
    )
    records, _ = synthesize(params)
    cfg = SimConfig(
        num_prefill=prefill,
        num_decode=2,
        pool_blocks=pool_blocks,
        ssd_bytes=(1 << 30) if ssd else 0,
        policy=policy,
        rejection="none",
        reserve_at_start=reserve,
    )
    sim = Simulator(cfg, records)
    result = sim.run().result
    started = _check_every_request_adds_up(sim)
    m = result.misses
    assert started == m.requests == len(records) - result.rejected_before_prefill
    assert m.blocks == sum(len(r.hashes) for r in sim.requests if r.misses is not None)
    assert sum(m.shares[k] for k in ("hit", "cold", "evicted", "elsewhere")) == pytest.approx(1)
    if not result.failed:  # a failed request started but never prefilled
        assert m.hit / m.blocks == pytest.approx(result.reuse_rate)


def test_coupled_instances_attribute_too():
    from mooncake.sim.trace import load_trace

    sim = Simulator(SimConfig(num_coupled=3, pool_blocks=300, limit=120), load_trace(FIXTURE))
    sim.run()
    assert _check_every_request_adds_up(sim) > 0


def test_rejected_requests_have_no_attribution_and_the_rest_add_up():
    records, _ = synthesize(SynthParams(mix={"agent": 1.0}, sessions=80, rate=20.0, seed=1))
    cfg = SimConfig(num_prefill=1, num_decode=1, pool_blocks=100, ttft_slo_s=2.0)
    sim = Simulator(cfg, records)
    result = sim.run().result
    assert result.rejected > 0  # an overloaded cluster
    assert _check_every_request_adds_up(sim) == result.misses.requests < len(records)
