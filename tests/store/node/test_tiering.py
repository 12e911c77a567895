"""Tiered pool: copies ahead to SSD, room made for a put at once (copies dropped first, a
block never dropped while it has somewhere to go), SSD replicas served as they are, and
events that keep the Conductor's index on each node's fastest tier."""

from __future__ import annotations

from mooncake.conductor.index import PrefixIndex
from mooncake.store.metadata import audit
from mooncake.store.metadata.service import MetadataService
from tests.store.helpers import dst, make_service, put

# 8 blocks of 64 bytes of DRAM: copies ahead past 2 blocks, eviction above 6, down to 4.
WM = {"high_watermark": 0.75, "low_watermark": 0.5, "copy_ahead_watermark": 0.25}


def kinds(svc: MetadataService) -> list[tuple[str, str, str, str]]:
    return [(e.kind, e.key, e.node_id, e.tier) for e in svc.pool.drain_events()]


def settle(svc: MetadataService, now: float, index: PrefixIndex | None = None) -> list[str]:
    """Confirm every pending move (as the nodes would); returns 'kind key' per move."""
    done = []
    for ins in svc.pool.drain_instructions():
        if ins.move_id:
            assert svc.mover.confirm(ins.move_id, True, now).status == "ok"
            done.append(f"{ins.kind} {ins.key}")
        svc.check_integrity()
    if index is not None:
        feed(svc, index)
    return done


def feed(svc: MetadataService, index: PrefixIndex) -> None:
    """Apply the service's events to a prefix index, as the master does."""
    for e in svc.pool.drain_events():
        if e.kind in ("added", "demoted", "promoted"):
            index.add(e.node_id, [e.key], e.tier)
        elif e.kind in ("evicted", "removed"):
            index.evict(e.node_id, [e.key])
        elif e.kind == "node_gone":
            index.remove_node(e.node_id)
    index.check_integrity()


def full_of_copies() -> MetadataService:
    """DRAM full with k0..k7 (64 bytes each, put at t=i): k0..k3 copied to SSD by a pass
    at 6 of 8 blocks (copies confirmed), k6 and k7 put after it."""
    svc = make_service({"a": {"dram": 512, "ssd": 4096}}, **WM)
    for i in range(6):
        assert put(svc, f"k{i}", 64, now=float(i)) == "ok"
    assert svc.evictor.run(6.0) == 0
    assert settle(svc, 6.0) == [f"copy k{i}" for i in range(4)]
    for i in range(6, 8):
        assert put(svc, f"k{i}", 64, now=float(i)) == "ok"
    svc.pool.drain_events()
    return svc


def tiers_of(svc: MetadataService, key: str) -> list[str]:
    return sorted(r.tier for r in svc.objects[key].replicas)


def test_blocks_past_the_copy_ahead_watermark_are_copied_to_ssd_and_kept_in_dram():
    """At 4 of 8 blocks (under the high watermark) a pass copies the 2 oldest to the same
    node's SSD and keeps them in DRAM; the index still sees them in DRAM."""
    svc = make_service({"a": {"dram": 512, "ssd": 4096}}, **WM)
    index = PrefixIndex()
    for i in range(4):
        assert put(svc, f"k{i}", 64, now=float(i)) == "ok"
    feed(svc, index)
    assert svc.evictor.run(10.0) == 0  # no victims: copies only
    moves = svc.pool.drain_instructions("a")
    assert [
        (m.kind, m.key, m.src.tier, dst(m).tier, dst(m).node_id, m.release_src) for m in moves
    ] == [("copy", f"k{i}", "dram", "ssd", "a", False) for i in (0, 1)]
    svc.check_integrity()
    for m in moves:
        assert svc.mover.confirm(m.move_id, True, 11.0).status == "ok"
        svc.check_integrity()
    assert kinds(svc) == []  # the node's fastest tier did not change
    assert svc.space.tier_used == {"vram": 0, "dram": 256, "ssd": 128}
    assert svc.counters.copies == 2 and svc.counters.demotions == 0
    svc.evictor.run(20.0)
    assert svc.pool.drain_instructions() == []  # already clean: nothing copied twice
    assert index.holders("k0") == {"a": "dram"}
    assert [r.tier for r in svc.get_replicas("k0", 21.0).replicas] == ["dram", "ssd"]
    svc.evictor.run(22.0)  # k0 is now the most recent: k2 is one of the two oldest
    assert [(m.kind, m.key) for m in svc.pool.drain_instructions()] == [("copy", "k2")]


