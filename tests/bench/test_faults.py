"""`mooncake bench faults`: a replay while a node fails, on a real supervised local cluster."""

from __future__ import annotations

from pathlib import Path

import pytest

from mooncake.bench.faults import FAULTS, FaultRun, parse_faults, run_fault
from mooncake.errors import ConfigError
from mooncake.local.cost import ensure_cost_model
from mooncake.local.launcher import LocalPlan
from mooncake.replay.prompts import PromptConfig
from mooncake.sim.trace import load_trace

TRACE = Path(__file__).resolve().parents[1] / "fixtures" / "traces" / "conversation_head300.jsonl"


def test_fault_names_are_checked() -> None:
    assert [f.name for f in parse_faults("none, decode-kill")] == ["none", "decode-kill"]
    with pytest.raises(ConfigError, match="unknown fault 'disk-fire'.*decode-kill"):
        parse_faults("none,disk-fire")
    with pytest.raises(ConfigError, match="name at least one"):
        parse_faults(" , ")


@pytest.mark.cluster
@pytest.mark.timeout(240)
def test_a_killed_decode_node_is_restarted_and_no_request_hangs(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """SIGKILL the decode node mid-replay: the supervisor starts it again, the requests it
    held are placed again, and every request completes; none hangs."""
    records = load_trace(TRACE, limit=24)
    prompts = PromptConfig(scale=0.0625, output_scale=0.0625, max_tokens=24)
    plan = LocalPlan(
        api_port=0,
        block_tokens=prompts.block_tokens,
        run_dir=tmp_path / "run",
        extra={"scheduler.rejection": "none"},
    )
    cost = ensure_cost_model(plan, tmp_path_factory.mktemp("faults-cost"))
    run = FaultRun(at_s=2.0, hang_s=90.0, settle_s=60.0)
    result = run_fault(FAULTS["decode-kill"], plan, cost, records, prompts, run)
    assert result.hung == 0
    assert result.completed == result.sent == 24, result.errors
    assert result.restarts == 1
    assert result.serve_again_s is not None
