"""Memory named by raw address, as upstream's API names it, mapped onto our segments.

`AddressBook`: each `register_buffer(ptr, size)` becomes one segment of the client's
Transfer Engine over those very bytes, wrapped without a copy as the engine drop-in wraps
them (engine/pointers.py): host memory after /proc/self/maps shows it mapped and writable
(an address that is no memory of this process is refused, not read until it crashes),
CUDA memory (vLLM's store connector registers its GPU KV cache) as a device tensor the
Transfer Engine moves on its GPU path. A later pointer into any registered range resolves
to (segment, offset). NOTE: the CUDA branch has not run on a GPU yet (CPU-only machines).

`BufferHandle`: what `get_buffer` returns, a bytes-like object (the buffer protocol, len,
bytes()) with upstream's `ptr()` and `size()`.
"""

from __future__ import annotations

import bisect
import ctypes
import itertools
from dataclasses import dataclass
from typing import Any

from mooncake.engine.pointers import memory_at
from mooncake.transfer.engine import TransferEngine


@dataclass(frozen=True)
class Registered:
    """One registered range of this process's memory."""

    start: int  # address of its first byte
    size: int  # bytes
    segment: str  # its segment name on the engine
    view: Any  # the array or device tensor over it (kept alive while registered)


class AddressBook:
    """Registered address ranges of one client, sorted by start; not thread-safe on its
    own (the store's lock guards register and unregister)."""

    def __init__(self, engine: TransferEngine, prefix: str):
        self.engine, self.prefix = engine, prefix
        self._starts: list[int] = []
        self._ranges: list[Registered] = []
        self._ids = itertools.count()

    def register(self, ptr: int, size: int) -> None:
        """Register `size` bytes at `ptr` as a segment; the same range again is a no-op.
        Raises ValueError for a null or negative range, one that is no writable memory of
        this process, or one overlapping another."""
        if ptr <= 0 or size <= 0:
            raise ValueError(
                f"register_buffer: need a non-null address and size > 0, got {ptr:#x}, {size}"
            )
        i = bisect.bisect_right(self._starts, ptr)
        if i and (r := self._ranges[i - 1]).start == ptr and r.size == size:
            return
        before = self._ranges[i - 1] if i else None
        after = self._ranges[i] if i < len(self._ranges) else None
        if (before and before.start + before.size > ptr) or (after and ptr + size > after.start):
            raise ValueError(
                f"register_buffer: [{ptr:#x}, +{size}) overlaps a registered buffer; "
                "unregister it first or register the whole range once"
            )
        try:
            view, where = memory_at(ptr, size)
        except ValueError as e:
            raise ValueError(f"register_buffer: {e}") from None
        name = f"{self.prefix}.buf{next(self._ids)}"
        self.engine.register(name, view, where)
        self._starts.insert(i, ptr)
        self._ranges.insert(i, Registered(ptr, size, name, view))

    def unregister(self, ptr: int) -> None:
        """Unregister the range starting at `ptr`; ValueError if none does."""
        i = bisect.bisect_left(self._starts, ptr)
        if i == len(self._starts) or self._starts[i] != ptr:
            raise ValueError(f"unregister_buffer: no buffer registered at {ptr:#x}")
        r = self._ranges.pop(i)
        del self._starts[i]
        self.engine.unregister(r.segment)

    def resolve(self, ptr: int, size: int) -> tuple[str, int, int]:
        """(segment, offset, bytes registered from ptr on) of [ptr, ptr + size); ValueError
        when the range is not inside one registered buffer."""
        i = bisect.bisect_right(self._starts, ptr)
        if i:
            r = self._ranges[i - 1]
            room = r.start + r.size - ptr
            if room >= max(size, 1):
                return r.segment, ptr - r.start, room
        raise ValueError(
            f"[{ptr:#x}, +{size}) is not inside a registered buffer; call register_buffer "
            "on the memory first"
        )

    def clear(self) -> None:
        """Unregister every range (the engine is closing)."""
        while self._starts:
            self.unregister(self._starts[-1])


class BufferHandle(bytearray):
    """An object's bytes (upstream's BufferHandle): a bytearray with `ptr()` (the address
    of its first byte) and `size()`."""

    def ptr(self) -> int:
        return ctypes.addressof(ctypes.c_char.from_buffer(self)) if len(self) else 0

    def size(self) -> int:
        return len(self)
