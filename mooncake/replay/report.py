"""Per-request records of a replay and the summary it reports.

- TTFT: from sending the request to the first chunk that carries a token.
- TBT: the gaps between later token chunks. The TBT percentiles pool every gap of every
  completed request; a request's own TBT is the 90th percentile of its gaps.
- SLO: a request meets it when it completed with TTFT <= the TTFT SLO and its own P90
  TBT <= the TBT SLO (a request with one output token has no gaps and meets the TBT
  part). Attainment is over all requests sent, so rejected and failed ones are misses.
- Percentiles interpolate linearly between the closest ranks (numpy's default).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Literal

import msgspec
import numpy as np

from mooncake.conductor.misses import CAUSES, ELSEWHERE_PARTS

# usage.prompt_tokens_details.kv_blocks of a mooncake server (api/bodies.py): the blocks
# the prompt could have reused, and those by cause
KV_BLOCK_KEYS = ("requested", *CAUSES, *ELSEWHERE_PARTS)

Status = Literal["ok", "rejected", "error"]


class RequestRecord(msgspec.Struct, kw_only=True):
    """What one replayed request did (times in seconds from the start of the replay)."""

    index: int  # position in the trace (0-based)
    status: Status  # ok | rejected (HTTP 429) | error
    send_s: float  # when the request was sent
    end_s: float  # when its response ended
    ttft_s: float | None = None  # send -> first token chunk; None if no token came
    gaps_s: list[float] = []  # between consecutive token chunks after the first
    prompt_tokens: int = 0  # as the server reported it (else as sent)
    output_tokens: int = 0  # as the server reported it (else token chunks seen)
    expected_output_tokens: int = 0  # what was asked for (max_tokens)
    cached_tokens: int | None = None  # prompt tokens served from the server's cache, if told
    # usage.prompt_tokens_details.kv_blocks, if told (mooncake): requested and each cause
    kv_blocks: dict[str, int] = {}
    error: str = ""  # why it failed (status "error") or was rejected
    # what kind of failure, from its shape, not its wording: "http <status> <error.type>",
    # "stream <error.type>" (an error event mid-stream), "connect", "disconnected" (the
    # connection cut mid-answer), "timeout", "ended early" (no finish and no error),
    # "bad data", "hung" (set by a caller that gave up waiting); "" when it did not fail
    error_kind: str = ""

    @property
    def tbt_p90_s(self) -> float:
        return _pct(self.gaps_s, 90)


class ReplayReport(msgspec.Struct, kw_only=True):
    """What `mooncake replay` reports (seconds unless named otherwise)."""

    url: str
    model: str
    sent: int
    completed: int
    rejected: int  # HTTP 429
    failed: int  # any other error
    short_outputs: int  # completed with fewer output tokens than asked (EOS not ignored?)
    ttft_p50_s: float | None  # None when no request produced a token
    ttft_p90_s: float | None
    ttft_p99_s: float | None
    tbt_p50_s: float | None  # over all token gaps; None when there were none
    tbt_p90_s: float | None
    tbt_p99_s: float | None
    ttft_slo_s: float
    tbt_slo_s: float
    slo_attainment: float  # share of sent requests meeting both SLOs
    prompt_tokens: int  # over completed requests
    output_tokens: int  # over completed requests
    output_tokens_per_s: float  # output_tokens / duration_s
    # goodput: the output tokens of the requests meeting both SLOs / duration_s
    goodput_tokens_per_s: float
    request_throughput_rps: float  # completed / duration_s
    cached_token_share: float | None  # cached / prompt tokens where reported; None if never
    duration_s: float  # first send to last response end
    block_tokens: int  # tokens per block after --scale
    scale: float
    output_scale: float
    speed: float
    vocab_size: int
    prompt_format: str  # tokens | text
    errors: dict[str, int] = {}  # error message -> count (failed and rejected requests)
    # the completed requests' blocks by cause, where the server attributes its misses
    # (KV_BLOCK_KEYS: requested, each cause, the elsewhere parts); {} if it never did
    kv_blocks: dict[str, int] = {}
    kv_block_shares: dict[str, float] = {}  # each of them / requested


def _pct(values: list[float] | np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else 0.0


def _pct_or_none(values: np.ndarray, q: float) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


def meets_slo(rec: RequestRecord, ttft_slo_s: float, tbt_slo_s: float) -> bool:
    """Completed, TTFT within its SLO and the request's P90 TBT within its SLO."""
    return (
        rec.status == "ok"
        and rec.ttft_s is not None
        and rec.ttft_s <= ttft_slo_s
        and rec.tbt_p90_s <= tbt_slo_s
    )


