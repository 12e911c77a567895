"""`mooncake bench vllm`: servers one at a time on one made checkpoint, figures and ratios.

CI has no vLLM: the orchestration runs with `mooncake serve` as the baseline; the run
against real vLLM happens only when MOONCAKE_VLLM_PYTHON names its python."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mooncake.bench.checkpoint import CheckpointShape, make_checkpoint
from mooncake.bench.servers import LaunchedServer, ServerSpec, ServerStartError
from mooncake.bench.versus import (
    FIGURES,
    Row,
    Versus,
    VersusPlan,
    compare,
    parse_cpus,
    ratios,
    server_spec,
)
from mooncake.errors import ConfigError
from mooncake.local.launcher import free_port

TRACE = Path(__file__).resolve().parents[1] / "fixtures" / "traces" / "conversation_head300.jsonl"
# a checkpoint small enough to start four servers on in a test
TINY = ["--shape", "dummy:tiny", "--layers", "1", "--hidden", "64", "--heads", "2"]
TINY += ["--kv-heads", "1", "--ffn", "128", "--vocab-size", "300"]


def _row(server: str, **figures: float | None) -> Row:
    values: dict[str, float | None] = dict.fromkeys(FIGURES, 1.0)
    values.update(figures)
    counts = {"sent": 10, "completed": 10, "rejected": 0, "failed": 0}
    return Row(server=server, speed=4.0, **counts, **values)  # type: ignore[arg-type]


def test_ratios_are_server_over_baseline_and_none_without_a_baseline_value() -> None:
    base = _row("vllm", ttft_p50_s=0.5, hit_rate=None, slo_attainment=0.0)
    ours = _row("up-local", ttft_p50_s=1.0, hit_rate=0.4, slo_attainment=0.5)
    got = ratios(ours, base)
    assert set(got) == set(FIGURES)
    assert got["ttft_p50_s"] == 2.0 and got["tbt_p90_s"] == 1.0
    assert got["hit_rate"] is None and got["slo_attainment"] is None  # base None, base 0
    res = compare("vllm", {"vllm": base, "up-local": ours}, 4.0)
    assert list(res.ratio) == ["up-local"] and res.ratio["up-local"] == got


def test_the_table_shows_every_server_and_its_ratio_to_the_baseline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from rich.console import Console

    import mooncake.cli.output as output
    from mooncake.cli.bench_vllm import _print

    out = io.StringIO()
    monkeypatch.setattr(output, "console", Console(file=out, width=200))
    rows = {"vllm": _row("vllm", ttft_p50_s=0.25), "up-local": _row("up-local", ttft_p50_s=0.5)}
    result = Versus(
        baseline="vllm",
        servers=["vllm", "up-local"],
        model="/m",
        requests=10,
        scale=0.0625,
        block_tokens=32,
        ttft_slo_s=2.0,
        tbt_slo_s=0.1,
        cpus=[0, 1],
        speeds=[compare("vllm", rows, 4.0)],
        logs={},
    )
    _print(result)
    text = out.getvalue()
    assert "speed 4" in text and "up-local / base" in text
    ttft = next(line for line in text.splitlines() if "TTFT P50" in line)
    assert "250.0 ms" in ttft and "500.0 ms" in ttft and "2.00" in ttft


def test_the_plan_names_what_is_missing_or_unknown(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--vllm-python is not given"):
        VersusPlan(model=str(tmp_path), vocab_size=300).validate()
    with pytest.raises(ConfigError, match="no such file"):
        VersusPlan(model=str(tmp_path), vocab_size=300, vllm_python="/nope/python").validate()
    with pytest.raises(ConfigError, match="unknown server 'sglang'"):
        VersusPlan(
            model=str(tmp_path), vocab_size=300, baseline="serve", also=("sglang",)
        ).validate()
    plan = VersusPlan(model=str(tmp_path), vocab_size=1, baseline="serve", also=("up-local",))
    assert plan.servers == ["serve", "up-local"]  # ours once, the baseline first
    with pytest.raises(ConfigError, match="vLLM serves only checkpoint directories"):
        VersusPlan(model="dummy:tiny", vocab_size=1, vllm_python=sys.executable).validate()
    with pytest.raises(ConfigError, match="--cpus"):
        parse_cpus("0-x")
    assert parse_cpus("0") == frozenset({0}) and parse_cpus("") is None


def test_each_server_is_started_on_the_same_checkpoint_cpus_and_block_size(
    tmp_path: Path,
) -> None:
    plan = VersusPlan(
        model="/ckpt",
        vocab_size=300,
        also=("serve", "up-local-no-pool"),
        cpus=frozenset({0}),
        vllm_python=sys.executable,
        up_sets=("prefill.chunk_tokens=128",),
        work_dir=tmp_path,
    )
    plan.validate()
    assert plan.servers == ["vllm", "up-local", "serve", "up-local-no-pool"]
    specs = {name: server_spec(plan, name, tmp_path, 32) for name in plan.servers}
    vllm = specs["vllm"]
    assert vllm.argv[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    assert {"--enable-prefix-caching", "--enable-prompt-tokens-details"} <= set(vllm.argv)
    assert vllm.argv[vllm.argv.index("--block-size") + 1] == "32"
    assert vllm.env["VLLM_CPU_OMP_THREADS_BIND"] == "0" and vllm.env["VLLM_CPU_KVCACHE_SPACE"]
    serve = specs["serve"].argv
    assert serve[serve.index("--threads") + 1] == "1" and "model.block_tokens=32" in serve
    for name in ("up-local", "up-local-no-pool"):
        spec = specs[name]
        assert ("--no-pool" in spec.argv) == (name == "up-local-no-pool")
        assert spec.argv[spec.argv.index("--block-tokens") + 1] == "32"
        assert "prefill.chunk_tokens=128" in spec.argv and spec.ready_text
        # the cluster admits by the SLOs its figures are judged by (a --set still wins)
        sets = [spec.argv[i + 1] for i, a in enumerate(spec.argv) if a == "--set"]
        assert sets[:2] == [
            f"scheduler.ttft_slo_s={plan.ttft_slo_s}",
            f"scheduler.tbt_slo_s={plan.tbt_slo_s}",
        ]
        assert sets[-1] == "prefill.chunk_tokens=128"
        # its runfile in this run's directory: never the user's own cluster's
        assert spec.env["XDG_RUNTIME_DIR"].startswith(str(tmp_path))
    assert all(spec.argv[spec.argv.index("--model") + 1] == "/ckpt" for spec in specs.values())
    assert len({spec.url for spec in specs.values()}) == 4


def test_a_made_checkpoint_loads_in_our_engine_and_is_reused(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    from mooncake.model.info import load_model_info

    sizes = {"num_layers": 1, "hidden_size": 64, "num_heads": 2, "num_kv_heads": 1}
    shape = CheckpointShape(**sizes, intermediate_size=128, vocab_size=300)
    path = make_checkpoint(shape, tmp_path)
    info = load_model_info(str(path))
    assert (info.spec.num_layers, info.spec.hidden_size, info.spec.vocab_size) == (1, 64, 300)
    assert info.eos_token_ids == (1,)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    assert tok.get_vocab_size() <= 300 and tok.token_to_id("</s>") == 1
    assert tok.decode(tok.encode("time héllo").ids) == "time héllo"  # byte-level
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert make_checkpoint(shape, tmp_path) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no half-made leftovers
    other = make_checkpoint(CheckpointShape(**{**shape.__dict__, "seed": 1}), tmp_path)
    assert other != path


FAKE_SERVER = textwrap.dedent(
    """
    import http.server, subprocess, sys
    child = subprocess.Popen(["sleep", "600"])
    print("child", child.pid, flush=True)
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers(); self.wfile.write(b"{}")
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
    """
)


@pytest.mark.cluster
def test_a_server_is_ready_when_it_answers_and_stopping_ends_its_children(
    tmp_path: Path,
) -> None:
    script = tmp_path / "fake.py"
    script.write_text(FAKE_SERVER)
    port = free_port()
    spec = ServerSpec("fake", [sys.executable, str(script), str(port)], f"http://127.0.0.1:{port}")
    log = tmp_path / "fake.log"
    with LaunchedServer(spec, log, cpus=frozenset(parse_cpus("0") or ())) as server:
        assert server.proc is not None
        assert os.sched_getaffinity(server.proc.pid) == {0}
        child = int(log.read_text().split()[1])
        os.kill(child, 0)  # alive
    # SIGTERM ended the server; its sleeping child went with its process group
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    pytest.fail("the server's child outlived it")


@pytest.mark.cluster
def test_a_server_that_exits_at_start_is_reported_with_the_tail_of_its_log(
    tmp_path: Path,
) -> None:
    argv = [sys.executable, "-c", "print('no model named x'); raise SystemExit(3)"]
    spec = ServerSpec("vllm", argv, "http://127.0.0.1:9")
    with pytest.raises(ServerStartError, match=r"exited with status 3(.|\n)*no model named x"):
        LaunchedServer(spec, tmp_path / "vllm.log").start()


def _bench(tmp_path: Path, *args: str, timeout: float = 150) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "mooncake", "bench", "vllm", str(TRACE), *args]
    return subprocess.run(
        cmd + ["--cache-dir", str(tmp_path / "cache")],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=tmp_path,
    )


@pytest.mark.cluster
def test_without_vllm_python_it_says_what_to_pass(tmp_path: Path) -> None:
    env_free = {k: v for k, v in os.environ.items() if k != "MOONCAKE_VLLM_PYTHON"}
    cmd = [sys.executable, "-m", "mooncake", "bench", "vllm", str(TRACE)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env_free)
    assert out.returncode == 2
    assert "--vllm-python is not given" in out.stderr and "scripts/vllm-venv" in out.stderr


@pytest.mark.cluster
def test_a_vllm_that_fails_to_start_shows_its_log(tmp_path: Path) -> None:
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'ImportError: no module named vllm' >&2\nexit 1\n")
    fake.chmod(0o755)
    out = _bench(tmp_path, *TINY, "--vllm-python", str(fake), "--limit", "2", timeout=60)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "vllm" in out.stderr and "exited with status 1" in out.stderr
    assert "ImportError: no module named vllm" in out.stderr


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_serve_as_the_baseline_against_up_local_end_to_end(tmp_path: Path) -> None:
    args = [*TINY, "--baseline", "serve"]
    args += ["--limit", "3", "--max-tokens", "4", "--prefill", "1", "--group-size", "1"]
    out = _bench(tmp_path, *args, "--speed", "16", "--warmup", "1", "--json")
    assert out.returncode == 0, out.stderr[-3000:]
    data = json.loads(out.stdout)
    assert data["servers"] == ["serve", "up-local"] and data["baseline"] == "serve"
    (res,) = data["speeds"]
    assert res["speed"] == 16
    for name in data["servers"]:
        row = res["rows"][name]
        assert row["completed"] == row["sent"] == 3, row
        assert row["ttft_p50_s"] > 0 and row["output_tokens_per_s"] > 0
    ratio = res["ratio"]["up-local"]
    assert set(ratio) == set(FIGURES) and ratio["ttft_p50_s"] > 0
    assert "replay" in out.stderr  # the progress bar


@pytest.mark.skipif(
    not os.environ.get("MOONCAKE_VLLM_PYTHON"), reason="MOONCAKE_VLLM_PYTHON names no vLLM"
)
@pytest.mark.timeout(900)
def test_against_real_vllm(tmp_path: Path) -> None:
    args = [*TINY, "--limit", "3", "--max-tokens", "4", "--speed", "16", "--warmup", "1"]
    out = _bench(tmp_path, *args, "--json", timeout=880)
    assert out.returncode == 0, out.stderr[-3000:]
    (res,) = json.loads(out.stdout)["speeds"]
    vllm = res["rows"]["vllm"]
    assert vllm["completed"] == 3 and vllm["hit_rate"] is not None
    assert res["ratio"]["up-local"]["ttft_p50_s"] > 0


def _sse(*chunks: dict[str, object]) -> bytes:
    lines = [f"data: {json.dumps(c)}\n\n" for c in chunks]
    return "".join([*lines, "data: [DONE]\n\n"]).encode()


@pytest.mark.parametrize(
    ("texts", "tokens"),
    [([""], 1), (["a", ""], 2), (["a", "b"], 2)],  # "": a byte that is not whole UTF-8 yet
)
def test_a_last_chunk_with_empty_text_counts_as_a_token_when_usage_says_so(
    texts: list[str], tokens: int
) -> None:
    import asyncio

    import httpx

    from mooncake.replay.client import send_completion

    chunks: list[dict[str, object]] = [
        {"choices": [{"text": t, "finish_reason": None}]} for t in texts[:-1]
    ]
    chunks.append({"choices": [{"text": texts[-1], "finish_reason": "length"}]})
    chunks.append({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": tokens}})
    body = _sse(*chunks)

    async def run() -> None:
        transport = httpx.MockTransport(lambda _: httpx.Response(200, content=body))
        async with httpx.AsyncClient(transport=transport, base_url="http://x") as client:
            req = {"prompt": [5, 6, 7], "max_tokens": tokens}
            rec = await send_completion(client, req, 0, 0.0)
        assert rec.status == "ok", rec.error
        assert rec.output_tokens == tokens and len(rec.gaps_s) == tokens - 1

    asyncio.run(run())


def test_a_server_that_fails_every_warm_up_request_stops_the_run_with_why() -> None:
    from mooncake.bench.versus import check_warmup
    from mooncake.replay.report import RequestRecord, RunInfo, summarize

    info = RunInfo(
        url="http://h:1",
        model="m",
        ttft_slo_s=2.0,
        tbt_slo_s=0.1,
        speed=1e9,
        block_tokens=32,
        scale=0.0625,
        output_scale=0.0625,
        vocab_size=300,
        prompt_format="tokens",
    )
    failed = RequestRecord(index=0, status="error", send_s=0, end_s=1, error="HTTP 400: bad ids")
    with pytest.raises(ServerStartError, match="vllm started but failed every warm-up.*bad ids"):
        check_warmup("vllm", summarize([failed], info))
