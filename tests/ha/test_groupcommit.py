"""Group commit to a real etcd (store/metadata/groupcommit.py, ha/journal.py): many clients
committing at once, all acknowledged puts present after a restart; a group written after
losing the leadership fails for every call in it and every later one, and etcd then holds
exactly what was acknowledged; groups stay within etcd's bounds; a call's ticket."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from mooncake.errors import MooncakeError
from mooncake.ha.etcd import MAX_TXN_OPS, Compare, Etcd, Put
from mooncake.ha.journal import EtcdJournal
from mooncake.ha.sealed import Sealer
from mooncake.store.metadata.groupcommit import GroupCommit, _added
from mooncake.store.metadata.journal import JournalError
from mooncake.store.metadata.poolstate import ObjectEntry, PoolChanges, ReplicaEntry
from mooncake.store.metadata.settings import MetadataConfig
from mooncake.store.server import messages as m
from mooncake.store.server.direct import DirectChannel
from mooncake.store.server.service import StoreService
from tests.ha.conftest import SECRET

PREFIX = "/test/groupcommit"
LEADER = f"{PREFIX}/leader"
ME, OTHER = b"this-master", b"another-master"
NUM_CLIENTS = 8
NUM_PUTS = 25  # per client


def _journal(etcd: Etcd) -> EtcdJournal:
    """A journal fenced on LEADER holding ME (as a leader's is), which reclaims nothing."""
    return EtcdJournal(etcd, PREFIX, LEADER, ME, Sealer(SECRET), lambda current: False)


@pytest.fixture
def leading(etcd: Etcd) -> Etcd:
    ok, _ = etcd.txn([Compare.absent(LEADER)], [Put(LEADER, ME)])
    assert ok
    return etcd


def _service(
    etcd: Etcd, errors: list[JournalError], journal: EtcdJournal | None = None
) -> StoreService:
    journal = journal or _journal(etcd)
    svc = StoreService(SECRET, MetadataConfig(replicas=1), journal=journal, tick_s=3600)
    svc.on_journal_error = errors.append
    svc.start()
    with svc.lock:
        svc.metadata.mount_segment("n", "n.dram", "dram", 1 << 24, time.monotonic(), "h:1", 64)
        ticket = svc.flush()
    svc.wait_durable(ticket)
    return svc


def _clients(svc: StoreService, flip: threading.Event | None = None) -> dict[str, str]:
    """NUM_CLIENTS threads, each on its own direct connection, put NUM_PUTS keys (stopping
    at the first failure); each key -> "ok" (put_end acknowledged) or "failed". With
    `flip`, set after half the puts of the first client."""
    outcome: dict[str, str] = {}

    def run(i: int) -> None:
        channel = DirectChannel("127.0.0.1", svc.direct_port, SECRET, timeout_s=30.0)
        try:
            for j in range(NUM_PUTS):
                if flip is not None and i == 0 and j == NUM_PUTS // 2:
                    flip.set()
                key = f"k{i}-{j}"
                try:
                    start = channel.call(m.PutStartMsg(key, 64, "w"), m.PutStartReplyMsg)
                    assert start.result.status == "ok", start
                    end = channel.call(m.PutEndMsg(key), m.KeyReplyMsg)
                    assert end.result.status == "ok", end
                    outcome[key] = "ok"
                except MooncakeError:
                    outcome[key] = "failed"
                    return
        finally:
            channel.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(NUM_CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcome


def _journaled_keys(etcd: Etcd) -> set[str]:
    return {o.key for o in _journal(etcd).load().objects}


@pytest.mark.cluster
def test_concurrent_commits_are_all_in_etcd_and_a_restarted_master_serves_them(leading: Etcd):
    errors: list[JournalError] = []
    svc = _service(leading, errors)
    try:
        outcome = _clients(svc)
        commits = svc.commits
        assert commits is not None and commits.error is None
        # NOTE: every put_end was one entry; the mount one more
        assert commits.num_entries == NUM_CLIENTS * NUM_PUTS + 1
        assert commits.num_groups <= commits.num_entries
    finally:
        svc.stop()
    assert set(outcome.values()) == {"ok"} and len(outcome) == NUM_CLIENTS * NUM_PUTS
    assert _journaled_keys(leading) == set(outcome) and not errors
    restarted = StoreService(SECRET, MetadataConfig(), journal=_journal(leading), tick_s=3600)
    with restarted, restarted.lock:
        now = time.monotonic()
        got = [restarted.metadata.get_replicas(k, now).status for k in outcome]
        restarted.metadata.check_integrity()
    assert got == ["ok"] * len(outcome)


@pytest.mark.cluster
def test_a_group_after_losing_the_leadership_fails_every_call_and_etcd_holds_what_was_acked(
    leading: Etcd,
):
    errors: list[JournalError] = []
    svc = _service(leading, errors)
    flip = threading.Event()

    def another_master_wins() -> None:
        flip.wait()
        leading.put(LEADER, OTHER)

    thief = threading.Thread(target=another_master_wins)
    thief.start()
    try:
        outcome = _clients(svc, flip)
        thief.join()
        assert svc.commits is not None and svc.commits.error is not None
        # NOTE: sticky: a call that changes nothing fails too (memory is ahead of etcd)
        channel = DirectChannel("127.0.0.1", svc.direct_port, SECRET, timeout_s=30.0)
        with pytest.raises(MooncakeError, match="no longer leads"):
            channel.call(m.RemoveMsg("k0-0"), m.KeyReplyMsg)
        channel.close()
    finally:
        svc.stop()
    acked = {k for k, v in outcome.items() if v == "ok"}
    failed = {k for k, v in outcome.items() if v == "failed"}
    assert len(failed) == NUM_CLIENTS  # NOTE: each client's first failure ends it
    # every acknowledged put is in etcd; besides them only puts whose call failed, from a
    # group that landed beside the failed one (an outcome a lost reply gives too)
    journaled = _journaled_keys(leading)
    assert acked and acked <= journaled and journaled - acked <= failed
    assert len(errors) == 1 and "no longer leads" in str(errors[0])


class _Gated(EtcdJournal):
    """An EtcdJournal whose first write waits for `gate`; records each write's keys."""

    def __init__(self, etcd: Etcd):
        super().__init__(etcd, PREFIX, LEADER, ME, Sealer(SECRET), lambda current: False)
        self.gate = threading.Event()
        self.entered = threading.Event()  # the first write waits at the gate
        self.writes: list[PoolChanges] = []

    def write(self, changes: PoolChanges) -> None:
        self.entered.set()
        self.gate.wait(30)
        self.writes.append(changes)
        super().write(changes)


def _entry(key: str, offset: int = 0) -> ObjectEntry:
    return ObjectEntry(
        key=key,
        size=64,
        replicas=(ReplicaEntry(segment="n.dram", offset=offset, size=64, replica_id=1),),
    )


class _Held(EtcdJournal):
    """An EtcdJournal whose writes of a group holding key "held" wait for `release`;
    records the keys of each write as it starts."""

    def __init__(self, etcd: Etcd):
        super().__init__(etcd, PREFIX, LEADER, ME, Sealer(SECRET), lambda current: False)
        self.release = threading.Event()
        self.started: list[set[str]] = []

    def write(self, changes: PoolChanges) -> None:
        self.started.append(set(changes.objects) | set(changes.segments))
        if "held" in changes.objects:
            self.release.wait(30)
        super().write(changes)


@pytest.mark.cluster
def test_independent_groups_land_beside_an_older_one_and_dependent_ones_wait_for_it(
    leading: Etcd,
):
    journal = _Held(leading)
    commits = GroupCommit(journal, max_in_flight=4)
    try:
        # a group in flight (held at etcd's door) that puts "held" and frees [64, 128)
        held = commits.submit(
            PoolChanges(objects={"held": _entry("held")}), frees=[("n.dram", 64, 128)]
        )
        while not journal.started:
            time.sleep(0.001)
        # independent of it: written beside it, in etcd, but durable for callers only after
        free = commits.submit(PoolChanges(objects={"free": _entry("free", offset=4096)}))
        deadline = time.monotonic() + 10
        while "free" not in _journaled_keys(leading) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _journaled_keys(leading) == {"free"}
        assert commits.durable_seq < held < free
        # dependent on it: the same key, a replica in the range it freed, a segment
        same_key = commits.submit(PoolChanges(objects={"held": None}))
        in_freed = commits.submit(PoolChanges(objects={"reuse": _entry("reuse", offset=64)}))
        segment = commits.submit(PoolChanges(segments={"n.ssd": None}))
        time.sleep(0.3)  # NOTE: room for a wrong writer to start them
        assert journal.started == [{"held"}, {"free"}]
        journal.release.set()
        commits.wait(segment)
        assert commits.durable_seq == segment > in_freed > same_key > free
        assert _journaled_keys(leading) == {"free", "reuse"}
        assert journal.started[:2] == [{"held"}, {"free"}]
        assert set().union(*journal.started[2:]) == {"held", "reuse", "n.ssd"}
        assert journal.started[-1] >= {"n.ssd"}  # a segment's group waits for every other
    finally:
        journal.release.set()
        commits.close()


@pytest.fixture
def gated(leading: Etcd) -> Iterator[_Gated]:
    journal = _Gated(leading)
    journal.load()
    yield journal
    journal.gate.set()


@pytest.mark.cluster
def test_groups_stay_within_etcds_ops_and_bytes_and_an_entry_over_them_goes_alone(
    gated: _Gated, leading: Etcd
):
    commits = GroupCommit(gated, max_in_flight=1)  # NOTE: the groups' shapes, one at a time
    first = commits.submit(PoolChanges(objects={"first": _entry("first")}))
    assert gated.entered.wait(30)  # NOTE: what follows queues behind it
    small = [commits.submit(PoolChanges(objects={f"s{i}": _entry(f"s{i}")})) for i in range(300)]
    big = commits.submit(PoolChanges(objects={f"b{i}": _entry(f"b{i}") for i in range(200)}))
    long_key = "x" * 8192  # NOTE: ~64 such keys fill max_group_bytes before 128 ops
    wide = [commits.submit(PoolChanges(objects={f"{long_key}{i}": None})) for i in range(150)]
    gated.gate.set()
    commits.wait(wide[-1])
    commits.close()
    assert commits.error is None and commits.durable_seq == wide[-1] > big > small[-1] > first
    for changes in gated.writes:
        ops, size = _added(PoolChanges(), changes)
        if len(changes.objects) != 200:  # NOTE: the big entry alone, split by the journal
            assert ops <= MAX_TXN_OPS and size <= gated.max_group_bytes, (ops, size)
    assert [len(c.objects) for c in gated.writes[:4]] == [1, 128, 128, 44]
    assert len(gated.writes[4].objects) == 200
    assert [len(c.objects) for c in gated.writes[5:]] == [63, 63, 24]
    keys = {o.key for o in gated.load().objects}
    assert keys == {"first", *(f"s{i}" for i in range(300)), *(f"b{i}" for i in range(200))}


@pytest.mark.cluster
def test_a_calls_ticket_covers_what_its_reply_tells_of(gated: _Gated):
    commits = GroupCommit(gated)
    t1 = commits.submit(PoolChanges(objects={"k": _entry("k")}))
    assert commits.submit(PoolChanges(), reads=["k"]) == t1  # a read of a queued commit
    assert commits.submit(PoolChanges(), reads=["other"]) == 0  # nothing of it queued
    assert commits.submit(PoolChanges(), reads=["other"], takes=[("seg", 0, 64)]) == 0
    t2 = commits.submit(PoolChanges(objects={"gone": None}), frees=[("seg", 64, 128)])
    t3 = commits.submit(PoolChanges(objects={"gone2": None}), frees=[("seg", 256, 320)])
    # a range handed out waits for the newest queued free it overlaps, and only for that
    assert commits.submit(PoolChanges(), reads=["other"], takes=[("seg", 96, 160)]) == t2
    assert commits.submit(PoolChanges(), reads=["other"], takes=[("seg", 0, 512)]) == t3
    assert commits.submit(PoolChanges(), reads=["other"], takes=[("seg", 128, 256)]) == 0
    assert commits.submit(PoolChanges(), reads=["other"], takes=[("seg2", 64, 128)]) == 0
    t4 = commits.submit(PoolChanges(segments={"seg2": None}), frees=[("seg2", 0, 1 << 64)])
    assert commits.submit(PoolChanges(), reads=[], takes=[("seg2", 1 << 40, 1 << 41)]) == t4
    assert commits.submit(PoolChanges()) == t4  # any other call: everything queued
    gated.gate.set()
    commits.wait(t4)
    assert commits.submit(PoolChanges(), reads=["k"], takes=[("seg", 0, 512)]) == 0  # durable
    commits.close()


@pytest.mark.cluster
def test_a_failed_group_fails_its_waiters_and_every_later_ticket(gated: _Gated, leading: Etcd):
    commits = GroupCommit(gated)
    t1 = commits.submit(PoolChanges(objects={"a": _entry("a")}))
    leading.put(LEADER, OTHER)
    gated.gate.set()
    with pytest.raises(JournalError, match="not journaled.*no longer leads"):
        commits.wait(t1)
    t2 = commits.submit(PoolChanges(objects={"b": _entry("b")}))
    with pytest.raises(JournalError):
        commits.wait(t2)
    commits.close()
    assert not {o.key for o in gated.load().objects}


@pytest.mark.cluster
def test_a_put_start_waits_for_a_queued_free_only_of_a_range_it_hands_out(gated: _Gated):
    gated.gate.set()
    svc = _service(gated.etcd, [], gated)
    channel = DirectChannel("127.0.0.1", svc.direct_port, SECRET, timeout_s=30.0)
    others = DirectChannel("127.0.0.1", svc.direct_port, SECRET, timeout_s=30.0)
    commits = svc.commits
    assert commits is not None

    def put_start(chan: DirectChannel, key: str, size: int) -> int:
        reply = chan.call(m.PutStartMsg(key, size, "w"), m.PutStartReplyMsg)
        assert reply.result.status == "ok", reply
        return reply.result.replicas[0].offset

    try:
        first = put_start(channel, "a", 64)
        channel.call(m.PutEndMsg("a"), m.KeyReplyMsg)
        put_start(channel, "b", 64)  # NOTE: keeps a's range a hole of its own when freed
        channel.call(m.PutEndMsg("b"), m.KeyReplyMsg)
        gated.gate.clear()
        removing = threading.Thread(
            target=lambda: others.call(m.RemoveMsg("a", force=True), m.KeyReplyMsg)
        )
        removing.start()
        while commits.last_seq == commits.durable_seq:  # the removal is queued, not durable
            time.sleep(0.01)
        assert put_start(channel, "far", 4096) != first  # not a freed range: no wait
        got: list[int] = []
        reusing = threading.Thread(target=lambda: got.append(put_start(channel, "c", 64)))
        reusing.start()
        reusing.join(0.5)
        assert reusing.is_alive() and removing.is_alive()  # a's range: waits for its free
        gated.gate.set()
        reusing.join(10)
        removing.join(10)
        assert got == [first]
    finally:
        gated.gate.set()
        channel.close()
        others.close()
        svc.stop()
