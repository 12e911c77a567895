"""`mooncake serve` as a user runs it: a child process that prints its URL once it
listens (the ready handshake), serves chat over the OpenAI API with its key, reads flags
over a config file, and exits cleanly on SIGTERM."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.timeout(90)


@pytest.mark.cluster
def test_serve_prints_its_url_serves_chat_and_stops_on_sigterm(tmp_path: Path):
    config = tmp_path / "serve.toml"
    config.write_text(
        '[model]\npath = "dummy:tiny"\nblock_tokens = 16\n'
        "[decode]\nmax_batch = 4\nmax_tokens_default = 3\n"
        "[metrics]\nport = 0\n[api]\nport = 1\n"
    )
    env = {**os.environ, "MOONCAKE_LOG_LEVEL": "warning"}
    cmd = [
        sys.executable,
        "-m",
        "mooncake",
        "serve",
        "--config",
        str(config),
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--api-key",
        "k1",
        "--kv-cache",
        "4MiB",
        "--served-model-name",
        "tiny",
        "--threads",
        "1",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None and proc.stderr is not None
        line = proc.stdout.readline()  # printed once the server accepts connections
        match = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
        assert match, (line, proc.stderr.read() if proc.poll() is not None else "")
        url = match.group(1)
        assert f"metrics {url}/metrics" in line  # metrics.port = 0: on the API port
        headers = {"Authorization": "Bearer k1"}
        with httpx.Client(base_url=url, headers=headers, timeout=30) as http:
            models = http.get("/v1/models").json()["data"]
            assert [(m["id"], m["max_model_len"]) for m in models] == [("tiny", 1024)]
            body = {
                "model": "tiny",
                "messages": [{"role": "user", "content": "hi"}],
                "ignore_eos": True,
            }
            resp = http.post("/v1/chat/completions", json=body).json()
            assert resp["usage"]["completion_tokens"] == 3  # decode.max_tokens_default
            assert http.get("/v1/status").json()["num_completed"] == 1
            prompt = [{"role": "user", "content": "hello " * 9}]
            long = {**body, "temperature": 0, "messages": prompt}
            first, again = (http.post("/v1/chat/completions", json=long).json() for _ in "12")
            assert again["choices"][0]["message"] == first["choices"][0]["message"]
            cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in (first, again)]
            assert cached[0] == 0 and cached[1] >= 48  # prefix caching is on by default
            assert "mooncake_api_ttft_seconds" in http.get("/metrics").text
            assert http.get("/v1/models", headers={"Authorization": "Bearer x"}).status_code == 401
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_with_an_unknown_model_names_it():
    from typer.testing import CliRunner

    from mooncake.cli.app import app, load_verbs
    from mooncake.errors import ConfigError

    load_verbs()
    result = CliRunner().invoke(app, ["serve", "--model", "dummy:nope", "--port", "0"])
    assert isinstance(result.exception, ConfigError)
    assert "dummy:nope" in str(result.exception)


@pytest.mark.cluster
def test_serve_listens_where_it_says_on_this_machine_only_by_default():
    """No --host, no api.host: the API and its own metrics port bind 127.0.0.1, and the
    line printed names the address bound (not a wildcard shown as 127.0.0.1)."""
    import psutil

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        metrics_port = s.getsockname()[1]
    env = {**os.environ, "MOONCAKE_LOG_LEVEL": "warning"}
    env = {k: v for k, v in env.items() if not k.startswith(("MOONCAKE_API_", "MOONCAKE_METRICS_"))}
    flags = (
        f"--model dummy:tiny --port 0 --kv-cache 4MiB --threads 1 --set metrics.port={metrics_port}"
    )
    cmd = [sys.executable, "-m", "mooncake", "serve", *flags.split()]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None and proc.stderr is not None
        line = proc.stdout.readline()
        match = re.search(r"listening on http://127\.0\.0\.1:(\d+) \(", line)
        assert match, (line, proc.stderr.read() if proc.poll() is not None else "")
        api_port = int(match.group(1))
        assert f"metrics http://127.0.0.1:{metrics_port}/metrics" in line
        listening = {
            (c.laddr.ip, c.laddr.port)
            for c in psutil.Process(proc.pid).net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN
        }
        assert listening == {("127.0.0.1", api_port), ("127.0.0.1", metrics_port)}
        url = f"http://127.0.0.1:{api_port}"
        assert httpx.get(url + "/metrics", timeout=10).status_code == 404  # it has its own port
        metrics = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10)
        assert "mooncake_api_ttft_seconds" in metrics.text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.cluster
def test_requests_still_running_after_the_drain_end_with_an_error(tmp_path: Path):
    """SIGTERM: once api.drain_s is over, a request still running ends with an error: a
    stream with an SSE error event and [DONE] (not a cut chunked body), a whole response
    with a 503; the server exits 0 with no traceback."""
    cmd = [
        sys.executable,
        "-m",
        "mooncake",
        "serve",
        "--model",
        "dummy:tiny",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--threads",
        "1",
        "--set",
        "api.drain_s=0",
        "--set",
        "metrics.enabled=false",
    ]
    with (tmp_path / "stderr").open("w") as stderr:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        assert proc.stdout is not None
        match = re.search(r"listening on (http://127\.0\.0\.1:\d+)", proc.stdout.readline())
        assert match, (tmp_path / "stderr").read_text()
        url = match.group(1) + "/v1/completions"
        body = {"prompt": [7] * 8, "max_tokens": 1000, "ignore_eos": True}
        with ThreadPoolExecutor(1) as pool:
            whole = pool.submit(httpx.post, url, json=body, timeout=60)
            deadline = time.monotonic() + 30
            while httpx.get(match.group(1) + "/v1/status").json()["num_running"] < 1:
                assert time.monotonic() < deadline and not whole.done()
                time.sleep(0.05)
            events: list[str] = []
            with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line.removeprefix("data: "))
                    if len(events) == 1:
                        proc.send_signal(signal.SIGTERM)
            assert events[-1] == "[DONE]" and 2 < len(events) < 1001, events[-3:]
            error = json.loads(events[-2])["error"]
            assert error["code"] == 503 and "shutting down" in error["message"], error
            assert whole.result().status_code == 503
            assert "shutting down" in whole.result().json()["error"]["message"]
        assert proc.wait(timeout=30) == 0
        assert "Traceback" not in (tmp_path / "stderr").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
