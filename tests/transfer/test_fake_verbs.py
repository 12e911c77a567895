"""The verbs emulator itself is as strict as the rules it claims (tests/transfer/fake_verbs.py):
send queue and CQ depths, the error state and its flush, RTR checks, use after destroy,
MRs bound to their PD, a closed MR's keys unusable, send_flags (unsignalled requests
complete silently and free their slots with a signalled one), chains of work requests,
asynchronous events (port down and up, QP fatal, CQ overrun). Driven through
mooncake.native.rdma, the code the transport uses."""

from __future__ import annotations

import dataclasses
import errno
import threading

import numpy as np
import pytest

from mooncake.config.rdma import RdmaConfig
from mooncake.errors import TransferError
from mooncake.native.rdma import RdmaNic, build_init_attr, build_send_wr
from tests.transfer.rdma_helpers import flat_fabric, wait_for

_opened: list[RdmaNic] = []


@pytest.fixture(autouse=True)
def _close_nics():
    yield
    while _opened:
        _opened.pop().close()  # their QPs, MRs and the device threads go with them


def _nic(fv, name: str, cfg: RdmaConfig = RdmaConfig()) -> RdmaNic:
    _opened.append(RdmaNic(fv, name, cfg))
    return _opened[-1]


def _addr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def _connected(fv, cfg: RdmaConfig = RdmaConfig(), names=("fake_0", "fake_1")):
    """Two NICs, one QP each, connected to each other; and a registered buffer on each."""
    n0, n1 = (_nic(fv, n, cfg) for n in names)
    q0, q1 = n0.create_qp(), n1.create_qp()
    n0.connect(q0, n1.endpoint(q1, 7), 5)
    n1.connect(q1, n0.endpoint(q0, 5), 7)
    bufs = [np.arange(1 << 16, dtype=np.uint8), np.zeros(1 << 16, np.uint8)]
    mrs = [n0.register(_addr(bufs[0]), 1 << 16)[0], n1.register(_addr(bufs[1]), 1 << 16)[0]]
    return (n0, n1), (q0, q1), bufs, mrs


def _wr(fv, wr_id, bufs, mrs, off=0, length=4096, signalled=True):
    wr = build_send_wr(
        fv,
        wr_id,
        True,
        _addr(bufs[0]) + off,
        length,
        mrs[0].lkey,
        _addr(bufs[1]) + off,
        mrs[1].rkey,
    )
    wr.send_flags = fv.IBV_SEND_SIGNALED if signalled else 0
    return wr


def _write(nic, qp, wr_id, bufs, mrs, off=0, length=4096):
    qp.post_send(_wr(nic.verbs, wr_id, bufs, mrs, off, length))


def _drain(nic, count, timeout_s=5.0):
    got: list = []
    wait_for(lambda: bool(got.extend(nic.poll(64))) or len(got) >= count, timeout_s)
    return got


def test_completions_arrive_from_the_device_thread_and_the_send_queue_is_bounded(emulator):
    flat_fabric()
    (n0, n1), (q0, _), bufs, mrs = _connected(emulator, RdmaConfig(rdma_queue_depth=4))
    for i in range(4):
        _write(n0, q0, i, bufs, mrs, off=i * 4096)
    with pytest.raises(emulator.PyverbsRDMAError) as e:
        _write(n0, q0, 9, bufs, mrs)
    assert e.value.error_code == errno.ENOMEM  # the fifth, before any completion was polled
    done = _drain(n0, 4)
    assert [(w, s) for w, s, _ in done] == [(i, 0) for i in range(4)]
    assert (bufs[1][: 4 * 4096] == bufs[0][: 4 * 4096]).all()
    _write(n0, q0, 10, bufs, mrs)  # polled: room again
    assert _drain(n0, 1)[0][:2] == (10, 0)


def test_a_cq_overrun_puts_its_qps_in_error_and_loses_the_completion(emulator):
    flat_fabric()
    (n0, _), (q0, _), bufs, mrs = _connected(emulator, RdmaConfig(rdma_cq_depth=16))
    for i in range(17):
        _write(n0, q0, i, bufs, mrs)
    assert wait_for(lambda: q0.qp_state == emulator.IBV_QPS_ERR)
    assert emulator.STATS["overruns"] >= 1 and len(_drain(n0, 17, 0.5)) == 16


