"""A real etcd on loopback (Debian's etcd-server), fresh for each test that asks for it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from mooncake.ha.localetcd import LocalEtcd, etcd_binary


@pytest.fixture
def etcd_url(tmp_path: Path) -> Iterator[str]:
    if etcd_binary() is None:
        pytest.skip("no etcd server on this host (Debian: apt-get install etcd-server)")
    etcd = LocalEtcd(tmp_path / "etcd")
    try:
        yield etcd.start()
    finally:
        etcd.stop()
