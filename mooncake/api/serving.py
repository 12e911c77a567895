"""One generation request end to end: parse -> tokenize -> start -> stream or collect.

Tokenizing runs on a worker thread, and a prompt text longer than the context's tokens can
stand for (`BaseTokenizer.max_token_chars` each) is refused before it, so that a huge
prompt holds up neither the event loop nor the streams it serves.

The backend's first output is awaited before any response is started, so a request the
backend refuses (`Rejected`, `ApiError`, another `MooncakeError`) gets a real HTTP status
even when it asked to stream. A streamed response then sends one SSE chunk per output;
when the client goes away the SSE body is closed, which closes the backend's iterator,
which aborts the request. A request still running when a stopping server's drain is over
(`server.CLOSING`) ends with an error: a 503 before its response started, else an error
event and [DONE] in its stream. Every request is traced in `RequestStats`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import anyio
import anyio.abc
import anyio.to_thread
import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from mooncake.api import schemas, tools
from mooncake.api.backend import BaseBackend, GenerateRequest, Output, Rejected
from mooncake.api.bodies import Body, ResponseBuilder, error_body, usage_body
from mooncake.api.schemas import ChatRequest, CompletionRequest, InvalidRequest
from mooncake.api.server import CLOSING
from mooncake.api.stats import Outcome, RequestStats, RequestTrace
from mooncake.api.tools import ToolPlan
from mooncake.conductor.misses import MissCounts
from mooncake.errors import ApiError, ConfigError, MooncakeError
from mooncake.model.fim import FIM_TOKENS, fim_prompt_ids
from mooncake.model.grammar import GrammarError
from mooncake.model.params import Guided

log = logging.getLogger(__name__)
OPENAI_DEFAULT_MAX_TOKENS = 16  # /v1/completions without max_tokens, as OpenAI does
SHUTTING_DOWN = "the server is shutting down: the request was ended before it finished"


class StreamFailed(MooncakeError):
    """The backend ended a request with an error (before anything was sent to the client)."""


@dataclass
class ServingContext:
    backend: BaseBackend
    stats: RequestStats
    default_max_tokens: int | None  # None: 16 for completions, the rest of the context for chat
    max_body_bytes: int


def json_response(body: Body, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(msgspec.json.encode(body), status, headers, media_type="application/json")


def sse(body: Body) -> bytes:
    return b"data: " + msgspec.json.encode(body) + b"\n\n"


DONE = b"data: [DONE]\n\n"  # a stream's last event


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing (413) one larger than `limit` bytes before reading it all."""
    declared = request.headers.get("content-length", "")
    too_big = InvalidRequest(f"the request body exceeds {limit} bytes", status=413)
    if declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


def _prompt_ids(
    ctx: ServingContext, req: CompletionRequest | ChatRequest
) -> tuple[list[int], ToolPlan | None]:
    """The prompt's token ids and a chat's tool plan; a text that cannot fit the context is
    refused before it is tokenized. Called off the event loop: a long prompt takes a while
    to tokenize (and tools' schemas to check)."""
    tokenizer = ctx.backend.tokenizer
    if isinstance(req, ChatRequest):
        template = tokenizer.chat_template
        plan = tools.plan_tools(req, template)
        messages, template_tools = tools.prompt_messages(schemas.chat_messages(req), plan, template)
        text = tokenizer.render_chat(messages, tools=template_tools)
        _check_chars(ctx, text, "messages")
        return tokenizer.encode(text, add_special_tokens=False), plan  # the template wrote them
    prompt = schemas.completion_prompt(req)
    if req.suffix:
        if not isinstance(prompt, str):
            raise InvalidRequest("suffix: needs a text prompt, not token ids", "suffix")
        _check_chars(ctx, prompt + req.suffix, "prompt")
        ids = fim_prompt_ids(tokenizer, prompt, req.suffix)
        if ids is None:
            names = ", ".join("/".join(t) for t in FIM_TOKENS)
            raise InvalidRequest(
                "suffix: this model cannot fill in the middle: its vocabulary has no "
                f"fill-in-the-middle tokens ({names}); send the prompt without a suffix",
                "suffix",
            )
        return ids, None
    if isinstance(prompt, str):
        _check_chars(ctx, prompt, "prompt")
        return tokenizer.encode(prompt), None
    return prompt, None


