"""The master's /metrics, scraped over HTTP, follows the service's counters after puts and
gets; the client-side histograms count timed put/get calls."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from mooncake.store.client.client import NotFoundError, Store
from mooncake.store.metadata.settings import MetadataConfig
from mooncake.store.node.node import StoreNode, TierSizes
from mooncake.store.server.metrics import ClientMetrics, MetricsServer, instrument
from mooncake.store.server.service import StoreService

pytestmark = pytest.mark.timeout(60)
SECRET = "metrics-test-secret-0123456789abcdef"


def scrape(url: str) -> dict[tuple[str, str], float]:
    """(sample name, tier label or "") -> value, from a GET of `url`."""
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    return {
        (s.name, s.labels.get("tier", "") or s.labels.get("op", "")): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def test_metrics_endpoint_counts_puts_hits_misses_and_bytes_per_tier() -> None:
    """After 3 puts, 2 hits and 1 miss, /metrics reports exactly those deltas, the objects
    and the DRAM bytes used; the client histograms saw 3 puts and 3 gets."""
    cfg = MetadataConfig(lease_ttl_s=0.2, heartbeat_ttl_s=5.0)
    with StoreService(SECRET, cfg, tick_s=3600, metrics_port=0) as service:
        assert service.metrics is not None
        url = service.metrics.url
        node = StoreNode("m0", service.address, SECRET, TierSizes(dram_bytes=1 << 20))
        node.start()
        try:
            before = scrape(url)
            assert before[("mooncake_store_tier_capacity_bytes", "dram")] == 1 << 20
            assert before[("mooncake_store_nodes", "")] == 1
            client = ClientMetrics()
            with Store.connect(service.address, SECRET) as store:
                instrument(store, client)
                for i in range(3):
                    store.put(f"k{i}", bytes([i]) * 1000)
                assert store.get("k0") == bytes(1000) and store.get("k1") == b"\x01" * 1000
                with pytest.raises(NotFoundError):
                    store.get("absent")
            after = scrape(url)
            cserver = MetricsServer(registry=client.registry)
            cserver.start()
            try:
                seen = scrape(cserver.url)
            finally:
                cserver.stop()
        finally:
            node.stop()

    def delta(name: str, label: str = "") -> float:
        return after[(name, label)] - before.get((name, label), 0.0)

    assert delta("mooncake_store_puts_total") == 3
    assert delta("mooncake_store_hits_total") == 2
    assert delta("mooncake_store_misses_total") == 1
    assert after[("mooncake_store_objects", "")] == 3
    assert after[("mooncake_store_tier_objects", "dram")] == 3
    assert after[("mooncake_store_tier_used_bytes", "dram")] >= 3000
    for name in ("evictions", "demotions", "promotions"):
        assert (f"mooncake_store_{name}_total", "") in after
    assert seen[("mooncake_store_client_latency_seconds_count", "put")] == 3
    assert seen[("mooncake_store_client_latency_seconds_count", "get")] == 3  # miss included