def test_a_put_into_full_dram_drops_the_oldest_copy_at_once():
    """DRAM full (8 of 8): a put drops the DRAM replica of the least recently used object
    that has an SSD copy, in the allocation itself (no pass, no no_space); the object is
    then on SSD only and the index moves it there."""
    svc = full_of_copies()
    index = PrefixIndex()
    index.add("a", [f"k{i}" for i in range(8)], "dram")
    assert svc.space.tier_used["dram"] == 512
    r = svc.writes.put_start("new", 64, 20.0, writer="a")
    assert r.status == "ok" and [(d.tier, d.offset) for d in r.replicas] == [("dram", 0)]
    svc.writes.put_end("new", 20.0)
    svc.check_integrity()
    assert kinds(svc)[0] == ("demoted", "k0", "a", "ssd")
    index.demote("a", ["k0"], "ssd")
    assert [r.tier for r in svc.get_replicas("k0", 21.0).replicas] == ["ssd"]
    assert svc.counters.demotions == 1 and svc.counters.evictions == 0
    assert put(svc, "new2", 64, now=22.0) == "ok"  # k1 next: also copied
    assert tiers_of(svc, "k1") == ["ssd"]
    assert set(svc.objects) == {f"k{i}" for i in range(8)} | {"new", "new2"}
    assert index.holders("k0") == {"a": "ssd"} and index.holders("k2") == {"a": "dram"}


def test_a_put_into_full_dram_drops_a_replica_whose_object_keeps_another():
    """Two nodes' DRAM full of objects stored twice: a put drops one replica of the least
    recently used object at once (it stays readable on the other node), without a pass."""
    svc = make_service({n: {"dram": 256, "ssd": 4096} for n in "ab"})
    for i in range(4):
        assert put(svc, f"k{i}", 64, now=float(i), replicas=2) == "ok"
    svc.pool.drain_events()
    r = svc.writes.put_start("new", 64, 10.0, writer="a")
    assert r.status == "ok" and [(d.node_id, d.offset) for d in r.replicas] == [("a", 0)]
    assert kinds(svc) == [("evicted", "k0", "a", "dram")]
    assert [d.node_id for d in svc.get_replicas("k0", 11.0).replicas] == ["b"]
    assert svc.counters.evictions == 1 and len(svc.objects) == 5
    svc.check_integrity()


def test_a_put_with_no_copy_to_drop_goes_to_ssd_or_is_refused_dropping_nothing():
    """When no object in full DRAM has another replica and SSD is mounted (its victims
    have somewhere to go), the put does not evict: a put allowed onto SSD lands there, a
    DRAM-only put answers no_space (and the next pass demotes); nothing is lost."""
    svc = make_service({"a": {"dram": 512, "ssd": 4096}}, copy_ahead_watermark=1.0)
    for i in range(8):
        assert put(svc, f"k{i}", 64, now=float(i)) == "ok"
    svc.pool.drain_events()
    r = svc.writes.put_start("ssd-ok", 64, 10.0, tiers=("dram", "ssd"))
    assert r.status == "ok" and [d.tier for d in r.replicas] == ["ssd"]
    refused = svc.writes.put_start("dram-only", 64, 10.0)
    assert refused.status == "no_space" and "free bytes" in refused.message
    assert len(svc.objects) == 9 and svc.counters.evictions == 0
    svc.check_integrity()
    svc.evictor.run(11.0)  # the pressure: LRU objects are demoted down to the low watermark
    assert [(m.kind, m.key) for m in svc.pool.drain_instructions()] == [
        ("demote", "k0"),
        ("demote", "k1"),
    ]


def test_a_refused_put_says_whether_room_is_on_its_way():
    """no_space with `room_pending` while demotions are in flight or a pass can start
    some (the client asks again, store/client/batches.py); without, when nothing can move down."""
    svc = make_service({"a": {"dram": 512, "ssd": 4096}}, copy_ahead_watermark=1.0)
    for i in range(8):
        assert put(svc, f"k{i}", 64, now=float(i)) == "ok"
    r = svc.writes.put_start("new", 64, 10.0)
    assert r.status == "no_space" and r.room_pending  # the next pass demotes
    svc.evictor.run(10.5)
    assert svc.writes.put_start("new", 64, 11.0).room_pending  # demotions in flight
    settle(svc, 12.0)
    assert put(svc, "new", 64, now=12.0) == "ok"
    bare = make_service({"a": {"dram": 128}}, copy_ahead_watermark=1.0)
    for i in range(2):
        assert put(bare, f"p{i}", 64, now=0.0, pin_ttl_s=100.0) == "ok"
    r = bare.writes.put_start("new", 64, 1.0)
    assert r.status == "no_space" and not r.room_pending  # pinned, nowhere to go
    svc.check_integrity()
    bare.check_integrity()


