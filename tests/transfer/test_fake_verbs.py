"""The verbs emulator itself is as strict as the rules it claims (tests/transfer/fake_verbs.py):
send queue and CQ depths, the error state and its flush, RTR checks, use after destroy,
MRs bound to their PD. Driven through mooncake.native.rdma, the code the transport uses."""

from __future__ import annotations

import dataclasses
import errno

import numpy as np
import pytest

from mooncake.config.rdma import RdmaConfig
from mooncake.errors import TransferError
from mooncake.native.rdma import RdmaNic, build_send_wr
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


def _write(nic, qp, wr_id, bufs, mrs, off=0, length=4096):
    wr = build_send_wr(
        nic.verbs,
        wr_id,
        True,
        _addr(bufs[0]) + off,
        length,
        mrs[0].lkey,
        _addr(bufs[1]) + off,
        mrs[1].rkey,
    )
    qp.post_send(wr)


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
