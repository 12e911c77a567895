"""On a GPU node (marker `gpu`; with `rdma` too where a NIC is needed; skipped elsewhere,
see tests/conftest.py): device memory over every transport with real CUDA, the CUDA
device order against NVML, and the race of a long kernel followed at once by a transfer."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from mooncake.native import cudamap, nvml
from mooncake.store.client.client import Store
from mooncake.transfer import EngineOptions, TransferEngine, TransferRequest
from mooncake.transfer.types import TransferOp
from tests.store.cluster import SECRET as STORE_SECRET
from tests.store.cluster import Child, start_master, start_node
from tests.transfer.conftest import SECRET

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]
SIZES = [64 << 10, (1 << 20) + 13, 64 << 20, 256 << 20]
PEERMEM = Path("/sys/module/nvidia_peermem").is_dir()


def _pair(protocol: str) -> tuple[TransferEngine, TransferEngine]:
    opts = EngineOptions(protocol=protocol, timeout_s=60.0)  # type: ignore[arg-type]
    a, b = TransferEngine("gpu-a", SECRET, opts), TransferEngine("gpu-b", SECRET, opts)
    a.directory.add_peer("127.0.0.1", b.server.port)  # type: ignore[attr-defined]
    return a, b


def _random(num_bytes: int, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(0, 256, (num_bytes,), dtype=torch.uint8, device="cuda", generator=gen)


@pytest.mark.parametrize("protocol", ["tcp", "shm"])
def test_cuda_buffer_over_host_transports(protocol: str) -> None:
    """A CUDA tensor written to a peer's host segment and read back into another CUDA
    tensor, through pinned bounce buffers on a copy stream: byte exact, 64 KiB..256 MiB."""
    a, b = _pair(protocol)
    try:
        b.allocate("pool", max(SIZES))
        for size in SIZES:
            src, dst = _random(size, size), torch.zeros(size, dtype=torch.uint8, device="cuda")
            a.register("src", src)
            a.register("dst", dst)
            a.transfer([TransferRequest(TransferOp.WRITE, "src", 0, "pool", 0, size)]).check()
            a.transfer([TransferRequest(TransferOp.READ, "dst", 0, "pool", 0, size)]).check()
            assert torch.equal(src, dst), size
            a.unregister("src")
            a.unregister("dst")
    finally:
        a.close()
        b.close()


def test_served_cuda_segment_over_tcp() -> None:
    """A peer's CUDA segment (a decode node's KV cache, a VRAM tier) read and written over
    tcp: the server stages it."""
    a, b = _pair("tcp")
    try:
        size = 64 << 20
        vram = torch.zeros(size, dtype=torch.uint8, device="cuda")
        b.register("vram", vram)
        host = a.allocate("host", size)
        host[:] = _random(size, 3).cpu().numpy()
        a.transfer([TransferRequest(TransferOp.WRITE, "host", 0, "vram", 0, size)]).check()
        assert torch.equal(vram.cpu(), torch.from_numpy(host.copy()))
    finally:
        a.close()
        b.close()


def test_torch_and_nvml_agree_on_the_device_order() -> None:
    """torch's cuda:i is the GPU cudamap maps from CUDA_VISIBLE_DEVICES and NVML alone."""
    gpus, notes = nvml.read_gpus()
    if not gpus:
        pytest.skip(f"NVML sees no GPU: {notes}")
    if len({g.name for g in gpus}) > 1 and os.environ.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID":
        pytest.skip("mixed GPU models: CUDA orders them fastest first; set CUDA_DEVICE_ORDER")
    by_torch = cudamap.visible_gpus(gpus, torch_uuids=cudamap.torch_uuids())
    assert len(by_torch) == torch.cuda.device_count()
    assert cudamap.visible_gpus(gpus) == by_torch


@pytest.fixture(scope="module")
def pool() -> Iterator[Child]:
    master = start_master()
    node = start_node("gpu-n0", master, 512 << 20)
    yield master
    node.stop()
    master.stop()


def _race(store: Store, name: str) -> None:
    """A long kernel, then at once a kernel writing the buffer, then put_from: the put
    must carry the second kernel's bytes (the copy engine or NIC waits for it)."""
    size = 64 << 20
    buf = torch.zeros(size, dtype=torch.uint8, device="cuda")
    store.register_buffer(name, buf)
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU time before the fill
    buf.fill_(7)
    store.put_from(name, name, 0, size)  # no event given: the current stream's
    out = torch.zeros(size, dtype=torch.uint8, device="cuda")
    store.register_buffer(f"{name}.out", out)
    store.get_into(name, f"{name}.out", 0)
    assert bool((out == 7).all())


def test_long_kernel_then_put_from_over_tcp(pool: Child) -> None:
    opts = EngineOptions(protocol="tcp", timeout_s=60.0)
    with Store.connect(pool.address, STORE_SECRET, engine_options=opts, timeout_s=60.0) as s:
        _race(s, "race-tcp")


@pytest.mark.rdma
def test_long_kernel_then_put_from_over_rdma(pool: Child) -> None:
    """The same race with the NIC reading GPU memory in place (GPUDirect RDMA)."""
    opts = EngineOptions(protocol="rdma", timeout_s=60.0)
    with Store.connect(pool.address, STORE_SECRET, engine_options=opts, timeout_s=60.0) as s:
        _race(s, "race-rdma")


def _gpu_over_rdma() -> None:
    a, b = _pair("rdma")
    try:
        size = 64 << 20
        src = _random(size, 9)
        a.register("gpu", src)  # NOTE: ibv_reg_mr (peermem) or ibv_reg_dmabuf_mr
        host = b.allocate("host", size)
        a.transfer([TransferRequest(TransferOp.WRITE, "gpu", 0, "host", 0, size)]).check()
        assert torch.equal(src.cpu(), torch.from_numpy(host.copy()))
    finally:
        a.close()
        b.close()


@pytest.mark.rdma
@pytest.mark.skipif(not PEERMEM, reason="nvidia_peermem is not loaded (modprobe nvidia-peermem)")
def test_gpu_registration_with_peermem() -> None:
    _gpu_over_rdma()


@pytest.mark.rdma
@pytest.mark.skipif(
    PEERMEM,
    reason="nvidia_peermem is loaded: `modprobe -r nvidia_peermem` "
    "to test the dma-buf registration path",
)
def test_gpu_registration_with_dmabuf() -> None:
    _gpu_over_rdma()