def test_protected_objects_are_never_dropped_for_a_put():
    """Leased, pinned and moving objects keep their DRAM replicas whatever a put needs:
    the put takes the oldest unprotected copy, and is refused when there is none."""
    svc = full_of_copies()
    svc.get_replicas("k0", 20.0)  # leased until 25
    svc.pin("k1", 100.0, 20.0)
    assert put(svc, "new", 64, now=21.0) == "ok"
    assert tiers_of(svc, "k0") == tiers_of(svc, "k1") == ["dram", "ssd"]
    assert tiers_of(svc, "k2") == ["ssd"]
    assert put(svc, "new2", 64, now=21.0) == "ok"  # k3: the last copy
    assert tiers_of(svc, "k3") == ["ssd"]
    for key in ("k4", "k5", "k6", "k7", "new", "new2"):
        svc.get_replicas(key, 22.0)
    assert svc.writes.put_start("other", 64, 23.0).status == "no_space"
    assert svc.counters.evictions == 0
    svc.check_integrity()


def test_an_ssd_only_object_is_served_from_ssd_and_its_promotion_keeps_it_clean():
    """A read of an object on SSD only answers its SSD replica (the client reads it there);
    with DRAM above its high watermark no promotion starts. Once DRAM has room a read
    promotes it and the SSD copy stays, so a later put drops its DRAM replica at once."""
    svc = full_of_copies()
    put(svc, "new", 64, now=20.0)  # k0 -> SSD only
    svc.pool.drain_events()
    assert [i.kind for i in svc.pool.drain_instructions()] == ["evict"]  # its DRAM range
    got = svc.get_replicas("k0", 21.0, reader="a")
    assert got.status == "ok" and [(d.tier, d.segment) for d in got.replicas] == [("ssd", "a-ssd")]
    assert svc.pool.drain_instructions() == []  # DRAM at 100%: no promotion
    for i in range(5, 8):
        svc.remove(f"k{i}", 30.0)  # DRAM 5 of 8: under the high watermark
    svc.pool.drain_events()
    svc.get_replicas("k0", 31.0, reader="a")
    assert settle(svc, 32.0) == ["promote k0"]
    assert kinds(svc) == [("promoted", "k0", "a", "dram")]
    assert tiers_of(svc, "k0") == ["dram", "ssd"]
    for i in range(5):  # 2 fill DRAM, 3 drop the copies k1..k3
        assert put(svc, f"more{i}", 64, now=40.0 + i) == "ok"
    assert tiers_of(svc, "k0") == ["dram", "ssd"]
    assert put(svc, "last", 64, now=50.0) == "ok"  # k4 and new are not copied: k0 goes
    assert tiers_of(svc, "k0") == ["ssd"]  # dropped, not lost
    assert svc.counters.evictions == 0
    svc.check_integrity()


def test_hits_are_counted_by_the_tier_of_the_replica_read_first():
    """A read of an object on SSD only is an SSD hit; once promoted, its reads are DRAM
    hits (memory first) though the SSD copy stays."""
    svc = full_of_copies()
    put(svc, "new", 64, now=20.0)  # k0 -> SSD only
    assert svc.get_replicas("k0", 21.0, reader="a").status == "ok"
    assert svc.get_replicas("k7", 21.0, reader="a").status == "ok"
    assert audit.stats(svc.pool).tier_hits == {"vram": 0, "dram": 1, "ssd": 1}
    for i in range(5, 8):
        svc.remove(f"k{i}", 30.0)  # room in DRAM: the next read promotes k0
    svc.get_replicas("k0", 31.0, reader="a")
    assert settle(svc, 32.0) == ["promote k0"]
    svc.get_replicas("k0", 33.0, reader="a")
    assert tiers_of(svc, "k0") == ["dram", "ssd"]
    assert audit.stats(svc.pool).tier_hits == {"vram": 0, "dram": 2, "ssd": 2}
    assert audit.stats(svc.pool).hits == 4


def test_events_keep_the_index_on_each_nodes_fastest_tier():
    """Through copies, drops of DRAM replicas, an SSD copy's eviction, a promotion and a
    remove, the index (fed the service's events) always says the node's fastest tier."""
    svc = make_service({"a": {"dram": 512, "ssd": 512}}, **WM)
    index = PrefixIndex()
    for i in range(8):
        put(svc, f"k{i}", 64, now=float(i))
    feed(svc, index)
    svc.evictor.run(10.0)  # demotes the 2 dirty victims... copies the rest past 25%
    settle(svc, 10.0, index)

    def tiers_now() -> dict[str, str]:
        out: dict[str, str] = {}
        for key, obj in svc.objects.items():
            best = min((r.tier for r in obj.complete()), key=("vram", "dram", "ssd").index)
            out[key] = best
        return out

    def index_now() -> dict[str, str]:
        return {k: index.holders(k).get("a", "") for k in svc.objects}

    assert index_now() == tiers_now()
    for i in range(6):
        put(svc, f"n{i}", 64, now=20.0 + i)
        svc.evictor.run(20.0 + i)
        settle(svc, 20.0 + i, index)
        assert index_now() == tiers_now(), i
    svc.get_replicas("k6", 30.0, reader="a")
    settle(svc, 30.0, index)
    svc.remove("k6", 40.0)
    feed(svc, index)
    assert index.holders("k6") == {}
    assert index_now() == tiers_now()
