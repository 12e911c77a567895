"""Links between pipeline stages: a chunk's activations go down, results come back up.

A frame is a fixed header plus the raw bytes of at most one tensor (never pickle):

    HEADER "<4sBBBBQIII4IQ": magic "MCSF", version, kind, dtype code, ndim, req_id,
    index, start, count, shape[4], payload bytes

    kind    index        start                count              tensor
    BEGIN   -            reused tokens        flags (RETURN_KV)  token ids (n,) int64
    CHUNK   chunk no.    first position       tokens             hidden (tokens, hidden)
    END     -            -                    -                  -
    RESULT  -            -                    -                  logits (vocab,) float32
    KV      layer        0 = K, 1 = V         -                  (tokens, kv_heads, head_dim)
    ERROR   -            -                    good reused blocks utf-8 message, uint8
    DEST    -            -                    -                  msgpack StreamPlan, uint8
    WROTE   first layer  -                    -                  msgpack StreamReport, uint8

BEGIN's `index` counts the stages the prompt went through (each stage adds one as it
passes it on); the last stage's RESULT carries it back, so the first stage knows how many
WROTE frames (one per later stage) a prompt with a DEST plan gets.

`LocalStageLink` pairs pass frames through queues (stages as threads of one process);
`TcpStageLink` carries them over TCP after a mutual HMAC-SHA256 challenge on the cluster
secret (`stageauth`). Sends are asynchronous (a sender thread), receives are read ahead
(a reader thread), so a stage never waits on the network while it could compute. A link
that broke (the peer died, an error) says so at once (`ended`), so a leader need not wait
for its next request to find out. A later stage accepts its upstream link with
`stagelisten.StageListener`.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import struct
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import IntEnum
from typing import Final

import torch
from torch import Tensor

from mooncake.errors import AuthError, ProtocolError, TransferError
from mooncake.roles.prefill.group import auth as stageauth
from mooncake.transfer import wire

log = logging.getLogger(__name__)

MAGIC: Final = b"MCSF"
VERSION: Final = 1
HEADER = struct.Struct("<4sBBBBQIII4IQ")
RETURN_KV: Final = 1  # BEGIN flag: every later stage sends its KV of the prompt back up
MAX_FRAME_BYTES: Final = 1 << 31
_DTYPES: Final = {
    1: torch.float32,
    2: torch.bfloat16,
    3: torch.float16,
    4: torch.int64,
    5: torch.uint8,
}
_CODES: Final = {v: k for k, v in _DTYPES.items()}


class FrameKind(IntEnum):
    BEGIN = 1
    CHUNK = 2
    END = 3
    RESULT = 4
    KV = 5
    ERROR = 6
    DEST = 7
    WROTE = 8


_KINDS: Final = frozenset(int(k) for k in FrameKind)


@dataclass(frozen=True)
class StageFrame:
    """One message between stages; see the module table for what each field means."""

    kind: FrameKind
    req_id: int
    index: int = 0
    start: int = 0
    count: int = 0
    tensor: Tensor | None = None

    @classmethod
    def error(cls, req_id: int, message: str, good_blocks: int = 0, index: int = 0) -> StageFrame:
        data = torch.frombuffer(bytearray(message.encode() or b"?"), dtype=torch.uint8)
        return cls(FrameKind.ERROR, req_id, index=index, count=good_blocks, tensor=data)

    @classmethod
    def packed(cls, kind: FrameKind, req_id: int, payload: bytes, index: int = 0) -> StageFrame:
        """A frame carrying encoded bytes (a msgpack struct) as its tensor."""
        data = torch.frombuffer(bytearray(payload or b"\0"), dtype=torch.uint8)
        return cls(kind, req_id, index=index, count=len(payload), tensor=data)

    @property
    def payload(self) -> bytes:
        """The bytes a `packed` frame carries."""
        if self.tensor is None or self.tensor.dtype != torch.uint8:
            raise ProtocolError(f"a {self.kind.name} frame without its payload")
        return bytes(self.tensor.numpy())[: self.count]

    @property
    def message(self) -> str:
        assert self.tensor is not None
        return bytes(self.tensor.numpy()).decode(errors="replace")


class StageTimeoutError(TransferError):
    """No frame within the deadline (a stopped peer closes nothing): the link is broken."""


class BaseStageLink(ABC):
    """A bidirectional frame channel to the neighbouring stage."""

    @abstractmethod
    def send(self, frame: StageFrame) -> None:
        """Queue `frame` (its tensor must not change afterwards); raises TransferError if
        the link is broken. Returns at once."""

    @abstractmethod
    def recv(self, timeout: float | None = None) -> StageFrame | None:
        """The next frame, or None once the peer closed. Raises StageTimeoutError when none
        came within `timeout` seconds, TransferError when the link failed."""

    @abstractmethod
    def close(self) -> None:
        """Flush queued frames and close; the peer's recv then returns None."""


