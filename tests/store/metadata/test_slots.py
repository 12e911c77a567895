"""Write slots and mount incarnations in the metadata service (pure logic, time passed in)."""

from __future__ import annotations

import logging

from mooncake.store.metadata.slots import MAX_RESERVE, SlotSpec, slot_key
from tests.store.helpers import make_service, put

SPEC = SlotSpec("w", 1, ("dram",))


def test_reserved_slot_commits_under_the_real_key_at_its_offsets() -> None:
    """A slot is an allocation held for the writer; committing it makes the key readable
    exactly where the slot was, reserves the refill asked for, and frees nothing."""
    svc = make_service({"a": {"dram": 4096}})
    slots = svc.slots.reserve(256, 3, SPEC, now=0.0)
    svc.check_integrity()
    assert len(slots) == 3 and len({s.replicas[0].offset for s in slots}) == 3
    assert svc.get_replicas("k", 0.0).status == "not_found"
    used = svc.space.tier_used["dram"]
    result, fresh = svc.slots.commit("k", slots[0].slot_id, "w", 1.0, refill=1)
    svc.check_integrity()
    assert result.status == "ok" and len(fresh) == 1
    got = svc.get_replicas("k", 1.0)
    assert got.status == "ok" and got.size == 256
    assert got.replicas[0].offset == slots[0].replicas[0].offset
    assert svc.space.tier_used["dram"] == used + 256  # the refill; the commit freed nothing
    assert [e.kind for e in svc.pool.drain_events()] == ["added"]


def test_refused_commit_keeps_the_slot_for_another_key() -> None:
    """exists / busy refusals leave the slot reserved; a wrong writer or an unknown or
    used slot is an error that changes nothing."""
    svc = make_service({"a": {"dram": 4096}})
    assert put(svc, "k", 256) == "ok"
    (slot,) = svc.slots.reserve(256, 1, SPEC, now=0.0)
    assert svc.slots.commit("k", slot.slot_id, "w", 0.0)[0].status == "exists"
    assert svc.slots.commit("x", slot.slot_id, "intruder", 0.0)[0].status == "error"
    assert svc.slots.commit("\x00x", slot.slot_id, "w", 0.0)[0].status == "error"
    svc.check_integrity()
    assert svc.slots.commit("k2", slot.slot_id, "w", 0.0)[0].status == "ok"
    again, _ = svc.slots.commit("k3", slot.slot_id, "w", 0.0)
    assert again.status == "error" and "not held" in again.message
    assert svc.slots.commit("k", 999, "w", 0.0)[0].status == "error"
    svc.check_integrity()


def test_overwrite_through_a_slot_replaces_the_old_value() -> None:
    svc = make_service({"a": {"dram": 4096}})
    assert put(svc, "k", 256) == "ok"
    old = svc.get_replicas("k", 0.0, "").replicas[0].offset
    (slot,) = svc.slots.reserve(256, 1, SPEC, now=10.0)
    assert svc.slots.commit("k", slot.slot_id, "w", 10.0, overwrite=True)[0].status == "ok"
    assert svc.get_replicas("k", 10.0).replicas[0].offset != old
    svc.check_integrity()


def test_unused_slots_are_reclaimed_and_released_slots_freed(caplog) -> None:
    """A slot never committed is reclaimed after put_timeout_s like an unfinished put (one
    debug line per writer, not a warning per slot: holding space ahead is routine);
    release gives slots back at once; both free their space."""
    caplog.set_level(logging.DEBUG, logger="mooncake.store.metadata.membership")
    svc = make_service({"a": {"dram": 4096}}, put_timeout_s=5.0)
    first = svc.slots.reserve(256, 2, SPEC, now=0.0)
    second = svc.slots.reserve(256, 2, SPEC, now=4.0)
    assert svc.slots.release([second[0].slot_id], "intruder", 4.0) == 0
    assert svc.slots.release([second[0].slot_id], "w", 4.0) == 1
    assert svc.writes.put_start("stuck", 256, 0.0, writer="w").status == "ok"
    svc.expire(6.0)  # the first two slots and the unended put are past put_timeout_s
    svc.check_integrity()
    assert set(svc.slots.specs) == {second[1].slot_id}
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", "reclaiming put of 'stuck' by 'w': never ended"),
        ("DEBUG", "reclaimed 2 write slots 'w' left unused for 5 s"),
    ]
    assert svc.space.tier_used["dram"] == 256
    result, _ = svc.slots.commit("k", first[0].slot_id, "w", 6.0)
    assert result.status == "error"


def test_reservations_are_capped_per_request_and_by_space() -> None:
    svc = make_service({"a": {"dram": 1 << 20}})
    assert len(svc.slots.reserve(64, 100, SPEC, now=0.0)) == MAX_RESERVE
    assert len(svc.slots.reserve(300_000, 8, SPEC, now=0.0)) == 3  # 1 MiB holds three
    svc.check_integrity()


def test_slots_on_a_dead_node_go_with_it() -> None:
    svc = make_service({"a": {"dram": 4096}, "b": {"dram": 4096}}, heartbeat_ttl_s=1.0)
    slots = svc.slots.reserve(256, 2, SlotSpec("w", 2, ("dram",)), now=0.0)
    assert all(len(s.replicas) == 2 for s in slots)
    svc.space.heartbeat("a", 5.0)
    assert svc.expire(5.0) == ["b"]
    svc.check_integrity()
    result, _ = svc.slots.commit("k", slots[0].slot_id, "w", 5.0)
    assert result.status == "ok"  # what is left of the slot: the replica on "a"
    assert [r.node_id for r in svc.get_replicas("k", 5.0).replicas] == ["a"]


