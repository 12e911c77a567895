"""Tiers of a store node: DRAM shm arena, VRAM tensor arena (on cpu), SSD file."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from mooncake.errors import StoreError
from mooncake.store.node.tiers import DramTier, SsdTier, VramTier, sweep_stale
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


_HOLD_SSD = """
import sys
from mooncake.store.node.tiers import SsdTier
tier = SsdTier(sys.argv[1], sys.argv[2], 1 << 20)
print("READY", tier.path, flush=True)
sys.stdin.read()
tier.close()
"""


def _node_with_ssd(ssd_path: Path, segment: str) -> tuple[subprocess.Popen[str], str]:
    """A child process holding an SSD tier file, ready once it printed the file's path."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLD_SSD, str(ssd_path), segment],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    ready, path = proc.stdout.readline().split()
    assert ready == "READY" and os.path.exists(path), path
    return proc, path


@pytest.mark.cluster
def test_a_starting_node_sweeps_the_files_of_killed_nodes_and_never_a_live_ones(
    tmp_path: Path,
) -> None:
    """Three nodes share one SSD directory: one is SIGKILLed (its sparse file stays
    behind), one lives on. A node starting there removes the dead one's file, keeps the
    live one's; a node with the killed one's id starts on its name again; one with the
    live one's id is refused rather than truncating its file."""
    dead, dead_path = _node_with_ssd(tmp_path, "dead.ssd")
    live, live_path = _node_with_ssd(tmp_path, "live.ssd")
    stray = tmp_path / "notes.txt"  # not an SSD tier file: never touched
    stray.write_text("x")
    try:
        dead.send_signal(signal.SIGKILL)
        dead.wait(timeout=10)
        assert os.path.exists(dead_path)
        tier = SsdTier(str(tmp_path), "new.ssd", 1 << 16)
        try:
            assert not os.path.exists(dead_path)
            assert os.path.exists(live_path) and stray.exists()
            again = SsdTier(str(tmp_path), "dead.ssd", 1 << 16)  # the killed node restarts
            again.close()
            with pytest.raises(StoreError, match="held by another live node"):
                SsdTier(str(tmp_path), "live.ssd", 1 << 16)
            assert os.path.getsize(live_path) == 1 << 20
        finally:
            tier.close()
        assert sweep_stale(str(tmp_path)) == []  # the live one's is still held
    finally:
        assert live.stdin is not None
        live.stdin.close()
        live.wait(timeout=10)
    assert not os.path.exists(live_path)  # removed by its own node as it stopped
