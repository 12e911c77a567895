"""Store client against a master and store nodes running as separate real processes."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from mooncake.errors import StoreError
from mooncake.store.client.client import NotFoundError, Store
from mooncake.store.metadata.objects import MAX_KEY_BYTES
from mooncake.transfer.types import EngineOptions
from tests.store.cluster import SECRET, Child, start_master, start_node

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(60)]
MIB = 1 << 20


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[Child, list[Child]]]:
    master = start_master()
    nodes = [start_node(f"n{i}", master, 8 * MIB) for i in range(2)]
    yield master, nodes
    for c in [*nodes, master]:
        c.stop()


def _connect(master: Child, protocol: str = "auto") -> Store:
    opts = EngineOptions(protocol=protocol, timeout_s=5.0)  # type: ignore[arg-type]
    return Store.connect(master.address, SECRET, timeout_s=5.0, engine_options=opts)


@pytest.mark.parametrize("protocol", ["tcp", "shm"])
def test_put_get_round_trip_is_byte_exact(
    cluster: tuple[Child, list[Child]], protocol: str
) -> None:
    """Values of odd sizes come back byte for byte over tcp and over same-host shm."""
    master, nodes = cluster
    with _connect(master, "auto" if protocol == "shm" else "tcp") as store:
        segment = f"n0.dram@{nodes[0].address}"
        assert store.engine.resolve(segment).transport.name == protocol
        for size in (1, 4096, MIB + 3):
            value = os.urandom(size)
            key = f"{protocol}-{size}"
            store.put(key, value)
            assert store.exists(key)
            assert store.get(key) == value
            store.remove(key)
            assert not store.exists(key)


def test_zero_copy_put_from_get_into(cluster: tuple[Child, list[Child]]) -> None:
    """put_from/get_into move bytes between registered buffers without a staging copy."""
    master, _ = cluster
    with _connect(master, "tcp") as store:
        src = np.frombuffer(os.urandom(2 * MIB), dtype=np.uint8).copy()
        dst = np.zeros(2 * MIB, dtype=np.uint8)
        store.register_buffer("src", src)
        store.register_buffer("dst", dst)
        store.put_from("zc", "src", 100, MIB)
        assert store.get_into("zc", "dst", 7) == MIB
        assert bytes(dst[7 : 7 + MIB]) == bytes(src[100 : 100 + MIB])
        with pytest.raises(StoreError, match="buffer offers"):
            store.get_into("zc", "dst", 0, max_size=10)
        store.remove("zc")


def test_batches_answer_per_key(cluster: tuple[Child, list[Child]]) -> None:
    """A batch answers every key: the hits with their bytes, a miss as not_found."""
    master, _ = cluster
    with _connect(master) as store:
        values = [os.urandom(n) for n in (10, 5000, 70000)]
        keys = ["b0", "b1", "b2"]
        assert [r.status for r in store.put_batch(keys, values)] == ["ok"] * 3
        assert [r.status for r in store.put_batch(["b0"], [b"x"])] == ["exists"]
        got = store.get_batch([*keys, "missing"])
        assert [g.value for g in got[:3]] == values
        assert got[3].status == "not_found" and got[3].value is None
        with pytest.raises(NotFoundError):
            got[3].unwrap()
        assert store.exists_batch(["b1", "nope"]) == [True, False]
        assert [r.status for r in store.remove_batch(keys)] == ["ok"] * 3


def test_bad_requests_get_clear_errors_and_service_goes_on(
    cluster: tuple[Child, list[Child]],
) -> None:
    """Empty or oversized keys, empty or oversized values, misses and duplicates raise a
    StoreError that says what is wrong; the master keeps serving afterwards."""
    master, _ = cluster
    with _connect(master) as store:
        with pytest.raises(StoreError, match="empty"):
            store.put("", b"x")
        with pytest.raises(StoreError, match="limit"):
            store.put("k" * (MAX_KEY_BYTES + 1), b"x")
        with pytest.raises(StoreError, match="1 byte"):
            store.put("empty", b"")
        with pytest.raises(StoreError, match="free bytes"):
            store.put("huge", bytes(9 * MIB))
        with pytest.raises(NotFoundError, match="not in the store"):
            store.get("never-put")
        store.put("dup", b"one")
        with pytest.raises(StoreError, match="already exists"):
            store.put("dup", b"two")
        store.put("dup", b"two", overwrite=True)
        assert store.get("dup") == b"two"
        store.remove("dup")


def test_two_replicas_survive_a_killed_node() -> None:
    """With replicas=2, killing one store node leaves every committed object readable."""
    master = start_master()
    nodes = [start_node(f"k{i}", master, 4 * MIB) for i in range(2)]
    try:
        with _connect(master, "tcp") as store:
            values = {f"r{i}": os.urandom(1000 + 997 * i) for i in range(20)}
            for k, v in values.items():
                store.put(k, v, replicas=2)
            nodes[0].kill()
            for k, v in values.items():
                assert store.get(k) == v
            assert [g.value for g in store.get_batch(list(values))] == list(values.values())
    finally:
        for c in [*nodes, master]:
            c.stop()


def test_node_killed_during_gets_never_hangs_or_corrupts() -> None:
    """While gets of a 2-replica object run, one store node dies: each get returns the
    exact bytes or raises StoreError, and none outlives its timeout."""
    master = start_master()
    nodes = [start_node(f"d{i}", master, 16 * MIB) for i in range(2)]
    outcomes: list[str] = []
    try:
        with _connect(master, "tcp") as store:
            value = os.urandom(4 * MIB)
            store.put("big", value, replicas=2)

            def reader() -> None:
                for _ in range(15):
                    try:
                        outcomes.append("ok" if store.get("big") == value else "corrupt")
                    except StoreError:
                        outcomes.append("error")

            t = threading.Thread(target=reader)
            t.start()
            nodes[1].kill()
            t.join(timeout=40)
            assert not t.is_alive(), "a get hung past its timeout"
            assert "corrupt" not in outcomes and len(outcomes) == 15
            assert store.get("big") == value  # the survivor still serves it
    finally:
        for c in [*nodes, master]:
            c.stop()


def _where(store: Store, key: str) -> list[str]:
    """The nodes the master lists for `key` (a read: it leases the object)."""
    from mooncake.store.server import messages as m

    reply = store._call(m.GetReplicasMsg(key), m.GetReplicasReplyMsg)
    return [d.node_id for d in reply.result.replicas]


def test_a_put_into_its_writers_full_memory_stays_there_and_its_oldest_moves() -> None:
    """Node w0 is full and the pool's oldest value is on w1: w0's put lands on w0, and
    w0's own oldest value, relocated by the master to where the pool's oldest was, is
    copied there by the writer first: every value left reads back byte for byte."""
    master = start_master()
    nodes = [start_node(f"w{i}", master, 64 * 1024) for i in range(2)]
    try:
        conn = {
            name: Store.connect(
                master.address, SECRET, node_id=name, timeout_s=5.0, reuse_grants=False
            )
            for name in ("w0", "w1")
        }
        values = {f"k{i}": os.urandom(16000) for i in range(11)}
        for i in range(4):
            conn["w1"].put(f"k{i}", values[f"k{i}"])  # the pool's oldest, on w1
        for i in range(4, 8):
            conn["w0"].put(f"k{i}", values[f"k{i}"])
        conn["w0"].put("k8", values["k8"])  # the pool is full
        assert _where(conn["w0"], "k8") == ["w0"]
        assert _where(conn["w0"], "k4") == ["w1"]  # w0's oldest took k0's place
        results = conn["w0"].put_batch(["k9", "k10"], [values["k9"], values["k10"]])
        assert [r.status for r in results] == ["ok", "ok"]
        assert _where(conn["w0"], "k10") == ["w0"] and _where(conn["w0"], "k6") == ["w1"]
        assert not any(conn["w0"].exists_batch(["k0", "k1", "k2"]))
        for i in range(3, 11):
            assert conn["w0"].get(f"k{i}") == values[f"k{i}"], i
        for store in conn.values():
            store.close()
    finally:
        for c in [*nodes, master]:
            c.stop()


def test_a_put_into_full_dram_waits_for_the_demotions_that_free_room(tmp_path: Path) -> None:
    """DRAM full of last copies, no copies ahead, an SSD tier below: the master answers a
    DRAM-only put "no room, but on its way" while it demotes (a store node carries the
    copies out on its heartbeats); the put asks again until it gets room, then every value
    reads back byte for byte (the oldest from SSD)."""
    wm = {"high_watermark": 1.0, "low_watermark": 0.5, "copy_ahead_watermark": 1.0}
    master = start_master(**wm)
    node = start_node("s0", master, 64 * 1024, str(tmp_path), str(1 << 20))
    try:
        with Store.connect(
            master.address, SECRET, timeout_s=5.0, reuse_grants=False, put_wait_s=60.0
        ) as store:
            values = {f"k{i}": os.urandom(16000) for i in range(5)}
            for key, value in values.items():  # the fifth finds DRAM full
                store.put(key, value)
            for key, value in values.items():
                assert store.get(key) == value, key
    finally:
        for c in (node, master):
            c.stop()
