"""Prometheus metrics of the Store.

Master side: `StoreCollector` reads the service's stats snapshot on every scrape (the
counters live in the metadata service only; nothing is counted twice), and
`MetricsServer` serves it on /metrics (StoreService(metrics_port=...) starts one).

Client side: `ClientMetrics` holds put/get latency histograms in its own registry;
`instrument(store, metrics)` times a Store's calls into it.

    server = MetricsServer(service.stats, port=9100); server.start()   # GET :9100/metrics
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mooncake.store.metadata.objects import StoreStats

# Latency buckets in seconds: 20 us to 10 s, roughly x2.5 apart.
LATENCY_BUCKETS_S = (
    2e-5,
    5e-5,
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    1e-2,
    2.5e-2,
    5e-2,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
_COUNTERS = (  # StoreStats field -> (metric name without _total, help)
    ("hits", "mooncake_store_hits", "Reads that found a committed object."),
    ("misses", "mooncake_store_misses", "Reads of a key with no committed object."),
    ("puts", "mooncake_store_puts", "Committed puts."),
    ("removes", "mooncake_store_removes", "Removed objects."),
    ("evictions", "mooncake_store_evictions", "Replicas evicted above the high watermark."),
    ("demotions", "mooncake_store_demotions", "Replicas moved down a tier (DRAM -> SSD)."),
    ("promotions", "mooncake_store_promotions", "Replicas moved up a tier on a hit."),
    ("replications", "mooncake_store_replications", "Hot-spot copies made on another node."),
    ("copies", "mooncake_store_copies", "Copies made to a lower tier ahead of eviction."),
    ("lost_objects", "mooncake_store_lost_objects", "Objects lost with their last replica."),
)


class StoreCollector(Collector):
    """Turns one `stats()` snapshot per scrape into Prometheus counters and gauges."""

    def __init__(self, stats: Callable[[], StoreStats]):
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        for field, name, doc in _COUNTERS:
            yield CounterMetricFamily(name, doc, value=getattr(s, field))
        yield GaugeMetricFamily("mooncake_store_objects", "Objects in the pool.", s.num_objects)
        yield GaugeMetricFamily("mooncake_store_segments", "Mounted segments.", s.num_segments)
        yield GaugeMetricFamily("mooncake_store_nodes", "Live store nodes.", s.num_nodes)
        per_tier = (
            (
                "mooncake_store_tier_capacity_bytes",
                "Bytes mounted per tier.",
                "tier_capacity_bytes",
            ),
            ("mooncake_store_tier_used_bytes", "Bytes allocated per tier.", "tier_used_bytes"),
            (
                "mooncake_store_tier_objects",
                "Committed objects with a replica per tier.",
                "tier_objects",
            ),
        )
        hits = CounterMetricFamily(
            "mooncake_store_tier_hits",
            "Reads that found a committed object, by the tier of the replica read first.",
            labels=["tier"],
        )
        for tier, value in sorted(s.tier_hits.items()):
            hits.add_metric([tier], value)
        yield hits
        for name, doc, field in per_tier:
            g = GaugeMetricFamily(name, doc, labels=["tier"])
            for tier, value in sorted(getattr(s, field).items()):
                g.add_metric([tier], value)
            yield g


class MetricsServer:
    """Serves a registry (by default one StoreCollector over `stats`) on http://host:port/metrics."""

    def __init__(
        self,
        stats: Callable[[], StoreStats] | None = None,
        *,
        port: int = 0,  # 0 = any free port (see `port` after start)
        host: str = "127.0.0.1",
        registry: CollectorRegistry | None = None,
    ):
        self.registry = registry or CollectorRegistry(auto_describe=False)
        if stats is not None:
            self.registry.register(StoreCollector(stats))
        self.host, self.port = host, port
        self._server: Any = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def start(self) -> None:
        server, _thread = start_http_server(self.port, self.host, registry=self.registry)
        self._server = server
        self.port = server.server_port

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class ClientMetrics:
    """Put/get latency histograms of one client, in a registry of their own."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.latency = Histogram(
            "mooncake_store_client_latency_seconds",
            "Latency of Store client calls, by call (put, get, put_from, ...).",
            ["op"],
            registry=self.registry,
            buckets=LATENCY_BUCKETS_S,
        )

    def observe(self, op: str, seconds: float) -> None:
        self.latency.labels(op).observe(seconds)


TIMED_OPS = ("put", "get", "put_from", "get_into", "put_batch", "get_batch")


def instrument(store: Any, metrics: ClientMetrics) -> Any:
    """Time `store`'s put/get calls (all of TIMED_OPS) into `metrics`; returns `store`.
    Calls that raise are timed too."""
    for op in TIMED_OPS:
        method = getattr(store, op)

        @functools.wraps(method)
        def timed(*args: Any, _op: str = op, _method: Any = method, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _method(*args, **kw)
            finally:
                metrics.observe(_op, time.perf_counter() - t0)

        setattr(store, op, timed)
    return store
