"""Failures with real processes: a node killed (SIGKILL) under load. Two single-stage
prefill groups and two decode nodes, so the cluster can route around each loss."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from mooncake.local.launcher import LocalLauncher
from tests.roles.cluster import kill, local_cluster, node_row

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, cost_cache: Path) -> Iterator[LocalLauncher]:
    # NOTE: admission off: these tests are about failures, not overload
    with local_cluster(
        tmp_path_factory.mktemp("failures"),
        cost_cache,
        num_prefill=2,
        group_size=1,
        num_decode=2,
        extra={"scheduler.rejection": "none"},
    ) as launcher:
        yield launcher


def _post(url: str, prompt: list[int], max_tokens: int = 6, **extra: object) -> httpx.Response:
    body = {
        "model": "dummy:tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }
    return httpx.post(url + "/v1/completions", json=body, timeout=90)


def _prompt(seed: int, n: int = 600) -> list[int]:
    return [(i * seed + 3) % 250 + 1 for i in range(n)]


def test_store_node_killed_only_costs_cache_misses(cluster: LocalLauncher) -> None:
    for i in range(3):
        assert _post(cluster.url, _prompt(7 + i)).status_code == 200
    kill(cluster, "store-0")
    results = [_post(cluster.url, _prompt(7 + i)).status_code for i in range(3)]
    assert results == [200, 200, 200]


def test_prefill_node_killed_with_queued_requests(cluster: LocalLauncher) -> None:
    """Requests queued (or prefilling, their KV streaming) on a prefill node that dies are
    placed again on the other group and complete; no decode node keeps their blocks."""
    codes: list[int] = []

    def run(seed: int) -> None:
        codes.append(_post(cluster.url, _prompt(seed)).status_code)

    threads = [threading.Thread(target=run, args=(s,)) for s in range(20, 28)]
    for t in threads:
        t.start()
    time.sleep(0.3)  # NOTE: not a readiness wait: the requests must be in flight when it dies
    kill(cluster, "prefill-0")
    for t in threads:
        t.join()
    assert codes == [200] * 8
    assert node_row(cluster.url, "prefill-0")["state"] == "down"
    # NOTE: prompts it was streaming left blocks reserved on the decode nodes: the
    # re-placement gives them back (not the decode node's reserve_ttl_s of 120 s)
    deadline = time.monotonic() + 20
    while any(node_row(cluster.url, d).get("num_reserved") for d in ("decode-0", "decode-1")):
        assert time.monotonic() < deadline, "reservations of the dead node's prompts are held"
        time.sleep(0.2)


def _assert_same_greedy(got: dict, want: dict) -> None:
    """The same greedy tokens, except where the model was at a tie: a resumed request
    computes its KV again in another order, so a float-level difference may flip a choice
    whose top two logprobs are within 1e-3 (random weights are near-uniform). From the
    first difference on, the texts may part; that difference must be such a tie."""
    a, b = got["token_ids"], want["token_ids"]
    if a == b:
        return
    i = next(k for k, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
    lp_got, lp_want = got["logprobs"]["token_logprobs"][i], want["logprobs"]["token_logprobs"][i]
    assert abs(lp_got - lp_want) < 1e-3, (i, a[i], b[i], lp_got, lp_want)


def test_decode_node_killed_requests_resume_on_another(cluster: LocalLauncher) -> None:
    """Requests decoding on a decode node that dies are placed again: their prompt and the
    tokens already streamed are prefilled again and decoding goes on elsewhere, so every
    one completes with all its tokens, the same greedy text as without the failure."""
    n = 300
    extra = {"logprobs": 1, "return_token_ids": True}
    expected = {
        s: _post(cluster.url, _prompt(s, 100), max_tokens=n, **extra).json() for s in (40, 41)
    }
    replies: dict[int, httpx.Response] = {}

    def run(s: int) -> None:
        replies[s] = _post(cluster.url, _prompt(s, 100), max_tokens=n, **extra)

    threads = [threading.Thread(target=run, args=(s,)) for s in range(40, 46)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while (
        node_row(cluster.url, "decode-0")["num_running"] < 2
    ):  # some are decoding there when it dies
        assert time.monotonic() < deadline, "no request reached decode-0"
        time.sleep(0.05)
    kill(cluster, "decode-0")
    for t in threads:
        t.join()
    for s, r in replies.items():
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == n
        if s in expected:
            _assert_same_greedy(r.json()["choices"][0], expected[s]["choices"][0])
    deadline = time.monotonic() + 30
    while node_row(cluster.url, "decode-0")["state"] != "down" and time.monotonic() < deadline:
        time.sleep(0.2)
    after = [_post(cluster.url, _prompt(50 + i)).status_code for i in range(3)]
    assert after == [200, 200, 200]


def test_master_restart_nodes_re_register_and_serving_resumes(cluster: LocalLauncher) -> None:
    """The master dies and comes back on the same addresses; running nodes register again
    on their own (no restart of theirs) and new requests are served."""
    pids = {c.node_id: c.proc.pid for c in cluster.children if c.role != "master"}
    kill(cluster, "master")
    cluster.relaunch("master")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        nodes = httpx.get(cluster.url + "/v1/status", timeout=10).json()["nodes"]
        ready = {n["node_id"] for n in nodes if n["state"] == "ready"}
        if {"prefill-1", "decode-1"} <= ready:
            break
        time.sleep(0.2)
    assert {"prefill-1", "decode-1"} <= ready
    assert _post(cluster.url, _prompt(77)).status_code == 200
    alive = {c.node_id: c.proc.pid for c in cluster.children if c.role != "master"}
    assert {k: v for k, v in alive.items() if k in ready} == {
        k: v for k, v in pids.items() if k in ready
    }
