"""A store node carries out the master's heartbeat instructions: demote to SSD on eviction,
promote back to DRAM on a hit; it serves its SSD file to readers; and it unmounts on stop."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from mooncake.store.client.client import Store
from mooncake.store.metadata import audit
from mooncake.store.metadata.settings import MetadataConfig
from mooncake.store.node.node import StoreNode, TierSizes
from mooncake.store.server.service import StoreService

pytestmark = pytest.mark.timeout(60)
SECRET = "node-test-secret-0123456789abcdef"
KIB = 1024


def _tiers_of(service: StoreService, key: str) -> list[str]:
    with service.lock:
        obj = service.metadata.objects.get(key)
        return sorted(r.tier for r in obj.replicas) if obj else []


def test_demoted_object_is_promoted_and_read_back(tmp_path: Path) -> None:
    """Filling DRAM past the high watermark demotes the LRU object to SSD; a get returns the
    same bytes and starts its promotion back to DRAM; stop() unmounts every segment."""
    cfg = MetadataConfig(
        lease_ttl_s=0.2, heartbeat_ttl_s=5.0, high_watermark=0.9, low_watermark=0.5
    )
    with StoreService(SECRET, cfg, tick_s=3600) as service:
        sizes = TierSizes(dram_bytes=64 * KIB, ssd_bytes=256 * KIB, ssd_path=str(tmp_path))
        node = StoreNode("s0", service.address, SECRET, sizes, heartbeat_s=0.02)
        node.start()
        try:
            with Store.connect(service.address, SECRET, timeout_s=5.0) as store:
                values = {f"k{i}": os.urandom(20 * KIB) for i in range(3)}
                for k, v in values.items():
                    store.put(k, v)
                service.tick()  # 94% > high watermark: the two oldest objects are demoted
                deadline = time.monotonic() + 10
                while [_tiers_of(service, k) for k in ("k0", "k1")] != [["ssd"], ["ssd"]]:
                    assert time.monotonic() < deadline, _tiers_of(service, "k0")
                    time.sleep(0.01)
                assert store.get("k0") == values["k0"]  # read from SSD; starts a promotion
                assert "dram" in _tiers_of(service, "k0")
                assert store.get("k2") == values["k2"]
        finally:
            node.stop()
        with service.lock:
            assert audit.stats(service.metadata.pool).num_segments == 0


def test_populate_leaves_the_bytes_and_the_node_says_when_it_is_done() -> None:
    """populate() faults pages in without changing a byte (clients may already write);
    a node's `populated` is set once its DRAM tier is done, and stop() waits for it."""
    import numpy as np

    from mooncake.native.shm import ShmArena
    from mooncake.store.node.node import populate

    with ShmArena.create(1 << 20) as arena:
        arena.array[::999] = np.arange(len(arena.array[::999])) % 251
        before = arena.array.copy()
        populate(arena.array)
        assert (arena.array == before).all()
    with StoreService(SECRET, MetadataConfig()) as service:
        node = StoreNode(
            "p0", service.address, SECRET, TierSizes(dram_bytes=4 << 20), prefault=True
        )
        node.start()
        assert node.populated.wait(10.0)
        node.stop()


def test_replicated_object_survives_its_source_node() -> None:
    """A hot-spot replication is carried out by the source node (a one-sided write into
    the other node's DRAM): once confirmed, the object reads back byte for byte with the
    source node gone."""
    cfg = MetadataConfig(lease_ttl_s=0.2, heartbeat_ttl_s=5.0)
    with StoreService(SECRET, cfg, tick_s=3600) as service:
        nodes = {
            n: StoreNode(
                n, service.address, SECRET, TierSizes(dram_bytes=256 * KIB), heartbeat_s=0.02
            )
            for n in ("s0", "s1")
        }
        for node in nodes.values():
            node.start()
        try:
            with Store.connect(service.address, SECRET, timeout_s=5.0) as store:
                value = os.urandom(40 * KIB)
                store.put("hot", value, replicas=1)
                (src,) = _nodes_of(service, "hot")
                other = "s1" if src == "s0" else "s0"
                assert service.replicate(["hot"], other) == 1
                deadline = time.monotonic() + 10
                while _nodes_of(service, "hot") != ["s0", "s1"]:
                    assert time.monotonic() < deadline, _nodes_of(service, "hot")
                    time.sleep(0.01)
                nodes.pop(src).stop()  # unmounts: only the copy is left
                assert _nodes_of(service, "hot") == [other]
                assert store.get("hot") == value
        finally:
            for node in nodes.values():
                node.stop()


