"""`bench grammar`'s run on a tiny model: both modes step a full batch, the guided one's
masks are filled, every random schema compiles (figures are reported, never asserted)."""

from __future__ import annotations

import json
import random

import pytest

from mooncake.bench.grammar import random_schema, run_grammar_bench

pytest.importorskip("torch")
pytest.importorskip("llguidance")


def test_the_bench_steps_both_batches_full_and_compiles_every_schema():
    f = run_grammar_bench(
        "dummy:tiny", batch=4, context_len=8, num_steps=3, num_rounds=1, num_schemas=10
    )
    assert f.batch == 4 and f.num_steps == 3 and f.num_schemas == 10
    assert f.free_step_ms > 0 and f.guided_step_ms > 0 and f.mask_fill_ms > 0
    assert f.ratio == pytest.approx(f.guided_step_ms / f.free_step_ms)
    assert 0 < f.compile_ms_p50 <= f.compile_ms_p99 <= f.compile_ms_max


def test_random_schemas_are_closed_objects_with_bounded_values():
    rng = random.Random(1)
    for _ in range(50):
        schema = random_schema(rng)
        assert schema["type"] == "object" and schema["additionalProperties"] is False
        text = json.dumps(schema)
        assert '"type": "string"}' not in text, "every string has a maxLength"
