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


def test_a_store_node_started_before_its_master_waits_for_it(
    tmp_path: Path, cost_cache: Path
) -> None:
    """Nodes may start with the master (a deployment, a supervisor): a store node whose
    master does not answer yet keeps trying, and mounts once the master is up."""
    with local_cluster(
        tmp_path,
        cost_cache,
        num_prefill=0,
        num_decode=0,
        num_store=1,
        extra={"store.dram_bytes": "48MiB"},
    ) as cluster:
        master = next(c for c in cluster.children if c.role == "master")
        store = next(c for c in cluster.children if c.role == "store")
        master.proc.send_signal(signal.SIGKILL)
        master.proc.wait()
        store.proc.send_signal(signal.SIGKILL)
        store.proc.wait()
        starting = cluster.respawn("store-0")  # the master is still down
        assert starting is not None
        time.sleep(6)  # NOTE: longer than one mount call's timeout (5 s): it must retry
        assert starting.poll() is None, "the store node gave up on its master"
        cluster.relaunch("master")
        deadline = time.monotonic() + 30
        while _pool_capacity(cluster.url) != 48 << 20:
            assert time.monotonic() < deadline, "the store node never mounted"
            time.sleep(0.2)
