"""The master in front of two real vLLM instances (skipped without the vLLM venv): a
prefix one instance holds (learnt from its own KV events) sends the request there, where
vLLM reports prefix cache hits, even though with nothing cached the Conductor's tie goes
to the other instance."""

from __future__ import annotations

import os
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from mooncake.bench.checkpoint import CheckpointShape, make_checkpoint
from mooncake.bench.routing import RoutingPlan, cache_counters, router_spec, vllm_instance
from mooncake.bench.servers import LaunchedServer
from mooncake.bench.versus import VersusPlan

VLLM_PYTHON = Path(os.environ.get("MOONCAKE_VLLM_PYTHON", "/tmp/vllm-venv/bin/python"))
BT = 32  # vLLM for CPU's block sizes are multiples of 32
pytestmark = [
    pytest.mark.timeout(1500),
    pytest.mark.skipif(not VLLM_PYTHON.is_file(), reason=f"no vLLM venv at {VLLM_PYTHON}"),
]


def _status(url: str) -> dict[str, Any]:
    return httpx.get(url + "/v1/status", timeout=30).json()


def test_a_prefix_held_by_one_vllm_instance_routes_there(tmp_path: Path) -> None:
    shape = CheckpointShape(
        hidden_size=128,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=256,
        max_position_embeddings=2048,
    )
    model = make_checkpoint(shape, tmp_path / "ckpt")
    versus = VersusPlan(
        model=str(model),
        vocab_size=shape.vocab_size,
        vllm_python=str(VLLM_PYTHON),
        work_dir=tmp_path,
        start_timeout_s=900,
    )
    plan = RoutingPlan(versus, num_instances=2, policies=("kvcache_centric",), max_model_len=1024)
    specs = [vllm_instance(plan, i, tmp_path, BT) for i in range(2)]
    prefix = [2 + (i * 7) % 500 for i in range(8 * BT)]  # 8 full blocks
    with ExitStack() as stack:
        for s in specs:
            stack.enter_context(LaunchedServer(s, tmp_path / f"{s.name}.log"))
        router = router_spec(plan, "kvcache_centric", specs, tmp_path, BT)
        stack.enter_context(LaunchedServer(router, tmp_path / "router.log"))
        model_id = httpx.get(specs[1].url + "/v1/models", timeout=30).json()["data"][0]["id"]
        # the second instance computes the prefix, asked directly (not through the router)
        body = {"model": model_id, "prompt": prefix, "max_tokens": 1}
        assert (
            httpx.post(specs[1].url + "/v1/completions", json=body, timeout=300).status_code == 200
        )
        deadline = time.monotonic() + 60
        while _status(router.url)["backends"][1]["num_blocks"] < 8:
            assert time.monotonic() < deadline, _status(router.url)["backends"]
            time.sleep(0.2)
        assert _status(router.url)["backends"][0]["num_blocks"] == 0
        before = [cache_counters(s.url) for s in specs]
        body = {"model": str(model), "prompt": prefix + [3, 4, 5, 6], "max_tokens": 4}
        r = httpx.post(router.url + "/v1/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
        after = [cache_counters(s.url) for s in specs]
        rows = _status(router.url)["backends"]
    assert [b["num_routed"] for b in rows] == [0, 1]
    assert after[1][0] - before[1][0] == 8 * BT  # every block of the prefix was a hit there
    assert after[0] == before[0]
