"""`mooncake bench store --local` runs end to end (master and store node as child processes
with a ready handshake) and prints one JSON row per API with the documented keys."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import mooncake.cli.bench_store  # noqa: F401  (registers the verb)
from mooncake.cli.app import app
from mooncake.errors import ConfigError

pytestmark = pytest.mark.timeout(90)


def test_bench_store_local_json_has_a_row_per_api_with_the_documented_keys() -> None:
    args = ["bench", "store", "--local", "--sizes", "4KiB", "--duration", "0.2", "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert [r["api"] for r in rows] == ["bytes", "zero-copy", "batch"]
    for r in rows:
        assert r["value_bytes"] == 4096
        assert r["protocol"] == "tcp"  # --protocol defaults to the remote path
        for key in ("put_gbps", "get_gbps", "put_p50_us", "get_p50_us", "put_p99_us",
                    "get_p99_us", "num_puts", "num_gets"):  # fmt: skip
            assert r[key] > 0, (r["api"], key)
        assert r["put_p50_us"] <= r["put_p99_us"] and r["get_p50_us"] <= r["get_p99_us"]
        # the same-run floor (a plain socket round trip with the value) for single-key APIs
        has_floor = r["socket_put_p50_us"] > 0 and r["socket_get_p50_us"] > 0
        assert has_floor == (r["api"] != "batch"), r


def test_bench_store_rejects_an_unknown_protocol_with_a_clear_error() -> None:
    result = CliRunner().invoke(app, ["bench", "store", "--local", "--protocol", "udp"])
    assert isinstance(result.exception, ConfigError)
    assert "--protocol" in str(result.exception)
