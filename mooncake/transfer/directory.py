"""Where a segment lives: the directory interface, and the peer-to-peer directory that asks
the owning node itself (upstream's P2P handshake), so no master is needed.

A name is either plain ("kv-pool") and looked up among the known peers, or qualified with
its owner ("kv-pool@10.0.0.7:7000") and asked of that node directly. The master can later
implement `BaseDirectory` from its segment table.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TypeVar

import msgspec

from mooncake.errors import MooncakeError, TransferError
from mooncake.transfer.tcp import control_call
from mooncake.transfer.types import SegmentDesc
from mooncake.transfer.wire import Op, Status, status_text

log = logging.getLogger(__name__)

T = TypeVar("T")
_decode_desc = msgspec.msgpack.Decoder(SegmentDesc).decode


class BaseDirectory:
    """Maps segment names to descriptors."""

    def lookup(self, name: str) -> SegmentDesc | None:  # pragma: no cover - interface
        """The descriptor of `name`, or None if no node has it. May do network I/O."""
        raise NotImplementedError

    def publish(self, desc: SegmentDesc) -> None:
        """This node registered `desc` (a master-backed directory records it)."""

    def withdraw(self, name: str) -> None:
        """This node unregistered `name`."""


def split_name(name: str) -> tuple[str, tuple[str, int] | None]:
    """("seg", ("host", port)) for "seg@host:port"; ("seg", None) for a plain name."""
    if "@" not in name:
        return name, None
    seg, _, hostport = name.rpartition("@")
    host, _, port = hostport.rpartition(":")
    if not seg or not host or not port.isdigit():
        raise TransferError(f"bad segment name {name!r}: expected NAME or NAME@HOST:PORT")
    return seg, (host.strip("[]"), int(port))


class PeerDirectory(BaseDirectory):
    """Resolves names by asking peers' transfer servers (DESCRIBE over an authenticated
    connection). Peers are added with add_peer() or named in qualified segment names."""

    def __init__(self, secret: bytes, timeout_s: float = 5.0):
        self._secret = secret
        self._timeout_s = timeout_s
        self._peers: list[tuple[str, int]] = []
        self._lock = threading.Lock()

    def add_peer(self, host: str, port: int) -> None:
        """Ask this peer too when resolving plain names."""
        with self._lock:
            if (host, port) not in self._peers:
                self._peers.append((host, port))

    def ask(self, host: str, port: int, name: str) -> SegmentDesc | None:
        """The descriptor of `name` held by the node at host:port (None if it has none).
        Raises TransferError if the node cannot be reached or answers nonsense."""
        return self.call(host, port, Op.DESCRIBE, name.encode(), _decode_desc, repr(name))

    def call(
        self, host: str, port: int, op: Op, payload: bytes, decode: Callable[[bytes], T], what: str
    ) -> T | None:
        """One control request `op` to the node at host:port, its reply decoded (None if the
        node has no such segment). Raises TransferError if the node cannot be reached,
        refuses, or answers nonsense; `what` names the object asked about in messages."""
        try:
            status, body = control_call(host, port, self._secret, op, payload, self._timeout_s)
        except (OSError, MooncakeError) as e:
            raise TransferError(f"cannot reach transfer peer {host}:{port}: {e}") from e
        if status == Status.NO_SEGMENT:
            return None
        if status != Status.OK:
            raise TransferError(
                f"peer {host}:{port} refused {op.name} of {what}: {status_text(status)}"
            )
        try:
            return decode(body)
        except msgspec.DecodeError as e:
            raise TransferError(f"peer {host}:{port} sent a malformed {op.name} reply: {e}") from e

    def lookup(self, name: str) -> SegmentDesc | None:
        seg, owner = split_name(name)
        if owner is not None:
            return self.ask(owner[0], owner[1], seg)
        with self._lock:
            peers = list(self._peers)
        errors = []
        for host, port in peers:
            try:
                desc = self.ask(host, port, seg)
            except TransferError as e:
                errors.append(str(e))
                continue
            if desc is not None:
                return desc
        if errors:
            log.warning("segment %r not found; unreachable peers: %s", name, "; ".join(errors))
        return None


class StaticDirectory(BaseDirectory):
    """A fixed table of descriptors (tests, or a directory fed by the master)."""

    def __init__(self, descs: list[SegmentDesc] | None = None):
        self._descs = {d.name: d for d in descs or []}

    def publish(self, desc: SegmentDesc) -> None:
        self._descs[desc.name] = desc

    def withdraw(self, name: str) -> None:
        self._descs.pop(name, None)

    def lookup(self, name: str) -> SegmentDesc | None:
        return self._descs.get(name)
