"""Trace parsing: valid files load; every malformed line is named with its field."""

import pytest

from mooncake.sim.trace import TraceError, load_trace, trace_span_s
from tests.sim.toy import FIXTURE, write_trace


def test_fixture_loads_with_limit():
    records = load_trace(FIXTURE)
    assert len(records) == 300
    assert records[0].input_length == 6758 and records[0].hash_ids[:3] == [0, 1, 2]
    assert len(load_trace(FIXTURE, limit=10)) == 10
    assert trace_span_s(records) == records[-1].timestamp / 1000


def test_a_slice_after_skipped_requests_keeps_its_records():
    whole = load_trace(FIXTURE)
    part = load_trace(FIXTURE, skip=100, limit=50)
    assert part == whole[100:150]
    assert load_trace(FIXTURE, skip=290) == whole[290:]
    with pytest.raises(TraceError, match="no requests after the first 300"):
        load_trace(FIXTURE, skip=300)
    with pytest.raises(TraceError, match="skip: expected"):
        load_trace(FIXTURE, skip=-1)


GOOD = '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]}'


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (
            '{"timestamp": "x", "input_length": 600, "output_length": 5, "hash_ids": [0, 1]}',
            "field 'timestamp'",
        ),
        ('{"timestamp": 0, "input_length": 600, "output_length": 5}', "field 'hash_ids'"),
        (
            '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, "a"]}',
            "field 'hash_ids'",
        ),
        (
            '{"timestamp": 0, "input_length": 0, "output_length": 5, "hash_ids": []}',
            "field 'input_length'",
        ),
        (
            '{"timestamp": 0, "input_length": 600, "output_length": 0, "hash_ids": [0, 1]}',
            "field 'output_length'",
        ),
        (
            '{"timestamp": -1, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]}',
            "field 'timestamp'",
        ),
        (
            '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0]}',
            "field 'hash_ids' has 1 ids",
        ),
        ('{"timestamp": 0, "input_length": 6', "not a JSON object"),
    ],
)
def test_malformed_line_names_line_and_field(tmp_path, line, expected):
    path = tmp_path / "t.jsonl"
    path.write_text(f"{GOOD}\n\n{line}\n")
    with pytest.raises(TraceError, match="t.jsonl line 3") as err:
        load_trace(path)
    assert expected in str(err.value)


def test_time_going_backwards_and_empty_or_missing_files(tmp_path):
    path = write_trace(tmp_path / "t.jsonl", [(5, 10, 1, [0]), (4, 10, 1, [1])])
    with pytest.raises(TraceError, match="line 2: field 'timestamp' goes back"):
        load_trace(path)
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(TraceError, match="no requests"):
        load_trace(tmp_path / "e.jsonl")
    with pytest.raises(TraceError, match="cannot read trace"):
        load_trace(tmp_path / "missing.jsonl")


def test_other_block_sizes_are_checked_against_their_size(tmp_path):
    path = write_trace(tmp_path / "t.jsonl", [(0, 300, 1, [7, 8, 9])])
    assert load_trace(path, block_tokens=128)[0].hash_ids == [7, 8, 9]
    with pytest.raises(TraceError, match="needs 1 blocks of 512"):
        load_trace(path)
