"""Why a request recomputed blocks it could have reused: miss attribution in the simulator.

When a request's prefill starts, each of its blocks is either reused (*hit*) or gets one
cause, decided from the pool as it is at that moment (`MissLedger.attribute`):

- *elsewhere*: the pool holds it (and every block before it, on some nodes) but this
  request did not reuse it, in three parts by the block's place in the prompt:
  `priced_out`, the placement at arrival saw it in the pool and chose to recompute it
  (Algorithm 1 weighs the transfer and each instance's queue, the holder's included,
  against recomputing); `plan_lost`, the placement meant to reuse it but the plan was
  overtaken before the start (the chosen instance lost part of its own prefix, so the
  fetch no longer joins it); `after_placement`, the pool did not hold it when the
  request was placed (another request stored it since: the placement's view lagged);
- *cold*: never stored in the pool before;
- *evicted*: stored before, then its last copy was dropped; the ledger keeps its age at
  eviction (from its last use anywhere in the pool to the drop);
- *unverified*: a hash hit whose token check failed; the simulator's block ids are exact,
  so it never happens here (the field is kept so reports match the cluster's).

Prefix reuse stops at the first block the pool lacks, so a block past that break which
the pool still holds takes the break's cause (cold or evicted, without an age of its
own). Every request's counts add up: hit + cold + evicted + elsewhere + unverified =
its blocks.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

import msgspec

from mooncake.conductor.index import PrefixIndex

CAUSES = ("hit", "cold", "evicted", "elsewhere", "unverified")


ELSEWHERE_PARTS = ("priced_out", "plan_lost", "after_placement")


class MissCounts(msgspec.Struct, frozen=True):
    """One request's blocks by cause; the ELSEWHERE_PARTS add up to `elsewhere`."""

    hit: int
    cold: int
    evicted: int
    elsewhere: int
    priced_out: int
    plan_lost: int
    after_placement: int
    unverified: int = 0

    @property
    def total(self) -> int:
        return self.hit + self.cold + self.evicted + self.elsewhere + self.unverified


class MissLedger:
    """Each block's history in the pool: when it was last used anywhere and when a node
    last dropped it. The pool calls `used` and `dropped`; the prefill calls `attribute`
    as a request starts.

    NOTE: a block the pool does not hold now was last dropped when its last copy went,
    and not used since (a use stores it), so its age at eviction is the difference of
    the two times; no per-drop look at the other nodes is needed.
    """

    def __init__(self, index: PrefixIndex):
        self.index = index
        self.last_use: dict[Hashable, float] = {}  # every block ever stored: last use, s
        self.last_drop: dict[Hashable, float] = {}  # when a node last dropped it, s
        self.evicted_ages: list[float] = []  # one per block a request missed as evicted, s

    def used(self, hashes: Iterable[Hashable], t: float) -> None:
        """Blocks were written or read at `t`."""
        self.last_use.update(dict.fromkeys(hashes, t))

    def dropped(self, hashes: Iterable[Hashable], t: float) -> None:
        """A node dropped these blocks at `t`."""
        self.last_drop.update(dict.fromkeys(hashes, t))

    def attribute(
        self, hashes: Sequence[Hashable], hit: int, best_seen: int, planned: int
    ) -> MissCounts:
        """Causes of `hashes[hit:]` now. `best_seen`: the pool's prefix when the request
        was placed; `planned`: the blocks the placement meant to reuse."""
        held, last, n = self.index.holders_mask, self.last_use, len(hashes)
        i = hit
        while i < n and held(hashes[i]):
            i += 1
        elsewhere = i - hit
        # [hit, i) split at `planned` and `best_seen` (planned <= best_seen: a placement
        # reuses nothing beyond the pool's prefix)
        plan_lost = max(0, min(i, planned) - hit)
        priced_out = max(0, min(i, best_seen) - max(hit, planned))
        after_placement = elsewhere - plan_lost - priced_out
        cold = evicted = 0
        if i < n:
            break_cold = hashes[i] not in last
            ages, drop = self.evicted_ages, self.last_drop
            for h in hashes[i:]:
                used = last.get(h)
                if used is None:
                    cold += 1
                elif held(h):  # past the break: unreachable, the break's cause
                    if break_cold:
                        cold += 1
                    else:
                        evicted += 1
                else:
                    evicted += 1
                    ages.append(drop[h] - used)
        return MissCounts(hit, cold, evicted, elsewhere, priced_out, plan_lost, after_placement)
