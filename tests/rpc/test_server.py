"""RpcServer and RpcClient over real sockets: calls, events, remote errors, timeouts, bad peers."""

from __future__ import annotations

import threading
from typing import Any

import msgspec
import pytest
import zmq

from mooncake.errors import ProtocolError, RpcTimeout
from mooncake.rpc import Peer, RemoteError, RemoteProtocolError, RpcClient, wire

from .conftest import (
    MAX_FRAME_BYTES,
    SECRET,
    BadReplyMsg,
    BeatMsg,
    EchoMsg,
    FailMsg,
    Served,
    SleepMsg,
    UnservedMsg,
    decode_error,
    raw_dealer,
    raw_exchange,
    request_frame,
    start_server,
)


def test_echo_round_trip_returns_the_handlers_reply(served: Served, client: RpcClient) -> None:
    reply = client.call(EchoMsg("hello", 42), EchoMsg, timeout_s=5.0)
    assert reply == EchoMsg("hello", 42)
    assert served.calls == [EchoMsg("hello", 42)]
    assert served.peers[0].address == "127.0.0.1"


def test_events_reach_the_event_handler_in_order(served: Served, client: RpcClient) -> None:
    for node_id in range(5):
        client.send_event(BeatMsg(node_id))
    got = [served.events.get(timeout=5.0).node_id for _ in range(5)]
    assert got == [0, 1, 2, 3, 4]
    assert served.calls == []  # events never reach request handlers


def test_remote_mooncake_error_becomes_remote_error_with_its_message(
    served: Served, client: RpcClient
) -> None:
    with pytest.raises(RemoteError) as info:
        client.call(FailMsg(crash=False), EchoMsg)
    e = info.value
    assert e.remote_type == "StoreError" and e.code == wire.CODE_ERROR
    assert "object 'k1' not found" in str(e) and "test.fail" in str(e)
    assert e.remote_message.startswith("object 'k1' not found")


def test_handler_crash_is_an_internal_error_and_the_server_keeps_serving(
    served: Served, client: RpcClient
) -> None:
    with pytest.raises(RemoteError) as info:
        client.call(FailMsg(crash=True), EchoMsg)
    assert info.value.code == wire.CODE_INTERNAL and info.value.remote_type == "KeyError"
    with pytest.raises(RemoteError, match="not a Msg"):
        client.call(BadReplyMsg(), EchoMsg)
    assert client.call(EchoMsg("still here"), EchoMsg).text == "still here"


def test_timeout_names_address_and_type_and_the_late_reply_is_dropped(
    served: Served, client: RpcClient
) -> None:
    with pytest.raises(RpcTimeout) as info:
        client.call(SleepMsg(0.5, "first"), SleepMsg, timeout_s=0.1)
    assert served.address in str(info.value) and "test.sleep" in str(info.value)
    # The first reply arrives while this call waits: it must be dropped, not returned.
    assert client.call(SleepMsg(0.0, "second"), SleepMsg, timeout_s=5.0).label == "second"
    assert client.call(EchoMsg("third"), EchoMsg).text == "third"


def test_unknown_request_type_is_a_remote_protocol_error(client: RpcClient) -> None:
    with pytest.raises(RemoteProtocolError, match="no handler for request 'test.unserved'"):
        client.call(UnservedMsg(), EchoMsg)
    with pytest.raises(ProtocolError):  # RemoteProtocolError is also a ProtocolError
        client.call(UnservedMsg(), EchoMsg)


def test_reply_of_the_wrong_type_is_a_protocol_error(client: RpcClient) -> None:
    with pytest.raises(ProtocolError, match="expected a test.beat reply"):
        client.call(EchoMsg("x"), BeatMsg)


BODY = msgspec.msgpack.encode
HEAD = wire.HEAD.pack


