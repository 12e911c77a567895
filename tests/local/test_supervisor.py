"""The local cluster's supervisor restarts nodes that exit (with a doubling backoff, up to a
limit), leaves a stopped (SIGSTOP) node alone, keeps the runfile's pids true, works with API
keys on; stopping kills a node that outlives its grace and sweeps its shared memory.

First with plain processes standing for nodes (`sleep`, `sh -c 'exit 3'`), then on one
`up --local` cluster (master, prefill, decode; real processes on loopback)."""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import mooncake.local.launcher as launcher_module
from mooncake.errors import MooncakeError
from mooncake.local.cost import ensure_cost_model
from mooncake.local.launcher import LocalLauncher, LocalPlan
from mooncake.local.runfile import read_runfile
from mooncake.local.supervisor import Child, NodeEvent, RestartPolicy, Supervisor, wait_ready

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

KEY = "sk-local-test-0123456789"
NODE_IDS = {"master", "prefill-0", "decode-0"}


class Processes:
    """Nodes that are plain processes running `cmd` (what the supervisor sees of a launcher)."""

    def __init__(self, cmd: list[str], node_ids: list[str]):
        self.cmd = cmd
        self.procs = {n: subprocess.Popen(cmd) for n in node_ids}

    def processes(self) -> dict[str, subprocess.Popen[bytes]]:
        return dict(self.procs)

    def respawn(self, node_id: str) -> subprocess.Popen[bytes]:
        self.procs[node_id] = subprocess.Popen(self.cmd)
        return self.procs[node_id]

    def is_ready(self, node_id: str) -> bool:
        return True

    def close(self) -> None:
        for proc in self.procs.values():
            proc.kill()
            proc.wait()


def _next(events: queue.Queue[NodeEvent], node_id: str, kind: str) -> NodeEvent:
    """The next event about `node_id`, which must be of `kind`."""
    while True:
        event = events.get(timeout=60)
        if event.node_id == node_id:
            assert event.kind == kind, event
            return event


def test_a_crashing_node_is_restarted_with_doubling_backoff_until_the_limit() -> None:
    nodes = Processes(["sh", "-c", "exit 3"], ["decode-0"])
    policy = RestartPolicy(backoff_s=0.01, max_backoff_s=0.03, limit=3, poll_s=0.01)
    events: list[NodeEvent] = []
    try:
        reason = Supervisor(nodes, policy).run(threading.Event(), events.append)
    finally:
        nodes.close()
    seen = [(e.kind, e.num_restarts, e.backoff_s) for e in events if e.kind != "ready"]
    restarted = ("restarted", 0, 0.0)
    assert seen == [
        *[("exited", 1, 0.01), restarted, ("exited", 2, 0.02), restarted],
        *[("exited", 3, 0.03), restarted],  # the doubling stops at max_backoff_s
        ("gave_up", 3, 0.0),
    ]
    first = events[0].message
    assert first.startswith("decode-0 (pid ") and "exited with code 3" in first
    assert "restarting it in 0.02 s (2nd restart within 300 s; at most 3)" in events[2].message
    assert reason is not None and reason == events[-1].message
    assert "exited with code 3, and it was already restarted 3 times within 300 s" in reason


def test_a_node_failing_at_start_says_it_exited_not_that_it_stayed_silent() -> None:
    """Its stdout closes a moment before it can be reaped (here 0.3 s: a config error takes
    that long to print): the message has its exit code, at once, not "within 180 s"."""
    script = "import os, sys, time; os.close(1); time.sleep(0.3); sys.exit(2)"
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    started = time.monotonic()
    try:
        with pytest.raises(
            MooncakeError,
            match=r"prefill-0 \(prefill\) did not report ready: "
            r"it exited with code 2",
        ):
            wait_ready(Child("prefill-0", "prefill", proc), timeout_s=180)
    finally:
        proc.kill()
        proc.wait()
    assert time.monotonic() - started < 10


