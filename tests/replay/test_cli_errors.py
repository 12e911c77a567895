"""`mooncake replay` failures the user can cause end in one clear line, never a traceback."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mooncake.cli.app import app, load_verbs
from mooncake.replay import ReplayError
from mooncake.sim.trace import TraceError

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "traces" / "conversation_head300.jsonl"

pytestmark = pytest.mark.timeout(60)
load_verbs()


def _mooncake(args: list[str], runtime_dir: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime_dir), "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "mooncake", "replay", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=50,
    )


def _closed_port() -> int:
    # A port that was just free: nothing listens there, so connecting is refused.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.cluster
def test_connection_refused_is_one_clear_error(tmp_path):
    url = f"http://127.0.0.1:{_closed_port()}"
    out = _mooncake([str(FIXTURE), "--limit", "2", "--url", url], tmp_path)
    assert out.returncode == 2, out
    assert "Traceback" not in out.stderr
    assert f"cannot reach {url}/v1/models" in out.stderr
    assert "refused" in out.stderr.lower() and "--url" in out.stderr


def test_no_url_and_no_local_cluster_says_to_pass_url(tmp_path):
    env = {"XDG_RUNTIME_DIR": str(tmp_path)}  # no runfile there
    result = CliRunner().invoke(app, ["replay", str(FIXTURE), "--limit", "2"], env=env)
    assert isinstance(result.exception, ReplayError), result.output
    assert "no --url given and no local cluster is running" in str(result.exception)
    assert "--url http://HOST:PORT" in str(result.exception)


def test_a_malformed_trace_line_is_named(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]}\n'
        '{"timestamp": 5, "input_length": "x", "output_length": 1, "hash_ids": [1]}\n'
    )
    result = CliRunner().invoke(app, ["replay", str(bad), "--url", "http://127.0.0.1:1"])
    assert isinstance(result.exception, TraceError), result.output
    assert "bad.jsonl line 2: field 'input_length'" in str(result.exception)
