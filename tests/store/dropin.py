"""Shared by the drop-in's tests: a master child process and clients set up as upstream's
users set them up (store/upstream/store.py)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from mooncake.store.upstream import MooncakeDistributedStore
from tests.store.cluster import SECRET, Child, start_master

MIB = 1 << 20
LEASE_S = 2.0  # the master's read lease: long enough that "read, then remove" meets it


@contextmanager
def secret_env() -> Iterator[None]:
    """MOONCAKE_CLUSTER_SECRET set to the test cluster's secret, as a user sets it."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MOONCAKE_CLUSTER_SECRET", SECRET)
        mp.delenv("MOONCAKE_CONFIG", raising=False)
        yield


@contextmanager
def master() -> Iterator[str]:
    """A master child process; yields its "host:port" as upstream's clients name it."""
    child: Child = start_master(LEASE_S, heartbeat_ttl_s=5.0)
    try:
        yield child.address.removeprefix("tcp://")
    finally:
        child.stop()


def client(master_addr: str, segment_bytes: int = 64 * MIB, buffer_bytes: int = 16 * MIB):
    """A set-up client (positional form, as vLLM's and LMCache's connectors call it)."""
    store = MooncakeDistributedStore()
    rc = store.setup(
        "localhost", "P2PHANDSHAKE", segment_bytes, buffer_bytes, "tcp", "", master_addr
    )
    assert rc == 0, rc
    return store
