"""The OpenAPI 3.1 document the app serves at `GET /openapi.json` (open, like /health).

It describes the routes this app serves, as `create_app` was configured: request bodies
are the JSON Schemas of the msgspec structs the routes parse (`schemas.py`); responses
are the structs below, which spell out the dict bodies `bodies.py` builds (a test decodes
real responses into them, strictly, so they stay true). Streamed responses are
`text/event-stream` (`data: {chunk}` lines, then `data: [DONE]`); every error is an
`ErrorResponse` with its status: 400 bad field, 401 missing or wrong key, 404 unknown
model, 413 body too large, 429 admission refused (with Retry-After), 503 cannot serve now.
With `return_token_ids` (vLLM's extension) responses also carry `prompt_token_ids` and
`token_ids` where vLLM puts them (the optional fields below; `bodies.py` says where in a
stream).

Fields OpenAI documents that we accept only at their neutral value are parsed in their
wide type, so that the refusal can say why, and documented at that value
(`schemas._only`). What a field's schema cannot say is in the request body's
description: a prompt of token ids past the vocabulary, or longer than the context,
`top_logprobs` without `logprobs`, `stream_options` without `stream`, `best_of` below `n`
or streamed above it, `echo` with `logprobs`, a `suffix` for a model without
fill-in-the-middle tokens get a 400; so does a structured-output constraint
(`response_format`, `guided_*`) the grammar engine cannot compile, or more than one.

    curl -s http://127.0.0.1:8000/openapi.json     # e.g. for schemathesis or a client generator
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from mooncake.api.schemas import ChatRequest, CompletionRequest
from mooncake.api.status import Status

FinishReason = Literal["stop", "length"]


class _Shape(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A response body's shape (documentation; `bodies.py` builds the body)."""


class ErrorDetail(_Shape):
    message: str  # what was wrong and what is allowed
    type: str  # invalid_request_error | server_error | requests
    param: str | None  # the request field at fault, if one is
    code: str | int | None  # e.g. invalid_api_key, model_not_found, rate_limit_exceeded


class ErrorResponse(_Shape):
    """Every error: the OpenAI error body."""

    error: ErrorDetail


class KVBlocks(_Shape):
    """mooncake's extension: the full blocks of the prompt a prefill could have reused,
    by cause (the cluster's master only; see the README's "Why a request missed")."""

    requested: int  # = hit + cold + evicted + elsewhere + unverified
    hit: int  # reused
    cold: int  # never stored in the pool (or evicted beyond what the master remembers)
    evicted: int  # stored, then its last copy was dropped before this request
    elsewhere: int  # in the pool, not reused: = priced_out + plan_lost + after_placement
    unverified: int  # found by hash, its token check failed
    priced_out: int  # the placement saw it in the pool and chose to recompute it
    plan_lost: int  # the placement meant to reuse it; lost or not fetched by the start
    after_placement: int  # not in the placement's view of the pool
    evicted_age_p50_s: float  # median age at eviction of its evicted blocks (0: none)


class TokensDetails(_Shape):
    cached_tokens: int  # prompt tokens whose KV was reused
    kv_blocks: KVBlocks | None = None  # absent where the server does not attribute misses


class Usage(_Shape):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: TokensDetails


class CompletionLogprobs(_Shape):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float | None] | None]
    text_offset: list[int]


class CompletionChoice(_Shape):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None  # None in a stream chunk before the last
    prompt_token_ids: list[int] | None = None  # with return_token_ids
    token_ids: list[int] | None = None  # with return_token_ids: the output's


class Completion(_Shape):
    """POST /v1/completions, not streamed (a stream sends these as chunks)."""

    id: str
    object: Literal["text_completion"]
    created: int  # unix seconds
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None


class ChatTopLogprob(_Shape):
    token: str
    logprob: float | None
    bytes: list[int]


class ChatLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(_Shape):
    content: list[ChatLogprob]
    refusal: None


class CalledFunction(_Shape):
    name: str  # one of the request's tools
    arguments: str  # a JSON object as text (cut short with finish_reason "length")


class ToolCall(_Shape):
    id: str  # "call_..."
    type: Literal["function"]
    function: CalledFunction


class AssistantMessage(_Shape):
    role: Literal["assistant"]
    content: str | None  # None: the message is only tool calls
    refusal: None
    tool_calls: list[ToolCall] | None = None  # absent when the model called no tool


