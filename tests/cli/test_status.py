"""`mooncake status` against a real HTTP server: --once, --json, the API key, finding the
master (url > config > runfile), a master that is down or answers something else."""

from __future__ import annotations

import json
import os
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import msgspec
import pytest
from rich.console import RenderableType
from typer.testing import CliRunner

from mooncake.api.status import encode_status
from mooncake.cli.app import app, load_verbs
from mooncake.cli.status import Master, fetch_status, find_master, run_live
from mooncake.errors import ConfigError
from mooncake.local.runfile import LocalCluster, write_runfile
from tests.cli.test_statusview import flat, make_status, to_text

# --- a real master stand-in: HTTP on 127.0.0.1:0 -----------------------------------------------


class FakeMaster:
    """An HTTP server answering GET /v1/status with `body`/`code`; records Authorization."""

    def __init__(self, body: bytes, code: int = 200, api_key: str = ""):
        self.body, self.code, self.api_key = body, code, api_key
        self.auth_headers: list[str | None] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                owner.auth_headers.append(self.headers.get("Authorization"))
                code, body = owner.code, owner.body
                if owner.api_key and self.headers.get("Authorization") != f"Bearer {owner.api_key}":
                    code, body = 401, b'{"error": "invalid api key"}'
                elif self.path != "/v1/status":
                    code, body = 404, b"not found"
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.01,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


@pytest.fixture
def master() -> Iterator[FakeMaster]:
    server = FakeMaster(encode_status(make_status()))
    yield server
    server.close()


@pytest.fixture(scope="module")
def runner() -> CliRunner:
    load_verbs()
    return CliRunner()


@pytest.fixture(autouse=True)
def no_runfile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own (empty) runtime dir, so a real local cluster is never found."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    return tmp_path


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


pytestmark = pytest.mark.timeout(30)