def test_an_error_state_qp_flushes_its_work(emulator):
    flat_fabric()
    (n0, n1), (q0, _), bufs, mrs = _connected(emulator)
    emulator.cut("fake_0")
    for i in range(3):
        _write(n0, q0, i, bufs, mrs)
    statuses = [s for _, s, _ in _drain(n0, 3)]
    assert statuses == [emulator.IBV_WC_RETRY_EXC_ERR] + [emulator.IBV_WC_WR_FLUSH_ERR] * 2
    emulator.cut("fake_0", False)
    _write(n0, q0, 3, bufs, mrs)  # posting in error is allowed: it flushes too
    assert _drain(n0, 1)[0][1] == emulator.IBV_WC_WR_FLUSH_ERR
    n0.to_error(q0)  # already in error: no change


def test_rtr_checks_psn_mtu_and_hop_limit(emulator):
    emulator.DEVICES["fake_1"].ports[1].active_mtu = emulator.IBV_MTU_1024
    n1 = _nic(emulator, "fake_1", RdmaConfig())
    ep1 = n1.endpoint(n1.create_qp(), 1)
    cases = [
        (RdmaConfig(), dataclasses.replace(ep1, psn=1 << 24), "rq_psn"),
        (RdmaConfig(), dataclasses.replace(ep1, mtu=5), "remote port's MTU"),
        (RdmaConfig(rdma_hop_limit=1), ep1, "behind a router"),
        (RdmaConfig(rdma_gid_index=0), ep1, "behind a router"),  # link-local RoCEv1
    ]
    for cfg, ep, why in cases:
        nic = _nic(emulator, "fake_0", cfg)
        with pytest.raises(TransferError, match="modify_qp\\(RTR\\) failed") as e:
            nic.connect(nic.create_qp(), ep, 3)
        assert why in str(e.value)


def test_rtr_refuses_a_gid_type_other_than_the_remote_qps(emulator):
    flat_fabric()
    v1 = _nic(emulator, "fake_0", RdmaConfig(rdma_gid_index=2))  # IPv4 RoCEv1
    v2 = _nic(emulator, "fake_1", RdmaConfig())  # IPv4 RoCEv2
    q1, q2 = v1.create_qp(), v2.create_qp()
    v2.connect(q2, v1.endpoint(q1, 1), 2)
    with pytest.raises(TransferError, match="GID type mismatch: RoCEv1 here, RoCEv2"):
        v1.connect(q1, v2.endpoint(q2, 2), 1)


def test_use_after_destroy_is_a_crash_not_an_exception(emulator):
    flat_fabric()
    (n0, _), (q0, _), bufs, mrs = _connected(emulator)
    q0.close()
    with pytest.raises(emulator.VerbsCrash):
        _write(n0, q0, 1, bufs, mrs)
    n0.cq.close()
    with pytest.raises(emulator.VerbsCrash):
        n0.cq.poll(1)
    assert not issubclass(emulator.VerbsCrash, Exception)
    emulator.CRASHES.clear()  # expected here


def test_memory_regions_are_bound_to_their_protection_domain(emulator):
    flat_fabric()
    (n0, n1), (q0, _), bufs, mrs = _connected(emulator)
    other = _nic(emulator, "fake_0", RdmaConfig())  # another PD on the same device
    foreign = other.register(_addr(bufs[0]), 1 << 16)[0]
    _write(n0, q0, 1, bufs, [foreign, mrs[1]])
    assert _drain(n0, 1)[0][1] == emulator.IBV_WC_LOC_PROT_ERR
    q0b = n0.create_qp()
    q1b = n1.create_qp()
    n0.connect(q0b, n1.endpoint(q1b, 2), 4)
    n1.connect(q1b, n0.endpoint(q0b, 4), 2)
    remote_on_other_pd = other.register(_addr(bufs[1]), 1 << 16)[0]
    _write(n0, q0b, 2, bufs, [mrs[0], remote_on_other_pd])
    assert _drain(n0, 1)[0][1] == emulator.IBV_WC_REM_ACCESS_ERR


