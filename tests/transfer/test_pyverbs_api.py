"""The calls of mooncake.native.rdma checked against the real pyverbs (Debian's
python3-pyverbs), without a device: every class, method and enum the transport uses exists,
the attribute objects it builds are accepted by pyverbs' constructors and hold the values
the QP handshake needs, and the fake provider has the same names. Skipped where pyverbs does
not import. Not exercised: opening a device, registering memory, QP transitions and
posting on real hardware (no RDMA NIC exists on these machines)."""

from __future__ import annotations

import inspect

import pytest

from mooncake.errors import TransferError
from mooncake.native import rdma
from mooncake.native.rdma import QpEndpoint
from mooncake.transfer import EngineOptions, TransferEngine
from tests.transfer import fake_verbs

try:
    verbs = rdma.load_pyverbs()
except ImportError as e:  # pragma: no cover - depends on the host
    pytest.skip(f"pyverbs does not import: {e}", allow_module_level=True)

GID = "fe80:0000:0000:0000:0000:0000:0000:0001"
METHODS = {
    "Context": (
        "query_device",
        "query_port",
        "query_gid",
        "query_gid_type",
        "get_async_event",
        "close",
    ),
    "MR": ("lkey", "rkey", "close"),
    "CQ": ("poll", "close"),
    "QP": ("to_init", "to_rtr", "to_rts", "modify", "post_send", "qp_num", "close"),
    "SendWR": ("set_wr_rdma", "next_wr", "send_flags", "wr_id"),
    "GID": ("gid",),
    "PD": ("close",),
}


def test_every_class_method_and_enum_used_exists_in_pyverbs() -> None:
    for cls, names in METHODS.items():
        missing = [n for n in names if not hasattr(getattr(verbs, cls), n)]
        assert not missing, f"pyverbs {cls} lacks {missing}"
    for name in rdma.USED_ENUMS:
        assert isinstance(int(getattr(verbs, name)), int)


def test_attributes_read_from_query_results_exist_in_pyverbs() -> None:
    import pyverbs.cq
    import pyverbs.device

    port = ("state", "link_layer", "active_mtu", "lid", "gid_tbl_len", "max_msg_sz")
    device = ("max_qp_wr", "max_cqe", "max_qp_rd_atom", "max_qp_init_rd_atom", "phys_port_cnt")
    for cls, names in (
        (pyverbs.device.PortAttr, port),
        (pyverbs.device.DeviceAttr, device),
        (pyverbs.cq.WC, ("wr_id", "status", "vendor_err")),
    ):
        assert not [n for n in names if not hasattr(cls, n)], cls
    fake_port = fake_verbs.Context("fake_0").query_port(1)
    assert all(hasattr(fake_port, n) for n in port)
    assert callable(verbs.fork_init)


def test_fake_provider_offers_the_same_names_and_enum_values() -> None:
    for names in rdma.USED.values():
        for n in names:
            assert hasattr(fake_verbs, n), n
    for cls, names in METHODS.items():
        for n in names:
            # instance attributes in the fake
            if n not in ("lkey", "rkey", "qp_num", "gid", "send_flags", "wr_id"):
                assert hasattr(getattr(fake_verbs, cls), n), f"fake {cls}.{n}"
    for name in rdma.USED_ENUMS:
        assert int(getattr(fake_verbs, name)) == int(getattr(verbs, name)), name


def test_chains_and_signalling_behave_in_the_emulator_as_in_pyverbs() -> None:
    """What the emulator's chains and send flags mirror: next_wr takes a SendWR only,
    reads None while unset and (rdma-core 44) raises once set; pyverbs keeps no reference
    to the linked WR; QPInitAttr defaults to signalling every WR."""
    import sys

    from pyverbs.pyverbs_error import PyverbsUserError

    for api, user_error in ((verbs, PyverbsUserError), (fake_verbs, fake_verbs.PyverbsUserError)):
        head, tail = (rdma.build_send_wr(api, i, True, 0x1000, 64, 1, 0x2000, 2) for i in (1, 2))
        assert head.next_wr is None
        refs = sys.getrefcount(tail)
        head.next_wr = tail
        assert sys.getrefcount(tail) == refs, api  # a pointer, not a reference
        with pytest.raises(user_error):
            head.next_wr  # noqa: B018
        with pytest.raises(TypeError):
            head.next_wr = None
        head.send_flags = 0
        assert head.send_flags == 0 and tail.send_flags == int(api.IBV_SEND_SIGNALED)
    assert verbs.QPInitAttr().sq_sig_all == 1 == fake_verbs.QPInitAttr().sq_sig_all


