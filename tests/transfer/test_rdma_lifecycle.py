"""Lifetimes on the rdma transport (emulator): a segment unregistered with its transfers in
flight fails them cleanly and closes its memory regions only once no posted work request
names them; a restarted initiator (a new engine under the same node name) never runs into
the responder's per-peer queue-pair quota, and the responder's queue pairs stay bounded;
the RDMA_CONNECT message that carries the incarnation still talks to peers without it."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from mooncake.config.rdma import RdmaConfig
from mooncake.transfer import TransferOp, TransferRequest
from mooncake.transfer.rdma import QpInfo, RdmaConnectMsg
from mooncake.transfer.rdmamr import RegionMrs, SegmentGone
from tests.transfer.peer import pattern
from tests.transfer.rdma_helpers import flat_fabric, rdma_engine, rdma_pair, transport, wait_for

READ, WRITE = TransferOp.READ, TransferOp.WRITE


def test_unregistering_a_segment_in_flight_fails_its_request_and_keeps_the_pollers(
    emulator,
) -> None:
    """Its queued slices fail naming the segment, its posted ones finish before its MRs
    close (the fixture fails the test on a closed key in a work request), every poller
    lives on and later transfers on the same NICs work."""
    flat_fabric()
    small_queues = RdmaConfig(rdma_queue_depth=2)
    with rdma_pair(small_queues, timeout_s=5.0) as (a, b):
        pool = b.allocate("pool", 1 << 20)
        a.register("src", pattern(1 << 20))
        for _ in range(3):  # the race is wide, not certain: take it a few times
            batch = a.submit([TransferRequest(WRITE, "src", 0, "pool", 0, 1 << 20)])
            a.unregister("src")
            status = batch.wait(5.0)[0]
            assert status.state.value == "failed", status
            assert "'src'" in status.reason and "unregistered" in status.reason
            assert all(t.is_alive() for t in transport(a)._pollers)
            assert transport(a).num_poller_errors == 0
            a.register("src", pattern(1 << 20))
        later = pattern(1 << 16, offset=7)
        a.register("later", later)
        a.submit([TransferRequest(WRITE, "later", 0, "pool", 0, 1 << 16)]).check(5.0)
        assert (pool[: 1 << 16] == later).all()
        back = np.zeros(1 << 16, np.uint8)
        a.register("back", back)
        a.submit([TransferRequest(READ, "back", 0, "pool", 0, 1 << 16)]).check(5.0)
        assert (back == later).all()


def test_memory_regions_of_an_unregistered_segment_outlive_the_work_posted_on_them(
    emulator,
) -> None:
    """On a slow link, unregister waits for the posted work requests before it closes the
    MRs they name: none executes with a closed key (recorded as a crash by the emulator)."""
    flat_fabric()
    for spec in emulator.DEVICES.values():
        spec.wr_delay_s = 0.002
    with rdma_pair(timeout_s=5.0) as (a, b):
        b.allocate("pool", 1 << 18)
        a.register("src", pattern(1 << 18))
        mrs = a.segments.get("src").rdma_handles[0].mrs()
        batch = a.submit([TransferRequest(WRITE, "src", 0, "pool", 0, 1 << 18)])
        assert wait_for(lambda: emulator.STATS["max_sq"] > 1)
        a.unregister("src")
        assert all(mr.closed for mr in mrs)
        assert batch.wait(5.0)[0].state.value in ("done", "failed")
        assert not emulator.CRASHES


def test_a_restarted_initiator_never_hits_the_qp_quota(emulator) -> None:
    """Each new engine "a" reclaims what its dead predecessors left on the responder:
    its connects are never refused, the responder holds at most the quota."""
    flat_fabric()
    quota = RdmaConfig(rdma_max_qps_per_peer=16)  # two incarnations' 8 queue pairs
    with rdma_engine("b", quota) as b:
        pool = b.allocate("pool", 1 << 16)
        for i in range(6):
            with rdma_engine("a", pause_after_failures=1000) as a:
                a.directory.add_peer("127.0.0.1", b.server.port)  # type: ignore[attr-defined]
                a.register("src", pattern(1 << 16, offset=i))
                a.submit([TransferRequest(WRITE, "src", 0, "pool", 0, 1 << 16)]).check(5.0)
                assert a.num_retries == 0
            assert (pool == pattern(1 << 16, offset=i)).all()
            assert len(transport(b)._served) <= 16
        held = emulator.live_qps("fake_0") + emulator.live_qps("fake_1")
        assert held == len(transport(b)._served) <= 16


def test_connect_messages_decode_both_ways_with_peers_that_send_no_incarnation() -> None:
    class OldConnectMsg(msgspec.Struct, frozen=True):  # RdmaConnectMsg before the field
        node: str
        initiator_nic: str
        target_nic: str
        path_id: int
        slots: list[int]
        qps: list[QpInfo]

    info = QpInfo("fe80:0000:0000:0000:0000:0000:0000:0001", 0, 7, 9, 5, 16)
    new = RdmaConnectMsg("a", "fake_0", "fake_1", 3, [0], [info], incarnation=77)
    old = msgspec.msgpack.decode(msgspec.msgpack.encode(new), type=OldConnectMsg)
    assert (old.node, old.path_id, old.qps) == ("a", 3, [info])
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(old), type=RdmaConnectMsg)
    assert back.incarnation == 0 and back.qps == [info]


def test_region_mrs_close_at_the_last_release_once_the_wait_ended() -> None:
    class Mr:
        lkey, rkey, closed = 5, 6, False

        def close(self) -> None:
            assert not self.closed, "closed twice"
            self.closed = True

    mr = Mr()
    mrs = RegionMrs("seg", [("nic0", mr, 4096)])
    assert mrs.acquire("nic0") == (5, 4096) and mrs.acquire("nic0") == (5, 4096)
    assert mrs.close(0.01) is False and not mr.closed  # two posted: the wait ends first
    with pytest.raises(SegmentGone, match="'seg' was unregistered"):
        mrs.acquire("nic0")
    mrs.release()
    assert not mr.closed
    mrs.release()
    assert mr.closed and mrs.is_closed and mrs.num_posted == 0
