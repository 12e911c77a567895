"""Host arenas placed on the NUMA node they serve: mbind(2) on this real kernel, read back
from /proc/self/numa_maps."""

from __future__ import annotations

import logging

import pytest

from mooncake.native import numa
from mooncake.native.shm import ShmArena
from mooncake.transfer.segment import SegmentTable


def _policy(name: str) -> str:
    with open("/proc/self/numa_maps") as f:
        for line in f:
            if name in line:
                return line.split()[1]
    raise AssertionError(f"{name} is not mapped")


def test_prefer_sets_the_policy_of_an_untouched_arena() -> None:
    with ShmArena.create(1 << 20) as arena:
        assert numa.prefer(arena.array, 0) == ""
        arena.array[:] = 1  # faulted in under the policy
        assert _policy(arena.name) == "prefer:0"


def test_a_node_the_kernel_refuses_is_said_once_and_the_arena_still_works(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with ShmArena.create(1 << 16) as arena, caplog.at_level(logging.WARNING):
        why = numa.prefer(arena.array, 1000)
        assert "NUMA node 1000" in why and "Invalid argument" in why
        numa.prefer(arena.array, 1000)
        arena.array[:] = 7
    assert sum("NUMA node 1000" in r.getMessage() for r in caplog.records) == 1


def test_allocated_segment_goes_to_its_location_node(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a host of several nodes a segment allocated for "cpu:N" is placed on node N
    (this machine has one node: node 0 is the one the kernel can honour)."""
    monkeypatch.setattr(numa, "num_nodes", lambda sysfs_root="/sys": 2)
    table = SegmentTable(native=False)
    region = table.allocate("pool", 1 << 20, "cpu:0")
    try:
        assert region.arena is not None
        region.array[:] = 3  # type: ignore[index]
        assert _policy(region.arena.name) == "prefer:0"
    finally:
        table.close()
