"""The pool's eviction order (`store/metadata/poolorder.py`) on its own and in the metadata service:
one recency across every segment, duplicates before last copies, the duplicates' budget,
demotion to SSD before anything leaves the pool."""

from __future__ import annotations

from mooncake.store.metadata.poolorder import PoolOrder
from mooncake.store.metadata.service import MetadataService
from tests.store.helpers import dst, make_service, put


def test_spare_copies_come_before_last_copies_each_least_recently_used_first():
    order: PoolOrder[str] = PoolOrder(("dram", "ssd"))
    for key in ("a", "b", "c", "d"):
        order.add(key, "dram", units=10)
    order.add("c", "dram", units=10)  # a duplicate of c
    order.add("b", "ssd", units=10)  # b is clean in DRAM (a copy on SSD)
    order.touch("b")  # b is the most recent now
    assert list(order.victims("dram")) == ["c", "b", "a", "d"]
    assert list(order.victims("dram", spare_only=True)) == ["c", "b"]
    assert list(order.victims("ssd")) == ["b"]  # spare there too: DRAM holds it
    assert order.dup_units == {"dram": 10, "ssd": 0}
    order.remove("c", "dram")
    order.remove("b", "dram")  # b's last copy is on SSD now
    assert list(order.victims("dram")) == ["a", "c", "d"] and list(order.victims("ssd")) == ["b"]
    assert order.spare == {"dram": set(), "ssd": set()} and order.dup_units["dram"] == 0
    order.check_integrity()


def test_the_budget_counts_copies_beyond_what_the_put_asked_for():
    order: PoolOrder[str] = PoolOrder(("dram",))
    order.add("x", "dram", units=5, wanted=2)
    order.add("x", "dram")
    assert order.dup_units["dram"] == 0  # the put asked for both
    assert order.may_duplicate("dram", 5, budget=0.1, capacity=50)
    order.add("x", "dram")
    assert order.dup_units["dram"] == 5
    assert not order.may_duplicate("dram", 5, budget=0.1, capacity=50)
    order.check_integrity()


def _full_pool() -> MetadataService:
    """Nodes a and b, 4 objects of 64 bytes each: a's old0-3 (oldest), then b's new0-3."""
    svc = make_service({"a": {"dram": 256}, "b": {"dram": 256}})
    for i in range(4):
        assert put(svc, f"old{i}", 64, now=float(i), writer="a") == "ok"
    for i in range(4):
        assert put(svc, f"new{i}", 64, now=10.0 + i, writer="b") == "ok"
    svc.pool.drain_events()
    return svc


def test_a_put_into_a_full_pool_evicts_the_pools_oldest_object_and_stays_on_its_writer():
    """Per-node LRU would drop the writer's own recent objects; the pool's order drops the
    oldest object of the pool, and the writer's own oldest object takes its place (a
    relocation the writer copies), so the put lands on its writer."""
    svc = _full_pool()
    r = svc.writes.put_start("newest", 64, 20.0, writer="b")
    assert r.status == "ok" and [d.node_id for d in r.replicas] == ["b"]
    (rel,) = r.relocations
    assert (rel.key, rel.src.node_id, rel.dst.node_id) == ("new0", "b", "a")
    assert rel.dst.offset == 0 and rel.src.offset == r.replicas[0].offset  # the old ranges
    events = [(e.kind, e.key, e.node_id) for e in svc.pool.drain_events()]
    assert events == [("evicted", "old0", "a"), ("evicted", "new0", "b")]
    assert all(f"new{i}" in svc.objects for i in range(4)) and "old0" not in svc.objects
    svc.check_integrity()
    assert svc.get_replicas("new0", 20.0).status == "not_found"  # until its copy is done
    assert svc.pool.snapshot().objects[-1].key != "new0" and len(svc.pool.snapshot().objects) == 6
    assert svc.writes.put_end("newest", 21.0).status == "ok"
    svc.check_integrity()
    assert list(svc.pool.order.order["dram"])[:5] == ["old1", "old2", "old3", "new0", "new1"]
    got = svc.get_replicas("new0", 22.0)  # it kept its place in the order until now
    assert got.status == "ok" and [(d.node_id, d.offset) for d in got.replicas] == [("a", 0)]
    events = [(e.kind, e.key, e.node_id) for e in svc.pool.drain_events()]
    assert ("added", "new0", "a") in events and ("added", "newest", "b") in events
    # the pool's oldest is the writer's own: dropped as usual, nothing relocated
    r = svc.writes.put_start("later", 64, 30.0, writer="a")
    assert [d.node_id for d in r.replicas] == ["a"] and not r.relocations
    assert "old1" not in svc.objects
    svc.check_integrity()


