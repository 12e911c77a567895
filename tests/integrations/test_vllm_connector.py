"""PoolConnector in real vLLM (CPU): two instances on one pool (a master and a store node,
real processes). Runs only when MOONCAKE_VLLM_PYTHON names the python of a vLLM for CPU
venv (`scripts/vllm-venv` prints it), as tests/bench/test_vllm.py; about 7 minutes
on 2 cores (three vLLM start-ups).

The second instance loads a prompt the first computed (vLLM counts external hit tokens)
and its greedy tokens equal the first's and those of vLLM without the connector; with the
store node killed, a prompt the master still lists fails to load and is recomputed, with
the same tokens. TTFTs are reported, not asserted (`mooncake bench vllm-pool` measures)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mooncake.bench.checkpoint import CheckpointShape
from mooncake.integrations.vllm.trial import TrialPlan, run_trial


def vllm_python() -> str:
    return os.environ.get("MOONCAKE_VLLM_PYTHON", "")


pytestmark = [
    pytest.mark.skipif(
        not vllm_python(),
        reason="no vLLM for CPU: set MOONCAKE_VLLM_PYTHON (scripts/vllm-venv makes one)",
    ),
    pytest.mark.timeout(1800),  # three vLLM start-ups on a shared 2-core machine
]

# the smallest Llama vLLM's CPU attention runs: head_dim 32 (2 heads of a 64 hidden)
TINY = CheckpointShape(
    num_layers=2, hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=128, vocab_size=300
)


def test_a_second_instance_loads_the_first_ones_prompt_and_recomputes_without_the_pool(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = run_trial(TrialPlan(vllm_python=vllm_python(), shape=TINY, work_dir=tmp_path))
    # B's Pi came from the pool: 8 blocks of 32 tokens each
    assert result.b_external_hit_tokens >= 256 * 3, result.b_log[-3000:]
    assert result.checked == ["P0", "P1", "P2", "Q"]
    for k in result.checked:
        assert result.agree(k), k
        assert result.a[k].text == result.b[k].text == result.c[k].text, k
    # Q: the master still listed its blocks; their loads failed and vLLM recomputed them
    assert "not loaded from block 0" in result.b_log, result.b_log[-3000:]
    assert "Recovered from KV load failure" in result.b_log, result.b_log[-3000:]
    with capsys.disabled():
        print(
            f"\nTTFT p50 (s) on B: cold {result.median_ttft_s('R'):.4f}, pool hit "
            f"{result.median_ttft_s('P'):.4f} (x{result.hit_over_cold_ttft:.2f}); "
            f"Q after the store node died {result.b['Q'].ttft_s:.4f}"
        )
