"""Eviction: LRU order at the watermarks, what protects an object, demotion to SSD instead
of loss, promotion on a hit, and eviction for a put that found no room."""

from __future__ import annotations

from mooncake.store.metadata.service import MetadataService
from tests.store.helpers import dst, make_service, put

# 8 blocks of 64 bytes; eviction starts above 6 blocks and stops at 4.
WM = {"high_watermark": 0.75, "low_watermark": 0.5, "lease_ttl_s": 5.0}


def fill(svc: MetadataService, n: int, size: int = 64) -> None:
    for i in range(n):
        assert put(svc, f"k{i}", size, now=float(i)) == "ok"
    svc.pool.drain_events()


def kinds(svc: MetadataService) -> list[tuple[str, str, str, str]]:
    return [(e.kind, e.key, e.node_id, e.tier) for e in svc.pool.drain_events()]


def test_last_copies_with_nowhere_to_go_stay_until_a_put_needs_their_room():
    """Without a lower tier the pass evicts nothing (the pool keeps its whole capacity for
    distinct objects); a put into the full tier drops the least recently used at once."""
    svc = make_service({"a": {"dram": 512}}, **WM)
    fill(svc, 8)  # 512 of 512 bytes: over 0.75
    svc.get_replicas("k0", 8.0)  # k0 becomes most recent (leased until 13)
    assert svc.evictor.run(20.0) == 0 and len(svc.objects) == 8
    for i, key in enumerate(("n0", "n1", "n2")):
        assert put(svc, key, 64, now=20.0 + i) == "ok"
    assert kinds(svc)[::2] == [("evicted", f"k{i}", "a", "dram") for i in (1, 2, 3)]
    ins = svc.pool.drain_instructions("a")
    assert [(i.kind, i.key, i.src.offset) for i in ins] == [
        ("evict", "k1", 64),
        ("evict", "k2", 128),
        ("evict", "k3", 192),
    ]
    assert svc.space.tier_used["dram"] == 512 and svc.counters.evictions == 3
    svc.check_integrity()


def test_leased_pinned_and_uncommitted_objects_are_never_victims():
    svc = make_service({"a": {"dram": 512, "ssd": 4096}}, **WM)
    fill(svc, 6)
    svc.writes.put_start("writing", 64, 6.0)  # PROCESSING: 448 bytes used
    for i in range(6):
        svc.get_replicas(f"k{i}", 10.0)  # all leased until 15
    assert svc.evictor.run(12.0) == 0
    svc.pin("k0", 100.0, 12.0)
    svc.pin("k1", 100.0, 12.0)
    assert svc.evictor.run(16.0) == 3  # k0, k1 pinned; k2..k4 go down to SSD
    assert [(m.kind, m.key) for m in svc.pool.drain_instructions()] == [
        ("demote", f"k{i}") for i in (2, 3, 4)
    ]
    svc.check_integrity()


def test_a_soft_pin_expires_when_the_object_is_not_read():
    svc = make_service({"a": {"dram": 512, "ssd": 4096}}, **WM)
    for i in range(7):
        assert put(svc, f"k{i}", 64, now=0.0, pin_ttl_s=10.0) == "ok"
    svc.get_replicas("k6", 8.0)  # renews k6's pin to 18 (and its lease to 13)
    assert svc.evictor.run(9.0) == 0
    assert svc.evictor.run(11.0) == 3
    assert [m.key for m in svc.pool.drain_instructions()] == ["k0", "k1", "k2"]  # not k6


