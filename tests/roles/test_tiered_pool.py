"""A tiered pool in real processes: a master and a store node with a tiny DRAM tier and an
SSD directory (tests/store/procs.py), a client in this process. Puts past the DRAM
watermark succeed at once by demotion (copies made ahead on SSD are dropped from DRAM),
nothing leaves the pool, and the first get of a value that is on SSD only returns it."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from mooncake.rpc.client import RpcClient
from mooncake.store.client.client import Store
from mooncake.store.metadata.objects import StoreStats
from mooncake.store.server import messages as m
from tests.store.cluster import SECRET, Child, start_master, start_node

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(60)]
KIB = 1024


def _stats(rpc: RpcClient) -> StoreStats:
    stats: StoreStats = rpc.call(m.StatsMsg(), m.StatsReplyMsg).stats
    return stats


def _tiers(rpc: RpcClient, key: str) -> list[str]:
    result = rpc.call(m.GetReplicasMsg(key, "probe"), m.GetReplicasReplyMsg).result
    return sorted(d.tier for d in result.replicas)


def test_puts_past_the_dram_watermark_stay_in_the_pool_and_the_first_get_reads_ssd(
    tmp_path: Path,
) -> None:
    """24 values of 32 KiB into 256 KiB of DRAM (3x what it holds): every put succeeds,
    the oldest values are dropped from DRAM for them only once copied to SSD (demotions,
    no eviction, no loss), and the oldest, now on SSD only, is returned by its first get;
    a batch get then returns every value byte for byte."""
    master = start_master(0.2, high_watermark=0.9, low_watermark=0.6, copy_ahead_watermark=0.3)
    children: list[Child] = [master]
    rpc = RpcClient(master.address, SECRET.encode(), timeout_s=5.0)
    try:
        children.append(start_node("s0", master, 256 * KIB, str(tmp_path), str(4096 * KIB)))
        with Store.connect(master.address, SECRET, timeout_s=5.0) as store:
            values = {f"k{i:02}": os.urandom(32 * KIB) for i in range(24)}
            keys = list(values)
            for key in keys[:6]:  # 192 KiB: 75% of DRAM, under its high watermark
                store.put(key, values[key])
            deadline = time.monotonic() + 20
            while _stats(rpc).copies < 4:  # the node copies the 4 oldest to SSD ahead
                assert time.monotonic() < deadline, _stats(rpc)
                time.sleep(0.02)
            for key in keys[6:]:  # as the KV pool puts: DRAM, else SSD
                store.put(key, values[key], tiers=("dram", "ssd"))
            stats = _stats(rpc)
            assert stats.puts == 24, stats
            assert stats.evictions == 0 and stats.lost_objects == 0, stats
            assert stats.demotions >= 4, stats  # at least the 4 copies made room
            assert stats.tier_objects["dram"] < 24, stats
            assert _tiers(rpc, "k00") == ["ssd"]
            assert store.get("k00") == values["k00"]  # the first get, from SSD
            got = store.get_batch(keys)
            assert [r.status for r in got] == ["ok"] * 24
            assert [r.value for r in got] == list(values.values())
    finally:
        rpc.close()
        for child in reversed(children):
            child.stop()
