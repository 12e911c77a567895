"""Structured outputs on `up --local` (random weights), through the official `openai`
client: json_schema answers validate on 20 random schemas, the master having compiled each
before placing it. A guided request whose decode node dies (SIGKILL) mid-output resumes its
grammar on the other decode node: the master sends the output so far as part of the
prompt, with how much of it is output (`num_resumed`), and the new node's matcher replays
it. Real processes on loopback; every request of that test is guided and streamed, so
those on the killed node had output."""

from __future__ import annotations

import json
import random
import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from mooncake.bench.grammar import random_schema
from mooncake.local.launcher import LocalLauncher
from tests.roles.cluster import kill, local_cluster, node_row

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]
N = 240  # output tokens: a regex of exactly N characters
REGEX = f"[a-z]{{{N // 2}}}[0-9]{{{N // 2}}}"  # without the replay, letters would restart
SEEDS = range(60, 66)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, cost_cache: Path) -> Iterator[LocalLauncher]:
    with local_cluster(
        tmp_path_factory.mktemp("guided-resume"),
        cost_cache,
        num_prefill=1,
        group_size=1,
        num_decode=2,
        extra={"scheduler.rejection": "none"},
    ) as launcher:
        yield launcher


def _body(seed: int, stream: bool) -> dict[str, object]:
    return {
        "model": "dummy:tiny",
        "prompt": [(i * seed + 3) % 250 + 1 for i in range(100)],
        "max_tokens": N,
        "temperature": 0,
        "guided_regex": REGEX,
        "stream": stream,
    }


def test_json_schema_answers_validate_on_20_random_schemas(cluster):
    jsonschema = pytest.importorskip("jsonschema")
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="-", max_retries=0, timeout=120)
    rng = random.Random(20)
    schemas = [random_schema(rng) for _ in range(20)]

    def ask(i: int) -> tuple[str | None, str | None]:
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schemas[i]}}
        reply = client.chat.completions.create(
            model="dummy:tiny",
            messages=[{"role": "user", "content": "Some JSON, please."}],
            max_completion_tokens=800,
            seed=i,
            response_format=fmt,  # type: ignore[arg-type]
        )
        return reply.choices[0].message.content, reply.choices[0].finish_reason

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(20)))
    for schema, (content, finish) in zip(schemas, answers, strict=True):
        assert finish == "stop", (schema, content)
        jsonschema.validate(json.loads(content or ""), schema)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="dummy:tiny",
            messages=[{"role": "user", "content": "x"}],
            response_format={  # type: ignore[arg-type, typeddict-item]
                "type": "json_schema",
                "json_schema": {"name": "bad", "schema": {"type": "objec"}},
            },
        )
    assert e.value.body["param"] == "response_format"  # type: ignore[index]


def test_guided_requests_on_a_killed_decode_node_resume_their_grammar(cluster):
    url = cluster.url + "/v1/completions"
    expected = {s: httpx.post(url, json=_body(s, False), timeout=90).json() for s in SEEDS}
    texts: dict[int, list[str]] = {s: [] for s in SEEDS}
    finish: dict[int, str | None] = {}

    def run(seed: int) -> None:
        with httpx.stream("POST", url, json=_body(seed, True), timeout=90) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    texts[seed].append(choice["text"])
                    finish[seed] = choice["finish_reason"] or finish.get(seed)

    threads = [threading.Thread(target=run, args=(s,)) for s in SEEDS]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    # every request decoding with some output streamed, some of them on decode-0
    while (
        min(len(t) for t in texts.values()) < 20
        or node_row(cluster.url, "decode-0")["num_running"] < 1
    ):
        assert time.monotonic() < deadline, "the requests did not reach decode-0"
        time.sleep(0.02)
    assert max(len(t) for t in texts.values()) < N, "a request ended before the kill"
    kill(cluster, "decode-0")
    for t in threads:
        t.join()
    for s in SEEDS:
        text = "".join(texts[s])
        assert finish[s] == "stop", (s, text)
        assert re.fullmatch(REGEX, text), (s, text)
        assert text == expected[s]["choices"][0]["text"]
