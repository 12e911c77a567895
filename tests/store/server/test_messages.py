"""Wire messages: every request decodes with its limits and is answered by `handle`; the
handlers serve a real RpcServer; misuse comes back as a clear error, and serving goes on."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from mooncake.errors import StoreError
from mooncake.rpc import Msg, RemoteError, RpcClient, RpcServer
from mooncake.store.metadata.service import MetadataService
from mooncake.store.server import messages as m
from tests.store.helpers import make_service


def roundtrip(msg: Any) -> Any:
    """`msg` after encoding and decoding with its type's limits."""
    return msgspec.msgpack.decode(msgspec.msgpack.encode(msg), type=type(msg))


def call(svc: MetadataService, msg: Msg, now: float = 0.0) -> Any:
    """The reply to `msg`, both sides through the wire encoding."""
    return roundtrip(m.handle(svc, roundtrip(msg), now))


def test_put_get_remove_through_handle_with_wire_roundtrips():
    svc = make_service({"a": {"dram": 1024}})

    def h(msg: Msg, now: float = 0.0) -> Any:
        return call(svc, msg, now)

    r = h(m.PutStartMsg("k", 100, node_id="a"))
    assert r.result.status == "ok" and r.result.replicas[0].segment == "a-dram"
    assert h(m.PutEndMsg("k")).result.status == "ok"
    got = h(m.GetReplicasMsg("k", node_id="a"), 1.0).result
    assert (got.status, got.size, got.replicas[0].offset) == ("ok", 100, 0)
    assert h(m.ExistsMsg("k")).result.status == "ok"
    assert h(m.RemoveMsg("k"), 2.0).result.status == "leased"
    assert h(m.RemoveMsg("k"), 10.0).result.status == "ok"
    batch = h(m.BatchPutStartMsg(("x", "y"), (64, 4096), node_id="a"))
    assert [x.status for x in batch.results] == ["ok", "no_space"]
    assert [x.status for x in h(m.BatchExistsMsg(("x", "q"))).results] == [
        "not_found",
        "not_found",
    ]
    assert h(m.PinMsg("x", 5.0)).result.status == "ok"
    stats = h(m.StatsMsg()).stats
    assert stats.num_objects == 1 and stats.hits == 1


def test_heartbeat_reply_carries_the_nodes_instructions_and_confirm_commits():
    svc = make_service({"a": {"dram": 512, "ssd": 4096}}, high_watermark=0.75, low_watermark=0.5)
    for i in range(7):
        m.handle(svc, m.PutStartMsg(f"k{i}", 64), 0.0)
        m.handle(svc, m.PutEndMsg(f"k{i}"), 0.0)
    svc.evictor.run(1.0)
    reply = call(svc, m.HeartbeatMsg("a"), 1.0)
    assert reply.is_known and [i.kind for i in reply.instructions] == ["demote"] * 3
    ok = call(svc, m.ConfirmMoveMsg(reply.instructions[0].move_id, True), 2.0)
    assert ok.result.status == "ok"
    assert not call(svc, m.HeartbeatMsg("new"), 2.0).is_known
    svc.check_integrity()


@pytest.mark.parametrize(
    "msg",
    [
        m.PutStartMsg("k" * 257, 10),
        m.PutStartMsg("k", 0),
        m.PutStartMsg("k", 10, replicas=99),
        m.PutStartMsg("k", 10, tiers=()),
        m.GetReplicasMsg(""),
        m.BatchRemoveMsg(tuple(f"k{i}" for i in range(m.MAX_BATCH + 1))),
        m.MountSegmentMsg("n", "s", "dram", 0),
    ],
)
def test_decoding_rejects_oversized_or_malformed_requests(msg):
    raw = msgspec.msgpack.encode(msg)  # encoding does not validate; the receiver must
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(raw, type=type(msg))


def test_segment_misuse_raises_store_error():
    svc = make_service({"a": {"dram": 1024}})
    with pytest.raises(StoreError, match="already mounted"):
        m.handle(svc, m.MountSegmentMsg("b", "a-dram", "dram", 1024), 0.0)
    with pytest.raises(StoreError, match="nothing to unmount"):
        m.handle(svc, m.UnmountSegmentMsg("b", "a-dram"), 0.0)
    assert call(svc, m.UnmountSegmentMsg("a", "a-dram")).num_replicas_dropped == 0


def test_registered_handlers_serve_an_rpc_server_and_survive_misuse():
    svc = make_service({})
    server = RpcServer("tcp://127.0.0.1:0", None)
    m.register(server, svc, clock=lambda: 0.0)
    server.start()
    client = RpcClient(server.address, None, timeout_s=5.0)
    try:
        client.call(m.MountSegmentMsg("a", "a-dram", "dram", 1024), reply_type=m.AckMsg)
        with pytest.raises(RemoteError, match="already mounted"):
            client.call(m.MountSegmentMsg("b", "a-dram", "dram", 64), reply_type=m.AckMsg)
        put = client.call(m.PutStartMsg("k", 10, node_id="a"), reply_type=m.PutStartReplyMsg)
        assert put.result.replicas[0].node_id == "a"
        end = client.call(m.PutEndMsg("k"), reply_type=m.KeyReplyMsg)
        assert end.result.status == "ok"
    finally:
        client.close()
        server.stop()
    svc.check_integrity()
