"""Tool calling through the HTTP API with the official `openai` client: the model's calls
come back as `tool_calls`, streamed as OpenAI streams them, and the streamed deltas
assemble to the same message as the whole response; `required` and a named function ask
the backend for the grammar that forces them (`Guided` JSON schema) and read its answer.

The backend is scripted (no model writes these calls on random weights): it turns a fixed
text into tokens with the real tokenizer and streams them through the engine's own
`Sequence` (incremental detokenization, stop handling), behind the real serving path.
Tokenizers: SmolLM2-135M-Instruct's (the built-in model, a template without tools: the
tools go into a system message) and the byte tokenizer with vLLM's Llama 3.1 JSON tool
template."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import msgspec
import openai
import pytest

from mooncake.api import openapi
from mooncake.api.app import create_app
from mooncake.api.backend import BaseBackend, GenerateRequest, Output
from mooncake.api.server import ApiServer
from mooncake.api.tools.forced import required_schema
from mooncake.model.sequence import Sequence
from mooncake.model.tokenizer import BaseTokenizer, ByteTokenizer, create_tokenizer
from tests.model.smollm2 import NAME, smollm2_file

pytestmark = pytest.mark.timeout(120)
LLAMA = (
    Path(__file__).parents[1] / "fixtures" / "chat_templates" / "llama3.1_json.jinja"
).read_text()
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time"}}
QUESTION = [{"role": "user", "content": "What is the weather in Zürich, and the time?"}]
HERMES_ANSWER = (
    "Let me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)


class ScriptedBackend(BaseBackend):
    """Answers every request with `script`, tokenized, through a real `Sequence`."""

    model_name = "scripted"
    max_model_len = 4096

    def __init__(self, tokenizer: BaseTokenizer):
        self.tokenizer = tokenizer
        self.script = ""
        self.requests: list[GenerateRequest] = []

    async def generate(self, req: GenerateRequest) -> AsyncIterator[Output]:
        self.requests.append(req)
        tok = self.tokenizer
        seq = Sequence(
            0, req.prompt_ids, req.params, eos_token_ids=tok.eos_token_ids, tokenizer=tok
        )
        for token_id in [*tok.encode(self.script, add_special_tokens=False), tok.eos_token_ids[0]]:
            event = seq.append(token_id)
            yield Output(token_id=token_id, text=event.text, finish_reason=event.finish_reason)
            if event.finish_reason is not None:
                return


def _serve(
    tokenizer: BaseTokenizer,
) -> Iterator[tuple[ScriptedBackend, openai.OpenAI, httpx.Client]]:
    backend = ScriptedBackend(tokenizer)
    server = ApiServer(create_app(backend), "127.0.0.1", 0)
    server.start_in_thread()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            yield backend, client, http
    finally:
        server.stop()


@pytest.fixture(scope="module")
def smol() -> Iterator[tuple[ScriptedBackend, openai.OpenAI, httpx.Client]]:
    smollm2_file()  # skips without the package
    yield from _serve(create_tokenizer(NAME))


@pytest.fixture(scope="module")
def llama() -> Iterator[tuple[ScriptedBackend, openai.OpenAI, httpx.Client]]:
    tokenizer = ByteTokenizer()
    tokenizer.chat_template = LLAMA
    yield from _serve(tokenizer)


def _whole(client: openai.OpenAI, **body: Any) -> tuple[Any, str | None]:
    resp = client.chat.completions.create(model="scripted", messages=QUESTION, **body)
    choice = resp.choices[0]
    calls = [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    return (choice.message.content, calls), choice.finish_reason


def _streamed(client: openai.OpenAI, **body: Any) -> tuple[Any, str | None, list[Any]]:
    """The stream assembled as a client does, and every tool_calls delta entry."""
    stream = client.chat.completions.create(
        model="scripted", messages=QUESTION, stream=True, **body
    )
    content, calls, entries, finish = [], {}, [], None
    for chunk in stream:
        delta = chunk.choices[0].delta
        if delta.content:
            assert "<" not in delta.content, delta.content  # no markup leaks into content
            content.append(delta.content)
        for entry in delta.tool_calls or []:
            entries.append(entry)
            call = calls.setdefault(entry.index, {"id": None, "name": None, "arguments": ""})
            if entry.id:
                call["id"], call["name"] = entry.id, entry.function.name
            call["arguments"] += entry.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    text = "".join(content) or None
    message = (text, [(c["id"], c["name"], c["arguments"]) for _, c in sorted(calls.items())])
    return message, finish, entries


def _without_ids(message: Any) -> Any:
    content, calls = message
    assert all(call_id.startswith("call_") for call_id, _, _ in calls)
    assert len({call_id for call_id, _, _ in calls}) == len(calls)
    return content, [(name, args) for _, name, args in calls]


def test_auto_calls_come_back_as_tool_calls_and_the_stream_assembles_to_them(smol):
    backend, client, _ = smol
    backend.script = HERMES_ANSWER
    whole, finish = _whole(client, tools=[WEATHER, TIME])
    expected = ("Let me check.", [("get_weather", '{"city": "Zürich"}'), ("get_time", "{}")])
    assert (_without_ids(whole), finish) == (expected, "tool_calls")
    streamed, stream_finish, entries = _streamed(client, tools=[WEATHER, TIME])
    assert (_without_ids(streamed), stream_finish) == (expected, "tool_calls")
    firsts = [e for e in entries if e.id]
    assert [(e.index, e.type, e.function.name) for e in firsts] == [
        (0, "function", "get_weather"),
        (1, "function", "get_time"),
    ]
    assert all(e.type is None and e.function.name is None for e in entries if not e.id)
    # the tools reached the prompt: SmolLM2's template has none, so a system message
    prompt = backend.tokenizer.decode(backend.requests[-1].prompt_ids, skip_special_tokens=False)
    assert "<tools>\n" + json.dumps(WEATHER) in prompt
    assert backend.requests[-1].params.guided is None


def test_a_conversation_goes_on_with_the_message_the_client_got_back(smol):
    """The openai client sends the returned message back as is (refusal: null, content
    null, the tool calls), then the tool's result."""
    backend, client, _ = smol
    backend.script = HERMES_ANSWER
    message = client.chat.completions.create(
        model="scripted", messages=QUESTION, tools=[WEATHER, TIME]
    )
    calls = message.choices[0].message.tool_calls
    assert calls is not None
    history = [
        *QUESTION,
        message.choices[0].message,
        *(
            {"role": "tool", "tool_call_id": c.id, "content": f"result of {c.function.name}"}
            for c in calls
        ),
    ]
    backend.script = "Sunny, 21C, at 09:00."
    answer = client.chat.completions.create(
        model="scripted", messages=history, tools=[WEATHER, TIME]
    )
    assert answer.choices[0].message.content == "Sunny, 21C, at 09:00."
    assert answer.choices[0].finish_reason == "stop" and not answer.choices[0].message.tool_calls
    prompt = backend.tokenizer.decode(backend.requests[-1].prompt_ids, skip_special_tokens=False)
    assert "<tool_response>\nresult of get_weather\n</tool_response>" in prompt
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>'
        in prompt
    )


