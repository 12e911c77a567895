"""The OpenAI-compatible HTTP app: routes, API keys, and errors as OpenAI bodies.

    app = create_app(backend, api_keys=["sk-1"], status_fn=master.status,
                     metrics_registry=registry, stats=stats)

Routes: POST /v1/completions and /v1/chat/completions (`serving.generate`), GET /v1/models
(and /v1/models/{id}), GET /v1/status (the `Status` snapshot, when `status_fn` is given),
GET /metrics (when `metrics_registry` is given and `serve_metrics`), GET /health and GET
/openapi.json (the OpenAPI 3.1 document of these routes, `openapi.py`). With API keys every
route but /health and /openapi.json needs `Authorization: Bearer KEY` (/metrics too:
Prometheus sends one with `authorization: {credentials: KEY}` in its scrape config).

Errors are `{"error": {"message", "type", "param", "code"}}`: InvalidRequest -> its
status (400, 401, 404, 413); other ApiError -> 400; Rejected -> 429 with Retry-After (whole
seconds, >= 1); other MooncakeError -> 503; anything else -> 500 (logged). A bad request
never stops the server.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence

from fastapi import Depends, FastAPI
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from mooncake import __version__
from mooncake.api.backend import BaseBackend, Rejected
from mooncake.api.bodies import error_body
from mooncake.api.openapi import openapi_document
from mooncake.api.schemas import InvalidRequest
from mooncake.api.serving import ServingContext, generate, json_response
from mooncake.api.stats import RequestStats
from mooncake.api.status import Status, encode_status
from mooncake.errors import ApiError, MooncakeError

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 32 * 1024 * 1024  # a 128k-token id prompt is ~1 MB of JSON


def _key_checker(api_keys: Sequence[str]) -> Callable[[Request], None]:
    keys = [k.encode() for k in api_keys if k]

    def check(request: Request) -> None:
        if not keys:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            raise InvalidRequest(
                "You didn't provide an API key. Send it in an Authorization header "
                "using Bearer auth (Authorization: Bearer YOUR_KEY).",
                status=401,
                code="invalid_api_key",
            )
        token = given.strip().encode()
        # NOTE: compare against every key so that timing does not tell which one matched
        if not any([hmac.compare_digest(token, k) for k in keys]):
            raise InvalidRequest("Incorrect API key provided.", status=401, code="invalid_api_key")

    return check


def _install_error_handlers(app: FastAPI) -> None:
    async def invalid(request: Request, e: Exception) -> Response:
        assert isinstance(e, InvalidRequest)
        log.info("%s %s: %d %s", request.method, request.url.path, e.status, e)
        headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else {}
        if e.status == 413:  # the rest of the body was not read: do not reuse the connection
            headers["Connection"] = "close"
        return json_response(error_body(str(e), param=e.param, code=e.code), e.status, headers)

    async def api_error(request: Request, e: Exception) -> Response:
        log.info("%s %s: 400 %s", request.method, request.url.path, e)
        return json_response(error_body(str(e)), 400)

    async def rejected(request: Request, e: Exception) -> Response:
        assert isinstance(e, Rejected)
        retry_after = max(1, math.ceil(e.retry_after_s))
        log.info("%s %s: 429 %s", request.method, request.url.path, e)
        body = error_body(str(e), "requests", code="rate_limit_exceeded")
        return json_response(body, 429, {"Retry-After": str(retry_after)})

    async def unavailable(request: Request, e: Exception) -> Response:
        log.warning("%s %s: 503 %s", request.method, request.url.path, e)
        return json_response(error_body(str(e), "server_error", code="service_unavailable"), 503)

    async def http_error(request: Request, e: Exception) -> Response:
        assert isinstance(e, HTTPException)
        message = str(e.detail)
        if e.status_code in (404, 405):  # as OpenAI words an unknown route
            message = f"Invalid URL ({request.method} {request.url.path}): {e.detail}"
        body = error_body(message, "invalid_request_error")
        return json_response(body, e.status_code, dict(e.headers or {}))

    async def bug(request: Request, e: Exception) -> Response:
        log.error("%s %s: 500", request.method, request.url.path, exc_info=e)
        return json_response(error_body(f"internal error: {e!r}", "server_error"), 500)

    app.add_exception_handler(InvalidRequest, invalid)
    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(Rejected, rejected)
    app.add_exception_handler(MooncakeError, unavailable)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, bug)


def create_app(
    backend: BaseBackend,
    *,
    api_keys: Sequence[str] = (),
    status_fn: Callable[[], Awaitable[Status]] | None = None,
    metrics_registry: CollectorRegistry | None = None,
    stats: RequestStats | None = None,
    default_max_tokens: int | None = None,
    serve_metrics: bool = True,
) -> FastAPI:
    """The HTTP app over `backend`. Records every generation request in `stats` (a new
    RequestStats if None; also at `app.state.stats`), which counts into Prometheus metrics
    in `metrics_registry` when given; `serve_metrics` serves that registry at /metrics
    (False when it has a port of its own). `default_max_tokens` applies when a request
    names none (None: OpenAI's 16 for completions, the rest of the context for chat)."""
    stats = stats or RequestStats()
    if metrics_registry is not None:
        stats.register_metrics(metrics_registry)
    ctx = ServingContext(backend, stats, default_max_tokens, MAX_BODY_BYTES)
    app = FastAPI(title="mooncake", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.stats = stats
    _install_error_handlers(app)
    auth = [Depends(_key_checker(api_keys))]
    started = int(time.time())

    async def serve(request: Request, is_chat: bool) -> Response:
        try:
            return await generate(ctx, request, is_chat)
        except MooncakeError:
            raise  # to the handlers above
        except Exception as e:  # a bug: answer here, as a re-raise would drop the connection
            log.error("%s %s: 500", request.method, request.url.path, exc_info=e)
            return json_response(error_body(f"internal error: {e!r}", "server_error"), 500)

    @app.post("/v1/completions", dependencies=auth)
    async def completions(request: Request) -> Response:
        return await serve(request, is_chat=False)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(request: Request) -> Response:
        return await serve(request, is_chat=True)

    def model_card() -> dict[str, object]:
        return {
            "id": backend.model_name,
            "object": "model",
            "created": started,
            "owned_by": "mooncake",
            "max_model_len": backend.max_model_len,
            "vocab_size": backend.vocab_size or None,
        }

    @app.get("/v1/models", dependencies=auth)
    async def models() -> Response:
        return json_response({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model_id:path}", dependencies=auth)
    async def model(model_id: str) -> Response:
        if model_id != backend.model_name:
            raise InvalidRequest(
                f"The model `{model_id}` does not exist.",
                "model",
                status=404,
                code="model_not_found",
            )
        return json_response(model_card())

    @app.get("/v1/status", dependencies=auth)
    async def status() -> Response:
        if status_fn is None:
            raise InvalidRequest("this server has no status feed", status=404)
        return Response(encode_status(await status_fn()), media_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        try:
            return json_response(await backend.health())
        except MooncakeError as e:
            log.warning("health check failed: %s", e)
            return json_response({"status": "error", "error": str(e)}, 503)

    if metrics_registry is not None and serve_metrics:
        registry = metrics_registry

        @app.get("/metrics", dependencies=auth)
        async def metrics(request: Request) -> Response:
            encode, content_type = choose_encoder(request.headers.get("accept", ""))
            # NOTE: collectors may take their service's threading lock: off the event loop
            body = await asyncio.to_thread(encode, registry)
            return Response(body, headers={"Content-Type": content_type})

    document = openapi_document(
        title="mooncake",
        version=__version__,
        has_keys=any(api_keys),
        has_status=status_fn is not None,
        has_metrics=metrics_registry is not None and serve_metrics,
    )

    @app.get("/openapi.json")
    async def openapi() -> Response:
        return json_response(document)

    return app
