"""Why a request recomputed blocks it could have reused: miss attribution, one code for the
simulator and the real master.

Each block a request could have reused is either reused (*hit*) or gets one cause, decided
from the pool as it was when the request's prefill started:

- *elsewhere*: the pool held it (and every block before it, on some nodes) but this
  request did not reuse it, in three parts: `priced_out`, the placement saw it in the pool
  and chose to recompute it (Algorithm 1 weighs the transfer and each instance's queue,
  the holder's included, against recomputing); `plan_lost`, the placement meant to reuse
  it but the plan was overtaken before the start (the chosen instance lost part of its
  own prefix; on the cluster: the fetch failed); `after_placement`, the placement's view
  of the pool did not have it (stored since, or the index lagging);
- *cold*: never stored in the pool before (or evicted so long ago that the ledger forgot
  it: see `MissLedger`);
- *evicted*: stored before, then its last copy was dropped; with its age at eviction (from
  its last use anywhere in the pool to the drop);
- *unverified*: a hash hit whose token check failed (on the cluster: a pool object whose
  tokens, model or checksum did not match; the simulator's block ids are exact).

Prefix reuse stops at the first block it cannot take, so a block past that break which
the pool still holds takes the break's cause (cold, evicted or unverified, without an
age of its own). Every request's counts add up: hit + cold + evicted + elsewhere +
unverified = its blocks.

Two steps, so the cluster can take them at two moments: `MissLedger.snapshot` as the
prefill starts (each block held, evicted with its age, or cold) and `classify` once the
prefill reports what it reused. The simulator takes both at once (`MissLedger.attribute`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence

import msgspec

from mooncake.conductor.index import PrefixIndex

CAUSES = ("hit", "cold", "evicted", "elsewhere", "unverified")
ELSEWHERE_PARTS = ("priced_out", "plan_lost", "after_placement")
DEFAULT_MEMORY_BLOCKS = 1_000_000  # evictions remembered (about 175 bytes each)


class MissCounts(msgspec.Struct, frozen=True, kw_only=True):
    """One request's blocks by cause; the ELSEWHERE_PARTS add up to `elsewhere`."""

    hit: int = 0
    cold: int = 0
    evicted: int = 0
    elsewhere: int = 0
    unverified: int = 0
    priced_out: int = 0
    plan_lost: int = 0
    after_placement: int = 0
    evicted_age_s: tuple[float, ...] = ()  # s, one per evicted block with an age of its own

    @property
    def total(self) -> int:
        return self.hit + self.cold + self.evicted + self.elsewhere + self.unverified


class PoolView(msgspec.Struct, frozen=True):
    """A request's blocks as the pool had them when its prefill started."""

    is_held: tuple[bool, ...]  # block i: some node holds it
    evicted_age_s: dict[int, float]  # block i -> age at eviction (s), for dropped blocks
    # the ledger remembers; a block neither held nor here is cold


def classify(
    view: PoolView, hit: int, best_seen: int, planned: int, is_unverified: bool = False
) -> MissCounts:
    """Causes of the blocks past the first `hit`. `best_seen`: the pool's prefix when the
    request was placed; `planned`: the blocks the placement meant to reuse;
    `is_unverified`: reuse stopped at block `hit` because its check failed."""
    held, n = view.is_held, len(view.is_held)
    assert 0 <= hit <= n, (hit, n)
    i = hit
    while i < n and held[i]:
        i += 1
    unverified = elsewhere = plan_lost = priced_out = 0
    if is_unverified and hit < n:
        i = max(i, hit + 1)  # NOTE: the prefill saw it by hash even if the view did not
        unverified = i - hit
    else:
        elsewhere = i - hit
        # [hit, i) split at `planned` and `best_seen` (planned <= best_seen: a placement
        # reuses nothing beyond the pool's prefix)
        plan_lost = max(0, min(i, planned) - hit)
        priced_out = max(0, min(i, best_seen) - max(hit, planned))
    cold = evicted = 0
    ages: list[float] = []
    if i < n:
        gone = view.evicted_age_s
        break_cold = i not in gone
        for k in range(i, n):
            age = gone.get(k)
            if age is not None:
                evicted += 1
                ages.append(age)
            elif not held[k] or break_cold:  # NOTE: a held one takes the break's cause
                cold += 1
            else:
                evicted += 1
    return MissCounts(
        hit=hit,
        cold=cold,
        evicted=evicted,
        elsewhere=elsewhere,
        unverified=unverified,
        priced_out=priced_out,
        plan_lost=plan_lost,
        after_placement=elsewhere - plan_lost - priced_out,
        evicted_age_s=tuple(ages),
    )


