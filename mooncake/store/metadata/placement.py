"""Replica placement: in which order to try segments for a new object's replicas.

A strategy only ranks candidate segments (all of one tier, all with a free block large
enough); the service walks the ranking and takes at most one segment per node, so the
replicas of one object always land on distinct nodes.

- local_first: the writer's own segments first (its reads stay local), then free_ratio;
  a full writer's memory is made room on rather than the put landing elsewhere
  (`keeps_local`: eviction.py's `room_on_writer`).
- free_ratio: the emptiest segments first (share of free bytes), spreading load evenly.
- random: a uniform shuffle from a seeded RNG (reproducible in tests and the simulator).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator, Sequence
from typing import Literal

from mooncake.errors import StoreError
from mooncake.store.metadata.objects import Segment

PlacementName = Literal["local_first", "free_ratio", "random"]


class BasePlacement:
    """Ranks candidate segments for the replicas of one new object."""

    name: str = ""
    keeps_local: bool = False  # a put into its writer's full memory makes room there

    def rank(self, candidates: Sequence[Segment], writer: str) -> Iterable[Segment]:
        """Candidates, best first (consumed lazily); does not change the segments."""
        raise NotImplementedError


def _by_free_ratio(candidates: Sequence[Segment]) -> list[Segment]:
    # NOTE: ties broken by name, so the ranking is a pure function of the segments' state.
    return sorted(candidates, key=lambda s: (-s.free_ratio, s.name))


class FreeRatioPlacement(BasePlacement):
    name = "free_ratio"

    def rank(self, candidates: Sequence[Segment], writer: str) -> list[Segment]:
        return _by_free_ratio(candidates)


class LocalFirstPlacement(BasePlacement):
    name = "local_first"
    keeps_local = True

    def rank(self, candidates: Sequence[Segment], writer: str) -> Iterator[Segment]:
        # NOTE: a generator: when the writer's own segment takes the only replica, the
        # other segments are never sorted.
        yield from _by_free_ratio([s for s in candidates if s.node_id == writer])
        yield from _by_free_ratio([s for s in candidates if s.node_id != writer])


class RandomPlacement(BasePlacement):
    name = "random"

    def __init__(self, seed: int = 0):
        self._rng = random.Random(seed)

    def rank(self, candidates: Sequence[Segment], writer: str) -> list[Segment]:
        ranked = sorted(candidates, key=lambda s: s.name)  # independent of dict order
        self._rng.shuffle(ranked)
        return ranked


def create_placement(name: str, seed: int = 0) -> BasePlacement:
    """The strategy called `name`; raises StoreError naming the allowed ones."""
    if name == "local_first":
        return LocalFirstPlacement()
    if name == "free_ratio":
        return FreeRatioPlacement()
    if name == "random":
        return RandomPlacement(seed)
    raise StoreError(f"unknown replica placement {name!r}: use local_first, free_ratio or random")
