"""`[node] nice`: a node lowers its own priority; `up --local` lowers its prefill nodes'
when its compute nodes outnumber the cores, so decode steps (held to the TBT SLO) go first."""

import subprocess
import sys
from pathlib import Path

import pytest

from mooncake.local import launcher as local
from mooncake.local.launcher import LocalLauncher, LocalPlan
from mooncake.local.plan import PREFILL_NICE


@pytest.mark.cluster
def test_a_node_lowers_its_priority_and_never_raises_it():
    code = (
        "import os; from mooncake.roles import lower_priority; "
        "lower_priority(7); a = os.getpriority(os.PRIO_PROCESS, 0); "
        "lower_priority(3); print(a, os.getpriority(os.PRIO_PROCESS, 0))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["7", "7"]


@pytest.mark.parametrize(("cores", "nice"), [({0, 1}, True), ({0, 1, 2, 3}, False)])
def test_up_local_lowers_prefill_nodes_only_when_the_cores_are_shared(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cores: set[int], nice: bool
):
    launched: list[list[str]] = []

    class Proc:
        stdout = None

    def popen(cmd: list[str], **_kw: object) -> Proc:
        launched.append(cmd)
        return Proc()

    monkeypatch.setattr(local.subprocess, "Popen", popen)
    monkeypatch.setattr(local.os, "sched_getaffinity", lambda _pid: cores)
    launcher = LocalLauncher(LocalPlan(num_prefill=2, num_decode=1, run_dir=tmp_path))
    for role, node_id in (("prefill", "prefill-0"), ("decode", "decode-0")):
        launcher._launch(role, node_id)
    prefill, decode = launched
    assert (f"node.nice={PREFILL_NICE}" in prefill) == nice
    assert not any(a.startswith("node.nice") for a in decode)
    assert not any(a.startswith("decode.step_interval_s") for a in decode)
    assert plan_pace(tmp_path) == 0.0  # decode steps are paced only when asked


def plan_pace(tmp_path: Path, **extra: object) -> float:
    plan = LocalPlan(num_prefill=2, num_decode=1, run_dir=tmp_path, extra=extra)
    return plan.decode_step_interval_s


def test_the_twin_reads_the_pace_given() -> None:
    assert plan_pace(Path("/nonexistent"), **{"decode.step_interval_s": "0.05"}) == 0.05