def _echo_text(ctx: ServingContext, req: CompletionRequest | ChatRequest, ids: list[int]) -> str:
    """What `echo` prepends to each choice: the prompt as sent (its text, or its token
    ids decoded); "" without echo."""
    if not isinstance(req, CompletionRequest) or not req.echo:
        return ""
    prompt = schemas.completion_prompt(req)
    return prompt if isinstance(prompt, str) else ctx.backend.tokenizer.decode(ids)


def _check_chars(ctx: ServingContext, text: str, field: str) -> None:
    """Refuse a text with more characters than the context's tokens can stand for."""
    limit, max_token_chars = ctx.backend.max_model_len, ctx.backend.tokenizer.max_token_chars
    max_chars = limit * max_token_chars
    if max_chars and len(text) > max_chars:
        raise InvalidRequest(
            f"This model's maximum context length is {limit} tokens, but the {field} has "
            f"{len(text)} characters, more than {limit} tokens can hold (at most {max_chars} "
            f"characters: a token of this model stands for at most {max_token_chars}). "
            "Please shorten it.",
            field,
        )


def _check_vocab(ctx: ServingContext, ids: Sequence[int], field: str) -> None:
    """Refuse token ids the model has no embedding for (a node would fail on them)."""
    vocab = ctx.backend.vocab_size
    if vocab and ids and (min(ids) < 0 or max(ids) >= vocab):
        bad = next(t for t in ids if not 0 <= t < vocab)
        raise InvalidRequest(
            f"{field}: token id {bad} is outside the model's vocabulary of {vocab} "
            f"(ids 0 to {vocab - 1})",
            field,
        )


def _max_tokens(ctx: ServingContext, req: CompletionRequest | ChatRequest, prompt_len: int) -> int:
    """The request's max_tokens, checked against the context; raises InvalidRequest.
    Without one, the choices (n, or best_of) share the rest of the context (a KV cache the
    size of the context holds them all), within the server's default."""
    limit = ctx.backend.max_model_len
    field = "messages" if isinstance(req, ChatRequest) else "prompt"
    if prompt_len >= limit:
        raise InvalidRequest(
            f"This model's maximum context length is {limit} tokens, but the {field} has "
            f"{prompt_len} tokens, which leaves no room for output. Please shorten it.",
            field,
        )
    asked, name = schemas.requested_max_tokens(req)
    if asked is None:
        fallback = ctx.default_max_tokens
        if fallback is None and not isinstance(req, ChatRequest):
            fallback = OPENAI_DEFAULT_MAX_TOKENS
        rest = (limit - prompt_len) // schemas.num_candidates(req)
        return max(1, min(fallback or limit, rest))
    if prompt_len + asked > limit:
        raise InvalidRequest(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_len + asked} tokens ({prompt_len} in the {field}, {asked} in the "
            f"completion). Please reduce the {field} or {name}.",
            name,
        )
    return asked


async def _compile_guided(
    ctx: ServingContext, req: CompletionRequest | ChatRequest, guided: Guided
) -> None:
    """Compile the request's constraint (cached, bounded in time) on a worker thread, so
    that one the grammar engine cannot hold the output to is a 400 naming its field, never
    a failure on a node."""
    try:
        await anyio.to_thread.run_sync(lambda: ctx.backend.grammar_engine().compile(guided))
    except (GrammarError, ConfigError) as e:
        found = schemas.guided_constraint(req)  # NOTE: only to name the field
        field = found[1] if found is not None else "tool_choice"
        if isinstance(e, ConfigError):
            raise InvalidRequest(
                f"{field}: structured outputs are not available: {e}", field
            ) from e
        raise InvalidRequest(f"{field}: {e}", field) from e


