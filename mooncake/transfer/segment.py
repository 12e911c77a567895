"""Local segments: memory this node registered under a name, which peers read and write.

A segment is one contiguous region (a numpy array, a torch tensor, or a shared-memory arena
the engine allocated). Peers address it by (name or token, offset); every access is
bounds-checked here, on the owner's side, whatever the initiator checked.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mooncake.errors import TransferError
from mooncake.native import numa
from mooncake.native.dataloop import SegmentIndex
from mooncake.native.memory import BufferView, buffer_view
from mooncake.native.shm import ShmArena, new_name
from mooncake.transfer.types import EndpointDesc, RdmaKeyDesc, SegmentDesc

log = logging.getLogger(__name__)

MAX_NAME_BYTES = 256  # segment names are short identifiers, never payloads


@dataclass(eq=False)
class Region:
    """One registered segment of this node."""

    name: str
    token: int  # random u64 identifying this registration on the wire
    view: BufferView
    array: np.ndarray | None  # uint8 view of the bytes; None for device memory
    arena: ShmArena | None = None  # set when the segment lives in POSIX shared memory
    rdma_keys: list[RdmaKeyDesc] = field(default_factory=list)  # filled by the rdma transport
    rdma_handles: list[Any] = field(default_factory=list)  # MR objects kept alive

    @property
    def num_bytes(self) -> int:
        return self.view.num_bytes

    @property
    def location(self) -> str:
        return self.view.location

    def describe(
        self, node: str, host_id: str, endpoints: list[EndpointDesc], preferred_nics: list[str]
    ) -> SegmentDesc:
        """The descriptor peers need to reach this segment on `node`."""
        return SegmentDesc(
            name=self.name,
            token=self.token,
            num_bytes=self.num_bytes,
            location=self.location,
            node=node,
            host_id=host_id,
            endpoints=list(endpoints),
            preferred_nics=preferred_nics,
            shm_name=self.arena.name if self.arena is not None else "",
            rdma=list(self.rdma_keys),
        )

    def bounds_error(self, offset: int, length: int) -> str:
        """Why [offset, offset+length) is not a valid range of this segment ("" if it is)."""
        return range_error(self.name, self.num_bytes, offset, length)


def range_error(name: str, num_bytes: int, offset: int, length: int) -> str:
    """Why [offset, offset+length) is not inside segment `name` of `num_bytes` ("" if it is)."""
    if length <= 0:
        return f"length must be > 0, got {length}"
    if offset < 0 or offset + length > num_bytes:
        return (
            f"range [{offset}, {offset + length}) is outside segment {name!r} of {num_bytes} bytes"
        )
    return ""


def check_name(name: str) -> None:
    """Raise TransferError unless `name` is a usable segment name."""
    if not name or len(name.encode()) > MAX_NAME_BYTES or "@" in name:
        raise TransferError(
            f"invalid segment name {name!r}: use 1..{MAX_NAME_BYTES} bytes without '@' "
            "('@' separates a name from its owner's host:port)"
        )


class SegmentTable:
    """Thread-safe registry of this node's segments by name and by wire token."""

    def __init__(self, native: bool = True) -> None:
        """`native`: also index host-memory segments for the C request loop when it was
        built (native/dataloop.py), so the TcpServer serving this table uses it."""
        self._lock = threading.Lock()
        self._by_name: dict[str, Region] = {}
        self._by_token: dict[int, Region] = {}
        self.native = SegmentIndex.create() if native else None
        # called when a removal waits on a loop stuck on a stalled peer (the server sets it
        # to drop its connections, which frees the loop)
        self.on_stuck: Callable[[], object] = lambda: None

    def register(
        self, name: str, buffer: Any, location: str | None = None, view: BufferView | None = None
    ) -> Region:
        """Register `buffer` (no copy) under `name`; raises TransferError if the name is taken
        or the buffer cannot be written in place. `view`: its bytes as the caller's staging
        sees them (device memory), else made here."""
        check_name(name)
        try:
            view = view or buffer_view(buffer, location)
        except ValueError as e:
            raise TransferError(f"cannot register segment {name!r}: {e}") from e
        array = np.frombuffer(view.mv, dtype=np.uint8) if view.mv is not None else None
        return self._add(Region(name, secrets.randbits(64) or 1, view, array))

    def allocate(self, name: str, num_bytes: int, location: str | None = None) -> Region:
        """Create a zero-filled shared-memory segment, so peers on this host can map it;
        its pages go to the NUMA node of `location` ("cpu:N") where the host has several
        (None: labelled "cpu:0", its pages wherever they are first touched)."""
        check_name(name)
        if num_bytes <= 0:
            raise TransferError(f"segment {name!r}: size must be > 0 bytes, got {num_bytes}")
        arena = ShmArena.create(num_bytes, new_name(name))
        if location is not None:
            numa.place(arena.array, location)  # NOTE: before any page is touched
        view = buffer_view(arena.array, location or "cpu:0")
        region = Region(name, secrets.randbits(64) or 1, view, arena.array, arena=arena)
        try:
            return self._add(region)
        except TransferError:
            arena.close()
            raise

    def _add(self, region: Region) -> Region:
        with self._lock:
            if region.name in self._by_name:
                raise TransferError(
                    f"segment {region.name!r} is already registered; unregister it first"
                )
            self._by_name[region.name] = region
            self._by_token[region.token] = region
            while self.native is not None and region.array is not None:
                if self.native.add(region.token, region.array) != 1:
                    break  # NOTE: added, or the table is full and Python serves it
                self._stuck(region.name)
        return region

    def _stuck(self, name: str) -> None:
        log.warning(
            "segment %r: a transfer is stuck on a stalled peer; dropping connections "
            "to change the served segments",
            name,
        )
        self.on_stuck()

    def unregister(self, name: str) -> Region:
        """Remove `name` (its shm arena, if any, is unlinked); raises TransferError if unknown."""
        with self._lock:
            region = self._by_name.pop(name, None)
            if region is None:
                raise TransferError(f"segment {name!r} is not registered here")
            del self._by_token[region.token]
        while self.native is not None and not self.native.remove(region.token):
            self._stuck(name)
        if region.arena is not None:
            region.arena.close()
        return region

    def get(self, name: str) -> Region | None:
        """The region registered as `name`, or None."""
        return self._by_name.get(name)

    def by_token(self, token: int) -> Region | None:
        """The region whose wire token is `token`, or None (unknown or unregistered)."""
        return self._by_token.get(token)

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._by_name)

    def close(self) -> None:
        """Unregister everything (unlinking owned shm arenas)."""
        for name in self.names():
            self.unregister(name)
