"""Streams over a real socket: a client that disconnects mid-stream aborts its request
(the runner ends with no work and every KV block free), and the server keeps serving."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from tests.api.conftest import KEY, MODEL

pytestmark = pytest.mark.timeout(60)
AUTH = {"Authorization": f"Bearer {KEY}"}
LONG = {
    "model": MODEL,
    "prompt": [5] * 20,
    "max_tokens": 1500,
    "temperature": 0,
    "ignore_eos": True,
    "stream": True,
}


def _wait_until(predicate, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _assert_idle(served) -> None:
    _wait_until(lambda: not served.engine.runner.has_work)
    blocks = served.engine.prefix_cache  # free or cached for reuse, none held
    _wait_until(lambda: blocks.num_free == served.engine.cache.num_blocks)
    blocks.check_integrity()


def test_closing_the_response_mid_stream_aborts_the_request(served):
    before = served.stats.snapshot().num_cancelled
    tokens_before = served.engine.num_generated_tokens
    with (
        httpx.Client(base_url=served.url, headers=AUTH, timeout=30) as http,
        http.stream("POST", "/v1/completions", json=LONG) as resp,
    ):
        lines = (line for line in resp.iter_lines() if line)
        chunks = [json.loads(next(lines).removeprefix("data: ")) for _ in range(3)]
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks)
        assert served.engine.runner.has_work
    # leaving the block closed the connection after 3 of 1500 tokens
    _assert_idle(served)
    _wait_until(lambda: served.stats.snapshot().num_cancelled == before + 1)
    # the engine stopped long before the 1500 tokens asked for
    assert served.engine.num_generated_tokens - tokens_before < 500


def test_a_reset_connection_mid_stream_aborts_the_request_too(served):
    body = json.dumps(LONG).encode()
    host, port = served.url.removeprefix("http://").split(":")
    tokens_before = served.engine.num_generated_tokens
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        got = b""
        while got.count(b"data: ") < 3:
            got += sock.recv(65536)
        assert got.startswith(b"HTTP/1.1 200")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    _assert_idle(served)
    assert served.engine.num_generated_tokens - tokens_before < 500
    with httpx.Client(base_url=served.url, headers=AUTH) as http:  # still serving
        short = {**LONG, "max_tokens": 2, "stream": False}
        assert http.post("/v1/completions", json=short).json()["usage"]["completion_tokens"] == 2


def test_many_concurrent_streams_all_finish_with_their_own_tokens(served):
    """Eight streams batched together each get max_tokens chunks and a [DONE]."""
    import concurrent.futures

    def one(http: httpx.Client, i: int) -> tuple[int, str]:
        body = {**LONG, "prompt": [i + 1] * (3 + i), "max_tokens": 6}
        with http.stream("POST", "/v1/completions", json=body) as resp:
            lines = [ln for ln in resp.iter_lines() if ln]
        return len(lines) - 1, lines[-1]

    limits = httpx.Limits(max_connections=8)
    with (
        httpx.Client(base_url=served.url, headers=AUTH, timeout=30, limits=limits) as http,
        concurrent.futures.ThreadPoolExecutor(8) as pool,
    ):
        results = list(pool.map(lambda i: one(http, i), range(8)))
    assert results == [(6, "data: [DONE]")] * 8
    _assert_idle(served)


def test_a_client_that_gives_up_on_a_non_streamed_request_aborts_it(served):
    before = served.stats.snapshot().num_cancelled
    tokens_before = served.engine.num_generated_tokens
    body = {**LONG, "stream": False}
    with (
        httpx.Client(base_url=served.url, headers=AUTH, timeout=0.5) as http,
        pytest.raises(httpx.ReadTimeout),  # then the client closes the connection
    ):
        http.post("/v1/completions", json=body)
    _assert_idle(served)
    _wait_until(lambda: served.stats.snapshot().num_cancelled == before + 1)
    assert served.engine.num_generated_tokens - tokens_before < 500


def test_closing_a_stream_of_several_choices_aborts_every_choice(served):
    tokens_before = served.engine.num_generated_tokens
    body = {**LONG, "max_tokens": 600, "n": 3}
    with (
        httpx.Client(base_url=served.url, headers=AUTH, timeout=30) as http,
        http.stream("POST", "/v1/completions", json=body) as resp,
    ):
        lines = (line for line in resp.iter_lines() if line)
        chunks = [json.loads(next(lines).removeprefix("data: ")) for _ in range(6)]
        assert {c["choices"][0]["index"] for c in chunks} == {0, 1, 2}
        assert len(served.engine.runner.running) == 3
    _assert_idle(served)  # NOTE: every choice's blocks, the shared ones too
    assert served.engine.num_generated_tokens - tokens_before < 3 * 200
