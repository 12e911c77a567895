"""Tool-call parsers: what each format's text becomes (content, calls), the same whatever
pieces the text arrives in (every split point, one character at a time, random splits),
and stream deltas in OpenAI's shape that assemble to the whole message."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake.api.tools.forced import NamedParser, RequiredParser
from mooncake.api.tools.parsers import HermesParser, Llama3JsonParser, ToolParser
from mooncake.api.tools.stream import ToolStream

NAMES = frozenset({"get_weather", "get_time"})
Message = tuple[str | None, list[tuple[str, str]]]  # (content, [(name, arguments)])


def _run(make: Callable[[], ToolParser], pieces: list[str]) -> tuple[Message, list[dict]]:
    """Feed `pieces` (the last one ends the output); the message and the stream deltas."""
    stream = ToolStream(make())
    deltas = []
    for i, piece in enumerate(pieces):
        text, calls = stream.delta(piece, is_last=i == len(pieces) - 1)
        deltas.append({"content": text, "tool_calls": calls})
    content, calls = stream.message()
    return (content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls]), deltas


def _every_split(make: Callable[[], ToolParser], text: str) -> Message:
    """The message of `text`, checked equal for every split into two pieces and for one
    character at a time."""
    whole, _ = _run(make, [text])
    for i in range(len(text) + 1):
        assert _run(make, [text[:i], text[i:]])[0] == whole, (i, text)
    assert _run(make, [*text, ""])[0] == whole
    return whole


def hermes(parallel: bool = True) -> Callable[[], ToolParser]:
    return lambda: HermesParser(NAMES, parallel)


def llama() -> ToolParser:
    return Llama3JsonParser(NAMES)


WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
TIME = '{"name": "get_time", "arguments": {}}'


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("Hello, world", ("Hello, world", [])),
        ("", ("", [])),
        # Qwen 2.5's own layout: content, then calls on their own lines
        (
            f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>",
            ("Let me check.", [("get_weather", '{"city": "Paris"}')]),
        ),
        (
            f"<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>",
            (None, [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]),
        ),
        # content between and after calls is kept, the whitespace around calls is not
        (
            f"a <tool_call>{TIME}</tool_call> b <tool_call>{TIME}</tool_call>\n",
            ("ab", [("get_time", "{}"), ("get_time", "{}")]),
        ),
        # the model's own JSON text is the arguments, key order and spacing as written
        (
            '<tool_call>{"arguments": {"q": "}{", "n": [1, 2.5e3]}, "name": "get_weather"}'
            "</tool_call>",
            (None, [("get_weather", '{"q": "}{", "n": [1, 2.5e3]}')]),
        ),
        ('<tool_call>{"name": "get_time"}</tool_call>', (None, [("get_time", "{}")])),
        # not calls: the text stays as written
        (
            '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
            ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', []),
        ),
        (
            'x <tool_call>{"name": "get_time", "arguments": "now"}</tool_call>',
            ('x <tool_call>{"name": "get_time", "arguments": "now"}</tool_call>', []),
        ),
        ("x <tool_call> y", ("x <tool_call> y", [])),
        ("<tool_call>{'name': 'get_time'}", ("<tool_call>{'name': 'get_time'}", [])),
        ("cut at <tool_", ("cut at <tool_", [])),
        # cut off by max_tokens: the call keeps what was written
        (
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Par',
            (None, [("get_weather", '{"city": "Par')]),
        ),
        (f"<tool_call>{TIME}</tool_", (None, [("get_time", "{}")])),
        # a call whose JSON breaks after it began: the rest of it is dropped
        (
            '<tool_call>{"name": "get_time", "arguments": {"a": 1]}</tool_call>ok',
            ("ok", [("get_time", '{"a": 1')]),
        ),
        # a call with text after it but no closing tag
        (f"<tool_call>{TIME} and more", ("and more", [("get_time", "{}")])),
    ],
)
def test_hermes_text_becomes_content_and_calls_whatever_the_split(text, message):
    assert _every_split(hermes(), text) == message


def test_hermes_without_parallel_calls_keeps_the_first():
    text = f"<tool_call>{WEATHER}</tool_call>\n<tool_call>{TIME}</tool_call>"
    assert _every_split(hermes(parallel=False), text) == (
        None,
        [("get_weather", '{"city": "Paris"}')],
    )


LLAMA_WEATHER = '{"name": "get_weather", "parameters": {"city": "Paris"}}'


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (LLAMA_WEATHER, (None, [("get_weather", '{"city": "Paris"}')])),
        # after <|python_tag|>, several calls separated by ";" (vLLM's llama3_json)
        (
            '<|python_tag|>{"name": "get_time", "parameters": {}}; ' + LLAMA_WEATHER,
            (None, [("get_time", "{}"), ("get_weather", '{"city": "Paris"}')]),
        ),
        # Llama 3.2 may write the type too; "arguments" is read like "parameters"
        (
            '{"type": "function", "name": "get_time", "arguments": {"tz": "UTC"}}',
            (None, [("get_time", '{"tz": "UTC"}')]),
        ),
        # text that does not start with a call is content, JSON in it included
        ('The answer is {"a": 1}', ('The answer is {"a": 1}', [])),
        ('{"a": 1}', ('{"a": 1}', [])),
        ('\n{"name": "nope", "parameters": {}}', ('\n{"name": "nope", "parameters": {}}', [])),
        (
            '<|python_tag|>brave_search.call(query="x")',
            ('<|python_tag|>brave_search.call(query="x")', []),
        ),
        ("   ", ("   ", [])),
        # after the calls, the rest is content
        (LLAMA_WEATHER + "\nDone.", ("Done.", [("get_weather", '{"city": "Paris"}')])),
        # a call that breaks: its arguments up to the break, the rest dropped
        (
            '{"name": "get_time", "parameters": {"tz": 1]}; {"name": "get_time"}',
            (None, [("get_time", '{"tz": 1')]),
        ),
    ],
)
def test_llama3_json_text_becomes_content_and_calls_whatever_the_split(text, message):
    assert _every_split(llama, text) == message


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            '[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
            '{"name": "get_time", "parameters": {}}]',
            (None, [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]),
        ),
        (
            ' [{"parameters": {"a": [{"b": "]"}]}, "name": "get_time"}] ',
            (None, [("get_time", '{"a": [{"b": "]"}]}')]),
        ),
        # not held to the schema (no grammar engine): no call read -> content
        ("I will not.", ("I will not.", [])),
        ('[{"name": "rm", "parameters": {}}]', ('[{"name": "rm", "parameters": {}}]', [])),
    ],
)
def test_required_array_becomes_calls_whatever_the_split(text, message):
    assert _every_split(lambda: RequiredParser(NAMES), text) == message


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"city": "Paris"}', (None, [("get_weather", '{"city": "Paris"}')])),
        ('\n {"city": {"n": [1]}}\n', (None, [("get_weather", '{"city": {"n": [1]}}')])),
        ("Paris", ("Paris", [])),
    ],
)
def test_named_function_output_is_its_arguments_whatever_the_split(text, message):
    assert _every_split(lambda: NamedParser("get_weather"), text) == message


def test_deltas_have_openais_shape_and_hold_back_the_tags():
    """The first delta of a call has index, id, type and name; the next ones only text to
    append to its arguments; no chunk's content holds any of the markup."""
    text = f"Checking.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>"
    (content, calls), deltas = _run(hermes(), [*text, ""])
    assert content == "Checking." and [c[0] for c in calls] == ["get_weather", "get_time"]
    assert "".join(d["content"] for d in deltas) == "Checking."
    entries = [e for d in deltas for e in d["tool_calls"]]
    firsts = [e for e in entries if "id" in e]
    assert [(e["index"], e["type"], e["function"]["name"]) for e in firsts] == [
        (0, "function", "get_weather"),
        (1, "function", "get_time"),
    ]
    assert all(e["id"].startswith("call_") for e in firsts)
    assert firsts[0]["id"] != firsts[1]["id"]
    for e in entries:
        if "id" not in e:
            assert set(e) == {"index", "function"} and set(e["function"]) == {"arguments"}
    args = [
        "".join(e["function"].get("arguments", "") for e in entries if e["index"] == i)
        for i in (0, 1)
    ]
    assert args == ['{"city": "Paris"}', "{}"]
    # arguments stream as they are written: more than one piece for the longer call
    assert sum(1 for e in entries if e["index"] == 0) > 2


