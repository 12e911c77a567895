"""Tools in the prompt: a template that renders tools gets them (and the tool conversation)
as transformers' `apply_chat_template(tools=...)` passes them, rendering the same text as
transformers does; a template without tools gets them in a Hermes system message.

Templates: Qwen 2.5's (tokenizer_config.json of Qwen/Qwen2.5-7B-Instruct) and vLLM's
examples/tool_chat_template_llama3.1_json.jinja (Llama 3.1 JSON calls), in
tests/fixtures/chat_templates/."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from mooncake.api.schemas import ChatRequest, chat_messages, decode_body
from mooncake.api.tools.plan import plan_tools, prompt_messages, text_format
from mooncake.model.tokenizer import BYTE_CHAT_TEMPLATE, ByteTokenizer

TEMPLATES = Path(__file__).parents[2] / "fixtures" / "chat_templates"
QWEN = (TEMPLATES / "qwen2.5.jinja").read_text()
LLAMA = (TEMPLATES / "llama3.1_json.jinja").read_text()
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Time now"}}


def _call(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    function = {"name": name, "arguments": json.dumps(arguments)}
    return {"id": call_id, "type": "function", "function": function}


def _conversation(num_calls: int) -> list[dict[str, Any]]:
    calls = [_call("call_1", "get_weather", {"city": "Zürich"}), _call("call_2", "get_time", {})]
    results = [
        {"role": "tool", "tool_call_id": c["id"], "content": r}
        for c, r in zip(calls, ["sunny, 21C", "09:00"], strict=False)
    ]
    return [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Zürich?"},
        {"role": "assistant", "content": None, "tool_calls": calls[:num_calls]},
        *results[:num_calls],
    ]


def _render(template: str, body: dict[str, Any]) -> str:
    req = decode_body(json.dumps(body).encode(), ChatRequest)
    tok = ByteTokenizer()
    tok.chat_template = template
    plan = plan_tools(req, template)
    messages, tools = prompt_messages(chat_messages(req), plan, template)
    return tok.render_chat(messages, tools=tools)


def _transformers(template: str, messages: list[dict[str, Any]], tools: Any) -> str:
    """transformers' rendering of the same messages (arguments as objects, as vLLM and
    transformers' docs pass them)."""
    chat_template_utils = pytest.importorskip("transformers.utils.chat_template_utils")
    for m in messages:
        for c in m.get("tool_calls") or ():
            c["function"]["arguments"] = json.loads(c["function"]["arguments"])
        if m.get("content") is None:
            m["content"] = ""
    rendered, _ = chat_template_utils.render_jinja_template(
        conversations=[messages], tools=tools, chat_template=template, add_generation_prompt=True
    )
    return rendered[0]


@pytest.mark.parametrize(("template", "num_calls"), [(QWEN, 2), (LLAMA, 1)])
def test_templates_with_tools_render_as_transformers_renders_them(template, num_calls):
    messages = _conversation(num_calls)
    body = {"messages": messages, "tools": [WEATHER, TIME]}
    before = _render(template, body)  # NOTE: Llama's has today's date: once on each side
    theirs = _transformers(template, json.loads(json.dumps(messages)), [WEATHER, TIME])
    assert theirs in (before, _render(template, body))
    # and without tools, the template is not told of any
    plain = _render(template, {"messages": messages[:2]})
    theirs = _transformers(template, messages[:2], None)
    assert theirs in (plain, _render(template, {"messages": messages[:2]}))
    assert "get_weather" not in plain


def test_qwen_renders_the_tools_the_calls_and_the_results():
    text = _render(QWEN, {"messages": _conversation(2), "tools": [WEATHER, TIME]})
    tools = "\n".join(json.dumps(t, ensure_ascii=False) for t in (WEATHER, TIME))
    assert text.startswith("<|im_start|>system\nYou are terse.\n\n# Tools\n")
    assert f"<tools>\n{tools}\n</tools>" in text
    assert text.endswith(
        "<|im_start|>user\nWeather in Zürich?<|im_end|>\n"
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nsunny, 21C\n</tool_response>\n"
        "<tool_response>\n09:00\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_llama_renders_the_tools_the_call_and_the_result():
    text = _render(LLAMA, {"messages": _conversation(1), "tools": [WEATHER]})
    assert "Environment: ipython\n" in text
    assert json.dumps(WEATHER, indent=4) + "\n\nWeather in Zürich?<|eot_id|>" in text
    assert text.endswith(
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
        '{"name": "get_weather", "parameters": {"city": "Zürich"}}<|eot_id|>'
        "<|start_header_id|>ipython<|end_header_id|>\n\n"
        '{"output": "sunny, 21C"}<|eot_id|>'
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_a_template_without_tools_gets_them_in_a_system_message():
    """The byte template (dummy models) renders no tools: they go after the system
    message in the Hermes format, calls and results as Qwen's template writes them."""
    text = _render(BYTE_CHAT_TEMPLATE, {"messages": _conversation(2), "tools": [WEATHER, TIME]})
    tools = "\n".join(json.dumps(t, ensure_ascii=False) for t in (WEATHER, TIME))
    assert text == (
        "<|system|>\nYou are terse.\n\n# Tools\n\nYou may call one or more functions to "
        "assist with the user query.\n\nYou are provided with function signatures within "
        f"<tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\nFor each function call, "
        "return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>\n'
        "<|user|>\nWeather in Zürich?\n"
        '<|assistant|>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n'
        "<|user|>\n<tool_response>\nsunny, 21C\n</tool_response>\n"
        "<tool_response>\n09:00\n</tool_response>\n"
        "<|assistant|>\n"
    )
    no_system = _render(BYTE_CHAT_TEMPLATE, {"messages": _conversation(0)[1:], "tools": [TIME]})
    assert no_system.startswith("<|system|>\n# Tools\n") and "<|user|>\nWeather" in no_system


def test_the_call_format_is_read_from_the_template():
    assert text_format(QWEN) == "hermes"
    assert text_format(LLAMA) == "llama3_json"
    assert text_format(BYTE_CHAT_TEMPLATE) == "hermes"  # our system message asks for it
    assert text_format("{{ messages }}{{ tools }}[TOOL_CALLS]") == "unknown"
    qwen3_coder = "{{ tools }}<tool_call>\n<function=example_function_name>"  # its XML calls
    assert text_format(qwen3_coder) == "unknown"
