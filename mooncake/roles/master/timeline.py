"""Where each request's time to first token went, against what the Conductor predicted.

The master notes four moments of a request's first placement (`Moments`):

    arrival     placed by the Conductor, with its predicted TTFT (Algorithm 1)
    started     its group's leader asked to start it (`admit_prefill`): queue before it
    prefilled   every stage's KV landed on the decode node and the request was submitted
    first       the decode node's first token reached the master

so TTFT = queue + prefill (with the streamed hand-off) + first step. `PhaseLog` keeps the
last N requests' phases and answers their percentiles and the median of predicted / actual
TTFT, the figure that says whether the Conductor prices the cluster it schedules (a ratio
well under 1 means it admits requests it cannot serve in time). `mooncake status --json`
shows them as `ttft_phases`; `/metrics` as `mooncake_ttft_phase_seconds{phase}` and
`mooncake_ttft_predicted_over_actual`.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Histogram

from mooncake.api.stats import TTFT_BUCKETS_S, percentile
from mooncake.api.status import TtftPhases

log = logging.getLogger(__name__)

PHASES = ("queue", "prefill", "first_step")
RATIO_BUCKETS = (0.05, 0.1, 0.2, 0.35, 0.5, 0.7, 0.85, 1.0, 1.2, 1.5, 2.0, 3.0, 5.0)


@dataclass
class Moments:
    """One placement's moments (time.monotonic(), s; 0 = not yet)."""

    req_id: int
    arrival: float
    predicted_ttft_s: float
    started: float = 0.0
    prefilled: float = 0.0
    first: float = 0.0  # its first token at the master


class PhaseLog:
    """The phases of the last `window` requests that got a first token. Thread-safe."""

    def __init__(self, window: int = 1000):
        self._lock = threading.Lock()
        self._rows: deque[tuple[float, float, float, float]] = deque(maxlen=window)
        self._hist: Histogram | None = None
        self._ratio: Histogram | None = None

    def register_metrics(self, registry: CollectorRegistry) -> None:
        self._hist = Histogram(
            "mooncake_ttft_phase_seconds",
            "Where time to first token went: queue (arrival -> prefill start), prefill "
            "(start -> all KV on the decode node), first_step (-> first token).",
            ["phase"],
            registry=registry,
            buckets=TTFT_BUCKETS_S,
        )
        self._ratio = Histogram(
            "mooncake_ttft_predicted_over_actual",
            "The Conductor's predicted TTFT over the real one, per request.",
            registry=registry,
            buckets=RATIO_BUCKETS,
        )

    def first_token(self, m: Moments, t: float) -> None:
        """Its first token arrived at `t`: recorded now if its prefill node reported, else
        with the report (which comes after the pool's seal, often after the token)."""
        with self._lock:
            m.first, is_ready = t, m.prefilled > 0
        if is_ready:
            self.record(m, t)

    def handed_off(self, m: Moments, t: float) -> None:
        """Its prefill node reported its KV with the decode node at `t` (the report's
        arrival less the seal that came between)."""
        with self._lock:
            m.prefilled, first = t, m.first
        if first:
            self.record(m, first)

    def record(self, m: Moments, first: float) -> None:
        """A request's first token arrived at `first`; ignored without a start. The prefill
        node's report and the decode node's first token come on different connections: a
        first token ahead of the report counts its prefill up to the token."""
        if not m.arrival <= m.started <= first:  # NOTE: started 0 (never) fails this too
            return
        prefilled = m.prefilled if m.started <= m.prefilled <= first else first
        row = (m.started - m.arrival, prefilled - m.started, first - prefilled)
        ratio = m.predicted_ttft_s / max(first - m.arrival, 1e-6)
        log.debug(
            "req %d: ttft %.3f s (predicted %.3f): queue %.3f, prefill %.3f, first step %.3f",
            m.req_id,
            first - m.arrival,
            m.predicted_ttft_s,
            *row,
        )
        with self._lock:
            self._rows.append((*row, ratio))
        if self._hist is not None and self._ratio is not None:
            for phase, seconds in zip(PHASES, row, strict=True):
                self._hist.labels(phase).observe(seconds)
            self._ratio.observe(ratio)

    def summary(self) -> TtftPhases:
        with self._lock:
            rows = list(self._rows)
        return phase_summary([row[:3] for row in rows], [row[3] for row in rows])


def phase_summary(
    rows: list[tuple[float, float, float]], ratios: list[float] | None = None
) -> TtftPhases:
    """Percentiles of (queue, prefill, first step) rows, and the median of predicted /
    actual TTFT when `ratios` are given."""
    q, p, f = ([row[i] for row in rows] for i in range(3))
    return TtftPhases(
        num_requests=len(rows),
        queue_p50_s=percentile(q, 50),
        queue_p90_s=percentile(q, 90),
        prefill_p50_s=percentile(p, 50),
        prefill_p90_s=percentile(p, 90),
        first_step_p50_s=percentile(f, 50),
        first_step_p90_s=percentile(f, 90),
        predicted_over_actual_p50=percentile(ratios or [], 50),
    )
