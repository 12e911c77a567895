"""`BufferPool`: registered host buffers leased for a Store's zero-copy calls, as upstream's.

Upstream Mooncake exports `from mooncake import BufferPool` (kvcache-ai/Mooncake
`mooncake-wheel/mooncake/buffer_pool.py`, implemented in
`mooncake-integration/store/buffer_pool.cpp`): leases of registered memory to pass to
`put_from`/`get_into`/`batch_*` by address. Ours keeps its signature, errors and rules:

- leases come first from a local arena the size of the store's local buffer (upstream
  carves its store's own local buffer; ours registers an arena of that size with
  `store.register_buffer` once), then, while the pool holds less than `max_bytes` (default
  twice the local buffer), from overflow buffers aligned to `alignment` and registered one
  by one (unregistered on release);
- `acquire(size, block=None, timeout=None)` waits for a release when the pool is full
  (`block_on_exhaustion`), else raises "buffer pool is exhausted"; `max_regions` caps the
  leases out at once;
- `lease.buffer` is a writable memoryview of `size` bytes; `release()` refuses while such
  views live; a lease dropped unreleased is released; `close()` refuses with leases out;
- `prewarm` does nothing, as upstream's.

The store must have been set up with a local buffer: it exposes `local_buffer_size` (bytes,
as given to `setup`) and upstream's `register_buffer`/`unregister_buffer`. Every error is a
RuntimeError, as upstream's bindings raise.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from typing import Any

import numpy as np

from mooncake.native.memory import aligned_empty
from mooncake.store.metadata.allocator import OffsetAllocator

ARENA_ALIGNMENT = 64  # bytes: a cache line, as upstream's local-buffer allocator hands out


class BufferLease:
    """One leased buffer: `ptr` (its address), `size` (bytes asked for), `buffer`."""

    def __init__(self, pool: BufferPool, memory: np.ndarray, size: int, offset: int | None):
        self._pool: BufferPool | None = pool
        self._memory = memory  # (>= max(size, 1),) uint8: the leased bytes
        self._size = size
        self._offset = offset  # in the pool's arena; None = an overflow buffer
        self._views: list[weakref.ref[np.ndarray]] = []

    @property
    def ptr(self) -> int:
        if self._pool is None:
            raise RuntimeError("buffer lease is closed")
        return int(self._memory.ctypes.data)

    @property
    def size(self) -> int:
        return self._size

    @property
    def buffer(self) -> memoryview:
        """A writable view of the lease's bytes; release() refuses while one lives."""
        if self._pool is None:
            raise RuntimeError("buffer lease is closed")
        view = self._memory[: self._size].view()  # NOTE: its own object, to watch its life
        self._views.append(weakref.ref(view))
        return memoryview(view)  # type: ignore[arg-type]

    def release(self) -> None:
        """Give the buffer back to the pool; raises while exported views exist."""
        if any(ref() is not None for ref in self._views):
            raise RuntimeError("cannot release buffer while exported views exist")
        self._release()

    def _release(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool._give_back(self._memory, self._offset)

    def __enter__(self) -> BufferLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # NOTE: a finalizer must not raise
            self._release()


class BufferPool:
    """Leases of registered buffers for one store (see the module docstring)."""

    def __init__(
        self,
        store: Any,
        max_bytes: int = 0,
        min_size_class: int = 64 * 1024,
        max_size_class: int | None = None,
        alignment: int = 8 * 1024 * 1024,
        block_on_exhaustion: bool = True,
        default_timeout: float | None = None,
        max_regions: int | None = None,
        prewarm_size: int | None = None,
        prewarm_count: int = 0,
    ):
        if store is None:
            raise RuntimeError("MooncakeDistributedStore is not initialized")
        if min_size_class <= 0 or alignment <= 0:
            raise RuntimeError("min_size_class and alignment must be positive")
        if alignment < 8 or alignment & (alignment - 1):
            raise RuntimeError("alignment must be a power of two and at least sizeof(void*)")
        local_bytes = int(getattr(store, "local_buffer_size", 0) or 0)
        if local_bytes <= 0:
            raise RuntimeError("BufferPool requires a store configured with a local buffer")
        self._store = store
        self.max_bytes = max(max_bytes, local_bytes) if max_bytes else 2 * local_bytes
        self.max_size_class = self.max_bytes if max_size_class is None else max_size_class
        self.alignment = alignment  # bytes, of overflow buffers
        self.block_on_exhaustion = block_on_exhaustion
        self.default_timeout = default_timeout
        self.max_regions = max_regions
        self._arena = aligned_empty(local_bytes, ARENA_ALIGNMENT)
        self._arena_alloc = OffsetAllocator(local_bytes, ARENA_ALIGNMENT)
        self._register(int(self._arena.ctypes.data), local_bytes, "local buffer")
        self._cond = threading.Condition()
        self._total_bytes = 0  # bytes leased out, arena and overflow
        self._num_leases = 0
        self._is_closed = False
        if prewarm_size is not None and prewarm_count > 0:
            self.prewarm(prewarm_size, prewarm_count)

    def _register(self, ptr: int, size: int, what: str) -> None:
        if self._store.register_buffer(ptr, size) != 0:
            raise RuntimeError(f"{what} registration failed")

    def acquire(
        self, size: int, block: bool | None = None, timeout: float | None = None
    ) -> BufferLease:
        """A lease of `size` bytes (0 allowed); waits for room per `block`/`timeout`."""
        should_block = self.block_on_exhaustion if block is None else block
        timeout_s = self.default_timeout if timeout is None else timeout
        if timeout_s is not None and timeout_s < 0:
            raise RuntimeError("timeout must be non-negative")
        need = max(size, 1)
        if need > self.max_bytes:
            raise RuntimeError("requested buffer size exceeds pool capacity")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while True:
                self._check_open()
                lease = self._try_lease(size, need)
                if lease is not None:
                    return lease
                if not should_block:
                    raise RuntimeError("buffer pool is exhausted")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise RuntimeError("timed out waiting for buffer")
                self._cond.wait(left)

    buffer = acquire  # upstream's second name for it

    def _try_lease(self, size: int, need: int) -> BufferLease | None:
        """A lease from the arena, else an overflow buffer, or None when the pool is full
        (lock held)."""
        if self._total_bytes + need > self.max_bytes:
            return None
        if self.max_regions is not None and self._num_leases >= self.max_regions:
            return None
        offset = self._arena_alloc.allocate(need)
        if offset is not None:
            memory = self._arena[offset : offset + need]
        else:
            memory = aligned_empty(need, self.alignment)
            self._register(int(memory.ctypes.data), need, "overflow buffer")
        self._total_bytes += need
        self._num_leases += 1
        return BufferLease(self, memory, size, offset)

    def _give_back(self, memory: np.ndarray, offset: int | None) -> None:
        with self._cond:
            if offset is not None:
                self._arena_alloc.free(offset)
            elif self._store.unregister_buffer(int(memory.ctypes.data)) != 0:
                raise RuntimeError("overflow buffer unregistration failed")
            self._total_bytes -= memory.nbytes
            self._num_leases -= 1
            self._cond.notify_all()

    def prewarm(self, size: int, count: int) -> None:
        """Nothing, as upstream's: buffers are made on demand."""

    def close(self) -> None:
        """Unregister the arena; raises while leases are out. Idempotent."""
        with self._cond:
            if self._is_closed:
                return
            if self._num_leases:
                raise RuntimeError("cannot close buffer pool with active leases")
            self._is_closed = True
            self._cond.notify_all()
        self._store.unregister_buffer(int(self._arena.ctypes.data))

    def _check_open(self) -> None:
        if self._is_closed:
            raise RuntimeError("buffer pool is closed")


RegisteredBufferPool = BufferPool
RegisteredBufferLease = BufferLease

__all__ = ["BufferLease", "BufferPool", "RegisteredBufferLease", "RegisteredBufferPool"]
