"""A local cluster (real processes on loopback) for the role tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from mooncake.local.cost import ensure_cost_model
from mooncake.local.launcher import LocalLauncher, LocalPlan

MAIN = "from mooncake.cli.app import main\nmain()\n"  # `start_node`'s script: the node as is


@contextmanager
def local_cluster(run_dir: Path, cost_cache: Path, **plan_kw: object) -> Iterator[LocalLauncher]:
    """Start a cluster (API on a free port, runfile under `run_dir`), stop it after."""
    old = os.environ.get("XDG_RUNTIME_DIR")
    os.environ["XDG_RUNTIME_DIR"] = str(run_dir)
    plan = LocalPlan(api_port=0, run_dir=run_dir, **plan_kw)  # type: ignore[arg-type]
    launcher = LocalLauncher(plan)
    try:
        launcher.start(str(ensure_cost_model(plan, cost_cache)))
        yield launcher
    finally:
        launcher.stop()
        if old is None:
            os.environ.pop("XDG_RUNTIME_DIR", None)
        else:
            os.environ["XDG_RUNTIME_DIR"] = old


def kill(cluster: LocalLauncher, node_id: str) -> None:
    """SIGKILL a node of the cluster and reap it."""
    child = next(c for c in cluster.children if c.node_id == node_id)
    child.proc.send_signal(signal.SIGKILL)
    child.proc.wait()


def stop_procs(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM each of `procs`, then reap them (SIGKILL what outlives a minute)."""
    for p in procs:
        p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def node_row(url: str, node_id: str) -> dict[str, Any]:
    """The node's row of the master's /v1/status ({} when the master does not list it)."""
    nodes = httpx.get(url + "/v1/status", timeout=10).json()["nodes"]
    return next((n for n in nodes if n["node_id"] == node_id), {})


def start_node(
    cluster: LocalLauncher,
    role: str,
    node_id: str,
    script: str,
    log: Path,
    env: dict[str, str],
    sets: tuple[str, ...] = (),
) -> subprocess.Popen[bytes]:
    """Start `mooncake up --role ROLE` of the cluster's config under `python -c script` (the
    real node with one function wrapped from the test side, or `MAIN`), with `--set` of
    each of `sets`; returns once it is ready."""
    cmd = [sys.executable, "-c", script, "up", "--role", role]
    cmd += ["--config", str(cluster.config_path), "--set", f"node.id={node_id}"]
    for item in sets:
        cmd += ["--set", item]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=log.open("wb"), env={**os.environ, **env}
    )
    assert proc.stdout is not None
    for line in proc.stdout:  # the ready handshake
        if json.loads(line).get("ready"):
            return proc
    raise AssertionError(f"{node_id} exited: {log.read_text()[-2000:]}")
