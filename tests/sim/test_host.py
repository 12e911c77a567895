"""CPU shares on one shared host (`sim/host.py`): the water-filling of the kernel's fair
scheduler by nice weight, and what it does to a simulated `up --local` twin whose prefill
nodes run at nice 10."""

import pytest

from mooncake.sim.cluster import SimConfig
from mooncake.sim.host import core_shares, nice_weight, slowdown
from mooncake.sim.simulator import Simulator
from mooncake.sim.trace import load_trace
from tests.sim.toy import write_toy_cost, write_trace


def test_nice_weights_follow_the_kernel_table():
    # kernel/sched/core.c sched_prio_to_weight: nice 0 = 1024, 5 = 335, 10 = 110, 19 = 15
    for nice, weight in ((0, 1024), (5, 335), (10, 110), (19, 15)):
        assert nice_weight(nice) == pytest.approx(weight, rel=0.02)
    with pytest.raises(ValueError, match="-20..19"):
        nice_weight(20)


def test_cores_are_split_by_weight_and_nobody_gets_more_than_it_can_use():
    assert core_shares([(1, 1), (1, 1)], 2) == [1, 1]
    assert core_shares([(1, 1), (1, 1), (1, 1)], 2) == pytest.approx([2 / 3] * 3)
    # a heavy single-threaded task is capped at one core; the rest is split again
    assert core_shares([(1024, 1), (110, 1), (110, 1)], 2) == pytest.approx([1, 0.5, 0.5])
    # 0.3 cores of control plane at nice 0 get what they ask for, first
    shares = core_shares([(1024, 1), (110, 1), (110, 1), (1024 * 0.3, 0.3)], 2)
    assert shares == pytest.approx([1, 0.35, 0.35, 0.3])
    assert sum(shares) == pytest.approx(2)
    assert core_shares([(1, 1)], 4) == [1]  # idle cores are not handed out
    assert core_shares([], 2) == []


def test_at_nice_10_a_busy_decode_node_keeps_its_core_and_prefill_pays():
    kw = {"prefill_busy": 2, "decode_busy": 1, "background_cores": 0.3}
    fair_p = slowdown("prefill", 2, prefill_nice=0, **kw)
    fair_d = slowdown("decode", 2, prefill_nice=0, **kw)
    assert fair_p == fair_d == pytest.approx(3.3 / 2)
    assert slowdown("decode", 2, prefill_nice=10, **kw) == 1.0
    assert slowdown("prefill", 2, prefill_nice=10, **kw) == pytest.approx(1 / 0.35)
    # nobody decoding: the prefill stages share the cores with the control plane only
    idle = {"prefill_busy": 2, "decode_busy": 0, "background_cores": 0.3}
    assert slowdown("prefill", 2, prefill_nice=10, **idle) == pytest.approx(1 / 0.85)
    assert slowdown("prefill", 0, prefill_busy=9, decode_busy=9) == 1.0  # own devices
    with pytest.raises(ValueError, match="'prefill' or 'decode'"):
        slowdown("store", 2, prefill_busy=0, decode_busy=0)


def _run(tmp_path, nice, **kw):
    """A long-decoding request, then a prompt while it decodes, on a 2-stage group and a
    decode node sharing 2 cores."""
    cost = write_toy_cost(tmp_path / "cost.json", step_per_request_s=0, step_per_token_s=0)
    rows = [(0, 100, 400, [1]), (500, 1000, 2, [2, 3])]
    cfg = SimConfig(
        num_prefill=2,
        num_decode=1,
        group_size=2,
        chunk_tokens=1000,
        rejection="none",
        cost_model_path=cost,
        host_cores=2,
        prefill_nice=nice,
        **kw,
    )
    sim = Simulator(cfg, load_trace(write_trace(tmp_path / "t.jsonl", rows)))
    sim.run()
    return sim.requests


def test_the_twin_prices_nice_prefill_slower_and_decode_steps_at_full_speed(tmp_path):
    fair, nice = _run(tmp_path, 0), _run(tmp_path, 10)
    took = [r[1].prefill_end - r[1].prefill_start for r in (fair, nice)]
    # fair: 3 busy processes on 2 cores, 1.5x; nice 10: decode keeps a core, 2x
    assert took == pytest.approx([1.5, 2.0])
    assert nice[0].tbt < fair[0].tbt  # the decode node's steps were not slowed
    with pytest.raises(Exception, match="prefill_nice"):
        SimConfig(prefill_nice=20)


