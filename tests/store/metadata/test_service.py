"""Metadata service: the put protocol, reads and leases, removal, pins, placement, batches."""

from __future__ import annotations

import pytest

from mooncake.config.settings import StoreConfig
from mooncake.errors import ConfigError, StoreError
from mooncake.store.metadata import audit
from mooncake.store.metadata.settings import MetadataConfig
from tests.store.helpers import make_service, put


def test_put_protocol_states_processing_invisible_until_put_end():
    svc = make_service({"a": {"dram": 1024}})
    r = svc.writes.put_start("k", 100, now=0.0, writer="a")
    assert r.status == "ok" and [(d.segment, d.offset, d.size) for d in r.replicas] == [
        ("a-dram", 0, 100)
    ]
    assert r.replicas[0].state == "processing"
    assert svc.get_replicas("k", 0.0).status == "not_found"
    assert svc.exists("k", 0.0).status == "not_found"
    assert svc.writes.put_start("k", 100, 0.0).status == "busy"
    assert svc.remove("k", 0.0).status == "busy"
    svc.check_integrity()
    assert svc.writes.put_end("k", 1.0).status == "ok"
    assert svc.writes.put_end("k", 1.0).status == "ok"  # idempotent
    got = svc.get_replicas("k", 1.0)
    assert got.status == "ok" and got.size == 100 and got.replicas[0].state == "complete"
    assert svc.exists("k", 1.0).status == "ok"
    assert [(e.kind, e.key, e.node_id, e.tier) for e in svc.pool.drain_events()] == [
        ("added", "k", "a", "dram")
    ]
    assert svc.counters.hits == 1 and svc.counters.misses == 1
    svc.check_integrity()


def test_put_revoke_frees_the_space_and_unknown_keys_are_clear_errors():
    svc = make_service({"a": {"dram": 256}})
    assert svc.writes.put_start("k", 256, 0.0).status == "ok"
    assert svc.writes.put_start("other", 64, 0.0).status == "no_space"
    assert svc.writes.put_revoke("k", 0.0).status == "ok"
    assert svc.space.tier_used["dram"] == 0
    end = svc.writes.put_end("k", 0.0)
    assert end.status == "not_found" and "'k'" in end.message and "put_start" in end.message
    assert put(svc, "k", 64) == "ok"
    rev = svc.writes.put_revoke("k", 0.0)
    assert rev.status == "error" and "remove" in rev.message
    svc.check_integrity()


def test_existing_key_is_reported_not_overwritten_unless_asked():
    svc = make_service({"a": {"dram": 1024}})
    assert put(svc, "k", 64) == "ok"
    r = svc.writes.put_start("k", 128, 0.0)
    assert r.status == "exists" and "overwrite" in r.message
    svc.get_replicas("k", 1.0)  # leased until 6.0
    assert svc.writes.put_start("k", 128, 2.0, overwrite=True).status == "leased"
    assert put(svc, "k", 128, now=7.0, overwrite=True) == "ok"
    assert svc.get_replicas("k", 7.0).size == 128
    assert svc.space.tier_used["dram"] == 128


def test_lease_blocks_remove_until_it_expires_and_reads_renew_it():
    svc = make_service({"a": {"dram": 1024}}, lease_ttl_s=5.0)
    put(svc, "k", 64)
    assert svc.get_replicas("k", 10.0).lease_ttl_s == 5.0
    svc.get_replicas("k", 14.0)  # renewed to 19.0
    refused = svc.remove("k", 18.0)
    assert refused.status == "leased" and "'k'" in refused.message
    assert svc.remove("k", 19.5).status == "ok"
    assert svc.exists("k", 20.0).status == "not_found"
    assert svc.remove("k", 20.0).status == "not_found"
    svc.check_integrity()


def test_bad_keys_and_sizes_return_error_results():
    svc = make_service({"a": {"dram": 1024}})
    long_key = "é" * 200  # 400 bytes of UTF-8
    for r in (
        svc.writes.put_start(long_key, 10, 0.0),
        svc.writes.put_start("", 10, 0.0),
        svc.writes.put_start("k", 0, 0.0),
        svc.writes.put_start("k", 10, 0.0, tiers=("tape",)),
        svc.get_replicas(long_key, 0.0),
        svc.exists("", 0.0),
        svc.remove(long_key, 0.0),
    ):
        assert r.status == "error" and r.message, r
    assert "256-byte" in svc.writes.put_start(long_key, 10, 0.0).message
    assert not svc.objects
    svc.check_integrity()