def test_user_keys_cannot_take_the_slot_prefix() -> None:
    svc = make_service({"a": {"dram": 4096}})
    r = svc.writes.put_start(slot_key(1), 64, 0.0)
    assert r.status == "error" and "NUL" in r.message


def test_segment_registered_again_loses_its_objects() -> None:
    """The same node mounting a segment with a new token restarted: what the old
    registration held is gone (lost), the space is fresh; the same token is a no-op."""
    svc = make_service({})
    svc.mount_segment("a", "a-dram", "dram", 4096, 0.0, alignment=64, token=7)
    assert put(svc, "k", 256) == "ok"
    svc.mount_segment("a", "a-dram", "dram", 4096, 1.0, alignment=64, token=7)
    assert svc.get_replicas("k", 1.0).status == "ok"
    svc.pool.drain_events()
    svc.mount_segment("a", "a-dram", "dram", 4096, 2.0, alignment=64, token=8)
    svc.check_integrity()
    assert svc.get_replicas("k", 2.0).status == "not_found"
    assert svc.space.tier_used["dram"] == 0
    assert [e.kind for e in svc.pool.drain_events()] == ["evicted", "lost"]
    assert svc.get_replicas("k", 2.0, "").replicas == ()


def test_remounted_segment_takes_no_object_while_old_grants_may_be_used() -> None:
    """Mounted again to a master that forgot it, a segment gets no new object for
    lease_ttl_s: readers and writers may still hold the previous master's grants on it."""
    svc = make_service({}, lease_ttl_s=2.0)
    svc.mount_segment("a", "a-dram", "dram", 4096, 10.0, alignment=64, is_remount=True)
    assert svc.writes.put_start("k", 64, 11.0).status == "no_space"
    assert svc.slots.reserve(64, 1, SPEC, now=11.0) == []
    assert put(svc, "k", 64, now=12.5) == "ok"


def test_slots_take_only_spare_space_and_never_cause_eviction() -> None:
    """Reserving stops where the tier would pass its high watermark; no eviction
    pressure is noted for slots, so committed objects stay."""
    svc = make_service({"a": {"dram": 1024}}, high_watermark=0.5, low_watermark=0.25)
    assert put(svc, "data", 256) == "ok"
    assert len(svc.slots.reserve(128, 8, SPEC, now=0.0)) == 2  # 256 + 2 * 128 = the mark
    assert svc.evictor.run(1.0) == 0 and svc.get_replicas("data", 1.0).status == "ok"
    svc.check_integrity()


def test_a_multi_replica_slot_stops_at_the_mark_replica_by_replica() -> None:
    svc = make_service(
        {"a": {"dram": 1024}, "b": {"dram": 1024}}, high_watermark=0.5, low_watermark=0.25
    )
    (slot,) = svc.slots.reserve(512, 8, SlotSpec("w", 2, ("dram",)), now=0.0)
    assert len(slot.replicas) == 2 and svc.space.share("dram") == 0.5
    assert svc.slots.reserve(512, 8, SlotSpec("w", 2, ("dram",)), now=0.0) == []
    svc.check_integrity()


def test_a_batch_commits_into_its_slots_key_by_key_then_refills() -> None:
    """commit_many commits each key into its own slot (a refusal fails only that key and
    keeps its slot), and reserves the refill like the first slot."""
    svc = make_service({"a": {"dram": 8192}})
    assert put(svc, "old", 128) == "ok"
    slots = svc.slots.reserve(128, 3, SPEC, now=0.0)
    ids = [s.slot_id for s in slots]
    results, fresh = svc.slots.commit_many(["k0", "old", "k2"], ids, "w", 1.0, refill=2)
    assert [r.status for r in results] == ["ok", "exists", "ok"]
    assert len(fresh) == 2 and all(s.replicas[0].size == 128 for s in fresh)
    assert set(svc.slots.specs) == {ids[1], *(s.slot_id for s in fresh)}
    bad, _ = svc.slots.commit_many(["x"], [], "w", 1.0)
    assert bad[0].status == "error" and "one slot per key" in bad[0].message
    svc.check_integrity()


def test_expiry_reclaims_only_timed_out_puts_whatever_the_order_they_started_in() -> None:
    """Expiry stops at the first put in flight not yet timed out while the puts started in
    clock order, and looks at all of them once a caller's clock went back: either way
    exactly the puts past put_timeout_s are reclaimed."""
    for starts in ([0.0, 1.0, 2.0, 8.0], [8.0, 0.0, 2.0, 1.0]):
        svc = make_service({"a": {"dram": 4096}}, put_timeout_s=5.0)
        for i, t in enumerate(starts):
            assert svc.writes.put_start(f"k{i}", 256, t, writer="w").status == "ok"
        assert svc.pool.is_writing_in_order == (starts == sorted(starts))
        svc.check_integrity()
        svc.expire(6.5)
        svc.check_integrity()
        assert sorted(svc.pool.writing) == [f"k{i}" for i, t in enumerate(starts) if t >= 1.5]
