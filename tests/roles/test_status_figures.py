"""`/v1/status` and `mooncake status` on a real local cluster: the cached-token share is
the API's own figure (cached over prompt tokens of the usage it returned), the Conductor's
placement hit rates are labelled apart from it, and each node row says what memory that
node gives the pool."""

from __future__ import annotations

import io
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from rich.console import Console

from mooncake.api.status import decode_status
from mooncake.cli.statusview import render_status
from mooncake.local.launcher import LocalLauncher
from tests.roles.cluster import local_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, cost_cache: Path) -> Iterator[LocalLauncher]:
    with local_cluster(tmp_path_factory.mktemp("figures"), cost_cache) as launcher:
        yield launcher


def _complete(url: str, prompt: list[int]) -> dict[str, int]:
    body = {
        "model": "dummy:tiny",
        "prompt": prompt,
        "max_tokens": 2,
        "temperature": 0,
        "ignore_eos": True,
    }
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    return {
        "prompt": usage["prompt_tokens"],
        "cached": usage["prompt_tokens_details"]["cached_tokens"],
    }


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return float(next(ln for ln in text.splitlines() if ln.startswith(name + " ")).split()[-1])


def test_the_cached_token_share_is_the_apis_and_each_node_shows_its_pool_bytes(
    cluster: LocalLauncher,
) -> None:
    prompt = [(i * 17 + 3) % 250 + 1 for i in range(320)]
    usages = [_complete(cluster.url, prompt + [1, 2])]
    deadline = time.monotonic() + 15
    while True:  # NOTE: the repeat reuses KV once the pool has it (within a tick)
        usages.append(_complete(cluster.url, prompt + [5, 6, 7]))
        if usages[-1]["cached"] or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert usages[-1]["cached"] == 320  # ten full 32-token blocks
    prompt_tokens = sum(u["prompt"] for u in usages)
    cached_tokens = sum(u["cached"] for u in usages)

    raw = httpx.get(cluster.url + "/v1/status", timeout=10).content
    status = decode_status(raw)
    assert (status.num_prompt_tokens, status.num_cached_tokens) == (prompt_tokens, cached_tokens)
    assert status.cached_token_share == pytest.approx(cached_tokens / prompt_tokens)
    assert _metric(cluster.url, "mooncake_api_cached_tokens_total") == cached_tokens
    assert _metric(cluster.url, "mooncake_api_prompt_tokens_total") == prompt_tokens

    # every byte of the pool is some node's, and the store node gives some
    by_node = {n.node_id: n.pool_bytes for n in status.nodes}
    for tier in status.pool:
        given = sum(b.get(tier.tier, 0) for b in by_node.values())
        assert given == tier.capacity_bytes, (tier, by_node)
    assert any(n.pool_bytes for n in status.nodes if n.role == "store")

    out = io.StringIO()
    Console(file=out, width=80, color_system=None).print(render_status(status, "u", 80))
    text = " ".join(out.getvalue().split())
    share = f"{cached_tokens / prompt_tokens * 100:.1f}% of prompt tokens served from cache"
    assert f"cached tokens {share} ({cached_tokens:,} of {prompt_tokens:,})" in text
    assert "pool hits" in text and "of blocks in the pool at placement" in text
    assert "KV pool by node" in text
