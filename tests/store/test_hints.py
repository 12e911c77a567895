"""A get on a hint (store/grants.py, Store._get): the client reads where it last knew the
value to be while it asks the master, and keeps the bytes only if the master still lists
that very replica. Real processes; the point is that a moved, replaced or removed value
is never returned from its old place."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from mooncake.store.client import NotFoundError, Store
from mooncake.transfer.types import EngineOptions
from tests.store.cluster import SECRET, Child, start_master, start_node

OPTS = EngineOptions(protocol="tcp", timeout_s=5.0)


@pytest.fixture
def cluster() -> Iterator[Child]:
    master = start_master(lease_ttl_s=0.2)
    node = start_node("n0", master, 1 << 20)
    try:
        yield master
    finally:
        node.stop()
        master.stop()


def _connect(master: Child, **kw: object) -> Store:
    return Store.connect(master.address, SECRET, timeout_s=5.0, engine_options=OPTS, **kw)  # type: ignore[arg-type]


@pytest.mark.timeout(60)
def test_the_writer_reads_its_own_values_on_hints_and_others_ask_first(cluster: Child) -> None:
    with _connect(cluster) as writer, _connect(cluster) as other:
        values = {f"k{i}": os.urandom(4096) for i in range(6)}
        for k, v in values.items():
            writer.put(k, v)
        assert writer.locations is not None and other.locations is not None
        assert all(writer.get(k) == v for k, v in values.items())
        assert writer.locations.num_overlapped == len(values)
        assert all(other.get(k) == v for k, v in values.items())
        assert other.locations.num_overlapped == 0  # it knew nothing: lookup, then read


@pytest.mark.timeout(60)
def test_a_replaced_value_is_read_anew_even_at_the_same_offset(cluster: Child) -> None:
    with _connect(cluster) as writer, _connect(cluster, reuse_grants=False) as other:
        old, new = os.urandom(4096), os.urandom(4096)
        writer.put("k", old)
        assert writer.locations is not None
        hint = writer.locations.guess("k")
        assert hint is not None
        other.remove("k")
        other.put("k", new)  # best fit: into the very range just freed
        now = other._get_replicas("k").replicas[0]
        assert (now.segment, now.offset) == (hint[0].segment, hint[0].offset)
        assert now.replica_id != hint[0].replica_id  # a new allocation, a new id
        assert writer.get("k") == new  # the hinted read got the new bytes, but was not kept
        assert writer.locations.num_overlapped == 0


@pytest.mark.timeout(60)
def test_a_range_reused_by_another_key_is_never_returned(cluster: Child) -> None:
    with _connect(cluster) as writer, _connect(cluster, reuse_grants=False) as other:
        mine, theirs, again = os.urandom(4096), os.urandom(4096), os.urandom(4096)
        writer.put("a", mine)
        assert writer.locations is not None
        hint = writer.locations.guess("a")
        assert hint is not None
        other.remove("a")
        other.put("b", theirs)  # into the range "a" had
        other.put("a", again)  # elsewhere
        b = other._get_replicas("b").replicas[0]
        assert (b.segment, b.offset) == (hint[0].segment, hint[0].offset)
        assert writer.get("a") == again
        assert writer.locations.num_overlapped == 0


@pytest.mark.timeout(60)
def test_a_removed_value_is_not_found_and_the_connection_stays_usable(cluster: Child) -> None:
    with _connect(cluster) as writer, _connect(cluster) as other:
        value = os.urandom(4096)
        writer.put("gone", value)
        writer.put("kept", value[::-1])
        other.remove("gone")
        with pytest.raises(NotFoundError):
            writer.get("gone")  # its bytes still sit at the hinted place
        buf = bytearray(4096)
        writer.register_buffer("buf", buf)
        with pytest.raises(NotFoundError):
            writer.get_into("gone", "buf", 0)
        assert writer.get("kept") == value[::-1]  # the hinted read's reply was collected
        assert writer.locations is not None and writer.locations.num_overlapped == 1
