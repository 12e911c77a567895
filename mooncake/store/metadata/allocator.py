"""Offset allocator of one segment: which byte ranges of [0, capacity) are taken.

Pure bookkeeping: it never touches the segment's memory. The data plane writes the bytes at
the offsets this hands out; the metadata service owns one allocator per mounted segment.

Free space is a list of blocks kept sorted by offset (for coalescing on free) and, for
best fit, a second list sorted by (size, offset):

    | structure      | content                         | used by                        |
    |----------------|---------------------------------|--------------------------------|
    | `_free_starts` | start offsets, ascending        | free: find the neighbours      |
    | `_free_size`   | start -> size of the free block | both                           |
    | `_by_size`     | (size, start), ascending        | best fit: smallest block >= n  |
    | `_used`        | start -> size of the allocation | free, size_of, integrity       |

NOTE: every offset and size is a multiple of `alignment`, and adjacent free blocks never
exist (they are merged on free), so the free list is the unique canonical one.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from collections.abc import Iterable
from typing import Literal

from mooncake.errors import StoreError

Fit = Literal["best", "first"]
DEFAULT_ALIGNMENT = 64  # bytes: a cache line; SSD segments mount with 4096 (O_DIRECT)


class OffsetAllocator:
    """Allocates aligned ranges of [0, capacity); `allocate` returns None when there is no
    room (a normal outcome), `free` raises StoreError for an offset it did not hand out."""

    def __init__(self, capacity: int, alignment: int = DEFAULT_ALIGNMENT, fit: Fit = "best"):
        if alignment <= 0 or alignment & (alignment - 1):
            raise StoreError(f"allocator alignment must be a power of two, got {alignment}")
        if capacity < 0:
            raise StoreError(f"segment capacity must be >= 0 bytes, got {capacity}")
        if fit not in ("best", "first"):
            raise StoreError(f'allocator fit must be "best" or "first", got {fit!r}')
        self.capacity = capacity  # bytes, as mounted
        self.alignment = alignment  # bytes
        self._mask = alignment - 1
        self.fit: Fit = fit
        # NOTE: a tail shorter than one alignment unit can never be handed out; leave it out.
        self.usable_bytes = capacity - capacity % alignment
        self._free_starts: list[int] = []
        self._free_size: dict[int, int] = {}
        self._by_size: list[tuple[int, int]] = []
        self._used: dict[int, int] = {}
        self.used_bytes = 0  # bytes allocated, alignment padding included
        if self.usable_bytes:
            self._add_free(0, self.usable_bytes)

    # -- queries -------------------------------------------------------------------------

    @property
    def free_bytes(self) -> int:
        return self.usable_bytes - self.used_bytes

    @property
    def largest_free_bytes(self) -> int:
        return self._by_size[-1][0] if self._by_size else 0

    @property
    def fragmentation(self) -> float:
        """1 - largest free block / free bytes: 0 when all free space is one block."""
        free = self.free_bytes
        return 1.0 - self.largest_free_bytes / free if free else 0.0

    @property
    def num_allocations(self) -> int:
        return len(self._used)

    def aligned(self, size: int) -> int:
        """`size` rounded up to the alignment: what an allocation of `size` really takes."""
        return (size + self._mask) & ~self._mask

    def can_fit(self, size: int) -> bool:
        """Whether `allocate(size)` would succeed now."""
        by_size = self._by_size  # NOTE: inlined: this runs for every segment on every put
        return size > 0 and bool(by_size) and (size + self._mask) & ~self._mask <= by_size[-1][0]

    def size_of(self, offset: int) -> int | None:
        """Bytes taken by the allocation at `offset` (aligned), or None if none starts there."""
        return self._used.get(offset)

    def largest_free_after(self, offsets: Iterable[int]) -> int:
        """The largest free block there would be if the allocations at `offsets` were freed;
        changes nothing. O(k log k) in the number of offsets."""
        runs = []
        for off in offsets:
            end = off + self._used[off]
            runs.append((off, end))
            i = bisect_left(self._free_starts, off)
            if i < len(self._free_starts) and self._free_starts[i] == end:
                runs.append((end, end + self._free_size[end]))
            if i > 0:
                prev = self._free_starts[i - 1]
                if prev + self._free_size[prev] == off:
                    runs.append((prev, off))
        best, start, stop = self.largest_free_bytes, 0, -1
        for lo, hi in sorted(set(runs)):
            if lo != stop:  # NOTE: runs never overlap; adjacent ones merge
                start = lo
            stop = hi
            best = max(best, stop - start)
        return best

    def allocations(self) -> dict[int, int]:
        """A copy of offset -> aligned size of every allocation."""
        return dict(self._used)

    # -- changes -------------------------------------------------------------------------

    def allocate(self, size: int) -> int | None:
        """Take `size` bytes (rounded up to the alignment); the offset, or None if no free
        block is large enough. Raises StoreError if size <= 0."""
        if size <= 0:
            raise StoreError(f"cannot allocate {size} bytes: a size must be > 0")
        need = self.aligned(size)
        if self.fit == "best":
            i = bisect_left(self._by_size, (need, -1))
            if i == len(self._by_size):
                return None
            block, start = self._by_size[i]
        else:
            for start in self._free_starts:  # O(n): first fit trades speed for low addresses
                block = self._free_size[start]
                if block >= need:
                    break
            else:
                return None
        self._remove_free(start, block)
        if block > need:
            self._add_free(start + need, block - need)
        self._used[start] = need
        self.used_bytes += need
        return start

    def allocate_at(self, offset: int, size: int) -> bool:
        """Take `size` bytes (rounded up to the alignment) at exactly `offset`, as a previous
        owner of this segment's metadata had allocated them (a rebuilt pool); False if that
        range is not wholly free or `offset` is not aligned."""
        need = self.aligned(size)
        if size <= 0 or offset & self._mask or offset < 0:
            return False
        i = bisect_right(self._free_starts, offset) - 1
        if i < 0:
            return False
        start = self._free_starts[i]
        block = self._free_size[start]
        if offset + need > start + block:
            return False
        self._remove_free(start, block)
        if offset > start:
            self._add_free(start, offset - start)
        if start + block > offset + need:
            self._add_free(offset + need, start + block - offset - need)
        self._used[offset] = need
        self.used_bytes += need
        return True

    def free(self, offset: int) -> int:
        """Give back the allocation at `offset`, merging it with free neighbours; returns the
        bytes freed. Raises StoreError if no allocation starts at `offset`."""
        size = self._used.pop(offset, None)
        if size is None:
            raise StoreError(
                f"free of offset {offset}: no allocation starts there (double free, or an "
                "offset this segment never handed out)"
            )
        self.used_bytes -= size
        start, end = offset, offset + size
        i = bisect_left(self._free_starts, offset)
        if i < len(self._free_starts) and self._free_starts[i] == end:  # merge the next block
            nxt = self._free_size[end]
            self._remove_free(end, nxt)
            end += nxt
        if i > 0:  # merge the previous block if it ends where we start
            prev = self._free_starts[i - 1]
            prev_size = self._free_size[prev]
            if prev + prev_size == start:
                self._remove_free(prev, prev_size)
                start = prev
        self._add_free(start, end - start)
        return size

    def _add_free(self, start: int, size: int) -> None:
        insort(self._free_starts, start)
        self._free_size[start] = size
        insort(self._by_size, (size, start))

    def _remove_free(self, start: int, size: int) -> None:
        del self._free_starts[bisect_left(self._free_starts, start)]
        del self._free_size[start]
        del self._by_size[bisect_left(self._by_size, (size, start))]

    # -- invariants ----------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Assert: used and free blocks tile [0, usable_bytes) exactly, without overlap, free
        blocks are coalesced, both free indexes agree, and the byte counts match."""
        a = self.alignment
        assert self._free_starts == sorted(self._free_size), "free start list out of sync"
        assert self._by_size == sorted((s, o) for o, s in self._free_size.items()), (
            "size index out of sync with the free list"
        )
        blocks = [(o, s, False) for o, s in self._free_size.items()]
        blocks += [(o, s, True) for o, s in self._used.items()]
        blocks.sort()
        pos, prev_free = 0, False
        for offset, size, is_used in blocks:
            assert offset == pos, f"gap or overlap at {pos}: next block starts at {offset}"
            assert size > 0 and offset % a == 0 and size % a == 0, (
                f"unaligned or empty block ({offset}, {size}) with alignment {a}"
            )
            assert is_used or not prev_free, f"free block at {offset} not merged with previous"
            prev_free = not is_used
            pos += size
        assert pos == self.usable_bytes, f"blocks cover {pos} of {self.usable_bytes} bytes"
        assert self.used_bytes == sum(self._used.values()), "used_bytes out of sync"
        assert self.free_bytes == sum(self._free_size.values()), "free_bytes out of sync"
