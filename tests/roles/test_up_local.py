"""`mooncake up --local` as a user runs it: it prints the URL once every node is ready, and
Ctrl-C stops every process it started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from mooncake.roles.local import LocalPlan, ensure_cost_model

pytestmark = pytest.mark.timeout(180)


def test_ctrl_c_stops_every_process(tmp_path: Path, cost_cache: Path) -> None:
    cost = ensure_cost_model(LocalPlan(), cost_cache)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path), "COLUMNS": "200"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "mooncake", "up", "--local", "--port", "0", "--prefill", "1",
         "--group-size", "1", "--run-dir", str(tmp_path), "--cost-model", str(cost)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline()  # the handshake: printed once the cluster serves
    assert "ready" in line, line
    url = line.split("ready")[1].split()[1]
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    children = psutil.Process(proc.pid).children(recursive=True)
    assert len(children) == 4  # master, prefill, decode, store
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 0
    deadline = time.monotonic() + 10
    while any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children):
        assert time.monotonic() < deadline, [c.pid for c in children if c.is_running()]
        time.sleep(0.1)
    assert not (tmp_path / f"mooncake-{os.getuid()}" / "local.json").exists()
