"""A get on a hint (store/client/grants.py, Store._get): the client reads where it last knew the
value to be while it asks the master, and keeps the bytes only if the master still lists
that very replica. Real processes; the point is that a moved, replaced or removed value
is never returned from its old place."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest

from mooncake.store.client.client import NotFoundError, Store
from mooncake.transfer.types import EngineOptions
from tests.store.cluster import SECRET, Child, start_master, start_node

pytestmark = pytest.mark.cluster

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
def test_a_removed_value_is_not_found_and_later_gets_still_overlap(cluster: Child) -> None:
    with _connect(cluster) as writer, _connect(cluster) as other:
        value = os.urandom(4096)
        for key in ("gone", "kept", "kept2"):
            writer.put(key, value)
        other.remove("gone")
        with pytest.raises(NotFoundError):
            writer.get("gone")  # its bytes still sit at the hinted place
        buf = bytearray(4096)
        writer.register_buffer("buf", buf)
        with pytest.raises(NotFoundError):
            writer.get_into("gone", "buf", 0)
        assert writer.locations is not None and writer.locations.num_overlapped == 0
        # the abandoned reads closed their connection: the next get connects again...
        assert writer.get("kept") == value
        # ...after which hinted reads overlap again, the stale replies never taken
        assert writer.get("kept2") == value and writer.locations.num_overlapped >= 1


@pytest.mark.timeout(60)
def test_a_hint_on_a_hung_node_is_abandoned_not_waited_for() -> None:
    """The node a hint points at hangs (SIGSTOP: its kernel still accepts bytes, nothing
    answers). Once the master has dropped that node, a get reads the other replica at
    once: the hinted read is abandoned, not waited for until the socket's timeout."""
    master = start_master(lease_ttl_s=0.2)
    nodes = {n: start_node(n, master, 1 << 20) for n in ("h0", "h1")}
    opts = EngineOptions(protocol="tcp", timeout_s=30.0)  # a socket may stall 7.5 s
    hung = None
    try:
        with Store.connect(master.address, SECRET, timeout_s=30.0, engine_options=opts) as w:
            value = os.urandom(4096)
            w.put("k", value, replicas=2)
            assert w.locations is not None
            hint = w.locations.guess("k")
            assert hint is not None
            hung = nodes[hint[0].node_id]
            os.kill(hung.proc.pid, signal.SIGSTOP)
            deadline = time.monotonic() + 20
            while hint[0].node_id in {d.node_id for d in w._get_replicas("k").replicas}:
                assert time.monotonic() < deadline, "the master never dropped the hung node"
                time.sleep(0.2)  # heartbeat_ttl_s is 1 s
            started = time.monotonic()
            assert w.get("k") == value
            assert time.monotonic() - started < opts.slice_io_timeout_s / 2
    finally:
        if hung is not None:
            os.kill(hung.proc.pid, signal.SIGCONT)
        for c in [*nodes.values(), master]:
            c.stop()
