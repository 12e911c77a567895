"""Every request ends, with real processes on loopback: token events lost at the master,
a client that goes away, and a decode step held while its node's RPC handlers answer.

The faults are injected from the test side, as tests/roles/test_decode_faults.py does:
the real `mooncake up` runs with one function wrapped. The master's `receive_tokens` loses
events of marked requests (prompt starting with 251: the first arrival of the final event;
252: every event); the decode node's step waits while a file exists."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from mooncake.config.load import load_config
from mooncake.local.launcher import LocalLauncher
from mooncake.roles.node.messages import (
    AckMsg,
    DecodeReleaseMsg,
    DecodeReserveMsg,
    DecodeReserveReplyMsg,
)
from mooncake.rpc import RpcClient
from tests.roles.cluster import local_cluster, node_row, start_node, stop_procs

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

DROPPING_MASTER = """
import msgspec
from mooncake.roles.master.cluster import ClusterBackend
real = ClusterBackend.receive_tokens
once = set()
def receive_tokens(self, msg):
    keep = []
    for t in msg.tokens:
        f = self.flights.get(t.req_id)
        mark = f.gen.prompt_ids[0] if f is not None else 0
        if mark == 251 and t.finish_reason is not None and t.req_id not in once:
            once.add(t.req_id)  # lost: the final event's first arrival
            continue
        if mark == 252:
            continue  # lost: every event
        keep.append(t)
    return real(self, msgspec.structs.replace(msg, tokens=keep))
ClusterBackend.receive_tokens = receive_tokens
from mooncake.cli.app import main
main()
"""

HOLDING_DECODE = """
import os, time
import mooncake.model.decode as decode
real = decode.DecodeRunner.step
hold = os.environ["MOONCAKE_TEST_HOLD"]
def step(self):
    if os.path.exists(hold):
        open(hold + ".entered", "w").close()
        while os.path.exists(hold):
            time.sleep(0.01)
    return real(self)
decode.DecodeRunner.step = step
from mooncake.cli.app import main
main()
"""

# deadline = 6 + 1 x (4 + max_tokens x 0.1) s: 10.6 s for 6 tokens
EXTRA = {
    "scheduler.rejection": "none",
    "scheduler.ttft_slo_s": 4.0,
    "scheduler.deadline_factor": 1.0,
    "scheduler.deadline_slack_s": 6.0,
    "decode.token_resend_s": 0.3,
    "decode.token_max_resends": 3,
}


def _replace(cluster: LocalLauncher, node_id: str) -> None:
    child = next(c for c in cluster.children if c.node_id == node_id)
    child.proc.send_signal(signal.SIGKILL)
    child.proc.wait()


class Faulty:
    def __init__(self, cluster: LocalLauncher, hold: Path):
        self.cluster, self.url, self.hold = cluster, cluster.url, hold
        self.secret = load_config(cluster.config_path).config.cluster.require_secret().encode()


@pytest.fixture(scope="module")
def faulty(tmp_path_factory: pytest.TempPathFactory, cost_cache: Path) -> Iterator[Faulty]:
    tmp = tmp_path_factory.mktemp("delivery")
    procs: list[subprocess.Popen[bytes]] = []
    plan = {"num_prefill": 1, "group_size": 1, "pool": False, "extra": EXTRA}
    with local_cluster(tmp, cost_cache, **plan) as cluster:
        try:
            hold = tmp / "hold"
            env = {"MOONCAKE_TEST_HOLD": str(hold)}
            _replace(cluster, "master")
            procs.append(
                start_node(cluster, "master", "master", DROPPING_MASTER, tmp / "m.log", env)
            )
            _replace(cluster, "decode-0")
            procs.append(
                start_node(cluster, "decode", "decode-0", HOLDING_DECODE, tmp / "d.log", env)
            )
            _wait(lambda: _health(cluster.url).get("status") == "ok", "the cluster is not ready")
            yield Faulty(cluster, hold)
        finally:
            stop_procs(procs)


def _health(url: str) -> dict:
    r = httpx.get(url + "/health", timeout=10)
    return r.json() if r.status_code == 200 else {}


def _wait(cond: Callable[[], bool], why: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, why
        time.sleep(0.1)


def _post(url: str, mark: int, seed: int, max_tokens: int = 6) -> httpx.Response:
    prompt = [mark] + [(i * seed + 3) % 250 + 1 for i in range(60)]
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return httpx.post(url + "/v1/completions", json=body, timeout=120)


def _assert_released(f: Faulty) -> None:
    """Nothing of the ended requests is held: no Conductor ticket, no flight, nothing
    decoding or reserved on the decode node."""
    deadline = time.monotonic() + 60
    while True:
        h, d = _health(f.url), node_row(f.url, "decode-0")
        held = [h.get("num_tickets"), h.get("num_running")]
        held += [d.get("num_running"), d.get("num_queued"), d.get("num_reserved")]
        if held == [0] * 5:
            return
        assert time.monotonic() < deadline, f"still held (tickets, flights, decode): {held}"
        time.sleep(0.1)


def test_a_lost_final_token_event_is_sent_again_and_the_request_completes(faulty: Faulty) -> None:
    """(Before: the one-way final event was lost and the HTTP request hung forever.)"""
    f = faulty
    r = _post(f.url, 251, 3)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert r.json()["usage"]["completion_tokens"] == 6
    assert _post(f.url, 7, 3).json()["choices"][0]["text"] != ""  # the cluster serves on
    _assert_released(f)


def test_events_never_acknowledged_end_the_request_with_an_error_by_its_deadline(
    faulty: Faulty,
) -> None:
    """Every event of the request is lost: the decode node sends them again, gives the
    request up after decode.token_max_resends, and the master ends the HTTP request at its
    deadline with an error naming it; every reservation and ticket is released."""
    f = faulty
    r = _post(f.url, 252, 4)
    assert r.status_code == 503, r.text
    why = "no end within its deadline of 10.6 s (its KV handed to decode-0, no token received"
    assert why in r.text, r.text
    _assert_released(f)


def test_a_client_that_goes_away_mid_stream_releases_everything(faulty: Faulty) -> None:
    f = faulty
    prompt = [5] + [(i * 11 + 3) % 250 + 1 for i in range(60)]
    body = {"prompt": prompt, "max_tokens": 60, "temperature": 0, "stream": True}
    with httpx.stream("POST", f.url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # the first token: the client leaves
    _assert_released(f)


def test_a_held_decode_step_does_not_hold_the_nodes_rpc_handlers(faulty: Faulty) -> None:
    """A decode step is held (the test holds it) while a request decodes: the node still
    answers a reservation at once. Shown by order: the answer comes while the step is
    still held. (Before: every handler took the lock the whole step held, so the call
    timed out.)"""
    f = faulty
    f.hold.touch()
    replies: list[httpx.Response] = []
    t = threading.Thread(target=lambda: replies.append(_post(f.url, 9, 5)))
    t.start()
    try:
        entered = Path(str(f.hold) + ".entered")
        _wait(entered.exists, "no decode step started")
        address = "tcp://" + node_row(f.url, "decode-0")["address"]
        with RpcClient(address, f.secret) as client:
            reply = client.call(DecodeReserveMsg(1, 64), DecodeReserveReplyMsg, timeout_s=20)
            assert f.hold.exists()  # the step is still held
            assert len(reply.block_ids) == 2  # 64 tokens of 32-token blocks
            client.call(DecodeReleaseMsg(1), AckMsg, timeout_s=20)
    finally:
        f.hold.unlink()
    t.join()
    assert replies[0].status_code == 200, replies[0].text
    _assert_released(f)
