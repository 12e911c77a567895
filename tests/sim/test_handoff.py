"""The simulator runs the cluster's prefill data path: a pipeline group takes a new request
every prefill time / S, the decode node's room is reserved as a prefill starts (the group
waits, head of line, while there is none), and the KV streamed during the prefill lands
one layer's write after its compute."""

import msgspec
import pytest

from mooncake.conductor import CostModel
from mooncake.sim.cluster import SimConfig
from mooncake.sim.simulator import Simulator
from mooncake.sim.trace import load_trace
from tests.conductor.toy import toy_cost_file
from tests.sim.toy import STEP_1, write_toy_cost, write_trace


def _sim(tmp_path, rows, cost, **cfg):
    trace = load_trace(write_trace(tmp_path / "t.jsonl", rows))
    cfg.setdefault("rejection", "none")
    sim = Simulator(SimConfig(num_decode=1, cost_model_path=cost, **cfg), trace)
    sim.run()
    sim.conductor.check_integrity()
    assert sim.conductor.num_inflight == 0
    return sim


def test_two_stage_group_pipelines_two_requests(tmp_path):
    """Each prompt: 1 s on the whole model, 10 chunks. On 2 stages the first ends after
    0.5 * 11/10 s and the second, started when stage 0 freed at 0.5 s, 0.5 s later."""
    cost = write_toy_cost(tmp_path / "cost.json")
    rows = [(0, 1000, 2, [1, 2]), (0, 1000, 2, [3, 4])]
    sim = _sim(tmp_path, rows, cost, num_prefill=2, group_size=2, chunk_tokens=100)
    a, b = sim.requests
    assert a.prefill_end == pytest.approx(0.55)
    assert b.prefill_start == pytest.approx(0.5)
    assert b.prefill_end - a.prefill_end == pytest.approx(0.5)
    # one request in flight at most: the second waits for the whole first
    sim = _sim(tmp_path, rows, cost, num_prefill=2, group_size=2, chunk_tokens=100, max_inflight=1)
    assert sim.requests[1].prefill_end == pytest.approx(1.1)
    # two groups of one node: each takes one, in 1 s
    sim = _sim(tmp_path, rows, cost, num_prefill=2, chunk_tokens=100)
    assert [r.prefill_end for r in sim.requests] == [pytest.approx(1.0)] * 2


def test_streamed_hand_off_ends_one_layer_after_the_compute(tmp_path):
    """1,000 bytes of KV over a 2,000 B/s link would take 0.5 s after the prefill; streamed
    during it, only the last chunk's last layer (512 B / 4 layers) is left: 0.064 s. The
    decode node then gives the first token at the end of its first step."""
    spec = msgspec.structs.replace(toy_cost_file(link_bytes_per_s=2000.0), model="dummy:tiny")
    path = tmp_path / "cost.json"
    CostModel(spec).save(path)
    rows = [(0, 1000, 11, [1, 2])]
    sim = _sim(tmp_path, rows, str(path), num_prefill=1)
    req = sim.requests[0]
    assert req.prefill_end == pytest.approx(1.0)
    assert req.stream_end == pytest.approx(1.064)
    tau = STEP_1 + 1001e-6
    assert req.first_token == pytest.approx(1.064 + tau)
    # a link too slow to keep up: the KV lands when it has all crossed (4 s from the start)
    CostModel(msgspec.structs.replace(spec, link_bytes_per_s=250.0)).save(path)
    sim = _sim(tmp_path, rows, str(path), num_prefill=1)
    assert sim.requests[0].stream_end == pytest.approx(4.0)


