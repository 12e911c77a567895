"""The cluster's figures: `PoolCounters` (prefix hits as the Conductor placed requests, KV
handed to decode nodes), counted by the backend, and their Prometheus export with nodes by
role and state, read on each scrape.

The prefix hits are the Conductor's view at placement, not the reuse the API reports
(`cached_tokens`: counted by api/stats.py from the prefill node's actual reuse, exported as
`mooncake_api_cached_tokens` and shown by `mooncake status` as "cached tokens")."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mooncake.roles.master.registry import Registry


@dataclass
class PoolCounters:
    lookups: int = 0  # prompt blocks looked up
    hits: int = 0  # of those, held anywhere in the pool
    local_hits: int = 0  # held by the chosen prefill node itself
    kv_bytes: int = 0  # KV handed from prefill to decode nodes
    kv_window: deque[tuple[float, int]] = field(default_factory=deque)  # (time, bytes)
    # requests refused for the prefill queue alone (scheduler.defer_s): waiting now for an
    # idle group, placed after waiting, refused when none was idle in time
    waiting: int = 0
    waited: int = 0
    waited_out: int = 0

    def add_lookup(self, num_blocks: int, num_hits: int, num_local_hits: int) -> None:
        self.lookups += num_blocks
        self.hits += num_hits
        self.local_hits += num_local_hits

    def add_kv(self, now: float, num_bytes: int) -> None:
        self.kv_bytes += num_bytes
        self.kv_window.append((now, num_bytes))

    def kv_bytes_per_s(self, now: float, window_s: float = 10.0) -> float:
        """KV handed off over the last `window_s` seconds, per second (drops older ones)."""
        while self.kv_window and self.kv_window[0][0] < now - window_s:
            self.kv_window.popleft()
        return sum(b for _, b in self.kv_window) / window_s


class ClusterCollector(Collector):
    """Reads `counters` and (under `lock`) `registry` on each scrape."""

    def __init__(self, counters: PoolCounters, registry: Registry, lock: threading.Lock):
        self.counters, self.registry, self.lock = counters, registry, lock

    def collect(self) -> Iterator[Metric]:
        c = self.counters
        for name, doc, value in (
            (
                "mooncake_prefix_blocks_looked_up",
                "Prompt blocks the Conductor looked up at placement.",
                c.lookups,
            ),
            (
                "mooncake_prefix_blocks_hit",
                "Prompt blocks the Conductor found in the pool at placement (the reuse the API "
                "reports is mooncake_api_cached_tokens).",
                c.hits,
            ),
            (
                "mooncake_prefix_blocks_local_hit",
                "Prompt blocks the chosen prefill node held itself at placement.",
                c.local_hits,
            ),
            (
                "mooncake_kv_handoff_bytes",
                "KV bytes handed from prefill to decode nodes.",
                c.kv_bytes,
            ),
            (
                "mooncake_requests_waited",
                "Requests refused for the prefill queue alone that waited for an idle group "
                "and were placed (scheduler.defer_s).",
                c.waited,
            ),
            (
                "mooncake_requests_waited_out",
                "Requests that waited for an idle prefill group and were refused (429).",
                c.waited_out,
            ),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        yield GaugeMetricFamily(
            "mooncake_requests_waiting",
            "Requests waiting now for an idle prefill group (scheduler.defer_s).",
            value=c.waiting,
        )
        g = GaugeMetricFamily(
            "mooncake_nodes", "Nodes by role and state.", labels=["role", "state"]
        )
        counts: dict[tuple[str, str], int] = {}
        with self.lock:
            for r in self.registry.nodes.values():
                counts[(r.role, r.state)] = counts.get((r.role, r.state), 0) + 1
        for (role, state), n in sorted(counts.items()):
            g.add_metric([role, state], n)
        yield g
