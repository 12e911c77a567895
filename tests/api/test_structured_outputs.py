"""Structured outputs through the official `openai` client against a real server on random
weights: `response_format` json_schema answers parse and validate on 20 random schemas,
streamed deltas assemble to valid JSON, vLLM's guided_* hold their output, and a
constraint the grammar engine cannot compile (or several of them) is a 400 naming the
field (the API compiles it before the request starts)."""

from __future__ import annotations

import json
import random
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from mooncake.bench.grammar import random_schema
from tests.api.conftest import KEY, MODEL

jsonschema = pytest.importorskip("jsonschema")
pytestmark = pytest.mark.timeout(240)
MESSAGES = [{"role": "user", "content": "Describe a city as JSON."}]


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _schema_format(schema: dict, name: str = "city") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def test_json_schema_answers_parse_and_validate_on_20_random_schemas(client):
    rng = random.Random(38)
    schemas = [random_schema(rng) for _ in range(20)]

    def ask(i: int) -> tuple[str | None, str | None]:
        reply = client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_completion_tokens=800,
            seed=i,
            response_format=_schema_format(schemas[i], f"schema_{i}"),  # type: ignore[arg-type]
        )
        return reply.choices[0].message.content, reply.choices[0].finish_reason

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(20)))
    for schema, (content, finish) in zip(schemas, answers, strict=True):
        assert finish == "stop", (schema, content)
        jsonschema.validate(json.loads(content or ""), schema)


def test_streamed_deltas_assemble_to_json_that_validates(client):
    schema = random_schema(random.Random(7))
    chunks = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_completion_tokens=800,
        seed=3,
        stream=True,
        response_format=_schema_format(schema),  # type: ignore[arg-type]
    )
    parts, finish = [], None
    for c in chunks:
        if c.choices:
            parts.append(c.choices[0].delta.content or "")
            finish = c.choices[0].finish_reason or finish
    assert finish == "stop"
    jsonschema.validate(json.loads("".join(parts)), schema)


@pytest.mark.parametrize(
    "extra, check",
    [
        ({"guided_regex": r"[a-z]{3,6}@[a-z]{2,5}\.com"}, r"[a-z]{3,6}@[a-z]{2,5}\.com"),
        ({"guided_choice": ["sunny", "rainy", "foggy"]}, r"sunny|rainy|foggy"),
        ({"guided_grammar": 'root ::= "(" [0-9]+ ")"'}, r"\([0-9]+\)"),
        ({"guided_json": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}}, None),
        ({"structured_outputs": {"regex": "[0-9]{4}"}}, r"[0-9]{4}"),
        ({"structured_outputs": {"choice": ["up", "down"]}}, r"up|down"),
        (
            {
                "structured_outputs": {
                    "json": '{"type": "array", "items": {"type": "boolean"}, "maxItems": 3}'
                }
            },
            None,
        ),
    ],
)
def test_vllm_guided_fields_hold_completions_and_chat(client, extra, check):
    kw = {"max_tokens": 300, "seed": 5, "extra_body": extra}
    completion = client.completions.create(model=MODEL, prompt="Answer: ", **kw)
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, **kw)
    for text, finish in (
        (completion.choices[0].text, completion.choices[0].finish_reason),
        (chat.choices[0].message.content or "", chat.choices[0].finish_reason),
    ):
        assert finish == "stop", text
        if check is None:
            value = json.loads(text)
            assert isinstance(value, list) and all(isinstance(v, bool) for v in value)
        else:
            assert re.fullmatch(check, text), text


def test_text_format_is_unconstrained(client):
    reply = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_completion_tokens=5,
        temperature=0,
        response_format={"type": "text"},
        extra_body={"ignore_eos": True},
    )
    assert reply.choices[0].finish_reason == "length"


BAD = [
    (
        {"response_format": _schema_format({"type": "objec"})},
        "response_format",
        "objec",
    ),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "json_schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "json_schema"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}},
        "response_format.json_schema.name",
        "",
    ),
    ({"guided_regex": "(ab"}, "guided_regex", "regex"),
    ({"guided_json": "not json"}, "guided_json", "JSON schema"),
    ({"guided_choice": []}, "guided_choice", ""),
    ({"guided_grammar": 'root ::= ("a"'}, "guided_grammar", "grammar"),
    (
        {"guided_regex": "a+", "guided_choice": ["a"]},
        "guided_choice",
        "at most one structured-output constraint",
    ),
    (
        {"response_format": {"type": "json_object"}, "guided_json": {"type": "object"}},
        "guided_json",
        "at most one",
    ),
    (
        {"structured_outputs": {"regex": "a", "choice": ["a"]}},
        "structured_outputs.choice",
        "at most one",
    ),
    ({"structured_outputs": {"json": "[1]"}}, "structured_outputs.json", "JSON schema"),
    ({"structured_outputs": {"grammar": "::="}}, "structured_outputs.grammar", "grammar"),
    (
        {"structured_outputs": {"whitespace_pattern": " "}},
        "structured_outputs.whitespace_pattern",
        "Unrecognized",
    ),
]


@pytest.mark.parametrize("is_chat", [False, True])
@pytest.mark.parametrize("extra, param, message", BAD)
def test_a_bad_or_second_constraint_is_a_400_naming_its_field(
    served, is_chat, extra, param, message
):
    body = {"model": MODEL, "max_tokens": 4, **extra}
    if is_chat:
        body["messages"] = MESSAGES
    else:
        body["prompt"] = "x"
    path = "/v1/chat/completions" if is_chat else "/v1/completions"
    r = httpx.post(
        served.url + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=30
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert message in error["message"], error
