"""The simulator: exact single-request timings, determinism, the coupled baseline, where
rejections happen, and the Conductor's books after a whole replay."""

import msgspec
import pytest

from mooncake.sim.cluster import SimConfig
from mooncake.sim.lru import global_lru_hit_rate
from mooncake.sim.simulator import Simulator, run_sim
from mooncake.sim.trace import load_trace
from tests.sim.toy import FIXTURE, STEP_1, write_toy_cost, write_trace


def _result(report):
    data = msgspec.structs.asdict(report.result)
    data.pop("wall_s")
    return data


def test_one_request_on_prefill_and_decode_by_hand(tmp_path):
    cost = write_toy_cost(tmp_path / "cost.json")
    trace = load_trace(write_trace(tmp_path / "t.jsonl", [(0, 1000, 11, [1, 2])]))
    cfg = SimConfig(num_prefill=1, num_decode=1, cost_model_path=cost, reserve_at_start=False)
    sim = Simulator(cfg, trace)  # the paper's path: the prefill gives the first token
    result = sim.run().result
    req = sim.requests[0]
    tau = STEP_1 + 1001e-6  # one request holding 1,000 prompt tokens + 1 generated
    assert req.prefill_end == pytest.approx(1.0)  # 1,000 tokens at 1 ms
    assert req.done_at == pytest.approx(1.0 + 10 * tau)  # 10 decode steps
    assert req.tbt == pytest.approx(tau)
    assert (result.completed, result.ttft_p50_s) == (1, pytest.approx(1.0))
    assert result.prefill_gpu_s == pytest.approx(8.0)  # 1 s on 8 GPUs
    sim.conductor.check_integrity()
    assert sim.conductor.num_inflight == 0


def test_second_request_reuses_the_cached_prefix(tmp_path):
    cost = write_toy_cost(tmp_path / "cost.json")
    rows = [(0, 1024, 2, [1, 2]), (5000, 1500, 2, [1, 2, 3])]
    sim = Simulator(
        SimConfig(num_prefill=2, num_decode=1, cost_model_path=cost),
        load_trace(write_trace(tmp_path / "t.jsonl", rows)),
    )
    sim.run()
    second = sim.requests[1]
    assert (second.decision.best_blocks, second.reused_blocks) == (2, 2)
    assert second.prefill_end - second.arrival == pytest.approx((1500 - 1024) / 1000)


def test_coupled_instance_chunks_the_prefill_then_decodes(tmp_path):
    cost = write_toy_cost(tmp_path / "cost.json")
    trace = load_trace(write_trace(tmp_path / "t.jsonl", [(0, 1000, 3, [1, 2])]))
    sim = Simulator(SimConfig(num_coupled=1, chunk_tokens=512, cost_model_path=cost), trace)
    sim.run()
    req = sim.requests[0]
    assert req.prefill_end == pytest.approx(0.512 + 0.488)  # two chunked iterations
    assert req.done_at == pytest.approx(1.0 + 2 * (STEP_1 + 1001e-6))


def test_coupled_baseline_slows_tokens_when_prefills_interleave():
    records = load_trace(FIXTURE)
    coupled = run_sim(SimConfig(num_coupled=4, rejection="none"), records).result
    disagg = run_sim(SimConfig(num_prefill=2, num_decode=2, rejection="none"), records).result
    assert coupled.completed + coupled.rejected == 300
    assert coupled.tbt_p50_s > disagg.tbt_p50_s  # prefill chunks ride in every decode step
    assert coupled.local_hit_rate <= coupled.hit_rate  # what a global pool would have held


def test_same_seed_same_result():
    records = load_trace(FIXTURE)
    cfg = SimConfig(num_prefill=3, num_decode=2, policy="random", seed=5, speed=3.0)
    assert _result(run_sim(cfg, records)) == _result(run_sim(cfg, records))


