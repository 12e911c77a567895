"""How backend errors reach clients: Rejected -> 429 with Retry-After, ApiError -> 400,
another MooncakeError -> 503, a bug -> 500, an abort mid-stream -> an SSE error event; the
server serves on after each. The backend is a scripted BaseBackend: these are tests of
the API layer's mapping, not of an engine."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import openai
import pytest

from mooncake.api.app import create_app
from mooncake.api.backend import BaseBackend, GenerateRequest, Output, Rejected
from mooncake.api.server import ApiServer
from mooncake.api.stats import RequestStats
from mooncake.errors import ApiError, MooncakeError
from mooncake.model.tokenizer import ByteTokenizer

pytestmark = pytest.mark.timeout(60)
TOKENS = [Output(token_id=104, text="h"), Output(token_id=105, text="i")]


class ScriptedBackend(BaseBackend):
    """Raises `error` on start, else yields `outputs`."""

    model_name = "scripted"
    max_model_len = 64

    def __init__(self) -> None:
        self.tokenizer = ByteTokenizer()
        self.error: BaseException | None = None
        self.outputs: list[Output] = []
        self.health_error: MooncakeError | None = None
        self.requests: list[GenerateRequest] = []

    async def generate(self, req: GenerateRequest) -> AsyncIterator[Output]:
        self.requests.append(req)
        if self.error is not None:
            raise self.error
        for out in self.outputs:
            yield out

    async def health(self) -> dict[str, object]:
        if self.health_error is not None:
            raise self.health_error
        return {"status": "ok"}


@pytest.fixture(scope="module")
def setup():
    backend, stats = ScriptedBackend(), RequestStats()
    server = ApiServer(create_app(backend, stats=stats), "127.0.0.1", 0)
    server.start_in_thread()
    with httpx.Client(base_url=server.url, timeout=30) as http:
        yield backend, stats, http, server.url
    server.stop()


def _post(http: httpx.Client, **body: object) -> httpx.Response:
    return http.post("/v1/completions", json={"model": "scripted", "prompt": "hey", **body})


@pytest.mark.parametrize(("retry_after_s", "header"), [(2.5, "3"), (0.01, "1"), (0.0, "1")])
def test_rejected_is_a_429_with_whole_retry_after_seconds(setup, retry_after_s, header):
    backend, stats, http, _ = setup
    backend.error = Rejected("TTFT SLO would be broken", retry_after_s=retry_after_s)
    before = stats.snapshot().num_rejected
    resp = _post(http, stream=True)
    assert resp.status_code == 429
    assert resp.headers["retry-after"] == header
    assert resp.json()["error"] == {
        "message": "TTFT SLO would be broken",
        "type": "requests",
        "param": None,
        "code": "rate_limit_exceeded",
    }
    assert stats.snapshot().num_rejected == before + 1


def test_the_openai_client_sees_rate_limit_error(setup):
    backend, _, _, url = setup
    backend.error = Rejected("busy", retry_after_s=1)
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.RateLimitError) as e:
        client.completions.create(model="scripted", prompt="x")
    assert e.value.response.headers["retry-after"] == "1"


@pytest.mark.parametrize(
    ("error", "status", "type_"),
    [
        (ApiError("prompt too odd"), 400, "invalid_request_error"),
        (MooncakeError("no decode node is up"), 503, "server_error"),
        (RuntimeError("a bug"), 500, "server_error"),
    ],
)
def test_backend_errors_map_to_status_codes_and_the_server_goes_on(setup, error, status, type_):
    backend, _, http, _ = setup
    backend.error = error
    resp = _post(http)
    assert resp.status_code == status
    assert resp.json()["error"]["type"] == type_
    assert str(error) in resp.json()["error"]["message"]
    backend.error, backend.outputs = (
        None,
        [*TOKENS[:1], Output(token_id=None, text="", finish_reason="stop")],
    )
    assert _post(http).json()["choices"][0]["text"] == "h"


def test_an_abort_mid_stream_ends_with_an_sse_error_and_done(setup):
    backend, stats, http, url = setup
    backend.error = None
    backend.outputs = [
        *TOKENS,
        Output(token_id=None, text="", finish_reason="abort", error="decode node lost"),
    ]
    before = stats.snapshot().num_failed
    body = {"model": "scripted", "prompt": "x", "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as resp:
        events = [line for line in resp.iter_lines() if line]
    assert resp.status_code == 200
    assert len(events) == 4 and events[-1] == "data: [DONE]"
    assert '"error"' in events[2] and "decode node lost" in events[2]
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.APIError, match="decode node lost"):
        list(client.completions.create(model="scripted", prompt="x", stream=True))
    whole = _post(http)  # not streamed: nothing was sent yet, so a plain 503
    assert whole.status_code == 503 and "decode node lost" in whole.json()["error"]["message"]
    assert stats.snapshot().num_failed == before + 3


def test_a_backend_that_ends_without_output_is_a_503(setup):
    backend, _, http, _ = setup
    backend.error, backend.outputs = None, []
    resp = _post(http, stream=True)
    assert resp.status_code == 503
    assert "without any output" in resp.json()["error"]["message"]


def test_the_request_reaches_the_backend_tokenized_with_its_params(setup):
    backend, _, http, _ = setup
    backend.error, backend.outputs = None, [Output(token_id=1, text="", finish_reason="stop")]
    _post(
        http,
        prompt="ab",
        max_tokens=5,
        temperature=0.5,
        top_k=-1,
        stop="zz",
        seed=3,
        stop_token_ids=[9],
        ignore_eos=True,
        user="u1",
    )
    req = backend.requests[-1]
    assert req.req_id.startswith("cmpl-") and req.arrival_s > 0
    assert req.prompt_ids == [256, 97, 98]  # BOS, "a", "b"
    p = req.params
    assert (p.max_tokens, p.temperature, p.top_k, p.stop, p.seed) == (5, 0.5, 0, ("zz",), 3)
    assert (p.stop_token_ids, p.ignore_eos, p.logprobs) == ((9,), True, None)
    neutral = (p.min_p, p.presence_penalty, p.frequency_penalty, p.repetition_penalty)
    assert neutral == (0.0, 0.0, 0.0, 1.0)
    _post(http, prompt="ab")
    assert backend.requests[-1].params.max_tokens == 16  # OpenAI's default for completions
    _post(
        http,
        presence_penalty=-1.5,
        frequency_penalty=0.25,
        min_p=0.05,
        repetition_penalty=1.2,
    )
    p = backend.requests[-1].params
    penalties = (p.min_p, p.presence_penalty, p.frequency_penalty, p.repetition_penalty)
    assert penalties == (0.05, -1.5, 0.25, 1.2)
    http.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": [{"type": "text", "text": "q"}]}]},
    )
    chat = backend.requests[-1]
    assert chat.req_id.startswith("chatcmpl-")
    assert chat.prompt_ids == ByteTokenizer().encode_chat([{"role": "user", "content": "q"}])
    assert chat.params.max_tokens == 64 - len(chat.prompt_ids)  # the rest of the context


def test_health_is_503_with_the_error_and_status_metrics_are_404_when_not_given(setup):
    backend, _, http, _ = setup
    backend.health_error = MooncakeError("master lost its store")
    resp = http.get("/health")
    assert resp.status_code == 503
    assert resp.json() == {"status": "error", "error": "master lost its store"}
    backend.health_error = None
    assert http.get("/health").status_code == 200
    assert http.get("/v1/status").status_code == 404
    assert "no status feed" in http.get("/v1/status").json()["error"]["message"]
    assert http.get("/metrics").status_code == 404
