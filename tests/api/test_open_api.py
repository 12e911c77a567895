"""Who may use the API: a master (or `serve`) that others could reach without a key refuses
to start unless told `api.allow_unauthenticated`; keys come from a private file
(`api.api_keys_file`) or the environment, never needing a command line. Real master
processes, started as `mooncake up --role master` is."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from mooncake.api.server import check_open_api, is_loopback
from mooncake.cli.app import app, load_verbs
from mooncake.config.api import ApiConfig
from mooncake.errors import ConfigError
from mooncake.local.launcher import free_port

pytestmark = pytest.mark.timeout(90)
REFUSAL = "lets other hosts reach the API, and no API key is set"


def _start_master(tmp_path: Path, api: str, env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    """A master with `api` in its [api] section; (the process, its ready line or "" when
    it exited before it was ready)."""
    config = tmp_path / "master.toml"
    config.write_text(
        f'[cluster]\nmaster = "127.0.0.1:{free_port()}"\nsecret = "{"s" * 32}"\n'
        '[model]\npath = "dummy:tiny"\n[scheduler]\ncost_model_path = ""\n'
        f"[api]\nport = {free_port()}\n{api}\n[metrics]\nenabled = false\n"
    )
    cmd = [sys.executable, "-m", "mooncake", "up", "--role", "master", "--config", str(config)]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **env}
    )
    assert proc.stdout is not None
    return proc, proc.stdout.readline()


def _stop(proc: subprocess.Popen) -> str:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.communicate(timeout=30)[1]
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.communicate()[1]


@pytest.mark.cluster
def test_a_master_others_could_reach_without_a_key_refuses_to_start(tmp_path: Path):
    """(The documented defaults, api.host = 0.0.0.0 and no key, once served /v1/status to
    the network without a word.) It fails at once, naming what to set."""
    proc, line = _start_master(tmp_path, 'host = "0.0.0.0"', {})
    stderr = _stop(proc)
    assert line == "" and proc.returncode == 2, (line, stderr)
    flat = " ".join(stderr.split())
    assert REFUSAL in flat and "api.allow_unauthenticated = true" in flat, stderr
    assert "api.api_keys_file" in flat and "MOONCAKE_API_API_KEYS" in flat, stderr


@pytest.mark.cluster
def test_keys_from_a_private_file_and_the_environment_guard_the_api(tmp_path: Path):
    keys_file = tmp_path / "api-keys"
    keys_file.write_text("# one key a line\nsk-from-file\n\n")
    keys_file.chmod(0o600)
    api = f'host = "127.0.0.1"\napi_keys_file = "{keys_file}"'
    proc, line = _start_master(tmp_path, api, {"MOONCAKE_API_API_KEYS": "sk-env-1,sk-env-2"})
    try:
        assert line, _stop(proc)
        url = json.loads(line)["url"] + "/v1/status"
        assert httpx.get(url, timeout=10).status_code == 401
        for key, status in [("sk-from-file", 200), ("sk-env-2", 200), ("# one key a line", 401)]:
            resp = httpx.get(url, headers={"Authorization": f"Bearer {key}"}, timeout=10)
            assert resp.status_code == status, (key, resp.text)
    finally:
        _stop(proc)


def test_a_keys_file_others_may_read_or_that_is_not_yours_is_refused(tmp_path: Path):
    path = tmp_path / "keys"
    path.write_text("sk-1\n")
    config = ApiConfig(api_keys=("sk-0",), api_keys_file=str(path))
    for mode in (0o644, 0o640, 0o604):
        path.chmod(mode)
        with pytest.raises(ConfigError, match=f"has mode {mode:04o}.*allowed: 0600 or 0400"):
            config.load_keys()
    path.chmod(0o400)
    assert config.load_keys() == ("sk-0", "sk-1")
    if os.getuid() == 0:  # only root can give a file away
        os.chown(path, 65534, -1)
        with pytest.raises(ConfigError, match="belongs to uid 65534, not to this user"):
            config.load_keys()
    with pytest.raises(ConfigError, match="api.api_keys_file: cannot read"):
        ApiConfig(api_keys_file=str(tmp_path / "missing")).load_keys()


def test_only_a_loopback_bind_may_go_without_keys():
    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        assert is_loopback(host), host
        check_open_api(host, (), allow_unauthenticated=False)
    for host in ("0.0.0.0", "::", "", "10.0.0.1"):
        assert not is_loopback(host), host
        with pytest.raises(ConfigError, match=REFUSAL):
            check_open_api(host, (), allow_unauthenticated=False)
        check_open_api(host, ("sk-1",), allow_unauthenticated=False)
        check_open_api(host, (), allow_unauthenticated=True)


def test_serve_on_every_interface_without_a_key_refuses():
    load_verbs()
    result = CliRunner().invoke(app, ["serve", "--model", "dummy:tiny", "--host", "0.0.0.0"])
    assert isinstance(result.exception, ConfigError), result.output
    assert REFUSAL in str(result.exception)
