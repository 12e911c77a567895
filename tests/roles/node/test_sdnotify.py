"""The appliance around a node: sd_notify over a real NOTIFY_SOCKET (a path and an abstract
name; in-process and from a real `mooncake up --role master`), plain log lines off a
terminal, and the shipped systemd units and Containerfile."""

from __future__ import annotations

import configparser
import io
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from mooncake.cli.app import setup_logging
from mooncake.config.settings import Config
from mooncake.local.launcher import free_port
from mooncake.roles.node.common import install_signal_handlers, report_ready

pytestmark = pytest.mark.timeout(60)
DEPLOY = Path(__file__).resolve().parents[3] / "deploy"
ROLES = ("master", "prefill", "decode", "store")


def _recv(sock: socket.socket, timeout_s: float = 10.0) -> dict[str, str]:
    """One notification datagram as its KEY=VALUE assignments."""
    sock.settimeout(timeout_s)
    data = sock.recv(4096).decode()
    return dict(line.split("=", 1) for line in data.splitlines())


@pytest.fixture(params=["path", "abstract"])
def notify_socket(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator:
    """A bound AF_UNIX datagram socket, its address in NOTIFY_SOCKET as systemd sets it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    with tempfile.TemporaryDirectory(prefix="sd") as tmp:  # short: sun_path holds 108 bytes
        if request.param == "path":
            sock.bind(f"{tmp}/notify")
            monkeypatch.setenv("NOTIFY_SOCKET", f"{tmp}/notify")
        else:
            name = f"mooncake-test-{secrets.token_hex(6)}"
            sock.bind("\0" + name)
            monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        with sock:
            yield sock


def test_report_ready_sends_ready_with_status(notify_socket: socket.socket, capsys):
    report_ready(node_id="n1", role="decode")
    assert json.loads(capsys.readouterr().out) == {"ready": True, "node_id": "n1", "role": "decode"}
    msg = _recv(notify_socket)
    assert msg["READY"] == "1" and msg["STATUS"] == "decode n1 serving"


def test_signal_handler_sends_stopping_once(notify_socket: socket.socket):
    old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    stop = threading.Event()
    try:
        install_signal_handlers(stop)
        signal.raise_signal(signal.SIGTERM)
        assert stop.is_set()
        assert _recv(notify_socket)["STOPPING"] == "1"
        signal.raise_signal(signal.SIGINT)  # a second signal: the stop is under way already
        with pytest.raises(TimeoutError):
            _recv(notify_socket, timeout_s=0.3)
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def test_without_notify_socket_nothing_is_sent(monkeypatch: pytest.MonkeyPatch, capsys):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    report_ready(node_id="n1", role="store")  # no socket to reach: just the stdout line
    assert json.loads(capsys.readouterr().out)["ready"] is True


@pytest.mark.cluster
def test_master_process_notifies_ready_and_stopping(tmp_path: Path):
    config = tmp_path / "master.toml"
    config.write_text(
        f'[cluster]\nmaster = "127.0.0.1:{free_port()}"\nsecret = "{"s" * 32}"\n'
        '[model]\npath = "dummy:llama3-8b"\n'  # a shape the Conductor has a roofline for
        f'[api]\nhost = "127.0.0.1"\nport = {free_port()}\n[metrics]\nport = 0\n'
    )
    name = f"mooncake-test-{secrets.token_hex(6)}"
    env = {**os.environ, "NOTIFY_SOCKET": "@" + name, "MOONCAKE_LOG_LEVEL": "info"}
    env.pop("JOURNAL_STREAM", None)
    cmd = [sys.executable, "-m", "mooncake", "up", "--role", "master", "--config", str(config)]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        try:
            assert proc.stdout is not None and proc.stderr is not None
            assert proc.stdout.readline(), proc.stderr.read()  # the ready line on stdout
            msg = _recv(sock)
            assert msg["READY"] == "1" and msg["STATUS"] == "master master serving"
            proc.send_signal(signal.SIGTERM)
            assert _recv(sock)["STOPPING"] == "1"
            assert proc.wait(timeout=30) == 0
            # stderr is a pipe, not a terminal: plain lines, level first, no rich layout
            lines = proc.stderr.read().splitlines()
            assert any(
                ln.startswith("INFO mooncake.roles.master.role: master: API") for ln in lines
            )
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


class _Stream(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.mark.parametrize("tty, journal", [(False, False), (True, True)])
def test_plain_log_lines_off_a_terminal(
    tty: bool, journal: bool, monkeypatch: pytest.MonkeyPatch, restore_logging: None
):
    stream = _Stream(tty)
    monkeypatch.setattr(sys, "stderr", stream)
    if journal:  # systemd's journal: stderr may even be a terminal's twin, still plain
        monkeypatch.setenv("JOURNAL_STREAM", "8:12345")
    else:
        monkeypatch.delenv("JOURNAL_STREAM", raising=False)
    setup_logging("info")
    log = logging.getLogger("mooncake.test")
    long = "a message long enough that rich would wrap it at eighty columns, " * 2
    log.info(long)
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("it failed")
    out = stream.getvalue().splitlines()
    assert out[0] == "INFO mooncake.test: " + long
    assert out[1] == "ERROR mooncake.test: it failed"
    assert out[2] == "Traceback (most recent call last):" and out[-1] == "ValueError: boom"
    assert not any(ch in stream.getvalue() for ch in "╭│╰")
    later = _Stream(tty)  # a CLI run in-process (CliRunner) swaps stderr and closes it
    monkeypatch.setattr(sys, "stderr", later)
    stream.close()
    log.warning("after")
    assert later.getvalue() == "WARNING mooncake.test: after\n"


def _unit(role: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # keys keep their case
    parser.read_string((DEPLOY / "systemd" / f"mooncake-{role}.service").read_text())
    return parser


@pytest.mark.parametrize("role", ROLES)
def test_unit_files_have_the_expected_keys(role: str):
    unit = _unit(role)
    svc = unit["Service"]
    assert svc["Type"] == "notify" and svc["Restart"] == "on-failure"
    assert svc["RestartSec"] == "2" and svc["KillSignal"] == "SIGTERM" and svc["User"]
    exec_start = f"/usr/local/bin/mooncake up --role {role} --config /etc/mooncake/{role}.toml"
    assert svc["ExecStart"] == exec_start
    assert int(svc["LimitNOFILE"]) >= 65536
    assert "network-online.target" in unit["Unit"]["After"].split()
    assert "network-online.target" in unit["Unit"]["Wants"].split()
    assert int(unit["Unit"]["StartLimitBurst"]) > 0 and unit["Unit"]["StartLimitIntervalSec"]
    if role != "master":  # nodes register KV memory with RDMA
        assert svc["LimitMEMLOCK"] == "infinity"
    if role == "decode":  # its drain must end before systemd's SIGKILL
        assert float(svc["TimeoutStopSec"]) > Config().decode.drain_s
    assert unit["Install"]["WantedBy"] == "multi-user.target"


@pytest.mark.cluster
@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze here")
def test_unit_files_pass_systemd_analyze_verify(tmp_path: Path):
    # verify checks that ExecStart's program exists: point it at this checkout's mooncake
    exe = shutil.which("mooncake") or str(Path(sys.executable).parent / "mooncake")
    for role in ROLES:
        text = (DEPLOY / "systemd" / f"mooncake-{role}.service").read_text()
        (tmp_path / f"mooncake-{role}.service").write_text(
            text.replace("/usr/local/bin/mooncake", exe)
        )
    units = sorted(str(p) for p in tmp_path.glob("*.service"))
    res = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", *units], capture_output=True, text=True
    )
    assert res.returncode == 0 and res.stderr == "", res.stderr  # unknown keys only warn


def test_containerfile():
    text = (DEPLOY / "Containerfile").read_text()
    assert "FROM python:3.11-slim" in text
    assert all(lib in text for lib in ("libibverbs1", "librdmacm1", "libnuma1"))
    assert "ARG TORCH_INDEX_URL" in text and "[engine" in text
    assert 'ENTRYPOINT ["mooncake"]' in text
