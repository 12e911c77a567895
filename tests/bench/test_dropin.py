"""`mooncake bench dropin` (mooncake/bench/dropin.py, dropin_driver.py): the driver's command
line, strict parsing of its replies, the side-by-side rows, and real runs: upstream's side
where MOONCAKE_UPSTREAM_PYTHON has upstream Mooncake, ours once this tree has upstream's API
names (mooncake.store.MooncakeDistributedStore, mooncake.engine.TransferEngine)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

import mooncake.cli.bench_dropin  # noqa: F401  (registers the verb)
from mooncake.bench import dropin_driver
from mooncake.bench.dropin import (
    NUM_PHASES,
    Phase,
    SideResult,
    SideSpec,
    compare,
    ours_available,
    parse_phase,
    run_side,
)
from mooncake.bench.upstream import probe
from mooncake.cli.app import app
from mooncake.errors import ConfigError, StoreError


def test_driver_arguments_are_checked() -> None:
    a = dropin_driver.parse_args(
        ["client", "--master", "h:1", "--target", "h:2", "--target-addr", "9"]
    )
    assert (a.mode, a.master, a.metadata, a.target_addr, a.duration) == (
        "client",
        "h:1",
        "P2PHANDSHAKE",
        9,
        1.0,
    )
    for bad in (
        ["node", "--segment-bytes", "1"],  # no master
        ["node", "--master", "h:1"],  # no segment
        ["client", "--master", "h:1"],  # no target
        ["target", "--duration", "0"],
        ["server"],
    ):
        with pytest.raises(SystemExit):
            dropin_driver.parse_args(bad)


def test_phase_figures_are_bytes_over_summed_call_time() -> None:
    got = dropin_driver.phase_figures("c", "put", 1000, [0.001, 0.003, 0.002])
    assert got == {
        "cell": "c",
        "op": "put",
        "bytes_per_call": 1000,
        "calls": 3,
        "gbps": 0.0005,
        "p50_us": 2000.0,
    }


def test_replies_are_parsed_strictly() -> None:
    line = {
        "cell": "c",
        "op": "get",
        "bytes_per_call": 4096,
        "calls": 3,
        "gbps": 1.5,
        "p50_us": 9.0,
    }
    assert parse_phase(json.dumps(line).encode()) == Phase("c", "get", 4096, 3, 1.5, 9.0)
    with pytest.raises(StoreError, match="put returned -600"):
        parse_phase(b'{"error": "put returned -600"}')
    for bad in (b"not json", json.dumps({**line, "calls": 0}).encode(), b'{"cell": "c"}'):
        with pytest.raises(StoreError, match="bad reply"):
            parse_phase(bad)


def test_rows_pair_both_sides_with_the_ratio() -> None:
    ours = SideResult("ours", [Phase("c", "put", 1, 1, 2.0, 10.0), Phase("d", "w", 1, 1, 1.0, 5.0)])
    theirs = SideResult("upstream", [Phase("c", "put", 1, 1, 1.0, 20.0)])
    rows = compare(ours, theirs)
    assert [(r.cell, r.op, r.ratio) for r in rows] == [("c", "put", 2.0), ("d", "w", None)]
    assert (rows[0].ours_p50_us, rows[0].upstream_p50_us) == (10.0, 20.0)
    assert rows[1].upstream_gbps is None
    assert [r.ratio for r in compare(SideResult("ours", error="x"), theirs)] == [None]


def test_verb_refuses_a_missing_upstream_python(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MOONCAKE_UPSTREAM_PYTHON", raising=False)
    result = CliRunner().invoke(app, ["bench", "dropin", "--sides", "upstream"])
    assert isinstance(result.exception, ConfigError)
    assert "--upstream" in str(result.exception)
    result = CliRunner().invoke(app, ["bench", "dropin", "--sides", "theirs"])
    assert isinstance(result.exception, ConfigError)


def _upstream_python() -> str:
    python = os.environ.get("MOONCAKE_UPSTREAM_PYTHON", "")
    if not python or not Path(python).exists():
        pytest.skip("MOONCAKE_UPSTREAM_PYTHON is not set (scripts/upstream-venv makes one)")
    try:
        probe(python)
    except StoreError as e:
        pytest.skip(f"MOONCAKE_UPSTREAM_PYTHON lacks upstream Mooncake: {e}")
    return python


def _check_side(side: SideResult) -> None:
    assert side.error == ""
    assert len(side.phases) == NUM_PHASES
    assert all(p.gbps > 0 and p.p50_us > 0 and p.calls >= 1 for p in side.phases)
    assert [p.op for p in side.phases][-1] == "write"


@pytest.mark.cluster
def test_upstreams_side_runs_the_workload() -> None:
    _check_side(run_side(SideSpec.upstream(_upstream_python()), 0.1, 0.0, 128 << 20))


@pytest.mark.cluster
def test_our_side_runs_the_workload() -> None:
    if lack := ours_available():
        pytest.skip(f"this tree lacks upstream's API names yet: {lack}")
    _check_side(run_side(SideSpec.ours(), 0.1, 0.0, 128 << 20))
