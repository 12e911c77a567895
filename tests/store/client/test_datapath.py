"""A client's data plane: batch reads that survive a bad descriptor among good ones."""

from __future__ import annotations

import numpy as np

from mooncake.store.client.datapath import DataPath
from mooncake.store.metadata.objects import ReplicaDesc
from mooncake.transfer import EngineOptions, TransferEngine

SECRET = b"datapath-test-secret-0123456789"


def _replica(segment: str, offset: int, size: int, token: int) -> ReplicaDesc:
    return ReplicaDesc(
        segment=segment,
        node_id="b",
        endpoint="",
        tier="dram",
        offset=offset,
        size=size,
        state="complete",
        token=token,
    )


def test_a_stale_descriptor_fails_only_its_own_key_in_a_batch_read() -> None:
    """One key's descriptor names a segment registered again since (its token is stale):
    that rejects the whole Transfer Engine batch, and every other key is still read, from
    its first replica, on its own."""
    opts = EngineOptions(protocol="tcp", timeout_s=5.0)
    a, b = TransferEngine("a", SECRET, opts), TransferEngine("b", SECRET, opts)
    a.directory.add_peer("127.0.0.1", b.server.port)  # type: ignore[attr-defined]
    try:
        pool = b.allocate("seg", 8192)
        pool[:] = np.arange(8192, dtype=np.uint8)
        token = b.describe("seg").token  # type: ignore[union-attr]
        dst = np.zeros(8192, np.uint8)
        a.register("dst", dst)
        data = DataPath(a, "a", timeout_s=5.0)
        plan = [
            ("good", [_replica("seg", 0, 4096, token)], "dst", 0, 4096),
            ("stale", [_replica("seg", 4096, 4096, token + 1)], "dst", 4096, 4096),
        ]
        failed, moved = data.read_many(plan)  # type: ignore[arg-type]
        assert list(failed) == ["stale"] and "registered again" in failed["stale"]
        assert moved == {}
        assert (dst[:4096] == pool[:4096]).all() and not dst[4096:].any()
    finally:
        a.close()
        b.close()