class LocalStageLink(BaseStageLink):
    """One end of an in-process link; build both ends with `local_link_pair`."""

    def __init__(
        self,
        inbox: queue.SimpleQueue[StageFrame | None],
        outbox: queue.SimpleQueue[StageFrame | None],
    ):
        self._inbox, self._outbox = inbox, outbox

    def send(self, frame: StageFrame) -> None:
        self._outbox.put(frame)

    def recv(self, timeout: float | None = None) -> StageFrame | None:
        try:
            return self._inbox.get(timeout=timeout)
        except queue.Empty as e:
            raise StageTimeoutError(f"no frame from the next stage within {timeout} s") from e

    def close(self) -> None:
        self._outbox.put(None)


def local_link_pair() -> tuple[LocalStageLink, LocalStageLink]:
    a: queue.SimpleQueue[StageFrame | None] = queue.SimpleQueue()
    b: queue.SimpleQueue[StageFrame | None] = queue.SimpleQueue()
    return LocalStageLink(a, b), LocalStageLink(b, a)


def _recv_exact(sock: socket.socket, n: int) -> bytearray | None:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        r = sock.recv_into(view[got:])
        if r == 0:
            if got == 0:
                return None
            raise ProtocolError(f"stage link closed mid-frame ({got} of {n} bytes)")
        got += r
    return buf


def _encode(frame: StageFrame) -> tuple[bytes, memoryview | None]:
    t = frame.tensor
    shape: list[int] = [] if t is None else list(t.shape)
    if len(shape) > 4:
        raise ProtocolError(f"stage frames carry tensors of at most 4 dims, got {shape}")
    payload = None
    if t is not None:
        raw = t.detach().to("cpu").contiguous().view(-1).view(torch.uint8)
        payload = raw.numpy().data
    header = HEADER.pack(
        MAGIC,
        VERSION,
        int(frame.kind),
        0 if t is None else _CODES[t.dtype],
        len(shape),
        frame.req_id,
        frame.index,
        frame.start,
        frame.count,
        *(shape + [0] * (4 - len(shape))),
        0 if payload is None else payload.nbytes,
    )
    return header, payload


def _read_frame(sock: socket.socket, max_bytes: int) -> StageFrame | None:
    raw = _recv_exact(sock, HEADER.size)
    if raw is None:
        return None
    magic, version, kind, code, ndim, req_id, index, start, count, *rest = HEADER.unpack(raw)
    shape, nbytes = rest[:ndim], rest[4]
    if magic != MAGIC or version != VERSION:
        raise ProtocolError(f"not a v{VERSION} stage frame (magic {magic!r}, version {version})")
    if kind not in _KINDS or ndim > 4 or (code and code not in _DTYPES):
        raise ProtocolError(f"bad stage frame header: kind {kind}, dtype {code}, ndim {ndim}")
    if nbytes > max_bytes:
        raise ProtocolError(f"stage frame of {nbytes} bytes exceeds the {max_bytes} limit")
    tensor = None
    if code:
        dtype = _DTYPES[code]
        numel = 1
        for d in shape:
            numel *= d
        if numel * dtype.itemsize != nbytes:
            raise ProtocolError(f"stage frame shape {shape} {dtype} does not match {nbytes} bytes")
        payload = _recv_exact(sock, nbytes) if nbytes else bytearray()
        if payload is None:
            raise ProtocolError("stage link closed mid-frame")
        tensor = (
            torch.frombuffer(payload, dtype=dtype).view(shape)
            if nbytes
            else torch.empty(shape, dtype=dtype)
        )
    return StageFrame(FrameKind(kind), req_id, index, start, count, tensor)


