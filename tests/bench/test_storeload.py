"""`bench store --clients`: client processes load a real local master (file journal) and
report every call they made; histograms merge into exact counts and bounded percentiles;
bad replies and bad options are clear errors; upstream's driver runs the same loop (and,
only where MOONCAKE_UPSTREAM_PYTHON has upstream Mooncake, loads upstream's master)."""

from __future__ import annotations

import json
import runpy

import pytest
from typer.testing import CliRunner

import mooncake.cli.bench_store  # noqa: F401  (registers the verb)
from mooncake.bench import storeload
from mooncake.bench.storeload import (
    BIN_RATIO,
    ClientFigures,
    bin_of,
    merge,
    parse_figures,
    percentile_us,
)
from mooncake.bench.storeloadrun import (
    PROFILE_RATE_HZ,
    LoadPlan,
    busy_share,
    run_load,
    top_entries,
)
from mooncake.bench.upstream import DRIVER, UpstreamLoad
from mooncake.cli.app import app
from mooncake.errors import ConfigError, StoreError
from tests.bench.test_upstream import _upstream_python

pytestmark = pytest.mark.timeout(180)
SECRET = b"a-secret-for-the-load-bench-tests"


def test_a_latency_falls_in_the_bin_whose_edges_hold_it() -> None:
    for us in (1.0, 7.3, 150.0, 12_345.0):
        b = bin_of(us / 1e6)
        assert BIN_RATIO**b <= us * (1 + 1e-9) and us < BIN_RATIO ** (b + 1), (us, b)


def test_percentiles_of_a_histogram_are_within_one_bin_of_the_samples() -> None:
    samples = [100.0] * 50 + [200.0] * 49 + [5000.0]
    hist: dict[int, int] = {}
    for us in samples:
        hist[bin_of(us / 1e6)] = hist.get(bin_of(us / 1e6), 0) + 1
    assert percentile_us(hist, 50) == pytest.approx(100.0, rel=0.02)
    assert percentile_us(hist, 99) == pytest.approx(200.0, rel=0.02)
    assert percentile_us(hist, 100) == pytest.approx(5000.0, rel=0.02)
    assert percentile_us({}, 50) == 0.0


def test_merged_clients_sum_their_calls_over_the_longest_client_time() -> None:
    a = ClientFigures({"put": 10, "get": 20}, {"put": {300: 10}, "get": {200: 20}}, 2.0)
    b = ClientFigures({"put": 30, "remove": 40}, {"put": {300: 30}, "remove": {100: 40}}, 1.0)
    row = merge("ours", 512, [a, b])
    assert (row.clients, row.seconds, row.ops_per_s) == (2, 2.0, 50)
    assert row.op_ops_per_s == {"put": 20, "get": 10, "exists": 0, "remove": 20}
    assert row.op_p50_us["remove"] == round(BIN_RATIO**100.5, 1)
    assert row.p50_us == round(BIN_RATIO**200.5, 1)  # 40 of 100 calls at bin 100, 20 at 200


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        (b"not json", "bad reply"),
        (b'{"ops": {"put": 1}}', "bad reply"),  # no histograms, no seconds
        (b'{"error": "client 3: it broke"}', "client 3: it broke"),
    ],
)
def test_a_bad_client_reply_is_a_store_error_naming_what_was_wrong(line: bytes, needle: str):
    with pytest.raises(StoreError, match=needle):
        parse_figures(line)


@pytest.mark.cluster
def test_clients_load_a_real_master_and_report_every_call_of_the_mix() -> None:
    """Two client processes against a local master with a file journal: every op of the
    mix is made (in the mix's proportions) and the keys are gone afterwards."""
    plan = LoadPlan(clients=(2,), journals=("file",), duration_s=0.5, pool_bytes=32 << 20)
    [row] = run_load(plan, SECRET)
    assert (row.master, row.clients, row.value_bytes) == ("ours (file journal)", 2, 512)
    ops = row.op_ops_per_s
    assert all(ops[op] > 0 for op in storeload.OPS), ops
    # per cycle: 1 put, 2 gets, 2 exists, 1 remove (each client stops mid-cycle at most)
    assert abs(ops["get"] - 2 * ops["put"]) <= 2 * 2 / row.seconds + 1, ops
    assert 0 < row.p50_us <= row.p99_us
    assert row.master_cores > 0  # the master worked for them


def test_an_unknown_journal_or_client_count_is_refused_with_the_choices() -> None:
    with pytest.raises(ConfigError, match="none, file|choose from"):
        run_load(LoadPlan(clients=(1,), journals=("sqlite",)), SECRET)
    for bad in ("etcd0", "etcd4w", "etcdw-1", "etcd100"):
        with pytest.raises(ConfigError, match="etcdN / etcdNwM"):
            run_load(LoadPlan(clients=(1,), journals=(bad,)), SECRET)
    result = CliRunner().invoke(app, ["bench", "store", "--clients", "eight"])
    assert isinstance(result.exception, ConfigError)
    assert "--clients" in str(result.exception)


def test_etcd_journal_variants_set_the_group_commit_and_say_so() -> None:
    from mooncake.bench.storeloadrun import _etcd_variant
    from mooncake.bench.storeprocs import JournalSpec

    base = JournalSpec("etcd", "http://127.0.0.1:2379", "pw")
    assert _etcd_variant(base, "etcd") == (base, "etcd journal")
    spec, label = _etcd_variant(base, "etcd4w0.5")
    assert (spec.in_flight, spec.window_s) == (4, 0.0005)
    assert label == "etcd journal, 4 in flight, 0.5 ms window"
    spec, label = _etcd_variant(base, "etcd2")
    assert (spec.in_flight, spec.window_s, label) == (2, -1.0, "etcd journal, 2 in flight")


def test_top_entries_rank_functions_by_their_own_samples(tmp_path) -> None:
    path = tmp_path / "stacks.txt"
    path.write_text("main;serve;encode 6\nmain;serve 3\nmain;tick;expire 1\n")
    top = top_entries(path, 2)
    assert top == [("encode", 0.6, 0.6), ("serve", 0.3, 0.9)]
    assert busy_share(path, 1.0) == 10 / PROFILE_RATE_HZ  # samples only while the GIL is held


def test_the_drivers_load_loop_is_the_benchs() -> None:
    """upstream_driver.py repeats Workload's loop (it cannot import our package)."""
    driver = runpy.run_path(str(DRIVER), run_name="not_main")
    assert driver["LOAD_STEPS"] == storeload.STEPS
    assert driver["LOAD_OPS"] == storeload.OPS
    for name in ("RING_KEYS", "PREFILL_BATCH", "BIN_RATIO"):
        assert driver[name] == getattr(storeload, name), name


@pytest.mark.cluster
def test_upstreams_master_is_loaded_by_its_own_clients_the_same_way() -> None:
    python = _upstream_python()
    with UpstreamLoad(python, 32 << 20, 2) as up:
        figures = up.run(512, 0.3)
    row = merge("upstream", 512, figures)
    assert row.clients == 2 and all(row.op_ops_per_s[op] > 0 for op in storeload.OPS)
    assert json.loads(json.dumps(row.op_p50_us))["get"] > 0
