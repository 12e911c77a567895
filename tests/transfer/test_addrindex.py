"""Memory named by address: the local AddressIndex and DESCRIBE_ADDRESS between engines."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from mooncake.errors import TransferError
from mooncake.transfer import EngineOptions, TransferEngine
from mooncake.transfer.addrindex import AddressDirectory, AddressIndex, AddressQuery
from mooncake.transfer.tcp import control_call
from mooncake.transfer.wire import Op, Status
from tests.transfer.conftest import SECRET


def test_index_finds_whole_ranges_and_refuses_overlaps():
    """find() answers only ranges inside one buffer; add() of an overlapping buffer names
    the one it overlaps and records nothing; first() is the earliest still registered."""
    index = AddressIndex()
    assert index.add(1000, 100, "a") is None
    assert index.add(2000, 50, "b") is None
    assert index.add(1099, 10, "c").segment == "a"  # type: ignore[union-attr]
    assert index.add(1950, 51, "c").segment == "b"  # type: ignore[union-attr]
    assert index.add(1100, 900, "c") is None  # touching both, overlapping neither
    assert index.find(1000, 100).segment == "a"  # type: ignore[union-attr]
    assert index.find(1050, 51) is None  # runs past "a" into "c"
    assert index.find(999, 1) is None
    assert index.find(2049, 1).segment == "b"  # type: ignore[union-attr]
    assert index.first().segment == "a"  # type: ignore[union-attr]
    assert index.remove(1000).segment == "a"  # type: ignore[union-attr]
    assert index.remove(1000) is None
    assert index.first().segment == "b"  # type: ignore[union-attr]
    assert [s.segment for s in index.spans()] == ["c", "b"]


def test_describe_address_between_engines():
    """A peer's DESCRIBE_ADDRESS answers the buffer holding a range, with the segment's
    token; a range outside every buffer is None; a malformed query is refused."""
    owner = TransferEngine("owner", SECRET, EngineOptions(protocol="tcp"))
    index = AddressIndex()
    owner.server.handlers[Op.DESCRIBE_ADDRESS] = index.handler(owner.describe)
    buf = np.zeros(4096, dtype=np.uint8)
    desc = owner.register("mem", buf)
    index.add(buf.ctypes.data, 4096, "mem")
    directory = AddressDirectory(SECRET)
    port = owner.server.port
    try:
        found = directory.ask_address("127.0.0.1", port, AddressQuery(buf.ctypes.data + 10, 100))
        assert found is not None and found.address == buf.ctypes.data
        assert found.segment.token == desc.token and found.segment.num_bytes == 4096
        assert directory.lookup(f"mem@127.0.0.1:{port}") == found.segment  # learnt, no ask
        assert directory.ask_address("127.0.0.1", port, AddressQuery(buf.ctypes.data, 4097)) is None
        first = directory.ask_address("127.0.0.1", port, AddressQuery(0, 0, first=True))
        assert first is not None and first.address == buf.ctypes.data
        status, _ = control_call(
            "127.0.0.1", port, SECRET, Op.DESCRIBE_ADDRESS, msgspec.msgpack.encode("x"), 5.0
        )
        assert status == Status.BAD_REQUEST
        with pytest.raises(TransferError, match="cannot reach"):
            AddressDirectory(b"another-secret-0123456789").ask_address(
                "127.0.0.1", port, AddressQuery(buf.ctypes.data, 1)
            )
    finally:
        owner.close()
