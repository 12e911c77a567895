"""Device memory over tcp and shm: its bytes staged through pinned host bounce buffers.

The rdma transport reads and writes GPU memory in place (GPUDirect RDMA); every other
transport needs host bytes. So a request whose local buffer is device memory, and a
served READ or WRITE of a device segment, go through two page-locked host buffers of
`stage_chunk_bytes`, chunk by chunk, with the copies queued on a CUDA stream of their own
so that copying one chunk overlaps moving the next over the wire:

    device -> wire (a WRITE sent, a READ served)   wire -> device (a READ, a WRITE served)
      D2H chunk k+1 into buffer (k+1)%2             chunk k arrives in buffer k%2
      while chunk k leaves buffer k%2               while H2D of chunk k-1 runs

A buffer is reused only after the wire (or the copy) it last served is done with it.

`BaseStaging` is the whole CUDA surface: what counts as device memory, pinned buffers,
asynchronous copies with an event each, and the event of the work a caller queued. Only
`CudaStaging` touches torch.cuda; the pipelines (`Stager`) are written against the
interface, and tests run them with CPU tensors standing in for device memory
(tests/transfer/fake_cuda.py). The NIC must not read what a kernel is still writing:
callers that stage or post memory a kernel produced wait for that kernel's event first
(`BaseStaging.record`; kv/stream.py, store/client/client.py put_from).
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from mooncake.native.memory import BufferView, buffer_view


class Event(Protocol):
    """A point in a device stream: synchronize() returns once the work before it is done."""

    def synchronize(self) -> None: ...


# send or receive one chunk of host bytes at `pos` (bytes from the request's start);
# returns wait(), which returns once the chunk's buffer may be reused (raises on failure)
ChunkMove = Callable[[np.ndarray, int], Callable[[], None]]


def _done() -> None:
    return None


class BaseStaging:
    """What the staging pipelines need from a device runtime."""

    def device_view(self, obj: Any, location: str | None) -> BufferView | None:
        """`obj`'s bytes as device memory this staging moves (mv None), or None when `obj`
        is not device memory."""
        raise NotImplementedError

    def pinned(self, num_bytes: int) -> np.ndarray:
        """A page-locked host buffer of `num_bytes` (uint8), kept alive by the array."""
        raise NotImplementedError

    def to_host(self, dst: np.ndarray, view: BufferView, offset: int) -> Event:
        """Queue a copy of len(dst) bytes at `offset` of device `view` into pinned `dst`;
        returns the event after it. Copies of one device run in the order queued."""
        raise NotImplementedError

    def to_device(self, view: BufferView, offset: int, src: np.ndarray) -> Event:
        """Queue a copy of pinned `src` into device `view` at `offset`; returns its event."""
        raise NotImplementedError

    def record(self, location: str) -> Event:
        """The event after the work queued so far on the calling thread's current stream of
        `location`'s device: what a caller's kernels produced there."""
        raise NotImplementedError


class CudaStaging(BaseStaging):
    """CUDA through torch: one copy stream per device, pinned buffers from torch."""

    def __init__(self) -> None:
        import torch  # NOTE: only a node that stages device memory pays for the import

        self._torch = torch
        self._streams: dict[int, Any] = {}
        self._lock = threading.Lock()

    def device_view(self, obj: Any, location: str | None) -> BufferView | None:
        is_cuda = isinstance(obj, self._torch.Tensor) and obj.device.type == "cuda"
        return buffer_view(obj, location) if is_cuda else None

    def pinned(self, num_bytes: int) -> np.ndarray:
        return self._torch.empty(num_bytes, dtype=self._torch.uint8, pin_memory=True).numpy()

    def _stream(self, device: Any) -> Any:
        with self._lock:
            stream = self._streams.get(device.index)
            if stream is None:
                stream = self._streams[device.index] = self._torch.cuda.Stream(device)
        # NOTE: after what the device's default stream has queued (producers' usual stream)
        stream.wait_stream(self._torch.cuda.default_stream(device))
        return stream

    def _copy(self, dst: Any, src: Any, device: Any) -> Event:
        torch = self._torch
        stream = self._stream(device)
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return event

    def _bytes(self, view: BufferView, offset: int, num_bytes: int) -> Any:
        flat = view.owner.reshape(-1).view(self._torch.uint8)
        return flat[offset : offset + num_bytes]

    def to_host(self, dst: np.ndarray, view: BufferView, offset: int) -> Event:
        src = self._bytes(view, offset, len(dst))
        return self._copy(self._torch.from_numpy(dst), src, src.device)

    def to_device(self, view: BufferView, offset: int, src: np.ndarray) -> Event:
        dst = self._bytes(view, offset, len(src))
        return self._copy(dst, self._torch.from_numpy(src), dst.device)

    def record(self, location: str) -> Event:
        torch = self._torch
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(torch.device(location)))
        return event


class Stager:
    """The two pipelines over a `BaseStaging`, with pairs of bounce buffers to lend.

    `staging` None makes a CudaStaging at first use (a node that never stages device
    memory never imports torch.cuda). At most `num_pairs` requests stage at once; more
    wait for a pair. The engine's initiator and its server have a Stager each, so that
    one waiting on the other's peer can never hold the buffers the other needs."""

    def __init__(self, staging: BaseStaging | None, chunk_bytes: int, num_pairs: int):
        assert chunk_bytes > 0 and num_pairs > 0, (chunk_bytes, num_pairs)
        self._staging = staging
        self.chunk_bytes = chunk_bytes  # bytes per bounce buffer
        self._num_pairs = num_pairs
        self._made = 0  # pairs allocated so far (lazily: pinned memory is scarce)
        self._free: queue.SimpleQueue[tuple[np.ndarray, np.ndarray]] = queue.SimpleQueue()
        self._lock = threading.Lock()

    @property
    def staging(self) -> BaseStaging:
        if self._staging is None:
            with self._lock:
                if self._staging is None:
                    self._staging = CudaStaging()
        return self._staging

    def _take(self) -> tuple[np.ndarray, np.ndarray]:
        with self._lock:
            make = self._made < self._num_pairs and self._free.empty()
            self._made += make
        if make:
            return self.staging.pinned(self.chunk_bytes), self.staging.pinned(self.chunk_bytes)
        return self._free.get()

    def out(self, view: BufferView, offset: int, length: int, send: ChunkMove) -> None:
        """Move device bytes [offset, offset+length) of `view` out through `send`, chunk by
        chunk in order; raises what `send` or its wait raise."""
        bufs = self._take()
        n, size = -(-length // self.chunk_bytes), self.chunk_bytes
        sizes = [min(size, length - k * size) for k in range(n)]
        events: list[Event | None] = [None, None]
        waits: list[Callable[[], None]] = [_done, _done]

        def copy(k: int) -> None:  # D2H of chunk k, once its buffer left the wire
            b = k % 2
            waits[b]()
            waits[b] = _done
            events[b] = self.staging.to_host(bufs[b][: sizes[k]], view, offset + k * size)

        try:
            copy(0)
            for k in range(n):
                b = k % 2
                events[b].synchronize()  # type: ignore[union-attr]
                if k + 1 < n:
                    copy(k + 1)  # NOTE: queued before chunk k goes: they overlap
                waits[b] = send(bufs[b][: sizes[k]], k * size)
            for w in waits:
                w()
        finally:
            self._give_back(bufs, events, waits)

    def into(self, view: BufferView, offset: int, length: int, recv: ChunkMove) -> None:
        """Fill device bytes [offset, offset+length) of `view` from `recv`, chunk by chunk;
        returns once the last copy landed; raises what `recv` or its wait raise."""
        bufs = self._take()
        events: list[Event | None] = [None, None]
        size = self.chunk_bytes
        try:
            for k in range(-(-length // size)):
                b, n = k % 2, min(size, length - k * size)
                if events[b] is not None:
                    events[b].synchronize()  # type: ignore[union-attr]
                recv(bufs[b][:n], k * size)()
                events[b] = self.staging.to_device(view, offset + k * size, bufs[b][:n])
            for ev in events:
                if ev is not None:
                    ev.synchronize()
        finally:
            self._give_back(bufs, events, [])

    def _give_back(
        self,
        bufs: tuple[np.ndarray, np.ndarray],
        events: list[Event | None],
        waits: list[Callable[[], None]],
    ) -> None:
        """Return `bufs` once no copy or wire still uses them (after a failure too)."""
        for end in [*waits, *(ev.synchronize for ev in events if ev is not None)]:
            with contextlib.suppress(Exception):  # NOTE: the failure is being raised already
                end()
        self._free.put(bufs)
