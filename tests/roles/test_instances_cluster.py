"""`[node] instances = 2` on a CPU decode node: `mooncake up` starts two members, each
registered with the master under its own id, both serving; one exiting stops the node."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.roles.cluster import local_cluster, node_row

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]


def _post(url: str, seed: int) -> int:
    # NOTE: long enough (dummy:tiny's 512 positions, less the prompt) that each member's
    # decoding spans more than the one-second heartbeat that carries its num_running
    body = {
        "model": "dummy:tiny",
        "prompt": [(i * seed + 3) % 250 + 1 for i in range(64)],
        "max_tokens": 440,
        "temperature": 0,
        "ignore_eos": True,
    }
    return httpx.post(url + "/v1/completions", json=body, timeout=120).status_code


def test_two_instances_register_serve_and_stop_together(tmp_path: Path, cost_cache: Path) -> None:
    """No other decode node: both members must take requests; SIGKILL of one makes the
    parent stop the other and exit non-zero."""
    with local_cluster(tmp_path, cost_cache, num_prefill=1, group_size=1, num_decode=0) as c:
        cmd = [sys.executable, "-m", "mooncake", "up", "--role", "decode"]
        cmd += ["--config", str(c.config_path), "--set", "node.id=multi"]
        cmd += ["--set", "node.instances=2"]
        log = tmp_path / "multi.log"
        parent = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log.open("wb"))
        try:
            assert parent.stdout is not None
            ready = json.loads(parent.stdout.readline() or "{}")
            assert ready.get("ready"), log.read_text()[-3000:]
            assert [i["node_id"] for i in ready["instances"]] == ["multi-0", "multi-1"]
            for member in ("multi-0", "multi-1"):
                assert node_row(c.url, member)["state"] == "ready", member
            assert node_row(c.url, "multi") == {}  # the parent is no member itself

            codes: list[int] = []
            threads = [
                threading.Thread(target=lambda s=s: codes.append(_post(c.url, s))) for s in range(6)
            ]
            for t in threads:
                t.start()
            busy: set[str] = set()
            deadline = time.monotonic() + 60
            while busy != {"multi-0", "multi-1"} and time.monotonic() < deadline:
                rows = {m: node_row(c.url, m) for m in ("multi-0", "multi-1")}
                busy |= {m for m, r in rows.items() if r["num_running"] or r["num_reserved"]}
                time.sleep(0.05)
            for t in threads:
                t.join()
            assert codes == [200] * 6
            assert busy == {"multi-0", "multi-1"}, "both members decode requests"

            children = psutil.Process(parent.pid).children()
            assert len(children) == 2
            os.kill(children[1].pid, signal.SIGKILL)
            assert parent.wait(timeout=60) != 0
            assert not any(ch.is_running() and ch.status() != "zombie" for ch in children)
            said = " ".join(log.read_text().split())  # NOTE: rich wraps the error
            assert "multi-1 (pid" in said, said
            assert "exited with code -9; the other instances of multi were stopped" in said
        finally:
            if parent.poll() is None:
                parent.terminate()
                parent.wait(timeout=60)
