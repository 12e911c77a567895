"""A request no node's KV cache could hold even alone is an HTTP 400 at the API naming the
limit and its key, not a late abort: a local cluster (a 2-stage prefill group, a decode
node) whose caches hold 512 tokens per prefill stage and 256 on the decode node."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from mooncake.local.launcher import LocalLauncher
from tests.roles.cluster import local_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, cost_cache: Path) -> Iterator[LocalLauncher]:
    # dummy:tiny in float32: 1 KiB of KV per token and layer; a stage has 2 of its 4 layers
    small = {"prefill.kv_cache_bytes": "1MiB", "decode.kv_cache_bytes": "1MiB"}
    with local_cluster(tmp_path_factory.mktemp("kvroom"), cost_cache, pool=False, extra=small) as c:
        yield c


def _complete(url: str, prompt_len: int, max_tokens: int) -> httpx.Response:
    body = {
        "model": "dummy:tiny",
        "prompt": [(i * 7 + 3) % 500 + 1 for i in range(prompt_len)],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


@pytest.mark.parametrize(
    "prompt_len,max_tokens,message",
    [
        (
            600,
            1,
            "prompt of 600 tokens exceeds the KV cache of the prefill nodes: at most 512 "
            "tokens (prefill.kv_cache_bytes)",
        ),
        (
            200,
            100,
            "prompt of 200 tokens (+ max_tokens 100) exceeds the KV cache of the decode "
            "nodes: at most 256 tokens (decode.kv_cache_bytes)",
        ),
    ],
    ids=["prompt-over-prefill", "prompt-and-output-over-decode"],
)
def test_a_request_over_a_cache_is_refused_with_the_limit(
    cluster: LocalLauncher, prompt_len: int, max_tokens: int, message: str
) -> None:
    r = _complete(cluster.url, prompt_len, max_tokens)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith(message)


def test_a_request_that_fits_is_served(cluster: LocalLauncher) -> None:
    r = _complete(cluster.url, 200, 56)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 56
