"""Values in etcd that no master wrote (someone who can write etcd, here with its root
password, to test the seal apart from etcd's auth) are never trusted: a forged leader record
names no leader and the leader keeps leading; forged pool entries are left out and reported
(mooncake/ha/sealed.py, election.py, journal.py, on a real etcd)."""

from __future__ import annotations

import logging
import threading
import time

import msgspec
import pytest

from mooncake.ha.election import Election, MasterInfo, leader_key
from mooncake.ha.etcd import Etcd, KeyValue
from mooncake.ha.journal import EtcdJournal
from mooncake.ha.sealed import ForgedRecord, Sealer
from mooncake.store.metadata.service import MetadataService
from tests.ha.conftest import SECRET
from tests.store.helpers import make_service, put

PREFIX = "/test/forged"
EVIL = MasterInfo(id="evil", rpc="127.0.0.1:1", api="http://127.0.0.1:1", pid=1)


def _election(
    etcd: Etcd, name: str, ttl_s: float = 1.0
) -> tuple[Election, threading.Event, list[str]]:
    """NOTE: a leader reads its key only when a read that takes all of the client's timeout
    leaves its step-down on time: a client with a short one."""
    etcd = Etcd(etcd.endpoints, timeout_s=0.3, access=etcd.access)
    elected, lost = threading.Event(), []
    me = MasterInfo(id=name, rpc=f"127.0.0.1:{len(name)}", api=f"http://{name}", pid=1)
    e = Election(etcd, PREFIX, me, ttl_s, 0.05, elected.set, lost.append, Sealer(SECRET))
    e.start()
    return e, elected, lost


FORGERIES = {
    "unsealed": msgspec.json.encode(EVIL),
    "sealed with another secret": Sealer(b"not-this-cluster's-secret").seal(
        leader_key(PREFIX), msgspec.json.encode(EVIL)
    ),
}


@pytest.mark.cluster
@pytest.mark.parametrize("forgery", FORGERIES, ids=list(FORGERIES))
def test_a_forged_leader_record_names_no_leader_and_the_leader_puts_its_own_back(
    etcd: Etcd, forgery: str, caplog: pytest.LogCaptureFixture
):
    a, won_a, lost = _election(etcd, "a")
    assert won_a.wait(5)
    b, won_b, _ = _election(etcd, "b")
    time.sleep(0.3)
    assert b.leader is not None and b.leader.id == "a"
    seen: set[str] = set()
    etcd.put(leader_key(PREFIX), FORGERIES[forgery])  # NOTE: no lease, as in the finding
    deadline = time.monotonic() + 3 * a.ttl_s
    while time.monotonic() < deadline:  # the standby's view, as its forwarder reads it
        seen.add(b.leader.id if b.leader else "none")
        time.sleep(0.005)
    assert "evil" not in seen and b.leader is not None and b.leader.id == "a"
    assert a.is_leader and not lost and not won_b.is_set()
    kv = etcd.get(leader_key(PREFIX))
    assert kv is not None and kv.value == a.value and kv.lease == a.lease
    assert "forged leader record" in caplog.text and "put its leader record back" in caplog.text
    b.stop()
    a.stop()


@pytest.mark.cluster
def test_a_journal_write_fenced_out_by_a_forged_leader_record_reclaims_it(etcd: Etcd):
    a, won_a, lost = _election(etcd, "a", ttl_s=5.0)
    assert won_a.wait(5)
    a._stop.set()  # NOTE: its loop would reclaim the key first; the journal must on its own
    a._thread.join()
    journal = EtcdJournal(etcd, PREFIX, a.key, a.value, a.sealer, a.reclaim)
    svc = make_service({"n": {"dram": 4096}})
    assert put(svc, "k0", 100) == "ok"
    etcd.put(leader_key(PREFIX), msgspec.json.encode(EVIL))
    journal.write(svc.pool.drain_changes())
    assert etcd.get(leader_key(PREFIX)).value == a.value  # type: ignore[union-attr]
    assert [o.key for o in journal.load().objects] == ["k0"]
    etcd.revoke(a.lease)


@pytest.mark.cluster
def test_a_forged_leader_record_nobody_reclaims_gives_way_to_a_standby(etcd: Etcd):
    a, won_a, _ = _election(etcd, "a")
    assert won_a.wait(5)
    b, won_b, _ = _election(etcd, "b")
    a._stop.set()  # NOTE: a dies without giving its lease back, and a forgery takes its key
    a._thread.join()
    etcd.put(leader_key(PREFIX), msgspec.json.encode(EVIL))
    assert won_b.wait(10), "a forged record with no lease blocked the election"
    kv = etcd.get(leader_key(PREFIX))
    assert kv is not None and kv.value == b.value
    b.stop()


@pytest.mark.cluster
def test_forged_pool_entries_are_left_out_and_reported(
    etcd: Etcd, caplog: pytest.LogCaptureFixture
):
    a, won_a, _ = _election(etcd, "a")
    assert won_a.wait(5)
    journal = EtcdJournal(etcd, PREFIX, a.key, a.value, a.sealer, a.reclaim)
    svc = make_service({"n": {"dram": 4096}})
    for i in range(3):
        assert put(svc, f"k{i}", 100) == "ok"
    journal.write(svc.pool.drain_changes())
    genuine = etcd.get(f"{PREFIX}/pool/o/k0")
    assert genuine is not None
    etcd.put(f"{PREFIX}/pool/o/garbage", b"\xff not msgpack")
    etcd.put(f"{PREFIX}/pool/o/copy", genuine.value)  # NOTE: a genuine entry, at another key
    etcd.put(f"{PREFIX}/pool/o/k1", Sealer(b"another cluster's secret").seal("k1", b"x"))
    with caplog.at_level(logging.CRITICAL):
        state = journal.load()
    assert sorted(o.key for o in state.objects) == ["k0", "k2"]
    assert "left out 3 etcd entries no master of this cluster wrote" in caplog.text
    assert f"{PREFIX}/pool/o/garbage" in caplog.text and f"{PREFIX}/pool/o/copy" in caplog.text
    fresh = MetadataService()
    assert fresh.restore(state, now=50.0) == 2
    fresh.check_integrity()
    a.stop()


def test_a_sealed_value_opens_only_at_its_key_and_lease():
    sealer = Sealer(SECRET)
    value = sealer.seal("/k", b"payload", lease=7)
    assert sealer.open(KeyValue("/k", value, 1, 7)) == b"payload"
    for kv in (KeyValue("/other", value, 1, 7), KeyValue("/k", value, 1, 0)):
        with pytest.raises(ForgedRecord, match="does not match this cluster's secret"):
            sealer.open(kv)
    with pytest.raises(ForgedRecord, match="no master of this cluster wrote"):
        sealer.open(KeyValue("/k", b"{}", 1, 0))
