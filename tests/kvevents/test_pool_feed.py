"""The master's KV event feed read as a router reads vLLM's (tests/kvevents/subscriber.py:
pyzmq and msgpack only), on a real master and store node."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from mooncake.config.load import load_config
from mooncake.local.launcher import LocalLauncher, LocalPlan
from mooncake.store.client.client import Store
from tests.kvevents.subscriber import Subscriber

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]
KIB = 1024


@contextmanager
def pool_cluster(run_dir: Path, **plan_kw: Any) -> Iterator[LocalLauncher]:
    """A master and store nodes (no engine: the master prices with its roofline, so no
    cost model is profiled)."""
    launcher = LocalLauncher(LocalPlan(api_port=0, run_dir=run_dir, **plan_kw))
    try:
        launcher.start("")
        yield launcher
    finally:
        launcher.stop()


def _key(i: int) -> str:
    return f"kv/{i:032x}"


def _stored(sub: Subscriber, i: int) -> bool:
    h = i.to_bytes(16, "big")
    return any(e["type"] == "BlockStored" and h in e["block_hashes"] for _, e in sub.events())


def test_puts_and_evictions_reach_a_vllm_subscriber_in_order_and_a_gap_is_replayed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """BlockStored (medium CPU, block_size = model.block_tokens) after each put,
    BlockRemoved after the pool evicts, under the store node's data_parallel_rank;
    sequence numbers never go backwards; batches sent while the subscriber was away come
    back through the replay socket, each exactly once."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    with pool_cluster(
        tmp_path,
        num_prefill=0,
        num_decode=0,
        num_store=1,
        extra={
            "store.dram_bytes": "512KiB",
            "store.ssd_bytes": "0",  # no tier below: the pool evicts (with one: demotes)
            "store.high_watermark": 0.7,
            "store.low_watermark": 0.4,
            "kv_events.topic": "pool",
        },
    ) as cluster:
        cfg = load_config(cluster.config_path).config
        status = httpx.get(cluster.url + "/v1/status", timeout=10).json()
        feed = status["kv_events"]
        assert feed["topic"] == "pool" and feed["endpoint"].startswith("tcp://127.0.0.1:")
        sub = Subscriber(feed["endpoint"], feed["replay_endpoint"], b"pool")
        witness = Subscriber(feed["endpoint"], feed["replay_endpoint"], b"pool")  # stays
        try:
            with Store.connect(
                f"tcp://{cfg.cluster.master}", cfg.cluster.secret, timeout_s=5
            ) as st:
                st.put(_key(1), os.urandom(64 * KIB))
                sub.wait_for(lambda s: _stored(s, 1))
                rank, ev = next((r, e) for r, e in sub.events() if e["type"] == "BlockStored")
                assert ev["medium"] == "CPU" and ev["block_size"] == cfg.model.block_tokens
                assert ev["parent_block_hash"] is None and ev["token_ids"] == []
                store_id = next(n["node_id"] for n in status["nodes"] if n["role"] == "store")
                ranks = httpx.get(cluster.url + "/v1/status", timeout=10).json()["kv_events"][
                    "ranks"
                ]
                assert ranks == {store_id: rank}
                # a gap: the subscriber is away while the pool changes
                sub.disconnect()
                for i in range(2, 5):
                    st.put(_key(i), os.urandom(64 * KIB))
                witness.wait_for(lambda s: all(_stored(s, i) for i in range(1, 5)))
                sub.connect()
                for i in range(5, 12):  # past the high watermark: the oldest are evicted
                    st.put(_key(i), os.urandom(64 * KIB))
                sub.wait_for(lambda s: all(_stored(s, i) for i in range(1, 12)))
                sub.wait_for(lambda s: any(e["type"] == "BlockRemoved" for _, e in s.events()))
        finally:
            sub.close()
            witness.close()
    seqs = [seq for seq, _ in sub.batches]
    assert seqs == list(range(len(seqs)))  # from 0, never backwards, none twice, no hole
    missed = {
        seq
        for seq, b in sub.batches
        for e in b[1]
        if e["type"] == "BlockStored" and int.from_bytes(e["block_hashes"][0], "big") in (2, 3, 4)
    }
    assert missed and missed <= set(sub.replayed)
    removed = [e for _, e in sub.events() if e["type"] == "BlockRemoved"]
    assert all(e["medium"] == "CPU" for e in removed)
    first_removed = int.from_bytes(removed[0]["block_hashes"][0], "big")
    assert first_removed == 1  # LRU: the oldest put goes first
