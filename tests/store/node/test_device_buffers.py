"""Store.put_from/get_into with device buffers (CPU tensors standing in for GPU memory,
tests/transfer/fake_cuda.py) over tcp against real master and node processes: the bytes
are staged through pinned memory, and a put reads them only after the producing kernel."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from mooncake.store.client.client import Store
from mooncake.transfer.types import EngineOptions
from tests.store.cluster import SECRET, Child, start_master, start_node
from tests.transfer.fake_cuda import CpuStaging

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(60)]
CHUNK = 16 << 10


@pytest.fixture(scope="module")
def cluster() -> Iterator[Child]:
    master = start_master()
    node = start_node("n0", master, 4 << 20)
    yield master
    for c in (node, master):
        c.stop()


@pytest.fixture
def store(cluster: Child) -> Iterator[tuple[Store, CpuStaging]]:
    staging = CpuStaging(copy_delay_s=0.001)
    opts = EngineOptions(protocol="tcp", timeout_s=10.0, stage_chunk_bytes=CHUNK)
    s = Store.connect(cluster.address, SECRET, timeout_s=10.0, engine_options=opts, staging=staging)
    yield s, staging
    s.close()
    staging.close()


def test_put_from_waits_for_the_kernel_then_get_into_device(
    store: tuple[Store, CpuStaging],
) -> None:
    """A kernel still writing the buffer when put_from is called: the put records the
    stream's event and waits for it before the first staged copy, so the pool holds the
    kernel's output; get_into a device buffer brings it back byte for byte."""
    s, staging = store
    size = 3 * CHUNK + 5
    buf = torch.zeros(size, dtype=torch.uint8)
    final = torch.from_numpy(np.random.default_rng(5).integers(0, 256, size, dtype=np.uint8))
    s.register_buffer("kv", buf, "cuda:0")
    staging.launch(lambda: buf.copy_(final), delay_s=0.2)  # returns at once, as a launch
    s.put_from("obj", "kv", 0, size)
    log = staging.log
    first_copy = next(i for i, e in enumerate(log) if e.startswith("d2h"))
    assert log.index("kernel 1") < log.index("waited event after kernel 1") < first_copy
    out = torch.zeros(size, dtype=torch.uint8)
    s.register_buffer("out", out, "cuda:0")
    assert s.get_into("obj", "out", 0) == size
    assert torch.equal(out, final)
    assert s.get("obj") == final.numpy().tobytes()


def test_put_from_waits_for_the_event_given(store: tuple[Store, CpuStaging]) -> None:
    """An explicit `ready` event (the caller's kernel on its own stream) is waited first."""
    s, staging = store
    buf = torch.zeros(1000, dtype=torch.uint8)
    s.register_buffer("kv2", buf, "cuda:0")
    staging.launch(lambda: buf.fill_(9), delay_s=0.1)
    ready = staging.record("cuda:0")
    s.put_from("obj2", "kv2", 0, 1000, ready=ready)
    assert s.get("obj2") == bytes([9]) * 1000
