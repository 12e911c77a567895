"""Device memory over tcp and shm through the staging seam, with CPU tensors standing in for
GPU memory (tests/transfer/fake_cuda.py): bytes, chunking, pipelining, transport choice."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch

from mooncake.native.memory import BufferView
from mooncake.transfer import EngineOptions, TransferEngine, TransferRequest
from mooncake.transfer.staging import Stager
from mooncake.transfer.transport import BaseTransport, TargetCache
from mooncake.transfer.types import SegmentDesc, TransferOp
from tests.transfer.conftest import SECRET
from tests.transfer.fake_cuda import CpuStaging

CHUNK = 16 << 10  # bytes per bounce buffer in these tests
SIZES = [1, CHUNK - 1, CHUNK, 2 * CHUNK, 3 * CHUNK + 4097]  # chunk multiples and not


def _engine(name: str, protocol: str, staging: CpuStaging | None) -> TransferEngine:
    opts = EngineOptions(
        protocol=protocol,  # type: ignore[arg-type]
        slice_bytes=4096,
        group_bytes=8192,
        timeout_s=10.0,
        stage_chunk_bytes=CHUNK,
        copy_threads=2,
    )
    return TransferEngine(name, SECRET, opts, staging=staging)


@pytest.fixture
def staging() -> Iterator[CpuStaging]:
    s = CpuStaging(copy_delay_s=0.001)  # NOTE: a buffer read before its event: stale bytes
    yield s
    s.close()


def _pattern(num_bytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, num_bytes, dtype=np.uint8)


@pytest.mark.parametrize("protocol", ["tcp", "shm"])
def test_device_buffer_round_trip_over_host_transports(protocol: str, staging: CpuStaging) -> None:
    """A device buffer written to a remote host segment and read back into another device
    buffer over tcp and shm is byte exact, for sizes that are and are not chunk multiples;
    the bytes went through the pinned bounce buffers, chunk by chunk."""
    a, b = _engine("a", protocol, staging), _engine("b", protocol, None)
    try:
        a.directory.add_peer("127.0.0.1", b.server.port)  # type: ignore[attr-defined]
        total = (sum(SIZES) + 8 * len(SIZES) + 3) // 4 * 4
        b.allocate("pool", total)
        src = torch.from_numpy(_pattern(total, 1)).view(torch.float32).clone()  # any dtype
        dst = torch.zeros(total // 4, dtype=torch.float32)
        a.register("src", src, "cuda:0")
        a.register("dst", dst, "cuda:0")
        assert a.segments.get("src").array is None  # type: ignore[union-attr]
        offset = 0
        for size in SIZES:
            staging.log.clear()
            w = TransferRequest(TransferOp.WRITE, "src", offset, "pool", offset + 3, size)
            a.transfer([w]).check()
            assert sum(e.startswith("d2h") for e in staging.log) == -(-size // CHUNK)
            r = TransferRequest(TransferOp.READ, "dst", offset, "pool", offset + 3, size)
            a.transfer([r]).check()
            assert sum(e.startswith("h2d") for e in staging.log) == -(-size // CHUNK)
            want = src.view(torch.uint8).numpy()[offset : offset + size]
            assert np.array_equal(dst.view(torch.uint8).numpy()[offset : offset + size], want)
            offset += size + 8
        moved = 2 * sum(SIZES)  # each size written, then read
        assert a.bytes_by_transport() == {protocol: moved}  # counted once, by the sub-batches
    finally:
        a.close()
        b.close()


def test_served_device_segment_over_tcp(staging: CpuStaging) -> None:
    """A peer's device segment is written and read over tcp: the server stages it (before,
    it refused device memory to every transport but rdma)."""
    a, b = _engine("a", "tcp", None), _engine("b", "tcp", staging)
    try:
        a.directory.add_peer("127.0.0.1", b.server.port)  # type: ignore[attr-defined]
        size = 5 * CHUNK + 123
        vram = torch.zeros(size, dtype=torch.uint8)
        b.register("vram", vram, "cuda:1")
        host = a.allocate("host", size)
        host[:] = _pattern(size, 2)
        a.transfer([TransferRequest(TransferOp.WRITE, "host", 0, "vram", 0, size)]).check()
        assert np.array_equal(vram.numpy(), host)
        back = a.allocate("back", size)
        a.transfer([TransferRequest(TransferOp.READ, "back", 0, "vram", 0, size)]).check()
        assert np.array_equal(back, host)
        assert any(e.startswith("h2d") for e in staging.log)
        assert any(e.startswith("d2h") for e in staging.log)
    finally:
        a.close()
        b.close()


def test_device_to_device_between_two_engines(staging: CpuStaging) -> None:
    """Both ends device memory over tcp: staged on the initiator and on the server."""
    a, b = _engine("a", "tcp", staging), _engine("b", "tcp", staging)
    try:
        a.directory.add_peer("127.0.0.1", b.server.port)  # type: ignore[attr-defined]
        size = 2 * CHUNK + 7
        src = torch.from_numpy(_pattern(size, 3))
        dst = torch.zeros(size, dtype=torch.uint8)
        a.register("kv", src, "cuda:0")
        b.register("kv-dst", dst, "cuda:0")
        a.transfer([TransferRequest(TransferOp.WRITE, "kv", 0, "kv-dst", 0, size)]).check()
        assert torch.equal(src, dst)
    finally:
        a.close()
        b.close()


class _Recorder:
    """Sends chunks 'over a wire' that completes only when told, recording the order."""

    def __init__(self, log: list[str]):
        self.log = log
        self.received: dict[int, bytes] = {}

    def send(self, chunk: np.ndarray, pos: int) -> Callable[[], None]:
        self.log.append(f"send {pos}")
        data = chunk.tobytes()

        def wait() -> None:
            self.received[pos] = data
            self.log.append(f"sent {pos}")

        return wait


def test_pipeline_copies_the_next_chunk_while_one_is_on_the_wire(staging: CpuStaging) -> None:
    """stage-out queues the D2H of chunk k+1 before chunk k goes on the wire, and never
    reuses a bounce buffer before the wire it served is done with it."""
    size = 4 * CHUNK + 10
    dev = torch.from_numpy(_pattern(size, 4))
    view = BufferView(None, dev.data_ptr(), size, "cuda:0", dev)
    stager = Stager(staging, CHUNK, 1)
    rec = _Recorder(staging.log)
    stager.out(view, 0, size, rec.send)
    log = [e for e in staging.log if not e.startswith("waited")]
    assert b"".join(rec.received[k * CHUNK] for k in range(5)) == dev.numpy().tobytes()
    for k in range(4):  # D2H k+1 was queued (and ran) before chunk k was sent
        n = min(CHUNK, size - (k + 1) * CHUNK)
        assert log.index(f"d2h {(k + 1) * CHUNK}+{n}") < log.index(f"send {k * CHUNK}") + 2
    for k in range(2, 5):  # buffer k%2 refilled only after chunk k-2 left it
        n = min(CHUNK, size - k * CHUNK)
        assert log.index(f"sent {(k - 2) * CHUNK}") < log.index(f"d2h {k * CHUNK}+{n}")
    assert staging.num_pinned_bytes == 2 * CHUNK  # one pair of bounce buffers, reused


class _Reaches(BaseTransport):
    def __init__(self, name: str):
        super().__init__(lambda *a: None)
        self.name = name

    def can_reach(self, desc: SegmentDesc) -> bool:
        return self.name != "local"


def test_transport_choice_follows_the_local_buffer() -> None:
    """A same-host peer reachable by shm and rdma: a host buffer copies through shm, a
    device buffer goes over rdma (the NIC reads GPU memory in place; shm would stage it)."""
    transports = {n: _Reaches(n) for n in ("local", "shm", "rdma", "tcp")}
    cache = TargetCache(transports, "auto", lambda name: None)  # type: ignore[arg-type]
    desc = SegmentDesc("pool", 1, 4096, "cpu:0", "peer", "host", [], shm_name="x")
    assert cache.choose(desc, on_device=False).name == "shm"
    assert cache.choose(desc, on_device=True).name == "rdma"
    del transports["rdma"]  # no RDMA NIC: the device buffer is staged through shm
    assert cache.choose(desc, on_device=True).name == "shm"
