"""`mooncake up --role store`: a node that only gives memory to the pool."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.roles.cluster import local_cluster

pytestmark = pytest.mark.timeout(120)


def _pool_capacity(url: str) -> int:
    return sum(
        t["capacity_bytes"] for t in httpx.get(url + "/v1/status", timeout=10).json()["pool"]
    )


def test_store_node_mounts_its_tiers_and_unmounts_on_sigterm(
    tmp_path: Path, cost_cache: Path
) -> None:
    with local_cluster(tmp_path, cost_cache, num_prefill=0, num_decode=0, num_store=1,
                       extra={"store.dram_bytes": "48MiB"}) as cluster:  # fmt: skip
        assert _pool_capacity(cluster.url) == 48 << 20
        store = next(c for c in cluster.children if c.role == "store")
        store.proc.send_signal(signal.SIGTERM)
        assert store.proc.wait(timeout=30) == 0
        deadline = time.monotonic() + 10
        while _pool_capacity(cluster.url) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _pool_capacity(cluster.url) == 0  # unmounted, not left to expire
        nodes = httpx.get(cluster.url + "/v1/status", timeout=10).json()["nodes"]
        assert [n["role"] for n in nodes] == ["master"]  # deregistered
