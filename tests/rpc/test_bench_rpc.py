"""`mooncake bench rpc` runs end to end (server child with a ready handshake) and prints JSON."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import mooncake.cli.bench_rpc  # noqa: F401  (registers the verb)
from mooncake.cli.app import app

pytestmark = pytest.mark.cluster


def test_bench_rpc_json_has_the_documented_keys() -> None:
    result = CliRunner().invoke(
        app, ["bench", "rpc", "--iterations", "100", "--warmup", "5", "--no-auth", "--json"]
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    for key in ("rpc_p50_us", "rpc_p99_us", "rpc_no_auth_p50_us", "baseline_p50_us", "ratio"):
        assert data[key] > 0, key
    assert data["rpc_p50_us"] <= data["rpc_p99_us"]