def test_a_stopped_node_is_alive_and_not_restarted() -> None:
    """SIGSTOP a node and kill another: only the dead one is restarted."""
    nodes = Processes(["sleep", "60"], ["decode-0", "prefill-0"])
    stopped, killed = nodes.procs["decode-0"], nodes.procs["prefill-0"]
    events: queue.Queue[NodeEvent] = queue.Queue()
    stop = threading.Event()
    watcher = threading.Thread(
        target=Supervisor(nodes, RestartPolicy(backoff_s=0.05, poll_s=0.01)).run,
        args=(stop, events.put),
    )
    try:
        stopped.send_signal(signal.SIGSTOP)
        watcher.start()
        killed.kill()
        assert _next(events, "prefill-0", "exited").code == -signal.SIGKILL
        assert _next(events, "prefill-0", "restarted").pid == nodes.procs["prefill-0"].pid
        _next(events, "prefill-0", "ready")  # polled once more after the restart
        assert events.empty() and nodes.procs["decode-0"] is stopped
        assert stopped.poll() is None
    finally:
        stop.set()
        watcher.join()
        stopped.send_signal(signal.SIGCONT)
        nodes.close()


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, cost_cache: Path
) -> Iterator[tuple[LocalLauncher, queue.Queue[NodeEvent]]]:
    """One supervised cluster with API keys on (1 prefill, 1 decode, no store), whose
    first choice of the master's port is taken by another socket before the master binds
    it (as any process may take a port the launcher found free): the launcher chooses again."""
    run_dir = tmp_path_factory.mktemp("supervised")
    held = socket.create_server(("127.0.0.1", 0))
    chosen: list[int] = []
    free_port = launcher_module.free_port

    def free_port_once_taken() -> int:
        port = held.getsockname()[1] if not chosen else free_port()
        chosen.append(port)
        return port

    plan = LocalPlan(
        api_port=0,
        run_dir=run_dir,
        num_prefill=1,
        group_size=1,
        pool=False,
        extra={"api.api_keys": KEY},
    )
    events: queue.Queue[NodeEvent] = queue.Queue()
    stop = threading.Event()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_RUNTIME_DIR", str(run_dir))  # the runfile goes there
        mp.setattr(launcher_module, "free_port", free_port_once_taken)
        launcher = LocalLauncher(plan, policy=RestartPolicy(backoff_s=0.1, poll_s=0.05))
        watcher = threading.Thread(target=launcher.supervise, args=(stop, events.put))
        try:
            launcher.start(str(ensure_cost_model(plan, cost_cache)))
            held.close()
            assert launcher.info is not None
            assert launcher.info.master.endswith(f":{chosen[-2]}"), (chosen, launcher.info)
            assert chosen[-2] != chosen[0], chosen  # the master's port was chosen again
            watcher.start()
            yield launcher, events
        finally:
            stop.set()
            if watcher.is_alive():
                watcher.join()
            launcher.stop()
            held.close()


def _post(url: str, **body: object) -> httpx.Response:
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 4, "temperature": 0, "ignore_eos": True, **body}
    return httpx.post(
        url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
    )


def _wait_all_ready(url: str) -> None:
    deadline = time.monotonic() + 60
    while True:
        r = httpx.get(url + "/v1/status", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
        nodes = r.json()["nodes"] if r.status_code == 200 else []
        if {n["node_id"] for n in nodes if n["state"] == "ready"} == NODE_IDS:
            return
        assert time.monotonic() < deadline, r.text
        time.sleep(0.1)


def _pid(launcher: LocalLauncher, node_id: str) -> int:
    return next(c.proc.pid for c in launcher.children if c.node_id == node_id)


def test_a_cluster_with_api_keys_starts_and_status_finds_it(
    cluster: tuple[LocalLauncher, queue.Queue[NodeEvent]],
) -> None:
    from typer.testing import CliRunner

    from mooncake.cli.app import app, load_verbs

    launcher, _ = cluster
    assert httpx.get(launcher.url + "/v1/status", timeout=10).status_code == 401
    info = read_runfile()
    assert info is not None and info.api_key == KEY
    load_verbs()
    result = CliRunner().invoke(app, ["status", "--json"])  # with the runfile's key
    assert result.exit_code == 0, result.output
    roles = sorted(n["role"] for n in json.loads(result.output)["nodes"])
    assert roles == ["decode", "master", "prefill"]


def test_a_killed_node_and_the_master_are_restarted_and_the_runfile_follows(
    cluster: tuple[LocalLauncher, queue.Queue[NodeEvent]],
) -> None:
    launcher, events = cluster
    for node_id in ("decode-0", "master"):
        old = _pid(launcher, node_id)
        os.kill(old, signal.SIGKILL)
        exited = _next(events, node_id, "exited")
        assert (exited.pid, exited.code) == (old, -signal.SIGKILL)
        assert "exited with code -9 (SIGKILL); restarting it in 0.1 s" in exited.message
        new = _next(events, node_id, "restarted").pid
        assert new == _pid(launcher, node_id) != old
        _next(events, node_id, "ready")
        info = read_runfile()  # the new master's pid and start time: still found
        assert info is not None and info.pids[node_id] == new
        _wait_all_ready(launcher.url)  # a restarted master: the nodes register again
        assert _post(launcher.url).status_code == 200


def test_stop_kills_a_node_past_its_grace_and_sweeps_its_shared_memory(
    cluster: tuple[LocalLauncher, queue.Queue[NodeEvent]],
) -> None:
    """Runs last: it stops the cluster. The decode node drains a long request, longer than
    the grace given here, so it is killed; the arenas it never unlinked are removed."""
    launcher, _ = cluster
    decode = next(c.proc for c in launcher.children if c.node_id == "decode-0")
    arenas = [n for n in os.listdir("/dev/shm") if n.startswith(f"mc-{decode.pid}-")]
    assert arenas  # its KV cache and staging memory
    body = {"prompt": [5, 6, 7], "max_tokens": 1000, "ignore_eos": True, "stream": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream(
        "POST", launcher.url + "/v1/completions", json=body, headers=headers, timeout=60
    ) as r:
        next(r.iter_lines())  # the first token: the request is decoding
        launcher.stop(grace_s=0.0)
    assert decode.returncode == -signal.SIGKILL
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"mc-{decode.pid}-")]