def test_dram_victims_are_demoted_to_ssd_not_dropped():
    svc = make_service({"a": {"dram": 512, "ssd": 4096}}, **WM)
    fill(svc, 7)
    assert svc.evictor.run(20.0) == 3
    moves = svc.pool.drain_instructions("a")
    assert [(m.kind, m.key, m.src.tier, dst(m).tier, m.release_src) for m in moves] == [
        ("demote", f"k{i}", "dram", "ssd", True) for i in range(3)
    ]
    assert [dst(m).offset for m in moves] == [0, 64, 128]
    assert svc.evictor.run(20.0) == 0  # pending releases count: no second round of victims
    got = svc.get_replicas("k0", 20.0)  # still served from DRAM until the copy is confirmed
    assert [r.tier for r in got.replicas] == ["dram"]
    assert svc.remove("k1", 30.0).status == "busy"
    svc.check_integrity()
    for m in moves:
        assert svc.mover.confirm(m.move_id, True, 21.0).status == "ok"
        svc.check_integrity()
    assert kinds(svc) == [("demoted", f"k{i}", "a", "ssd") for i in range(3)]
    # k0 is leased until 25: its DRAM range is freed only after that
    assert svc.space.tier_used == {"vram": 0, "dram": 320, "ssd": 192}
    svc.space.heartbeat("a", 26.0)
    svc.expire(26.0)
    assert svc.space.tier_used["dram"] == 256 and svc.counters.demotions == 3
    assert svc.mover.confirm(moves[0].move_id, True, 26.0).status == "not_found"
    svc.check_integrity()


def test_a_failed_move_keeps_the_source_and_a_later_pass_retries():
    svc = make_service({"a": {"dram": 512, "ssd": 4096}}, **WM)
    fill(svc, 7)
    svc.evictor.run(20.0)
    for m in svc.pool.drain_instructions():
        assert svc.mover.confirm(m.move_id, False, 21.0).status == "ok"
    assert [r.tier for r in svc.objects["k0"].replicas] == ["dram"]
    assert svc.space.tier_used == {"vram": 0, "dram": 448, "ssd": 0}
    svc.check_integrity()
    svc.evictor.run(22.0)
    assert [m.key for m in svc.pool.drain_instructions()] == ["k0", "k1", "k2"]


def test_victims_are_dropped_when_no_ssd_has_room():
    svc = make_service({"a": {"dram": 512, "ssd": 128}}, **WM)
    fill(svc, 7)
    svc.evictor.run(20.0)
    assert [(m.kind, m.key) for m in svc.pool.drain_instructions()] == [
        ("demote", "k0"),
        ("demote", "k1"),
        ("evict", "k2"),
    ]
    assert "k2" not in svc.objects


def test_ssd_hit_promotes_back_to_dram_on_the_same_node_and_keeps_the_ssd_copy():
    """The promoted object stays on SSD too (clean): its DRAM replica can go at once."""
    svc = make_service({"a": {"dram": 512, "ssd": 4096}}, **WM)
    fill(svc, 7)
    svc.evictor.run(20.0)
    for m in svc.pool.drain_instructions():
        svc.mover.confirm(m.move_id, True, 20.0)
    svc.pool.drain_events()
    got = svc.get_replicas("k1", 30.0, reader="a")
    assert [r.tier for r in got.replicas] == ["ssd"]
    (prom,) = svc.pool.drain_instructions("a")
    assert (prom.kind, prom.key, prom.src.tier, dst(prom).tier, prom.release_src) == (
        "promote",
        "k1",
        "ssd",
        "dram",
        False,
    )
    svc.mover.confirm(prom.move_id, True, 40.0)
    assert kinds(svc) == [("promoted", "k1", "a", "dram")]
    assert [r.tier for r in svc.get_replicas("k1", 40.0).replicas] == ["dram", "ssd"]
    assert svc.counters.promotions == 1
    svc.check_integrity()


def test_vram_victims_move_down_to_dram():
    svc = make_service({"a": {"vram": 512, "dram": 1024}}, **WM)
    for i in range(7):
        put(svc, f"k{i}", 64, tiers=("vram",))
    svc.evictor.run(20.0)
    moves = svc.pool.drain_instructions()
    assert {(m.src.tier, dst(m).tier) for m in moves} == {("vram", "dram")}
    assert len(moves) == 3


