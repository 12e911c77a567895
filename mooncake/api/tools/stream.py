"""A parser's events as OpenAI's chat API sends them: stream deltas and the whole message.

Streamed (as OpenAI and vLLM send them): a chunk's `delta` holds the new `content` and
`tool_calls` entries; a call's first entry has `index`, `id`, `type` and `function.name`
(and `function.arguments`, "" or the first of them), later ones `index` and text to append
to `function.arguments`. Whole: `message.content` (None when the message is only calls)
and `message.tool_calls` (`id`, `type`, `function.name`, `function.arguments`).

`finish_reason` is "tool_calls" when the model called (OpenAI's), unless the output
stopped for its length, or the call was a named `tool_choice`, which OpenAI and vLLM end
with "stop".
"""

from __future__ import annotations

from typing import Any

from mooncake.api.tools.parsers import Arguments, CallStart, Content, Event, ToolParser

Body = dict[str, Any]


class ToolStream:
    """The tool calls of one output; `delta` and `finish` change its state."""

    def __init__(self, parser: ToolParser, is_named: bool = False):
        self.parser, self.is_named = parser, is_named
        self.content: list[str] = []
        self.calls: list[Body] = []  # whole tool_calls entries, as they grow

    def delta(self, text: str, is_last: bool = False) -> tuple[str, list[Body]]:
        """(new content, new tool_calls delta entries) for `text` appended to the output;
        `is_last`: the output is over (held-back text is decided)."""
        events = self.parser.feed(text)
        if is_last:
            events += self.parser.end()
        return self._apply(events)

    def _apply(self, events: list[Event]) -> tuple[str, list[Body]]:
        content: list[str] = []
        entries: list[Body] = []
        for e in events:
            if isinstance(e, Content):
                content.append(e.text)
            elif isinstance(e, CallStart):
                function = {"name": e.name, "arguments": ""}
                self.calls.append({"id": e.id, "type": "function", "function": dict(function)})
                entries.append(
                    {"index": e.index, "id": e.id, "type": "function", "function": function}
                )
            elif isinstance(e, Arguments):
                self.calls[e.index]["function"]["arguments"] += e.text
                last = entries[-1] if entries else None
                if last is not None and last["index"] == e.index:
                    last["function"]["arguments"] = last["function"].get("arguments", "") + e.text
                else:
                    entries.append({"index": e.index, "function": {"arguments": e.text}})
        text = "".join(content)
        self.content.append(text)
        return text, entries

    def message(self) -> tuple[str | None, list[Body]]:
        """(content, tool_calls) of the whole message so far: content None when there are
        calls and no text."""
        text = "".join(self.content)
        return (None if self.calls and not text else text), self.calls

    def finish_reason(self, reason: str | None) -> str | None:
        if reason == "stop" and self.calls and not self.is_named:
            return "tool_calls"
        return reason