def test_a_closed_mrs_keys_are_unusable(emulator):
    """Reading a closed MR's key dereferences a freed ibv_mr in pyverbs; a work request
    naming it may reach a new MR that got the key: both are crashes, whether the MR was
    closed before the post or between the post and the NIC executing it."""
    flat_fabric()
    (n0, _), (q0, _), bufs, mrs = _connected(emulator)
    lkey = mrs[0].lkey
    with emulator._lock:  # NOTE: the device thread waits: the MR closes before it runs
        q0.post_send(_wr(emulator, 1, bufs, mrs))
        mrs[0].close()
    assert _drain(n0, 1)[0][1] == emulator.IBV_WC_LOC_PROT_ERR
    assert emulator.CRASHES and "closed MR" in emulator.CRASHES[-1]
    with pytest.raises(emulator.VerbsCrash):
        mrs[0].lkey  # noqa: B018 - the read is the crash
    wr = build_send_wr(emulator, 2, True, _addr(bufs[0]), 4096, lkey, _addr(bufs[1]), 1)
    with pytest.raises(emulator.VerbsCrash, match="lkey .* of a closed MR"):
        q0.post_send(wr)  # in error after the LOC_PROT_ERR: posting is still allowed
    emulator.CRASHES.clear()  # expected here


def test_unsignalled_requests_complete_silently_and_free_slots_with_a_signalled_one(emulator):
    flat_fabric()
    (n0, _), (q0, _), bufs, mrs = _connected(emulator, RdmaConfig(rdma_queue_depth=4))
    for i in range(3):
        q0.post_send(_wr(emulator, i, bufs, mrs, off=i * 4096, signalled=False))
    q0.post_send(_wr(emulator, 3, bufs, mrs, off=3 * 4096))
    with pytest.raises(emulator.PyverbsRDMAError) as e:  # four slots in use until polled
        q0.post_send(_wr(emulator, 4, bufs, mrs))
    assert e.value.error_code == errno.ENOMEM
    assert [(w, s) for w, s, _ in _drain(n0, 1)] == [(3, 0)]
    assert n0.poll(64) == [] and (bufs[1][: 4 * 4096] == bufs[0][: 4 * 4096]).all()
    for i in range(4):  # the signalled completion freed all four slots
        q0.post_send(_wr(emulator, 10 + i, bufs, mrs, signalled=i == 3))
    assert [w for w, _, _ in _drain(n0, 1)] == [13]


def test_unsignalled_slots_stay_taken_without_a_signalled_completion(emulator):
    flat_fabric()
    (n0, _), (q0, _), bufs, mrs = _connected(emulator, RdmaConfig(rdma_queue_depth=2))
    for i in range(2):
        q0.post_send(_wr(emulator, i, bufs, mrs, signalled=False))
    assert wait_for(lambda: not q0.sq) and n0.poll(64) == []
    with pytest.raises(emulator.PyverbsRDMAError):  # executed, but nothing freed them
        q0.post_send(_wr(emulator, 2, bufs, mrs))


def test_a_failing_unsignalled_request_still_completes_and_so_does_its_flush(emulator):
    flat_fabric()
    (n0, _), (q0, _), bufs, mrs = _connected(emulator)
    emulator.cut("fake_0")
    for i in range(2):
        q0.post_send(_wr(emulator, i, bufs, mrs, signalled=False))
    statuses = [(w, s) for w, s, _ in _drain(n0, 2)]
    assert statuses == [(0, emulator.IBV_WC_RETRY_EXC_ERR), (1, emulator.IBV_WC_WR_FLUSH_ERR)]


def test_sq_sig_all_signals_every_request(emulator):
    flat_fabric()
    (n0, n1), (_, q1), bufs, mrs = _connected(emulator)
    e = emulator
    cap = e.QPCap(max_send_wr=4)
    qp = e.QP(
        n0.pd, e.QPInitAttr(qp_type=e.IBV_QPT_RC, scq=n0.cq, rcq=n0.cq, cap=cap, sq_sig_all=1)
    )
    qp.to_init(build_init_attr(e, n0.port.port_num))
    q1b = n1.create_qp()
    n0.connect(qp, n1.endpoint(q1b, 3), 4)
    n1.connect(q1b, n0.endpoint(qp, 4), 3)
    for i in range(2):
        qp.post_send(_wr(e, i, bufs, mrs, signalled=False))
    assert [w for w, _, _ in _drain(n0, 2)] == [0, 1]


def test_a_chain_of_work_requests_runs_in_order_from_one_post(emulator):
    """pyverbs chains SendWRs through next_wr (a pointer: the caller keeps them alive);
    only the last is signalled here, as the C loop posts them."""
    flat_fabric()
    (n0, _), (q0, _), bufs, mrs = _connected(emulator, RdmaConfig(rdma_queue_depth=4))
    wrs = [_wr(emulator, i, bufs, mrs, off=i * 4096, signalled=i == 2) for i in range(3)]
    wrs[0].next_wr, wrs[1].next_wr = wrs[1], wrs[2]
    with pytest.raises(emulator.PyverbsUserError):  # rdma-core 44's getter, as it is
        wrs[0].next_wr  # noqa: B018
    assert wrs[2].next_wr is None
    with pytest.raises(TypeError):
        wrs[2].next_wr = None
    q0.post_send(wrs[0])
    assert [(w, s) for w, s, _ in _drain(n0, 1)] == [(2, 0)]
    assert (bufs[1][: 3 * 4096] == bufs[0][: 3 * 4096]).all()


