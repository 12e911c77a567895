"""Tool calling held by the grammar engine, through the official `openai` client against a
real server on random weights: `tool_choice="required"` returns tool calls whose names are
among the tools and whose arguments validate against that tool's parameters, on random
tools; a named function is called with valid arguments; streamed deltas assemble to the
same message as the answer not streamed (same seed); parallel_tool_calls=false keeps one."""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest

from mooncake.bench.grammar import random_schema
from tests.api.conftest import KEY, MODEL

jsonschema = pytest.importorskip("jsonschema")
pytestmark = pytest.mark.timeout(300)
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
NUM_CASES = 10


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _tools(rng: random.Random, num: int) -> list[dict[str, Any]]:
    return [
        {
            "type": "function",
            "function": {
                "name": f"tool_{i}",
                "description": f"tool number {i}",
                "parameters": random_schema(rng),
            },
        }
        for i in range(num)
    ]


def _check_calls(calls: list[Any], tools: list[dict[str, Any]]) -> None:
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call")
        assert call.function.name in by_name, call
        jsonschema.validate(json.loads(call.function.arguments), by_name[call.function.name])


def test_required_returns_calls_whose_arguments_validate_on_random_tools(client):
    rng = random.Random(3807)
    cases = [_tools(rng, rng.randint(1, 2)) for _ in range(NUM_CASES)]

    def ask(i: int) -> Any:
        return client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            tools=cases[i],  # type: ignore[arg-type]
            tool_choice="required",
            max_completion_tokens=420,
            seed=i,
        ).choices[0]

    with ThreadPoolExecutor(5) as pool:
        choices = list(pool.map(ask, range(NUM_CASES)))
    for tools, choice in zip(cases, choices, strict=True):
        assert choice.finish_reason == "tool_calls", choice
        assert not choice.message.content, choice
        _check_calls(choice.message.tool_calls or [], tools)


def test_a_named_function_is_called_with_valid_arguments(client):
    tools = _tools(random.Random(11), 3)
    choice = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=tools,  # type: ignore[arg-type]
        tool_choice={"type": "function", "function": {"name": "tool_1"}},
        max_completion_tokens=420,
        seed=5,
    ).choices[0]
    calls = choice.message.tool_calls or []
    assert [c.function.name for c in calls] == ["tool_1"]
    _check_calls(calls, tools)


def test_streamed_tool_call_deltas_assemble_to_the_message_not_streamed(client):
    tools = _tools(random.Random(23), 2)
    args = dict(
        model=MODEL,
        messages=MESSAGES,
        tools=tools,
        tool_choice="required",
        max_completion_tokens=420,
        seed=9,
        temperature=0.7,
    )
    whole = client.chat.completions.create(**args).choices[0]  # type: ignore[call-overload]
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **args):  # type: ignore[call-overload]
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        finish = chunk.choices[0].finish_reason or finish
        assert not delta.content
        for d in delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += d.id or ""
            call["name"] += (d.function.name if d.function else None) or ""
            call["arguments"] += (d.function.arguments if d.function else None) or ""
    assert finish == whole.finish_reason == "tool_calls"
    expected = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == expected
    assert all(c["id"].startswith("call") for c in calls.values())


def test_parallel_tool_calls_false_returns_one_call(client):
    tools = _tools(random.Random(31), 3)
    for seed in range(3):
        choice = client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            tools=tools,  # type: ignore[arg-type]
            tool_choice="required",
            parallel_tool_calls=False,
            max_completion_tokens=420,
            seed=seed,
        ).choices[0]
        assert len(choice.message.tool_calls or []) == 1
        _check_calls(choice.message.tool_calls or [], tools)


def test_each_of_several_choices_is_held_to_its_constraint(client):
    """n > 1 with a grammar: each forked choice carries its own copy of the matcher."""
    tools = _tools(random.Random(41), 1)
    reply = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=tools,  # type: ignore[arg-type]
        tool_choice="required",
        parallel_tool_calls=False,  # NOTE: one call: random weights write short
        max_completion_tokens=400,
        n=3,
        seed=13,
    )
    assert sorted(c.index for c in reply.choices) == [0, 1, 2]
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls", choice
        _check_calls(choice.message.tool_calls or [], tools)
    schema = random_schema(random.Random(43))
    reply = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_completion_tokens=420,
        n=3,
        seed=17,
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},  # type: ignore[arg-type]
    )
    assert len({c.message.content for c in reply.choices}) > 1  # three draws, not one copied
    for choice in reply.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content or ""), schema)
