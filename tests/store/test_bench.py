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
    args = ["bench", "store", "--local", "--sizes", "4KiB", "--duration", "0.2", "--warmup",
            "0.2", "--json"]  # fmt: skip
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
        assert r["repeats"] == 1


def test_repeated_cells_report_the_median_of_each_figure() -> None:
    args = ["bench", "store", "--local", "--apis", "zero-copy", "--sizes", "4KiB,8KiB",
            "--duration", "0.1", "--warmup", "0", "--repeat", "3", "--json"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert [(r["value_bytes"], r["repeats"]) for r in rows] == [(4096, 3), (8192, 3)]
    assert all(r["num_puts"] >= 3 and r["num_gets"] >= 3 for r in rows)


def test_median_row_takes_each_figure_apart_and_sums_the_calls() -> None:
    from mooncake.store.bench import StoreBenchRow, median_row

    def row(gbps: float, p50: float, calls: int) -> StoreBenchRow:
        return StoreBenchRow(
            api="bytes", value_bytes=4096, keys_per_call=1, protocol="tcp", put_gbps=gbps,
            get_gbps=2 * gbps, put_p50_us=p50, put_p99_us=3 * p50, get_p50_us=p50 / 2,
            get_p99_us=p50, num_puts=calls, num_gets=calls,
        )  # fmt: skip

    m = median_row([row(1.0, 300.0, 10), row(3.0, 100.0, 20), row(2.0, 900.0, 30)])
    assert (m.put_gbps, m.get_gbps, m.put_p50_us, m.put_p99_us, m.get_p50_us) == (
        2.0, 4.0, 300.0, 900.0, 150.0)  # fmt: skip
    assert (m.num_puts, m.num_gets, m.repeats) == (60, 60, 3)
    assert median_row([row(1.0, 5.0, 1)]).repeats == 1


def test_bench_store_rejects_an_unknown_protocol_with_a_clear_error() -> None:
    result = CliRunner().invoke(app, ["bench", "store", "--local", "--protocol", "udp"])
    assert isinstance(result.exception, ConfigError)
    assert "--protocol" in str(result.exception)
