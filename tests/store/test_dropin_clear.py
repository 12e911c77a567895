"""MooncakeDistributedStore.batch_replica_clear, the client's name and teardown, against a
real master (a child process), from upstream's sources: BatchReplicaClear in
docs/source/api-reference/cpp/mooncake-store.md and mooncake-store/src/master_service.cpp
(only the caller's objects, only once their lease has expired, every replica or those on
one segment; the keys cleared are returned), RealClient::setup_internal in
mooncake-store/src/real_client.cpp (a port in local_hostname names the client, bound only
with MC_LEGACY_RPC_PORT_BINDING) and its ResourceTracker (clients torn down at exit)."""

from __future__ import annotations

import gc
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from mooncake.store import MooncakeDistributedStore, ReplicateConfig
from mooncake.store.server import messages as m
from tests.store.cluster import SECRET
from tests.store.dropin import LEASE_S, MIB, client, master, secret_env

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def stores() -> Iterator[tuple[str, dict[str, MooncakeDistributedStore]]]:
    """Two clients giving the pool memory (`a`, `c`) and one giving none (`b`)."""
    with secret_env(), master() as addr:
        clients = {"a": client(addr, 32 * MIB), "b": client(addr, 0), "c": client(addr, 32 * MIB)}
        yield addr, clients
        for s in clients.values():
            assert s.close() == 0


def _past_lease() -> None:
    time.sleep(LEASE_S + 0.3)  # NOTE: the reads below granted leases of LEASE_S


def _segments(store: MooncakeDistributedStore) -> int:
    """Segments the master has mounted, as its stats count them."""
    assert store._store is not None
    return store._store.master.call(m.StatsMsg(), m.StatsReplyMsg).stats.num_segments


def test_clear_skips_leased_foreign_and_missing_keys_then_clears(stores) -> None:
    _, s = stores
    two = ReplicateConfig()
    two.replica_num = 2
    assert s["a"].batch_replica_clear([]) == []
    assert s["a"].put("clr-own", b"mine") == 0 and s["a"].put("clr-both", b"x", two) == 0
    assert s["c"].put("clr-other", b"theirs") == 0
    assert s["a"].put("clr-kept", b"keep") == 0
    # a read leases each object: nothing is cleared while a reader may be copying it
    for key in ("clr-own", "clr-both", "clr-other", "clr-kept"):
        assert s["b"].get(key) != b""
    assert s["a"].batch_replica_clear(["clr-own", "clr-both"]) == []
    _past_lease()
    keys = ["clr-missing", "", "clr-other", "clr-own", "clr-both"]
    # another client's object and a missing or empty key are skipped; order kept
    assert s["a"].batch_replica_clear(keys) == ["clr-own", "clr-both"]
    assert s["b"].get("clr-own") == b"" and s["b"].is_exist("clr-both") == 0
    assert s["b"].get("clr-other") == b"theirs" and s["b"].get("clr-kept") == b"keep"


def test_clear_on_one_segment_keeps_the_other_replica(stores) -> None:
    _, s = stores
    two = ReplicateConfig()
    two.replica_num = 2
    assert s["a"].put("clr-seg", b"replicated", two) == 0
    assert len(s["a"].get_replica_desc("clr-seg")) == 2  # NOTE: a lookup leases it
    _past_lease()
    assert s["a"].batch_replica_clear(["clr-seg"], segment_name="nowhere:99999") == []
    assert s["a"].batch_replica_clear(["clr-seg"], segment_name=s["a"].get_hostname()) == [
        "clr-seg"
    ]
    [left] = s["b"].get_replica_desc("clr-seg")
    assert left.get_memory_descriptor().buffer_descriptor.transport_endpoint != ""
    assert s["c"].get("clr-seg") == b"replicated"
    _past_lease()
    # the last replica, named by its endpoint as get_replica_desc reports it: the object goes
    endpoint = left.get_memory_descriptor().buffer_descriptor.transport_endpoint
    assert s["a"].batch_replica_clear(["clr-seg"], segment_name=endpoint) == ["clr-seg"]
    assert s["b"].is_exist("clr-seg") == 0


def test_clear_before_setup_answers_nothing() -> None:
    assert MooncakeDistributedStore().batch_replica_clear(["k"]) == []


def test_a_port_in_local_hostname_names_the_client(stores) -> None:
    """The port given is the client's name (get_hostname), not bound: two clients may
    share it, as upstream's do; MC_LEGACY_RPC_PORT_BINDING binds it (and fails if taken)."""
    addr, _ = stores
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        named = MooncakeDistributedStore()
        with secret_env():
            assert named.setup(f"localhost:{port}", "P2PHANDSHAKE", 0, MIB, "tcp", "", addr) == 0
        try:
            assert named.get_hostname() == f"localhost:{port}"
            assert named.put("named", b"v") == 0 and named.get("named") == b"v"
        finally:
            assert named.close() == 0
        legacy = MooncakeDistributedStore()
        with secret_env(), pytest.MonkeyPatch.context() as mp:
            mp.setenv("MC_LEGACY_RPC_PORT_BINDING", "1")
            rc = legacy.setup(f"localhost:{port}", "P2PHANDSHAKE", 0, MIB, "tcp", "", addr)
        assert rc == -600 and legacy.get_hostname() == ""


CHILD = """
import sys
from mooncake.store import MooncakeDistributedStore
s = MooncakeDistributedStore()
assert s.setup("localhost", "P2PHANDSHAKE", 16 << 20, 1 << 20, "tcp", "", sys.argv[1]) == 0
print("set up", flush=True)
"""


def test_a_store_never_closed_leaves_the_master_when_collected_or_at_exit(stores) -> None:
    """Upstream tears its clients down in their destructor and at exit: the segment goes
    from the master then, not after the heartbeat timeout."""
    addr, s = stores
    before = _segments(s["a"])
    dropped = client(addr, 16 * MIB)
    assert _segments(s["a"]) == before + 1
    del dropped
    gc.collect()
    assert _segments(s["a"]) == before
    env = {"MOONCAKE_CLUSTER_SECRET": SECRET, "PYTHONPATH": ":".join(sys.path)}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, addr], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and "set up" in out.stdout, out.stderr
    assert _segments(s["a"]) == before  # NOTE: the heartbeat timeout (5 s) has not passed
