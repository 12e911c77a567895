"""Round-number cost model files and tiny traces for simulator tests.

prefill 1 ms per new token; decode step 10 ms + 1 ms per request + 1 us per KV token;
1 byte of KV per token; links of 1 GB/s.
"""

import json
from pathlib import Path

from mooncake.conductor import CostModel
from tests.conductor.toy import toy_cost_file

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "traces" / "conversation_head300.jsonl"
STEP_1 = 0.01 + 0.001  # decode step of a batch of one, before its KV term


def write_toy_cost(
    path: Path,
    kv_capacity_tokens: int = 1_000_000,
    step_per_request_s: float = 1e-3,
    step_per_token_s: float = 1e-6,
) -> str:
    """A toy cost model file; the decode step is 10 ms + the given per-request and
    per-KV-token terms (both 0: every step takes 10 ms whatever the batch)."""
    CostModel(toy_cost_file(kv_capacity_tokens, 1e9, step_per_request_s, step_per_token_s)).save(
        path
    )
    return str(path)


def write_trace(path: Path, rows: list[tuple[int, int, int, list[int]]]) -> Path:
    """rows of (timestamp ms, input_length, output_length, hash_ids)."""
    lines = [
        json.dumps({"timestamp": t, "input_length": i, "output_length": o, "hash_ids": h})
        for t, i, o, h in rows
    ]
    path.write_text("\n".join(lines) + "\n")
    return path
