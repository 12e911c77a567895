"""Starting on the documented defaults: a master on `model.path = "dummy:tiny"` with no
cost model (`scheduler.cost_model_path = ""`, the roofline of the model's shape); a node
whose `cluster.master` names no master fails at once, naming the key; default node ids of
one role on one host differ. Real processes, started as `mooncake up --role ROLE` is."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from mooncake.config.settings import ClusterConfig, Config
from mooncake.local.launcher import free_port
from mooncake.roles.node.common import create_context

pytestmark = pytest.mark.timeout(60)


@pytest.mark.cluster
def test_master_starts_on_dummy_tiny_without_a_cost_model(tmp_path: Path) -> None:
    """... and on `api.host = "0.0.0.0"` (the default; with no key only when
    `api.allow_unauthenticated`) its log says it listens on all interfaces with a URL other
    hosts can use, not 127.0.0.1."""
    config = tmp_path / "master.toml"
    port = free_port()
    config.write_text(
        f'[cluster]\nmaster = "127.0.0.1:{free_port()}"\nsecret = "{"s" * 32}"\n'
        '[model]\npath = "dummy:tiny"\n[scheduler]\ncost_model_path = ""\n'
        f'[api]\nhost = "0.0.0.0"\nport = {port}\nallow_unauthenticated = true\n'
        "[metrics]\nenabled = false\n"
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
    said = re.search(rf"master: API on all interfaces, port {port} \((http://\S+)\)", stderr)
    assert said is not None, stderr
    assert not any(h in said[1] for h in ("127.0.0.1", "0.0.0.0", "localhost")), said[1]


@pytest.mark.cluster
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


@pytest.mark.cluster
def test_bench_store_master_takes_the_cluster_master_form() -> None:
    """`--master` takes what `cluster.master` holds (host:port), as its help says."""
    from typer.testing import CliRunner

    import mooncake.cli.bench_store  # noqa: F401  (registers the verb)
    from mooncake.bench.storeprocs import LocalCluster
    from mooncake.cli.app import app

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


def _hf_dir(root: Path) -> Path:
    """What a master reads of a checkpoint: config.json, a weight file, tokenizer.json."""
    tokenizers = pytest.importorskip("tokenizers", reason="pip install tokenizers")
    root.mkdir()
    config = {
        "model_type": "llama",
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "vocab_size": 300,
        "num_attention_heads": 4,
        "intermediate_size": 96,
    }
    (root / "config.json").write_text(json.dumps(config))
    (root / "model.safetensors").write_bytes(b"\0" * 64)  # never loaded by the master
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0, "hi": 1}, "[UNK]"))
    tok.save(str(root / "tokenizer.json"))
    return root


@pytest.mark.cluster
@pytest.mark.parametrize("served_name", ["", "my-model"])
def test_the_master_serves_an_hf_directory_under_the_path_given(
    tmp_path: Path, served_name: str
) -> None:
    """As `mooncake serve` and vLLM do (not the KV's `hf:NAME:DIGEST`), or under
    api.served_model_name: a client naming it is not told 404. A bad request (400) is
    counted as refused, apart from the received ones, as `serve` counts it."""
    path = str(_hf_dir(tmp_path / "ckpt"))
    config = tmp_path / "master.toml"
    config.write_text(
        f'[cluster]\nmaster = "127.0.0.1:{free_port()}"\nsecret = "{"s" * 32}"\n'
        f'[model]\npath = "{path}"\n[scheduler]\ncost_model_path = ""\n'
        f'[api]\nhost = "127.0.0.1"\nport = {free_port()}\nserved_model_name = "{served_name}"\n'
        "[metrics]\nenabled = false\n"
    )
    cmd = [sys.executable, "-m", "mooncake", "up", "--role", "master", "--config", str(config)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            proc.wait(timeout=10)
            pytest.fail(f"master exited {proc.returncode}: {proc.communicate()[1]}")
        url = json.loads(line)["url"]
        name = served_name or path
        assert [m["id"] for m in httpx.get(url + "/v1/models", timeout=10).json()["data"]] == [name]
        body = {"model": name, "prompt": "hi", "max_tokens": 1}
        resp = httpx.post(url + "/v1/completions", json=body, timeout=10)
        assert resp.status_code == 503, resp.text  # no node yet; the model is known
        bad = httpx.post(url + "/v1/completions", json={**body, "top_p": 0}, timeout=10)
        assert bad.status_code == 400
        status = httpx.get(url + "/v1/status", timeout=10).json()
        assert (status["num_requests"], status["num_failed"], status["num_refused"]) == (1, 1, 1)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


@pytest.mark.cluster
def test_the_masters_roofline_follows_the_gpus_its_prefill_nodes_report(tmp_path: Path) -> None:
    """No profile and no GPU on the master: it starts on the H800 x8 roofline; a prefill
    node without GPUs leaves it so (said once, with the hardware assumed); the first one
    registering with GPUs of a known type sets it to theirs; later ones change nothing."""
    from mooncake.roles.node.messages import NodeInfoMsg, RegisterMsg, RegisterReplyMsg
    from mooncake.rpc import RpcClient

    secret, master = "s" * 32, f"127.0.0.1:{free_port()}"
    config = tmp_path / "master.toml"
    config.write_text(
        f'[cluster]\nmaster = "{master}"\nsecret = "{secret}"\n[model]\npath = "dummy:tiny"\n'
        f'[api]\nhost = "127.0.0.1"\nport = {free_port()}\n[metrics]\nenabled = false\n'
    )
    env = {**os.environ, "MOONCAKE_LOG_LEVEL": "info", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "mooncake", "up", "--role", "master", "--config", str(config)]
    log = tmp_path / "master.log"
    with log.open("wb") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, env=env)
    # as nodes report them: NVML's name, then the memory
    h100, a100 = "NVIDIA H100 80GB HBM3 79GiB", "NVIDIA A100-SXM4-80GB 79GiB"
    try:
        assert proc.stdout is not None and proc.stdout.readline(), log.read_text()
        if "on H800 x8, the default" not in log.read_text():
            pytest.skip("this host has GPUs of a known type: the master's roofline is theirs")
        with RpcClient(f"tcp://{master}", secret.encode(), timeout_s=5.0) as client:
            nodes = {"cpu-0": [], "cpu-1": [], "gpu-0": [h100] * 2, "gpu-1": [a100]}
            for node_id, gpus in nodes.items():
                address = f"127.0.0.1:{free_port()}"
                info = NodeInfoMsg(
                    node_id, "prefill", address, gpus=gpus, device_memory_bytes=1 << 36
                )
                assert client.call(RegisterMsg(info), RegisterReplyMsg).is_accepted
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    text = " ".join(log.read_text().split())
    assumes = r"prefill node cpu-\d reports no GPU: the cost model's roofline still assumes "
    said = re.findall(assumes + r"H800 x8 \(tp=8\)", text)
    assert len(said) == 1, text  # once, not per node
    assert "cost model: roofline of dummy:tiny on H100 x2, detected on prefill node gpu-0 " in text
    assert "A100" not in text.split("detected on prefill node gpu-0")[1], text
