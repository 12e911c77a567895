"""GET /openapi.json describes the routes the app serves; real responses decode strictly
into the documented shapes; and random JSON (and bytes that are not JSON) posted to every
route never gets a 5xx: a short CI stand-in for schemathesis."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import httpx
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mooncake.api import openapi
from mooncake.api.app import create_app
from mooncake.api.schemas import ChatRequest, CompletionRequest
from mooncake.api.server import ApiServer
from mooncake.api.status import Status
from tests.api.conftest import KEY, MODEL

pytestmark = pytest.mark.timeout(90)
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


@pytest.fixture(scope="module")
def http(served) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=served.url, headers=AUTH, timeout=30) as client:
        yield client


def test_the_document_lists_the_served_routes_and_every_ref_resolves(http):
    doc = http.get("/openapi.json", headers={}).json()  # open, like /health
    assert doc["openapi"] == "3.1.0" and doc["security"] == [{"bearer": []}]
    assert sorted(doc["paths"]) == [
        "/health",
        "/metrics",
        "/openapi.json",
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/models",
        "/v1/models/{model_id}",
        "/v1/status",
    ]
    text = json.dumps(doc)
    refs = {r.split('"')[0] for r in text.split('"$ref": "#/components/schemas/')[1:]}
    assert refs <= set(doc["components"]["schemas"]), refs - set(doc["components"]["schemas"])
    completions = doc["paths"]["/v1/completions"]["post"]
    assert set(completions["responses"]) == {"200", "400", "401", "404", "413", "429", "503"}
    assert "text/event-stream" in completions["responses"]["200"]["content"]
    schema = doc["components"]["schemas"]["CompletionRequest"]
    # what is served, not only parsed
    assert schema["properties"]["n"]["maximum"] == 128
    for path in ("/health", "/openapi.json"):
        assert doc["paths"][path]["get"]["security"] == []


def test_an_app_without_keys_status_or_metrics_documents_none_of_them(served):
    app = create_app(served.engine)
    server = ApiServer(app, "127.0.0.1", 0)
    server.start_in_thread()
    try:
        doc = httpx.get(server.url + "/openapi.json", timeout=10).json()
        assert httpx.get(server.url + "/metrics", timeout=10).status_code == 404
    finally:
        server.stop()
    assert "security" not in doc and "securitySchemes" not in doc["components"]
    assert "/metrics" not in doc["paths"] and "/v1/status" not in doc["paths"]
    responses = doc["paths"]["/v1/completions"]["post"]["responses"]
    assert "401" not in responses


def _strict(data: bytes, shape: type) -> Any:
    return msgspec.json.decode(data, type=shape, strict=True)


def test_real_responses_decode_into_the_documented_shapes(http):
    body = {"model": MODEL, "prompt": "ab", "max_tokens": 3, "logprobs": 2, "ignore_eos": True}
    _strict(http.post("/v1/completions", json=body).content, openapi.Completion)
    chat = {**CHAT, "logprobs": True, "top_logprobs": 2}
    _strict(http.post("/v1/chat/completions", json=chat).content, openapi.ChatCompletion)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    for choice in ("auto", "required", {"type": "function", "function": {"name": "f"}}):
        with_tools = {**CHAT, "tools": [tool], "tool_choice": choice}
        resp = http.post("/v1/chat/completions", json=with_tools)
        _strict(resp.content, openapi.ChatCompletion)
    _strict(http.get("/v1/models").content, openapi.ModelList)
    _strict(http.get(f"/v1/models/{MODEL}").content, openapi.Model)
    _strict(http.get("/v1/status").content, Status)
    _strict(http.get("/health").content, openapi.Health)
    for resp in (http.get("/v1/models/nope"), http.post("/v1/completions", json={"n": 2})):
        _strict(resp.content, openapi.ErrorResponse)
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/completions", json=stream) as resp:
        lines = [x for x in resp.iter_lines() if x.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:  # completions' chunks have the whole response's shape
        _strict(line.removeprefix("data: ").encode(), openapi.Completion)


# -- random input ----------------------------------------------------------------------

_EDGES = [0, -1, 1, 511, 512, 2**31, 2**63, 2**64, -(2**63) - 1, 1e-300, 5e-324, 1e-6, 1e7, 1e308]
_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.sampled_from(_EDGES)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
_JSON = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)
_FIELDS = sorted(
    {f.name for f in msgspec.structs.fields(CompletionRequest)}
    | {f.name for f in msgspec.structs.fields(ChatRequest)}
)
_SMALL = st.integers(-2, 6)  # output lengths that keep an accepted request short
_EDGE = st.sampled_from(_EDGES)
_BODY = st.fixed_dictionaries(
    {"model": st.just(MODEL) | _JSON},
    optional={
        **dict.fromkeys([f for f in _FIELDS if f != "model"], _JSON),
        **dict.fromkeys(["temperature", "top_p", "top_k", "seed", "logprobs"], _EDGE | _JSON),
        "stop_token_ids": st.lists(_EDGE, max_size=3) | _JSON,
        "max_tokens": _SMALL,
        "max_completion_tokens": _SMALL,
        "messages": st.lists(
            st.fixed_dictionaries(
                {"role": st.sampled_from(["user", "system", "bot"])},
                optional={"content": _JSON, "name": _JSON},
            ),
            max_size=2,
        ),
        "prompt": _JSON | st.lists(_EDGE | st.integers(0, 600), min_size=1, max_size=8),
    },
)


def _deep(field: str, depth: int) -> bytes:
    return b'{"%s": ' % field.encode() + b"[" * depth + b"]" * depth + b"}"


def _not_utf8(field: str, junk: bytes) -> bytes:
    return b'{"%s": "%s"}' % (field.encode(), junk)


_RAW = (
    _BODY.map(lambda b: json.dumps(b).encode())
    | _JSON.map(lambda v: json.dumps(v).encode())
    | st.binary(max_size=64)
    | st.builds(
        _deep, st.sampled_from(["prompt", "tools", "stop"]), st.sampled_from([2, 999, 10_000])
    )
    | st.builds(
        _not_utf8, st.sampled_from(["prompt", "model", "user"]), st.binary(min_size=1, max_size=4)
    )
)


@pytest.fixture(scope="module")
def fuzz_url(served) -> Iterator[str]:
    """The test app over the shared engine, with a short default output (a chat request
    without max_tokens would otherwise decode up to the rest of the context)."""
    app = create_app(served.engine, api_keys=[KEY], default_max_tokens=4)
    server = ApiServer(app, "127.0.0.1", 0)
    server.start_in_thread()
    try:
        yield server.url
    finally:
        server.stop()


def _check(resp: httpx.Response) -> None:
    assert resp.status_code < 500, (resp.request.content[:300], resp.text[:500])
    if resp.status_code >= 400:
        _strict(resp.content, openapi.ErrorResponse)


@settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(body=_RAW, is_chat=st.booleans())
def test_random_bodies_never_get_a_server_error(fuzz_url, body, is_chat):
    path = "/v1/chat/completions" if is_chat else "/v1/completions"
    with httpx.Client(base_url=fuzz_url, headers=AUTH, timeout=30) as client:
        resp = client.post(path, content=body, headers={"content-type": "application/json"})
    _check(resp)
    if resp.status_code == 200 and resp.headers["content-type"].startswith("application/json"):
        _strict(resp.content, openapi.ChatCompletion if is_chat else openapi.Completion)
    elif resp.status_code == 200:
        assert resp.text.rstrip().endswith("data: [DONE]"), resp.text[-300:]


@settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(model_id=st.text(max_size=30), key=st.text(max_size=10))
def test_random_paths_and_keys_never_get_a_server_error(fuzz_url, model_id, key):
    headers = {"Authorization": "Bearer k" + quote(key)}
    with httpx.Client(base_url=fuzz_url, timeout=30) as client:
        for path in ("/v1/models/" + quote(model_id, safe=""), "/v1/models", "/health"):
            _check(client.get(path, headers=headers))
