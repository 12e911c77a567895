"""Tensor parallelism in the cluster's roles (real processes on loopback, gloo between
the ranks of an instance): a prefill instance at TP = 2 hands its KV to a decode instance
at TP = 1, one at TP = 1 to a decode instance at TP = 2, and one at TP = 2 to one at
TP = 2, each rank's heads moving between the ranks' own caches; every one gives the
engine-alone greedy tokens, and a prefix stored in the pool at one degree (by a prefill
or a decode instance) is reused at the other (the KV object does not depend on the
degree: kv/heads.py)."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from mooncake.local.launcher import LocalLauncher
from tests.roles.cluster import MAIN, kill, local_cluster, start_node, stop_procs
from tests.roles.test_local_cluster import _engine_events

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]
BLOCK = 32


@pytest.fixture()
def cluster(tmp_path: Path, cost_cache: Path) -> Iterator[LocalLauncher]:
    plan = {"num_prefill": 1, "group_size": 1, "num_decode": 1, "block_tokens": BLOCK}
    with local_cluster(tmp_path, cost_cache, **plan) as c:
        yield c


def _complete(url: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": "dummy:tiny", "prompt": prompt, "max_tokens": max_tokens}
    body |= {"temperature": 0, "ignore_eos": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _tokens(prompt: list[int], max_tokens: int) -> str:
    return "".join(e.text for e in _engine_events(prompt, max_tokens))


def _wait_pool_objects(url: str, n: int, timeout_s: float = 60.0) -> None:
    """Until the pool holds `n` committed objects (a prefill node seals its objects after
    the hand-off: stopped before, they would never be committed)."""
    deadline = time.monotonic() + timeout_s
    while (got := httpx.get(url + "/v1/status", timeout=10).json()["num_pool_objects"]) < n:
        assert time.monotonic() < deadline, f"{got} pool objects of {n} after {timeout_s} s"
        time.sleep(0.2)


def _cached_until(url: str, prompt: list[int], want: int, timeout_s: float = 30.0) -> dict:
    """The answer to `prompt` once `want` tokens of it are cached (a decode node stores its
    output's KV as the request retires: the pool learns of it a moment after the answer)."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = _complete(url, prompt, 4)
        if got["usage"]["prompt_tokens_details"]["cached_tokens"] == want:
            return got
        if time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def _restart(c: LocalLauncher, role: str, node_id: str, tp: int, log: Path) -> subprocess.Popen:
    """Node `node_id` again at `model.tensor_parallel = tp`; a prefill node with no share
    of the pool of its own (the KV objects it writes outlive its restarts)."""
    if any(ch.node_id == node_id and ch.proc.poll() is None for ch in c.children):
        kill(c, node_id)
    sets = (f"model.tensor_parallel={tp}",)
    if role == "prefill":
        sets += ("store.dram_bytes=0", "store.ssd_bytes=0")
    return start_node(c, role, node_id, MAIN, log, {}, sets)


def test_prefill_and_decode_at_different_degrees(cluster: LocalLauncher, tmp_path: Path) -> None:
    c = cluster
    prompt = [(i * 37 + 11) % 250 + 1 for i in range(150)]
    full = (len(prompt) // BLOCK) * BLOCK
    procs = [_restart(c, "prefill", "prefill-0", 2, tmp_path / "p2.log")]
    try:
        got = _complete(c.url, prompt, 12)
        assert got["choices"][0]["text"] == _tokens(prompt, 12), "prefill TP 2 -> decode TP 1"
        _wait_pool_objects(c.url, len(prompt) // BLOCK + 1)  # and the decode node's block 4

        # the prefix stored at TP = 2, reused at TP = 1
        stop_procs(procs)
        procs = [_restart(c, "prefill", "prefill-0", 1, tmp_path / "p1.log")]
        longer = prompt + [5, 6, 7, 8, 9]
        got = _complete(c.url, longer, 12)
        assert got["choices"][0]["text"] == _tokens(longer, 12)
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == full, got["usage"]

        # prefill at TP = 1, decode at TP = 2; the next turn reuses what decode stored
        procs.append(_restart(c, "decode", "decode-0", 2, tmp_path / "d2.log"))
        answer = [e.token_id for e in _engine_events(prompt, 40)]
        got = _complete(c.url, prompt, 40)
        assert got["choices"][0]["text"] == _tokens(prompt, 40), "prefill TP 1 -> decode TP 2"
        follow_up = prompt + answer + [1, 2, 3]
        # blocks 0-3 from prefill, block 4 (tokens 128-159) stored by the decode ranks
        got = _cached_until(c.url, follow_up, 160)
        assert got["choices"][0]["text"] == _tokens(follow_up, 4)
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 160, got["usage"]

        # both at TP = 2: the prefill ranks load those blocks, each its heads
        stop_procs(procs[:1])
        procs[0] = _restart(c, "prefill", "prefill-0", 2, tmp_path / "p2b.log")
        again = follow_up + [4]
        # every full block but the last token's: 0-5 (block 5 from the turn before, or
        # stored by this prefill when that one's seal was cut by the restart)
        got = _cached_until(c.url, again, 192)
        assert got["choices"][0]["text"] == _tokens(again, 4), "prefill TP 2 -> decode TP 2"
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 192, got["usage"]
    finally:
        stop_procs(procs)