class RunInfo(msgspec.Struct, frozen=True, kw_only=True):
    """The settings of a replay that its report repeats."""

    url: str
    model: str
    ttft_slo_s: float
    tbt_slo_s: float
    block_tokens: int
    scale: float
    output_scale: float
    speed: float
    vocab_size: int
    prompt_format: str


def summarize(records: list[RequestRecord], info: RunInfo) -> ReplayReport:
    """Aggregate the records of a finished replay (pure; changes nothing)."""
    ttft_slo_s, tbt_slo_s = info.ttft_slo_s, info.tbt_slo_s
    done = [r for r in records if r.status == "ok"]
    ttft = np.array([r.ttft_s for r in done if r.ttft_s is not None], dtype=float)
    gaps = np.array([g for r in done for g in r.gaps_s], dtype=float)
    start = min((r.send_s for r in records), default=0.0)
    end = max((r.end_s for r in records), default=0.0)
    duration = max(end - start, 1e-9)
    reported = [r for r in done if r.cached_tokens is not None]
    reported_prompt = sum(r.prompt_tokens for r in reported)
    output_tokens = sum(r.output_tokens for r in done)
    errors = Counter(r.error or r.status for r in records if r.status != "ok")
    good = [r for r in records if meets_slo(r, ttft_slo_s, tbt_slo_s)]
    blocks = Counter[str]()
    for r in done:
        blocks.update(r.kv_blocks)
    requested = blocks.get("requested", 0)
    return ReplayReport(
        sent=len(records),
        completed=len(done),
        rejected=sum(r.status == "rejected" for r in records),
        failed=sum(r.status == "error" for r in records),
        short_outputs=sum(r.output_tokens < r.expected_output_tokens for r in done),
        ttft_p50_s=_pct_or_none(ttft, 50),
        ttft_p90_s=_pct_or_none(ttft, 90),
        ttft_p99_s=_pct_or_none(ttft, 99),
        tbt_p50_s=_pct_or_none(gaps, 50),
        tbt_p90_s=_pct_or_none(gaps, 90),
        tbt_p99_s=_pct_or_none(gaps, 99),
        ttft_slo_s=ttft_slo_s,
        tbt_slo_s=tbt_slo_s,
        slo_attainment=len(good) / max(len(records), 1),
        prompt_tokens=sum(r.prompt_tokens for r in done),
        output_tokens=output_tokens,
        output_tokens_per_s=output_tokens / duration,
        goodput_tokens_per_s=sum(r.output_tokens for r in good) / duration,
        request_throughput_rps=len(done) / duration,
        cached_token_share=(
            sum(r.cached_tokens or 0 for r in reported) / reported_prompt
            if reported_prompt
            else None
        ),
        duration_s=end - start,
        errors=dict(errors.most_common(10)),
        kv_blocks=dict(blocks),
        kv_block_shares={k: v / requested for k, v in blocks.items() if requested},
        url=info.url,
        model=info.model,
        block_tokens=info.block_tokens,
        scale=info.scale,
        output_scale=info.output_scale,
        speed=info.speed,
        vocab_size=info.vocab_size,
        prompt_format=info.prompt_format,
    )


def figure_ratios(num: object, den: object, names: Sequence[str]) -> dict[str, float | None]:
    """num / den per named figure; None when either is missing or den's is 0."""
    out: dict[str, float | None] = {}
    for name in names:
        a, b = getattr(den, name), getattr(num, name)
        out[name] = float(b) / float(a) if a and b is not None else None
    return out