def test_a_chain_past_the_send_queue_posts_its_head_and_names_the_bad_request(emulator):
    flat_fabric()
    (n0, _), (q0, _), bufs, mrs = _connected(emulator, RdmaConfig(rdma_queue_depth=2))
    wrs = [_wr(emulator, i, bufs, mrs) for i in range(3)]
    wrs[0].next_wr, wrs[1].next_wr = wrs[1], wrs[2]
    bad = _wr(emulator, 99, bufs, mrs)
    with pytest.raises(emulator.PyverbsRDMAError) as e:
        q0.post_send(wrs[0], bad)
    assert e.value.error_code == errno.ENOMEM and bad.wr_id == 2
    assert [w for w, _, _ in _drain(n0, 2)] == [0, 1]  # the two before it were posted


def test_a_chain_linking_a_freed_request_is_a_crash(emulator):
    flat_fabric()
    (n0, _), (q0, _), bufs, mrs = _connected(emulator)
    head = _wr(emulator, 0, bufs, mrs)
    head.next_wr = _wr(emulator, 1, bufs, mrs)  # nothing keeps the second one alive
    with pytest.raises(emulator.VerbsCrash, match="freed SendWR"):
        q0.post_send(head)
    emulator.CRASHES.clear()  # expected here


def test_a_port_going_down_and_up_is_an_async_event_and_fails_its_work(emulator):
    """get_async_event blocks until an event; a port down fails posted work (RETRY_EXC),
    as a cut link does, and says so on every open context of the device."""
    flat_fabric()
    (n0, _), (q0, _), bufs, mrs = _connected(emulator)
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(n0.ctx.get_async_event()))
    waiter.start()
    waiter.join(0.05)
    assert waiter.is_alive() and not got  # nothing happened yet: it blocks
    emulator.set_port_state("fake_0", 1, emulator.IBV_PORT_DOWN)
    waiter.join(5)
    assert got[0].event_type == emulator.IBV_EVENT_PORT_ERR
    got[0].ack()
    assert n0.ctx.query_port(1).state == emulator.IBV_PORT_DOWN
    _write(n0, q0, 1, bufs, mrs)
    assert _drain(n0, 1)[0][1] == emulator.IBV_WC_RETRY_EXC_ERR
    emulator.set_port_state("fake_0", 1, emulator.IBV_PORT_ACTIVE)
    event = n0.ctx.get_async_event()
    assert event.event_type == emulator.IBV_EVENT_PORT_ACTIVE
    event.ack()


def test_a_qp_fatal_error_flushes_its_work_and_must_be_acked_before_destroy(emulator):
    flat_fabric()
    (n0, _), (q0, _), bufs, mrs = _connected(emulator)
    q1 = n0.create_qp()
    with emulator._lock:  # NOTE: fails before the device thread runs the request
        _write(n0, q0, 1, bufs, mrs)
        emulator.fail_qp(q0)
    assert _drain(n0, 1)[0][:2] == (1, emulator.IBV_WC_WR_FLUSH_ERR)
    event = n0.ctx.get_async_event()
    assert event.event_type == emulator.IBV_EVENT_QP_FATAL
    event.ack()
    q0.close()  # acked: destroys at once
    emulator.fail_qp(q1)
    q1.close()  # not acked: ibv_destroy_qp would wait forever
    crashes = list(emulator.CRASHES)
    assert crashes == [f"destroy of QP {q1.qp_num} with an unacked async event"]
    emulator.CRASHES.clear()  # expected here
    n0.ctx.get_async_event().ack()


def test_a_cq_overrun_is_an_async_event(emulator):
    flat_fabric()
    (n0, _), (q0, _), bufs, mrs = _connected(emulator, RdmaConfig(rdma_cq_depth=16))
    for i in range(17):
        _write(n0, q0, i, bufs, mrs)
    event = n0.ctx.get_async_event()
    assert event.event_type == emulator.IBV_EVENT_CQ_ERR
    event.ack()
