"""A decode node whose step loop fails, and one that was stopped (SIGSTOP) while holding
work: real processes on loopback. The failing step is injected by running the real decode
node with a sampler that raises for one marked request (as a sampler bug would)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from mooncake.local.launcher import LocalLauncher
from tests.roles.cluster import local_cluster, node_row

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

# the real `mooncake up`, with a sampler that fails for requests marked top_k=7
FAULTY_DECODE = """
import mooncake.model.decode as decode
real = decode.sample
def sample(logits, batch):
    if any(p.top_k == 7 for p in batch.params):
        raise RuntimeError("probability tensor contains either inf, nan or element < 0")
    return real(logits, batch)
decode.sample = sample
from mooncake.cli.app import main
main()
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, cost_cache: Path) -> Iterator[LocalLauncher]:
    extra = {
        "scheduler.rejection": "none",
        "decode.max_step_failures": 2,
        "decode.reserve_ttl_s": 4.0,
        "decode.drain_s": 60.0,
    }
    with local_cluster(
        tmp_path_factory.mktemp("decode-faults"),
        cost_cache,
        num_prefill=1,
        group_size=1,
        pool=False,
        extra=extra,
    ) as launcher:
        yield launcher


def _post(url: str, seed: int, **params: object) -> httpx.Response:
    prompt = [(i * seed + 3) % 250 + 1 for i in range(80)]
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    body.update(params)
    return httpx.post(url + "/v1/completions", json=body, timeout=120)


def _child(cluster: LocalLauncher, node_id: str) -> subprocess.Popen[bytes]:
    return next(c.proc for c in cluster.children if c.node_id == node_id)


def _wait_health(url: str, want: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    code = 0
    while time.monotonic() < deadline:
        code = httpx.get(url + "/health", timeout=10).status_code
        if code == want:
            return
        time.sleep(0.1)
    raise AssertionError(f"/health stayed {code}, wanted {want}")


def _wait_state(url: str, node_id: str, state: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while node_row(url, node_id).get("state", "") != state:
        assert time.monotonic() < deadline, f"{node_id} never became {state}"
        time.sleep(0.1)


def _start_faulty_decode(cluster: LocalLauncher, log: Path) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable,
        "-c",
        FAULTY_DECODE,
        "up",
        "--role",
        "decode",
        "--config",
        str(cluster.config_path),
        "--set",
        "node.id=decode-0",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log.open("wb"))
    assert proc.stdout is not None
    for line in proc.stdout:  # the ready handshake
        if json.loads(line).get("ready"):
            return proc
    raise AssertionError(f"the faulty decode node exited: {log.read_text()[-2000:]}")


def test_a_failing_step_fails_its_requests_and_repeated_failures_end_the_node(
    cluster: LocalLauncher, tmp_path: Path
) -> None:
    """A step that raises ends its requests with an error naming the failure (no hang) and
    the node serves on; `max_step_failures` failed steps in a row make it report failed
    (/health 503), end what it holds and exit with an error for its supervisor."""
    url = cluster.url
    old = _child(cluster, "decode-0")
    old.send_signal(signal.SIGKILL)
    old.wait()
    proc = _start_faulty_decode(cluster, tmp_path / "decode.log")
    try:
        _wait_health(url, 200)
        bad = _post(url, 3, temperature=0.5, top_k=7)
        assert bad.status_code >= 500 and "decode step failed" in bad.text, bad.text
        assert _post(url, 4).status_code == 200  # the node goes on serving
        assert _post(url, 5, temperature=0.5, top_k=7).status_code >= 500
        last = _post(url, 6, temperature=0.5, top_k=7)  # the second failure in a row
        assert "decode step failed" in last.text or "decode node failed" in last.text, last.text
        assert proc.wait(timeout=60) != 0  # exits for its supervisor to restart it
        _wait_health(url, 503)
        assert "decode node" in httpx.get(url + "/health", timeout=10).text
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    cluster.relaunch("decode-0")
    _wait_health(url, 200)
    assert _post(url, 7).status_code == 200


def test_a_stopped_decode_node_frees_what_it_held_when_it_continues(
    cluster: LocalLauncher,
) -> None:
    """SIGSTOP a decode node while requests head for it: the master marks it down and the
    requests wait to be placed again; after SIGCONT it registers again, serves them, frees
    the reservations nobody submits (decode.reserve_ttl_s) and so stops long before its
    drain limit (decode.drain_s = 60 s)."""
    url = cluster.url
    _wait_health(url, 200)
    proc = _child(cluster, "decode-0")
    codes: list[int] = []
    threads = [
        threading.Thread(target=lambda s=s: codes.append(_post(url, s).status_code))
        for s in range(20, 24)
    ]
    proc.send_signal(signal.SIGSTOP)
    try:
        for t in threads:
            t.start()
        _wait_state(url, "decode-0", "down")
    finally:
        proc.send_signal(signal.SIGCONT)
    for t in threads:
        t.join()
    assert codes == [200] * 4  # placed again once it was back
    _wait_state(url, "decode-0", "ready")
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    assert time.monotonic() - started < 30, "it waited on reservations nobody will submit"
    cluster.relaunch("decode-0")


def test_a_decode_node_restarted_before_its_heartbeats_lapse_gets_its_requests_back(
    cluster: LocalLauncher,
) -> None:
    """A decode node killed and started again at once (as a supervisor does) registers
    under its id before the master misses a heartbeat: the master sees a new process, so
    the requests the old one held are placed again (and complete) instead of waiting on
    a node that no longer exists."""
    url = cluster.url
    _wait_health(url, 200)
    replies: list[httpx.Response] = []
    threads = [
        threading.Thread(target=lambda s=s: replies.append(_post(url, s, max_tokens=300)))
        for s in range(30, 34)
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while (
        node_row(url, "decode-0").get("num_running", 0) < 1
    ):  # some are decoding there when it dies
        assert time.monotonic() < deadline, "no request reached decode-0"
        time.sleep(0.05)
    proc = _child(cluster, "decode-0")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    cluster.relaunch("decode-0")
    assert (
        node_row(url, "decode-0").get("state", "") == "ready"
    )  # placeable once its ready line is out
    for t in threads:
        t.join()
    assert [r.status_code for r in replies] == [200] * 4, [r.text for r in replies]
    assert all(r.json()["usage"]["completion_tokens"] == 300 for r in replies)