async def _close(it: AsyncIterator[Output]) -> None:
    aclose = getattr(it, "aclose", None)
    if aclose is not None:
        with anyio.CancelScope(shield=True):
            await aclose()


@contextlib.asynccontextmanager
async def _until_closing(closing: asyncio.Event | None) -> AsyncIterator[None]:
    """Run the block; once `closing` is set, cancel it and raise StreamFailed."""
    if closing is None:
        yield
        return
    with anyio.CancelScope() as scope:
        waiter = asyncio.ensure_future(closing.wait())

        def cancel(_: object) -> None:
            scope.cancel()

        waiter.add_done_callback(cancel)
        try:
            yield
        finally:
            waiter.remove_done_callback(cancel)
            waiter.cancel()
    if scope.cancelled_caught:
        raise StreamFailed(SHUTTING_DOWN)


async def generate(ctx: ServingContext, request: Request, is_chat: bool) -> Response:
    """Serve one POST /v1/completions or /v1/chat/completions."""
    trace = ctx.stats.start()
    closing: asyncio.Event | None = request.scope.get("extensions", {}).get(CLOSING)
    arrival_s = time.time()
    req_id = ("chatcmpl-" if is_chat else "cmpl-") + uuid.uuid4().hex
    it: AsyncIterator[Output] | None = None
    try:
        raw = await read_body(request, ctx.max_body_bytes)
        req: CompletionRequest | ChatRequest = (
            schemas.decode_body(raw, ChatRequest)
            if is_chat
            else schemas.decode_body(raw, CompletionRequest)
        )
        model = ctx.backend.model_name
        if req.model is not None and req.model != model:
            raise InvalidRequest(
                f"The model `{req.model}` does not exist; this server serves `{model}`.",
                "model",
                status=404,
                code="model_not_found",
            )
        prompt_ids, tool_plan = await anyio.to_thread.run_sync(_prompt_ids, ctx, req)
        field = "messages" if is_chat else "prompt"
        if not prompt_ids:
            raise InvalidRequest("the prompt is empty", field)
        max_tokens = _max_tokens(ctx, req, len(prompt_ids))  # NOTE: before reading the ids
        _check_vocab(ctx, prompt_ids, field)
        guided = tool_plan.guided if tool_plan is not None else None
        params = schemas.sampling_params(req, max_tokens, guided)
        _check_vocab(ctx, params.stop_token_ids, "stop_token_ids")
        _check_vocab(ctx, [t for t, _ in params.logit_bias], "logit_bias")
        if params.guided is not None:
            await _compile_guided(ctx, req, params.guided)
        gen = GenerateRequest(
            req_id=req_id, prompt_ids=prompt_ids, params=params, arrival_s=arrival_s
        )
        it = ctx.backend.generate(gen)
        async with _until_closing(closing):
            first = await it.__anext__()
        if first.finish_reason == "abort":
            raise StreamFailed(f"the request was aborted: {first.error or 'no reason given'}")
    except BaseException as e:
        if it is not None:
            await _close(it)
        if isinstance(e, ApiError):  # a bad request: refused, not received
            trace.refuse(e.status if isinstance(e, InvalidRequest) else 400)
        else:
            trace.end(_outcome_of(e))
        if isinstance(e, StopAsyncIteration):
            raise StreamFailed("the backend ended the request without any output") from e
        raise
    if first.token_id is not None:
        trace.token()
    trace.prompt(len(prompt_ids))
    builder = ResponseBuilder(
        req_id,
        model,
        is_chat,
        ctx.backend.tokenizer,
        # NOTE: not params.logprobs: best_of asks for them to rank, not to return
        req.logprobs if isinstance(req, ChatRequest) else req.logprobs is not None,
        prompt_ids=prompt_ids if req.return_token_ids else None,
        tools=tool_plan.new_stream if tool_plan is not None else None,
        echo=_echo_text(ctx, req, prompt_ids),
    )
    usage = _Usage(len(prompt_ids), trace)
    if req.stream:
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        body = _stream(it, first, trace, builder, usage, include_usage, closing, req.n)
        return SSEResponse(body, {"X-Request-Id": req_id}, closing)
    async with _until_closing(closing):
        outs = await _collect(request, it, first, trace, builder, usage)
    if outs is None:
        return Response(status_code=499)  # the client went away: nobody reads it
    return json_response(builder.response(best_choices(outs, req.n), usage.body()))


