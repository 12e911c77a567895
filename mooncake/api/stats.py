"""What the HTTP API served: outcome counters and a recent window of TTFT and TBT.

The app records every generation request (`RequestStats.start` -> `RequestTrace`): arrival
to first token is its TTFT, each gap between later tokens one TBT sample. A request refused
as bad with a 4xx (400, 404, 413: `RequestTrace.refuse`) is counted apart, as refused, and
not as received; one refused by admission (429) was a valid request: it is received, with
the outcome "rejected" (the paper's rejection rate is rejected / received). The master and
`mooncake serve` read `snapshot()` to build the `/v1/status` snapshot; with a Prometheus
registry the same events also feed counters and histograms.

    stats = RequestStats()
    trace = stats.start(time.perf_counter())
    trace.token(); trace.token(); trace.end("completed")
    stats.snapshot().ttft_p50_s
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable
from typing import Any, Literal

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

Outcome = Literal["completed", "rejected", "failed", "cancelled"]
OUTCOMES: tuple[Outcome, ...] = ("completed", "rejected", "failed", "cancelled")

# Histogram buckets, seconds: TTFT spans queueing and long prefills, TBT one decode step.
TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TBT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


def percentile(values: Iterable[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation, as numpy's default; None if
    `values` is empty."""
    assert 0 <= q <= 100, f"percentile {q} outside 0-100"
    data = sorted(values)
    if not data:
        return None
    pos = (len(data) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


class StatsSnapshot(msgspec.Struct, frozen=True, kw_only=True):
    """Counts since start and percentiles over the recent window (None when it is empty)."""

    num_requests: int  # generation requests received (every outcome below, plus in flight)
    num_completed: int  # finished with stop or length
    num_rejected: int  # refused by admission (HTTP 429)
    num_refused: int  # bad requests refused with a 4xx (400/404/413); not in num_requests
    num_failed: int  # backend errors before or after the first token
    num_cancelled: int  # the client went away first
    num_waiting: int  # in flight, no token yet
    num_streaming: int  # in flight, producing tokens
    num_prompt_tokens: int  # prompt tokens of requests that started
    num_cached_tokens: int  # of those, tokens whose KV the backend reused
    num_generated_tokens: int  # output tokens produced
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    ttft_p99_s: float | None
    tbt_p50_s: float | None
    tbt_p90_s: float | None
    tbt_p99_s: float | None
    window_requests: int  # TTFT samples the percentiles cover
    window_gaps: int  # TBT samples the percentiles cover

    def status_fields(self) -> dict[str, Any]:
        """The request figures of `/v1/status` (api.status.Status), as both servers give
        them."""
        share = self.num_cached_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0
        return {
            "num_requests": self.num_requests,
            "num_completed": self.num_completed,
            "rejected": self.num_rejected,
            "num_failed": self.num_failed,
            "num_refused": self.num_refused,
            "ttft_p50_s": self.ttft_p50_s,
            "ttft_p90_s": self.ttft_p90_s,
            "tbt_p50_s": self.tbt_p50_s,
            "tbt_p90_s": self.tbt_p90_s,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_cached_tokens": self.num_cached_tokens,
            "cached_token_share": share,
        }


class _Metrics:
    """The Prometheus side of RequestStats, in one registry."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry
        self.requests = Counter(
            "mooncake_api_requests",
            "Generation requests by outcome.",
            ["outcome"],
            registry=registry,
        )
        for outcome in OUTCOMES:
            self.requests.labels(outcome)
        self.refused = Counter(
            "mooncake_api_refused_requests",
            "Generation requests refused as bad with a 4xx (not counted as received), by status.",
            ["status"],
            registry=registry,
        )
        self.in_flight = Gauge(
            "mooncake_api_requests_in_flight", "Requests being served.", registry=registry
        )
        self.ttft = Histogram(
            "mooncake_api_ttft_seconds",
            "Time to first token (arrival to first token).",
            registry=registry,
            buckets=TTFT_BUCKETS_S,
        )
        self.tbt = Histogram(
            "mooncake_api_tbt_seconds",
            "Time between consecutive tokens of a request.",
            registry=registry,
            buckets=TBT_BUCKETS_S,
        )
        self.prompt_tokens = Counter(
            "mooncake_api_prompt_tokens", "Prompt tokens of started requests.", registry=registry
        )
        self.cached_tokens = Counter(
            "mooncake_api_cached_tokens",
            "Prompt tokens reported as cached (KV reused, not computed), as in the API's usage.",
            registry=registry,
        )
        self.generated_tokens = Counter(
            "mooncake_api_generated_tokens", "Output tokens generated.", registry=registry
        )


class RequestStats:
    """Counters and recent TTFT/TBT samples of the requests the API served. Thread-safe."""

    def __init__(self, window_requests: int = 1000, window_gaps: int = 10000):
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(OUTCOMES, 0)
        self._num_requests = self._num_streaming = self._num_refused = 0
        self._num_prompt = self._num_cached = self._num_generated = 0
        self._ttft_s: deque[float] = deque(maxlen=window_requests)  # one per request
        self._tbt_s: deque[float] = deque(maxlen=window_gaps)  # one per token gap
        self._metrics: _Metrics | None = None

    def register_metrics(self, registry: CollectorRegistry) -> None:
        """Also count into Prometheus metrics in `registry` (once; again is a no-op)."""
        if self._metrics is None:
            self._metrics = _Metrics(registry)
        assert self._metrics.registry is registry, "RequestStats feeds one registry only"

    def start(self, arrival: float | None = None) -> RequestTrace:
        """Count a request that arrived at `arrival` (time.perf_counter(); default now)."""
        with self._lock:
            self._num_requests += 1
        if self._metrics:
            self._metrics.in_flight.inc()
        return RequestTrace(self, time.perf_counter() if arrival is None else arrival)

    def snapshot(self) -> StatsSnapshot:
        """Counts and window percentiles as of now; does not change state."""
        with self._lock:
            ttft, tbt, c = list(self._ttft_s), list(self._tbt_s), dict(self._counts)
            num_requests, num_streaming = self._num_requests, self._num_streaming
            num_refused = self._num_refused
            prompt, cached, generated = self._num_prompt, self._num_cached, self._num_generated
        done = sum(c.values())
        return StatsSnapshot(
            num_requests=num_requests,
            num_completed=c["completed"],
            num_rejected=c["rejected"],
            num_refused=num_refused,
            num_failed=c["failed"],
            num_cancelled=c["cancelled"],
            num_waiting=num_requests - done - num_streaming,
            num_streaming=num_streaming,
            num_prompt_tokens=prompt,
            num_cached_tokens=cached,
            num_generated_tokens=generated,
            ttft_p50_s=percentile(ttft, 50),
            ttft_p90_s=percentile(ttft, 90),
            ttft_p99_s=percentile(ttft, 99),
            tbt_p50_s=percentile(tbt, 50),
            tbt_p90_s=percentile(tbt, 90),
            tbt_p99_s=percentile(tbt, 99),
            window_requests=len(ttft),
            window_gaps=len(tbt),
        )

    # -- called by RequestTrace ---------------------------------------------------------
    def _on_prompt(self, num_tokens: int, num_cached: int) -> None:
        with self._lock:
            self._num_prompt += num_tokens
            self._num_cached += num_cached
        if self._metrics:
            self._metrics.prompt_tokens.inc(num_tokens)
            self._metrics.cached_tokens.inc(num_cached)

    def _on_token(self, ttft_s: float | None, tbt_s: float | None) -> None:
        with self._lock:
            self._num_generated += 1
            if ttft_s is not None:
                self._ttft_s.append(ttft_s)
                self._num_streaming += 1
            if tbt_s is not None:
                self._tbt_s.append(tbt_s)
        if m := self._metrics:
            m.generated_tokens.inc()
            if ttft_s is not None:
                m.ttft.observe(ttft_s)
            if tbt_s is not None:
                m.tbt.observe(tbt_s)

    def _on_refused(self, status: int) -> None:
        with self._lock:
            self._num_requests -= 1  # NOTE: counted at arrival, before it could be read
            self._num_refused += 1
        if m := self._metrics:
            m.refused.labels(str(status)).inc()
            m.in_flight.dec()

    def _on_end(self, outcome: Outcome, was_streaming: bool) -> None:
        with self._lock:
            self._counts[outcome] += 1
            self._num_streaming -= was_streaming
        if m := self._metrics:
            m.requests.labels(outcome).inc()
            m.in_flight.dec()


class RequestTrace:
    """One request's timeline; the app calls `prompt` once, `cached` once the backend says
    what it reused, `token` per output token and `end` (or `refuse`, for a bad request)
    exactly once."""

    def __init__(self, stats: RequestStats, arrival: float):
        self.stats, self.arrival = stats, arrival  # time.perf_counter() seconds
        self.last_token: float | None = None
        self.num_tokens = 0
        self.outcome: Outcome | None = None
        self.is_ended = False

    def prompt(self, num_tokens: int) -> None:
        self.stats._on_prompt(num_tokens, 0)

    def cached(self, num_cached: int) -> None:
        """Prompt tokens the backend reused, once it tells (after `prompt`)."""
        self.stats._on_prompt(0, num_cached)

    def token(self, now: float | None = None) -> None:
        now = time.perf_counter() if now is None else now
        if self.last_token is None:
            self.stats._on_token(now - self.arrival, None)
        else:
            self.stats._on_token(None, now - self.last_token)
        self.last_token = now
        self.num_tokens += 1

    def end(self, outcome: Outcome) -> None:
        """Record the outcome; a second call is ignored (the first outcome stands)."""
        if not self.is_ended:
            self.is_ended, self.outcome = True, outcome
            self.stats._on_end(outcome, self.last_token is not None)

    def refuse(self, status: int) -> None:
        """The request was refused as bad with HTTP `status` (4xx), before any work: it
        counts as refused, not as received. Like `end`, once."""
        if not self.is_ended:
            self.is_ended = True
            self.stats._on_refused(status)
