"""The HTTP side of a replay: ask an OpenAI-compatible server what it serves, and send one
streaming `/v1/completions` request while timing its token chunks.

Works against any server that speaks the OpenAI completions API with SSE streaming (ours,
vLLM, SGLang). A chunk carries a token when its choice has text or is not the last one; a
final chunk with only a finish_reason (and the usage chunk) carries none, unless the usage
counts more output tokens than chunks were seen (vLLM sends a byte-level token that is not
whole UTF-8 yet as empty text, in the last chunk too). Output tokens
and cached prompt tokens come from the `usage` the server sends when asked with
`stream_options.include_usage`; without it, output tokens are the token chunks counted.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any
from urllib.parse import urlsplit

import httpx
import msgspec

from mooncake.errors import MooncakeError
from mooncake.replay.report import KV_BLOCK_KEYS, RequestRecord

DEFAULT_VOCAB_SIZE = 32000  # when the server does not say (LLaMA 2's vocabulary)


class ReplayError(MooncakeError):
    """The server cannot be reached, or answers in a way a replay cannot use."""


class ServerInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What `GET /v1/models` told us about the model to replay against."""

    model: str
    vocab_size: int | None = None  # when the server lists it
    max_model_len: int | None = None  # prompt + output tokens at most, when listed


def normalize_url(url: str) -> str:
    """`http://host:port` from `url` (a trailing `/` or `/v1` is dropped)."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ReplayError(f"--url: expected http://HOST:PORT or https://HOST:PORT, got {url!r}")
    path = parts.path.rstrip("/")
    path = path[: -len("/v1")] if path.endswith("/v1") else path
    return f"{parts.scheme}://{parts.netloc}{path}"


def describe_http_error(e: httpx.HTTPError) -> str:
    """One line for a transport failure (connection refused, timeout, broken stream)."""
    if isinstance(e, httpx.ConnectError):
        return f"cannot connect: {_root_os_error(e) or e}"
    if isinstance(e, httpx.TimeoutException):
        return f"timed out ({type(e).__name__})"
    return f"{type(e).__name__}: {e}"


def _root_os_error(e: BaseException) -> str:
    """`strerror` of the deepest OSError with an errno under `e` ("Connection refused")."""
    found, cause = "", e.__cause__ or e.__context__
    while cause is not None:
        if isinstance(cause, OSError) and cause.errno is not None:
            found = os.strerror(cause.errno)
        cause = cause.__cause__ or cause.__context__
    return found


def _message(body: bytes) -> str:
    """The `error.message` (or `detail`) of an error body, else its first 200 bytes."""
    try:
        obj = json.loads(body)
    except ValueError:
        obj = None
    err = obj.get("error", obj) if isinstance(obj, dict) else obj
    if isinstance(err, dict):
        err = err.get("message") or err.get("detail")
    return str(err) if err else body[:200].decode(errors="replace").strip()


def _error_message(status: int, body: bytes) -> str:
    return f"HTTP {status}: {_message(body)}"


def _error_type(body: bytes) -> str:
    """The OpenAI `error.type` of an error body, "" when it has none."""
    try:
        obj = json.loads(body)
    except ValueError:
        return ""
    err = obj.get("error") if isinstance(obj, dict) else None
    return str(err.get("type") or "") if isinstance(err, dict) else ""


def _transport_kind(e: httpx.HTTPError) -> str:
    if isinstance(e, httpx.ConnectError):
        return "connect"
    if isinstance(e, httpx.TimeoutException):
        return "timeout"
    return "disconnected"


async def probe_server(client: httpx.AsyncClient, url: str, model: str = "") -> ServerInfo:
    """The model to use (`model`, or the first one listed) and what the server says of it.

    Raises ReplayError when the server cannot be reached or lists no models."""
    try:
        resp = await client.get("/v1/models")
    except httpx.HTTPError as e:
        raise ReplayError(
            f"cannot reach {url}/v1/models ({describe_http_error(e)}); is the server running? "
            "Pass --url of an OpenAI-compatible server"
        ) from e
    if resp.status_code != 200:
        raise ReplayError(
            f"{url}/v1/models answered {_error_message(resp.status_code, resp.content)}"
        )
    try:
        cards = [c for c in resp.json().get("data", []) if isinstance(c, dict) and c.get("id")]
    except (ValueError, AttributeError) as e:
        raise ReplayError(f"{url}/v1/models did not answer an OpenAI model list: {e}") from e
    if not cards:
        raise ReplayError(f"{url}/v1/models lists no model; pass --model NAME")
    card = next((c for c in cards if c["id"] == model), None) if model else cards[0]
    if card is None:
        listed = ", ".join(str(c["id"]) for c in cards)
        raise ReplayError(f"--model {model!r} is not served at {url}; it serves: {listed}")
    vocab, max_len = card.get("vocab_size"), card.get("max_model_len")
    return ServerInfo(
        model=str(card["id"]),
        vocab_size=vocab if isinstance(vocab, int) and vocab > 0 else None,
        max_model_len=max_len if isinstance(max_len, int) and max_len > 0 else None,
    )


def _has_token(choice: dict[str, Any]) -> bool:
    return bool(choice.get("text")) or choice.get("finish_reason") is None


async def send_completion(
    client: httpx.AsyncClient, body: dict[str, Any], index: int, t0: float
) -> RequestRecord:
    """Send one streaming completion and time it; every failure becomes a record status."""
    send = time.perf_counter()
    rec = RequestRecord(index=index, status="error", send_s=send - t0, end_s=send - t0)
    rec.expected_output_tokens = int(body["max_tokens"])
    chunk_times: list[float] = []
    finish, usage, is_done = None, None, False
    finish_at: float | None = None  # when a last chunk with no text came
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                rec.status = "rejected" if resp.status_code == 429 else "error"
                payload = await resp.aread()
                rec.error = _error_message(resp.status_code, payload)
                rec.error_kind = f"http {resp.status_code} {_error_type(payload)}".rstrip()
                return _ended(rec, t0)
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, comments, event names
                data = line[5:].strip()
                if data == "[DONE]":
                    is_done = True
                    break
                obj = json.loads(data)
                if "error" in obj:
                    rec.error = f"stream error: {_message(data.encode())}"
                    rec.error_kind = f"stream {_error_type(data.encode())}".rstrip()
                    return _ended(rec, t0)
                usage = obj.get("usage") or usage
                for choice in obj.get("choices") or ():
                    if _has_token(choice):
                        chunk_times.append(time.perf_counter())
                    elif choice.get("finish_reason"):
                        finish_at = time.perf_counter()
                    finish = choice.get("finish_reason") or finish
    except httpx.HTTPError as e:
        rec.error = describe_http_error(e)
        rec.error_kind = _transport_kind(e)
        return _ended(rec, t0)
    except (ValueError, TypeError, AttributeError) as e:  # not JSON, or not OpenAI's shape
        rec.error = f"bad stream data from the server: {e}"
        rec.error_kind = "bad data"
        return _ended(rec, t0)
    told = int((usage or {}).get("completion_tokens") or 0)
    if finish_at is not None and told > len(chunk_times):
        # NOTE: the last chunk carried a token whose text is empty (a byte-level token
        # that is not whole UTF-8 yet, as vLLM streams it): usage says it was one
        chunk_times.append(finish_at)
    if chunk_times:
        rec.ttft_s = chunk_times[0] - send
        rec.gaps_s = [b - a for a, b in zip(chunk_times, chunk_times[1:], strict=False)]
    rec.output_tokens = len(chunk_times)
    rec.prompt_tokens = _prompt_len(body["prompt"])
    if usage:
        rec.output_tokens = int(usage.get("completion_tokens") or rec.output_tokens)
        rec.prompt_tokens = int(usage.get("prompt_tokens") or rec.prompt_tokens)
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            rec.cached_tokens = int(details["cached_tokens"])
        if isinstance(blocks := details.get("kv_blocks"), dict):  # mooncake's extension
            rec.kv_blocks = {k: int(v) for k, v in blocks.items() if k in KV_BLOCK_KEYS}
    if not chunk_times or finish == "abort" or (finish is None and not is_done):
        rec.error = f"stream ended early ({len(chunk_times)} token chunks, finish_reason {finish})"
        rec.error_kind = "ended early"
    else:
        rec.status = "ok"
    return _ended(rec, t0)


def _prompt_len(prompt: str | list[int]) -> int:
    return len(prompt) if isinstance(prompt, list) else len(prompt.split())


def _ended(rec: RequestRecord, t0: float) -> RequestRecord:
    rec.end_s = time.perf_counter() - t0
    return rec
