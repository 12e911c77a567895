"""`mooncake replay` end to end against our OpenAI API: `create_app(EngineBackend)` over
dummy:tiny on CPU, under uvicorn on 127.0.0.1 (port 0), prompts scaled down hard."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from mooncake.api.app import create_app
from mooncake.api.backend import BaseBackend, GenerateRequest, Output, Rejected
from mooncake.api.engine_backend import EngineBackend
from mooncake.api.server import ApiServer
from mooncake.cli.app import app, load_verbs
from mooncake.config.settings import ModelConfig
from mooncake.errors import ConfigError
from mooncake.local.runfile import LocalCluster, write_runfile
from mooncake.replay import (
    PromptConfig,
    ReplayConfig,
    ReplayError,
    ReplayReport,
    RequestRecord,
    replay,
)
from mooncake.sim.trace import load_trace

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "traces" / "conversation_head300.jsonl"
KEY = "sk-replay-test"
VOCAB = 512  # dummy:tiny
SCALE = 0.03  # 15-token blocks: the fixture's prompts become 15-250 tokens

pytestmark = pytest.mark.timeout(60)
torch.set_num_threads(1)
load_verbs()


@pytest.fixture(scope="module")
def engine() -> Iterator[EngineBackend]:
    backend = EngineBackend(
        ModelConfig(path="dummy:tiny", block_tokens=16), max_batch=8, kv_cache_bytes=8 * 1024 * 1024
    )
    yield backend
    backend.close()


def _serve(backend: BaseBackend) -> ApiServer:
    server = ApiServer(create_app(backend, api_keys=[KEY]), "127.0.0.1", 0)
    server.start_in_thread()
    return server


@pytest.fixture(scope="module")
def url(engine: EngineBackend) -> Iterator[str]:
    server = _serve(engine)
    yield server.url
    server.stop()


def _replay(
    url: str, n: int, scale: float = SCALE, **kw
) -> tuple[ReplayReport, list[RequestRecord], PromptConfig]:
    prompts = PromptConfig(scale=scale, output_scale=scale, max_tokens=4, vocab_size=VOCAB)
    cfg = ReplayConfig(url=url, api_key=KEY, speed=1000.0, vocab_size=VOCAB, **kw)
    records: list[RequestRecord] = []
    report = replay(load_trace(FIXTURE, limit=n), prompts, cfg, on_record=records.append)
    return report, sorted(records, key=lambda r: r.index), prompts


def test_every_request_completes_with_its_exact_lengths_and_a_gap_per_token(url):
    report, records, prompts = _replay(url, 6)
    trace = load_trace(FIXTURE, limit=6)
    assert (report.sent, report.completed, report.rejected, report.failed) == (6, 6, 0, 0)
    for rec, tr in zip(records, trace, strict=True):
        assert rec.status == "ok", rec.error
        assert rec.prompt_tokens == prompts.input_len(tr)  # as the server counted them
        # ignore_eos: exactly the asked length; our API sends one chunk per token.
        assert rec.output_tokens == rec.expected_output_tokens == prompts.output_len(tr)
        assert len(rec.gaps_s) == rec.output_tokens - 1
        assert rec.ttft_s is not None and 0 < rec.ttft_s <= rec.end_s - rec.send_s
        assert rec.cached_tokens == 0  # reported by usage; EngineBackend has no prefix cache
    assert report.output_tokens == sum(r.output_tokens for r in records)
    assert report.cached_token_share == 0.0 and report.block_tokens == 15
    assert report.ttft_p50_s is not None and report.tbt_p50_s is not None


def test_text_prompts_also_complete(url):
    # Each id becomes a word of ~5 bytes, so ~5 byte tokens of dummy:tiny: scale down more.
    report, records, prompts = _replay(url, 3, scale=0.01, prompt_format="text")
    assert report.completed == 3
    ids_sent = [prompts.input_len(r) for r in load_trace(FIXTURE, limit=3)]
    assert all(r.prompt_tokens > n for r, n in zip(records, ids_sent, strict=True))


def test_a_vocabulary_larger_than_the_servers_is_refused_before_sending(url):
    """The server reports its vocabulary in /v1/models; asking for ids beyond it is a clear
    error up front instead of a run of HTTP 400s (the API's 400 is tested in tests/api)."""
    prompts = PromptConfig(scale=SCALE, max_tokens=2, first_id=600)
    cfg = ReplayConfig(url=url, api_key=KEY, speed=1000.0, vocab_size=32000)
    with pytest.raises(ConfigError, match="larger than the vocabulary"):
        replay(load_trace(FIXTURE, limit=3), prompts, cfg)


class _AdmitShort(BaseBackend):
    """Admission control that rejects prompts longer than `max_prompt_len` (HTTP 429)."""

    def __init__(self, inner: EngineBackend, max_prompt_len: int):
        self.inner, self.max_prompt_len = inner, max_prompt_len
        self.model_name, self.max_model_len = inner.model_name, inner.max_model_len
        self.tokenizer = inner.tokenizer

    async def generate(self, req: GenerateRequest) -> AsyncIterator[Output]:
        if len(req.prompt_ids) > self.max_prompt_len:
            raise Rejected(f"prompt of {len(req.prompt_ids)} tokens is over the limit")
        async for out in self.inner.generate(req):
            yield out


def test_http_429_counts_as_rejected_not_failed(engine):
    prompts = PromptConfig(scale=SCALE)
    lengths = [prompts.input_len(r) for r in load_trace(FIXTURE, limit=8)]
    limit = sorted(lengths)[len(lengths) // 2]
    server = _serve(_AdmitShort(engine, limit))
    try:
        report, records, _ = _replay(server.url, 8)
    finally:
        server.stop()
    num_long = sum(n > limit for n in lengths)
    assert 0 < num_long < 8
    assert (report.rejected, report.completed, report.failed) == (num_long, 8 - num_long, 0)
    assert [r.status == "rejected" for r in records] == [n > limit for n in lengths]
    assert all("HTTP 429" in message for message in report.errors)
    assert report.slo_attainment <= (8 - num_long) / 8


def test_an_unknown_model_lists_what_the_server_serves(url):
    with pytest.raises(ReplayError, match="'nope' is not served .* it serves: dummy:tiny"):
        _replay(url, 1, model="nope")


def test_cli_finds_the_local_cluster_and_prints_json(url, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    write_runfile(
        LocalCluster(
            url=url, master="127.0.0.1:1", config_path="", pids={"master": os.getpid()}, api_key=KEY
        )
    )
    args = [
        "replay",
        str(FIXTURE),
        "--limit",
        "4",
        "--scale",
        str(SCALE),
        "--max-tokens",
        "3",
        "--vocab-size",
        str(VOCAB),
        "--speed",
        "1000",
        "--json",
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, (result.output, result.exception)
    out = json.loads(result.stdout)
    for key in (
        "sent",
        "completed",
        "rejected",
        "failed",
        "ttft_p50_s",
        "ttft_p90_s",
        "ttft_p99_s",
        "tbt_p50_s",
        "tbt_p90_s",
        "tbt_p99_s",
        "slo_attainment",
        "output_tokens_per_s",
        "cached_token_share",
        "block_tokens",
    ):
        assert key in out, key
    assert out["url"] == url and out["sent"] == out["completed"] == 4
    assert out["block_tokens"] == 15 and out["output_tokens"] == 4 * 3


def _cli(url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *flags: str):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    write_runfile(
        LocalCluster(
            url=url, master="127.0.0.1:1", config_path="", pids={"master": os.getpid()}, api_key=KEY
        )
    )
    args = [
        "replay",
        str(FIXTURE),
        "--max-tokens",
        "2",
        "--vocab-size",
        str(VOCAB),
        "--speed",
        "1000",
        *flags,
    ]
    return CliRunner().invoke(app, args)


def test_without_scale_the_cli_fits_the_trace_to_the_servers_context(
    url, engine, tmp_path, monkeypatch
):
    """The first try works: at scale 1 these prompts exceed the server's 2048 tokens, so
    replay halves the scale until they fit, and says which it took."""
    assert engine.max_model_len == 2048
    result = _cli(url, tmp_path, monkeypatch, "--limit", "2")
    assert result.exit_code == 0, (result.output, result.exception)
    assert (
        "--scale 0.25: the largest power of 2 at which every request fits the server's "
        "context of 2048 tokens (pass --scale to choose)"
    ) in result.output
    assert "blocks of 128 tokens after --scale 0.25" in result.output
    assert "2 / 2" in result.output  # sent / completed


def test_requests_over_the_context_end_with_a_hint_naming_scale(url, tmp_path, monkeypatch):
    result = _cli(url, tmp_path, monkeypatch, "--limit", "2", "--scale", "1")
    assert result.exit_code == 1, (result.output, result.exception)  # none completed
    assert "maximum context length is 2048 tokens" in result.output
    assert (
        "hint: 2 requests did not fit the server's context at --scale 1; leave --scale out "
        "to have replay fit the trace to it, or pass a smaller one (or --max-tokens)"
    ) in result.output
