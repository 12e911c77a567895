"""What a chat request does with its tools: checked once, before the prompt is rendered.

`plan_tools(req, template)` checks `tools` and `tool_choice` (every refusal names the
field) and returns a `ToolPlan`: the tools as the chat template receives them, how the
output is read, and the `Guided` constraint that `required` and a named function need.

- `auto` (the default with tools): the model writes calls in its own format, found by the
  parser of its template: `<tool_call>` in the template -> Hermes; `<|python_tag|>` or
  Llama 3's "Environment: ipython" -> Llama 3 JSON. A template that renders tools in
  another format (Mistral's `[TOOL_CALLS]`, Qwen3-Coder's `<function=...>` XML, ...) gets
  a 400 for `auto`: we could not read the calls; `required` and a named function do not
  depend on it.
- `required`, a named function: the grammar engine holds the output to a schema
  (`forced.py`), so that it always parses. Function `strict: true` is held there; with
  `auto` it is refused (the model's text is parsed as written, not held to the schema).
- `none`: the tools are rendered all the same and nothing is parsed, as vLLM does by
  default (docs.vllm.ai, "Tool Calling", tool_choice none).

A template that does not read `tools` (the dummy models' byte template, SmolLM2's) gets
them in a system message in the Hermes format that Qwen 2.5's template writes (and its
output read by the Hermes parser), as TGI does for such templates; earlier calls and tool
results are then written into the messages as that template would (`prompt_messages`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import jsonschema
import msgspec

from mooncake.api.schemas import ChatRequest, InvalidRequest, NamedToolChoice
from mooncake.api.tools.forced import (
    NamedParser,
    RequiredParser,
    ToolSchemaError,
    named_schema,
    required_schema,
)
from mooncake.api.tools.parsers import HermesParser, Llama3JsonParser, ToolParser
from mooncake.api.tools.stream import ToolStream
from mooncake.model.params import MAX_GUIDED_BYTES, Guided
from mooncake.model.tokenizer import template_variables

PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}


@dataclass(frozen=True)
class ToolPlan:
    tools: list[dict[str, Any]]  # {"type": "function", "function": {...}} as the client sent
    choice: str  # none | auto | required | function
    function: str  # the named function ("" unless choice is "function")
    is_parallel: bool  # parallel_tool_calls
    text_format: str  # how the model writes calls: hermes | llama3_json | unknown
    template_renders_tools: bool  # else a system message carries them (prompt_messages)
    guided: Guided | None  # the constraint required / a named function needs

    def new_stream(self) -> ToolStream | None:
        """A fresh reader of one output's calls; None when nothing is parsed (none)."""
        names = frozenset(t["function"]["name"] for t in self.tools)
        if self.choice == "function":
            return ToolStream(NamedParser(self.function), is_named=True)
        if self.choice == "required":
            return ToolStream(RequiredParser(names, self.is_parallel))
        if self.choice == "auto":
            return ToolStream(PARSERS[self.text_format](names, self.is_parallel))
        return None


def text_format(template: str | None) -> str:
    """How a model with this chat template writes tool calls."""
    if template is None or "tools" not in template_variables(template):
        return "hermes"  # NOTE: our system message asks for that format
    if "<tool_call>" in template and "<function=" not in template:  # not Qwen3-Coder's XML
        return "hermes"
    if "<|python_tag|>" in template or "Environment: ipython" in template:
        return "llama3_json"
    return "unknown"


