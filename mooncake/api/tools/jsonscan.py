"""An incremental JSON checker: one character at a time, it says whether the text so far
can still be the start of a JSON value (RFC 8259), where that value ends, and where the
members of the objects at one depth begin and end, so that a tool-call parser can act on
a call's name and stream its arguments while the model is still writing them.

`JsonScanner(record_depth)` records every object that starts at `record_depth` (0: the
value itself, a call object; 1: the elements of a top-level array, the calls of a
`tool_choice="required"` answer) as an `ObjectSpan`: its start, its end, and for each
member key the span of its value. Offsets count characters of the text fed so far.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

_WS = frozenset(" \t\n\r")
_DIGITS = frozenset("0123456789")
_HEX = frozenset("0123456789abcdefABCDEF")
_ESCAPES = frozenset('"\\/bfnrt')
_LITERALS = {"t": "true", "f": "false", "n": "null"}
# number states that may end the number (RFC 8259 section 6)
_NUMBER_ENDS = frozenset({"zero", "int", "frac", "exp"})


@dataclass
class ObjectSpan:
    """An object at the recorded depth: [start, end) and each member's value span."""

    start: int
    end: int | None = None  # None while the object is open
    # member key -> [value start, value end (None while the value is open)]
    members: dict[str, list[int | None]] = field(default_factory=dict)


