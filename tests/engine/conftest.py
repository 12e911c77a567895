"""Fixtures of the mooncake.engine tests: the cluster secret in the environment, an engine
of upstream's API in this process, and one in a child process."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from mooncake.engine import TransferEngine
from tests.engine.peer import Peer

SECRET = "engine-api-test-secret-0123456789"
ENV = {"MOONCAKE_CLUSTER_SECRET": SECRET, "MC_TRANSFER_TIMEOUT": "5"}
PEER_BYTES = 1 << 20


@pytest.fixture(scope="module")
def secret_env() -> Iterator[dict[str, str]]:
    with pytest.MonkeyPatch.context() as mp:
        for key, value in ENV.items():
            mp.setenv(key, value)
        yield ENV


@pytest.fixture(scope="module")
def peer(secret_env: dict[str, str]) -> Iterator[Peer]:
    """A P2PHANDSHAKE engine in a child process with a registered 1 MiB buffer."""
    p = Peer.start(secret_env, PEER_BYTES)
    yield p
    p.stop()


@pytest.fixture
def engine(secret_env: dict[str, str]) -> Iterator[TransferEngine]:
    """An initialized engine in this process (tcp, P2PHANDSHAKE)."""
    te = TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    yield te
    te.close()