def test_rejections_before_or_after_prefill_by_mode(tmp_path):
    # a decode pool of 40k tokens cannot hold the fixture's concurrency at 4x speed
    cost = write_toy_cost(tmp_path / "cost.json", kv_capacity_tokens=40_000)
    records = load_trace(FIXTURE)
    out = {}
    for mode in ("none", "basic", "predictive"):
        cfg = SimConfig(
            num_prefill=4,
            num_decode=1,
            speed=4.0,
            rejection=mode,
            cost_model_path=cost,
            reserve_at_start=False,  # the paper's §7 path: decode checks when the KV lands
        )
        sim = Simulator(cfg, records)
        out[mode] = sim.run().result
        reasons = {r.decision.reason for r in sim.requests if r.status == "rejected_early"}
        if mode == "none":
            assert reasons <= {"ttft_slo"}  # the decode side is only checked after prefill
        else:
            assert "decode_load" in reasons
        sim.conductor.check_integrity()
        assert sim.conductor.num_inflight == 0
    assert out["none"].rejected_after_prefill > 0 and out["none"].wasted_prefill_gpu_s > 0
    assert out["predictive"].rejected_after_prefill < out["none"].rejected_after_prefill


def test_pool_never_exceeds_capacity_and_hit_rate_is_bounded_by_the_trace():
    records = load_trace(FIXTURE)
    sim = Simulator(SimConfig(num_prefill=2, num_decode=2, pool_blocks=200), records)
    result = sim.run().result
    for pool in sim.pools.values():
        pool.check_integrity()
        assert len(pool.top) <= 100
    sim.conductor.check_integrity()
    assert 0 < result.hit_rate <= global_lru_hit_rate(records, None) + 1e-9
    assert result.local_hit_rate <= result.hit_rate


def test_decode_instance_reports_the_kv_it_holds_to_the_conductor(tmp_path):
    cost = write_toy_cost(tmp_path / "cost.json")
    rows = [(0, 1000, 200, [1, 2]), (100, 1000, 200, [3, 4])]
    sim = Simulator(
        SimConfig(num_prefill=1, num_decode=1, cost_model_path=cost),
        load_trace(write_trace(tmp_path / "t.jsonl", rows)),
    )
    inst, slots, seen = sim.decode["d0"], sim.conductor.decode[0], []
    offer = inst.offer

    def checked_offer(t, req):
        offer(t, req)
        # the batch grows one token per request per step until its membership changes
        for k in (0, 10):
            held = slots.held_tokens(inst.seg_t0 + k * inst.tau)
            assert held == pytest.approx(inst.context_tokens + inst.n * k)
        seen.append(inst.n)

    inst.offer = checked_offer  # type: ignore[method-assign]
    sim.run()
    assert seen == [1, 2]  # the second request joined while the first was decoding


def test_predictive_decides_again_as_each_prefill_starts(tmp_path):
    """With two small decode pools, some requests' KV goes to another decode instance than
    the one chosen at arrival (the one predicted to have room when it lands), and some are
    rejected as their prefill is about to start: those spend no prefill at all."""
    cost = write_toy_cost(tmp_path / "cost.json", kv_capacity_tokens=40_000)
    sim = Simulator(
        SimConfig(
            num_prefill=4,
            num_decode=2,
            speed=4.0,
            cost_model_path=cost,
            reserve_at_start=False,  # the paper's path: no decode room reserved at start
        ),
        load_trace(FIXTURE),
    )
    first = {}
    schedule = sim.conductor.schedule

    def remember(req, now):
        d = schedule(req, now)
        first[req.req_id] = d.decode
        return d

    served = {}
    for name, inst in sim.decode.items():

        def offer(t, req, inst=inst, name=name):
            served[req.rid] = name
            type(inst).offer(inst, t, req)

        inst.offer = offer  # type: ignore[method-assign]
    sim.conductor.schedule = remember  # type: ignore[method-assign]
    result = sim.run().result
    moved = [r for r in sim.requests if r.rid in served and served[r.rid] != first[r.rid]]
    assert moved and all(
        served[r.rid] == r.decision.decode for r in sim.requests if r.rid in served
    )
    at_start = [r for r in sim.requests if r.status == "rejected_start"]
    assert len(at_start) == result.rejected_at_prefill_start > 0
    assert all(r.prefill_start < 0 and r.prefill_s == 0 for r in at_start)
    sim.conductor.check_integrity()
    assert sim.conductor.num_inflight == 0


