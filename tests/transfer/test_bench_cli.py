"""`mooncake bench transfer --local`: starts its own target process, measures, and prints the
JSON object other tools read (keys and sanity of values, never the timings themselves)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.cluster


@pytest.mark.parametrize(
    ("protocol", "op", "baseline"), [("tcp", "read", "socket-stream"), ("shm", "write", "memcpy")]
)
def test_local_bench_prints_the_documented_json(protocol: str, op: str, baseline: str) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "mooncake",
            "bench",
            "transfer",
            "--local",
            "--protocol",
            protocol,
            "--op",
            op,
            "--block-size",
            "64KiB",
            "--batch-size",
            "4",
            "--threads",
            "1",
            "--duration",
            "0.2",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    result = json.loads(out.stdout)
    for key in ("protocol", "op", "block_bytes", "gbps", "baseline_gbps", "p50_us", "p99_us"):
        assert key in result, key
    assert (result["protocol"], result["op"], result["block_bytes"]) == (protocol, op, 65536)
    assert result["baseline"] == baseline and result["gbps"] > 0 and result["baseline_gbps"] > 0
    assert result["num_batches"] > 0 and result["p99_us"] >= result["p50_us"] > 0
    assert result["rss_peak_bytes"] > 0 and result["target_rss_peak_bytes"] > 0


def test_the_table_off_a_terminal_keeps_every_header_and_figure() -> None:
    """Piped (no terminal, no COLUMNS) the table is as wide as it needs: nothing cut to 80."""
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "mooncake",
            "bench",
            "transfer",
            "--local",
            "--op",
            "read",
            "--block-size",
            "4KiB",
            "--batch-size",
            "1",
            "--duration",
            "0.2",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env=env,
    )
    lines = out.stdout.splitlines()
    header = next(line for line in lines if "requests/s" in line)
    for col in (
        "GB/s",
        "p50 us",
        "p99 us",
        "ratio",
        "retries",
        "RSS start/end/peak MiB",
        "target peak MiB",
    ):
        assert col in header, header
    assert "…" not in out.stdout, out.stdout
    figures = lines[lines.index(header) + 2].strip("│ ").split("│")
    assert len(figures) == 9 and all(f.strip() for f in figures), figures


def test_bad_option_is_a_clear_error() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "mooncake", "bench", "transfer", "--local", "--protocol", "udp"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "--protocol" in out.stderr


def test_busy_target_reports_the_share_its_python_thread_kept() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "mooncake",
            "bench",
            "transfer",
            "--local",
            "--op",
            "read",
            "--block-size",
            "4KiB",
            "--batch-size",
            "1",
            "--duration",
            "0.2",
            "--no-baseline",
            "--busy-target",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    result = json.loads(out.stdout)
    assert result["num_batches"] > 0 and 0 < result["target_busy_share"] <= 2.0


def test_busy_target_needs_local() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "mooncake",
            "bench",
            "transfer",
            "--target",
            "127.0.0.1:1",
            "--secret",
            "x" * 32,
            "--busy-target",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0 and "--busy-target needs --local" in out.stderr