def test_a_full_decode_node_delays_the_prefill_start(tmp_path):
    """The decode node holds 2,500 tokens: the second prompt does not fit beside the first
    one's KV, so its group waits (head of line: the third waits behind it) until the first
    finishes decoding, then starts."""
    cost = write_toy_cost(tmp_path / "cost.json", kv_capacity_tokens=2_500)
    rows = [(0, 1500, 200, [1, 2, 6]), (100, 1000, 2, [3, 4]), (200, 100, 2, [5])]
    sim = _sim(tmp_path, rows, cost, num_prefill=1)
    a, b, c = sim.requests
    assert [r.status for r in sim.requests] == ["done"] * 3
    assert b.prefill_start == pytest.approx(a.done_at)
    assert c.prefill_start >= b.prefill_end - 1e-9
    # the paper's path starts it at once and the decode instance refuses it after prefill
    sim = _sim(tmp_path, rows, cost, num_prefill=1, reserve_at_start=False)
    assert sim.requests[1].prefill_start == pytest.approx(1.5)
    assert sim.requests[1].status == "rejected_late"


def test_no_room_until_the_deadline_fails_the_request(tmp_path):
    """A prompt larger than the decode node's room never gets it: after reserve_timeout_s
    the request fails (an error, not a rejection) before any prefill, and the one behind
    it starts then."""
    cost = write_toy_cost(tmp_path / "cost.json", kv_capacity_tokens=2_000)
    rows = [(0, 3000, 2, [1, 2, 3, 4, 5, 6]), (0, 100, 2, [7])]
    trace = load_trace(write_trace(tmp_path / "t.jsonl", rows))
    cfg = SimConfig(
        num_prefill=1, num_decode=1, rejection="none", cost_model_path=cost, reserve_timeout_s=2.0
    )
    sim = Simulator(cfg, trace)
    result = sim.run().result
    big, small = sim.requests
    assert big.status == "failed" and big.done_at == pytest.approx(2.0)
    assert small.status == "done" and small.prefill_start == pytest.approx(2.0)
    assert (result.failed, result.rejected, result.completed) == (1, 0, 1)
    sim.conductor.check_integrity()
    assert sim.conductor.num_inflight == 0


def test_groups_are_checked_and_shown(tmp_path):
    from typer.testing import CliRunner

    from mooncake.cli.app import app, load_verbs
    from mooncake.errors import ConfigError

    load_verbs()

    with pytest.raises(ConfigError, match="cannot form a group of 3"):
        SimConfig(num_prefill=2, group_size=3)
    cost = write_toy_cost(tmp_path / "cost.json")
    trace = write_trace(tmp_path / "t.jsonl", [(0, 1000, 2, [1, 2]), (0, 1000, 2, [3, 4])])
    args = ["sim", str(trace), "--prefill", "4", "--decode", "1", "--group-size", "2"]
    out = CliRunner().invoke(app, [*args, "--cost-model", cost, "--chunk-tokens", "100", "--json"])
    assert out.exit_code == 0, out.output
    assert "groups of 2" in out.output and '"completed": 2' in out.output


def test_a_shared_host_slows_compute_and_the_control_plane_delays_scheduling(tmp_path):
    """A one-host twin (`bench cluster`): a 2-stage group and a decode node on 2 cores with
    the control plane keeping 1 core busy run the 1 s prefill (2 + 1) / 2 = 1.5x slower; the
    fixed control-plane latency moves the start, and so the first token, by exactly itself."""
    cost = write_toy_cost(tmp_path / "cost.json")
    rows = [(0, 1000, 2, [1, 2])]
    kw = {"num_prefill": 2, "group_size": 2, "chunk_tokens": 1000}
    alone = _sim(tmp_path, rows, cost, **kw).requests[0]
    shared = _sim(tmp_path, rows, cost, host_cores=2, background_cores=1, **kw).requests[0]
    assert alone.prefill_end - alone.prefill_start == pytest.approx(1.0)
    # stage 0 and stage 1 busy, the decode node idle: (2 + 1) / 2
    assert shared.prefill_end - shared.prefill_start == pytest.approx(1.5)
    late = _sim(tmp_path, rows, cost, request_overhead_s=0.25, **kw).requests[0]
    assert late.prefill_start == pytest.approx(alone.prefill_start + 0.25)
    assert late.first_token_at - late.arrival == pytest.approx(
        alone.first_token_at - alone.arrival + 0.25
    )
    with pytest.raises(Exception, match="must be >= 0"):
        SimConfig(host_cores=-1)
