"""`mooncake up --local` as a user runs it: it prints the URL once every node is ready, is
not blocked by a stale runfile, keeps its files private, and Ctrl-C stops every process it
started. Its generated config holds `--set` values with their keys' types."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import psutil
import pytest

from mooncake.config.load import load_config, parse_set_option
from mooncake.config.sizes import Size
from mooncake.errors import ConfigError
from mooncake.local.config import local_ssd_dir, write_config
from mooncake.local.cost import ensure_cost_model
from mooncake.local.launcher import LocalLauncher, LocalPlan

pytestmark = pytest.mark.timeout(180)


@pytest.mark.cluster
def test_ctrl_c_stops_every_process(tmp_path: Path, cost_cache: Path) -> None:
    """...also when a stale runfile names a master pid that another process now has."""
    cost = ensure_cost_model(LocalPlan(), cost_cache)
    run_dir = tmp_path / f"mooncake-{os.getuid()}"  # the default run dir under XDG_RUNTIME_DIR
    run_dir.mkdir(mode=0o755)  # as an older version left it
    other = subprocess.Popen(["sleep", "60"])  # has the pid a dead master had
    stale = {"url": "http://127.0.0.1:1", "master": "127.0.0.1:2", "config_path": "/x"}
    (run_dir / "local.json").write_text(json.dumps({**stale, "pids": {"master": other.pid}}))
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path), "COLUMNS": "200"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mooncake",
            "up",
            "--local",
            "--model",
            "dummy:tiny",
            "--port",
            "0",
            "--prefill",
            "1",
            "--group-size",
            "1",
            "--cost-model",
            str(cost),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # the handshake: printed once the cluster serves
    other.kill()
    other.wait()
    assert "ready" in line, line
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE((run_dir / "mooncake-local.toml").stat().st_mode) == 0o600
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
    assert not (run_dir / "local.json").exists()


def test_set_values_keep_their_keys_types_in_the_generated_config(tmp_path: Path) -> None:
    """`--set` gives text; the config written for the nodes holds a bool, an int, a size and
    a list where the keys want them, and loads back."""
    keys = "api.api_keys=sk-one-0123456789,sk-two-0123456789"
    sets = ["metrics.enabled=false", "decode.max_batch=7", "store.dram_bytes=64MiB", keys]
    sets += ["metrics.port=0", "api.served_model_name=my-model"]
    plan = LocalPlan(run_dir=tmp_path, extra=dict(parse_set_option(s) for s in sets))
    path = write_config(plan, tmp_path / "c.toml", "s" * 32, 5000, "")
    cfg = load_config(path, env={}).config
    assert cfg.metrics.enabled is False and cfg.decode.max_batch == 7
    assert cfg.metrics.port == 0 and cfg.api.served_model_name == "my-model"
    assert "\nport = 0\n" in path.read_text()  # an integer, not "0"
    assert cfg.store.dram_bytes == Size(num_bytes=64 << 20)
    assert cfg.api.api_keys == ("sk-one-0123456789", "sk-two-0123456789")
    bad = LocalPlan(run_dir=tmp_path, extra=dict([parse_set_option("decode.max_batch=many")]))
    with pytest.raises(ConfigError, match="decode.max_batch: expected"):
        write_config(bad, tmp_path / "bad.toml", "s" * 32, 5000, "")


def test_a_decode_node_gets_longer_than_its_drain_to_stop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The launcher's grace before SIGKILL covers decode.drain_s (api.drain_s for the
    master) from the generated config; it also uses the first API key for its own
    readiness calls."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    extra: dict[str, object] = {"decode.drain_s": "100", "api.api_keys": "sk-one-0123456789"}
    extra["api.drain_s"] = "70"
    launcher = LocalLauncher(LocalPlan(run_dir=tmp_path, api_port=0, extra=extra))
    launcher.configure("")
    assert launcher.stop_grace_s("decode") > 100
    assert 70 < launcher.stop_grace_s("master") < 100
    assert launcher.stop_grace_s("prefill") == launcher.policy.stop_grace_s
    assert launcher.api_key == "sk-one-0123456789"


def test_each_node_gets_a_small_ssd_tier_under_the_run_directory(tmp_path: Path) -> None:
    """The generated config puts the SSD tier under the run directory (on disk here), or
    under /var/tmp when the run directory is a tmpfs (XDG_RUNTIME_DIR on most desktops);
    --no-pool turns it off with the DRAM share."""
    path = write_config(LocalPlan(run_dir=tmp_path), tmp_path / "c.toml", "s" * 32, 5000, "")
    cfg = load_config(path, env={}).config
    assert (cfg.store.ssd_path, cfg.store.ssd_bytes) == (
        str(tmp_path / "ssd"),
        Size.parse("256MiB"),
    )
    off = LocalPlan(run_dir=tmp_path, pool=False)
    cfg = load_config(write_config(off, tmp_path / "off.toml", "s" * 32, 5000, ""), env={}).config
    assert cfg.store.ssd_bytes.is_zero and cfg.store.dram_bytes.is_zero
    if os.path.isdir("/dev/shm"):
        on_tmpfs = local_ssd_dir(Path("/dev/shm") / "mooncake-run")
        assert on_tmpfs == Path("/var/tmp") / f"mooncake-{os.getuid()}" / "ssd"


def test_a_cached_cost_model_is_reused_only_for_the_same_matmul_backend(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A profile prices one host: one made with F.linear (or on another CPU or torch) is
    not reused when the nodes run oneDNN, and the profile runs the backend they run."""
    import inspect

    import mooncake.model.corun as corun
    import mooncake.model.profiling as profiling
    from mooncake.conductor.costmodel import CorunFactors
    from mooncake.local.cost import host_tag

    backends: list[str] = []
    real_profile = profiling.profile_cost_model

    def profile(*args: object, **kwargs: object):  # type: ignore[no-untyped-def]
        bound = inspect.signature(real_profile).bind(*args, **kwargs)
        backends.append(str(bound.arguments["cpu_gemm"]))
        return real_profile(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(profiling, "profile_cost_model", profile)
    alone = CorunFactors(busy=1, prefill=1.0, decode=1.0)
    monkeypatch.setattr(corun, "measure_corun", lambda *a, **k: alone)
    onednn, torch_gemm = LocalPlan(), LocalPlan(extra={"model.cpu_gemm": "torch"})
    assert host_tag(onednn) == host_tag(LocalPlan()) != host_tag(torch_gemm)
    assert host_tag(onednn).startswith("onednn-") and host_tag(torch_gemm).startswith("torch-")
    first = ensure_cost_model(torch_gemm, tmp_path)
    second = ensure_cost_model(onednn, tmp_path)
    assert first != second and first.exists() and second.exists()
    assert ensure_cost_model(onednn, tmp_path) == second  # cached now
    assert backends == ["torch", "onednn"]


def _stream_lines(url: str, max_tokens: int, on_token: Callable[[int], None]) -> list[str]:
    """The SSE `data:` payloads of one streamed completion; `on_token(n)` runs after the
    n-th token arrived."""
    body = {
        "model": "dummy:tiny",
        "prompt": [7] * 40,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    lines: list[str] = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                lines.append(line.removeprefix("data: "))
                if lines[-1] != "[DONE]" and "error" not in json.loads(lines[-1]):
                    on_token(len(lines))
    return lines


def _in_session(sid: int) -> list[str]:
    """The live processes of session `sid`, as "pid command line"."""
    left = []
    for p in psutil.process_iter(["cmdline", "status"]):
        with contextlib.suppress(ProcessLookupError):
            if os.getsid(p.pid) == sid and p.info["status"] != psutil.STATUS_ZOMBIE:
                left.append(f"{p.pid} {' '.join(p.info['cmdline'] or [])}")
    return left


@pytest.mark.cluster
def test_ctrl_c_in_a_terminal_lets_streams_finish_then_stops_every_process(
    tmp_path: Path, cost_cache: Path
) -> None:
    """A terminal's Ctrl-C sends SIGINT to the whole process group: the children leave it
    to the launcher, whose stop lets a running stream finish (every token, then [DONE]),
    then ends every process it started, with no traceback in the log."""
    cost = ensure_cost_model(LocalPlan(), cost_cache)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path), "COLUMNS": "200"}
    with (tmp_path / "stderr").open("w") as stderr:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mooncake",
                "up",
                "--local",
                "--model",
                "dummy:tiny",
                "--port",
                "0",
                "--prefill",
                "1",
                "--group-size",
                "1",
                "--cost-model",
                str(cost),
                "--set",
                "decode.step_interval_s=0.05",
            ],
            stdout=subprocess.PIPE,
            stderr=stderr,
            env=env,
            text=True,
            start_new_session=True,  # a process group of its own, as a terminal's job has
        )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # the handshake: printed once the cluster serves
        assert "ready" in line, line
        url = line.split("ready")[1].split()[1]
        assert len(psutil.Process(proc.pid).children(recursive=True)) == 4

        def ctrl_c(num_tokens: int) -> None:
            if num_tokens == 2:
                os.killpg(proc.pid, signal.SIGINT)

        lines = _stream_lines(url, 60, ctrl_c)  # 60 steps of >= 50 ms: 3 s past Ctrl-C
        assert lines[-1] == "[DONE]" and len(lines) == 61, lines[-3:]
        assert proc.wait(timeout=60) == 0
        deadline = time.monotonic() + 10
        while left := _in_session(proc.pid):  # whatever it started, restarted ones too
            assert time.monotonic() < deadline, left
            time.sleep(0.1)
        assert "Traceback" not in (tmp_path / "stderr").read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