def test_once_prints_one_frame(runner: CliRunner, master: FakeMaster) -> None:
    result = runner.invoke(app, ["status", "--url", master.url, "--once"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    assert "mooncake prod-a" in result.stdout and "10.0.0.21:7001" in result.stdout
    assert "TTFT P50 1.20 s P90 35.00 s" in flat(result.stdout)
    assert max(len(line) for line in result.stdout.splitlines()) <= 80
    assert master.auth_headers == [None]  # no key configured: no header


def test_json_is_the_snapshot_the_master_served(runner: CliRunner, master: FakeMaster) -> None:
    result = runner.invoke(app, ["status", "--url", master.url + "/", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data == msgspec.to_builtins(make_status())
    assert {"nodes", "pool", "hit_rate", "ttft_p90_s", "tbt_p90_s", "rejected"} <= set(data)


def test_api_key_is_sent_and_a_refusal_is_explained(runner: CliRunner) -> None:
    server = FakeMaster(encode_status(make_status()), api_key="sk-test-1")
    try:
        ok = runner.invoke(app, ["status", "--url", server.url, "--json", "--api-key", "sk-test-1"])
        assert ok.exit_code == 0, ok.output
        refused = runner.invoke(app, ["status", "--url", server.url, "--once"])
        assert refused.exit_code == 1
        assert "refused the API key (HTTP 401)" in flat(refused.stderr)
        assert server.auth_headers == ["Bearer sk-test-1", None]
    finally:
        server.close()


def test_unreachable_master_exits_1_with_a_message(runner: CliRunner) -> None:
    url = closed_port_url()
    for flag in ("--once", "--json"):
        result = runner.invoke(app, ["status", "--url", url, flag])
        assert result.exit_code == 1 and isinstance(result.exception, SystemExit)
        assert f"cannot reach the master at {url}/v1/status (--url)" in flat(result.stderr)
        assert result.stdout == "" and "Traceback" not in result.output


@pytest.mark.parametrize(
    ("body", "code", "message"),
    [
        (b'{"hello": "world"}', 200, "not a mooncake status snapshot"),
        (b"<html>it works</html>", 200, "not a mooncake status snapshot"),
        (b"[/bold] internal error", 500, "answered HTTP 500: [/bold] internal error"),
    ],
)
def test_an_answer_that_is_not_a_status_exits_1(
    runner: CliRunner, body: bytes, code: int, message: str
) -> None:
    server = FakeMaster(body, code)
    try:
        result = runner.invoke(app, ["status", "--url", server.url, "--once"])
    finally:
        server.close()
    assert result.exit_code == 1, result.output
    assert message in flat(result.stderr) and "Traceback" not in result.output


# --- finding the master ------------------------------------------------------------------------


def write_config(path: Path, host: str, port: int, keys: list[str]) -> Path:
    path.write_text(f'[api]\nhost = "{host}"\nport = {port}\napi_keys = {json.dumps(keys)}\n')
    return path


def test_discovery_order_is_url_then_config_then_runfile(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        find_master("", None, None)
    assert all(way in str(e.value) for way in ("--url", "--config FILE", "mooncake up --local"))
    assert str(tmp_path) in str(e.value)  # names the runfile it looked for

    cluster = LocalCluster(
        url="http://127.0.0.1:9101/",
        master="127.0.0.1:9100",
        config_path="/x.toml",
        pids={"master": os.getpid()},
        api_key="sk-local",
    )
    runfile = write_runfile(cluster)
    assert runfile.is_relative_to(tmp_path)
    found = find_master("", None, None)
    assert (found.url, found.api_key) == ("http://127.0.0.1:9101", "sk-local")
    assert found.source == f"runfile {runfile}"

    config = write_config(tmp_path / "m.toml", "0.0.0.0", 9200, ["sk-cfg", "sk-other"])
    found = find_master("", config, None)
    assert (found.url, found.api_key) == ("http://127.0.0.1:9200", "sk-cfg")
    v6 = find_master("", write_config(tmp_path / "v6.toml", "fd00::1", 9201, []), None)
    assert (v6.url, v6.api_key) == ("http://[fd00::1]:9201", "")

    found = find_master("http://10.0.0.1:8000", config, None)
    assert (found.url, found.api_key, found.source) == ("http://10.0.0.1:8000", "", "--url")
    assert find_master("http://10.0.0.1:8000", config, "sk-flag").api_key == "sk-flag"
    assert find_master("", config, "sk-flag").api_key == "sk-flag"


def test_a_runfile_of_a_dead_cluster_is_not_used() -> None:
    dead = LocalCluster(
        url="http://127.0.0.1:9101",
        master="127.0.0.1:9100",
        config_path="/x.toml",
        pids={"master": 2**22 + 12345},  # above pid_max's default: no such process
    )
    write_runfile(dead)
    with pytest.raises(ConfigError, match="no master to read"):
        find_master("", None, None)


def test_bad_url_is_refused_naming_the_flag() -> None:
    for bad in ("10.0.0.1:8000", "ftp://host", "http://"):
        with pytest.raises(ConfigError, match=r"--url: expected http://HOST:PORT"):
            find_master(bad, None, None)


def test_no_arguments_finds_the_local_cluster_and_sends_its_key(runner: CliRunner) -> None:
    server = FakeMaster(encode_status(make_status()), api_key="sk-local")
    try:
        cluster = LocalCluster(
            url=server.url,
            master="127.0.0.1:1",
            config_path="/x.toml",
            pids={"master": os.getpid()},
            api_key="sk-local",
        )
        write_runfile(cluster)
        result = runner.invoke(app, ["status", "--json"])
    finally:
        server.close()
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["cluster"] == "prod-a"
    assert server.auth_headers == ["Bearer sk-local"]


def test_config_wins_over_the_runfile_end_to_end(runner: CliRunner, tmp_path: Path) -> None:
    by_config = FakeMaster(encode_status(make_status(cluster="from-config")), api_key="sk-cfg")
    by_runfile = FakeMaster(encode_status(make_status(cluster="from-runfile")))
    try:
        cluster = LocalCluster(
            url=by_runfile.url,
            master="127.0.0.1:1",
            config_path="/x.toml",
            pids={"master": os.getpid()},
        )
        write_runfile(cluster)
        port = int(by_config.url.rsplit(":", 1)[1])
        config = write_config(tmp_path / "m.toml", "127.0.0.1", port, ["sk-cfg"])
        result = runner.invoke(app, ["status", "--config", str(config), "--json"])
    finally:
        by_config.close()
        by_runfile.close()
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["cluster"] == "from-config"
    assert by_config.auth_headers == ["Bearer sk-cfg"] and by_runfile.auth_headers == []


# --- the live loop -----------------------------------------------------------------------------


def test_live_view_says_when_the_master_is_down_keeps_retrying_and_recovers() -> None:
    server = FakeMaster(encode_status(make_status()))
    master_ = Master(server.url, "", "--url")
    frames: list[str] = []
    ok = encode_status(make_status())
    answers = iter([(500, b"master overloaded"), (200, b"{}"), (200, ok)])  # after frames 0..2

    def show(frame: RenderableType) -> None:
        frames.append(flat(to_text(frame, 80)))
        server.code, server.body = next(answers, (200, ok))

    try:
        with httpx.Client(timeout=5) as client:
            run_live(lambda: fetch_status(client, master_), show, master_, 0.01, lambda: 80, 4)
    finally:
        server.close()
    assert len(frames) == 4 and len(server.auth_headers) == 4
    assert frames[0].startswith("mooncake prod-a")
    assert frames[1].startswith("master unreachable for 0.0s") and "answered HTTP 500" in frames[1]
    assert "retrying every 0.01s" in frames[1] and "last snapshot: mooncake prod-a" in frames[1]
    assert "not a mooncake status snapshot" in frames[2]
    assert frames[3].startswith("mooncake prod-a")


def test_live_view_of_a_master_that_never_answered_retries_every_interval() -> None:
    master_ = Master(closed_port_url(), "", "--url")
    frames: list[str] = []
    with httpx.Client(timeout=5) as client:
        run_live(
            lambda: fetch_status(client, master_),
            lambda f: frames.append(flat(to_text(f, 80))),
            master_,
            0.01,
            lambda: 80,
            3,
        )
    assert len(frames) == 3
    assert all(f.startswith("master unreachable") and "cannot reach" in f for f in frames)
    assert not any("last snapshot" in f for f in frames)
