"""The master routing across two vLLM stand-ins (tests/router/vllm_emulator.py: vLLM's API,
metrics and KV events, no model), real processes on loopback: Algorithm 1 sends a prompt
to the instance whose cache holds its prefix (learnt from that instance's events), round
robin does not; a restarted instance's blocks are forgotten."""

from __future__ import annotations

import json
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from mooncake.bench.checkpoint import CheckpointShape, make_checkpoint
from mooncake.bench.routing import RoutingPlan, cache_counters, router_spec, run_routing
from mooncake.bench.servers import LaunchedServer, ServerSpec
from mooncake.bench.versus import VersusPlan
from mooncake.local.launcher import free_port
from mooncake.replay.prompts import PromptConfig
from mooncake.sim.trace import TraceRecord

BT = 32
REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]


def _emulator(i: int, model: Path) -> ServerSpec:
    port = free_port()
    kv = {
        "endpoint": f"tcp://127.0.0.1:{free_port()}",
        "replay_endpoint": f"tcp://127.0.0.1:{free_port()}",
    }
    argv = [
        sys.executable,
        "-m",
        "tests.router.vllm_emulator",
        "--model",
        str(model),
        "--port",
        str(port),
        "--block-size",
        str(BT),
        "--kv-events-config",
        json.dumps(kv),
    ]
    return ServerSpec(
        f"vllm-{i}",
        argv,
        f"http://127.0.0.1:{port}",
        env={"PYTHONPATH": str(REPO)},
        start_timeout_s=180,
    )


def _backends(url: str) -> list[dict[str, Any]]:
    return httpx.get(url + "/v1/status", timeout=30).json()["backends"]


def _wait_blocks(url: str, i: int, n: int) -> None:
    deadline = time.monotonic() + 90
    while _backends(url)[i]["num_blocks"] != n:
        assert time.monotonic() < deadline, _backends(url)
        time.sleep(0.05)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    shape = CheckpointShape(
        hidden_size=64,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=128,
        max_position_embeddings=2048,
    )
    return make_checkpoint(shape, tmp_path_factory.mktemp("ckpt"))


@pytest.mark.parametrize(
    ("policy", "routed"), [("kvcache_centric", [0, 1]), ("round_robin", [1, 0])]
)
def test_a_prompt_goes_where_its_prefix_is_cached(
    tmp_path: Path, model: Path, policy: str, routed: list[int]
) -> None:
    versus = VersusPlan(model=str(model), vocab_size=512, work_dir=tmp_path)
    plan = RoutingPlan(versus, num_instances=2, policies=(policy,), max_model_len=2048)
    specs = [_emulator(i, model) for i in range(2)]
    prefix = [2 + (i * 7) % 500 for i in range(8 * BT)]
    with ExitStack() as stack:
        for s in specs:
            stack.enter_context(LaunchedServer(s, tmp_path / f"{s.name}.log"))
        router = router_spec(plan, policy, specs, tmp_path, BT)
        stack.enter_context(LaunchedServer(router, tmp_path / "router.log"))
        body = {"model": str(model), "prompt": prefix, "max_tokens": 1}
        assert (
            httpx.post(specs[1].url + "/v1/completions", json=body, timeout=30).status_code == 200
        )
        _wait_blocks(router.url, 1, 8)
        before = cache_counters(specs[1].url)
        body = {"model": str(model), "prompt": prefix + [3, 4, 5], "max_tokens": 3}
        r = httpx.post(router.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3
        rows = _backends(router.url)
        assert [b["num_routed"] for b in rows] == routed
        hits = cache_counters(specs[1].url)[0] - before[0]
        assert hits == (8 * BT if routed[1] else 0)


def test_a_restarted_instance_is_forgotten_and_a_late_feed_is_replayed(
    tmp_path: Path, model: Path
) -> None:
    """Blocks stored before the router started reach it by replay; an instance restarted
    on the same ports (sequence numbers from 0 again) holds nothing."""
    versus = VersusPlan(model=str(model), vocab_size=512, work_dir=tmp_path)
    plan = RoutingPlan(versus, num_instances=2, max_model_len=2048)
    specs = [_emulator(i, model) for i in range(2)]
    prefix = [2 + (i * 3) % 500 for i in range(4 * BT)]
    with ExitStack() as stack:
        servers = [
            stack.enter_context(LaunchedServer(s, tmp_path / f"{s.name}.log")) for s in specs
        ]
        body = {"model": str(model), "prompt": prefix, "max_tokens": 1}
        assert (
            httpx.post(specs[0].url + "/v1/completions", json=body, timeout=30).status_code == 200
        )
        router = router_spec(plan, "kvcache_centric", specs, tmp_path, BT)
        stack.enter_context(LaunchedServer(router, tmp_path / "router.log"))
        _wait_blocks(router.url, 0, 4)  # published before the router subscribed: replayed
        assert _backends(router.url)[0]["num_replayed"] >= 1
        servers[0].stop()
        servers[0].start()
        assert (
            httpx.post(
                specs[0].url + "/v1/completions", json={**body, "prompt": prefix[:BT]}, timeout=30
            ).status_code
            == 200
        )
        _wait_blocks(router.url, 0, 1)  # the old four forgotten, the new one indexed


def test_bench_router_measures_a_higher_hit_rate_for_algorithm_1(
    tmp_path: Path, model: Path
) -> None:
    """`bench router`'s run on the stand-ins: sessions of three turns, each turn the
    previous prompt and more; round robin sends every other turn where its prefix is not,
    Algorithm 1 sends each where it is, and the caches are reset between the policies."""
    records = [
        TraceRecord(
            timestamp=100 * (3 * turn + s),
            input_length=512 * (turn + 2),
            output_length=16,
            hash_ids=[1000 * s + b for b in range(turn + 2)],
        )
        for turn in range(3)
        for s in range(3)
    ]
    versus = VersusPlan(model=str(model), vocab_size=512, work_dir=tmp_path)
    plan = RoutingPlan(versus, num_instances=2, max_model_len=2048)
    prompts = PromptConfig(scale=BT / 512, output_scale=BT / 512, seed=0, first_id=2)
    result = run_routing(
        plan, records, prompts, instance_spec=lambda _p, i, _d, _b: _emulator(i, model)
    )
    rr, kv = result.rows
    assert (rr.policy, kv.policy) == ("round_robin", "kvcache_centric")
    assert rr.completed == kv.completed == 9 and rr.failed == kv.failed == 0
    assert rr.query_tokens == kv.query_tokens == sum(r.input_length for r in records) * BT // 512
    assert kv.hit_rate > rr.hit_rate
    # every later turn finds its whole previous prompt: (2 + 3) blocks per session, 3 sessions
    assert kv.hit_tokens == 3 * 5 * BT
