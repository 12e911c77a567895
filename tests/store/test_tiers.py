"""Tiers of a store node: DRAM shm arena, VRAM tensor arena (on cpu), SSD file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mooncake.errors import StoreError
from mooncake.store.tiers import DramTier, SsdTier, VramTier
from mooncake.transfer.engine import TransferEngine

SECRET = b"tier-test-secret-0123456789abcdef"


def test_ssd_tier_round_trip_and_checksum_catches_corruption(tmp_path: Path) -> None:
    """SSD reads return what was written; a flipped byte on disk fails the checksum."""
    tier = SsdTier(str(tmp_path), "n.ssd", 1 << 16)
    try:
        value = os.urandom(5000)
        tier.write(4096, value)
        assert tier.read(4096, 5000) == value
        with pytest.raises(StoreError, match="is 5000 bytes, not 10"):
            tier.read(4096, 10)
        with open(tier.path, "r+b") as f:
            f.seek(4096 + 17)
            f.write(bytes([value[17] ^ 0xFF]))
        with pytest.raises(StoreError, match="checksum mismatch"):
            tier.read(4096, 5000)
        with pytest.raises(StoreError, match="outside"):
            tier.write(1 << 16, b"x")
    finally:
        tier.close()
    assert not os.path.exists(tier.path)


def test_ssd_mapping_shows_the_direct_writes_and_peers_writes_are_read_back(
    tmp_path: Path,
) -> None:
    """The file's mapping (what the node serves to readers) holds what the node wrote with
    O_DIRECT, also over a range written before (a reused allocation); bytes a peer wrote
    into the mapping are what the node reads back (no checksum of its own for them)."""
    tier = SsdTier(str(tmp_path), "m.ssd", 1 << 16)
    try:
        for _ in range(2):
            value = os.urandom(6000)
            tier.write(8192, value)
            assert bytes(tier.mapping[8192 : 8192 + 6000]) == value
        peer = os.urandom(3000)
        tier.mapping[16384 : 16384 + 3000] = peer
        assert tier.read(16384, 3000) == peer
    finally:
        tier.close()
    assert not os.path.exists(tier.path)


def test_memory_tiers_are_engine_segments() -> None:
    """DRAM (shm) and VRAM (a torch tensor, here on cpu) register as engine segments and
    read back what was written at an offset."""
    pytest.importorskip("torch")
    with TransferEngine("tiers", SECRET) as engine:
        dram = DramTier(engine, "t.dram", 1 << 16)
        vram = VramTier(engine, "t.vram", 1 << 16, device="cpu")
        for tier in (dram, vram):
            desc = engine.describe(tier.segment)
            assert desc is not None and desc.num_bytes == 1 << 16
            tier.write(100, b"hello")
            assert tier.read(100, 5) == b"hello"
        assert engine.describe("t.dram").shm_name  # type: ignore[union-attr]
        dram.close()
        vram.close()
        assert engine.describe("t.dram") is None
