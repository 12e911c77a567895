"""The master serves /metrics as `[metrics]` says: on its own port (and then not on the API
port), on the API port behind the API key (metrics.port = 0), or nowhere (enabled =
false). Real master processes, started as `mooncake up --role master` is."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(90)]
KEY = "k-metrics"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def _master(tmp_path: Path, name: str, metrics: str) -> Iterator[tuple[str, subprocess.Popen]]:
    """A master with `metrics` as its [metrics] section; yields (API URL, process)."""
    config = tmp_path / f"{name}.toml"
    config.write_text(
        f'[cluster]\nmaster = "127.0.0.1:{_free_port()}"\nsecret = "{"s" * 32}"\n'
        '[model]\npath = "dummy:llama3-8b"\n'  # a shape the Conductor has a roofline for
        f'[api]\nhost = "127.0.0.1"\nport = {_free_port()}\napi_keys = ["{KEY}"]\n'
        f"[metrics]\n{metrics}\n"
    )
    env = {**os.environ, "MOONCAKE_LOG_LEVEL": "warning"}
    cmd = [sys.executable, "-m", "mooncake", "up", "--role", "master", "--config", str(config)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None and proc.stderr is not None
        line = proc.stdout.readline()  # the ready handshake
        assert line, proc.stderr.read()
        yield json.loads(line)["url"], proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_metrics_follow_the_metrics_section(tmp_path: Path):
    own_port, off_port = _free_port(), _free_port()
    key = {"Authorization": f"Bearer {KEY}"}
    with ExitStack() as stack:
        own = stack.enter_context(
            _master(tmp_path, "own", f'host = "127.0.0.1"\nport = {own_port}')
        )
        on_api = stack.enter_context(_master(tmp_path, "api", "port = 0"))
        off = stack.enter_context(_master(tmp_path, "off", f"enabled = false\nport = {off_port}"))
        with httpx.Client(timeout=10) as http:
            # its own port: served there (no key: bind metrics.host privately), not on the API
            assert http.get(own[0] + "/metrics", headers=key).status_code == 404
            resp = http.get(f"http://127.0.0.1:{own_port}/metrics")
            assert resp.status_code == 200 and "mooncake_nodes" in resp.text
            # on the API port: behind the API key, like every /v1 route
            assert http.get(on_api[0] + "/metrics").status_code == 401
            resp = http.get(on_api[0] + "/metrics", headers=key)
            assert resp.status_code == 200 and "mooncake_api_requests_in_flight" in resp.text
            # disabled: nowhere (the API answers 404; the configured port has no listener)
            assert http.get(off[0] + "/metrics", headers=key).status_code == 404
            assert http.get(off[0] + "/v1/models", headers=key).status_code == 200
            with socket.socket() as s:
                assert s.connect_ex(("127.0.0.1", off_port)) != 0
        paths = {url: httpx.get(url + "/openapi.json").json()["paths"] for url, _ in (own, off)}
        assert all("/metrics" not in p for p in paths.values())
