"""The block allocator hands out each block once and takes back only what it gave."""

from __future__ import annotations

import pytest

from mooncake.model.kvcache import BlockAllocator


def test_allocation_is_all_or_nothing_and_blocks_come_back():
    alloc = BlockAllocator(4)
    first = alloc.allocate(3)
    assert first == [0, 1, 2]
    assert alloc.allocate(2) is None and alloc.num_free == 1
    alloc.free([1])
    assert sorted(alloc.allocate(2) or []) == [1, 3]
    alloc.check_integrity()


def test_freeing_a_block_twice_is_a_bug():
    alloc = BlockAllocator(2)
    ids = alloc.allocate(1)
    assert ids is not None
    alloc.free(ids)
    with pytest.raises(AssertionError, match="freed but not allocated"):
        alloc.free(ids)
