"""Input that once crashed a step or answered 500 is a 400 naming the field, and the
server serves the next request: sampling values the sampler cannot compute with, nesting
deeper than a prompt has, bodies that are not UTF-8, token ids past the vocabulary or
past what the wire carries, stop strings past their bounds in number and size."""

from __future__ import annotations

import threading

import httpx
import pytest

from mooncake.model.params import MAX_STOP_BYTES, MAX_STOP_CHARS, MAX_STOPS
from tests.api.conftest import KEY, MODEL

pytestmark = pytest.mark.timeout(60)
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
DEEP = 10_000


@pytest.fixture(scope="module")
def http(served):
    with httpx.Client(base_url=served.url, headers=AUTH, timeout=30) as client:
        yield client


def _refused(resp: httpx.Response, param: str | None, message: str) -> None:
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param), error
    assert message in error["message"], error


def _still_serves(http: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": "a", "max_tokens": 4, "temperature": 0.5, "seed": 1}
    resp = http.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize(
    ("path", "body", "param", "message"),
    [
        (
            "completions",
            {"prompt": "a", "max_tokens": 4, "temperature": 1e-300},
            "temperature",
            "temperature must be 0 (greedy) or in [1e-05, 1e+06], got 1e-300",
        ),
        ("chat/completions", {**CHAT, "top_p": 5e-324}, "top_p", "expected `float` >= 1e-05"),
        ("completions", {"prompt": "a", "temperature": 1e7}, "temperature", "<= 1000000.0"),
        ("completions", {"prompt": [-1]}, "prompt[0]", "expected `int` >= 0"),
        ("completions", {"prompt": [2**64]}, "prompt[0]", "expected `int` <= 2147483647"),
        ("completions", {"prompt": [[1, -1]]}, "prompt[0][1]", "expected `int` >= 0"),
        (
            "completions",
            {"prompt": [5, 512]},
            "prompt",
            "token id 512 is outside the model's vocabulary of 512 (ids 0 to 511)",
        ),
        ("completions", {"prompt": "a", "stop_token_ids": [-1]}, "stop_token_ids[0]", ">= 0"),
        (
            "completions",
            {"prompt": "a", "stop_token_ids": [2**64]},
            "stop_token_ids[0]",
            "<= 2147483647",
        ),
        (
            "chat/completions",
            {**CHAT, "stop_token_ids": [3, 600]},
            "stop_token_ids",
            "token id 600 is outside the model's vocabulary of 512",
        ),
        ("completions", {"prompt": "a", "top_k": 2**64}, "top_k", "<= 2147483647"),
        ("completions", {"prompt": "a", "seed": 2**64}, "seed", "<= 9223372036854775807"),
        # the penalties OpenAI documents, and vLLM's min_p and repetition_penalty
        ("completions", {"prompt": "a", "presence_penalty": 2.5}, "presence_penalty", "<= 2.0"),
        ("chat/completions", {**CHAT, "frequency_penalty": -3}, "frequency_penalty", ">= -2.0"),
        ("completions", {"prompt": "a", "min_p": 1.5}, "min_p", "<= 1"),
        ("chat/completions", {**CHAT, "min_p": -0.1}, "min_p", ">= 0"),
        ("completions", {"prompt": "a", "repetition_penalty": 0}, "repetition_penalty", "> 0"),
        ("completions", {"prompt": "a", "repetition_penalty": 3}, "repetition_penalty", "<= 2.0"),
        ("completions", {"prompt": "a", "presence_penalty": "x"}, "presence_penalty", "got `str`"),
        # the 2.3 MB body, which held a decode step 220 ms per token
        (
            "completions",
            {"prompt": "a", "stop": [f"s{i}" for i in range(200_000)]},
            "stop",
            f"stop must be at most {MAX_STOPS} strings, got 200000",
        ),
        (
            "chat/completions",
            {**CHAT, "stop": "x" * (MAX_STOP_CHARS + 1)},
            "stop",
            f"stop must be strings of 1 to {MAX_STOP_CHARS} characters, got 1025 characters",
        ),
        (
            "completions",
            {"prompt": "a", "stop": ["é" * MAX_STOP_CHARS] * 9},
            "stop",
            f"stop must be at most {MAX_STOP_BYTES} bytes of UTF-8 together, got 18432",
        ),
    ],
)
def test_values_past_what_the_model_or_sampler_can_take_are_named(http, path, body, param, message):
    _refused(http.post(f"/v1/{path}", json={"model": MODEL, **body}), param, message)
    _still_serves(http)


@pytest.mark.parametrize(
    ("path", "head", "tail", "param", "message"),
    [
        ("completions", b'{"prompt": ', b"}", "prompt[0][0]", "expected `int`, got `array`"),
        (
            "chat/completions",
            b'{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", '
            b'"function": {"name": "f", "parameters": {"a": ',
            b"}}}]}",
            "tools",
            "'tools' nests arrays or objects too deeply; at most 100 levels",
        ),
    ],
)
def test_nesting_10000_deep_is_refused_naming_the_field(http, path, head, tail, param, message):
    """A tool's parameters (any JSON) nested past what msgspec decodes is refused."""
    body = head + b"[" * DEEP + b"]" * DEEP + tail
    _refused(http.post(f"/v1/{path}", content=body), param, message)
    _still_serves(http)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("completions", b'{"prompt": "ab\xff", "max_tokens": 2}', "prompt"),
        ("chat/completions", b'{"messages": [{"role": "user", "content": "\xc3("}]}', "messages"),
        ("completions", b'{"prompt": "a", "st\xffop": 1}', None),
        ("completions", b'\xfe\xff{"prompt": "a"}', None),
    ],
)
def test_a_body_that_is_not_utf8_is_refused(http, path, body, param):
    resp = http.post(f"/v1/{path}", content=body, headers={"content-type": "application/json"})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param
    _still_serves(http)


