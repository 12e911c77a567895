"""The prefill side of the hand-off against a real decode-side RPC server: a full decode
node makes the prefill wait for room, then fail clearly past [prefill] reserve_timeout_s."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

from mooncake.config.roles import PrefillConfig
from mooncake.errors import TransferError
from mooncake.roles.node.messages import DecodeReserveMsg, DecodeReserveReplyMsg
from mooncake.roles.prefill.handoff import DecodeHandoff, DecodeTarget
from mooncake.rpc import RpcServer

SECRET = b"handoff-test-secret-0123456789ab"


class FullDecodeNode:
    """Answers "no room" to the first `full_for` asks, then reserves blocks."""

    def __init__(self, full_for: int):
        self.full_for, self.asks = full_for, 0
        self.server = RpcServer("tcp://127.0.0.1:0", SECRET, name="decode")
        self.server.register(DecodeReserveMsg, self._on_reserve)
        self.server.start()

    def _on_reserve(self, msg: DecodeReserveMsg, _peer: object) -> DecodeReserveReplyMsg:
        self.asks += 1
        if self.asks <= self.full_for:
            return DecodeReserveReplyMsg([])
        return DecodeReserveReplyMsg([3, 4], "decode-0.kv.", "127.0.0.1:9")


@pytest.fixture
def node(request: pytest.FixtureRequest) -> Iterator[FullDecodeNode]:
    n = FullDecodeNode(request.param)
    yield n
    n.server.stop()


def _target(address: str) -> DecodeTarget:
    return DecodeTarget("decode-0", address)


@pytest.mark.parametrize("node", [5], indirect=True)
def test_the_prefill_waits_while_the_decode_node_is_full(node: FullDecodeNode) -> None:
    handoff = DecodeHandoff(SECRET, PrefillConfig(reserve_timeout_s=30))
    try:
        dest = handoff.reserve(7, _target(node.server.address), 19)
    finally:
        handoff.close()
    assert node.asks == 6
    assert dest.block_ids == [3, 4] and dest.num_tokens == 19 and dest.prefix == "decode-0.kv."


@pytest.mark.parametrize("node", [1 << 30], indirect=True)
def test_no_room_within_the_deadline_fails_naming_the_node_and_the_key(
    node: FullDecodeNode,
) -> None:
    handoff = DecodeHandoff(SECRET, PrefillConfig(reserve_timeout_s=0.3))
    start = time.monotonic()
    try:
        with pytest.raises(
            TransferError,
            match=r"decode-0 had no room for 19 tokens .*"
            r"reserve_timeout_s",
        ):
            handoff.reserve(7, _target(node.server.address), 19)
    finally:
        handoff.close()
    assert node.asks > 1  # it asked again, it did not give up at once
    assert time.monotonic() - start < 10


def _num_open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_decode_node_restarted_again_and_again_leaves_no_connections_behind() -> None:
    """The decode node is restarted 20 times under its id, each time at a new address (a
    task names the current one): the prefill's hand-off reserves on each, and keeps only
    the connection to the live one. A client kept per address ever used would hold its
    sockets (reconnecting to a dead address) for the life of the prefill node."""
    handoff = DecodeHandoff(SECRET, PrefillConfig(reserve_timeout_s=30))
    try:
        for i in range(21):
            node = FullDecodeNode(0)
            try:
                dest = handoff.reserve(7, _target(node.server.address), 19)
            finally:
                node.server.stop()
            assert dest.block_ids == [3, 4]
            if i == 0:
                before = _num_open_fds()  # NOTE: after the first: the ZeroMQ context is up
        after = _num_open_fds()
    finally:
        handoff.close()
    # NOTE: each client left behind holds several descriptors (its socket and its
    # handshake monitor's); a few of slack for anything else the process opens meanwhile
    assert after - before < 10, (before, after)