def test_a_revoked_put_takes_the_objects_it_was_relocating_with_it():
    """The writer never copied them (or wrote over their old range): they go, cleanly."""
    svc = _full_pool()
    r = svc.writes.put_start("newest", 64, 20.0, writer="b")
    assert [m.key for m in r.relocations] == ["new0"]
    assert svc.remove("new0", 20.5).status == "busy"  # moving: not removable meanwhile
    assert svc.writes.put_revoke("newest", 21.0).status == "ok"
    assert "new0" not in svc.objects and "newest" not in svc.objects
    svc.check_integrity()
    assert put(svc, "again", 64, now=22.0, writer="b") == "ok"  # the room is b's again
    assert svc.objects["again"].replicas[0].node_id == "b"
    svc.check_integrity()


def test_other_placements_still_put_where_the_pools_oldest_was():
    svc = make_service({"a": {"dram": 256}, "b": {"dram": 256}}, placement="free_ratio")
    for i in range(4):
        assert put(svc, f"old{i}", 64, now=float(i), writer="a") == "ok"
    for i in range(4):
        assert put(svc, f"new{i}", 64, now=10.0 + i, writer="b") == "ok"
    r = svc.writes.put_start("newest", 64, 20.0, writer="b")
    assert [d.node_id for d in r.replicas] == ["a"] and not r.relocations
    svc.check_integrity()


def test_a_hot_spot_duplicate_goes_before_the_last_copy_of_an_older_object():
    svc = make_service({"a": {"dram": 256}, "b": {"dram": 256}}, replica_budget=0.5)
    for i in range(4):
        assert put(svc, f"k{i}", 64, now=float(i), writer="a") == "ok"
    assert svc.replicate(["k3"], "b", 5.0) == 1
    (copy,) = svc.pool.drain_instructions("a")
    svc.mover.confirm(copy.move_id, True, 5.0)
    svc.get_replicas("k3", 6.0)  # the hottest object, on both nodes
    for i in range(3):
        assert put(svc, f"n{i}", 64, now=20.0 + i, writer="b") == "ok"
    svc.pool.drain_events()
    assert put(svc, "n3", 64, now=30.0, writer="b") == "ok"  # a copy of k3 goes, not k0
    assert [(e.kind, e.key) for e in svc.pool.drain_events()][0] == ("evicted", "k3")
    assert "k0" in svc.objects and len(svc.objects["k3"].replicas) == 1
    assert put(svc, "n4", 64, now=31.0, writer="b") == "ok"  # no duplicate left: k0
    assert "k0" not in svc.objects
    svc.check_integrity()


def test_hot_spot_replicas_stay_within_the_budget():
    svc = make_service({n: {"dram": 1024} for n in "abc"}, replica_budget=128 / 3072)
    for i in range(4):
        assert put(svc, f"k{i}", 64, writer="a") == "ok"
    assert svc.replicate(["k0", "k1", "k2"], "b", 1.0) == 2  # 128 bytes of duplicates
    for m in svc.pool.drain_instructions("a"):
        svc.mover.confirm(m.move_id, True, 1.0)
    assert svc.order.dup_units["dram"] == 128
    assert svc.replicate(["k3"], "c", 2.0) == 0 and not svc.pool.drain_instructions()
    svc.check_integrity()
    none = make_service({n: {"dram": 1024} for n in "ab"}, replica_budget=0.0)
    assert put(none, "k", 64, writer="a") == "ok"
    assert none.replicate(["k"], "b", 1.0) == 0


def test_victims_move_down_to_any_nodes_ssd_before_the_pool_drops_them():
    """A node without an SSD: its DRAM victims go to another node's SSD, not away."""
    wm = {"high_watermark": 0.75, "low_watermark": 0.5}
    svc = make_service({"a": {"dram": 512}, "b": {"ssd": 4096}}, **wm)
    for i in range(7):
        assert put(svc, f"k{i}", 64, now=float(i)) == "ok"
    assert svc.evictor.run(20.0) == 3
    moves = svc.pool.drain_instructions("a")
    assert [(m.kind, m.key, dst(m).node_id, dst(m).tier) for m in moves] == [
        ("demote", f"k{i}", "b", "ssd") for i in range(3)
    ]
    for m in moves:
        svc.mover.confirm(m.move_id, True, 21.0)
    assert len(svc.objects) == 7 and svc.counters.evictions == 0
    svc.check_integrity()
