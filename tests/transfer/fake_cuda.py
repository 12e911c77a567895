"""A CUDA device for the staging seam (mooncake/transfer/staging.py) with CPU tensors
standing in for device memory, as strict as the real one where the pipelines could go wrong.

What it emulates:
- device memory: a CPU torch tensor registered at a "cuda:N" location is device memory
  (no host view: only the staging copies reach it), as a CUDA tensor would be;
- a stream per device: copies run on the stream's own thread, in the order queued, after
  `copy_delay_s` each, so a pipeline that reads a bounce buffer before its event completed
  sees stale bytes, as with cudaMemcpyAsync;
- pinned memory: copies refuse host buffers this device did not pin (a non_blocking copy
  to pageable memory is not asynchronous on CUDA: a pipeline relying on it is a bug);
- kernels: `launch(fn, delay_s)` runs `fn` (writing a tensor) on the stream of the calling
  thread after `delay_s`, returning at once as a launch does; `record()` is an event after
  every kernel launched so far.
Every copy and every event waited is appended to `log`, in the order they happened.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from mooncake.native.memory import BufferView, aligned_empty
from mooncake.transfer.staging import BaseStaging


class FakeEvent:
    """A CUDA event: completes when the stream reaches it; synchronize() waits for that."""

    def __init__(self, log: list[str], name: str):
        self._done = threading.Event()
        self._log, self.name = log, name

    def complete(self) -> None:
        self._done.set()

    def synchronize(self) -> None:
        if not self._done.wait(30):
            raise AssertionError(f"event {self.name} never completed")
        self._log.append(f"waited {self.name}")


class _Stream:
    """Work run in the order queued, on a thread of its own."""

    def __init__(self, log: list[str], name: str):
        self._log = log
        self._queue: queue.SimpleQueue[tuple[Callable[[], None], FakeEvent] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            work, event = item
            work()
            event.complete()

    def enqueue(self, name: str, work: Callable[[], None], delay_s: float) -> FakeEvent:
        """Queue `work` (after `delay_s`); returns the event after it."""
        event = FakeEvent(self._log, name)

        def run() -> None:
            time.sleep(delay_s)
            work()
            self._log.append(name)

        self._queue.put((run, event))
        return event

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)


class CpuStaging(BaseStaging):
    """`BaseStaging` over CPU tensors standing in for the memory of CUDA devices: kernels
    on a compute stream, the staging copies on a copy stream of their own (as CudaStaging's),
    so nothing orders a copy after a kernel but an event waited."""

    def __init__(self, copy_delay_s: float = 0.0):
        self.copy_delay_s = copy_delay_s
        self.log: list[str] = []  # "d2h OFFSET+N", "h2d OFFSET+N", "kernel K", "waited X"
        self.num_pinned_bytes = 0
        self._pinned: list[np.ndarray] = []
        self._compute = _Stream(self.log, "fake-cuda-compute")
        self._copy = _Stream(self.log, "fake-cuda-copy")
        self._num_kernels = 0

    def device_view(self, obj: Any, location: str | None) -> BufferView | None:
        if not (isinstance(obj, torch.Tensor) and (location or "").startswith("cuda:")):
            return None
        assert obj.device.type == "cpu" and obj.is_contiguous()
        num_bytes = obj.numel() * obj.element_size()
        return BufferView(None, obj.data_ptr(), num_bytes, str(location), obj)

    def pinned(self, num_bytes: int) -> np.ndarray:
        buf = aligned_empty(num_bytes)
        self._pinned.append(buf)
        self.num_pinned_bytes += num_bytes
        return buf

    def _check_pinned(self, host: np.ndarray) -> None:
        if not any(np.shares_memory(host, p) for p in self._pinned):
            raise ValueError("asynchronous copy with pageable host memory: pin it first")

    @staticmethod
    def _flat(view: BufferView, offset: int, num_bytes: int) -> np.ndarray:
        assert view.mv is None and offset >= 0 and offset + num_bytes <= view.num_bytes
        flat = view.owner.reshape(-1).view(torch.uint8).numpy()
        return flat[offset : offset + num_bytes]  # type: ignore[no-any-return]

    def to_host(self, dst: np.ndarray, view: BufferView, offset: int) -> FakeEvent:
        self._check_pinned(dst)
        src = self._flat(view, offset, len(dst))
        name = f"d2h {offset}+{len(dst)}"
        return self._copy.enqueue(name, lambda: np.copyto(dst, src), self.copy_delay_s)

    def to_device(self, view: BufferView, offset: int, src: np.ndarray) -> FakeEvent:
        self._check_pinned(src)
        dst = self._flat(view, offset, len(src))
        name = f"h2d {offset}+{len(src)}"
        return self._copy.enqueue(name, lambda: np.copyto(dst, src), self.copy_delay_s)

    def launch(self, fn: Callable[[], None], delay_s: float) -> None:
        """A kernel: `fn` runs on the stream after `delay_s`; returns at once."""
        self._num_kernels += 1
        self._compute.enqueue(f"kernel {self._num_kernels}", fn, delay_s)

    def record(self, location: str) -> FakeEvent:
        name = f"event after kernel {self._num_kernels}"
        return self._compute.enqueue(name, lambda: None, 0.0)

    def close(self) -> None:
        self._compute.close()
        self._copy.close()
