"""`bench engine --parts gguf` end to end on a tiny GGUF: both loaders and both decoders
run, and the report's ratios are the quotients of its timings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the engine needs torch")
pytest.importorskip("gguf", reason="test-only dependency: pip install gguf")
pytest.importorskip("transformers", reason="test-only dependency: transformers accelerate")


def test_bench_engine_gguf_reports_load_and_decode_ratios(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from mooncake.cli.app import app, load_verbs
    from tests.model.test_gguf import _hf_model, _write_gguf

    path = _write_gguf(tmp_path / "tiny.gguf", _hf_model("llama"), "llama")
    args = f"bench engine --parts gguf --gguf {path} --gguf-batches 1,2 --gguf-prompt-len 8"
    args += " --gguf-new-tokens 4 --block-tokens 16 --repeat 1 --json"
    load_verbs()
    result = CliRunner().invoke(app, args.split())
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)["gguf"]
    assert report["load_speedup"] == report["hf_load_s"] / report["load_s"]
    for b in (1, 2):
        r = report[f"decode_batch_{b}"]
        assert r["tokens_per_s"] > 0 and r["hf_tokens_per_s"] > 0
        assert r["ratio"] == pytest.approx(r["tokens_per_s"] / r["hf_tokens_per_s"])


def test_bench_engine_gguf_names_a_missing_file(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from mooncake.cli.app import app, load_verbs

    load_verbs()
    args = ["bench", "engine", "--parts", "gguf", "--gguf", str(tmp_path / "none.gguf")]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "500"})  # one line per message
    assert result.exit_code == 2 and "none.gguf: no such file" in result.output
