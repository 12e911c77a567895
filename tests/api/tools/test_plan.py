"""The tool plan of a chat request: each bad `tools` / `tool_choice` / tool message is a
400 naming the field; `required` and a named function get the `Guided` JSON schema that
forces a parsable answer (vLLM's schema), `auto` and `none` get none."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from mooncake.api.schemas import (
    ChatRequest,
    InvalidRequest,
    chat_messages,
    decode_body,
    one_constraint,
)
from mooncake.api.tools.plan import plan_tools
from mooncake.model.params import MAX_GUIDED_BYTES, Guided

TEMPLATES = Path(__file__).parents[2] / "fixtures" / "chat_templates"
QWEN = (TEMPLATES / "qwen2.5.jinja").read_text()
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Weather now", "parameters": CITY},
}
TIME = {"type": "function", "function": {"name": "get_time"}}


def _request(**body: Any) -> ChatRequest:
    return decode_body(json.dumps({"messages": USER, **body}).encode(), ChatRequest)


def _refusal(template: str | None = QWEN, **body: Any) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as e:
        req = _request(**body)
        plan_tools(req, template)
        chat_messages(req)
    assert e.value.status == 400
    return e.value


def _tool(**function: Any) -> dict[str, Any]:
    return {"type": "function", "function": function}


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"tools": []}, "tools", "length >= 1"),
        (
            {"tools": [{"type": "custom", "function": {"name": "f"}}]},
            "tools[0].type",
            "invalid enum value 'custom'",
        ),
        ({"tools": [_tool(name="get weather")]}, "tools[0].function.name", "^[a-zA-Z0-9_-]{1,64}$"),
        ({"tools": [_tool(name="f" * 65)]}, "tools[0].function.name", "matching regex"),
        ({"tools": [{"type": "function"}]}, "tools[0].function", "required property"),
        (
            {"tools": [_tool(name="f", parameters=[])]},
            "tools[0].function.parameters",
            "expected `object | null`",
        ),
        ({"tools": [_tool(name="f", extra=1)]}, "tools[0].function.extra", "Unrecognized"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name", "names two tools"),
        (
            {"tools": [_tool(name="f", parameters={"type": "string"})]},
            "tools[0].function.parameters",
            "must describe the arguments object (type 'object'), got type 'string'",
        ),
        (
            {"tools": [_tool(name="f", parameters={"type": "object", "properties": {"a": 5}})]},
            "tools[0].function.parameters",
            "not a valid JSON Schema at properties/a: 5 is not of type 'object', 'boolean'",
        ),
        (
            {"tools": [_tool(name="f", parameters={"type": "object", "required": "a"})]},
            "tools[0].function.parameters",
            "not a valid JSON Schema at required",
        ),
        (
            {"tools": [WEATHER], "tool_choice": "sometimes"},
            "tool_choice",
            "invalid enum value 'sometimes'",
        ),
        ({"tool_choice": "required"}, "tool_choice", "needs `tools`"),
        ({"tool_choice": "auto"}, "tool_choice", "needs `tools`"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
            "function 'x' is not one of `tools`",
        ),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {}}},
            "tool_choice.function.name",
            "required property",
        ),
        (
            {"tools": [_tool(name="f", parameters=CITY, strict=True)]},
            "tools[0].function.strict",
            "true is held only with tool_choice 'required' or a named function",
        ),
    ],
)
def test_bad_tools_and_tool_choice_are_refused_naming_the_field(body, param, message):
    error = _refusal(**body)
    assert error.param == param and message in str(error), (error.param, str(error))


def test_strict_is_allowed_where_the_grammar_holds_the_output():
    tools = [_tool(name="f", parameters=CITY, strict=True)]
    for choice in ("required", "none", {"type": "function", "function": {"name": "f"}}):
        assert plan_tools(_request(tools=tools, tool_choice=choice), QWEN) is not None


def test_auto_is_refused_for_a_template_whose_call_format_we_cannot_read():
    """A template that renders tools in another format (Mistral's [TOOL_CALLS] here):
    'auto' could not return the calls; 'required' does not depend on the format."""
    mistral = (
        "{% for m in messages %}{{ m.content }}{% endfor %}[AVAILABLE_TOOLS]{{ tools | tojson }}"
    )
    error = _refusal(mistral, tools=[WEATHER])
    assert error.param == "tool_choice" and "format we cannot read" in str(error)
    plan = plan_tools(_request(tools=[WEATHER], tool_choice="required"), mistral)
    assert plan is not None and plan.guided is not None


CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}


@pytest.mark.parametrize(
    ("messages", "param", "message"),
    [
        ([{"role": "tool", "content": "sunny"}], "messages[0].tool_call_id", "must name the call"),
        (
            [*USER, {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}],
            "messages[1].tool_call_id",
            "'call_1' is not one of its tool_calls' ids (it made none)",
        ),
        (
            [
                *USER,
                {"role": "assistant", "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_2", "content": "x"},
            ],
            "messages[2].tool_call_id",
            "'call_2' is not one of its tool_calls' ids (call_1)",
        ),
        (
            [{"role": "user", "content": "x", "tool_calls": [CALL]}],
            "messages[0].tool_calls",
            "only assistant messages have tool_calls",
        ),
        (
            [{"role": "user", "content": "x", "tool_call_id": "call_1"}],
            "messages[0].tool_call_id",
            "only tool messages have tool_call_id",
        ),
        (
            [
                {
                    "role": "assistant",
                    "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "[1]"}}],
                }
            ],
            "messages[0].tool_calls[0].function.arguments",
            "must be a JSON object as text",
        ),
        (
            [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f"}}]}],
            "messages[0].tool_calls[0].function.arguments",
            "required property",
        ),
        (
            [
                {
                    "role": "assistant",
                    "content": "",
                    "function_call": {"name": "f", "arguments": "{}"},
                }
            ],
            "messages[0].function_call",
            "legacy function calling is not supported",
        ),
        (
            [{"role": "assistant", "content": "", "audio": {"id": "a"}}],
            "messages[0].audio",
            "audio is not supported",
        ),
    ],
)
def test_bad_tool_messages_are_refused_naming_the_field(messages, param, message):
    error = _refusal(messages=messages)
    assert error.param == param and message in str(error), (error.param, str(error))


def test_a_tool_conversation_reaches_the_template_as_transformers_passes_it():
    """Arguments become objects (templates write `arguments | tojson`); a run of tool
    messages answers the calls of the assistant message before them; an assistant message
    sent back as the openai client dumps it (refusal, audio, ... null) is accepted."""
    second = {**CALL, "id": "call_2"}
    messages = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [CALL, second],
            # the rest of the message as the openai client's model_dump() writes it
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "9am"}]},
    ]
    got = chat_messages(_request(messages=messages))
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": {}},
    }
    assert got[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [call, {**call, "id": "call_2"}],
    }
    assert got[2:] == [
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
        {"role": "tool", "content": "9am", "tool_call_id": "call_2"},
    ]


# -- the constraint of required and a named function ---------------------------------------
def _schema(guided: Guided | None) -> dict[str, Any]:
    assert guided is not None and guided.kind == "json_schema"
    return json.loads(guided.spec)


def test_required_holds_the_output_to_an_array_of_known_calls():
    """vLLM's schema: an array of {name: one tool, parameters: its schema}; each tool's
    $defs moved to the top, where their references resolve; at most one call without
    parallel_tool_calls."""
    addr = {"type": "object", "properties": {"to": {"$ref": "#/$defs/Addr"}}}
    tools = [
        WEATHER,
        TIME,
        _tool(name="mail", parameters={**addr, "$defs": {"Addr": {"type": "string"}}}),
    ]
    plan = plan_tools(_request(tools=tools, tool_choice="required"), QWEN)
    assert plan is not None and plan.choice == "required"
    schema = _schema(plan.guided)
    item = {"type": "object", "required": ["name", "parameters"], "additionalProperties": False}
    assert schema == {
        "type": "array",
        "minItems": 1,
        "items": {
            "anyOf": [
                {
                    **item,
                    "properties": {
                        "name": {"type": "string", "enum": ["get_weather"]},
                        "parameters": CITY,
                    },
                },
                {
                    **item,
                    "properties": {
                        "name": {"type": "string", "enum": ["get_time"]},
                        "parameters": {"type": "object", "properties": {}},
                    },
                },
                {
                    **item,
                    "properties": {
                        "name": {"type": "string", "enum": ["mail"]},
                        "parameters": addr,
                    },
                },
            ]
        },
        "$defs": {"Addr": {"type": "string"}},
    }
    good = [
        {"name": "get_weather", "parameters": {"city": "Paris"}},
        {"name": "mail", "parameters": {"to": "x"}},
    ]
    jsonschema.validate(good, schema)
    for bad in (
        [],
        [{"name": "get_weather", "parameters": {}}],
        [{"name": "rm", "parameters": {}}],
        [{"name": "mail", "parameters": {"to": 5}}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = plan_tools(
        _request(tools=tools, tool_choice="required", parallel_tool_calls=False), QWEN
    )
    assert single is not None and _schema(single.guided)["maxItems"] == 1


def test_a_named_function_holds_the_output_to_its_parameters():
    named = {"type": "function", "function": {"name": "get_weather"}}
    plan = plan_tools(_request(tools=[TIME, WEATHER], tool_choice=named), QWEN)
    assert plan is not None and (plan.choice, plan.function) == ("function", "get_weather")
    assert _schema(plan.guided) == CITY
    plan = plan_tools(
        _request(tools=[TIME], tool_choice={**named, "function": {"name": "get_time"}}), QWEN
    )
    assert plan is not None and _schema(plan.guided) == {"type": "object", "properties": {}}


def test_auto_and_none_parse_the_models_text_or_nothing_and_constrain_nothing():
    auto = plan_tools(_request(tools=[WEATHER]), QWEN)
    assert auto is not None and (auto.choice, auto.guided, auto.text_format) == (
        "auto",
        None,
        "hermes",
    )
    none = plan_tools(_request(tools=[WEATHER], tool_choice="none"), QWEN)
    assert none is not None and none.guided is None and none.new_stream() is None
    assert none.tools == [WEATHER]  # still rendered, as vLLM does
    assert plan_tools(_request(), QWEN) is None
    assert plan_tools(_request(tool_choice="none"), QWEN) is None


def test_tool_schemas_that_cannot_be_combined_or_are_too_big_are_refused():
    defs = [{"type": "object", "$defs": {"A": {"type": kind}}} for kind in ("string", "integer")]
    tools = [_tool(name=f"f{i}", parameters=p) for i, p in enumerate(defs)]
    error = _refusal(tools=tools, tool_choice="required")
    assert error.param == "tools" and "$defs/A differently" in str(error)
    huge = {
        "type": "object",
        "properties": {"a": {"enum": ["x" * 1000] * (MAX_GUIDED_BYTES // 1000)}},
    }
    error = _refusal(tools=[_tool(name="f", parameters=huge)], tool_choice="required")
    assert error.param == "tools" and f"more than {MAX_GUIDED_BYTES}" in str(error)


def test_tool_choice_and_response_format_cannot_both_constrain_the_output():
    tool, fmt = Guided(kind="json_schema", spec="{}"), Guided(kind="json_object")
    assert one_constraint(tool, None) is tool and one_constraint(None, fmt) is fmt
    assert one_constraint(None, None) is None
    with pytest.raises(InvalidRequest) as e:
        one_constraint(tool, fmt)
    assert e.value.param == "tool_choice"