def best_choices(outs: Sequence[Output], n: int) -> list[list[Output]]:
    """The outputs of each choice returned, in the order returned: all of them when there
    are n, else the n of highest cumulative logprob (best_of, as vLLM ranks sampled
    candidates), best first; a choice whose logprobs are missing ranks last."""
    by_index: dict[int, list[Output]] = {}
    for out in outs:
        by_index.setdefault(out.index, []).append(out)
    choices = [by_index[i] for i in sorted(by_index)]
    if len(choices) <= n:
        return choices

    def score(choice: list[Output]) -> float:
        logprobs = [o.logprob for o in choice if o.token_id is not None]
        return -math.inf if None in logprobs else sum(lp for lp in logprobs if lp is not None)

    return sorted(choices, key=score, reverse=True)[:n]  # NOTE: stable: ties keep index order


def _outcome_of(e: BaseException) -> Outcome:
    if isinstance(e, Rejected):
        return "rejected"
    if isinstance(e, Exception):  # MooncakeError, StopAsyncIteration, a bug
        return "failed"
    return "cancelled"


@dataclass
class _Usage:
    prompt_tokens: int
    trace: RequestTrace
    cached_tokens: int = 0
    kv_blocks: MissCounts | None = None
    completion_tokens: int = 0

    def add(self, out: Output) -> None:
        """Count an output; the one that carries the reuse (backend.Output) sets it."""
        self.completion_tokens += out.token_id is not None
        if out.num_cached_tokens or out.kv_blocks is not None:
            self.cached_tokens, self.kv_blocks = out.num_cached_tokens, out.kv_blocks
            self.trace.cached(out.num_cached_tokens)

    def body(self) -> Body:
        return usage_body(
            self.prompt_tokens, self.completion_tokens, self.cached_tokens, self.kv_blocks
        )


async def _collect(
    request: Request,
    it: AsyncIterator[Output],
    first: Output,
    trace: RequestTrace,
    builder: ResponseBuilder,
    usage: _Usage,
) -> list[Output] | None:
    """Gather the outputs (every choice's, counted in `usage`); None when the client
    disconnected first (the request was aborted)."""
    outs, error, is_gone = [first], "", False

    async def pump() -> None:
        nonlocal error
        try:
            while not outs[-1].ends_request:
                out = await it.__anext__()
                if out.token_id is not None:
                    trace.token()
                outs.append(out)
        except StopAsyncIteration:
            error = "the backend ended the request without a finish reason"
        except MooncakeError as e:
            error = str(e)

    async def watch(tg: anyio.abc.TaskGroup) -> None:
        nonlocal is_gone
        while (await request.receive())["type"] != "http.disconnect":
            pass
        is_gone = True
        tg.cancel_scope.cancel()

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch, tg)
            await pump()
            tg.cancel_scope.cancel()
    finally:
        await _close(it)
        last = outs[-1].finish_reason
        trace.end(
            "cancelled" if is_gone else "completed" if last in ("stop", "length") else "failed"
        )
    if is_gone:
        log.info("%s: the client went away; request aborted", builder.req_id)
        return None
    if outs[-1].finish_reason == "abort":
        error = f"the request was aborted: {outs[-1].error or 'no reason given'}"
    if error:
        raise StreamFailed(error)
    for out in outs:
        usage.add(out)
    return outs