def test_a_put_that_found_no_room_evicts_for_it_at_once_where_nothing_lies_below():
    """With no lower tier, the put's allocation evicts LRU objects until a free block is
    large enough (no no_space, no pass needed), and no more."""
    svc = make_service({"a": {"dram": 512}}, high_watermark=0.9, low_watermark=0.8)
    for i in range(3):
        put(svc, f"k{i}", 128, now=float(i))  # 384 bytes: under the high watermark
    assert svc.evictor.run(10.0) == 0
    svc.pool.drain_events()
    # k0 alone frees [0,128), not adjacent to the free tail [384,512): k1 must go too
    r = svc.writes.put_start("big", 256, 10.0)
    assert r.status == "ok" and [d.offset for d in r.replicas] == [0]
    assert kinds(svc) == [("evicted", "k0", "a", "dram"), ("evicted", "k1", "a", "dram")]
    assert sorted(svc.objects) == ["big", "k2"] and svc.counters.evictions == 2
    svc.check_integrity()


def test_a_put_no_eviction_can_make_room_for_evicts_nothing():
    """A value larger than any segment could hold (or than evicting every unprotected
    object would free) is refused, and eviction does not empty the tier for it."""
    svc = make_service({"a": {"dram": 512}}, high_watermark=0.9, low_watermark=0.8)
    for i in range(3):
        put(svc, f"k{i}", 128, now=float(i))
    assert svc.writes.put_start("huge", 1024, 10.0).status == "no_space"
    assert svc.evictor.run(10.0) == 0
    assert all(svc.exists(f"k{i}", 10.0).status == "ok" for i in range(3))
    svc.check_integrity()


def test_replicated_victims_lose_their_duplicates_before_anything_its_last_copy():
    """Duplicates go before the last copy of anything: the pass drops the second replica
    of the six least recently used objects (each keeps one in DRAM) and demotes nothing."""
    svc = make_service({n: {"dram": 512, "ssd": 4096} for n in "ab"}, replicas=2, **WM)
    fill(svc, 7)  # 896 of 1024 bytes: over 0.75; down to 512 is 6 replicas
    assert svc.evictor.run(20.0) == 6
    ins = svc.pool.drain_instructions()
    assert [(i.kind, i.key) for i in ins] == [("evict", f"k{i}") for i in range(6)]
    assert [len(svc.objects[f"k{i}"].replicas) for i in range(7)] == [1] * 6 + [2]
    assert not svc.mover.moves and svc.space.tier_used["dram"] == 512
    svc.check_integrity()


def test_hot_spot_replication_copies_to_the_named_node_and_keeps_the_source():
    """replicate() asks the source's owner to copy into the destination node's DRAM; the
    confirmed copy is an added replica there and the source stays. Keys already there,
    moving, missing, or with no room there (or only above the high watermark) are skipped."""
    # NOTE: tiny segments: the copies take 1/8 of DRAM, past the default replica_budget
    svc = make_service({"a": {"dram": 512}, "b": {"dram": 512}}, replica_budget=0.5, **WM)
    for i in range(2):
        assert put(svc, f"k{i}", 64, writer="a") == "ok"
    svc.pool.drain_events()
    assert svc.replicate(["k0", "k1", "missing"], "b", 1.0) == 2
    assert svc.replicate(["k0"], "b", 1.0) == 0  # its copy is in flight
    first, second = svc.pool.drain_instructions("a")
    assert (first.kind, first.key, first.src.node_id, dst(first).node_id) == (
        "replicate",
        "k0",
        "a",
        "b",
    )
    assert not first.release_src
    svc.mover.confirm(first.move_id, True, 2.0)
    svc.mover.confirm(second.move_id, False, 2.0)  # a failed copy frees its destination
    svc.check_integrity()
    assert kinds(svc) == [("added", "k0", "b", "dram")]
    assert sorted(r.node_id for r in svc.get_replicas("k0", 3.0).replicas) == ["a", "b"]
    assert [r.node_id for r in svc.get_replicas("k1", 3.0).replicas] == ["a"]
    assert svc.replicate(["k0"], "b", 4.0) == 0  # already there
    assert svc.counters.replications == 1
    fill_b = make_service({"a": {"dram": 512}, "b": {"dram": 512}}, **WM)
    for i in range(8):
        assert put(fill_b, f"b{i}", 64, writer="b") == "ok"
    assert put(fill_b, "hot", 64, writer="a") == "ok"
    assert fill_b.replicate(["hot"], "b", 1.0) == 0  # b has no room
    fill_b.check_integrity()
