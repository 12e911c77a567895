"""Replay a trace against a server: each request sent at its timestamp / speed, all in
flight at once on one asyncio loop (or at most `concurrency`), each one timed.

The loop reads as: probe the server -> for each request, wait for its arrival time and
start it -> gather the records -> summarize. Requests are never retried: a 429 is counted
as rejected and an error as failed, as the serving system's SLO attainment needs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, replace
from typing import Any, Literal

import httpx

from mooncake.errors import ConfigError
from mooncake.replay.client import (
    DEFAULT_VOCAB_SIZE,
    ReplayError,
    ServerInfo,
    normalize_url,
    probe_server,
    send_completion,
)
from mooncake.replay.prompts import PromptConfig, ids_to_text
from mooncake.replay.report import ReplayReport, RequestRecord, RunInfo, summarize
from mooncake.sim.trace import TraceRecord

log = logging.getLogger(__name__)

PromptFormat = Literal["tokens", "text"]


@dataclass(frozen=True)
class ReplayConfig:
    """Where and how to replay (prompt shapes live in `PromptConfig`)."""

    url: str  # base URL of the server, e.g. http://127.0.0.1:8000
    model: str = ""  # "" = the first model /v1/models lists
    api_key: str = ""  # sent as a Bearer token when set
    speed: float = 1.0  # 2.0 = arrivals twice as fast as the trace
    concurrency: int = 0  # requests in flight at most; 0 = no cap
    timeout_s: float = 300.0  # to connect, and between two pieces of a response
    prompt_format: PromptFormat = "tokens"  # token-id lists, or words standing for them
    ignore_eos: bool = True  # ask the server to go on past EOS (outputs of the asked length)
    vocab_size: int | None = None  # None = the server's, else DEFAULT_VOCAB_SIZE
    ttft_slo_s: float = 30.0  # PAPER.md §8.1.3 trace replay
    tbt_slo_s: float = 0.1

    def validate(self) -> None:
        """Raise ConfigError naming every flag that is out of range."""
        checks = [
            (self.speed > 0, f"--speed must be > 0, got {self.speed}"),
            (self.concurrency >= 0, f"--concurrency must be >= 0, got {self.concurrency}"),
            (self.timeout_s > 0, f"--timeout must be > 0 s, got {self.timeout_s}"),
            (
                self.prompt_format in ("tokens", "text"),
                f"--prompt-format must be tokens or text, got {self.prompt_format!r}",
            ),
            (
                self.vocab_size is None or self.vocab_size >= 1,
                f"--vocab-size must be >= 1, got {self.vocab_size}",
            ),
        ]
        if problems := [message for ok, message in checks if not ok]:
            raise ConfigError(problems)


OnRecord = Callable[[RequestRecord], None]


def resolve_vocab(cfg: ReplayConfig, info: ServerInfo) -> int:
    """The vocabulary to draw ids from: the flag, else the server's, else the default."""
    if cfg.vocab_size is None:
        return info.vocab_size or DEFAULT_VOCAB_SIZE
    if info.vocab_size is not None and cfg.vocab_size > info.vocab_size:
        raise ConfigError(
            f"--vocab-size {cfg.vocab_size} is larger than the vocabulary of {info.model} "
            f"({info.vocab_size} ids); leave it out or give at most {info.vocab_size}"
        )
    return cfg.vocab_size


