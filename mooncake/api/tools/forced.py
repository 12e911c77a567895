"""`tool_choice="required"` and a named function: the grammar engine holds the output to a
JSON schema made from the tools (`Guided(kind="json_schema")`), and these parsers read
that JSON, not the model's own call format, so that the calls always parse (vLLM's way).

- required: a JSON array of at least one (at most one with `parallel_tool_calls=false`)
  `{"name": <one of the tools>, "parameters": <that tool's parameters>}`: vLLM's schema
  (vllm/tool_parsers/utils.py, `_get_json_schema_from_tools`), each tool's `$defs` moved
  to the top so that its `#/$defs/...` references still resolve.
- named: the function's parameters object itself; the call's name is known at once.

Output that is not such JSON (a backend without the grammar engine, random weights) is
plain content when no call could be read from it, as the other parsers treat text.
"""

from __future__ import annotations

from typing import Any

from mooncake.api.tools.jsonscan import JsonScanner
from mooncake.api.tools.parsers import CallSpan, ToolParser

_WS = " \t\n\r"
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
_DEFS_KEYS = ("$defs", "definitions")  # 2019-09+ and draft-07 spellings


class ToolSchemaError(ValueError):
    """The tools cannot be combined into one schema (two `$defs` of one name differ)."""


def required_schema(functions: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """The schema of a `required` answer; `functions` are the tools' `function` objects."""
    items: list[dict[str, Any]] = []
    defs: dict[str, dict[str, Any]] = {key: {} for key in _DEFS_KEYS}
    for f in functions:
        params = dict(f.get("parameters") or _NO_PARAMETERS)
        for key in _DEFS_KEYS:
            for name, definition in (params.pop(key, None) or {}).items():
                if defs[key].setdefault(name, definition) != definition:
                    raise ToolSchemaError(
                        f"two tools define {key}/{name} differently; with tool_choice "
                        "'required' their definitions share one schema: rename one"
                    )
        items.append(
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [f["name"]]},
                    "parameters": params,
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    schema.update({key: d for key, d in defs.items() if d})
    return schema


def named_schema(function: dict[str, Any]) -> dict[str, Any]:
    return dict(function.get("parameters") or _NO_PARAMETERS)


class RequiredParser(ToolParser):
    """Reads `[{"name": ..., "parameters": {...}}, ...]` as calls."""

    def __init__(self, names: frozenset[str], parallel: bool = True):
        super().__init__(names, parallel)
        self.mode = "start"  # start | array | text (plain content) | drop (after the array)
        self.scan = JsonScanner(record_depth=1)
        self.base = 0  # buf offset of "["
        self.spans: list[CallSpan] = []  # one per element object
        self.indexes: list[int | None] = []  # each element's call index (None: dropped)

    def _run(self, is_final: bool) -> None:
        buf = self.buf
        if self.mode == "start":
            rest = buf[self.pos :].lstrip(_WS)
            if not rest:
                self.mode = "text" if is_final else "start"
            else:
                self.base = self.pos = len(buf) - len(rest)
                self.mode = "array" if rest[0] == "[" else "text"
        if self.mode == "array":
            self._array(is_final)
        if self.mode == "text":
            self._content(buf[self.pos :])
            self.pos = len(buf)
        elif self.mode == "drop":
            self.pos = len(buf)

    def _array(self, is_final: bool) -> None:
        scan, buf = self.scan, self.buf
        while self.pos < len(buf) and not (scan.is_done or scan.is_error):
            if scan.step(buf[self.pos]):
                self.pos += 1
            if len(scan.records) > len(self.spans):
                self._send_arguments()  # the previous call's, before the next one starts
                self.spans.append(CallSpan(self.names, ("parameters",)))
                self.indexes.append(None)
            if self.spans:
                span, record = self.spans[-1], scan.records[len(self.spans) - 1]
                if span.update(buf, self.base, record, scan.is_error):
                    self.indexes[-1] = self._start_call(span.name)
                if span.state == "not_call":
                    return self._stop()
        self._send_arguments()
        if scan.is_done or scan.is_error or is_final:
            self._stop()

    def _send_arguments(self) -> None:
        if self.spans and self.spans[-1].state == "call":
            record = self.scan.records[len(self.spans) - 1]
            args = self.spans[-1].new_arguments(self.buf, self.base, record, self.scan.pos)
            self._arguments(self.indexes[-1], args)

    def _stop(self) -> None:
        """The array (or what could be read of it) is over."""
        if self.num_calls == 0:
            self.pos, self.mode = 0, "text"
        else:
            self.mode = "drop"


class NamedParser(ToolParser):
    """Reads the parameters object of the named function as its one call."""

    def __init__(self, name: str):
        super().__init__(frozenset({name}))
        self.name = name
        self.mode = "start"  # start | object | text | drop
        self.scan = JsonScanner(record_depth=0)
        self.base = 0
        self.index: int | None = None
        self.num_sent = 0  # characters of the object sent as arguments

    def _run(self, is_final: bool) -> None:
        buf = self.buf
        if self.mode == "start":
            rest = buf[self.pos :].lstrip(_WS)
            if rest.startswith("{"):
                self.base = self.pos = len(buf) - len(rest)
                self.index, self.mode = self._start_call(self.name), "object"
            elif rest or is_final:
                self.mode = "text"
        if self.mode == "object":
            scan = self.scan
            while self.pos < len(buf) and scan.step(buf[self.pos]):
                self.pos += 1
            self._arguments(self.index, buf[self.base + self.num_sent : self.base + scan.pos])
            self.num_sent = scan.pos
            if scan.is_done or scan.is_error:
                self.mode = "drop"
        if self.mode == "text":
            self._content(buf[self.pos :])
            self.pos = len(buf)
        elif self.mode == "drop":
            self.pos = len(buf)
