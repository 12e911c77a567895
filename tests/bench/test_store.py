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


@pytest.mark.cluster
def test_bench_store_local_json_has_a_row_per_api_with_the_documented_keys() -> None:
    args = [
        "bench",
        "store",
        "--local",
        "--sizes",
        "4KiB",
        "--duration",
        "0.2",
        "--warmup",
        "0.2",
        "--json",
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert [r["api"] for r in rows] == ["bytes", "zero-copy", "batch"]
    for r in rows:
        assert r["value_bytes"] == 4096
        assert r["protocol"] == "tcp"  # --protocol defaults to the remote path
        for key in (
            "put_gbps",
            "get_gbps",
            "put_p50_us",
            "get_p50_us",
            "put_p99_us",
            "get_p99_us",
            "num_puts",
            "num_gets",
        ):
            assert r[key] > 0, (r["api"], key)
        assert r["put_p50_us"] <= r["put_p99_us"] and r["get_p50_us"] <= r["get_p99_us"]
        # the same-run floor (a plain socket round trip with the value) for single-key APIs
        has_floor = r["socket_put_p50_us"] > 0 and r["socket_get_p50_us"] > 0
        assert has_floor == (r["api"] != "batch"), r
        assert r["repeats"] == 1


@pytest.mark.cluster
def test_repeated_cells_report_the_median_of_each_figure() -> None:
    args = [
        "bench",
        "store",
        "--local",
        "--apis",
        "zero-copy",
        "--sizes",
        "4KiB,8KiB",
        "--duration",
        "0.1",
        "--warmup",
        "0",
        "--repeat",
        "3",
        "--json",
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert [(r["value_bytes"], r["repeats"]) for r in rows] == [(4096, 3), (8192, 3)]
    assert all(r["num_puts"] >= 3 and r["num_gets"] >= 3 for r in rows)


def test_median_row_takes_each_figure_apart_and_sums_the_calls() -> None:
    from mooncake.bench.store import StoreBenchRow, median_row

    def row(gbps: float, p50: float, calls: int) -> StoreBenchRow:
        return StoreBenchRow(
            api="bytes",
            value_bytes=4096,
            keys_per_call=1,
            protocol="tcp",
            put_gbps=gbps,
            get_gbps=2 * gbps,
            put_p50_us=p50,
            put_p99_us=3 * p50,
            get_p50_us=p50 / 2,
            get_p99_us=p50,
            num_puts=calls,
            num_gets=calls,
            upstream_put_gbps=gbps / 2,
            upstream_get_gbps=gbps / 4,
            upstream_put_p50_us=p50 + 1,
            upstream_get_p50_us=p50 + 2,
        )

    m = median_row([row(1.0, 300.0, 10), row(3.0, 100.0, 20), row(2.0, 900.0, 30)])
    assert (m.put_gbps, m.get_gbps, m.put_p50_us, m.put_p99_us, m.get_p50_us) == (
        2.0,
        4.0,
        300.0,
        900.0,
        150.0,
    )
    assert (
        m.upstream_put_gbps,
        m.upstream_get_gbps,
        m.upstream_put_p50_us,
        m.upstream_get_p50_us,
    ) == (1.0, 0.5, 301.0, 302.0)
    assert (m.num_puts, m.num_gets, m.repeats) == (60, 60, 3)
    assert median_row([row(1.0, 5.0, 1)]).repeats == 1


def test_the_table_shows_upstreams_same_run_figures_and_our_ratios_when_measured() -> None:
    from rich.console import Console

    from mooncake.bench.store import StoreBenchRow
    from mooncake.cli.bench_store import _table

    r = StoreBenchRow(
        api="zero-copy",
        value_bytes=1 << 20,
        keys_per_call=1,
        protocol="tcp",
        put_gbps=1.5,
        get_gbps=0.5,
        put_p50_us=700.0,
        put_p99_us=900.0,
        get_p50_us=2000.0,
        get_p99_us=3000.0,
        num_puts=10,
        num_gets=10,
        upstream_put_gbps=1.0,
        upstream_get_gbps=1.0,
        upstream_put_p50_us=1000.0,
        upstream_get_p50_us=1000.0,
    )
    console = Console(width=400, record=True)
    console.print(_table([r], "t", has_upstream=True))
    text = console.export_text()
    assert "1.00/1.00" in text and "1,000/1,000" in text and "1.50x/0.50x" in text
    assert "PAPER.md" not in text  # the quoted reference only without --upstream
    console.print(_table([r], "t", has_upstream=False))
    assert "1.0/1.4 GB/s" in console.export_text()  # PAPER.md's zero-copy 1 MiB figures


def test_bench_store_rejects_an_unknown_protocol_with_a_clear_error() -> None:
    result = CliRunner().invoke(app, ["bench", "store", "--local", "--protocol", "udp"])
    assert isinstance(result.exception, ConfigError)
    assert "--protocol" in str(result.exception)
