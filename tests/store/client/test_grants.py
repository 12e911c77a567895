"""Reusing the master's grants: read leases (LocationCache) and write slots (SlotPool)."""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest

from mooncake.rpc.wire import Msg
from mooncake.store.client.client import Store
from mooncake.store.client.grants import MARGIN, LocationCache, PutShape, SlotPool
from mooncake.store.metadata.objects import ReplicaDesc, Slot
from mooncake.transfer.types import EngineOptions
from tests.store.cluster import SECRET, start_master, start_node

REPLICA = ReplicaDesc(
    segment="n.dram",
    node_id="n",
    endpoint="",
    tier="dram",
    offset=0,
    size=8,
    state="complete",
    token=1,
)
SHAPE = PutShape(4096, 0, ("dram",))


def test_location_is_reused_only_inside_the_lease_counted_from_sending() -> None:
    cache = LocationCache(max_entries=2)
    cache.put("a", REPLICA, 8, sent_at=10.0, ttl_s=1.0)
    assert cache.get("a", 10.0 + MARGIN - 0.01) == (REPLICA, 8)
    assert cache.get("a", 10.0 + MARGIN) is None  # expired: no longer a lease...
    assert cache.guess("a") == (REPLICA, 8)  # ...but still where the value was
    cache.put("z", REPLICA, 8, sent_at=10.0, ttl_s=0.0)  # no lease: nothing to reuse
    assert cache.get("z", 10.0) is None and cache.guess("z") == (REPLICA, 8)


def test_a_learned_location_is_a_hint_never_a_lease() -> None:
    cache = LocationCache()
    cache.learn("w", REPLICA, 8)  # where this client wrote it
    assert cache.get("w", 0.0) is None
    assert cache.guess("w") == (REPLICA, 8)
    cache.drop("w")
    assert cache.guess("w") is None


def test_location_cache_keeps_the_most_recently_used_entries() -> None:
    cache = LocationCache(max_entries=2)
    for key in "abc":
        cache.put(key, REPLICA, 8, sent_at=0.0, ttl_s=100.0)
        if key == "b":
            assert cache.get("a", 1.0) is not None  # "a" is now more recent than "b"
    assert [k for k in "abc" if cache.get(k, 1.0)] == ["a", "c"]
    cache.drop("a")
    assert cache.get("a", 1.0) is None


def test_slot_pool_hands_out_fresh_slots_and_gives_back_expired_ones() -> None:
    pool = SlotPool(max_bytes=16384, max_slots=8)
    assert pool.want(4096) == 4 and pool.want(1 << 20) == 0
    slots = tuple(Slot(slot_id=i, replicas=(REPLICA,), ttl_s=1.0) for i in (1, 2))
    pool.add(SHAPE, slots[:1], sent_at=0.0)
    pool.add(SHAPE, slots[1:], sent_at=5.0)
    assert pool.take(PutShape(8192, 0, ("dram",)), 5.0) is None  # another shape
    taken = pool.take(SHAPE, 5.0 + MARGIN / 2)
    assert taken is not None and taken[0].slot_id == 2
    assert pool.take(SHAPE, 5.0 + MARGIN / 2) is None  # slot 1 had expired
    pool.give_back(SHAPE, taken)
    assert [s.slot_id for s in pool.held()] == [2]
    assert sorted(pool.drain()) == [1, 2] and pool.held() == []


@pytest.mark.cluster
@pytest.mark.timeout(60)
def test_warm_get_needs_no_master_and_puts_commit_into_slots() -> None:
    """Real processes. A second get (or get_batch) of a key within its lease reads the
    replica with the master stopped; the second put of a size lands in a slot the first
    put reserved."""
    master = start_master(lease_ttl_s=30.0)
    node = start_node("n0", master, 8 << 20)
    opts = EngineOptions(protocol="tcp", timeout_s=5.0)
    try:
        with Store.connect(master.address, SECRET, timeout_s=5.0, engine_options=opts) as store:
            value = os.urandom(4096)
            store.put("k1", value)
            assert store.slots is not None and store.locations is not None
            offsets = {s.replicas[0].offset for s in store.slots.held()}
            assert len(offsets) == store.slots.want(4096)
            store.put("k2", value[::-1])
            assert store.get("k2") == value[::-1]
            assert store.data.rank(store._get_replicas("k2").replicas)[0].offset in offsets
            assert [v.value for v in store.get_batch(["k1", "k2"])] == [value, value[::-1]]
            sent: list[str] = []
            call = store._call

            def counting(msg: Msg, reply_type: type[Any]) -> Any:
                sent.append(type(msg).__name__)
                return call(msg, reply_type)

            store._call = counting  # type: ignore[method-assign]
            for batch in ([f"b{i}" for i in range(6)], [f"c{i}" for i in range(6)]):
                assert all(r.status == "ok" for r in store.put_batch(batch, [value] * 6))
            store._call = call  # type: ignore[method-assign]
            # the first batch reserved slots with its put_start; the second used them
            assert sent == ["BatchPutStartMsg", "BatchPutEndMsg", "BatchPutSlotMsg"]
            assert [v.value for v in store.get_batch(batch)] == [value] * 6
            os.kill(master.proc.pid, signal.SIGSTOP)
            try:
                assert store.get("k2") == value[::-1]
                assert [v.value for v in store.get_batch(["k2", "k1", "k2"])] == [
                    value[::-1],
                    value,
                    value[::-1],
                ]
                assert store.locations.num_hits >= 3
            finally:
                os.kill(master.proc.pid, signal.SIGCONT)
    finally:
        node.stop()
        master.stop()


@pytest.mark.cluster
@pytest.mark.timeout(60)
def test_a_cached_location_on_a_dead_node_falls_back_to_the_master() -> None:
    """The node a warm location points at dies: get and get_batch drop the location, ask
    the master and read the surviving replica."""
    master = start_master(lease_ttl_s=30.0)
    nodes = {n: start_node(n, master, 8 << 20) for n in ("a0", "a1")}
    opts = EngineOptions(protocol="tcp", timeout_s=5.0)
    try:
        with Store.connect(master.address, SECRET, timeout_s=5.0, engine_options=opts) as store:
            values = {f"k{i}": os.urandom(5000 + i) for i in range(4)}
            for k, v in values.items():
                store.put(k, v, replicas=2)
            assert [r.value for r in store.get_batch(list(values))] == list(values.values())
            assert store.locations is not None
            hit = store.locations.get("k0", 0.0)
            assert hit is not None
            node_id = hit[0].node_id
            nodes.pop(node_id).kill()
            assert [r.value for r in store.get_batch(list(values))] == list(values.values())
            assert store.get("k0") == values["k0"]
    finally:
        for c in [*nodes.values(), master]:
            c.stop()
