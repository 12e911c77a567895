"""The pool's eviction order (`store/poolorder.py`) on its own and in the metadata service:
one recency across every segment, duplicates before last copies, the duplicates' budget,
demotion to SSD before anything leaves the pool."""

from __future__ import annotations

from mooncake.store.poolorder import PoolOrder
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


def test_a_put_into_a_full_pool_evicts_the_pools_oldest_object_whichever_node_holds_it():
    """Per-node LRU would drop the writer's own recent objects; the pool's order drops the
    oldest object of the pool, and the put goes where it freed room."""
    svc = make_service({"a": {"dram": 256}, "b": {"dram": 256}})
    for i in range(4):
        assert put(svc, f"old{i}", 64, now=float(i), writer="a") == "ok"
    for i in range(4):
        assert put(svc, f"new{i}", 64, now=10.0 + i, writer="b") == "ok"
    svc.drain_events()
    r = svc.put_start("newest", 64, 20.0, writer="b")
    assert r.status == "ok" and [d.node_id for d in r.replicas] == ["a"]
    assert [(e.kind, e.key) for e in svc.drain_events()] == [("evicted", "old0")]
    assert all(f"new{i}" in svc.objects for i in range(4))
    svc.check_integrity()


def test_a_hot_spot_duplicate_goes_before_the_last_copy_of_an_older_object():
    svc = make_service({"a": {"dram": 256}, "b": {"dram": 256}}, replica_budget=0.5)
    for i in range(4):
        assert put(svc, f"k{i}", 64, now=float(i), writer="a") == "ok"
    assert svc.replicate(["k3"], "b", 5.0) == 1
    (copy,) = svc.drain_instructions("a")
    svc.confirm_move(copy.move_id, True, 5.0)
    svc.get_replicas("k3", 6.0)  # the hottest object, on both nodes
    for i in range(3):
        assert put(svc, f"n{i}", 64, now=20.0 + i, writer="b") == "ok"
    svc.drain_events()
    assert put(svc, "n3", 64, now=30.0, writer="b") == "ok"  # a copy of k3 goes, not k0
    assert [(e.kind, e.key) for e in svc.drain_events()][0] == ("evicted", "k3")
    assert "k0" in svc.objects and len(svc.objects["k3"].replicas) == 1
    assert put(svc, "n4", 64, now=31.0, writer="b") == "ok"  # no duplicate left: k0
    assert "k0" not in svc.objects
    svc.check_integrity()


def test_hot_spot_replicas_stay_within_the_budget():
    svc = make_service({n: {"dram": 1024} for n in "abc"}, replica_budget=128 / 3072)
    for i in range(4):
        assert put(svc, f"k{i}", 64, writer="a") == "ok"
    assert svc.replicate(["k0", "k1", "k2"], "b", 1.0) == 2  # 128 bytes of duplicates
    for m in svc.drain_instructions("a"):
        svc.confirm_move(m.move_id, True, 1.0)
    assert svc.order.dup_units["dram"] == 128
    assert svc.replicate(["k3"], "c", 2.0) == 0 and not svc.drain_instructions()
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
    assert svc.evict(20.0) == 3
    moves = svc.drain_instructions("a")
    assert [(m.kind, m.key, dst(m).node_id, dst(m).tier) for m in moves] == [
        ("demote", f"k{i}", "b", "ssd") for i in range(3)
    ]
    for m in moves:
        svc.confirm_move(m.move_id, True, 21.0)
    assert len(svc.objects) == 7 and svc.counters.evictions == 0
    svc.check_integrity()