class MissLedger:
    """Each block's history in the pool: the last use of every block the pool holds, and
    the age at eviction of blocks whose last copy was dropped. The pool (or the master,
    from store events) calls `used` and `dropped`, the latter after the prefix index
    applied the drop.

    NOTE: memory is bounded. Last uses are kept only for blocks the pool holds (the index's
    size); evictions for the `memory_blocks` most recent ones: an older one is forgotten,
    and such a block, requested again, counts as cold.
    """

    def __init__(self, index: PrefixIndex, memory_blocks: int = DEFAULT_MEMORY_BLOCKS):
        assert memory_blocks >= 0, memory_blocks
        self.index = index
        self.memory_blocks = memory_blocks
        self.last_use: dict[Hashable, float] = {}  # held blocks: last write or read, s
        self.evicted: OrderedDict[Hashable, float] = OrderedDict()  # hash -> age at eviction, s

    def used(self, hashes: Iterable[Hashable], t: float) -> None:
        """Blocks were written or read at `t`."""
        last, gone = self.last_use, self.evicted
        for h in hashes:
            last[h] = t
            if gone:
                gone.pop(h, None)

    def read(self, hashes: Iterable[Hashable], t: float) -> None:
        """Blocks were read at `t`: the last use of those the pool still holds."""
        held = self.index.holders_mask
        self.used([h for h in hashes if held(h)], t)

    def dropped(self, hashes: Iterable[Hashable], t: float) -> None:
        """A node dropped these blocks at `t`; those no node holds now are evicted."""
        held, last, gone = self.index.holders_mask, self.last_use, self.evicted
        for h in hashes:
            if held(h):
                continue
            used = last.pop(h, None)
            if used is None:  # NOTE: never seen stored (dropped twice, or before we knew)
                continue
            gone[h] = t - used
            gone.move_to_end(h)
        while len(gone) > self.memory_blocks:
            gone.popitem(last=False)

    def node_lost(self, t: float) -> None:
        """A node's blocks went at once (it left the pool): every block no node holds now
        is evicted (one pass over the held blocks; nodes leave rarely)."""
        held = self.index.holders_mask
        self.dropped([h for h in self.last_use if not held(h)], t)

    def snapshot(self, hashes: Sequence[Hashable]) -> PoolView:
        """The pool as it is now for these blocks (no change)."""
        held, gone = self.index.holders_mask, self.evicted
        is_held = tuple(bool(held(h)) for h in hashes)
        ages = {i: gone[h] for i, h in enumerate(hashes) if not is_held[i] and h in gone}
        return PoolView(is_held, ages)

    def attribute(
        self, hashes: Sequence[Hashable], hit: int, best_seen: int, planned: int
    ) -> MissCounts:
        """`classify` on the pool as it is now (the simulator's single step)."""
        return classify(self.snapshot(hashes), hit, best_seen, planned)

    def check_integrity(self) -> None:
        """Every remembered last use is of a held block; the evictions within the cap."""
        held = self.index.holders_mask
        assert all(held(h) for h in self.last_use), "a last use of a block no node holds"
        assert len(self.evicted) <= self.memory_blocks, (len(self.evicted), self.memory_blocks)
        assert not self.evicted.keys() & self.last_use.keys(), "a block both held and evicted"
