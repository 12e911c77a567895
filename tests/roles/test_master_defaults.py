"""Starting on the documented defaults: a master on `model.path = "dummy:tiny"` with no
cost model (`scheduler.cost_model_path = ""`, the roofline of the model's shape); a node
whose `cluster.master` names no master fails at once, naming the key; default node ids of
one role on one host differ. Real processes, started as `mooncake up --role ROLE` is."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from mooncake.config import ClusterConfig, Config
from mooncake.roles.common import create_context
from mooncake.roles.local import free_port

pytestmark = pytest.mark.timeout(60)


def test_master_starts_on_dummy_tiny_without_a_cost_model(tmp_path: Path) -> None:
    config = tmp_path / "master.toml"
    config.write_text(
        f'[cluster]\nmaster = "127.0.0.1:{free_port()}"\nsecret = "{"s" * 32}"\n'
        '[model]\npath = "dummy:tiny"\n[scheduler]\ncost_model_path = ""\n'
        f'[api]\nhost = "127.0.0.1"\nport = {free_port()}\n[metrics]\nenabled = false\n'
    )
    env = {**os.environ, "MOONCAKE_LOG_LEVEL": "info"}
    cmd = [sys.executable, "-m", "mooncake", "up", "--role", "master", "--config", str(config)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # the ready handshake, or "" when it exited
        if not line:
            proc.wait(timeout=10)
            pytest.fail(f"master exited {proc.returncode}: {proc.communicate()[1]}")
        url = json.loads(line)["url"]
        resp = httpx.get(url + "/health", timeout=10)
        # served: 503 only because no prefill or decode node has registered yet
        assert resp.status_code in (200, 503) and "status" in resp.json(), resp.text
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            _, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, stderr = proc.communicate()
    # the log says which roofline it schedules with (no GPU here: the default, said so)
    assert "cost model: roofline of dummy:tiny on " in stderr, stderr


@pytest.mark.parametrize("role", ["store", "prefill"])
def test_a_node_without_a_master_fails_at_once_naming_the_key(tmp_path: Path, role: str) -> None:
    """`cluster.master` missing from a node's file (its default, 127.0.0.1:50051, where no
    master listens): no 11 s of retries, one line naming the key; and a master host that
    does not exist likewise."""
    default = ClusterConfig().master
    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", int(default.rpartition(":")[2]))) == 0:
            pytest.skip(f"something listens at {default} on this host")
    for master, message in (
        ("", f"cluster.master: not set, and no master listens at its default {default}"),
        ('master = "no-such-host.invalid:50051"\n', "cluster.master: no host 'no-such-host"),
    ):
        config = tmp_path / f"{role}.toml"
        config.write_text(
            f'[cluster]\n{master}secret = "{"s" * 32}"\n'
            f'[node]\nrole = "{role}"\n[store]\ndram_bytes = "16MiB"\n'
        )
        cmd = [sys.executable, "-m", "mooncake", "up", "--role", role, "--config", str(config)]
        started = time.monotonic()
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        assert done.returncode != 0
        assert time.monotonic() - started < 8  # the interpreter and imports; no retries
        assert message in " ".join(done.stderr.split()), done.stderr  # the console wraps
        assert "unmount" not in done.stderr  # nothing was mounted to undo


def test_default_node_ids_of_one_role_on_one_host_differ(tmp_path: Path) -> None:
    """`node.id = ""`: hostname, role, pid and a random part, so two nodes on one host never
    share an id, even in containers that share the hostname and are each pid 1."""
    with socket.socket() as listener:  # something for the master address to reach
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        cluster = ClusterConfig(master=f"127.0.0.1:{listener.getsockname()[1]}", secret="s" * 32)
        cfg = Config(cluster=cluster)
        a, b = create_context(cfg, "prefill"), create_context(cfg, "prefill")
    assert a.node_id != b.node_id
    assert a.node_id.startswith(f"{socket.gethostname()}-prefill-{os.getpid()}-")


def test_bench_store_master_takes_the_cluster_master_form() -> None:
    """`--master` takes what `cluster.master` holds (host:port), as its help says."""
    from typer.testing import CliRunner

    import mooncake.cli.bench_store  # noqa: F401  (registers the verb)
    from mooncake.cli.app import app
    from mooncake.store.localproc import LocalCluster

    secret = "b" * 32
    with LocalCluster(secret.encode(), 64 << 20) as cluster:
        hostport = cluster.master_address.removeprefix("tcp://")
        args = [
            "bench",
            "store",
            "--master",
            hostport,
            "--secret",
            secret,
            "--apis",
            "bytes",
            "--sizes",
            "4KiB",
            "--duration",
            "0.1",
            "--warmup",
            "0",
            "--json",
        ]
        result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)[0]["num_puts"] > 0
    help_text = CliRunner().invoke(app, ["bench", "store", "--help"]).output
    assert "7100" not in help_text and "10.0.0.1:50051" in help_text


def test_status_config_with_a_wildcard_api_host_dials_the_masters_host(tmp_path: Path) -> None:
    """api.host = 0.0.0.0 (the default) is where the master binds, not where it is."""
    from mooncake.cli.status import find_master

    config = tmp_path / "master.toml"
    config.write_text(
        '[cluster]\nmaster = "10.0.0.1:50051"\n[api]\nhost = "0.0.0.0"\nport = 8000\n'
    )
    assert find_master("", config, None).url == "http://10.0.0.1:8000"
    config.write_text('[cluster]\nmaster = "[fd00::1]:50051"\n[api]\nhost = "::"\nport = 8000\n')
    assert find_master("", config, None).url == "http://[fd00::1]:8000"
    config.write_text('[api]\nhost = "10.0.0.9"\nport = 8000\n')  # a named host stays
    assert find_master("", config, None).url == "http://10.0.0.9:8000"
