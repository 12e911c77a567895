"""A short soak of a real local cluster (`up --local --masters 2` on a real etcd): the
leading master SIGKILLed, a decode node SIGKILLed and, as root, the decode node's veth link
degraded, while a trace is replayed. No request may hang and every failed one must carry a
clear error; the failover is measured, the pool keeps its objects and every master serves
at the end. Run with -s to see the figures."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from mooncake.bench.soak.faults import FaultKind, FaultPlan
from mooncake.bench.soak.netns import Degrade
from mooncake.bench.soak.run import SoakConfig, default_trace, is_clear, run_soak
from mooncake.ha.localetcd import etcd_binary
from mooncake.local.cost import ensure_cost_model
from mooncake.local.launcher import LocalPlan
from mooncake.replay.prompts import PromptConfig

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        etcd_binary() is None, reason="no etcd server (apt-get install etcd-server)"
    ),
]
HAS_NETNS = os.geteuid() == 0 and shutil.which("ip") is not None and shutil.which("tc") is not None


def test_a_short_soak_hangs_nothing_and_every_failure_is_clear(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    prompts = PromptConfig(scale=0.0625, output_scale=0.0625, max_tokens=16)
    plan = LocalPlan(
        api_port=0,
        num_prefill=1,
        group_size=1,
        num_masters=2,
        block_tokens=prompts.block_tokens,
        run_dir=tmp_path,
        extra={"scheduler.rejection": "none"},
    )
    cost = ensure_cost_model(plan, tmp_path_factory.mktemp("soak-cost"))
    kinds: tuple[FaultKind, ...] = (
        ("master", "decode", "link") if HAS_NETNS else ("master", "decode")
    )
    cfg = SoakConfig(
        duration_s=45.0,
        fault_interval_s=10.0,
        warmup_s=10.0,
        netns_nodes=("decode-0",) if HAS_NETNS else (),
        faults=FaultPlan(kinds=kinds, settle_s=9.0, degrade=Degrade(loss_pct=5), degrade_s=5.0),
    )
    events: list[str] = []
    report = run_soak(plan, cost, default_trace(), prompts, cfg, events.append)
    print(f"\n{report.sent} sent, {report.completed} ok, errors {report.errors}")
    for f in report.faults:
        print(f"  {f}")
    assert report.sent > 20 and report.completed > 0
    assert report.hung == 0, report.error_examples
    failed = {k: v for k, v in report.error_examples.items() if k != "hung"}
    assert all(is_clear(kind) for kind in failed), failed
    assert report.unclear_errors == 0 and report.checks["errors_clear"]
    assert sorted(f.kind for f in report.faults) == sorted(kinds)
    assert all(not f.error for f in report.faults), report.faults
    (master,) = [f for f in report.faults if f.kind == "master"]
    assert master.leader_s is not None and master.nodes_s is not None, master
    assert master.objects_after is not None and master.objects_before is not None
    assert master.objects_after >= master.objects_before, master  # NOTE: none lost
    (decode,) = [f for f in report.faults if f.kind == "decode"]
    assert decode.nodes_s is not None and report.restarts >= 2
    if HAS_NETNS:
        (link,) = [f for f in report.faults if f.kind == "link"]
        assert link.target == "decode-0" and "5" in link.how
    assert report.serves_at_end, report.end_error
    names = {p.name for p in report.rss}
    assert {"master", "master-1", "decode-0", "prefill-0", "store-0", "etcd"} <= names
    assert any(p.rss_growth is not None for p in report.rss)