def test_segment_misuse_raises_store_error_and_changes_nothing():
    svc = make_service({"a": {"dram": 1024}})
    svc.mount_segment("a", "a-dram", "dram", 1024, 0.0, alignment=64)  # same again: no-op
    with pytest.raises(StoreError, match="already mounted by node 'a'"):
        svc.mount_segment("b", "a-dram", "dram", 1024, 0.0)
    with pytest.raises(StoreError, match="unknown tier"):
        svc.mount_segment("b", "b-x", "tape", 1024, 0.0)
    with pytest.raises(StoreError, match="nothing to unmount"):
        svc.unmount_segment("b", "a-dram", 0.0)
    with pytest.raises(ConfigError, match="low_watermark") as e:
        MetadataConfig(low_watermark=0.9, high_watermark=0.8, lease_ttl_s=0, placement="x")  # type: ignore[arg-type]
    assert len(e.value.errors) == 3  # every problem at once
    assert list(svc.space.segments) == ["a-dram"]
    svc.check_integrity()


def test_config_comes_from_the_store_section():
    cfg = MetadataConfig.from_store_config(
        StoreConfig(replicas=2, lease_ttl_s=3.0, low_watermark=0.5), placement="random"
    )
    assert (cfg.replicas, cfg.lease_ttl_s, cfg.low_watermark, cfg.high_watermark) == (
        2,
        3.0,
        0.5,
        0.95,
    )
    assert cfg.placement == "random"


def test_write_error_names_writes_outside_the_allocation():
    svc = make_service({"a": {"dram": 1024}})
    svc.writes.put_start("k", 100, 0.0)
    assert audit.write_error(svc.pool, "k", "a-dram", 0, 100) == ""
    assert "outside its allocation [0, 100)" in audit.write_error(svc.pool, "k", "a-dram", 50, 64)
    assert "put_start first" in audit.write_error(svc.pool, "k", "b-dram", 0, 10)
    svc.writes.put_end("k", 0.0)
    assert "put_start first" in audit.write_error(svc.pool, "k", "a-dram", 0, 10)


def test_replicas_land_on_distinct_nodes_local_first():
    svc = make_service({n: {"dram": 1024} for n in "abc"}, replicas=2)
    svc.mount_segment("b", "b-dram2", "dram", 1024, 0.0)  # b has two segments
    r = svc.writes.put_start("k", 64, 0.0, writer="b")
    assert r.status == "ok" and len({d.node_id for d in r.replicas}) == 2
    assert r.replicas[0].node_id == "b"
    # best effort: 3 replicas wanted, 3 nodes exist
    assert len(svc.writes.put_start("k3", 64, 0.0, replicas=3).replicas) == 3
    assert len(svc.writes.put_start("k4", 64, 0.0, replicas=5).replicas) == 3
    svc.check_integrity()


def test_free_ratio_placement_spreads_and_random_is_seeded():
    svc = make_service({"a": {"dram": 1024}, "b": {"dram": 1024}}, placement="free_ratio")
    nodes = [svc.writes.put_start(f"k{i}", 256, 0.0).replicas[0].node_id for i in range(4)]
    assert nodes == ["a", "b", "a", "b"]
    runs = []
    for _ in range(2):
        svc = make_service({n: {"dram": 4096} for n in "abcd"}, placement="random", seed=7)
        runs.append([svc.writes.put_start(f"k{i}", 64, 0.0).replicas[0].node_id for i in range(8)])
    assert runs[0] == runs[1] and len(set(runs[0])) > 1


def test_tiers_are_tried_in_order():
    svc = make_service({"a": {"dram": 128, "ssd": 8192}})
    assert svc.writes.put_start("k1", 128, 0.0, tiers=("dram", "ssd")).replicas[0].tier == "dram"
    r = svc.writes.put_start("k2", 128, 0.0, tiers=("dram", "ssd"))
    assert r.replicas[0].tier == "ssd" and r.replicas[0].offset % 4096 == 0


