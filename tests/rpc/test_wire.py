"""The wire codec: valid messages round-trip, and any other input is a clear ProtocolError."""

from __future__ import annotations

import contextlib

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake.errors import ProtocolError
from mooncake.rpc import Msg, wire

from .conftest import BeatMsg, EchoMsg, SleepMsg

KNOWN = {wire.msg_type(t).tag_bytes: wire.msg_type(t) for t in (EchoMsg, SleepMsg, BeatMsg)}
ENCODER = msgspec.msgpack.Encoder()

msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
messages = st.one_of(
    st.builds(EchoMsg, st.text(), st.integers(-(2**63), 2**63 - 1)),
    st.builds(SleepMsg, st.floats(allow_nan=False), st.text()),
    st.builds(BeatMsg, st.integers(0, 2**64 - 1)),
)


@given(msg=messages, kind=st.sampled_from(list(wire.KIND_NAMES)), req_id=st.integers(0, 2**64 - 1))
def test_valid_messages_round_trip(msg: Msg, kind: int, req_id: int) -> None:
    frame = wire.encode_frame(ENCODER, kind, req_id, msg)
    assert wire.decode_frame(frame, KNOWN) == (kind, req_id, msg)


@given(data=st.binary(max_size=200))
def test_random_bytes_raise_only_protocol_error(data: bytes) -> None:
    with contextlib.suppress(ProtocolError):
        wire.decode_frame(data, KNOWN)


@settings(max_examples=150)
@given(
    body=msgpack_values,
    tag=st.sampled_from([b"test.echo", b"test.sleep", b"test.beat", b"test.nope"]),
    kind=st.integers(0, 255),
    version=st.sampled_from([1, 1, 1, 2]),
)
def test_random_msgpack_bodies_raise_only_protocol_error(
    body: object, tag: bytes, kind: int, version: int
) -> None:
    frame = wire.HEAD.pack(version, kind, 1, len(tag)) + tag + msgspec.msgpack.encode(body)
    with contextlib.suppress(ProtocolError):
        wire.decode_frame(frame, KNOWN)


@given(fields=st.dictionaries(st.sampled_from(["type", "text", "num", "x"]), msgpack_values))
def test_random_echo_shaped_dicts_decode_to_valid_echo_or_protocol_error(fields: dict) -> None:
    frame = wire.HEAD.pack(1, 1, 1, 9) + b"test.echo" + msgspec.msgpack.encode(fields)
    try:
        _, _, msg = wire.decode_frame(frame, KNOWN)
    except ProtocolError:
        return
    assert isinstance(msg, EchoMsg) and isinstance(msg.text, str) and isinstance(msg.num, int)


def test_decoder_enforces_the_size_limit() -> None:
    frame = wire.encode_frame(ENCODER, wire.KIND_REQUEST, 1, EchoMsg("x" * 1000))
    with pytest.raises(ProtocolError, match="exceeds the limit of 100 bytes"):
        wire.decode_frame(frame, KNOWN, max_frame_bytes=100)
    assert wire.decode_frame(frame, KNOWN, max_frame_bytes=len(frame))[2] == EchoMsg("x" * 1000)


def test_errors_name_what_was_wrong() -> None:
    unknown = wire.HEAD.pack(1, 1, 1, 8) + b"test.zzz" + msgspec.msgpack.encode({})
    with pytest.raises(ProtocolError, match="unknown message tag 'test.zzz'"):
        wire.decode_frame(unknown, KNOWN)
    bad = wire.HEAD.pack(1, 1, 1, 9) + b"test.echo" + msgspec.msgpack.encode({"type": "test.echo"})
    with pytest.raises(
        ProtocolError, match="invalid test.echo message: Object missing required field `text`"
    ):
        wire.decode_frame(bad, KNOWN)


def test_a_message_type_needs_a_namespaced_tag() -> None:
    class NoTagMsg(Msg, frozen=True):
        x: int

    class FlatTagMsg(Msg, frozen=True, tag="echo"):
        x: int

    for cls in (NoTagMsg, FlatTagMsg):
        with pytest.raises(TypeError, match="stable namespaced tag"):
            wire.msg_type(cls)
