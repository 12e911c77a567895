"""How the rdma transport addresses devices, on the verbs emulator (whose devices sit on
two IPv4 subnets with a router between them): the IPv4 RoCEv2 GID from the GID table or
the configured index, hop limit / traffic class / service level from the config, only
ACTIVE ports, unopenable devices skipped, the path MTU the smaller of both ports, and read
depths, queue sizes and the slice size clamped to the device's limits."""

from __future__ import annotations

import logging

import pytest

from mooncake.config.rdma import RdmaConfig
from mooncake.errors import TransferError
from mooncake.transfer import TransferOp, TransferRequest
from tests.transfer.peer import pattern
from tests.transfer.rdma_helpers import flat_fabric, rdma_engine, rdma_pair, transport

WRITE = TransferOp.WRITE
IPV4_MAPPED = "0000:0000:0000:0000:0000:ffff:"


def _write_all_paths(a, b, n: int = 1 << 18) -> list:
    pool = b.allocate("pool", n)
    src = pattern(n, offset=11)
    a.register("src", src)
    a.submit([TransferRequest(WRITE, "src", 0, "pool", 0, n)]).check()
    assert (pool == src).all()
    return a.resolve("pool").pathsets["cpu:0"].paths


def _qps(engine) -> list:
    return [qp for p in transport(engine)._paths.values() for qp in p.qps()]


def test_a_routed_fabric_is_reached_through_the_ipv4_rocev2_gid(emulator) -> None:
    with rdma_pair() as (a, b):
        paths = _write_all_paths(a, b)
        assert len(paths) == 4 and all(p.num_slices > 0 for p in paths)
        assert a.num_retries == 0
        for nic in transport(a).nics.values():
            assert nic.port.gid_index == 3 and nic.gid.startswith(IPV4_MAPPED)


def test_the_configured_gid_index_wins_and_an_empty_one_is_refused(emulator, caplog) -> None:
    with rdma_engine("a", RdmaConfig(rdma_gid_index=2)) as a:
        assert {n.port.gid_index for n in transport(a).nics.values()} == {2}
    with caplog.at_level(logging.WARNING), pytest.raises(TransferError, match="no RDMA device"):
        rdma_engine("b", RdmaConfig(rdma_gid_index=6))
    assert "GID index 6 (transfer.rdma_gid_index) is empty" in caplog.text


def test_traffic_class_service_level_and_hop_limit_come_from_the_config(emulator, caplog):
    cfg = RdmaConfig(rdma_traffic_class=106, rdma_service_level=3, rdma_hop_limit=16)
    with rdma_pair(cfg, cfg) as (a, b):
        _write_all_paths(a, b)
        routes = {(q.rtr["hop_limit"], q.rtr["traffic_class"], q.rtr["sl"]) for q in _qps(a)}
        assert routes == {(16, 106, 3)}
    one_hop = RdmaConfig(rdma_hop_limit=1)  # never crosses the router between the subnets
    with rdma_pair(one_hop, one_hop, pause_after_failures=1000) as (a, b):
        with caplog.at_level(logging.WARNING):
            paths = _write_all_paths(a, b)
        assert "behind a router" in caplog.text
        assert [p.num_slices > 0 for p in paths] == [p.local_nic == p.remote_nic for p in paths]


def test_only_active_ports_are_used(emulator) -> None:
    for spec in emulator.DEVICES.values():
        spec.ports = {1: emulator.PortSpec(state=emulator.IBV_PORT_DOWN), 2: emulator.PortSpec()}
    with rdma_pair() as (a, b):
        _write_all_paths(a, b)
        assert {n.port.port_num for n in transport(a).nics.values()} == {2}
        assert a.num_retries == 0


def test_a_device_that_does_not_open_is_skipped_with_a_warning(emulator, caplog) -> None:
    emulator.DEVICES["fake_1"].open_error = "device is in a bad state"
    emulator.DEVICES["fake_2"] = emulator.DeviceSpec(
        2, ports={1: emulator.PortSpec(state=emulator.IBV_PORT_DOWN)}
    )
    with caplog.at_level(logging.WARNING), rdma_engine("a") as a:
        assert list(transport(a).nics) == ["fake_0"]
    assert "RDMA device fake_1 skipped" in caplog.text
    assert "RDMA device fake_2 skipped" in caplog.text and "no ACTIVE port" in caplog.text


def test_the_path_mtu_is_the_smaller_of_both_ports(emulator) -> None:
    emulator.DEVICES["fake_1"].ports[1].active_mtu = emulator.IBV_MTU_1024
    with rdma_pair() as (a, b):
        paths = _write_all_paths(a, b)
        assert all(p.num_slices > 0 for p in paths) and a.num_retries == 0
        mtus = {q.rtr["mtu"] for q in _qps(a) if q.pd.ctx.name == "fake_0"}
        assert mtus == {emulator.IBV_MTU_4096, emulator.IBV_MTU_1024}


def test_depths_and_sizes_are_clamped_to_the_device(emulator) -> None:
    for spec in emulator.DEVICES.values():
        spec.max_qp_rd_atom, spec.max_qp_init_rd_atom = 4, 2
        spec.max_qp_wr, spec.max_cqe = 32, 1024
        spec.ports[1].max_msg_sz = 2048
    cfg = RdmaConfig(rdma_queue_depth=256, rdma_cq_depth=4096)
    with rdma_pair(cfg, cfg, slice_bytes=4096) as (a, b):
        paths = _write_all_paths(a, b, 1 << 20)
        assert all(p.num_slices > 0 for p in paths) and a.num_retries == 0
        nic = transport(a).nics["fake_0"]
        assert (nic.queue_depth, nic.cq_depth, transport(a).slice_bytes(a.options)) == (
            32,
            1024,
            2048,
        )
        assert emulator.STATS["max_sq"] <= 32


def test_an_infiniband_port_uses_gid_index_0(emulator) -> None:
    flat_fabric()
    for spec in emulator.DEVICES.values():
        spec.ports[1].link_layer = emulator.IBV_LINK_LAYER_INFINIBAND
    with rdma_pair() as (a, b):
        _write_all_paths(a, b)
        assert {n.port.gid_index for n in transport(a).nics.values()} == {0}
        assert a.num_retries == 0
