"""The OpenAI API's choice-shaping fields through the engine backend: `logit_bias`
(OpenAI's) and `min_tokens` (vLLM's) change what the model says as documented."""

from __future__ import annotations

import httpx
import pytest

from tests.api.conftest import KEY, MODEL

pytestmark = pytest.mark.timeout(120)
EOS = 257  # dummy:tiny's byte tokenizer


@pytest.fixture(scope="module")
def http(served):
    with httpx.Client(
        base_url=served.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
    ) as client:
        yield client


def _complete(http, **body) -> dict:
    resp = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", **body})
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_logit_bias_forces_and_bans_tokens(http):
    forced = _complete(http, max_tokens=6, temperature=0, logit_bias={"65": 100})
    assert forced["choices"][0]["text"] == "AAAAAA"
    plain = _complete(http, max_tokens=6, temperature=0, return_token_ids=True)
    first = plain["choices"][0]["token_ids"][0]
    banned = _complete(
        http, max_tokens=6, temperature=0, logit_bias={str(first): -100}, return_token_ids=True
    )
    assert banned["choices"][0]["token_ids"][0] != first


def test_min_tokens_holds_off_eos_then_eos_ends_the_output(http):
    body = {"max_tokens": 20, "temperature": 0, "logit_bias": {str(EOS): 100}}
    assert _complete(http, **body)["usage"]["completion_tokens"] == 1
    out = _complete(http, **body, min_tokens=5)
    assert out["usage"]["completion_tokens"] == 6  # 5 tokens, then EOS
    assert out["choices"][0]["finish_reason"] == "stop"
    assert len(out["choices"][0]["text"]) == 5
    chat = http.post(
        "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "x"}],
            **body,
            "min_tokens": 3,
        },
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["completion_tokens"] == 4