# -- random calls and splits ---------------------------------------------------------------
_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)
_CALL = st.tuples(
    st.sampled_from(sorted(NAMES)), st.dictionaries(st.text(max_size=6), _VALUES, max_size=3)
)
_PROSE = st.text(st.characters(blacklist_characters="<{"), max_size=12).map(str.strip)


@settings(max_examples=300, deadline=None)
@given(
    before=_PROSE,
    calls=st.lists(_CALL, min_size=1, max_size=3),
    indent=st.sampled_from([None, 2]),
    cuts=st.lists(st.integers(0, 400), max_size=6),
)
def test_random_hermes_calls_parse_back_whatever_the_pieces(before, calls, indent, cuts):
    """Calls written as Qwen's template writes them come back with the same names and
    arguments (as JSON), however the text is cut."""
    blocks = [
        "<tool_call>\n" + json.dumps({"name": n, "arguments": a}, indent=indent) + "\n</tool_call>"
        for n, a in calls
    ]
    text = "\n".join(([before] if before else []) + blocks)
    points = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[i:j] for i, j in zip([0, *points], [*points, len(text)], strict=True)]
    (content, got), _ = _run(hermes(), pieces)
    assert content == (before or None)
    assert [(n, json.loads(a)) for n, a in got] == [(n, a) for n, a in calls]
    assert _run(hermes(), [text])[0] == (content, got)


def _llama_text(calls: list[tuple[str, dict]], indent: int | None) -> str:
    return "<|python_tag|>" + "; ".join(
        json.dumps({"name": n, "parameters": a}, indent=indent) for n, a in calls
    )


def _required_text(calls: list[tuple[str, dict]], indent: int | None) -> str:
    return json.dumps([{"name": n, "parameters": a} for n, a in calls], indent=indent)


@settings(max_examples=150, deadline=None)
@given(
    calls=st.lists(_CALL, min_size=1, max_size=3),
    indent=st.sampled_from([None, 2]),
    cuts=st.lists(st.integers(0, 400), max_size=6),
    fmt=st.sampled_from(["llama", "required", "named"]),
)
def test_random_calls_of_the_other_formats_parse_back_whatever_the_pieces(calls, indent, cuts, fmt):
    if fmt == "named":
        calls = calls[:1]
        text = json.dumps(calls[0][1], indent=indent)
        make: Callable[[], ToolParser] = lambda: NamedParser(calls[0][0])  # noqa: E731
    elif fmt == "llama":
        text, make = _llama_text(calls, indent), llama
    else:
        text, make = _required_text(calls, indent), lambda: RequiredParser(NAMES)
    points = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[i:j] for i, j in zip([0, *points], [*points, len(text)], strict=True)]
    (content, got), _ = _run(make, pieces)
    assert content is None
    assert [(n, json.loads(a)) for n, a in got] == [(n, a) for n, a in calls]
    assert _run(make, [text])[0] == (content, got)