class TcpStageLink(BaseStageLink):
    """A stage link over an authenticated TCP socket, with sender and reader threads."""

    def __init__(self, sock: socket.socket, max_frame_bytes: int = MAX_FRAME_BYTES):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock, self._max = sock, max_frame_bytes
        self._out: queue.SimpleQueue[StageFrame | None] = queue.SimpleQueue()
        self._in: queue.SimpleQueue[StageFrame | BaseException | None] = queue.SimpleQueue()
        self._failed: BaseException | None = None
        self.ended = threading.Event()  # set once the link carries no more frames either way
        self._sender = threading.Thread(target=self._send_loop, name="stage-send", daemon=True)
        self._reader = threading.Thread(target=self._read_loop, name="stage-read", daemon=True)
        self._sender.start()
        self._reader.start()

    @classmethod
    def connect(
        cls, host: str, port: int, secret: bytes, timeout: float = wire.HANDSHAKE_TIMEOUT_S
    ) -> TcpStageLink:
        """Dial the next stage and prove both sides know `secret`, all within `timeout`
        seconds; raises AuthError (wrong secret, or no answer in time) or TransferError."""
        deadline = time.monotonic() + timeout
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as e:
            raise TransferError(f"cannot reach pipeline stage at {host}:{port}: {e}") from e
        try:
            stageauth.client_handshake(sock, secret, deadline)
        except (OSError, AuthError) as e:
            sock.close()
            if isinstance(e, AuthError):
                raise
            raise AuthError(f"no handshake with the pipeline stage at {host}:{port}: {e}") from e
        sock.settimeout(None)
        return cls(sock)

    def _send_loop(self) -> None:
        try:
            while (frame := self._out.get()) is not None:
                header, payload = _encode(frame)
                self._sock.sendall(header)
                if payload is not None and payload.nbytes:
                    self._sock.sendall(payload)
            self._sock.shutdown(socket.SHUT_WR)
        except OSError as e:
            self.ended.set()  # NOTE: before _failed, so a failing send() sees `ended` set
            self._failed = e
            log.warning("stage link send failed: %s", e)

    def _read_loop(self) -> None:
        try:
            while (frame := _read_frame(self._sock, self._max)) is not None:
                self._in.put(frame)
            self.ended.set()  # NOTE: before the None, so a failing recv() sees it set
            self._in.put(None)
        except (OSError, ProtocolError) as e:
            self.ended.set()
            self._in.put(e)

    def send(self, frame: StageFrame) -> None:
        if self._failed is not None:
            raise TransferError(f"stage link is broken: {self._failed}") from self._failed
        self._out.put(frame)

    def recv(self, timeout: float | None = None) -> StageFrame | None:
        try:
            item = self._in.get(timeout=timeout)
        except queue.Empty as e:
            raise StageTimeoutError(f"no frame from the pipeline peer within {timeout} s") from e
        if isinstance(item, BaseException):
            self._in.put(item)  # every later recv fails the same way
            raise TransferError(f"stage link failed: {item}") from item
        if item is None:
            self._in.put(None)
        return item

    def close(self, timeout: float | None = None) -> None:
        """Flush queued frames and close; a peer that has not taken them all within
        `timeout` seconds (stopped, or its network dark) is cut off as by `abort`."""
        self._out.put(None)
        self._sender.join(timeout)
        with contextlib.suppress(OSError):  # wakes our reader (a close alone would not)
            self._sock.shutdown(socket.SHUT_RDWR)  # and a sender stuck past `timeout`
        self._sender.join()
        self._sock.close()

    def abort(self) -> None:
        """Close at once, dropping queued frames (the peer is gone or being replaced)."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # a sender stuck on a stalled peer fails
        self.close()