def test_batches_answer_per_key_in_order():
    svc = make_service({"a": {"dram": 256}})
    res = svc.writes.batch_put_start(["x", "", "y", "z"], [128, 1, 128, 128], 0.0, writer="a")
    assert [r.status for r in res] == ["ok", "error", "ok", "no_space"]
    assert [r.status for r in svc.writes.batch_put_end(["x", "nope", "y"], 0.0)] == [
        "ok",
        "not_found",
        "ok",
    ]
    assert [r.status for r in svc.batch_get_replicas(["y", "q", "x"], 1.0)] == [
        "ok",
        "not_found",
        "ok",
    ]
    assert [r.status for r in svc.batch_exists(["x", "q"], 1.0)] == ["ok", "not_found"]
    assert [r.status for r in svc.batch_remove(["x", "q"], 10.0)] == ["ok", "not_found"]
    assert [r.status for r in svc.writes.batch_put_revoke(["y", "q"], 10.0)] == [
        "error",
        "not_found",
    ]
    with pytest.raises(StoreError, match="2 keys but 1 sizes"):
        svc.writes.batch_put_start(["a", "b"], [1], 0.0)
    svc.check_integrity()


def test_unended_put_is_reclaimed_after_timeout_or_when_its_writer_dies():
    svc = make_service({"a": {"dram": 1024}, "w": {"dram": 1024}}, put_timeout_s=30.0)
    svc.writes.put_start("slow", 64, 0.0, writer="a")
    svc.writes.put_start("orphan", 64, 0.0, writer="w")
    svc.space.heartbeat("a", 12.0)
    assert svc.expire(12.0) == ["w"]  # w silent for > heartbeat_ttl_s (10 s)
    assert "orphan" not in svc.objects and "slow" in svc.objects
    svc.space.heartbeat("a", 20.0)
    svc.expire(20.0)
    assert "slow" in svc.objects
    svc.space.heartbeat("a", 31.0)
    svc.expire(31.0)
    assert not svc.objects and svc.space.tier_used["dram"] == 0
    assert svc.writes.put_end("slow", 31.0).status == "not_found"
    svc.check_integrity()


def test_stats_count_objects_bytes_hits_and_misses():
    svc = make_service({"a": {"dram": 1024, "ssd": 8192}})
    put(svc, "k", 100)
    svc.get_replicas("k", 0.0)
    svc.get_replicas("nope", 0.0)
    st = audit.stats(svc.pool)
    assert (st.num_objects, st.num_segments, st.num_nodes) == (1, 2, 1)
    assert st.tier_used_bytes == {"vram": 0, "dram": 128, "ssd": 0}
    assert st.tier_capacity_bytes["ssd"] == 8192 and st.tier_objects["dram"] == 1
    assert (st.hits, st.misses, st.puts) == (1, 1, 1)


def test_reads_list_memory_before_ssd_and_local_before_remote():
    svc = make_service({"a": {"dram": 1024, "ssd": 8192}, "b": {"dram": 1024}}, replicas=2)
    assert put(svc, "k", 64, writer="a", tiers=("ssd", "dram")) == "ok"
    got = svc.get_replicas("k", 1.0, reader="a")
    assert [(r.node_id, r.tier) for r in got.replicas] == [("b", "dram"), ("a", "ssd")]
    assert svc.pool.drain_instructions() == []  # a DRAM copy exists: nothing to promote
    put(svc, "m", 64, writer="a")
    assert [r.node_id for r in svc.get_replicas("m", 1.0, reader="b").replicas] == ["b", "a"]


def test_clear_replicas_takes_the_writers_unleased_objects_all_or_on_one_segment():
    """Upstream's BatchReplicaClear (mooncake-store/src/master_service.cpp): only the
    caller's objects, not while leased or being written; every replica, or those on one
    segment (named by segment, node or endpoint), the object with its last one."""
    svc = make_service({"a": {"dram": 4096}, "b": {"dram": 4096}}, lease_ttl_s=1.0)
    assert put(svc, "both", 64, writer="a", replicas=2) == "ok"
    assert put(svc, "one", 64, writer="a") == "ok"
    assert put(svc, "theirs", 64, writer="b") == "ok"
    svc.writes.put_start("writing", 64, 0.0, writer="a")
    assert svc.get_replicas("one", 0.0).status == "ok"  # a lease until t=1
    keys = ["missing", "theirs", "writing", "one", "both"]
    assert svc.clear_replicas(keys, "a", "b-dram", 0.5) == ["both"]  # "one" is leased
    assert [r.node_id for r in svc.objects["both"].replicas] == ["a"]
    assert svc.clear_replicas(["both"], "a", "b", 0.5) == []  # nothing left on node b
    assert svc.clear_replicas(["both", "one"], "a", "", 2.0) == ["both", "one"]
    assert set(svc.objects) == {"theirs", "writing"}
    svc.check_integrity()
