"""A real etcd on loopback (Debian's etcd-server), fresh for each test that asks for it, with
its auth on (root and a random password, as `up --local` runs it)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from mooncake.ha.etcd import Etcd
from mooncake.ha.localetcd import LocalEtcd, etcd_binary
from mooncake.ha.sealed import Sealer

SECRET = b"a-cluster-secret-for-tests"


@pytest.fixture
def local_etcd(tmp_path: Path) -> Iterator[LocalEtcd]:
    if etcd_binary() is None:
        pytest.skip("no etcd server on this host (Debian: apt-get install etcd-server)")
    server = LocalEtcd(tmp_path / "etcd")
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture
def etcd(local_etcd: LocalEtcd) -> Iterator[Etcd]:
    """A client of `local_etcd`, logged in as its root."""
    client = Etcd([local_etcd.url], timeout_s=2.0, access=local_etcd.access)
    yield client
    client.close()


@pytest.fixture
def sealer() -> Sealer:
    return Sealer(SECRET)
