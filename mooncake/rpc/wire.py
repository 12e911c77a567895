"""Wire format of the control plane: typed messages, one frame per message, checked decoding.

A frame is a fixed binary header followed by the msgpack body:

    | offset  | bytes | field                                            |
    |---------|-------|--------------------------------------------------|
    | 0       | 1     | version (1)                                      |
    | 1       | 1     | kind: 1 request, 2 reply, 3 error, 4 event       |
    | 2       | 8     | request id, u64 little-endian (0 for events)     |
    | 10      | 1     | n = length of the tag                            |
    | 11      | n     | tag, ASCII (e.g. b"store.put_start")             |
    | 11 + n  | rest  | msgpack body: the Msg struct, tag included       |

A receiver looks the tag up among the types it registered, so it only ever decodes types it
knows into typed structs; nothing is unpickled. Every failure is a `ProtocolError`.
"""

from __future__ import annotations

import re
import struct
from typing import Any, Final, Generic, TypeVar

import msgspec

from mooncake.errors import ProtocolError, RpcError

VERSION: Final = 1
KIND_REQUEST: Final = 1
KIND_REPLY: Final = 2
KIND_ERROR: Final = 3
KIND_EVENT: Final = 4
KIND_NAMES: Final = {1: "request", 2: "reply", 3: "error", 4: "event"}

DEFAULT_MAX_FRAME_BYTES: Final = (
    8 << 20
)  # bytes; control messages are small, bulk data uses transfer/
MAX_TAG_BYTES: Final = 64
HEAD = struct.Struct("<BBQB")  # version, kind, request id, tag length
_TAG_RE = re.compile(r"[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*)+")

# Error codes carried by ErrorMsg.code.
CODE_PROTOCOL: Final = "protocol"  # the request was malformed, too large, or of an unknown type
CODE_ERROR: Final = "error"  # the handler raised a MooncakeError (an expected failure)
CODE_INTERNAL: Final = "internal"  # the handler crashed (a bug on the server side)


class Msg(msgspec.Struct, frozen=True, tag=True):
    """Base of every control-plane message.

    Subclasses name a stable, namespaced tag and repeat `frozen=True` (for mypy; msgspec
    inherits it anyway): `class PutStartMsg(Msg, frozen=True, tag="store.put_start")`.
    The tag, not the class name, identifies the type on the wire, so renaming a class is safe
    and renaming a tag is a protocol change. Unknown fields are ignored when decoding, so a
    new field with a default value is compatible with older peers.
    """


class ErrorMsg(Msg, frozen=True, tag="rpc.error"):
    """The reply to a request that failed; re-raised by the client as a `RemoteError`."""

    code: str  # CODE_PROTOCOL, CODE_ERROR or CODE_INTERNAL
    message: str  # human-readable, says what went wrong
    remote_type: str = ""  # class name of the exception raised on the server, if any


M = TypeVar("M", bound=Msg)


class MsgType(Generic[M]):
    """What a side needs to send or receive one message type: its tag and a reusable decoder."""

    __slots__ = ("cls", "tag", "tag_bytes", "decoder")

    def __init__(self, cls: type[M]):
        assert isinstance(cls, type) and issubclass(cls, Msg), f"{cls!r} is not a Msg subclass"
        tag = cls.__struct_config__.tag
        if not isinstance(tag, str) or not _TAG_RE.fullmatch(tag) or len(tag) > MAX_TAG_BYTES:
            raise TypeError(
                f"{cls.__name__} needs a stable namespaced tag such as "
                f'`class {cls.__name__}(Msg, frozen=True, tag="component.verb")` '
                f"(lowercase, dotted, at most {MAX_TAG_BYTES} characters); got {tag!r}"
            )
        self.cls: type[M] = cls
        self.tag: str = tag
        self.tag_bytes: bytes = tag.encode()
        self.decoder: msgspec.msgpack.Decoder[M] = msgspec.msgpack.Decoder(cls)


_TYPES: dict[type, MsgType[Any]] = {}


def msg_type(cls: type[M]) -> MsgType[M]:
    """The cached `MsgType` of `cls`; raises TypeError if `cls` has no valid tag."""
    info = _TYPES.get(cls)
    if info is None:
        info = _TYPES[cls] = MsgType(cls)
    return info


