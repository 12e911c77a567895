"""The pool's committed state: what changes are journaled, and a rebuild from the journal
that gives back the same objects, ranges and replica ids (store/metadata/poolstate.py,
journal.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mooncake.rpc import RpcClient
from mooncake.store.metadata.allocator import OffsetAllocator
from mooncake.store.metadata.journal import FileJournal, JournalError
from mooncake.store.metadata.service import MetadataService
from mooncake.store.metadata.settings import MetadataConfig
from mooncake.store.server import messages as m
from mooncake.store.server.service import StoreService
from tests.store.helpers import make_service, put


def _journaled(svc: MetadataService, journal: FileJournal) -> None:
    changes = svc.pool.drain_changes()
    if changes:
        journal.write(changes)


def _view(svc: MetadataService) -> dict[str, list[tuple[str, int, int, int]]]:
    """key -> its committed replicas (segment, offset, size, replica id)."""
    return {
        k: sorted((r.segment.name, r.offset, r.size, r.replica_id) for r in o.complete())
        for k, o in svc.objects.items()
        if o.is_committed
    }


def test_allocate_at_takes_exactly_a_free_range_and_nothing_else():
    a = OffsetAllocator(1024, 64)
    assert a.allocate_at(128, 100)  # 128 bytes taken: [128, 256)
    assert a.size_of(128) == 128
    assert not a.allocate_at(192, 64)  # inside the first
    assert not a.allocate_at(100, 64)  # unaligned
    assert not a.allocate_at(960, 128)  # past the end
    assert a.allocate_at(0, 128) and a.allocate_at(960, 64)
    assert a.allocate(64) == 256  # best fit: the only free block starts at 256
    a.check_integrity()


def test_changes_name_every_commit_removal_and_segment(tmp_path: Path):
    svc = make_service({"a": {"dram": 1024}})
    changes = svc.pool.drain_changes()
    assert list(changes.segments) == ["a-dram"] and not changes.objects
    svc.writes.put_start("k", 100, 0.0, writer="a")
    assert not svc.pool.drain_changes()  # NOTE: an uncommitted put is never journaled
    svc.writes.put_end("k", 0.0)
    changes = svc.pool.drain_changes()
    entry = changes.objects["k"]
    assert entry is not None and entry.replicas[0].offset == 0 and entry.size == 100
    assert svc.remove("k", 1.0).status == "ok"
    assert svc.pool.drain_changes().objects == {"k": None}


def test_restore_from_the_file_journal_gives_the_same_objects_ranges_and_ids(tmp_path: Path):
    path = tmp_path / "pool.journal"
    journal = FileJournal(path)
    journal.load()
    svc = make_service({"a": {"dram": 4096}, "b": {"dram": 4096}}, replicas=2)
    for i in range(6):
        assert put(svc, f"k{i}", 100 + i) == "ok"
        _journaled(svc, journal)
    svc.writes.put_start("open", 64, 0.0, writer="a")  # never committed: lost in the rebuild
    assert svc.remove("k2", 1.0).status == "ok"
    _journaled(svc, journal)
    journal.close()
    before = _view(svc)

    fresh = MetadataService(MetadataConfig(replicas=2, lease_ttl_s=5.0))
    again = FileJournal(path)
    assert fresh.restore(again.load(), now=100.0) == 5
    fresh.check_integrity()
    assert _view(fresh) == before and "open" not in fresh.objects
    assert fresh.pool.snapshot() == svc.pool.snapshot()
    got = fresh.get_replicas("k0", 100.0)
    assert got.status == "ok" and {d.replica_id for d in got.replicas} == {
        r[3] for r in before["k0"]
    }
    events = {(e.kind, e.key, e.node_id) for e in fresh.pool.drain_events()}
    assert ("added", "k3", "a") in events and ("added", "k3", "b") in events
    # the old master's writers may still write ranges it never journaled, for a lease
    # (5 s): no new allocation there before then
    assert fresh.writes.put_start("new", 64, 104.0, writer="a").status == "no_space"
    assert fresh.writes.put_start("new", 64, 106.0, writer="a").status == "ok"
    fresh.check_integrity()
    # and the rebuilt objects are leased as long: not removable at once
    assert fresh.remove("k0", 101.0).status == "leased"


def test_a_torn_last_batch_is_ignored_and_the_journal_compacts(tmp_path: Path):
    path = tmp_path / "pool.journal"
    journal = FileJournal(path)
    journal.load()
    svc = make_service({"a": {"dram": 4096}})
    assert put(svc, "k", 100) == "ok"
    _journaled(svc, journal)
    journal.close()
    with path.open("ab") as f:
        f.write(b"\x40\x00\x00\x00partial")  # a batch of 64 bytes, cut short
    state = FileJournal(path).load()
    assert [o.key for o in state.objects] == ["k"] and len(state.segments) == 1


SECRET = b"journal-test-secret-0123456789abcdef"


def test_a_put_answered_ok_is_in_the_journal_and_a_restarted_service_serves_it(tmp_path: Path):
    path = tmp_path / "pool.journal"
    with StoreService(SECRET, MetadataConfig(), journal=FileJournal(path)) as svc:
        client = RpcClient(svc.address, SECRET, timeout_s=5.0)
        mount = m.MountSegmentMsg("n", "n.dram", "dram", 1 << 20, "127.0.0.1:1", 64, 7)
        client.call(mount, m.AckMsg)
        start = client.call(m.PutStartMsg("k", 1000, "n"), m.PutStartReplyMsg).result
        assert start.status == "ok"
        assert client.call(m.PutEndMsg("k"), m.KeyReplyMsg).result.status == "ok"
        # NOTE: read (a copy: load compacts) while the service runs: answered ok means
        # journaled already
        copy = tmp_path / "copy.journal"
        copy.write_bytes(path.read_bytes())
        state = FileJournal(copy).load()
        assert [(o.key, o.replicas[0].replica_id) for o in state.objects] == [
            ("k", start.replicas[0].replica_id)
        ]
        client.close()
    restarted = StoreService(SECRET, MetadataConfig(), journal=FileJournal(path))
    with restarted:
        client = RpcClient(restarted.address, SECRET, timeout_s=5.0)
        got = client.call(m.GetReplicasMsg("k"), m.GetReplicasReplyMsg).result
        assert got.status == "ok" and got.replicas[0].replica_id == start.replicas[0].replica_id
        assert got.replicas[0].token == 7 and got.replicas[0].endpoint == "127.0.0.1:1"
        assert restarted.restore() == 0  # NOTE: start restored it, once
        client.close()


def test_an_unreadable_journal_is_a_clear_error(tmp_path: Path):
    (tmp_path / "file").write_text("not a directory")
    svc = StoreService(SECRET, MetadataConfig(), journal=FileJournal(tmp_path / "file" / "j"))
    with pytest.raises(JournalError, match="cannot read the pool journal"):
        svc.restore()