def request_body(
    rec: TraceRecord, prompts: PromptConfig, cfg: ReplayConfig, model: str
) -> dict[str, Any]:
    """The JSON body of one streaming `/v1/completions` request for trace record `rec`."""
    ids = prompts.prompt_ids(rec)
    body: dict[str, Any] = {
        "model": model,
        "prompt": ids if cfg.prompt_format == "tokens" else ids_to_text(ids),
        "max_tokens": prompts.output_len(rec),
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    return body


def _client(cfg: ReplayConfig) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(
        max_connections=cfg.concurrency or None, max_keepalive_connections=cfg.concurrency or 64
    )
    return httpx.AsyncClient(
        base_url=normalize_url(cfg.url),
        headers=headers,
        timeout=httpx.Timeout(cfg.timeout_s),
        limits=limits,
    )


async def replay_async(
    records: list[TraceRecord],
    prompts: PromptConfig,
    cfg: ReplayConfig,
    on_start: Callable[[ServerInfo, PromptConfig], None] | None = None,
    on_record: OnRecord | None = None,
) -> ReplayReport:
    """Replay `records` and summarize. `on_start` hears the probed server and the final
    prompt settings before the first send; `on_record` hears each finished request."""
    cfg.validate()
    url = normalize_url(cfg.url)
    async with _client(cfg) as client:
        info = await probe_server(client, url, cfg.model)
        prompts = replace(prompts, vocab_size=resolve_vocab(cfg, info))
        if cfg.vocab_size is None and info.vocab_size is None:
            log.warning(
                "%s/v1/models gives no vocab_size: token ids are drawn from [%d, %d); pass "
                "--vocab-size N if the model's vocabulary is smaller",
                url,
                prompts.first_id,
                prompts.vocab_size,
            )
        if prompts.fit_context and info.max_model_len is not None:
            prompts = prompts.fitted(records, info.max_model_len)
        prompts.validate()
        _warn_too_long(records, prompts, info)
        if on_start is not None:
            on_start(info, prompts)
        gate = asyncio.Semaphore(cfg.concurrency) if cfg.concurrency else None
        t0 = time.perf_counter()

        async def one(i: int, rec: TraceRecord) -> RequestRecord:
            body = request_body(rec, prompts, cfg, info.model)
            if gate is None:
                done = await send_completion(client, body, i, t0)
            else:
                async with gate:
                    done = await send_completion(client, body, i, t0)
            if on_record is not None:
                on_record(done)
            return done

        done = await send_at_arrivals(records, cfg.speed, t0, one)
    run = RunInfo(
        url=url,
        model=info.model,
        ttft_slo_s=cfg.ttft_slo_s,
        tbt_slo_s=cfg.tbt_slo_s,
        block_tokens=prompts.block_tokens,
        scale=prompts.scale,
        output_scale=prompts.output_scale,
        speed=cfg.speed,
        vocab_size=prompts.vocab_size,
        prompt_format=cfg.prompt_format,
    )
    return summarize(list(done), run)


async def send_at_arrivals(
    records: list[TraceRecord],
    speed: float,
    t0: float,
    one: Callable[[int, TraceRecord], Coroutine[Any, Any, RequestRecord]],
) -> list[RequestRecord]:
    """Start `one(i, record)` at each record's timestamp / `speed` (seconds after `t0`, a
    perf_counter reading), all in flight at once; their records in trace order."""
    first_ms = records[0].timestamp
    tasks: list[asyncio.Task[RequestRecord]] = []
    for i, rec in enumerate(records):
        delay = (rec.timestamp - first_ms) / 1000.0 / speed - (time.perf_counter() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i, rec)))
    return list(await asyncio.gather(*tasks))


def replay(
    records: list[TraceRecord],
    prompts: PromptConfig,
    cfg: ReplayConfig,
    on_start: Callable[[ServerInfo, PromptConfig], None] | None = None,
    on_record: OnRecord | None = None,
) -> ReplayReport:
    """`replay_async` on a fresh event loop (blocks until every request ended)."""
    if not records:
        raise ReplayError("the trace has no requests to replay")
    return asyncio.run(replay_async(records, prompts, cfg, on_start, on_record))


def _warn_too_long(records: list[TraceRecord], prompts: PromptConfig, info: ServerInfo) -> None:
    if info.max_model_len is None:
        return
    num = sum(prompts.input_len(r) + prompts.output_len(r) > info.max_model_len for r in records)
    if num:
        log.warning(
            "%d of %d requests exceed the server's max_model_len %d (prompt + output) and "
            "will likely fail; lower --scale or --max-tokens",
            num,
            len(records),
            info.max_model_len,
        )