class JsonScanner:
    """Checks one JSON value as its characters arrive (`step`); changes its own state."""

    def __init__(self, record_depth: int = 0):
        self.record_depth = record_depth
        self.text: list[str] = []  # the characters stepped so far
        self.stack: list[str] = []  # "{" or "[" of each open container
        # what may come next: value | first_value (after "[") | first_key (after "{") | key |
        # colon | comma (after a member or element) | done | error
        self.expect = "value"
        self.lexeme = ""  # "" | string | number | literal: the token being read
        self.sub = ""  # the token's own state (string escapes, number part, literal text)
        self.token_start = 0  # offset where the token began
        self.is_key = False  # the string being read is an object key
        self.records: list[ObjectSpan] = []
        self._record_key: str | None = None  # the key whose value is next, in the record
        self.done_at: int | None = None  # offset just past the value, once it is complete

    @property
    def is_error(self) -> bool:
        return self.expect == "error"

    @property
    def is_done(self) -> bool:
        return self.expect == "done"

    @property
    def pos(self) -> int:
        return len(self.text)

    def step(self, ch: str) -> bool:
        """Take one character; False if it cannot continue the value (not taken) or the
        value is already complete. The first character must be "{" or "[" (a value that
        ends at its own last character)."""
        if self.expect in ("done", "error"):
            return False
        self.text.append(ch)
        if self.lexeme:  # NOTE: a number ends on the next character, which _lex then reads
            self._lex(ch)
            return not self.is_error
        return self._structure(ch)

    # -- tokens ---------------------------------------------------------------------------
    def _lex(self, ch: str) -> bool:
        """Feed a token; False if it is wrong (`expect` = error) or, for a number, ended
        before `ch` (which then goes to `_structure`)."""
        if self.lexeme == "string":
            return self._string(ch)
        if self.lexeme == "literal":
            word = _LITERALS[self.sub[0]]
            self.sub += ch
            if not word.startswith(self.sub):
                return self._fail()
            if self.sub == word:
                self.lexeme = ""
                self._value_end(self.pos)
            return True
        return self._number(ch)

    def _string(self, ch: str) -> bool:
        sub = self.sub
        if sub == "\\":
            if ch == "u":
                self.sub = "u"
            elif ch in _ESCAPES:
                self.sub = ""
            else:
                return self._fail()
        elif sub.startswith("u"):
            if ch not in _HEX:
                return self._fail()
            self.sub = "" if len(sub) == 4 else sub + "x"
        elif ch == "\\":
            self.sub = "\\"
        elif ch == '"':
            self.lexeme = ""
            if self.is_key:
                self._key_end(self.pos)
            else:
                self._value_end(self.pos)
        elif ord(ch) < 0x20:  # control characters must be escaped
            return self._fail()
        return True

    def _number(self, ch: str) -> bool:
        s = self.sub
        nxt = ""
        if s == "minus":
            nxt = "zero" if ch == "0" else "int" if ch in _DIGITS else ""
        elif s in ("zero", "int"):
            if ch in _DIGITS and s == "int":
                nxt = "int"
            elif ch == ".":
                nxt = "dot"
            elif ch in "eE":
                nxt = "e"
        elif s in ("dot", "frac"):
            nxt = "frac" if ch in _DIGITS else ("e" if ch in "eE" and s == "frac" else "")
        elif s in ("e", "esign"):
            nxt = "exp" if ch in _DIGITS else ("esign" if ch in "+-" and s == "e" else "")
        elif s == "exp":
            nxt = "exp" if ch in _DIGITS else ""
        if nxt:
            self.sub = nxt
            return True
        if s not in _NUMBER_ENDS:
            return self._fail()
        self.lexeme = ""
        self._value_end(self.pos - 1)  # the number ended before this character
        self._structure(ch)
        return False

    # -- structure ------------------------------------------------------------------------
    def _structure(self, ch: str) -> bool:
        if ch in _WS:
            return True
        expect, at = self.expect, self.pos - 1
        if expect in ("value", "first_value"):
            if expect == "first_value" and ch == "]":
                return self._close(at)
            return self._value_start(ch, at)
        if expect in ("first_key", "key"):
            if ch == '"':
                self.lexeme, self.sub, self.token_start, self.is_key = "string", "", at, True
                return True
            if ch == "}" and expect == "first_key":
                return self._close(at)
            return self._fail()
        if expect == "colon":
            if ch != ":":
                return self._fail()
            self.expect = "value"
            return True
        if expect == "comma":
            top = self.stack[-1]
            if ch == ",":
                self.expect = "key" if top == "{" else "value"
                return True
            if ch == ("}" if top == "{" else "]"):
                return self._close(at)
        return self._fail()

    def _value_start(self, ch: str, at: int) -> bool:
        if len(self.stack) == self.record_depth + 1 and self._record_key is not None:
            self.records[-1].members.setdefault(self._record_key, [at, None])
        if ch in "{[":
            if ch == "{" and len(self.stack) == self.record_depth:
                self.records.append(ObjectSpan(start=at))
            self.stack.append(ch)
            self.expect = "first_key" if ch == "{" else "first_value"
            return True
        self.token_start = at
        if ch == '"':
            self.lexeme, self.sub, self.is_key = "string", "", False
        elif ch == "-" or ch in _DIGITS:
            self.lexeme, self.sub = (
                "number",
                "minus" if ch == "-" else "zero" if ch == "0" else "int",
            )
        elif ch in _LITERALS:
            self.lexeme, self.sub = "literal", ch
        else:
            return self._fail()
        return True

    def _close(self, at: int) -> bool:
        opener = self.stack.pop()
        if opener == "{" and len(self.stack) == self.record_depth and self.records:
            self.records[-1].end = at + 1
        self._value_end(at + 1)
        return True

    def _key_end(self, end: int) -> None:
        if len(self.stack) == self.record_depth + 1 and self.records:
            raw = "".join(self.text[self.token_start : end])
            self._record_key = json.loads(raw)
        self.expect = "colon"

    def _value_end(self, end: int) -> None:
        """A value ended at `end` (exclusive): what comes next, and the record's member."""
        if len(self.stack) == self.record_depth + 1 and self._record_key is not None:
            span = self.records[-1].members.get(self._record_key)
            if span is not None and span[1] is None:
                span[1] = end
            self._record_key = None
        if self.stack:
            self.expect = "comma"
        else:
            self.expect, self.done_at = "done", end

    def _fail(self) -> bool:
        self.expect, self.lexeme = "error", ""
        self.text.pop()  # NOTE: `pos` counts the characters that can start a JSON value
        return False
