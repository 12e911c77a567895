"""The pool's eviction order: one pool-wide recency per tier, spare copies before last ones.

The master sees every object, so its order is the pool's, not a node's: the least recently
used object of a tier is the same whichever node holds it. Within a tier an object's
replica is either *spare* (the object keeps another committed copy in the pool: a
duplicate in this tier on another node, made for a hot spot, by a fetch or by a put of
several replicas, or a copy in another tier, made ahead of eviction or left by a
promotion) or a *last* copy. Victims
come in that order:

    | class | what dropping it costs                  | order                     |
    |-------|-----------------------------------------|---------------------------|
    | spare | nothing: the object stays in the pool   | least recently used first |
    | last  | the object leaves (or moves down a tier)| least recently used first |

Duplicates beyond what their puts asked for (`wanted` copies in a tier: hot-spot
replicas) are bounded by a budget (`replica_budget`, a share of the tier's capacity):
`may_duplicate` says whether one more fits it. Units are the caller's (bytes for the
Store, blocks for the simulator). Pure logic, shared by the Store's eviction
(`store/metadata/eviction.py`) and the simulated pool (`sim/pool.py`), so the simulator models the
Store's policy.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Hashable, Iterator, Sequence
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class PoolOrder(Generic[K]):
    """Per tier: the keys with a committed copy there, least recently used first, each
    key's copies per tier, and the units its duplicates take. Changes only through
    `add`, `remove` and `touch`."""

    def __init__(self, tiers: Sequence[str]):
        self.tiers = tuple(tiers)
        self.order: dict[str, OrderedDict[K, None]] = {t: OrderedDict() for t in tiers}
        self.copies: dict[K, dict[str, int]] = {}  # key -> tier -> committed copies there
        self.units: dict[K, int] = {}  # key -> units one copy takes (bytes, blocks)
        self.wanted: dict[K, int] = {}  # key -> copies per tier its put asked for
        # tier -> units of the copies there beyond each key's `wanted`
        self.dup_units: dict[str, int] = dict.fromkeys(tiers, 0)
        self.spare: dict[str, set[K]] = {t: set() for t in tiers}  # tier -> its spare keys
        self._stamp: dict[K, int] = {}  # key -> its last use (a counter: recency across tiers)
        self._clock = itertools.count()

    def __contains__(self, item: tuple[K, str]) -> bool:
        key, tier = item
        return key in self.order[tier]

    def count(self, tier: str) -> int:
        """Keys with a copy in `tier`."""
        return len(self.order[tier])

    def num_copies(self, key: K) -> int:
        """Committed copies of `key` in the pool, every tier."""
        return sum(self.copies.get(key, {}).values())

    def add(self, key: K, tier: str, units: int = 1, wanted: int = 1) -> None:
        """A copy of `key` was committed in `tier` (most recently used if the key is new
        there); `units` and `wanted` (copies the put asked for) as of its first copy."""
        per = self.copies.get(key)
        if per is None:  # NOTE: the common case: one copy, not spare, no duplicate units
            self.copies[key] = {tier: 1}
            self.units[key], self.wanted[key] = units, max(wanted, 1)
            self._stamp[key] = next(self._clock)
            self.order[tier][key] = None
            return
        n = per.get(tier, 0)
        per[tier] = n + 1
        self.dup_units[tier] += self._dup(key, n + 1) - self._dup(key, n)
        if not n:
            self.order[tier][key] = None
        self._classify(key)

    def remove(self, key: K, tier: str) -> None:
        """A copy of `key` in `tier` went (dropped, moved, lost)."""
        per = self.copies[key]
        n = per[tier]
        assert n > 0, (key, tier)
        if n == 1 and len(per) == 1:  # NOTE: its only copy: it leaves the order
            del self.copies[key], self.units[key], self.wanted[key], self._stamp[key]
            del self.order[tier][key]
            return
        self.dup_units[tier] += self._dup(key, n - 1) - self._dup(key, n)
        if n > 1:
            per[tier] = n - 1
        else:
            del per[tier]
            del self.order[tier][key]
            self.spare[tier].discard(key)
        if not per:
            del self.copies[key], self.units[key], self.wanted[key], self._stamp[key]
        else:
            self._classify(key)

    def _dup(self, key: K, copies: int) -> int:
        return max(0, copies - self.wanted[key]) * self.units[key]

    def touch(self, key: K) -> None:
        """`key` was used (read, written again): most recent in every tier holding it."""
        per = self.copies.get(key)
        if per is None:
            return
        self._stamp[key] = next(self._clock)
        for tier in per:
            self.order[tier].move_to_end(key)

    def victims(self, tier: str, spare_only: bool = False) -> Iterator[K]:
        """The keys of `tier` in eviction order: spare ones, least recently used first,
        then (unless `spare_only`) last copies in the same order. The caller skips what it
        may not drop; it must not change this order while iterating."""
        spare = self.spare[tier]
        if spare:
            yield from sorted(spare, key=self._stamp.__getitem__)
        if not spare_only:
            for key in self.order[tier]:
                if key not in spare:
                    yield key

    def may_duplicate(self, tier: str, units: int, budget: float, capacity: int) -> bool:
        """Whether one more copy of `units` in `tier` keeps its duplicates within `budget`
        (a share) of `capacity` units."""
        return self.dup_units[tier] + units <= budget * capacity

    def _classify(self, key: K) -> None:
        per = self.copies[key]
        is_spare = sum(per.values()) > 1
        for tier in per:
            if is_spare:
                self.spare[tier].add(key)
            else:
                self.spare[tier].discard(key)

    def check_integrity(self) -> None:
        """Assert the orders, copy counts, spare sets and duplicate units agree."""
        for tier in self.tiers:
            held = {k for k, per in self.copies.items() if per.get(tier)}
            assert set(self.order[tier]) == held, f"order of {tier} out of sync"
            spare = {k for k in held if sum(self.copies[k].values()) > 1}
            assert self.spare[tier] == spare, f"spare keys of {tier} out of sync"
            dup = sum(self._dup(k, self.copies[k][tier]) for k in held)
            assert self.dup_units[tier] == dup, (tier, self.dup_units[tier], dup)
        assert set(self._stamp) == set(self.copies) == set(self.units) == set(self.wanted)
