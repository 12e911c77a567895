"""`mooncake profile`: the fit recovers known costs; the command writes a loadable model."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from mooncake.cli.app import app, load_verbs
from mooncake.conductor.costmodel import CostModel
from mooncake.errors import ConfigError
from mooncake.model.profiling import PREFILL_POWERS, Sample, fit_poly2


def test_the_fit_recovers_an_exact_quadratic():
    def cost(x: float, y: float) -> float:
        return 0.01 + 2e-5 * (x - y) + 3e-9 * (x * x - y * y)

    samples = [
        Sample(x, y, cost(x, y)) for x in (512, 1024, 2048, 4096) for y in (0, 256, 512, x // 2)
    ]
    poly = fit_poly2(samples, PREFILL_POWERS, ("input_len", "reused_len"))
    assert poly.fit_error.max_rel < 1e-6 and poly.fit_error.num_samples == len(samples)
    coef = {t.powers: t.coef for t in poly.terms}
    assert coef[(2, 0)] == pytest.approx(3e-9, rel=1e-4)
    assert coef[(0, 1)] == pytest.approx(-2e-5, rel=1e-4)


def test_too_few_samples_is_a_config_error():
    with pytest.raises(ConfigError, match="cannot fit 6 terms"):
        fit_poly2([Sample(1, 0, 1.0)], PREFILL_POWERS, ("input_len", "reused_len"))


def test_profile_command_writes_a_cost_model_the_conductor_loads(tmp_path: Path):
    load_verbs()
    out = tmp_path / "cost.json"
    args = [
        "profile",
        "--out",
        str(out),
        "--input-lens",
        "16,32,48",
        "--reuse-fractions",
        "0,0.5",
        "--batch-sizes",
        "1,2,3",
        "--contexts",
        "8,16",
        "--decode-steps",
        "2",
        "--repeat",
        "1",
    ]
    result = CliRunner().invoke(app, args, env={"MOONCAKE_MODEL_BLOCK_TOKENS": "8"})
    assert result.exit_code == 0, result.output
    model = CostModel.load(out)
    assert model.spec.source == "profile" and model.spec.model == "dummy:tiny"
    assert model.spec.prefill.fit_error.num_samples == 6  # (16|32|48) x (0|half) reused
    assert model.prefill_time(48, 0) > 0 and model.decode_step_time(2, 32) > 0
    assert "wrote" in result.output
