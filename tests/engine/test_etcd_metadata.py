"""Engines of upstream's API that find each other through etcd ("etcd://HOST:PORT" and
upstream's bare "HOST:PORT"), as upstream's etcd metadata plugin (no etcd auth)."""

from __future__ import annotations

import numpy as np
import pytest

from mooncake.engine import TransferEngine
from mooncake.ha.etcd import Etcd
from mooncake.ha.localetcd import LocalEtcd, etcd_binary

pytestmark = pytest.mark.cluster  # an etcd server


def test_engines_find_each_other_through_etcd(tmp_path, secret_env):
    """Each engine's rpc_meta entry is in etcd under upstream's key; a transfer by name
    lands; close() removes the entry."""
    if etcd_binary() is None:
        pytest.skip("no etcd server on this host (Debian: apt-get install etcd-server)")
    server = LocalEtcd(tmp_path / "etcd", is_secured=False)
    server.start()
    a, b = TransferEngine(), TransferEngine()
    etcd = Etcd([server.url], timeout_s=2.0)
    try:
        hostport = server.url.removeprefix("http://")
        assert a.initialize("127.0.0.1:7001", f"etcd://{hostport}", "tcp", "") == 0
        assert b.initialize_ext("127.0.0.1:7002", hostport, "tcp", "", "etcd") == 0
        entry = etcd.get("mooncake/rpc_meta/127.0.0.1:7002")
        assert entry is not None and b'"rpc_port": %d' % b.get_rpc_port() in entry.value
        src, dst = np.arange(4096, dtype=np.uint8) % 251, np.zeros(4096, dtype=np.uint8)
        assert a.register_memory(src.ctypes.data, src.nbytes) == 0
        assert b.register_memory(dst.ctypes.data, dst.nbytes) == 0
        assert a.transfer_sync_write("127.0.0.1:7002", src.ctypes.data, dst.ctypes.data, 4096) == 0
        assert np.array_equal(src, dst)
        b.close()
        assert etcd.get("mooncake/rpc_meta/127.0.0.1:7002") is None
    finally:
        a.close()
        b.close()
        etcd.close()
        server.stop()
