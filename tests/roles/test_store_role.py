"""`mooncake up --role store`: a node that only gives memory to the pool."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx
import pytest

from mooncake.config.sizes import parse_size
from mooncake.local.config import LOCAL_SSD_BYTES
from tests.roles.cluster import local_cluster

pytestmark = pytest.mark.timeout(120)
LOCAL_SSD = parse_size(LOCAL_SSD_BYTES)  # the SSD tier of each up --local node, bytes


def _pool_capacity(url: str) -> int:
    return sum(
        t["capacity_bytes"] for t in httpx.get(url + "/v1/status", timeout=10).json()["pool"]
    )


@pytest.mark.cluster
def test_store_node_mounts_its_tiers_and_unmounts_on_sigterm(
    tmp_path: Path, cost_cache: Path
) -> None:
    with local_cluster(
        tmp_path,
        cost_cache,
        num_prefill=0,
        num_decode=0,
        num_store=1,
        extra={"store.dram_bytes": "48MiB"},
    ) as cluster:
        assert _pool_capacity(cluster.url) == (48 << 20) + LOCAL_SSD  # DRAM and up --local's SSD
        store = next(c for c in cluster.children if c.role == "store")
        store.proc.send_signal(signal.SIGTERM)
        assert store.proc.wait(timeout=30) == 0
        deadline = time.monotonic() + 10
        while _pool_capacity(cluster.url) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _pool_capacity(cluster.url) == 0  # unmounted, not left to expire
        nodes = httpx.get(cluster.url + "/v1/status", timeout=10).json()["nodes"]
        assert [n["role"] for n in nodes] == ["master"]  # deregistered


@pytest.mark.cluster
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
        while _pool_capacity(cluster.url) != (48 << 20) + LOCAL_SSD:
            assert time.monotonic() < deadline, "the store node never mounted"
            time.sleep(0.2)


def test_a_store_node_whose_master_never_answers_names_the_key_and_address(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An explicit `cluster.master` where nothing answers: the node says at INFO on its
    first miss that it waits for the master there, and after its wait fails with an error
    naming the key and its value (not only the RPC client's words)."""
    from mooncake.config.load import load_config
    from mooncake.errors import MooncakeError
    from mooncake.local.launcher import free_port
    from mooncake.roles.node.common import create_context
    from mooncake.roles.store.role import run_store

    master = f"127.0.0.1:{free_port()}"  # nothing listens there
    overrides = {
        "cluster.master": master,
        "cluster.secret": "s" * 32,
        "store.dram_bytes": "1MiB",
        "node.id": "lost-store",
    }
    ctx = create_context(load_config(overrides=overrides, env={}).config, "store")
    ctx.master_wait_s = 0.5
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    started = time.monotonic()
    try:
        with caplog.at_level("INFO"), pytest.raises(MooncakeError) as failed:
            run_store(ctx)
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    assert time.monotonic() - started < 5  # the wait, not 60 s nor a 5 s call, nor a 2 s goodbye
    message = str(failed.value)
    assert message.startswith(f"cluster.master = {master}: the master did not answer within 0.5 s")
    waiting = [r for r in caplog.records if "waiting up to 0.5 s for the master" in r.message]
    assert len(waiting) == 1 and waiting[0].levelname == "INFO", caplog.text
    assert master in waiting[0].message