def encode_frame(encoder: msgspec.msgpack.Encoder, kind: int, req_id: int, msg: Msg) -> bytes:
    """One frame carrying `msg`; `encoder` is reused by the caller (one per thread)."""
    tag = msg_type(type(msg)).tag_bytes
    return HEAD.pack(VERSION, kind, req_id, len(tag)) + tag + encoder.encode(msg)


def parse_head(frame: bytes | memoryview, max_frame_bytes: int) -> tuple[int, int, bytes, int]:
    """(kind, request id, tag, body offset) of a frame; raises ProtocolError if malformed."""
    size = len(frame)
    if size > max_frame_bytes:
        raise ProtocolError(f"frame of {size} bytes exceeds the limit of {max_frame_bytes} bytes")
    if size < HEAD.size:
        raise ProtocolError(f"frame of {size} bytes is shorter than the {HEAD.size}-byte header")
    version, kind, req_id, tag_len = HEAD.unpack_from(frame)
    if version != VERSION:
        raise ProtocolError(f"unsupported wire version {version} (this side speaks {VERSION})")
    if kind not in KIND_NAMES:
        raise ProtocolError(f"unknown frame kind {kind}")
    end = HEAD.size + tag_len
    if tag_len == 0 or tag_len > MAX_TAG_BYTES or end > size:
        raise ProtocolError(f"bad tag length {tag_len} in a frame of {size} bytes")
    return kind, req_id, bytes(frame[HEAD.size : end]), end


def decode_body(info: MsgType[M], frame: bytes | memoryview, offset: int) -> M:
    """Decode the body of `frame` as `info.cls`; raises ProtocolError on any invalid input."""
    try:
        return info.decoder.decode(memoryview(frame)[offset:])
    except msgspec.DecodeError as e:  # includes ValidationError: wrong types, missing fields
        raise ProtocolError(f"invalid {info.tag} message: {e}") from e
    except Exception as e:  # NOTE: a Msg's __post_init__ may raise anything; a peer must not
        raise ProtocolError(f"invalid {info.tag} message: {type(e).__name__}: {e}") from e


def decode_frame(
    frame: bytes, known: dict[bytes, MsgType[Any]], max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
) -> tuple[int, int, Msg]:
    """(kind, request id, message) of a frame whose tag is in `known`; else ProtocolError."""
    kind, req_id, tag, offset = parse_head(frame, max_frame_bytes)
    info = known.get(tag)
    if info is None:
        raise ProtocolError(f"unknown message tag {show_tag(tag)}")
    return kind, req_id, decode_body(info, frame, offset)


def show_tag(tag: bytes) -> str:
    """A tag from the network, printable in a log line whatever its bytes."""
    return repr(tag.decode("ascii", "replace")[:MAX_TAG_BYTES])


class RemoteError(RpcError):
    """The server answered a call with an error; `str(e)` carries the server's message."""

    def __init__(self, text: str, *, code: str, remote_type: str, remote_message: str):
        super().__init__(text)
        self.code = code  # CODE_PROTOCOL, CODE_ERROR or CODE_INTERNAL
        self.remote_type = (
            remote_type  # class name of the exception on the server, e.g. "StoreError"
        )
        self.remote_message = remote_message  # the server's own message, unprefixed


class RemoteProtocolError(RemoteError, ProtocolError):
    """The server could not decode our request (unknown type, wrong schema, too large)."""


_ERROR_TYPE: Final = msg_type(ErrorMsg)


def unpack_reply(
    info: MsgType[M],
    frame: bytes | memoryview,
    kind: int,
    tag: bytes,
    offset: int,
    call: Msg,
    address: str,
) -> M:
    """The reply of type `info` in `frame` answering `call`, or raise the error it carries."""
    if kind == KIND_REPLY and tag == info.tag_bytes:
        return decode_body(info, frame, offset)
    what = f"{msg_type(type(call)).tag} to {address}"  # only on the error paths
    if kind == KIND_ERROR and tag == _ERROR_TYPE.tag_bytes:
        err = decode_body(_ERROR_TYPE, frame, offset)
        cls = RemoteProtocolError if err.code == CODE_PROTOCOL else RemoteError
        text = f"{what} failed remotely: {err.remote_type or err.code}: {err.message}"
        raise cls(text, code=err.code, remote_type=err.remote_type, remote_message=err.message)
    raise ProtocolError(
        f"{what}: expected a {info.tag} reply, got a {KIND_NAMES.get(kind, '?')} {show_tag(tag)}"
    )