@pytest.mark.parametrize(
    ("name", "frames", "expect"),
    [
        ("garbage", [b"\xff" * 40], "unsupported wire version"),
        ("short", [b"\x01\x01"], "shorter than"),
        ("empty", [b""], "shorter than"),
        ("reply kind", [HEAD(1, wire.KIND_REPLY, 7, 9) + b"test.echo" + BODY({})], "not kind=2"),
        ("bad tag length", [HEAD(1, 1, 7, 200) + b"test.echo"], "bad tag length"),
        ("unknown tag", [HEAD(1, 1, 7, 8) + b"test.zzz" + BODY({"type": "test.zzz"})], "test.zzz"),
        (
            "wrong schema",
            [HEAD(1, 1, 7, 9) + b"test.echo" + BODY({"type": "test.echo", "text": 5})],
            "Expected `str`, got `int`",
        ),
        (
            "other type's body",
            [HEAD(1, 1, 7, 9) + b"test.echo" + BODY({"type": "test.beat"})],
            "Invalid value 'test.beat'",
        ),
        ("truncated msgpack", [request_frame(EchoMsg("hello"))[:-3]], "truncated"),
        ("multipart", [request_frame(EchoMsg("a")), b"more"], "multipart"),
    ],
)
def test_bad_frames_get_an_error_reply_and_the_server_keeps_serving(
    served: Served,
    client: RpcClient,
    zctx: zmq.Context[Any],
    name: str,
    frames: list[bytes],
    expect: str,
) -> None:
    sock = raw_dealer(zctx, served.address, "cluster")
    reply = raw_exchange(sock, *frames)
    assert reply is not None, f"{name}: no error reply"
    req_id, err = decode_error(reply)
    assert err.code == wire.CODE_PROTOCOL and expect in err.message, err
    assert req_id in (0, 7)  # 0 when the header itself could not be read
    assert served.calls == []
    assert client.call(EchoMsg("after " + name), EchoMsg).text == "after " + name


def test_oversized_frame_is_dropped_and_the_server_keeps_serving(
    served: Served, client: RpcClient, zctx: zmq.Context[Any]
) -> None:
    sock = raw_dealer(zctx, served.address, "cluster")
    big = request_frame(EchoMsg("x" * (MAX_FRAME_BYTES + 1)))
    assert raw_exchange(sock, big, wait_ms=300) is None  # MAXMSGSIZE: zmq drops the peer
    assert served.calls == []
    assert client.call(EchoMsg("fine"), EchoMsg).text == "fine"


def test_call_during_an_outage_times_out_and_the_client_reconnects_after_restart() -> None:
    first = start_server()
    address = first.address
    client = RpcClient(address, SECRET, timeout_s=5.0)
    try:
        assert client.call(EchoMsg("before"), EchoMsg).text == "before"
        first.server.stop()
        with pytest.raises(RpcTimeout, match=address):
            client.call(EchoMsg("during"), EchoMsg, timeout_s=0.3)
        second = start_server(bind=address)
        try:
            assert client.call(EchoMsg("after"), EchoMsg).text == "after"
            assert second.calls == [EchoMsg("after")]  # nothing queued during the outage
        finally:
            second.server.stop()
    finally:
        client.close()


def test_threads_share_one_client_and_each_gets_its_own_replies(
    served: Served, client: RpcClient
) -> None:
    errors: list[str] = []

    def work(t: int) -> None:
        for i in range(30):
            reply = client.call(EchoMsg(f"t{t}", i), EchoMsg)
            if reply != EchoMsg(f"t{t}", i):
                errors.append(f"thread {t} call {i} got {reply}")

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert len(served.calls) == 120


def test_no_auth_mode_serves_plain_clients() -> None:
    plain = start_server(secret=None)
    try:
        with RpcClient(plain.address, None) as c:
            assert c.call(EchoMsg("plain"), EchoMsg).text == "plain"
    finally:
        plain.server.stop()


def test_answer_runs_the_handler_on_the_callers_thread_and_returns_the_frame(
    served: Served,
) -> None:
    """answer() (what another transport uses) returns the reply frame a client would get:
    the handler's reply, an error frame for a failing handler or an unknown type, and no
    frame for an event."""
    enc, peer = msgspec.msgpack.Encoder(), Peer(b"", "direct")
    out = served.server.answer(request_frame(EchoMsg("hi", 1), req_id=9), peer, enc)
    assert out is not None
    assert wire.decode_frame(out, {b"test.echo": wire.msg_type(EchoMsg)}) == (
        wire.KIND_REPLY,
        9,
        EchoMsg("hi", 1),
    )
    failed = served.server.answer(request_frame(FailMsg(crash=False)), peer, enc)
    assert failed is not None and decode_error(failed)[1].remote_type == "StoreError"
    unknown = served.server.answer(request_frame(UnservedMsg()), peer, enc)
    assert unknown is not None and decode_error(unknown)[1].code == wire.CODE_PROTOCOL
    event = wire.encode_frame(enc, wire.KIND_EVENT, 0, BeatMsg(3))
    assert served.server.answer(event, peer, enc) is None
    assert served.events.get(timeout=5.0) == BeatMsg(3)
