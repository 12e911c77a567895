"""JsonScanner agrees with `json.loads` on what is a JSON object or array (every prefix of
one is accepted; a text with one bad character is not), and its member spans are the
members' values."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake.api.tools.jsonscan import JsonScanner

_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=6),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=10,
)
_OBJECTS = st.dictionaries(st.text(max_size=4), _VALUES, max_size=4)


def _scan(text: str, record_depth: int = 0) -> JsonScanner:
    scan = JsonScanner(record_depth)
    for ch in text:
        if not scan.step(ch):
            break
    return scan


@settings(max_examples=400, deadline=None)
@given(value=_OBJECTS, indent=st.sampled_from([None, 0, 2]), ascii_only=st.booleans())
def test_a_json_object_is_accepted_whole_and_its_members_are_spanned(value, indent, ascii_only):
    text = json.dumps(value, indent=indent, ensure_ascii=ascii_only)
    scan = _scan(text)
    assert scan.is_done and scan.done_at == len(text) == scan.pos
    (span,) = scan.records
    assert (span.start, span.end) == (0, len(text))
    for key, member in value.items():
        start, end = span.members[key]
        assert json.loads(text[start:end]) == member


@settings(max_examples=200, deadline=None)
@given(calls=st.lists(_OBJECTS, max_size=4))
def test_objects_of_a_top_level_array_are_recorded(calls):
    text = json.dumps(calls)
    scan = _scan(text, record_depth=1)
    assert scan.is_done and len(scan.records) == len(calls)
    for span, call in zip(scan.records, calls, strict=True):
        assert span.end is not None and json.loads(text[span.start : span.end]) == call


@settings(max_examples=1500, deadline=None)
@given(
    value=_OBJECTS,
    at=st.integers(0, 10_000),
    ch=st.sampled_from(list('{}[]",:0-1.eE+tfnu\\ ax\x01')),
)
def test_one_inserted_character_is_refused_exactly_when_json_refuses_it(value, at, ch):
    text = json.dumps(value)
    at %= len(text) + 1
    text = text[:at] + ch + text[at:]
    scan = _scan(text)
    try:
        json.loads(text)
        is_json = True
    except ValueError:
        is_json = False
    is_whole = scan.is_done and not text[scan.done_at :].strip()
    assert is_whole == is_json, text
    if scan.is_error:  # pos: the longest prefix that can start a JSON value
        assert scan.pos < len(text)
        _scan_prefix = _scan(text[: scan.pos])
        assert not _scan_prefix.is_error
