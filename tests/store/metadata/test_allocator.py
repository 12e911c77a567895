"""Offset allocator: exact offsets, coalescing, figures, and a property test against a
byte-occupancy model."""

from __future__ import annotations

import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake.errors import StoreError
from mooncake.store.metadata.allocator import Fit, OffsetAllocator


def test_allocations_are_aligned_and_packed_from_zero():
    a = OffsetAllocator(1000, alignment=64)
    assert a.usable_bytes == 960  # the 40-byte tail cannot hold an aligned block
    assert [a.allocate(n) for n in (1, 64, 65)] == [0, 64, 128]
    assert a.used_bytes == 64 + 64 + 128 and a.free_bytes == 960 - 256
    assert a.size_of(128) == 128 and a.size_of(100) is None
    a.check_integrity()


def test_no_room_is_none_not_an_exception():
    a = OffsetAllocator(256, alignment=64)
    assert a.allocate(256) == 0
    assert a.allocate(1) is None
    a.check_integrity()


def test_free_coalesces_with_both_neighbours():
    a = OffsetAllocator(64 * 4, alignment=64)
    offs = [a.allocate(64) or 0 for _ in range(4)]
    assert offs == [0, 64, 128, 192]
    a.free(0)
    a.free(128)
    assert a.largest_free_bytes == 64 and a.fragmentation == pytest.approx(0.5)
    a.free(64)  # merges [0,64) + [64,128) + [128,192)
    assert a.largest_free_bytes == 192 and a.fragmentation == 0.0
    a.check_integrity()
    assert a.allocate(192) == 0


def test_best_fit_takes_the_smallest_block_first_fit_the_lowest():
    cases: list[tuple[Fit, int]] = [("best", 256), ("first", 0)]
    for fit, expected in cases:
        a = OffsetAllocator(64 * 8, alignment=64, fit=fit)
        offs = [a.allocate(64) or 0 for _ in range(8)]
        for o in (offs[0], offs[1], offs[4]):  # free blocks: [0,128) and [256,320)
            a.free(o)
        assert a.allocate(64) == expected, fit
        a.check_integrity()


def test_misuse_raises_store_error():
    a = OffsetAllocator(256)
    with pytest.raises(StoreError, match="double free"):
        a.free(0)
    with pytest.raises(StoreError, match="> 0"):
        a.allocate(0)
    with pytest.raises(StoreError, match="power of two"):
        OffsetAllocator(256, alignment=48)


ops = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(1, 300)),
        st.tuples(st.just("free"), st.integers(0, 1000)),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops=ops, fit=st.sampled_from(["best", "first"]), align=st.sampled_from([1, 16, 64]))
def test_random_sequences_keep_invariants_and_match_a_byte_model(ops, fit, align):
    """After every step: integrity holds, allocations never overlap (checked on a bytearray
    of owners), allocate fails only if no run of free bytes could hold the request, and
    largest_free_after predicts what a real free leaves."""
    cap = 1024
    a = OffsetAllocator(cap, alignment=align, fit=fit)
    owner = bytearray(a.usable_bytes)  # 1 = taken
    live: list[int] = []
    for op, n in ops:
        if op == "alloc":
            need = a.aligned(n)
            off = a.allocate(n)
            if off is None:
                run = best = 0
                for pos in range(0, len(owner), align):
                    run = 0 if owner[pos] else run + align
                    best = max(best, run)
                assert best < need, f"refused {need} bytes with a free run of {best}"
            else:
                assert off % align == 0 and not any(owner[off : off + need])
                owner[off : off + need] = b"\1" * need
                live.append(off)
        elif live:
            off = live.pop(n % len(live))
            batch = [off, *live[: n % 3]]  # what-if: freeing these would leave this block
            clone = copy.deepcopy(a)
            for o in batch:
                clone.free(o)
            assert a.largest_free_after(batch) == clone.largest_free_bytes
            size = a.free(off)
            assert all(owner[off : off + size])
            owner[off : off + size] = bytes(size)
        a.check_integrity()
        assert a.used_bytes == sum(owner)