def test_required_asks_for_the_calls_schema_and_reads_the_array(smol):
    backend, client, _ = smol
    backend.script = '[{"name": "get_weather", "parameters": {"city": "Paris"}}]'
    whole, finish = _whole(client, tools=[WEATHER, TIME], tool_choice="required")
    guided = backend.requests[-1].params.guided
    assert guided is not None and guided.kind == "json_schema"
    assert json.loads(guided.spec) == required_schema([WEATHER["function"], TIME["function"]], True)
    assert (_without_ids(whole), finish) == (
        (None, [("get_weather", '{"city": "Paris"}')]),
        "tool_calls",
    )
    jsonschema.validate(json.loads(whole[1][0][2]), CITY)
    streamed, stream_finish, _ = _streamed(client, tools=[WEATHER, TIME], tool_choice="required")
    assert (_without_ids(streamed), stream_finish) == (_without_ids(whole), "tool_calls")
    _whole(client, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    guided = backend.requests[-1].params.guided
    assert guided is not None and json.loads(guided.spec)["maxItems"] == 1


def test_a_named_function_asks_for_its_parameters_schema_and_ends_with_stop(smol):
    backend, client, _ = smol
    backend.script = '{"city": "Paris"}'
    named = {"type": "function", "function": {"name": "get_weather"}}
    whole, finish = _whole(client, tools=[WEATHER, TIME], tool_choice=named)
    guided = backend.requests[-1].params.guided
    assert guided is not None and json.loads(guided.spec) == CITY
    assert (_without_ids(whole), finish) == ((None, [("get_weather", '{"city": "Paris"}')]), "stop")
    streamed, stream_finish, _ = _streamed(client, tools=[WEATHER, TIME], tool_choice=named)
    assert (_without_ids(streamed), stream_finish) == (_without_ids(whole), "stop")


def test_none_renders_the_tools_and_reads_no_calls(smol):
    backend, client, _ = smol
    backend.script = HERMES_ANSWER
    whole, finish = _whole(client, tools=[WEATHER, TIME], tool_choice="none")
    assert (whole, finish) == ((HERMES_ANSWER, []), "stop")
    prompt = backend.tokenizer.decode(backend.requests[-1].prompt_ids, skip_special_tokens=False)
    assert json.dumps(TIME) in prompt


def test_a_call_cut_by_max_tokens_keeps_what_was_written(smol):
    backend, client, _ = smol
    backend.script = HERMES_ANSWER
    num_tokens = len(backend.tokenizer.encode(HERMES_ANSWER.split('"Zürich"')[0], False))
    whole, finish = _whole(client, tools=[WEATHER, TIME], max_tokens=num_tokens + 1)
    content, calls = _without_ids(whole)
    assert finish == "length" and content == "Let me check."
    assert len(calls) == 1 and calls[0][0] == "get_weather"
    assert '{"city": "Zürich"}'.startswith(calls[0][1]) and calls[0][1].startswith('{"city": ')


def test_llama3_json_calls_through_a_llama_template(llama):
    backend, client, _ = llama
    backend.script = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    whole, finish = _whole(client, tools=[WEATHER])
    assert (_without_ids(whole), finish) == (
        (None, [("get_weather", '{"city": "Paris"}')]),
        "tool_calls",
    )
    streamed, stream_finish, _ = _streamed(client, tools=[WEATHER])
    assert (_without_ids(streamed), stream_finish) == (_without_ids(whole), "tool_calls")
    prompt = backend.tokenizer.decode(backend.requests[-1].prompt_ids)
    assert "Environment: ipython" in prompt and json.dumps(WEATHER, indent=4) in prompt
    backend.script = "It is sunny."
    assert _whole(client, tools=[WEATHER]) == (("It is sunny.", []), "stop")


def test_responses_with_tool_calls_decode_into_the_documented_shapes(smol):
    backend, _, http = smol
    backend.script = HERMES_ANSWER
    body = {"model": "scripted", "messages": QUESTION, "tools": [WEATHER, TIME]}
    resp = http.post("/v1/chat/completions", json=body)
    shape = msgspec.json.decode(resp.content, type=openapi.ChatCompletion, strict=True)
    assert shape.choices[0].finish_reason == "tool_calls"
    assert shape.choices[0].message.content == "Let me check."
    calls = shape.choices[0].message.tool_calls
    assert calls is not None and [c.function.name for c in calls] == ["get_weather", "get_time"]
    resp = http.post("/v1/chat/completions", json={**body, "tool_choice": "required"})
    assert resp.status_code == 200  # the script is not an array: plain content
    assert (
        msgspec.json.decode(resp.content, type=openapi.ChatCompletion).choices[0].message.tool_calls
        is None
    )


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"messages": [*QUESTION, {"role": "tool", "tool_call_id": "c", "content": "x"}]},
            "messages[1].tool_call_id",
        ),
    ],
)
def test_bad_tool_requests_are_a_400_naming_the_field(smol, body, param):
    _, _, http = smol
    resp = http.post(
        "/v1/chat/completions", json={"model": "scripted", "messages": QUESTION, **body}
    )
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