def plan_tools(req: ChatRequest, template: str | None) -> ToolPlan | None:
    """The request's tool plan, None when it has no tools; raises InvalidRequest."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise InvalidRequest("tool_choice: needs `tools` (or 'none')", "tool_choice")
        return None
    tools = [msgspec.to_builtins(t) for t in req.tools]
    functions = [t["function"] for t in tools]
    _check_functions(functions)
    function = ""
    if isinstance(choice, NamedToolChoice):
        function = choice.function.name
        if function not in {f["name"] for f in functions}:
            raise InvalidRequest(
                f"tool_choice: function {function!r} is not one of `tools`", "tool_choice"
            )
    kind = "function" if function else (choice or "auto")
    assert isinstance(kind, str), kind
    fmt = text_format(template)
    if kind == "auto":
        _check_auto(functions, fmt)
    is_parallel = req.parallel_tool_calls is not False
    guided = _guided(kind, functions, function, is_parallel)
    renders = template is not None and "tools" in template_variables(template)
    return ToolPlan(tools, kind, function, is_parallel, fmt, renders, guided)


def _check_functions(functions: list[dict[str, Any]]) -> None:
    seen: set[str] = set()
    for i, f in enumerate(functions):
        where = f"tools[{i}].function"
        if f["name"] in seen:
            raise InvalidRequest(
                f"{where}.name: {f['name']!r} names two tools; names must be unique",
                f"{where}.name",
            )
        seen.add(f["name"])
        params = f.get("parameters")
        if params is not None:
            _check_parameters(params, f"{where}.parameters")


def _check_parameters(params: dict[str, Any], param: str) -> None:
    """A JSON Schema (by its `$schema`, else the latest draft) of an object."""
    if params.get("type", "object") != "object":
        raise InvalidRequest(
            f"{param}: must describe the arguments object (type 'object'), got type "
            f"{params['type']!r}",
            param,
        )
    try:
        jsonschema.validators.validator_for(params).check_schema(params)
    except jsonschema.SchemaError as e:
        at = "/".join(str(p) for p in e.absolute_path) or "its top"
        raise InvalidRequest(f"{param}: not a valid JSON Schema at {at}: {e.message}", param) from e


def _check_auto(functions: list[dict[str, Any]], fmt: str) -> None:
    if fmt == "unknown":
        raise InvalidRequest(
            "tool_choice: this model's chat template writes tool calls in a format we "
            "cannot read (we read Hermes <tool_call> and Llama 3 JSON calls), so 'auto' "
            "cannot return them; use tool_choice 'required' or a named function",
            "tool_choice",
        )
    for i, f in enumerate(functions):
        if f.get("strict"):
            param = f"tools[{i}].function.strict"
            raise InvalidRequest(
                f"{param}: true is held only with tool_choice 'required' or a named "
                "function (the grammar engine holds the output to the schema); with "
                "'auto' calls are read as the model writes them: send strict false",
                param,
            )


def _guided(
    kind: str, functions: list[dict[str, Any]], function: str, is_parallel: bool
) -> Guided | None:
    try:
        if kind == "required":
            schema = required_schema(functions, is_parallel)
        elif kind == "function":
            schema = named_schema(next(f for f in functions if f["name"] == function))
        else:
            return None
    except ToolSchemaError as e:
        raise InvalidRequest(f"tools: {e}", "tools") from e
    spec = json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
    size = len(spec.encode("utf-8", "surrogatepass"))
    if size > MAX_GUIDED_BYTES:
        raise InvalidRequest(
            f"tools: the schema tool_choice {kind!r} holds the output to is {size} bytes, "
            f"more than {MAX_GUIDED_BYTES}; send fewer or smaller tools",
            "tools",
        )
    return Guided(kind="json_schema", spec=spec)


# -- the prompt ---------------------------------------------------------------------------
# NOTE: Qwen 2.5's template's words (Hermes format), for templates without tools
_TOOLS_INTRO = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_OUTRO = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def prompt_messages(
    messages: list[dict[str, Any]], plan: ToolPlan | None, template: str | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for the chat template: the tools go to a template that reads
    them; else into a system message, with earlier calls and results written as text."""
    if template is not None and "tools" in template_variables(template):
        return messages, plan.tools if plan is not None else None
    out = _as_text(messages)
    if plan is not None:
        tools = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in plan.tools)
        text = _TOOLS_INTRO + tools + _TOOLS_OUTRO
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out, None


def _as_text(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Calls as `<tool_call>` text in their assistant message, a run of tool results as
    one user message of `<tool_response>`s (as Qwen 2.5's template writes them)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "tool":
            response = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("is_tool_response"):
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response, "is_tool_response": True})
            continue
        m = dict(m)
        calls = m.pop("tool_calls", None) or ()
        if calls:
            parts = [m["content"]] if m["content"] else []
            for call in calls:
                body = json.dumps(call["function"], ensure_ascii=False)
                parts.append(f"<tool_call>\n{body}\n</tool_call>")
            m["content"] = "\n".join(parts)
        out.append(m)
    for m in out:
        m.pop("is_tool_response", None)
    return out
