"""Fixtures of the Transfer Engine tests: engines on loopback and target processes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from mooncake.transfer import EngineOptions, TransferEngine
from tests.transfer.peer import PeerProcess

SECRET = b"transfer-test-secret-0123456789"


def make_engine(name: str, **options: object) -> TransferEngine:
    """An engine on 127.0.0.1 with small, fast-failing settings for tests: 4 KiB slices and
    8 KiB groups, so tcp and shm cut even small requests into several slices."""
    defaults: dict[str, object] = {
        "slice_bytes": 4096,
        "group_bytes": 8192,
        "timeout_s": 5.0,
        "connections_per_peer": 2,
        "copy_threads": 2,
    }
    defaults.update(options)
    return TransferEngine(name, SECRET, EngineOptions(**defaults))  # type: ignore[arg-type]


@pytest.fixture
def engines() -> Iterator[tuple[TransferEngine, TransferEngine]]:
    """Initiator `a` and target `b` in this process; `a` knows `b` as a peer."""
    a, b = make_engine("a", protocol="tcp"), make_engine("b", protocol="tcp")
    a.directory.add_peer("127.0.0.1", b.server.port)  # type: ignore[attr-defined]
    try:
        yield a, b
    finally:
        a.close()
        b.close()


@pytest.fixture
def peer() -> Iterator[PeerProcess]:
    """A target node in another process, serving a shm-backed segment "pool" of 1 MiB."""
    p = PeerProcess.start(SECRET, 1 << 20)
    try:
        yield p
    finally:
        p.kill()


@pytest.fixture
def emulator() -> Iterator[object]:
    """The verbs emulator (tests/transfer/fake_verbs.py) with default devices; fails the
    test if anything used a destroyed QP or CQ (a segfault on real pyverbs)."""
    from tests.transfer import fake_verbs

    fake_verbs.reset()
    try:
        yield fake_verbs
    finally:
        for name in ("fake_0", "fake_1"):
            fake_verbs.cut(name, False)
        crashes = list(fake_verbs.CRASHES)
        fake_verbs.reset()
        assert not crashes, f"use after free in verbs (a crash on hardware): {crashes[:3]}"