async def _stream(
    it: AsyncIterator[Output],
    first: Output,
    trace: RequestTrace,
    builder: ResponseBuilder,
    usage: _Usage,
    include_usage: bool,
    closing: asyncio.Event | None,
    n: int = 1,
) -> AsyncIterator[bytes]:
    outcome: Outcome = "cancelled"  # unless the stream reaches its end
    try:
        if builder.is_chat:
            for index in range(n):
                yield sse(builder.role_chunk(include_usage, index))
        out = first
        while True:
            if out.finish_reason == "abort":
                outcome = "failed"
                message = f"the request was aborted: {out.error or 'no reason given'}"
                log.warning("%s: %s", builder.req_id, message)
                yield sse(error_body(message, "server_error", code=503))
                break
            usage.add(out)
            yield sse(builder.chunk(out, include_usage))
            if out.ends_request:
                outcome = "completed"
                if include_usage:
                    yield sse(builder.usage_chunk(usage.body()))
                break
            try:
                out = await it.__anext__()
            except (StopAsyncIteration, MooncakeError) as e:
                outcome = "failed"
                message = str(e) or "the backend ended the request without a finish reason"
                log.warning("%s: %s", builder.req_id, message)
                yield sse(error_body(message, "server_error", code=503))
                break
            if out.token_id is not None:
                trace.token()
        yield DONE
    finally:
        await _close(it)
        is_cut = outcome == "cancelled" and closing is not None and closing.is_set()
        trace.end("failed" if is_cut else outcome)  # NOTE: SSEResponse cut it


class SSEResponse(StreamingResponse):
    """A text/event-stream whose body (and so the backend request) is closed as soon as the
    client disconnects, whatever the server's ASGI version, or once `closing` is set (a
    stopping server's drain is over): then the stream ends with an error event and [DONE]."""

    media_type = "text/event-stream"

    def __init__(
        self, content: AsyncIterator[bytes], headers: dict[str, str], closing: asyncio.Event | None
    ):
        super().__init__(
            content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers}
        )
        self.closing = closing

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = self.body_iterator
        assert isinstance(body, AsyncIterator), "SSEResponse streams an async generator"
        is_started = is_ended = False  # NOTE: uvicorn writes a message before send() awaits

        async def send_and_note(message: Message) -> None:
            nonlocal is_started, is_ended
            is_started = True
            is_ended = message["type"] == "http.response.body" and not message.get("more_body")
            await send(message)

        is_cut = False
        try:
            async with _until_closing(self.closing), anyio.create_task_group() as tg:

                async def watch() -> None:
                    await self.listen_for_disconnect(receive)
                    tg.cancel_scope.cancel()

                tg.start_soon(watch)
                # the client is gone: ASGI >= 2.4 servers raise OSError on send
                with contextlib.suppress(OSError):
                    await self.stream_response(send_and_note)
                tg.cancel_scope.cancel()
        except StreamFailed:
            is_cut = not is_ended
        finally:
            aclose = getattr(body, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()
        if is_cut:
            with contextlib.suppress(OSError):
                await self._end_cut(send, is_started)

    async def _end_cut(self, send: Send, is_started: bool) -> None:
        """End a stream cut by the server's shutdown with an error event and [DONE]."""
        log.warning("%s: %s", self.headers.get("x-request-id", "a stream"), SHUTTING_DOWN)
        if not is_started:
            await send(
                {
                    "type": "http.response.start",
                    "status": self.status_code,
                    "headers": self.raw_headers,
                }
            )
        end = sse(error_body(SHUTTING_DOWN, "server_error", code=503)) + DONE
        await send({"type": "http.response.body", "body": end, "more_body": False})
