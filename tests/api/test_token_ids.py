"""`return_token_ids` (vLLM's extension, as load generators send it): the prompt's and the
output's token ids, in the fields and places vLLM uses, streamed and not, for completions
and chat; documented in /openapi.json; absent unless asked for. The API layer builds them
from the backend's outputs, so the cluster's master serves them the same way."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import msgspec
import pytest

from mooncake.api import openapi
from mooncake.model.params import SamplingParams
from mooncake.model.tokenizer import ByteTokenizer
from tests.api.conftest import KEY, MODEL
from tests.api.reference import engine_alone

pytestmark = pytest.mark.timeout(60)
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = [(17 * i + 3) % 500 for i in range(12)]
MESSAGES = [{"role": "user", "content": "hi there"}]


@pytest.fixture(scope="module")
def http(served) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=served.url, headers=AUTH, timeout=30) as client:
        yield client


def _expected(prompt: list[int]) -> list[int]:
    return engine_alone(prompt, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]


def _chunks(http: httpx.Client, path: str, body: dict) -> list[dict]:
    with http.stream("POST", path, json={**body, "stream": True}) as resp:
        assert resp.status_code == 200, resp.read()
        lines = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_a_completion_returns_its_prompt_and_output_token_ids(http):
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": 5,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    resp = http.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    msgspec.json.decode(resp.content, type=openapi.Completion)  # the documented shape
    choice = resp.json()["choices"][0]
    assert choice["prompt_token_ids"] == PROMPT
    assert choice["token_ids"] == _expected(PROMPT)

    chunks = _chunks(http, "/v1/completions", body)
    choices = [c["choices"][0] for c in chunks]
    assert choices[0]["prompt_token_ids"] == PROMPT  # in the first chunk only
    assert all("prompt_token_ids" not in c for c in choices[1:])
    assert [t for c in choices for t in c["token_ids"]] == _expected(PROMPT)


def test_a_chat_completion_returns_them_where_vllm_puts_them(http):
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 5,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    prompt = ByteTokenizer().encode_chat(MESSAGES)
    resp = http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    msgspec.json.decode(resp.content, type=openapi.ChatCompletion)
    whole = resp.json()
    assert whole["prompt_token_ids"] == prompt  # on the response, not the choice
    assert whole["choices"][0]["token_ids"] == _expected(prompt)

    chunks = _chunks(http, "/v1/chat/completions", body)
    assert chunks[0]["prompt_token_ids"] == prompt  # the role chunk
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == _expected(prompt)


def test_without_the_flag_no_token_ids_and_the_flag_is_documented(http):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    assert "token_ids" not in choice and "prompt_token_ids" not in choice
    schemas = http.get("/openapi.json").json()["components"]["schemas"]
    for request in ("CompletionRequest", "ChatRequest"):
        described = schemas[request]["properties"]["return_token_ids"]["description"]
        assert "prompt_token_ids" in described
    assert "token_ids" in schemas["ChatChoice"]["properties"]
    assert "prompt_token_ids" in schemas["ChatCompletion"]["properties"]
