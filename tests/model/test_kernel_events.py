"""The KV a kernel produced is read only after that kernel's event: pool stores (kvio's
layer writes) wait for it, as the streamed hand-off does (kv/stream.py)."""

from __future__ import annotations

import threading

import torch

from mooncake.kv.layerio import DramKVPool
from mooncake.kv.object import KVLayout


class _KernelEvent:
    """A CUDA event whose kernel finishes writing `dst` (with `final`) only when waited on
    after a while: a reader that does not wait copies the old bytes."""

    def __init__(self, dst: torch.Tensor, final: torch.Tensor, log: list[str]):
        self._done = threading.Timer(0.1, self._finish, args=(dst, final))
        self._done.start()
        self.log = log

    def _finish(self, dst: torch.Tensor, final: torch.Tensor) -> None:
        dst.copy_(final)
        self.log.append("kernel done")

    def synchronize(self) -> None:
        self._done.join()
        self.log.append("waited")


def test_pool_store_waits_for_the_layer_kernel_event() -> None:
    """write_layer's copy into the pool object happens after the event completed: the
    stored object holds the kernel's output, not what the cache held before."""
    layout = KVLayout(1, 2, 1, 4, "float32")
    pool = DramKVPool(layout, b"f" * 16)
    try:
        k = torch.zeros(2, 1, 4)
        v = torch.zeros(2, 1, 4)
        final = torch.arange(8, dtype=torch.float32).reshape(2, 1, 4) + 1
        log: list[str] = []
        put = pool.begin([7], [[1, 2]])
        event = _KernelEvent(k, final, log)
        put.write_layer(0, [0], [k], [v], event)
        put.commit()
        assert put.wait(5.0) == 1
        obj = pool.get(7)
        assert obj is not None
        got = torch.frombuffer(obj, dtype=torch.uint8)[layout.k_offset(0) :][: layout.half_bytes]
        assert torch.equal(got.view(torch.float32), final.reshape(-1))
        assert log == ["kernel done", "waited"]
    finally:
        pool.close()
