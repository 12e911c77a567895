"""Memory named by raw virtual address, as upstream Mooncake's Python API names it: which
registered segment holds an address range, on this node (`AddressIndex`) and on a peer
(`AddressDirectory.ask_address`, over the data plane's DESCRIBE_ADDRESS).

A peer's address never travels on the data plane itself: the initiator maps it to (segment
token, offset) with the owner's answer, and the owner's server bounds-checks every access
by token as for any segment. An answer is cached by the initiator; a buffer unregistered
and registered again gets a new token, so a stale answer fails on the owner's side
(NO_SEGMENT) instead of touching the new memory.

    DESCRIBE_ADDRESS  payload msgpack AddressQuery -> reply msgpack BufferDesc
                      (status NO_SEGMENT when no registered buffer holds the whole range)
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from mooncake.errors import ProtocolError
from mooncake.transfer.directory import PeerDirectory
from mooncake.transfer.types import SegmentDesc
from mooncake.transfer.wire import Op, Status


class AddressQuery(msgspec.Struct, frozen=True):
    """Which registered buffer holds [address, address + length) on the asked node."""

    address: int  # a virtual address on the asked node
    length: int  # bytes from `address` that must lie in one buffer, >= 0
    first: bool = False  # True: the first buffer registered there, whatever `address` says


class BufferDesc(msgspec.Struct, frozen=True):
    """One registered buffer of a node: where it starts and the segment registered over it."""

    address: int  # virtual address of the buffer's first byte on its owner
    segment: SegmentDesc  # the segment over the buffer (its token, length, endpoints)

    def holds(self, address: int, length: int) -> bool:
        """Whether [address, address + length) lies inside this buffer."""
        return self.address <= address and address + length <= self.address + (
            self.segment.num_bytes
        )


_encode = msgspec.msgpack.Encoder().encode
_decode_query = msgspec.msgpack.Decoder(AddressQuery).decode
_decode_buffer = msgspec.msgpack.Decoder(BufferDesc).decode


@dataclass(frozen=True)
class Span:
    """A registered buffer of this node."""

    address: int  # virtual address of its first byte
    num_bytes: int
    segment: str  # name of the segment registered over it

    @property
    def end(self) -> int:
        """The address just past its last byte."""
        return self.address + self.num_bytes


class AddressIndex:
    """This node's registered buffers by address; they never overlap. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._starts: list[int] = []  # sorted addresses of the spans
        self._spans: dict[int, Span] = {}  # address -> span, in registration order

    def add(self, address: int, num_bytes: int, segment: str) -> Span | None:
        """Record a buffer; returns the span it overlaps (and records nothing) if any."""
        with self._lock:
            k = bisect.bisect_right(self._starts, address)
            for j in (k - 1, k):
                if 0 <= j < len(self._starts):
                    other = self._spans[self._starts[j]]
                    if other.address < address + num_bytes and address < other.end:
                        return other
            self._starts.insert(k, address)
            self._spans[address] = Span(address, num_bytes, segment)
        return None

    def remove(self, address: int) -> Span | None:
        """Forget the buffer that starts at `address`; returns it (None if there is none)."""
        with self._lock:
            span = self._spans.pop(address, None)
            if span is not None:
                self._starts.remove(address)
        return span

    def find(self, address: int, length: int) -> Span | None:
        """The buffer holding all of [address, address + length), or None."""
        with self._lock:
            k = bisect.bisect_right(self._starts, address) - 1
            if k < 0:
                return None
            span = self._spans[self._starts[k]]
        return span if address + length <= span.end else None

    def first(self) -> Span | None:
        """The earliest registered buffer still registered, or None."""
        with self._lock:
            return next(iter(self._spans.values()), None)

    def spans(self) -> list[Span]:
        """Every buffer, by address."""
        with self._lock:
            return [self._spans[a] for a in self._starts]

    def handler(
        self, describe: Callable[[str], SegmentDesc | None]
    ) -> Callable[[bytes], tuple[Status, bytes]]:
        """The transfer server's DESCRIBE_ADDRESS handler over this index; `describe` gives
        a local segment's descriptor by name."""

        def on_query(payload: bytes) -> tuple[Status, bytes]:
            try:
                q = _decode_query(payload)
            except msgspec.DecodeError as e:
                raise ProtocolError(f"malformed DESCRIBE_ADDRESS query: {e}") from e
            span = self.first() if q.first else self.find(q.address, q.length)
            desc = describe(span.segment) if span is not None else None
            if span is None or desc is None:
                return Status.NO_SEGMENT, b""
            return Status.OK, _encode(BufferDesc(span.address, desc))

        return on_query


class AddressDirectory(PeerDirectory):
    """A PeerDirectory that also maps peers' addresses to segments (DESCRIBE_ADDRESS) and
    answers lookups of the segments it learnt that way without asking again."""

    def __init__(self, secret: bytes, timeout_s: float = 5.0):
        super().__init__(secret, timeout_s)
        self._learnt: dict[str, SegmentDesc] = {}  # "name@host:port" -> latest descriptor

    def ask_address(self, host: str, port: int, query: AddressQuery) -> BufferDesc | None:
        """The buffer of the node at host:port holding the queried range (None if none).
        Raises TransferError if the node cannot be reached or answers nonsense."""
        what = "its first buffer" if query.first else f"address {query.address:#x}"
        found = self.call(host, port, Op.DESCRIBE_ADDRESS, _encode(query), _decode_buffer, what)
        if found is not None:
            with self._lock:
                self._learnt[f"{found.segment.name}@{host}:{port}"] = found.segment
        return found

    def lookup(self, name: str) -> SegmentDesc | None:
        with self._lock:
            desc = self._learnt.get(name)
        return desc if desc is not None else super().lookup(name)