def _nodes_of(service: StoreService, key: str) -> list[str]:
    with service.lock:
        obj = service.metadata.objects.get(key)
        done = obj.complete() if obj else []
        return sorted(r.node_id for r in done)


def test_an_object_on_ssd_only_is_read_by_the_first_get(tmp_path: Path) -> None:
    """A value demoted to SSD is returned by the first get and the first get_batch, read
    straight from the node's SSD file (its mapping is a Transfer Engine segment), without
    waiting for a promotion."""
    cfg = MetadataConfig(
        lease_ttl_s=0.2,
        heartbeat_ttl_s=5.0,
        high_watermark=0.9,
        low_watermark=0.5,
        promote_on_hit=False,
    )
    with StoreService(SECRET, cfg, tick_s=3600) as service:
        sizes = TierSizes(dram_bytes=64 * KIB, ssd_bytes=256 * KIB, ssd_path=str(tmp_path))
        node = StoreNode("s0", service.address, SECRET, sizes, heartbeat_s=0.02)
        node.start()
        try:
            with Store.connect(service.address, SECRET, timeout_s=5.0) as store:
                values = {f"k{i}": os.urandom(20 * KIB) for i in range(3)}
                for k, v in values.items():
                    store.put(k, v)
                service.tick()  # 94% > high watermark: k0 and k1 are demoted
                deadline = time.monotonic() + 10
                while _tiers_of(service, "k1") != ["ssd"]:
                    assert time.monotonic() < deadline, _tiers_of(service, "k1")
                    time.sleep(0.01)
                got = store.get_batch(["k0", "k1", "k2"])
                assert [r.value for r in got] == list(values.values())
                assert store.get("k1") == values["k1"]
                assert _tiers_of(service, "k0") == ["ssd"]  # served there, not promoted
        finally:
            node.stop()


def test_a_demotion_into_another_nodes_ssd_is_read_back_from_there(tmp_path: Path) -> None:
    """A node with DRAM only demotes into another node's SSD (a one-sided write into that
    node's file mapping); the value then reads back from that SSD."""
    cfg = MetadataConfig(
        lease_ttl_s=0.2, heartbeat_ttl_s=5.0, high_watermark=0.9, low_watermark=0.5
    )
    with StoreService(SECRET, cfg, tick_s=3600) as service:
        ssd = TierSizes(ssd_bytes=256 * KIB, ssd_path=str(tmp_path))
        nodes = [
            StoreNode(
                "d0", service.address, SECRET, TierSizes(dram_bytes=64 * KIB), heartbeat_s=0.02
            ),
            StoreNode("s1", service.address, SECRET, ssd, heartbeat_s=0.02),
        ]
        for node in nodes:
            node.start()
        try:
            with Store.connect(service.address, SECRET, timeout_s=5.0) as store:
                values = {f"k{i}": os.urandom(20 * KIB) for i in range(3)}
                for k, v in values.items():
                    store.put(k, v)
                service.tick()
                deadline = time.monotonic() + 10
                while _nodes_of(service, "k0") != ["s1"]:
                    assert time.monotonic() < deadline, _nodes_of(service, "k0")
                    time.sleep(0.01)
                assert store.get("k0") == values["k0"]
        finally:
            for node in nodes:
                node.stop()


def test_a_start_that_never_reached_the_master_stops_without_unmounting(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A store node whose master never answered gives up after its wait (RpcTimeout) and
    its stop has nothing to undo: no failed unmount is reported before the real error."""
    from mooncake.errors import RpcTimeout
    from mooncake.local.launcher import free_port

    node = StoreNode(
        "lost", f"tcp://127.0.0.1:{free_port()}", SECRET, TierSizes(dram_bytes=64 * KIB)
    )
    with pytest.raises(RpcTimeout):
        node.start(wait_s=0.0)
    with caplog.at_level("WARNING", logger="mooncake.store.node.node"):
        node.stop()
    assert not [r for r in caplog.records if "unmount" in r.getMessage()]