def test_async_events_of_the_emulator_have_pyverbs_names_and_values() -> None:
    import pyverbs.device

    for name in ("ack", "event_type"):
        assert hasattr(pyverbs.device.AsyncEvent, name) and hasattr(fake_verbs.AsyncEvent(), name)
    try:  # as load_pyverbs: newer rdma-core renamed the enums module
        import pyverbs.libibverbs_enums as e
    except ImportError:
        import pyverbs.enums as e
    for name in ("IBV_EVENT_CQ_ERR", "IBV_EVENT_QP_FATAL", "IBV_EVENT_PORT_ACTIVE"):
        assert int(getattr(e, name)) == getattr(fake_verbs, name), name
    assert int(e.IBV_EVENT_PORT_ERR) == fake_verbs.IBV_EVENT_PORT_ERR
    assert ":param bad_wr:" in verbs.QP.post_send.__doc__


def test_documented_parameters_of_the_calls_we_make() -> None:
    assert ":param address:" in verbs.MR.__init__.__doc__
    assert ":param comp_vector:" in verbs.CQ.__init__.__doc__
    assert "(npolled, wcs)" in verbs.CQ.poll.__doc__
    assert ":param rkey:" in verbs.SendWR.set_wr_rdma.__doc__
    assert verbs.DmaBufMR is not None  # Debian's pyverbs has it; older ones may not
    for kw in ("dmabuf", "offset"):
        assert f":param {kw}:" in verbs.DmaBufMR.__init__.__doc__, kw
    for kw in ("qp_type", "scq", "rcq", "cap", "sq_sig_all"):
        assert f":param {kw}:" in verbs.QPInitAttr.__init__.__doc__, kw


def test_attribute_builders_are_accepted_by_pyverbs() -> None:
    init = rdma.build_qp_init_attr(verbs, None, 64)
    assert init.qp_type == verbs.IBV_QPT_RC and init.max_send_wr == 64
    attr = rdma.build_init_attr(verbs, 1)
    assert attr.port_num == 1 and attr.qp_access_flags == rdma.access_flags(verbs)
    mtu = verbs.QPAttr().path_mtu
    route = rdma.Route(
        1,
        3,
        mtu,
        hop_limit=64,
        traffic_class=106,
        service_level=3,
        max_dest_rd_atomic=8,
        max_rd_atomic=4,
    )
    rtr = rdma.build_rtr_attr(verbs, QpEndpoint(GID, 7, 0x1234, 99, mtu, 8), route)
    assert (rtr.ah_attr.hop_limit, rtr.ah_attr.traffic_class, rtr.ah_attr.sl) == (64, 106, 3)
    assert rtr.max_dest_rd_atomic == 8
    assert (rtr.dest_qp_num, rtr.rq_psn, rtr.ah_attr.dlid, rtr.ah_attr.port_num) == (
        0x1234,
        99,
        7,
        1,
    )
    assert (
        rtr.ah_attr.is_global == 1 and str(rtr.ah_attr.dgid) == GID and rtr.ah_attr.sgid_index == 3
    )
    rts = rdma.build_rts_attr(verbs, rtr, 42, 4)
    assert (rts.sq_psn, rts.retry_cnt, rts.rnr_retry, rts.timeout) == (42, 7, 7, 14)
    assert rts.max_rd_atomic == 4
    err = verbs.QPAttr(qp_state=verbs.IBV_QPS_ERR)
    assert err.qp_state == verbs.IBV_QPS_ERR and int(verbs.IBV_QP_STATE) == 1
    wr = rdma.build_send_wr(verbs, 5, True, 0x1000, 4096, 11, 0x2000, 22)
    assert (wr.wr_id, wr.opcode, wr.num_sge) == (5, verbs.IBV_WR_RDMA_WRITE, 1)
    assert wr.send_flags == verbs.IBV_SEND_SIGNALED
    read = rdma.build_send_wr(verbs, 6, False, 0x1000, 4096, 11, 0x2000, 22)
    assert read.opcode == verbs.IBV_WR_RDMA_READ


def test_dmabuf_export_without_a_cuda_driver_is_a_clear_error() -> None:
    import ctypes

    from mooncake.native import cudadmabuf

    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        with pytest.raises(TransferError, match="libcuda.so.1"):
            cudadmabuf.export_dmabuf(0x10000, 4096)
    else:  # pragma: no cover - a host with the CUDA driver
        pytest.skip("this host has libcuda")


def test_engine_on_real_pyverbs_without_devices_falls_back_or_refuses() -> None:
    if rdma.list_devices(verbs):  # pragma: no cover - a host with RDMA NICs
        pytest.skip("this host has RDMA devices")
    assert inspect.isclass(verbs.PyverbsError)  # get_device_list raised it: no devices
    with TransferEngine(
        "auto", b"pyverbs-test-secret-0123456789", EngineOptions(protocol="auto")
    ) as e:
        assert e.transport_names == ["local", "shm", "tcp"]
    with pytest.raises(TransferError, match="no RDMA device"):
        TransferEngine("rdma", b"pyverbs-test-secret-0123456789", EngineOptions(protocol="rdma"))
