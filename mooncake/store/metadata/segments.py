"""The pool's space: live nodes, their mounted segments, per-tier totals, replica allocation.

`SegmentManager` knows nothing of keys' meaning; the metadata service attaches the replicas
it allocates here to objects. A released replica whose object is still leased is not freed
at once: its range stays taken until the lease ends (`defer`), since a reader may still be
copying from it.
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Iterable

from mooncake.errors import StoreError
from mooncake.store.metadata.allocator import DEFAULT_ALIGNMENT, Fit, OffsetAllocator
from mooncake.store.metadata.objects import TIERS, Replica, Segment, Tier

SSD_ALIGNMENT = 4096  # bytes: O_DIRECT needs block-aligned file offsets
MAX_NAME_BYTES = 256  # bytes of a segment or node name
Range = tuple[str, int, int]  # (segment name, first byte, end byte) of an allocation
WHOLE_SEGMENT = 1 << 64  # the end of a Range that covers a whole (unmounted) segment


class SegmentManager:
    """Nodes (last heartbeat), segments (by name, by node, by tier) and byte totals."""

    def __init__(self, fit: Fit = "best"):
        self.fit: Fit = fit
        self.segments: dict[str, Segment] = {}  # name -> segment
        self.node_last_seen: dict[str, float] = {}  # node id -> s of its last heartbeat
        self.node_segments: dict[str, list[Segment]] = {}  # node id -> its segments
        self.tier_segments: dict[Tier, list[Segment]] = {t: [] for t in TIERS}
        self.tier_usable: dict[Tier, int] = dict.fromkeys(TIERS, 0)  # bytes
        self.tier_used: dict[Tier, int] = dict.fromkeys(TIERS, 0)  # bytes, incl. deferred
        self.deferred: list[tuple[float, Replica]] = []  # (free at s, released replica)
        # ranges (segment, start, end) freed (a whole segment when unmounted) and handed
        # out since the last `drain_ranges` (group commit's tickets: groupcommit.py)
        self.freed: list[Range] = []
        self.taken: list[Range] = []
        # replica ids: from a random base, so a restarted master does not hand out ids
        # that clients still remember from before
        self._replica_ids = itertools.count(secrets.randbits(62) + 1)

    # -- nodes and segments --------------------------------------------------------------

    def heartbeat(self, node_id: str, now: float) -> bool:
        """Mark `node_id` alive at `now`; returns whether it was already known (False: the
        master did not know it, it must re-mount)."""
        known = node_id in self.node_last_seen
        self.node_last_seen[node_id] = now
        self.node_segments.setdefault(node_id, [])
        return known

    def mount(
        self,
        node_id: str,
        name: str,
        tier: str,
        capacity: int,
        endpoint: str,
        alignment: int,
        token: int = 0,
        usable_from: float = 0.0,
        now: float = 0.0,
    ) -> Segment | None:
        """Add a segment; None if this exact segment is already mounted (idempotent).
        Raises StoreError for a bad name or tier, or a name another mount owns (the caller
        unmounts a previous registration of the same node's segment first)."""
        for what, value in (("node id", node_id), ("segment name", name)):
            if not value or len(value.encode()) > MAX_NAME_BYTES:
                raise StoreError(f"mount: {what} {value!r} must be 1..{MAX_NAME_BYTES} bytes")
        if tier not in TIERS:
            raise StoreError(
                f"mount of segment {name!r}: unknown tier {tier!r}; use vram, dram or ssd"
            )
        if capacity <= 0:
            raise StoreError(f"mount of segment {name!r}: capacity must be > 0, got {capacity}")
        alignment = alignment or (SSD_ALIGNMENT if tier == "ssd" else DEFAULT_ALIGNMENT)
        old = self.segments.get(name)
        if old is not None:
            same = (
                old.node_id,
                old.tier,
                old.capacity,
                old.endpoint,
                old.allocator.alignment,
                old.token,
            )
            if same == (node_id, tier, capacity, endpoint, alignment, token):
                return None
            raise StoreError(
                f"mount of segment {name!r} by node {node_id!r}: the name is already mounted "
                f"by node {old.node_id!r} as {old.tier} of {old.capacity} bytes; unmount it "
                "first or pick a unique segment name"
            )
        allocator = OffsetAllocator(capacity, alignment, self.fit)
        seg = Segment(
            name,
            node_id,
            tier,
            endpoint,
            allocator,
            token=token,
            usable_from=usable_from,
            mounted_at=now,
        )
        self.segments[name] = seg
        self.node_segments.setdefault(node_id, []).append(seg)
        self.tier_segments[seg.tier].append(seg)
        self.tier_usable[seg.tier] += seg.allocator.usable_bytes
        return seg

    def unmount(self, seg: Segment) -> None:
        """Drop `seg` with everything allocated in it (the caller detached its replicas)."""
        del self.segments[seg.name]
        self.freed.append((seg.name, 0, WHOLE_SEGMENT))
        self.node_segments[seg.node_id].remove(seg)
        self.tier_segments[seg.tier].remove(seg)
        self.tier_usable[seg.tier] -= seg.allocator.usable_bytes
        self.tier_used[seg.tier] -= seg.allocator.used_bytes
        self.deferred = [(t, r) for t, r in self.deferred if r.segment is not seg]

    def forget_node(self, node_id: str) -> None:
        """Forget a node whose segments were all unmounted."""
        assert not self.node_segments.get(node_id), f"node {node_id} still has segments"
        self.node_last_seen.pop(node_id, None)
        self.node_segments.pop(node_id, None)

    def dead_nodes(self, now: float, ttl_s: float) -> list[str]:
        return [n for n, seen in self.node_last_seen.items() if now - seen > ttl_s]

    # -- space ---------------------------------------------------------------------------

    def candidates(
        self, tier: Tier, size: int, exclude_nodes: Iterable[str], now: float
    ) -> list[Segment]:
        """Segments of `tier` usable at `now` with a free block for `size` bytes, on nodes
        not excluded."""
        excluded = set(exclude_nodes)
        return [
            s
            for s in self.tier_segments[tier]
            if s.node_id not in excluded and s.usable_from <= now and s.allocator.can_fit(size)
        ]

    def allocate(self, seg: Segment, key: str, size: int) -> Replica | None:
        """A PROCESSING replica of `key` in `seg`, or None if `seg` has no room."""
        offset = seg.allocator.allocate(size)
        if offset is None:
            return None
        taken = seg.allocator.size_of(offset) or 0  # aligned
        self.tier_used[seg.tier] += taken
        self.taken.append((seg.name, offset, offset + taken))
        seg.keys.add(key)
        return Replica(seg, offset, size, replica_id=next(self._replica_ids))

    def free(self, key: str, replica: Replica, until: float = 0.0, now: float = 0.0) -> None:
        """Detach `replica` of `key` from its segment; its range is freed now, or when
        readers' leases end at `until` (> now)."""
        replica.segment.keys.discard(key)
        if until > now:
            self.deferred.append((until, replica))
        else:
            self._release(replica)

    def release_due(self, now: float) -> int:
        """Free the deferred ranges whose leases ended; returns how many."""
        due = [r for t, r in self.deferred if t <= now]
        if due:
            self.deferred = [(t, r) for t, r in self.deferred if t > now]
            for r in due:
                self._release(r)
        return len(due)

    def _release(self, replica: Replica) -> None:
        seg = replica.segment
        freed = seg.allocator.free(replica.offset)
        self.tier_used[seg.tier] -= freed
        self.freed.append((seg.name, replica.offset, replica.offset + freed))

    def drain_ranges(self) -> tuple[list[Range], list[Range]]:
        """The ranges freed and handed out since the last call: (freed, taken)."""
        freed, taken = self.freed, self.taken
        self.freed, self.taken = [], []
        return freed, taken

    def share(self, tier: Tier, extra_bytes: int = 0) -> float:
        """Used share of `tier` (0 when none mounted), counting `extra_bytes` more."""
        usable = self.tier_usable[tier]
        return (self.tier_used[tier] + extra_bytes) / usable if usable else 0.0

    def check_integrity(self) -> None:
        """Assert every index agrees with `segments`, and every allocator is sound."""
        for tier in TIERS:
            segs = [s for s in self.segments.values() if s.tier == tier]
            assert sorted(s.name for s in self.tier_segments[tier]) == sorted(s.name for s in segs)
            assert self.tier_usable[tier] == sum(s.allocator.usable_bytes for s in segs), tier
            assert self.tier_used[tier] == sum(s.allocator.used_bytes for s in segs), tier
        for node_id, segs in self.node_segments.items():
            assert node_id in self.node_last_seen, f"segments of unknown node {node_id}"
            assert all(s.node_id == node_id and self.segments[s.name] is s for s in segs)
        assert sum(len(v) for v in self.node_segments.values()) == len(self.segments)
        for seg in self.segments.values():
            seg.allocator.check_integrity()
        for _, r in self.deferred:
            assert self.segments.get(r.segment.name) is r.segment, "deferred in a gone segment"
            assert r.segment.allocator.size_of(r.offset), f"deferred range {r.offset} not taken"
