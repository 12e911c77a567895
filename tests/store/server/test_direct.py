"""The Store's direct control channel: the same handlers as the RPC behind the data
plane's handshake, a fallback to the RPC, and a service that survives bad peers."""

from __future__ import annotations

import os
from collections.abc import Iterator

import msgspec
import pytest

from mooncake.rpc import wire as rpc_wire
from mooncake.store.client.client import Store
from mooncake.store.metadata.settings import MetadataConfig
from mooncake.store.node.node import StoreNode, TierSizes
from mooncake.store.server import messages as m
from mooncake.store.server.direct import DirectChannel, DirectUnavailable
from mooncake.store.server.service import StoreService
from mooncake.transfer import wire
from mooncake.transfer.wire import REQ, RESP, Op

pytestmark = pytest.mark.timeout(60)
SECRET = b"direct-test-secret-0123456789abcdef"
CFG = MetadataConfig(lease_ttl_s=0.2, heartbeat_ttl_s=5.0)


@pytest.fixture
def service() -> Iterator[StoreService]:
    with StoreService(SECRET, CFG) as svc:
        node = StoreNode("d0", svc.address, SECRET, TierSizes(dram_bytes=1 << 20))
        node.start()
        try:
            yield svc
        finally:
            node.stop()


def _connect(service: StoreService, **kw: object) -> Store:
    return Store.connect(service.address, SECRET, timeout_s=5.0, **kw)  # type: ignore[arg-type]


def test_calls_take_the_direct_channel_and_see_the_same_objects(service: StoreService) -> None:
    """A client puts through the direct channel; a client forced onto the RPC reads the
    very same object, and the other way round."""
    with _connect(service) as fast, _connect(service, direct=False) as slow:
        value = os.urandom(5000)
        fast.put("k", value)
        assert fast._calls.direct is not None and fast._calls.direct.port == service.direct_port
        assert slow._calls.direct is None and slow.get("k") == value
        slow.put("k2", value[::-1])
        assert fast.get("k2") == value[::-1] and fast.exists("k")
        fast.remove("k")
        assert not slow.exists("k")


def test_a_master_without_the_channel_serves_every_call_over_the_rpc() -> None:
    with StoreService(SECRET, CFG, direct=False) as svc:
        node = StoreNode("d1", svc.address, SECRET, TierSizes(dram_bytes=1 << 20))
        node.start()
        try:
            with _connect(svc) as store:
                store.put("k", b"abc")
                assert store.get("k") == b"abc" and store._calls.direct is None
        finally:
            node.stop()


def test_a_peer_without_the_secret_cannot_call(service: StoreService) -> None:
    host = service.address.removeprefix("tcp://").rpartition(":")[0]
    intruder = DirectChannel(host, service.direct_port, b"x" * 32, timeout_s=2.0)
    with pytest.raises(DirectUnavailable, match="no direct connection"):
        intruder.call(m.ExistsMsg("k"), m.KeyReplyMsg)
    intruder.close()
    with _connect(service) as store:
        assert not store.exists("k")


def test_a_malformed_frame_gets_an_error_reply_and_the_service_goes_on(
    service: StoreService,
) -> None:
    host = service.address.removeprefix("tcp://").rpartition(":")[0]
    sock = wire.connect(host, service.direct_port, SECRET, 5.0)
    try:
        bad = b"\x01\x01" + b"\x00" * 8 + b"\x03zzz" + b"\xc1"  # unknown tag, bad msgpack
        wire.send_all(sock, [REQ.pack(Op.CALL, 0, 0, 1, 0, 0, len(bad)), bad])
        head = bytearray(RESP.size)
        wire.recv_exact(sock, head)
        _status, _rid, length = RESP.unpack(head)
        body = bytearray(length)
        wire.recv_exact(sock, body)
        kind, _, err = rpc_wire.decode_frame(
            bytes(body), {b"rpc.error": rpc_wire.msg_type(rpc_wire.ErrorMsg)}
        )
        assert kind == rpc_wire.KIND_ERROR and err.code == rpc_wire.CODE_PROTOCOL  # type: ignore[attr-defined]
        good = rpc_wire.encode_frame(
            msgspec.msgpack.Encoder(), rpc_wire.KIND_REQUEST, 2, m.ExistsMsg("k")
        )
        wire.send_all(sock, [REQ.pack(Op.CALL, 0, 0, 2, 0, 0, len(good)), good])
        wire.recv_exact(sock, head)
        assert RESP.unpack(head)[:2] == (0, 2)  # OK, same connection
    finally:
        sock.close()


def test_a_restarted_master_is_found_again(service: StoreService) -> None:
    """The direct port dies with its master: the client reconnects to the new master's
    port (asked again over the RPC), with no failed call in between."""
    address = service.address
    with _connect(service) as store:
        assert not store.exists("k")
        service.stop()
        with StoreService(SECRET, CFG, address=address) as second:
            node = StoreNode("d2", second.address, SECRET, TierSizes(dram_bytes=1 << 20))
            node.start()
            try:
                store.put("k", b"v")
                assert store.get("k") == b"v"
                assert (
                    store._calls.direct is not None
                    and store._calls.direct.port == second.direct_port
                )
            finally:
                node.stop()


def test_remove_batch_waits_only_while_a_key_is_leased(
    service: StoreService, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unleased keys go in one call with no pause; a key a reader just leased is retried
    until its lease ends, then removed."""
    import mooncake.store.client.client as client

    sleeps: list[float] = []
    real_sleep = client.time.sleep

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        real_sleep(seconds)

    monkeypatch.setattr(client.time, "sleep", sleep)
    with _connect(service) as store:
        store.put_batch(["a", "b"], [b"1", b"2"])
        assert [r.status for r in store.remove_batch(["a", "b"])] == ["ok", "ok"]
        assert sleeps == []
        store.put("c", b"3")
        assert store.get("c") == b"3"  # leases "c" for lease_ttl_s (0.2 s)
        assert [r.status for r in store.remove_batch(["c"])] == ["ok"]
        assert sleeps and not store.exists("c")


def test_a_port_that_stops_connecting_leaves_every_call_on_the_rpc(
    service: StoreService,
) -> None:
    """The master still offers a direct port that refuses connections (as behind a
    firewall): calls go on over the RPC, and the client stops trying the port."""
    with _connect(service) as store:
        store.put("k", b"v1")
        assert store._calls.direct is not None
        assert service.direct is not None
        service.direct.close()  # the port is still offered, nothing listens on it
        assert store.get("k") == b"v1"  # the idle connection was closed: reconnect fails
        store.put("k2", b"v2")
        assert store.get("k2") == b"v2" and store._calls.direct is None


def test_batches_larger_than_the_masters_limit_are_sent_in_chunks(service: StoreService) -> None:
    """exists_batch and remove_batch take any number of keys (the master takes at most
    MAX_BATCH per request): every key gets its answer."""
    keys = [f"many-{i}" for i in range(m.MAX_BATCH + 10)]
    with _connect(service) as store:
        store.put_batch(keys[:3], [b"a", b"b", b"c"])
        assert store.exists_batch(keys) == [True] * 3 + [False] * (len(keys) - 3)
        results = store.remove_batch(keys)
        assert [r.status for r in results[:3]] == ["ok"] * 3
        assert {r.status for r in results[3:]} == {"not_found"} and len(results) == len(keys)
