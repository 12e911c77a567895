"""The drop-in's parts that need no cluster: ReplicateConfig as upstream defines it, setup's
argument rules, the secret rule, the code table, and a store that was never set up."""

from __future__ import annotations

import pytest

from mooncake.errors import ConfigError, RpcTimeout, StoreError, TransferError
from mooncake.store import MooncakeDistributedStore, ReplicateConfig, SoftPinAction
from mooncake.store.client.client import NotFoundError, StatusError
from mooncake.store.upstream.codes import ErrorCode, code_of, code_of_put, code_of_status
from mooncake.store.upstream.replicate import MAX_PIN_S, SOFT_PIN_DEFAULT_S, put_options
from mooncake.store.upstream.setup import cluster_secret, parse_size, read_args, read_dict


def test_replicate_config_has_upstreams_fields_and_defaults() -> None:
    """Defaults as mooncake-store/include/replica.h; str names the replica count."""
    c = ReplicateConfig()
    assert (c.replica_num, c.nof_replica_num, c.dfs_replica_num) == (1, 0, 0)
    assert c.soft_pin_action == SoftPinAction.PRESERVE and c.soft_pin_ttl_ms is None
    assert (c.with_hard_pin, c.preferred_segment, c.preferred_segments) == (False, "", [])
    assert c.prefer_alloc_in_same_node is False and c.group_ids is None
    c.replica_num = 3
    assert "replica_num: 3" in str(c)


@pytest.mark.parametrize("bad", [-1, 1 << 64, 1.5, "10"])
def test_soft_pin_ttl_takes_only_none_or_uint64(bad: object) -> None:
    c = ReplicateConfig()
    c.soft_pin_ttl_ms = 1000
    assert c.soft_pin_ttl_ms == 1000
    with pytest.raises(TypeError, match="soft_pin_ttl_ms"):
        c.soft_pin_ttl_ms = bad
    c.soft_pin_ttl_ms = None
    assert c.soft_pin_ttl_ms is None


def test_put_options_map_pins_and_refuse_what_cannot_be_honoured() -> None:
    """ENABLE pins (the TTL given or upstream's 30 min), hard pin pins for the longest,
    a TTL without ENABLE and NVMe-oF/DFS replicas are refused."""
    assert put_options(None) == {"replicas": 1, "pin_ttl_s": 0.0, "overwrite": False}
    c = ReplicateConfig()
    c.soft_pin_action = SoftPinAction.ENABLE
    assert put_options(c)["pin_ttl_s"] == SOFT_PIN_DEFAULT_S
    c.soft_pin_ttl_ms = 1500
    assert put_options(c, overwrite=True)["pin_ttl_s"] == 1.5
    c.soft_pin_action = SoftPinAction.DISABLE
    with pytest.raises(ValueError, match="ENABLE"):
        put_options(c)
    hard = ReplicateConfig()
    hard.with_hard_pin = True
    assert put_options(hard)["pin_ttl_s"] == MAX_PIN_S
    for field in ("nof_replica_num", "dfs_replica_num"):
        c = ReplicateConfig()
        setattr(c, field, 1)
        with pytest.raises(ValueError, match="NVMe-oF or DFS"):
            put_options(c)
    c = ReplicateConfig()
    c.replica_num = 0
    with pytest.raises(ValueError, match="replica_num"):
        put_options(c)


def test_sizes_read_as_upstream_reads_them() -> None:
    """K/M/G/T with or without B are powers of 1024 (upstream's try_string_to_byte_size)."""
    assert parse_size("16MB", "k") == parse_size("16 MB", "k") == 16 << 20
    assert parse_size("1.5 GB", "k") == 3 << 29
    assert parse_size("64KiB", "k") == parse_size("64k", "k") == 65536
    assert parse_size(4096, "k") == 4096
    for bad in ("50%", "-1", "ten", True, -5):
        with pytest.raises(ValueError, match="k: expected bytes"):
            parse_size(bad, "k")


