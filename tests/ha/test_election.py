"""Leader election and the fenced pool journal on a real etcd (mooncake/ha)."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator

import pytest

from mooncake.config.settings import ClusterConfig, Config
from mooncake.ha.election import Election, MasterInfo, find_masters, leader_key
from mooncake.ha.etcd import Etcd
from mooncake.ha.journal import EtcdJournal
from mooncake.ha.localetcd import LocalEtcd, etcd_binary
from mooncake.ha.sealed import Sealer
from mooncake.roles.node.common import masters_to_dial
from mooncake.store.metadata.journal import JournalError
from mooncake.store.metadata.service import MetadataService
from tests.ha.conftest import SECRET
from tests.store.helpers import make_service, put

pytestmark = pytest.mark.cluster

PREFIX = "/test/cluster"


_made: list[Election] = []  # every election a test made, stopped after it


@pytest.fixture(autouse=True)
def _stop_elections() -> Iterator[None]:
    """A failed test still stops its elections' threads (left running, they retry a
    stopped etcd and log into every later test's output)."""
    yield
    while _made:
        _crash(_made.pop())


def _election(etcd: Etcd, name: str, elected: threading.Event, lost: list[str]) -> Election:
    me = MasterInfo(id=name, rpc=f"127.0.0.1:{len(name)}", api=f"http://{name}", pid=1)
    election = Election(
        etcd,
        PREFIX,
        me,
        ttl_s=1.0,
        poll_s=0.05,
        on_elected=elected.set,
        on_lost=lost.append,
        sealer=Sealer(SECRET),
    )
    _made.append(election)
    return election


def _journal(etcd: Etcd, e: Election) -> EtcdJournal:
    return EtcdJournal(etcd, PREFIX, e.key, e.value, e.sealer, e.reclaim)


def _crash(e: Election) -> None:
    """Stop renewing without giving the lease back: what a killed master does."""
    e._stop.set()
    if e._thread.is_alive():
        e._thread.join()


def test_one_master_leads_and_a_standby_takes_over_when_its_lease_runs_out(etcd: Etcd):
    won_a, won_b, lost = threading.Event(), threading.Event(), []
    a = _election(etcd, "a", won_a, lost)
    a.start()
    assert won_a.wait(5)
    b = _election(etcd, "b", won_b, lost)
    b.start()
    deadline = time.monotonic() + 10  # NOTE: b's first poll of the leader key, under load
    while b.leader is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not won_b.is_set() and b.leader is not None and b.leader.id == "a"
    assert [m.id for m in b.members()] == ["a", "b"]
    _crash(a)
    t0 = time.monotonic()
    assert won_b.wait(10), "the standby never took over"
    print(f"standby leads {time.monotonic() - t0:.2f} s after the leader stopped renewing")
    assert b.is_leader and not lost
    b.stop()
    assert etcd.get(leader_key(PREFIX)) is None  # NOTE: a clean stop gives leadership back


def test_the_journal_refuses_writes_from_a_master_that_no_longer_leads(etcd: Etcd):
    won_a, won_b, lost = threading.Event(), threading.Event(), []
    a = _election(etcd, "a", won_a, lost)
    a.start()
    assert won_a.wait(5)
    journal = _journal(etcd, a)
    svc = make_service({"n": {"dram": 4096}})
    for i in range(3):
        assert put(svc, f"k{i}", 100) == "ok"
    journal.write(svc.pool.drain_changes())
    b = _election(etcd, "b", won_b, lost)
    b.start()
    _crash(a)
    assert won_b.wait(10)
    assert put(svc, "late", 100) == "ok"
    with pytest.raises(JournalError, match="no longer leads"):
        journal.write(svc.pool.drain_changes())
    # the new leader rebuilds what the old one journaled while it led, nothing after
    state = _journal(etcd, b).load()
    fresh = MetadataService()
    assert fresh.restore(state, now=50.0) == 3
    assert sorted(fresh.objects) == ["k0", "k1", "k2"]
    fresh.check_integrity()
    b.stop()


def test_nodes_without_cluster_masters_dial_the_masters_registered_in_etcd(
    local_etcd: LocalEtcd, etcd: Etcd
):
    cluster = ClusterConfig(
        name="t",
        master="127.0.0.1:7000",
        secret=SECRET.decode(),
        etcd=(local_etcd.url,),
        etcd_user="root",
        etcd_password=local_etcd.access.password,
    )
    config = Config(cluster=cluster)
    elections = []
    for name, port in (("m0", 7000), ("m1", 7001)):
        me = MasterInfo(id=name, rpc=f"127.0.0.1:{port}", api="http://x", pid=1)
        prefix = cluster.etcd_key_prefix
        e = Election(etcd, prefix, me, 1.0, 0.05, lambda: None, print, Sealer(SECRET))
        e.start()
        elections.append(e)
    found = find_masters(etcd, cluster.etcd_key_prefix, Sealer(SECRET))
    assert sorted(m.rpc for m in found) == ["127.0.0.1:7000", "127.0.0.1:7001"]
    assert masters_to_dial(config) == ("127.0.0.1:7000", "127.0.0.1:7001")
    listed = Config(cluster=ClusterConfig(masters=("127.0.0.1:9",), etcd=(local_etcd.url,)))
    assert masters_to_dial(listed) == ("127.0.0.1:9",)  # NOTE: the config's list wins
    for e in elections:
        e.stop()


def test_a_leader_cut_off_from_etcd_steps_down_before_another_can_lead(tmp_path):
    if etcd_binary() is None:
        pytest.skip("no etcd server on this host (Debian: apt-get install etcd-server)")
    server = LocalEtcd(tmp_path / "etcd")
    url = server.start()
    try:
        etcd = Etcd([url], timeout_s=0.5, access=server.access)
        events: list[str] = []
        won_a, won_b = threading.Event(), threading.Event()
        a = _election(etcd, "a", won_a, [])
        a.on_lost = lambda why: events.append("a lost")
        a.start()
        assert won_a.wait(5)
        b = _election(etcd, "b", won_b, [])
        b.on_elected = lambda: (events.append("b leads"), won_b.set())
        b.start()
        assert server.proc is not None
        server.proc.send_signal(signal.SIGSTOP)  # etcd stalls: no renewal gets through
        time.sleep(3.0)
        server.proc.send_signal(signal.SIGCONT)
        assert won_b.wait(10)
        assert events == ["a lost", "b leads"]
        b.stop()
    finally:
        server.stop()
