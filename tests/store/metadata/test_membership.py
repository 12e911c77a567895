"""Node liveness: expiry and unmount drop replicas; objects with a replica elsewhere stay
readable, the others are reported lost; moves through a lost node are cancelled."""

from __future__ import annotations

from tests.store.helpers import dst, make_service, put


def test_node_expiry_with_two_replicas_keeps_every_object_readable():
    svc = make_service({n: {"dram": 4096} for n in "abc"}, replicas=2, heartbeat_ttl_s=10.0)
    for i in range(12):
        assert put(svc, f"k{i}", 100, writer="abc"[i % 3]) == "ok"
    svc.pool.drain_events()
    for node in "ab":
        assert svc.space.heartbeat(node, 8.0) is True
    assert svc.expire(11.0) == ["c"]
    svc.check_integrity()
    for i in range(12):
        got = svc.get_replicas(f"k{i}", 11.0)
        assert got.status == "ok" and "c" not in {r.node_id for r in got.replicas}
    assert [(e.kind, e.node_id) for e in svc.pool.drain_events()] == [("node_gone", "c")]
    assert svc.space.heartbeat("c", 12.0) is False  # c must re-mount its segments
    assert "c-dram" not in svc.space.segments


def test_objects_whose_only_replica_died_are_reported_lost():
    svc = make_service({"a": {"dram": 4096}, "b": {"dram": 4096}})
    put(svc, "on-a", 64, writer="a")
    put(svc, "on-b", 64, writer="b")
    svc.pool.drain_events()
    svc.space.heartbeat("a", 15.0)
    svc.expire(15.0)
    assert [(e.kind, e.key, e.node_id) for e in svc.pool.drain_events()] == [
        (
            "lost",
            "on-b",
            "b",
        ),
        ("node_gone", "", "b"),
    ]
    assert svc.get_replicas("on-b", 15.0).status == "not_found"
    assert svc.get_replicas("on-a", 15.0).status == "ok"
    assert svc.counters.lost_objects == 1
    svc.check_integrity()


def test_unmount_drops_replicas_with_evicted_events_and_keeps_other_copies():
    svc = make_service({"a": {"dram": 4096}, "b": {"dram": 4096}}, replicas=2)
    put(svc, "both", 64)
    svc.mount_segment("a", "a-ssd", "ssd", 8192, 0.0)
    put(svc, "only-ssd", 64, tiers=("ssd",))
    svc.pool.drain_events()
    assert svc.unmount_segment("a", "a-dram", 1.0) == 1
    assert svc.unmount_segment("a", "a-ssd", 1.0) == 1
    assert [(e.kind, e.key, e.node_id) for e in svc.pool.drain_events()] == [
        ("evicted", "both", "a"),
        ("evicted", "only-ssd", "a"),
        ("lost", "only-ssd", "a"),
    ]
    assert [r.node_id for r in svc.get_replicas("both", 1.0).replicas] == ["b"]
    svc.check_integrity()


def test_a_put_in_flight_survives_losing_one_of_its_replicas():
    svc = make_service({"a": {"dram": 4096}, "b": {"dram": 4096}}, replicas=2)
    svc.writes.put_start("k", 64, 0.0, writer="a")
    svc.space.heartbeat("a", 15.0)
    svc.expire(15.0)
    assert svc.writes.put_end("k", 15.0).status == "ok"
    assert [r.node_id for r in svc.get_replicas("k", 15.0).replicas] == ["a"]
    svc.check_integrity()


def test_death_of_a_move_source_cancels_the_move_and_frees_its_destination():
    wm = {"high_watermark": 0.75, "low_watermark": 0.5}
    svc = make_service({"a": {"dram": 512}, "b": {"ssd": 4096}}, **wm)
    for i in range(7):
        put(svc, f"k{i}", 64)
    svc.evictor.run(1.0)
    moves = svc.pool.drain_instructions("a")
    assert {(m.src.node_id, dst(m).node_id) for m in moves} == {("a", "b")}  # cross-node
    svc.mover.confirm(moves[0].move_id, True, 2.0)
    svc.space.heartbeat("b", 15.0)
    svc.expire(15.0)  # a dies: moves of k1, k2 cancelled, their SSD copies freed
    assert set(svc.objects) == {"k0"} and svc.space.tier_used["ssd"] == 64
    assert svc.mover.confirm(moves[1].move_id, True, 15.0).status == "not_found"
    svc.check_integrity()


def test_death_of_a_move_destination_cancels_the_move_and_keeps_the_source():
    wm = {"high_watermark": 0.75, "low_watermark": 0.5}
    svc = make_service({"a": {"dram": 512}, "b": {"ssd": 4096}}, **wm)
    for i in range(7):
        put(svc, f"k{i}", 64)
    svc.evictor.run(1.0)
    svc.space.heartbeat("a", 15.0)
    svc.expire(15.0)
    assert len(svc.objects) == 7 and not svc.mover.moves
    # nowhere to demote now: the last copies stay until a put needs their room
    assert svc.evictor.run(15.0) == 0 and len(svc.objects) == 7
    assert put(svc, "k7", 64, now=15.0) == "ok" and put(svc, "k8", 64, now=15.0) == "ok"
    assert "k0" not in svc.objects and len(svc.objects) == 8
    svc.check_integrity()


def test_a_client_without_segments_expires_silently():
    svc = make_service({"a": {"dram": 1024}})
    assert svc.space.heartbeat("client", 0.0) is False
    svc.space.heartbeat("a", 11.0)
    assert svc.expire(11.0) == ["client"]
    assert svc.pool.drain_events() == []


def test_a_restarted_node_loses_what_its_old_process_mounted_and_keeps_its_new_mounts():
    """The master saw node a restart (its last heartbeat at 5 s): a's segments mounted
    before then go at once (puts no longer land in dead memory), one mounted since stays."""
    svc = make_service({"a": {"dram": 4096}, "b": {"dram": 4096}})
    put(svc, "on-a", 64, writer="a")
    svc.mount_segment("a", "a-ssd", "ssd", 8192, now=6.0)  # the new process's
    svc.pool.drain_events()
    assert svc.drop_stale_segments("a", before=5.0, now=7.0) == 1
    assert "a-dram" not in svc.space.segments and "a-ssd" in svc.space.segments
    assert [(e.kind, e.key) for e in svc.pool.drain_events()] == [
        ("evicted", "on-a"),
        ("lost", "on-a"),
    ]
    assert put(svc, "next", 64, writer="a", tiers=("dram",)) == "ok"  # placed on b
    assert [r.node_id for r in svc.get_replicas("next", 7.0).replicas] == ["b"]
    assert svc.drop_stale_segments("b", before=0.0, now=7.0) == 0
    svc.check_integrity()
