"""Engines on the verbs emulator for the rdma transport's tests."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

from mooncake.config.rdma import RdmaConfig
from mooncake.transfer import EngineOptions, TransferEngine
from tests.transfer import fake_verbs
from tests.transfer.conftest import SECRET


def rdma_engine(name: str, rdma: RdmaConfig | None = None, **options: Any) -> TransferEngine:
    """An engine with protocol rdma on the emulator: 4 KiB slices, 2 QPs per path."""
    defaults: dict[str, Any] = {"slice_bytes": 4096, "connections_per_peer": 2}
    defaults.update(options)
    provider = defaults.pop("rdma_provider", "verbs")  # the C loop's (test_rdma_cloop.py)
    opts = EngineOptions(protocol="rdma", rdma=rdma or RdmaConfig(), **defaults)
    return TransferEngine(name, SECRET, opts, verbs=fake_verbs, rdma_provider=provider)


@contextlib.contextmanager
def rdma_pair(
    rdma: RdmaConfig | None = None, target_rdma: RdmaConfig | None = None, **options: Any
) -> Iterator[tuple[TransferEngine, TransferEngine]]:
    """Initiator `a` and target `b` on the emulator; `a` knows `b` as a peer."""
    b = rdma_engine("b", target_rdma, **options)
    try:
        a = rdma_engine("a", rdma, **options)
    except BaseException:
        b.close()
        raise
    a.directory.add_peer("127.0.0.1", b.server.port)  # type: ignore[attr-defined]
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def transport(engine: TransferEngine) -> Any:
    return engine._transports["rdma"]


def wait_for(cond: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.002)
    return cond()


def flat_fabric() -> None:
    """Every emulated device on one IPv4 subnet: no router between them, so even the
    link-local RoCEv1 GID reaches every NIC (to test one defect at a time)."""
    for spec in fake_verbs.DEVICES.values():
        spec.subnet = 0
