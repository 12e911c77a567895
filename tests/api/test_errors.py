"""Bad requests get OpenAI error bodies that name the field and what is allowed (400),
keys are enforced (401), unknown models and routes are 404, and none of it stops the
server."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.api.conftest import KEY, MODEL

pytestmark = pytest.mark.timeout(60)
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def http(served):
    with httpx.Client(base_url=served.url, headers=AUTH, timeout=30) as client:
        yield client


@pytest.fixture(scope="module")
def anon(served):
    with httpx.Client(base_url=served.url, timeout=30) as client:
        yield client


def _error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"] == "application/json"
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


@pytest.mark.parametrize(
    ("path", "body", "param", "message"),
    [
        (
            "completions",
            {"prompt": "x", "max_tokens": "ten"},
            "max_tokens",
            "Invalid value for 'max_tokens': expected `int | null`, got `str`",
        ),
        ("completions", {"prompt": "x", "max_tokens": 0}, "max_tokens", "expected `int` >= 1"),
        ("completions", {"prompt": "x", "temperature": -1}, "temperature", ">= 0.0"),
        ("completions", {"prompt": "x", "top_p": 0}, "top_p", ">= 1e-05"),
        ("completions", {"prompt": "x", "stop": [1]}, "stop[0]", "expected `str`, got `int`"),
        ("completions", {"prompt": 5}, "prompt", "expected `str | array`, got `int`"),
        ("completions", {"prompt": [1, "a"]}, "prompt", "a list of integer token ids"),
        ("completions", {"prompt": ["a", "b"]}, "prompt", "batches of prompts are not supported"),
        ("completions", {"prompt": []}, "prompt", "must not be empty"),
        ("completions", {"prompt": "x", "n": 200}, "n", "expected `int` <= 128"),
        (
            "completions",
            {"prompt": "x", "echo": True, "logprobs": 0},
            "echo",
            "cannot be combined with logprobs",
        ),
        ("completions", {"prompt": "x", "logprobs": 21}, "logprobs", "<= 20"),
        (
            "completions",
            {"prompt": "x", "logit_bias": {"a": 1}},
            "logit_bias",
            "keys must be token ids written as decimal integers, got 'a'",
        ),
        (
            "completions",
            {"prompt": "x", "logit_bias": {"-3": 1}},
            "logit_bias",
            "keys must be token ids written as decimal integers, got '-3'",
        ),
        (
            "completions",
            {"prompt": "x", "logit_bias": {"7": 1, "007": 2}},
            "logit_bias",
            "a token id is given twice",
        ),
        (
            "chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"512": 5}},
            "logit_bias",
            "token id 512 is outside the model's vocabulary of 512",
        ),
        (
            "completions",
            {"prompt": "x", "logit_bias": {"5": 100.5}},
            "logit_bias[...]",
            "<= 100.0",
        ),
        (
            "completions",
            {"prompt": "x", "max_tokens": 4, "min_tokens": 5},
            "min_tokens",
            "min_tokens must be in [0, max_tokens=4], got 5",
        ),
        ("completions", {"prompt": "x", "min_tokens": -1}, "min_tokens", ">= 0"),
        (
            "completions",
            {"prompt": "x", "max_tokenz": 3},
            "max_tokenz",
            "Unrecognized request argument supplied: max_tokenz",
        ),
        ("completions", {"max_tokens": 3}, "prompt", "'prompt' is a required property"),
        (
            "completions",
            {"prompt": "x", "stream_options": {"include_usage": True}},
            "stream_options",
            "only allowed when stream is true",
        ),
        (
            "completions",
            {"prompt": [1, 2, 700]},
            "prompt",
            "token id 700 is outside the model's vocabulary of 512",
        ),
        (
            "completions",
            {"prompt": [1] * 2000, "max_tokens": 100},
            "max_tokens",
            "maximum context length is 2048 tokens. However, you requested 2100 tokens "
            "(2000 in the prompt, 100 in the completion)",
        ),
        ("completions", {"prompt": [1] * 2048}, "prompt", "the prompt has 2048 tokens"),
        (
            "chat/completions",
            {"messages": [{"role": "bot", "content": "x"}]},
            "messages[0].role",
            "invalid enum value 'bot'",
        ),
        ("chat/completions", {"messages": []}, "messages", "at least one message"),
        (
            "chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
            "top_logprobs",
            "requires logprobs=true",
        ),
        (
            "chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 5000},
            "max_completion_tokens",
            "Please reduce the messages or max_completion_tokens",
        ),
    ],
)
def test_a_bad_field_is_named_in_a_400(http, path, body, param, message):
    error = _error(http.post(f"/v1/{path}", json={"model": MODEL, **body}), 400)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert message in error["message"]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"{bad", "We could not parse the JSON body of your request: JSON is malformed"),
        (b"", "the request body is empty; expected a JSON object"),
        (b"[1, 2]", "the request body must be a JSON object"),
    ],
)
def test_malformed_json_is_a_400_and_the_server_goes_on(http, content, message):
    error = _error(http.post("/v1/completions", content=content), 400)
    assert message in error["message"]
    assert http.get("/health").status_code == 200


def test_unknown_model_is_404_model_not_found_as_openai_says(served):
    client = openai.OpenAI(base_url=served.url + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="x")
    assert e.value.code == "model_not_found" and e.value.param == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_unknown_route_is_a_404_openai_body(http):
    error = _error(http.get("/v1/nothing"), 404)
    assert error["message"].startswith("Invalid URL (GET /v1/nothing)")


@pytest.mark.parametrize("header", [None, "Bearer wrong-key", "Basic " + KEY, "Bearer"])
def test_a_missing_or_wrong_key_is_a_401(anon, header):
    headers = {} if header is None else {"Authorization": header}
    for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models"), ("GET", "/v1/status")):
        resp = anon.request(method, path, headers=headers, json={"model": MODEL, "prompt": "x"})
        error = _error(resp, 401)
        assert error["code"] == "invalid_api_key"
        assert resp.headers["www-authenticate"] == "Bearer"


def test_the_openai_client_with_a_wrong_key_gets_authentication_error(served):
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])


def test_health_and_the_openapi_document_need_no_key_and_metrics_does(anon, http):
    assert anon.get("/health").json()["status"] == "ok"
    assert anon.get("/openapi.json").json()["openapi"] == "3.1.0"
    assert _error(anon.get("/metrics"), 401)["code"] == "invalid_api_key"
    assert http.get("/metrics").status_code == 200


def test_an_oversized_body_is_refused_with_413(http):
    big = b'{"prompt": "' + b"a" * (33 * 1024 * 1024) + b'"}'
    error = _error(http.post("/v1/completions", content=big), 413)
    assert "exceeds 33554432 bytes" in error["message"]