def test_a_batch_of_one_prompt_of_ids_is_still_served(http):
    body = {"model": MODEL, "prompt": [[1, 2, 3]], "max_tokens": 2, "ignore_eos": True}
    resp = http.post("/v1/completions", json=body)
    assert resp.status_code == 200 and resp.json()["usage"]["prompt_tokens"] == 3


@pytest.fixture
def encodes(served, monkeypatch) -> list[str]:
    """The names of the threads the served model's (real) tokenizer encoded on."""
    tokenizer = served.engine.tokenizer
    threads: list[str] = []
    encode = tokenizer.encode

    def counting(text: str, add_special_tokens: bool = True) -> list[int]:
        threads.append(threading.current_thread().name)
        return encode(text, add_special_tokens)

    monkeypatch.setattr(tokenizer, "encode", counting)
    return threads


@pytest.mark.parametrize(
    ("path", "field", "body"),
    [
        ("completions", "prompt", lambda text: {"prompt": text}),
        ("completions", "prompt", lambda text: {"prompt": [text]}),
        (
            "chat/completions",
            "messages",
            lambda text: {
                **CHAT,
                "messages": [
                    {"role": "user", "content": text[: len(text) // 2]},
                    {"role": "user", "content": text[len(text) // 2 :]},
                ],
            },
        ),
    ],
)
def test_a_prompt_too_long_for_the_context_is_refused_before_it_is_tokenized(
    http, served, encodes, path, field, body
):
    """Its characters alone say it cannot fit (the byte tokenizer: a token per byte), so
    the tokenizer is never called; a prompt that fits is tokenized off the event loop."""
    limit = served.engine.max_model_len
    resp = http.post(f"/v1/{path}", json={"model": MODEL, **body("é" * (limit + 1))})
    _refused(resp, field, f"characters, more than {limit} tokens can hold (at most {limit} ")
    assert encodes == []
    _still_serves(http)
    assert encodes and "api-server" not in encodes, encodes  # the server's loop thread


def test_token_ids_past_the_context_are_refused_for_their_number(http, served):
    limit = served.engine.max_model_len
    resp = http.post("/v1/completions", json={"model": MODEL, "prompt": [10**6] * (limit + 1)})
    _refused(resp, "prompt", f"maximum context length is {limit} tokens, but the prompt has")