def test_setup_arguments_are_checked_and_named() -> None:
    a = read_args("localhost", "P2PHANDSHAKE", "16MB", 0, "tcp", "", "10.0.0.1:50051")
    assert (a.host, a.port, a.segment_bytes, a.buffer_bytes) == ("127.0.0.1", 0, 16 << 20, 0)
    assert a.master == "tcp://10.0.0.1:50051"
    b = read_args("10.0.0.2:12345", "http://x:8080/metadata", 0, 1, "rdma", "mlx5_0, mlx5_1", "m:1")
    assert (b.host, b.port, b.nics) == ("10.0.0.2", 12345, ("mlx5_0", "mlx5_1"))
    d = read_dict({"local_hostname": "localhost", "metadata_server": "P2PHANDSHAKE"})
    assert (d.segment_bytes, d.buffer_bytes, d.protocol) == (16 << 20, 16 << 20, "tcp")
    assert d.master == "tcp://127.0.0.1:50051"
    with pytest.raises(ValueError, match="metadata_server"):
        read_dict({"local_hostname": "localhost"})
    with pytest.raises(ValueError, match="protocol: expected one of tcp, rdma"):
        read_args("localhost", "P2PHANDSHAKE", 0, 0, "efa", "", "m:1")
    with pytest.raises(ValueError, match="master_server_addr"):
        read_args("localhost", "P2PHANDSHAKE", 0, 0, "tcp", "", "no-port")


def test_no_secret_is_refused_naming_the_variable() -> None:
    """Without a secret nothing starts: the error says which variable to set."""
    with pytest.raises(ConfigError, match="MOONCAKE_CLUSTER_SECRET"):
        cluster_secret({})
    assert cluster_secret({"MOONCAKE_CLUSTER_SECRET": "s" * 20}) == "s" * 20
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("MOONCAKE_CLUSTER_SECRET", raising=False)
        mp.delenv("MOONCAKE_CLUSTER_SECRET_FILE", raising=False)
        mp.delenv("MOONCAKE_CONFIG", raising=False)
        with pytest.raises(ConfigError, match="MOONCAKE_CLUSTER_SECRET"):
            MooncakeDistributedStore().setup("localhost", "P2PHANDSHAKE", 0, 0, "tcp", "", "h:1")


def test_codes_follow_upstreams_table() -> None:
    """Statuses and exceptions map onto docs/source/troubleshooting/error-code.md."""
    assert [code_of_status(s) for s in ("ok", "not_found", "exists", "no_space")] == [
        0,
        -704,
        -705,
        -200,
    ]
    assert [code_of_status(s) for s in ("busy", "leased", "error")] == [-703, -706, -600]
    assert code_of_put("exists") == code_of_put("busy") == 0  # upstream's Put semantics
    assert code_of(NotFoundError("x")) == ErrorCode.OBJECT_NOT_FOUND
    assert code_of(StatusError("x", "leased")) == -706
    down = StoreError("store master")
    down.__cause__ = RpcTimeout("no answer")
    assert code_of(down) == -900
    assert code_of(StoreError("every replica failed")) == code_of(TransferError("x")) == -800


def test_a_store_never_set_up_answers_with_codes() -> None:
    s = MooncakeDistributedStore()
    assert s.put("k", b"v") == -600 and s.get("k") == b"" and s.get_buffer("k") is None
    assert s.is_exist("k") == -1 and s.batch_is_exist(["a", "b"]) == [-1, -1]
    assert s.batch_put_from(["a"], [1], [1]) == [-600] and s.remove_all() == -1
    assert s.register_buffer(1, 1) == -600 and s.health_check() == 1
    assert s.get_hostname() == "" and s.close() == 0
    assert s.setup("localhost", "P2PHANDSHAKE", "50%", 0, "tcp", "", "h:1") == -600
    assert s.setup({"local_hostname": "localhost"}) == -600
    assert not hasattr(s, "setup_dummy") and not hasattr(s, "remove_by_regex")
