"""Mooncake-format request traces: one JSON object per line.

    {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, ...]}

`timestamp` is the arrival in milliseconds from the start, non-decreasing; `input_length`
and `output_length` are token counts; `hash_ids` are prefix-chained block ids, one per
`block_tokens` (512) tokens of the prompt, the last block possibly partial. A malformed
line raises `TraceError` naming the file, the line number and the field.
"""

from __future__ import annotations

import re
from pathlib import Path

import msgspec

from mooncake.errors import MooncakeError


class TraceError(MooncakeError):
    """A trace file is missing or has a malformed line."""


class TraceRecord(msgspec.Struct, frozen=True):
    timestamp: int  # ms from the start of the trace
    input_length: int  # tokens
    output_length: int  # tokens
    hash_ids: list[int]  # prefix block ids, one per block_tokens of the prompt


_DECODER = msgspec.json.Decoder(TraceRecord)
_FIELD_RE = re.compile(r"`\$\.(\w+)|field `(\w+)`")


def _field_of(message: str) -> str:
    m = _FIELD_RE.search(message)
    return f"field '{m.group(1) or m.group(2)}': " if m else ""


def parse_trace_line(line: bytes | str, where: str, block_tokens: int = 512) -> TraceRecord:
    """One record from one line; `where` ("trace.jsonl line 7") prefixes any error."""
    try:
        rec = _DECODER.decode(line)
    except msgspec.ValidationError as e:
        raise TraceError(f"{where}: {_field_of(str(e))}{e}") from e
    except msgspec.DecodeError as e:
        raise TraceError(f"{where}: not a JSON object: {e}") from e
    if rec.timestamp < 0:
        raise TraceError(f"{where}: field 'timestamp' must be >= 0 ms, got {rec.timestamp}")
    if rec.input_length < 1:
        raise TraceError(f"{where}: field 'input_length' must be >= 1, got {rec.input_length}")
    if rec.output_length < 1:
        raise TraceError(f"{where}: field 'output_length' must be >= 1, got {rec.output_length}")
    need = -(-rec.input_length // block_tokens)
    if len(rec.hash_ids) != need:
        raise TraceError(
            f"{where}: field 'hash_ids' has {len(rec.hash_ids)} ids but input_length "
            f"{rec.input_length} needs {need} blocks of {block_tokens} tokens"
        )
    return rec


def load_trace(
    path: str | Path, *, limit: int | None = None, block_tokens: int = 512, skip: int = 0
) -> list[TraceRecord]:
    """`limit` records (all when None) of a trace file after its first `skip`, validated
    (the skipped ones too: a slice is taken from a well-formed trace only). A slice keeps
    its timestamps; replays and simulations count time from its first request."""
    if skip < 0:
        raise TraceError(f"skip: expected a number of requests >= 0, got {skip}")
    path = Path(path)
    try:
        fh = path.open("rb")
    except OSError as e:
        raise TraceError(f"cannot read trace {path}: {e.strerror}") from e
    records: list[TraceRecord] = []
    last_ts = skipped = 0
    with fh:
        for lineno, line in enumerate(fh, start=1):
            if limit is not None and len(records) >= limit:
                break
            if not line.strip():
                continue
            rec = parse_trace_line(line, f"{path.name} line {lineno}", block_tokens)
            if rec.timestamp < last_ts:
                raise TraceError(
                    f"{path.name} line {lineno}: field 'timestamp' goes back in time "
                    f"({rec.timestamp} ms after {last_ts} ms); sort the trace by timestamp"
                )
            last_ts = rec.timestamp
            if skipped < skip:
                skipped += 1
            else:
                records.append(rec)
    if not records:
        after = f" after the first {skipped}" if skip else ""
        raise TraceError(f"trace {path} has no requests{after}")
    return records


def trace_span_s(records: list[TraceRecord]) -> float:
    """Seconds from the first to the last arrival at speed 1 (at least 1 ms)."""
    return max(records[-1].timestamp - records[0].timestamp, 1) / 1000.0
