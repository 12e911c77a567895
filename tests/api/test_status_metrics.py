"""/v1/status serves status_fn's snapshot (behind the key); /metrics serves the registry
the app counts requests, TTFT, TBT and tokens into."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mooncake.api.status import decode_status
from tests.api.conftest import KEY, MODEL

pytestmark = pytest.mark.timeout(60)
AUTH = {"Authorization": f"Bearer {KEY}"}


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_status_and_metrics_count_what_was_served(served):
    with httpx.Client(base_url=served.url, headers=AUTH, timeout=30) as http:
        before = decode_status(http.get("/v1/status").content)
        metrics_before = _samples(http.get("/metrics").text)
        body = {"model": MODEL, "prompt": "abc", "max_tokens": 5, "ignore_eos": True}
        assert http.post("/v1/completions", json=body).status_code == 200
        assert http.post("/v1/completions", json={**body, "n": 129}).status_code == 400
        resp = http.get("/v1/status")
        assert resp.headers["content-type"] == "application/json"
        after = decode_status(resp.content)
        metrics = _samples(http.get("/metrics").text)
    assert after.model == MODEL and after.nodes[0].state == "ready"
    assert after.num_requests == before.num_requests + 1  # the 400 is refused, not received
    assert after.num_refused == before.num_refused + 1
    assert after.num_completed == before.num_completed + 1
    assert after.num_failed == before.num_failed and after.rejected == before.rejected
    assert after.ttft_p50_s is not None and after.ttft_p50_s > 0
    assert after.tbt_p50_s is not None and after.tbt_p90_s is not None
    assert after.tbt_p50_s <= after.tbt_p90_s
    assert (after.ttft_slo_s, after.tbt_slo_s) == (1.0, 0.1)

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return metrics[key] - metrics_before.get(key, 0.0)

    assert delta("mooncake_api_requests_total", outcome="completed") == 1
    assert delta("mooncake_api_refused_requests_total", status="400") == 1
    assert ("mooncake_api_requests_total", (("outcome", "invalid"),)) not in metrics
    assert delta("mooncake_api_generated_tokens_total") == 5
    assert delta("mooncake_api_prompt_tokens_total") == 4  # BOS + 3 bytes
    assert delta("mooncake_api_ttft_seconds_count") == 1
    assert delta("mooncake_api_tbt_seconds_count") == 4  # gaps between 5 tokens
    assert metrics[("mooncake_api_requests_in_flight", ())] == 0