def test_path_scales_stretch_the_twins_compute_not_its_conductors_prices(tmp_path):
    """bench cluster's lone-request probes: prefill groups and decode nodes compute at the
    measured factors; the Conductor keeps pricing with the cost model."""
    cost = write_toy_cost(tmp_path / "cost.json", step_per_request_s=0, step_per_token_s=0)
    trace = load_trace(write_trace(tmp_path / "t.jsonl", [(0, 1000, 11, [1, 2])]))

    def run(**kw):
        cfg = SimConfig(num_prefill=1, num_decode=1, rejection="none", cost_model_path=cost, **kw)
        sim = Simulator(cfg, trace)
        sim.run()
        return sim.requests[0]

    base, scaled = run(), run(prefill_scale=1.5, decode_scale=2.0)
    took = [r.prefill_end - r.prefill_start for r in (base, scaled)]
    assert took[1] == pytest.approx(1.5 * took[0])
    assert scaled.tbt == pytest.approx(2.0 * base.tbt)  # 10 steps of 20 ms, not 10 ms
    assert scaled.decision.ttft_s == base.decision.ttft_s
    with pytest.raises(Exception, match="prefill_scale and decode_scale"):
        SimConfig(decode_scale=0)


def test_a_node_that_wants_more_than_a_core_is_slowed_by_what_it_wants_over_what_it_gets():
    """A prefill stage whose KV stream and copy threads keep 1.5 cores busy: alone on 2
    cores it runs at full speed; two such stages and a decode node at nice 0 split 2 cores
    by 1.5 : 1.5 : 1, so each stage gets 0.75 of the 1.5 it wants (2x slower)."""
    alone = slowdown("prefill", 2, prefill_busy=1, decode_busy=0, prefill_cpu=1.5)
    assert alone == 1.0
    # 2 stages wanting 1.5 each and a decode node wanting 1, by weight 1.5 : 1.5 : 1 of 2
    shared = slowdown("prefill", 2, prefill_busy=2, decode_busy=1, prefill_cpu=1.5)
    assert shared == pytest.approx(1.5 / (2 * 1.5 / 4))
    # at nice 10 the decode node takes its core; the stages share the other
    nice = slowdown("prefill", 2, prefill_busy=2, decode_busy=1, prefill_cpu=1.5, prefill_nice=10)
    assert nice == pytest.approx(1.5 / 0.5)
    assert slowdown("decode", 2, prefill_busy=2, decode_busy=1, prefill_nice=10) == 1.0


def test_cpu_per_work_is_the_processes_cpu_over_the_twins_compute(tmp_path):
    from mooncake.bench.hostprobe import HostFigures, cpu_per_work

    cost = write_toy_cost(tmp_path / "cost.json", step_per_request_s=0, step_per_token_s=0)
    trace = load_trace(write_trace(tmp_path / "t.jsonl", [(0, 1000, 11, [1, 2])]))
    cfg = SimConfig(num_prefill=1, num_decode=1, rejection="none", cost_model_path=cost)
    sim = Simulator(cfg, trace)
    sim.run()
    # 1 s of prefill compute, 10 decode steps of 10 ms
    host = HostFigures(prefill_cpu_s=1.5, decode_cpu_s=0.08)
    assert cpu_per_work(host, sim) == pytest.approx((1.5, 0.8))
    assert cpu_per_work(HostFigures(), sim) == (1.0, 1.0)  # nothing measured
    assert cpu_per_work(HostFigures(prefill_cpu_s=100.0), sim)[0] == 5.0  # clamped


def test_a_paced_decode_node_leaves_the_prefill_stages_what_its_steps_do_not_need(tmp_path):
    """decode.step_interval_s: 10 ms steps started every 40 ms compute a quarter of the
    time; at nice 10 the two stages share the 1.75 cores left (not 1), and the decode
    node's gaps are the interval."""
    kw = {"prefill_busy": 2, "decode_busy": 1, "decode_duty": 0.25}
    assert slowdown("prefill", 2, prefill_nice=10, **kw) == pytest.approx(1 / 0.875)
    assert slowdown("decode", 2, prefill_busy=2, decode_busy=1, decode_duty=0.25) == (
        pytest.approx(slowdown("decode", 2, prefill_busy=2, decode_busy=1))
    )  # it competes in full while it steps
    paced = _run(tmp_path, 10, decode_step_interval_s=0.04)
    assert paced[1].prefill_end - paced[1].prefill_start == pytest.approx(1 / 0.875)
    assert paced[0].tbt == pytest.approx(0.04)
    with pytest.raises(Exception, match="decode_step_interval_s"):
        SimConfig(decode_step_interval_s=-1)
