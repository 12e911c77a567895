"""The whole design on one machine: `mooncake up --local`'s cluster (master, a 2-stage
prefill pipeline group, a decode node, a store node; real processes on loopback)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from mooncake.local.launcher import LocalLauncher
from tests.roles.cluster import local_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]
PACE_S = 0.05


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, cost_cache: Path) -> Iterator[LocalLauncher]:
    pace = {"decode.step_interval_s": PACE_S}  # [decode] step_interval_s, half the TBT SLO
    with local_cluster(tmp_path_factory.mktemp("local"), cost_cache, extra=pace) as launcher:
        yield launcher


def _complete(url: str, prompt: list[int] | str, max_tokens: int = 8) -> dict:
    body = {
        "model": "dummy:tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _engine_alone(prompt: list[int], max_tokens: int) -> str:
    """Greedy text of the same model run by one in-process DecodeRunner."""
    return "".join(e.text for e in _engine_events(prompt, max_tokens))


def _engine_events(prompt: list[int], max_tokens: int) -> list:
    """Greedy token events of the same model run by one in-process DecodeRunner."""
    from mooncake.model.decode import DecodeRunner
    from mooncake.model.info import load_model_info
    from mooncake.model.kvcache import PagedKVCache
    from mooncake.model.params import SamplingParams
    from mooncake.model.sequence import Sequence
    from mooncake.model.tokenizer import ByteTokenizer
    from mooncake.model.weights import create_model

    torch.set_num_threads(1)
    info = load_model_info("dummy:tiny")
    model = create_model(info, "float32", "cpu")
    runner = DecodeRunner(model, PagedKVCache.for_model(model, 64, 32), chunk_tokens=256)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    runner.add(Sequence(1, prompt, params, tokenizer=ByteTokenizer()))
    return runner.run_until_done()[1]


def test_greedy_tokens_equal_the_engine_alone(cluster: LocalLauncher) -> None:
    """Prefill on two pipeline stages, KV handed to the decode node, tokens streamed back
    through the master: the same greedy text the engine produces in one process."""
    prompt = [(i * 37 + 11) % 250 + 1 for i in range(150)]
    got = _complete(cluster.url, prompt, max_tokens=12)
    assert got["choices"][0]["text"] == _engine_alone(prompt, 12)
    assert got["usage"]["completion_tokens"] == 12


@pytest.mark.parametrize("n", [1, 5])
def test_a_prompt_shorter_than_one_block_equals_the_engine_alone(
    cluster: LocalLauncher, n: int
) -> None:
    """No full block to store, a partial block (or nothing) to stream to the decode node."""
    prompt = [(i * 53 + 7) % 250 + 1 for i in range(n)]
    assert _complete(cluster.url, prompt, max_tokens=6)["choices"][0]["text"] == _engine_alone(
        prompt, 6
    )


def test_concurrent_requests_in_one_group_equal_one_at_a_time(cluster: LocalLauncher) -> None:
    """Four prompts at once on the 2-stage group (several in flight, their KV streaming
    from both stages meanwhile): each gets the text it gets alone."""
    import concurrent.futures

    prompts = [[(i * (31 + s) + s) % 250 + 1 for i in range(300 + 40 * s)] for s in range(4)]
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        got = list(ex.map(lambda p: _complete(cluster.url, p, max_tokens=8), prompts))
    for p, g in zip(prompts, got, strict=True):
        assert g["choices"][0]["text"] == _engine_alone(p, 8)


def test_a_shared_prefix_hits_the_pool(cluster: LocalLauncher) -> None:
    """The second request with the first one's long prefix reuses its KV from the pool; the
    hit shows in usage, /metrics and the status feed."""
    base = [(i * 13 + 5) % 250 + 1 for i in range(320)]
    first = _complete(cluster.url, base + [7, 8, 9])
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    import time

    def blocks_hit() -> float:
        metrics = httpx.get(cluster.url + "/metrics", timeout=10).text
        hit = [ln for ln in metrics.splitlines() if ln.startswith("mooncake_prefix_blocks_hit")]
        return float(hit[0].split()[-1]) if hit else 0.0

    deadline = time.monotonic() + 10
    while True:
        # NOTE: the prefill node reads the pool itself; the Conductor's index (which the
        # metric counts at placement) learns of new blocks within a tick
        second = _complete(cluster.url, base + [40, 41, 42, 43])
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        if (cached and blocks_hit() >= 10) or time.monotonic() > deadline:
            break
    assert cached == 320  # ten full 32-token blocks
    assert blocks_hit() >= 10
    status = httpx.get(cluster.url + "/v1/status", timeout=10).json()
    assert status["hit_rate"] > 0
    assert status["pool"] and sum(t["num_objects"] for t in status["pool"]) >= 10


def test_status_finds_the_local_cluster_with_no_arguments(cluster: LocalLauncher) -> None:
    from typer.testing import CliRunner

    from mooncake.cli.app import app, load_verbs

    load_verbs()
    result = CliRunner().invoke(app, ["status", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    roles = sorted(n["role"] for n in data["nodes"])
    assert roles == ["decode", "master", "prefill", "prefill", "store"]
    assert all(n["state"] == "ready" for n in data["nodes"])
    assert {n["pipeline_group"] for n in data["nodes"] if n["role"] == "prefill"} == {"pg1"}
    for key in ("pool", "hit_rate", "ttft_p90_s", "tbt_p90_s", "rejected"):
        assert key in data


def test_the_openai_client_streams_a_chat(cluster: LocalLauncher) -> None:
    import openai

    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused")
    chunks = list(
        client.chat.completions.create(
            model="dummy:tiny",
            messages=[{"role": "user", "content": "hello there"}],
            max_tokens=6,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    whole = client.chat.completions.create(
        model="dummy:tiny",
        messages=[{"role": "user", "content": "hello there"}],
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert finish == ["length"] and whole.usage is not None
    assert whole.usage.completion_tokens == 6
    assert text == whole.choices[0].message.content  # greedy: streamed == not streamed


def test_decode_steps_keep_their_pace(cluster: LocalLauncher) -> None:
    """decode.step_interval_s: a step starts once per interval at most, so 12 tokens (11
    decode steps after the prefill's token) take at least 10 intervals to stream."""
    import time

    import openai

    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused")
    seen: list[float] = []
    for c in client.completions.create(
        model="dummy:tiny",
        prompt=[7] * 40,
        max_tokens=12,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    ):
        if c.choices and c.choices[0].text:
            seen.append(time.monotonic())
    assert seen and seen[-1] - seen[0] >= 10 * PACE_S


def test_the_next_turn_of_a_conversation_reuses_the_decoded_tokens_kv(
    cluster: LocalLauncher,
) -> None:
    """The decode node stores the KV of the output too: a follow-up prompt made of the
    first prompt, its answer and a new message reuses blocks that only decode computed."""
    import time

    prompt = [(i * 29 + 3) % 250 + 1 for i in range(150)]
    answer = [e.token_id for e in _engine_events(prompt, 40)]
    _complete(cluster.url, prompt, max_tokens=40)
    follow_up = prompt + answer + [1, 2, 3]  # 193 tokens; 149 + 40 - 1 = 188 have KV
    deadline = time.monotonic() + 10
    while True:  # the pool's index learns of new blocks within a tick
        got = _complete(cluster.url, follow_up, max_tokens=2)
        cached = got["usage"]["prompt_tokens_details"]["cached_tokens"]
        if cached == 160 or time.monotonic() > deadline:
            break
    assert cached == 160  # blocks 0-3 from prefill, block 4 (tokens 128-159) from decode


def test_a_hot_prefix_held_elsewhere_is_replicated_to_the_prefill_node(
    cluster: LocalLauncher,
) -> None:
    """Algorithm 1 over the global pool: when the prefix the pool holds (here one block
    the prefill node wrote, then answer blocks the decode node stored) beats the prefill
    node's own by more than the balancing threshold, the master has the Store copy the
    missing blocks to the prefill node."""
    import time

    def replications() -> float:
        metrics = httpx.get(cluster.url + "/metrics", timeout=10).text
        line = next(x for x in metrics.splitlines() if x.startswith("mooncake_store_replications"))
        return float(line.split()[-1])

    before = replications()
    prompt = [(i * 37 + 11) % 250 + 1 for i in range(40)]
    answer = [e.token_id for e in _engine_events(prompt, 120)]
    _complete(cluster.url, prompt, max_tokens=120)
    follow_up = prompt + answer + [4, 5, 6]  # 1 block from prefill, 4 more from decode
    deadline = time.monotonic() + 15
    while True:  # the prefix index learns of the decode node's blocks within a tick
        _complete(cluster.url, follow_up, max_tokens=2)
        if replications() > before or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert replications() > before
    # NOTE: the request that caused the copy may have recomputed (Algorithm 1's choice);
    # once the copy lands, the prefix is the prefill node's own
    deadline = time.monotonic() + 15
    while True:
        got = _complete(cluster.url, follow_up, max_tokens=2)
        cached = got["usage"]["prompt_tokens_details"]["cached_tokens"]
        if cached >= 128 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert cached >= 128


def _counter(url: str, name: str) -> float:
    metrics = httpx.get(url + "/metrics", timeout=10).text
    lines = [ln for ln in metrics.splitlines() if ln.startswith(name + " ")]
    return float(lines[0].split()[-1]) if lines else 0.0


def _settled(url: str, name: str) -> float:
    """The counter once no late report moves it (a prefill reports its KV bytes after its
    request may have ended): two reads a second apart agree, 20 s at most."""
    last, deadline = _counter(url, name), time.monotonic() + 20
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = _counter(url, name)
        if now == last:
            break
        last = now
    return last


def test_the_openai_client_gets_n_choices_from_one_prefill(cluster: LocalLauncher) -> None:
    """n=3 through prefill group and decode node: three choices with their indices, a
    seeded request reproduces them, choice i is what seed + i draws alone, and the prompt
    was placed once and its KV written once (as many bytes as a one-choice request's with
    a new prompt as long)."""
    import openai

    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused")
    prompt = [(i * 41 + 19) % 250 + 1 for i in range(70)]  # 2 full blocks and a part
    other = [(i * 43 + 23) % 250 + 1 for i in range(70)]  # new prompts: no block pooled
    kw = {"model": "dummy:tiny", "max_tokens": 6, "temperature": 1.3, "seed": 21}
    kw["extra_body"] = {"ignore_eos": True}
    looked_up = "mooncake_prefix_blocks_looked_up_total"
    # the KV a prefill writes (to the pool and to the decode node): once per placement
    bytes_before = _settled(cluster.url, "mooncake_kv_handoff_bytes_total")
    blocks_before = _counter(cluster.url, looked_up)
    three = client.completions.create(prompt=prompt, n=3, **kw)
    assert _counter(cluster.url, looked_up) - blocks_before == 2  # one placement, 2 blocks
    bytes_three = _settled(cluster.url, "mooncake_kv_handoff_bytes_total")
    client.completions.create(prompt=other, **kw)  # as long, new too, one choice
    bytes_one = _settled(cluster.url, "mooncake_kv_handoff_bytes_total")
    assert bytes_three - bytes_before == bytes_one - bytes_three > 0
    texts = {c.index: c.text for c in three.choices}
    assert sorted(texts) == [0, 1, 2] and len(set(texts.values())) == 3
    assert three.usage is not None and three.usage.completion_tokens == 18
    again = client.completions.create(prompt=prompt, n=3, **kw)
    assert {c.index: c.text for c in again.choices} == texts
    for i in range(3):
        alone = client.completions.create(prompt=prompt, **{**kw, "seed": 21 + i})
        assert alone.choices[0].text == texts[i]
    chunks = list(
        client.chat.completions.create(
            messages=[{"role": "user", "content": "three ways"}], n=3, stream=True, **kw
        )
    )
    streamed: dict[int, str] = {}
    for c in chunks:
        for choice in c.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + (choice.delta.content or "")
    whole = client.chat.completions.create(
        messages=[{"role": "user", "content": "three ways"}], n=3, **kw
    )
    assert streamed == {c.index: c.message.content for c in whole.choices}
