"""The data-plane server binds in `EngineOptions.ports` ([node] port_range), lowest first."""

from __future__ import annotations

import socket

import pytest

from mooncake.config.portrange import PortRange
from mooncake.errors import MooncakeError
from mooncake.transfer import EngineOptions, TransferEngine
from tests.roles.test_port_range import free_block
from tests.transfer.conftest import SECRET, make_engine


def test_engines_take_the_lowest_free_ports_of_the_range_then_fail_naming_the_key() -> None:
    rng = free_block(3)
    with socket.create_server(("127.0.0.1", rng.low)):  # someone else holds the first port
        a = make_engine("a", protocol="tcp", ports=rng)
        b = make_engine("b", protocol="tcp", ports=rng)
        try:
            assert (a.server.port, b.server.port) == (rng.low + 1, rng.low + 2)
            assert a.endpoints[0].port == a.server.port  # what peers are told
            with pytest.raises(MooncakeError, match=f"node.port_range: every port in {rng}"):
                make_engine("c", protocol="tcp", ports=rng)
        finally:
            a.close()
            b.close()


def test_an_explicit_port_wins_over_the_range() -> None:
    port = free_block(1).low
    engine = TransferEngine("a", SECRET, EngineOptions(ports=PortRange(1, 1)), port=port)
    try:
        assert engine.server.port == port
    finally:
        engine.close()