class ChatChoice(_Shape):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    # "tool_calls": the model called tools (a named tool_choice ends with "stop")
    finish_reason: Literal["stop", "length", "tool_calls"]
    token_ids: list[int] | None = None  # with return_token_ids: the output's


class ChatCompletion(_Shape):
    """POST /v1/chat/completions, not streamed."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = None  # with return_token_ids


class Model(_Shape):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int  # prompt + output tokens at most
    vocab_size: int | None  # token ids a prompt may use: [0, vocab_size)


class ModelList(_Shape):
    object: Literal["list"]
    data: list[Model]


class Health(msgspec.Struct, kw_only=True):
    """GET /health: "ok" (200) or "error" (503), and what the backend adds."""

    status: Literal["ok", "error"]
    error: str = ""


_BODIES: list[Any] = [
    CompletionRequest,
    ChatRequest,
    Completion,
    ChatCompletion,
    ModelList,
    Model,
    Status,
    Health,
    ErrorResponse,
]


def _json(name: str, description: str) -> dict[str, Any]:
    schema = {"$ref": f"#/components/schemas/{name}"}
    return {"description": description, "content": {"application/json": {"schema": schema}}}


_ERRORS = {
    "400": "A field is wrong; `param` names it.",
    "401": "No API key, or a wrong one.",
    "404": "No such model.",
    "413": "The body is larger than the server takes.",
    "429": "Admission refused the request; retry after Retry-After seconds.",
    "503": "The server cannot serve the request now.",
}


def _errors(*codes: str) -> dict[str, Any]:
    return {c: _json("ErrorResponse", _ERRORS[c]) for c in codes}


def _generation(body: str, response: str, summary: str, auth: tuple[str, ...]) -> dict[str, Any]:
    ok = _json(
        response,
        "The whole response (`stream` false); with `stream` true, one SSE `data:` chunk "
        "per token as OpenAI streams them, then `data: [DONE]`.",
    )
    ok["content"]["text/event-stream"] = {"schema": {"type": "string"}}
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": _json(body, "")["content"]},
            "responses": {"200": ok, **_errors("400", *auth, "404", "413", "429", "503")},
        }
    }


def _get(
    summary: str,
    responses: dict[str, Any],
    *,
    is_open: bool = False,
    parameters: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": summary, "responses": responses}
    if is_open:
        op["security"] = []  # no key needed, even when the API has keys
    if parameters:
        op["parameters"] = parameters
    return {"get": op}


def openapi_document(
    *, title: str, version: str, has_keys: bool, has_status: bool, has_metrics: bool
) -> dict[str, Any]:
    """The document of an app with (or without) API keys, a status feed and /metrics."""
    _, components = msgspec.json.schema_components(
        _BODIES, ref_template="#/components/schemas/{name}"
    )
    auth = ("401",) if has_keys else ()
    model_id = {"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}
    document = {"description": "OpenAPI 3.1", "content": {"application/json": {"schema": {}}}}
    paths: dict[str, Any] = {
        "/v1/completions": _generation(
            "CompletionRequest", "Completion", "Complete a prompt (text or token ids).", auth
        ),
        "/v1/chat/completions": _generation(
            "ChatRequest", "ChatCompletion", "Answer a conversation.", auth
        ),
        "/v1/models": _get(
            "The served model.", {"200": _json("ModelList", "The one model."), **_errors(*auth)}
        ),
        "/v1/models/{model_id}": _get(
            "One model by id.",
            {"200": _json("Model", "The model."), **_errors(*auth, "404")},
            parameters=[model_id],
        ),
        "/health": _get(
            "Whether the backend can serve.",
            {"200": _json("Health", "It can."), "503": _json("Health", "It cannot.")},
            is_open=True,
        ),
        "/openapi.json": _get("This document.", {"200": document}, is_open=True),
    }
    if has_status:
        ok = _json("Status", "Nodes, pool tiers, hit rates, latencies.")
        paths["/v1/status"] = _get("The status snapshot.", {"200": ok, **_errors(*auth)})
    if has_metrics:
        text = {
            "description": "Prometheus text format.",
            "content": {"text/plain": {"schema": {"type": "string"}}},
        }
        paths["/metrics"] = _get("Prometheus metrics.", {"200": text, **_errors(*auth)})
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "paths": paths,
        "components": {"schemas": components},
    }
    if has_keys:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        doc["security"] = [{"bearer": []}]
    return doc
