"""The same-run upstream baseline of `bench store --upstream`: the client driver's replies
are parsed strictly, an interpreter without upstream's Store is refused with a clear error,
and (only where MOONCAKE_UPSTREAM_PYTHON has upstream Mooncake) a real cell is measured."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import mooncake.cli.bench_store  # noqa: F401  (registers the verb)
from mooncake.bench.upstream import DRIVER, UpstreamStore, _Child, parse_reply, probe
from mooncake.cli.app import app
from mooncake.errors import ConfigError, StoreError

pytestmark = pytest.mark.timeout(60)

GOOD = {
    "api": "bytes",
    "value_bytes": 4096,
    "keys_per_call": 1,
    "put_gbps": 0.02,
    "get_gbps": 0.03,
    "put_p50_us": 200.0,
    "put_p99_us": 900.0,
    "get_p50_us": 130.0,
    "get_p99_us": 500.0,
    "num_puts": 10,
    "num_gets": 12,
}


def _line(**fields: object) -> bytes:
    return json.dumps({**GOOD, **fields}).encode()


def test_a_well_formed_reply_becomes_the_cell_figures() -> None:
    cell = parse_reply(_line(), "bytes", 4096, 1)
    assert (cell.put_gbps, cell.get_p50_us, cell.num_gets) == (0.02, 130.0, 12)


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        (b"not json", "bad reply"),
        (b"[1, 2]", "bad reply"),
        (json.dumps({k: v for k, v in GOOD.items() if k != "get_gbps"}).encode(), "get_gbps"),
        (_line(num_puts=0), "num_puts"),  # a cell measures at least one call
        (_line(put_gbps=-1.0), "put_gbps"),
        (_line(put_p50_us="fast"), "put_p50_us"),
        (_line(extra=1), "extra"),
        (_line(value_bytes=8192), "asked for"),  # figures of another cell
        (_line(keys_per_call=8), "asked for"),
    ],
)
def test_a_malformed_reply_is_a_store_error_naming_what_was_wrong(line: bytes, needle: str) -> None:
    with pytest.raises(StoreError, match=needle):
        parse_reply(line, "bytes", 4096, 1)


def test_an_error_reply_is_a_store_error_with_the_childs_message() -> None:
    line = json.dumps({"error": "upstream put returned -700"}).encode()
    with pytest.raises(StoreError, match=r"upstream bytes 4096 B: upstream put returned -700"):
        parse_reply(line, "bytes", 4096, 1)


@pytest.mark.cluster
def test_an_interpreter_without_upstreams_store_is_refused_with_a_pointer_to_the_script() -> None:
    # our own interpreter imports OUR mooncake.store, which has no MooncakeDistributedStore
    with pytest.raises(StoreError, match=r"cannot import upstream.*scripts/upstream-venv"):
        probe(sys.executable)
    with pytest.raises(StoreError, match=r"not a Python >= 3.11.*scripts/upstream-venv"):
        UpstreamStore("/nonexistent/bin/python", 64 << 20)


@pytest.mark.cluster
def test_the_driver_without_upstream_fails_naming_the_missing_class_before_ready() -> None:
    """Under an interpreter with only our package, the driver fails on upstream's missing
    class and never reports READY."""
    res = subprocess.run(
        [sys.executable, "-P", str(DRIVER), "client", "--master", "x:1", "--metadata", "http://x/"],
        capture_output=True,
        timeout=30,
    )
    assert res.returncode != 0
    assert b"MooncakeDistributedStore" in res.stderr, res.stderr[-500:]
    assert b"READY" not in res.stdout


@pytest.mark.cluster
@pytest.mark.parametrize(
    ("script", "needle"),
    [
        ("print('hello')", "expected READY, got b'hello'"),
        ("import sys; sys.stderr.write('boom')", "output ended"),
        ("import time; time.sleep(30)", "no reply within 0.5 s"),
    ],
)
def test_a_child_that_does_not_say_ready_is_an_error_naming_its_log(
    tmp_path: Path, script: str, needle: str
) -> None:
    child = _Child("node", [sys.executable, "-c", script], dict(os.environ), tmp_path)
    try:
        with pytest.raises(StoreError, match=needle) as err:
            child.read_line(0.5) if "sleep" in script else child.wait_ready()
        assert str(tmp_path / "node.log") in str(err.value)
    finally:
        child.stop(on_eof=False)
    assert child.proc.returncode is not None


def test_the_driver_answers_a_bad_request_with_an_error_line() -> None:
    from mooncake.bench import upstream_driver

    for line in (
        "not json",
        '{"api": "bytes"}',
        '{"api": "scatter", "size": 1, "duration": 0.1, "warmup": 0}',
    ):
        reply = upstream_driver._answer(None, line)  # type: ignore[arg-type]
        assert set(reply) == {"error"} and "bad request" in reply["error"], reply


def test_upstream_needs_local_with_a_clear_error() -> None:
    args = [
        "bench",
        "store",
        "--master",
        "tcp://127.0.0.1:1",
        "--secret",
        "x" * 16,
        "--upstream",
        sys.executable,
    ]
    result = CliRunner().invoke(app, args)
    assert isinstance(result.exception, ConfigError)
    assert "--upstream needs --local" in str(result.exception)


def _upstream_python() -> str:
    python = os.environ.get("MOONCAKE_UPSTREAM_PYTHON", "")
    if not python or not Path(python).exists():
        pytest.skip(
            "MOONCAKE_UPSTREAM_PYTHON is not set to an upstream venv's python "
            "(scripts/upstream-venv makes one)"
        )
    try:
        probe(python)
    except StoreError as e:
        pytest.skip(f"MOONCAKE_UPSTREAM_PYTHON lacks upstream Mooncake: {e}")
    return python


@pytest.mark.cluster
def test_a_tiny_cell_of_real_upstream_mooncake_is_measured_as_ours() -> None:
    python = _upstream_python()
    with UpstreamStore(python, 64 << 20) as up:
        cell = up.run("bytes", 4096, 0.2)
        batch = up.run("batch", 4096, 0.1)
        log_dir = up.log_dir
        assert (log_dir / "master.log").exists()
    assert (cell.api, cell.value_bytes, cell.keys_per_call) == ("bytes", 4096, 1)
    assert cell.num_puts >= 1 and cell.num_gets >= 1
    assert cell.put_gbps > 0 and cell.get_gbps > 0
    assert cell.put_p50_us <= cell.put_p99_us and cell.get_p50_us <= cell.get_p99_us
    assert batch.keys_per_call == 8  # the bench's rule: 8 keys of 4 KiB per call
    assert not log_dir.exists()  # a clean run leaves no logs behind


@pytest.mark.cluster
def test_bench_store_upstream_reports_upstreams_figures_in_our_rows() -> None:
    python = _upstream_python()
    args = [
        "bench",
        "store",
        "--local",
        "--apis",
        "zero-copy",
        "--sizes",
        "64KiB",
        "--duration",
        "0.1",
        "--warmup",
        "0.1",
        "--pool-size",
        "64MiB",
        "--json",
        "--upstream",
        python,
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    [row] = json.loads(result.stdout)
    for key in ("put_gbps", "get_gbps", "put_p50_us", "get_p50_us"):
        assert row[key] > 0 and row[f"upstream_{key}"] > 0, (key, row)


def test_the_drivers_loop_constants_are_the_benchs() -> None:
    """The driver repeats StoreBench.run's loop (it cannot import our package): its ring,
    batch and key-count limits must be ours, or the two sides measure different cells."""
    import runpy

    from mooncake.bench import store as bench

    driver = runpy.run_path(str(DRIVER), run_name="not_main")
    for name in ("RING_BYTES", "BATCH_BYTES", "MAX_BATCH_KEYS"):
        assert driver[name] == getattr(bench, name), name