def test_a_prefix_demoted_to_ssd_is_reused_at_the_ssd_read_cost(tmp_path):
    """One prefill node with DRAM for one 512-token block and SSD for four (1 byte of KV
    per token, SSD read at 5,120 B/s: 0.1 s a block): the first prompt's two blocks are
    pushed to SSD by the second prompt, and the third prompt reuses both from there,
    paying their read before its 512 new tokens (1 ms each)."""
    from mooncake.conductor import CostModel
    from tests.conductor.toy import toy_cost_file

    cost = tmp_path / "cost.json"
    CostModel(toy_cost_file(1_000_000, 1e9, ssd_read_bytes_per_s=5120.0)).save(cost)
    rows = [(0, 1024, 2, [1, 2]), (5000, 512, 2, [3]), (10000, 1536, 2, [1, 2, 4])]
    cfg = SimConfig(
        num_prefill=1,
        num_decode=1,
        cost_model_path=str(cost),
        block_tokens=512,
        dram_bytes=512,
        ssd_bytes=4 * 512,
        reserve_at_start=False,
    )
    sim = Simulator(cfg, load_trace(write_trace(tmp_path / "t.jsonl", rows)))
    result = sim.run().result
    third = sim.requests[2]
    assert (third.reused_blocks, third.ssd_blocks) == (2, 2)
    assert third.prefill_end - third.arrival == pytest.approx(0.512 + 0.2)
    assert result.ssd_hit_share == 1.0  # the only reused blocks were read from SSD
    without = Simulator(
        msgspec.structs.replace(cfg, ssd_bytes=0),
        load_trace(write_trace(tmp_path / "t.jsonl", rows)),
    )
    assert without.run().result.ssd_hit_share == 0.0
    assert without.requests[2].reused_blocks == 0  # dropped from DRAM: computed again


def test_requests_refused_for_the_queue_wait_for_an_idle_group_within_defer_s(tmp_path):
    # six 500-token prompts at once (0.5 s of prefill each) on one group, TTFT SLO 1.2 s:
    # two fit the SLO; the other four are refused for the queue ahead of them alone
    cost = write_toy_cost(tmp_path / "cost.json")
    rows = [(0, 500, 4, [10 * i]) for i in range(6)]
    trace = load_trace(write_trace(tmp_path / "t.jsonl", rows))
    base = SimConfig(num_prefill=1, num_decode=1, cost_model_path=cost, ttft_slo_s=1.2)
    strict = run_sim(base, trace).result
    assert (strict.completed, strict.rejected_ttft_slo, strict.waited) == (2, 4, 0)
    # waiting up to 5 s: each runs when the group has nothing queued, one after the other
    sim = Simulator(msgspec.structs.replace(base, defer_s=5.0), trace)
    waited = sim.run().result
    assert (waited.completed, waited.rejected, waited.waited) == (6, 0, 4)
    starts = sorted(r.prefill_start for r in sim.requests)
    # each offered again when the group is predicted idle, not on the next 0.25 s poll
    assert starts == pytest.approx([0.0, 0.5, 1.0, 1.5, 2.0, 2.5])
    assert waited.slo_attainment == strict.slo_attainment == pytest.approx(2 / 6)
    sim.conductor.check_integrity()
    assert sim.conductor.num_inflight == 0
    # waiting up to 1.2 s: the group is idle once (at 1.0 s) within it; the three behind
    # would start at 1.5 s and later: refused on arrival, never waiting
    sim = Simulator(msgspec.structs.replace(base, defer_s=1.2), trace)
    short = sim.run().result
    assert (short.completed, short.rejected, short.waited) == (3, 3, 1)
    refused = [r for r in sim.requests if r.status == "rejected_early"]
    assert [r.decision.can_wait for r in refused] == [False] * 3
    assert len(sim.conductor.waiting) == 0
