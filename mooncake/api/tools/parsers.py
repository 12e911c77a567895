"""Tool calls in the text a model writes, found as the text arrives.

A parser takes the output text in pieces (`feed`, then `end` once the output is over) and
returns `Event`s: content for the message, the start of a call (index, id, name), text to
append to a call's arguments. The events do not depend on how the text was split, so a
streamed response and a whole one carry the same message (the tests feed every split).

Formats, as the model families' own chat templates teach them:
- `HermesParser`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number,
  anywhere in the text (Hermes 2 Pro, Qwen 2.5 and Qwen 3, SmolLM3; vLLM's `hermes`).
- `Llama3JsonParser`: the whole output is `{"name": ..., "parameters": {...}}` objects
  (optionally after `<|python_tag|>`, separated by ";"), as Llama 3.1-3.3's templates ask
  (vLLM's `llama3_json`). Text that does not start so is plain content.

A candidate call is held back (no content, no call) until it is known: a call once its
name is one of the request's tools and its arguments have begun with "{" (or it closed
without arguments: "{}"); plain text once it cannot be a call (bad JSON, an unknown
name, arguments that are not an object), and then its text is content as written. So no
`<tool_call>` markup leaks into content while a call may be starting. The whitespace
between content and a call is dropped. A call's arguments are the model's own JSON text
(not re-serialized), streamed as it is written: a call cut off by `max_tokens` keeps the
arguments written so far, as OpenAI's `finish_reason="length"` leaves them; so does a
call whose JSON breaks after it was made, and the rest of it (up to `</tool_call>`; for
Llama 3, the rest of the output) is dropped. With `parallel_tool_calls=false` calls after
the first are dropped.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass

from mooncake.api.tools.jsonscan import JsonScanner, ObjectSpan

_WS = " \t\n\r"


@dataclass(frozen=True)
class Content:
    text: str  # message content, in order


@dataclass(frozen=True)
class CallStart:
    index: int  # the call's position in the message's tool_calls
    id: str  # "call_..."
    name: str


@dataclass(frozen=True)
class Arguments:
    index: int
    text: str  # appended to the call's arguments (JSON text)


Event = Content | CallStart | Arguments


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class CallSpan:
    """Whether one object (an `ObjectSpan` of a scanner) is a call, and its arguments.

    `state`: pending (not known yet), call, not_call. `update` is called after each
    character the scanner took (NOTE: decisions per character keep them independent of
    how the text was split) and returns the events of a new call."""

    def __init__(self, names: frozenset[str], arg_keys: tuple[str, ...]):
        self.names, self.arg_keys = names, arg_keys
        self.state = "pending"
        self.name = ""
        self.args_key: str | None = None
        self.num_sent = 0  # characters of the arguments value sent
        self.has_empty_args = False  # the object closed without arguments: "{}"

    def update(self, text: str, base: int, span: ObjectSpan | None, is_error: bool) -> bool:
        """Decide what can be decided; True when the object became a call just now.
        `text[base + offset]` is the character at a scanner offset."""
        if self.state != "pending":
            return False
        if span is None or is_error:
            self.state = "not_call" if is_error else "pending"
            return False
        if not self.name:
            start, end = span.members.get("name", (None, None))
            if start is not None and end is not None:
                raw = text[base + start : base + end]
                name = json.loads(raw)
                if not isinstance(name, str) or name not in self.names:
                    self.state = "not_call"
                    return False
                self.name = name
        if self.args_key is None:
            self.args_key = next((k for k in span.members if k in self.arg_keys), None)
            if self.args_key is not None:
                start = span.members[self.args_key][0]
                assert start is not None
                if text[base + start] != "{":
                    self.state = "not_call"
                    return False
        if span.end is not None and not (self.name and self.args_key is not None):
            self.has_empty_args = bool(self.name) and self.args_key is None
            self.state = "call" if self.has_empty_args else "not_call"
            return self.state == "call"
        if self.name and self.args_key is not None:
            self.state = "call"
            return True
        return False

    def new_arguments(self, text: str, base: int, span: ObjectSpan, upto: int) -> str:
        """The arguments text not sent yet, up to scanner offset `upto` (what was read)."""
        if self.has_empty_args:
            out, self.has_empty_args = "{}", False
            return out
        if self.args_key is None:
            return ""
        start, end = span.members[self.args_key]
        assert start is not None
        stop = upto if end is None else min(end, upto)
        out = text[base + start + self.num_sent : base + stop]
        self.num_sent += len(out)
        return out


class ToolParser(ABC):
    """Finds calls in one output; `feed` and `end` change its state."""

    def __init__(self, names: frozenset[str], parallel: bool = True):
        self.names, self.parallel = names, parallel
        self.buf = ""  # the output so far
        self.pos = 0  # buf[:pos] is decided
        self.num_calls = 0  # calls made (those dropped by parallel=false not counted)
        self.events: list[Event] = []

    def feed(self, text: str) -> list[Event]:
        """Events for the output so far (with `text` appended)."""
        self.buf += text
        self._run(is_final=False)
        return self._take()

    def end(self) -> list[Event]:
        """Events for the rest: the output is over."""
        self._run(is_final=True)
        return self._take()

    @abstractmethod
    def _run(self, is_final: bool) -> None:
        """Decide as much of buf[pos:] as can be decided; append events."""

    def _take(self) -> list[Event]:
        out, self.events = _merged(self.events), []
        return out

    def _content(self, text: str) -> None:
        if text:
            self.events.append(Content(text))

    def _start_call(self, name: str) -> int | None:
        """A call begins: its index, or None when parallel=false drops it."""
        if not self.parallel and self.num_calls >= 1:
            return None
        self.events.append(CallStart(self.num_calls, new_call_id(), name))
        self.num_calls += 1
        return self.num_calls - 1

    def _arguments(self, index: int | None, text: str) -> None:
        if index is not None and text:
            self.events.append(Arguments(index, text))


def _merged(events: list[Event]) -> list[Event]:
    """Adjacent content, and adjacent arguments of one call, as one event."""
    out: list[Event] = []
    for e in events:
        last = out[-1] if out else None
        if isinstance(e, Content) and isinstance(last, Content):
            out[-1] = Content(last.text + e.text)
        elif isinstance(e, Arguments) and isinstance(last, Arguments) and last.index == e.index:
            out[-1] = Arguments(e.index, last.text + e.text)
        else:
            out.append(e)
    return out


class _Region:
    """A candidate call object being read: its scanner, its span, what it became."""

    def __init__(self, names: frozenset[str], arg_keys: tuple[str, ...], base: int):
        self.scan = JsonScanner(record_depth=0)
        self.call = CallSpan(names, arg_keys)
        self.base = base  # buf offset of the object's "{"
        self.index: int | None = None  # the call's index once made (None: dropped)

    @property
    def span(self) -> ObjectSpan | None:
        return self.scan.records[0] if self.scan.records else None


class _ObjectReader(ToolParser):
    """Shared by the text parsers: a state machine over buf (`mode` names the method that
    reads on from `pos`), and the reading of one candidate call object."""

    arg_keys: tuple[str, ...] = ("arguments", "parameters")
    region: _Region | None = None
    mode: str

    def _run(self, is_final: bool) -> None:
        while True:
            before = (self.mode, self.pos)
            getattr(self, "_" + self.mode)(is_final)
            if (self.mode, self.pos) == before:
                return

    @property
    def _is_call(self) -> bool:
        return self.region is not None and self.region.call.state == "call"

    def _read_object(self) -> str:
        """Step the region's object through buf; returns pending (needs more text),
        call_done (a call, closed), call_broken (a call, then bad JSON), not_call."""
        region = self.region
        assert region is not None
        scan, call, buf = region.scan, region.call, self.buf
        while self.pos < len(buf) and not scan.is_done:
            is_taken = scan.step(buf[self.pos])
            if is_taken:
                self.pos += 1
            if call.update(buf, region.base, region.span, scan.is_error):
                region.index = self._start_call(call.name)
            if call.state == "not_call":
                return "not_call"
            if not is_taken:
                break
        if call.state == "call":
            assert region.span is not None
            args = call.new_arguments(buf, region.base, region.span, scan.pos)
            self._arguments(region.index, args)
            if scan.is_error:
                return "call_broken"
            return "call_done" if scan.is_done else "pending"
        if scan.is_error:
            return "not_call"
        return "pending"


TAG, END_TAG = "<tool_call>", "</tool_call>"


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class HermesParser(_ObjectReader):
    """`<tool_call>` JSON `</tool_call>` anywhere in the text (see the module docstring)."""

    def __init__(self, names: frozenset[str], parallel: bool = True):
        super().__init__(names, parallel)
        self.mode = "text"  # text | lead (after TAG) | call | close (before END_TAG) | skip
        self.is_after_call = False  # whitespace at pos follows a call: drop it
        self.tag_at = 0  # buf offset of the region's TAG
        self.ws_at = 0  # buf offset of the whitespace before TAG (kept if not a call)

    def _text(self, is_final: bool) -> None:
        buf = self.buf
        if self.is_after_call:
            rest = buf[self.pos :]
            self.pos += len(rest) - len(rest.lstrip(_WS))
            if self.pos == len(buf):
                return
            self.is_after_call = False
        k = buf.find(TAG, self.pos)
        if k < 0:
            if is_final:
                self._content(buf[self.pos :])
                self.pos = len(buf)
                return
            held = _partial_suffix(buf, TAG)
            stop = len(buf) - held
            stop = len(buf[self.pos : stop].rstrip(_WS)) + self.pos  # may precede a TAG
            self._content(buf[self.pos : stop])
            self.pos = stop
            return
        self.ws_at = self.pos + len(buf[self.pos : k].rstrip(_WS))
        self._content(buf[self.pos : self.ws_at])
        self.tag_at, self.pos, self.mode = k, k + len(TAG), "lead"

    def _lead(self, is_final: bool) -> None:
        rest = self.buf[self.pos :]
        self.pos += len(rest) - len(rest.lstrip(_WS))
        if self.pos == len(self.buf):
            if is_final:
                self._not_call()
            return
        if self.buf[self.pos] != "{":
            self._not_call()
            return
        self.region, self.mode = _Region(self.names, self.arg_keys, self.pos), "call"

    def _call(self, is_final: bool) -> None:
        result = self._read_object()
        if result == "not_call" or (result == "pending" and is_final and not self._is_call):
            self._not_call()
        elif result == "call_done":
            self.mode = "close"
        elif result == "call_broken":
            self.mode = "skip"
        elif result == "pending" and is_final:  # a call cut off: it stays as written
            self.pos, self.mode = len(self.buf), "text"

    def _close(self, is_final: bool) -> None:
        rest = self.buf[self.pos :]
        ws = len(rest) - len(rest.lstrip(_WS))
        tail = rest[ws:]
        if tail.startswith(END_TAG):
            self.pos += ws + len(END_TAG)
        elif END_TAG.startswith(tail):  # the closing tag may be coming
            if not is_final:
                return
            self.pos = len(self.buf)  # cut off at the end: dropped
        else:
            self.pos += ws  # text after the call without END_TAG: content
        self.mode, self.is_after_call = "text", True

    def _skip(self, is_final: bool) -> None:
        k = self.buf.find(END_TAG, self.pos)
        if k >= 0:
            self.pos, self.mode, self.is_after_call = k + len(END_TAG), "text", True
        elif is_final:
            self.pos = len(self.buf)

    def _not_call(self) -> None:
        """The region is text: the whitespace and TAG as written, then read on after TAG."""
        self._content(self.buf[self.ws_at : self.tag_at + len(TAG)])
        self.pos, self.mode, self.region = self.tag_at + len(TAG), "text", None


PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser(_ObjectReader):
    """Llama 3.x JSON calls: the output starts with a call (see the module docstring)."""

    def __init__(self, names: frozenset[str], parallel: bool = True):
        super().__init__(names, parallel)
        self.mode = "start"  # start | lead (after PYTHON_TAG) | call | between | text | drop

    def _start(self, is_final: bool) -> None:
        rest = self.buf.lstrip(_WS)
        if rest.startswith(PYTHON_TAG):
            self.pos, self.mode = len(self.buf) - len(rest) + len(PYTHON_TAG), "lead"
        elif rest.startswith("{"):
            self.pos, self.mode = len(self.buf) - len(rest), "lead"
        elif is_final or not (PYTHON_TAG.startswith(rest)):
            self.mode = "text"  # plain content, from the first character

    def _lead(self, is_final: bool) -> None:
        rest = self.buf[self.pos :]
        self.pos += len(rest) - len(rest.lstrip(_WS))
        if self.pos < len(self.buf) and self.buf[self.pos] == "{":
            self.region, self.mode = _Region(self.names, self.arg_keys, self.pos), "call"
        elif self.pos < len(self.buf) or is_final:
            self._not_call()

    def _call(self, is_final: bool) -> None:
        result = self._read_object()
        if result == "not_call" or (result == "pending" and is_final and not self._is_call):
            self._not_call()
        elif result == "call_done":
            self.mode = "between"
        elif result == "call_broken" or (result == "pending" and is_final):
            self.mode = "drop"  # the rest of a broken call is not content

    def _drop(self, is_final: bool) -> None:
        self.pos = len(self.buf)

    def _between(self, is_final: bool) -> None:
        rest = self.buf[self.pos :]
        self.pos += len(rest) - len(rest.lstrip(_WS + ";"))
        if self.pos < len(self.buf):
            if self.buf[self.pos] == "{":
                self.region, self.mode = _Region(self.names, self.arg_keys, self.pos), "call"
            else:
                self.mode = "text"

    def _text(self, is_final: bool) -> None:
        self._content(self.buf[self.pos :])
        self.pos = len(self.buf)

    def _not_call(self) -> None:
        """Not a call: before any call the whole output is content, after one the rest."""
        if self.num_calls == 0:
            self.pos = 0
        elif self.region is not None:
            self.pos = self.region.base
        self.mode, self.region = "text", None
