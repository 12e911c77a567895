"""A prompt sent again right after its answer ended reuses every full block, and the API
says so; every prefill's blocks are attributed (hit, cold, ...), in the response, in
/metrics and in /v1/status. Real processes on loopback.

The prefill node runs with its pool seal slowed (`StoreKVPool.seal_objects` waits
MOONCAKE_TEST_SEAL_DELAY_S first), as on a loaded host: the seal comes after the hand-off
to decode, so a one-token answer ends well before its blocks are committed. (Before: the
stream ended first, the repeat was placed and prefilled before the commit, recomputed
every block and reported cached_tokens 0; and a fast decode's first token beat the prefill
node's report, so cached_tokens read 0 even when the pool served the prefix.)"""

from __future__ import annotations

import random
import re
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest

from mooncake.api import openapi
from mooncake.local.launcher import LocalLauncher
from tests.roles.cluster import kill, local_cluster, start_node

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

SLOW_SEAL = """
import os, time
from mooncake.kv.pool import StoreKVPool
real = StoreKVPool.seal_objects
def seal_objects(self, *args, **kw):
    time.sleep(float(os.environ["MOONCAKE_TEST_SEAL_DELAY_S"]))
    return real(self, *args, **kw)
StoreKVPool.seal_objects = seal_objects
from mooncake.cli.app import main
main()
"""
PROMPT_LEN, BLOCK = 1500, 32
FULL = (PROMPT_LEN - 2) // BLOCK  # blocks a request can reuse (the last token is computed)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, cost_cache: Path) -> Iterator[LocalLauncher]:
    tmp = tmp_path_factory.mktemp("repeat")
    plan = {"num_prefill": 1, "group_size": 1, "block_tokens": BLOCK}
    with local_cluster(tmp, cost_cache, **plan) as c:
        kill(c, "prefill-0")
        env = {"MOONCAKE_TEST_SEAL_DELAY_S": "1.0"}
        proc = start_node(c, "prefill", "prefill-0", SLOW_SEAL, tmp / "p.log", env)
        try:
            yield c
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _complete(url: str, prompt: list[int]) -> dict:
    """The answer's usage.prompt_tokens_details, its usage checked against the OpenAPI
    document's shape."""
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    msgspec.json.decode(msgspec.json.encode(usage), type=openapi.Usage, strict=True)
    return usage["prompt_tokens_details"]


def _pool_hits(url: str) -> int:
    """Prompt blocks the Conductor found in the pool when it placed requests, so far."""
    return int(httpx.get(url + "/v1/status", timeout=10).json()["pool_hits"])


def test_an_immediate_repeat_reuses_every_full_block(cluster: LocalLauncher) -> None:
    rng = random.Random(7)
    for _ in range(3):
        prompt = [rng.randrange(3, 250) for _ in range(PROMPT_LEN)]
        first = _complete(cluster.url, prompt)
        seen = _pool_hits(cluster.url)
        again = _complete(cluster.url, prompt)
        assert again["cached_tokens"] == FULL * BLOCK, (first, again)
        # the Conductor's index had every block when it placed the repeat (a store event
        # reaches it before the put's reply, not a housekeeping tick later)
        assert _pool_hits(cluster.url) - seen == PROMPT_LEN // BLOCK
        blocks = again["kv_blocks"]
        assert blocks["requested"] == blocks["hit"] == FULL, blocks
        assert first["cached_tokens"] == 0 and first["kv_blocks"]["cold"] == FULL, first


def test_misses_are_counted_in_metrics_and_status(cluster: LocalLauncher) -> None:
    """A fresh prompt's blocks are cold; the counters by cause add up to the blocks the
    prefills could have reused, in /metrics and in /v1/status."""
    prompt = [random.Random(8).randrange(3, 250) for _ in range(PROMPT_LEN)]
    details = _complete(cluster.url, prompt)
    assert details["kv_blocks"]["cold"] == FULL and details["kv_blocks"]["hit"] == 0
    text = httpx.get(cluster.url + "/metrics", timeout=10).text
    causes = {
        m[1]: float(m[2])
        for m in re.finditer(r'^mooncake_kv_blocks_total\{cause="(\w+)"\} (\S+)$', text, re.M)
    }
    assert set(causes) == {"hit", "cold", "evicted", "elsewhere", "unverified"}, text
    assert causes["cold"] >= FULL and causes["hit"] >= 0
    status = httpx.get(cluster.url + "/v1/status", timeout=10).json()["kv_blocks"]
    assert status["blocks"] == sum(causes.values()) and status["requests"] >= 1
    assert sum(status["shares"][c] for c in causes) == pytest.approx(1.0)
