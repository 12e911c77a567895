"""On a GPU node (marker `gpu`, and `rdma` for the rdma run; skipped elsewhere): the whole
local cluster on `cuda`, its KV handed off and pooled over `rdma` and over `tcp` (GPU memory
staged through pinned host buffers), gives the greedy tokens of the engine alone."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

from tests.roles.cluster import local_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.gpu, pytest.mark.timeout(600)]


def _engine_alone(prompt: list[int], max_tokens: int) -> str:
    """Greedy text of the same model and dtype in one process on cuda:0."""
    from mooncake.model.decode import DecodeRunner
    from mooncake.model.info import load_model_info
    from mooncake.model.kvcache import PagedKVCache
    from mooncake.model.params import SamplingParams
    from mooncake.model.sequence import Sequence
    from mooncake.model.tokenizer import ByteTokenizer
    from mooncake.model.weights import create_model

    model = create_model(load_model_info("dummy:tiny"), "float32", "cuda:0")
    runner = DecodeRunner(model, PagedKVCache.for_model(model, 64, 32), chunk_tokens=256)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    runner.add(Sequence(1, prompt, params, tokenizer=ByteTokenizer()))
    return "".join(e.text for e in runner.run_until_done()[1])


@pytest.mark.parametrize("protocol", [pytest.param("rdma", marks=pytest.mark.rdma), "tcp"])
def test_local_cluster_on_cuda_equals_the_engine_alone(
    protocol: str, tmp_path: Path, cost_cache: Path
) -> None:
    assert torch.cuda.is_available()
    extra = {"transfer.protocol": protocol, "model.dtype": "float32"}
    prompts = [
        [(i * 37 + 11) % 250 + 1 for i in range(150)],
        [(i * 13 + 5) % 250 + 1 for i in range(700)],
    ]
    with local_cluster(tmp_path, cost_cache, extra=extra) as cluster:
        for prompt in prompts:
            body = {
                "model": "dummy:tiny",
                "prompt": prompt,
                "max_tokens": 16,
                "temperature": 0,
                "ignore_eos": True,
            }
            r = httpx.post(cluster.url + "/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == _engine_alone(prompt, 16)
        nodes = httpx.get(cluster.url + "/v1/status", timeout=10).json()["nodes"]
        moved = sum(n.get("transfer_bytes", {}).get(protocol, 0) for n in nodes)
        assert moved > 0, nodes  # the KV really went over `protocol`, not shm


def test_local_cluster_at_tensor_parallel_two_on_cuda_equals_the_engine_alone(
    tmp_path: Path, cost_cache: Path
) -> None:
    """Every prefill and decode instance over two GPUs (NCCL for the forwards, CUDA IPC for
    rank 1's KV cache, registered by rank 0's Transfer Engine on GPU 1): the greedy tokens
    of one GPU, and a repeated prefix reused."""
    if torch.cuda.device_count() < 2:
        pytest.skip(f"tensor parallelism needs 2 GPUs, {torch.cuda.device_count()} visible")
    extra = {"transfer.protocol": "tcp", "model.dtype": "float32", "model.tensor_parallel": 2}
    prompt = [(i * 37 + 11) % 250 + 1 for i in range(150)]
    body = {"model": "dummy:tiny", "prompt": prompt, "max_tokens": 16}
    body |= {"temperature": 0, "ignore_eos": True}
    with local_cluster(tmp_path, cost_cache, extra=extra) as cluster:
        for _ in range(2):
            r = httpx.post(cluster.url + "/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == _engine_alone(prompt, 16)
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
