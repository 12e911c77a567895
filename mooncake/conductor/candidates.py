"""Algorithm 1 over a bounded candidate set: the same choice as the scan of every instance.

The full scan (`policy.KVCacheCentricPolicy`) prices every prefill instance i:

    recompute (no fetch possible, p_i == best_len, or best_len / p_i < threshold):
        TTFT_i = T_queue(i) + R(p_i)                 R(p) = T_prefill(p) + T_read(p)
    fetch:
        TTFT_i = (T_queue(i) + R(best_len)) + T_transfer(best_idx -> i, best_len - p_i)

and keeps the first i with the least TTFT (lowest index among equal TTFTs). Here the
instances fall in two parts:

- explicit: the instances holding a prefix of the request that few others hold (each
  distinct prefix length held by at most `MAX_EXPLICIT` prefill instances; the index
  gives them as bitmasks, `PrefixIndex.prefix_groups`), and `best_idx` itself: priced
  exactly, one by one;
- walked: every other instance (those holding nothing of the prompt, and the members of
  a prefix length many hold, as a shared system prompt's first block), in increasing order
  of a floor of their queue (`LoadOrder`: T_queue(i) >= floor(i) at every `now`, the
  queued first-stage seconds minus the running request's, changed only by the queue's
  own events, so a sorted list kept as queues change). Each is priced exactly; the walk
  stops at the first instance whose lower bound is above the best TTFT found:

      bound_j = min over the walked prefix lengths p of
                floor(j) + R(p)                                   (recompute)
                (floor(j) + R(best_len)) + T_transfer_floor(best_len - p)   (fetch)

  where T_transfer_floor prices the transfer at the fastest link of the fleet and the
  source's egress queue alone (`NetworkState.floor_estimate`), below any destination's
  real estimate. Every instance after j in the walk has floor >= floor(j), so its TTFT is
  >= bound_j (IEEE addition and division round monotonically, so the inequality holds
  on the floats the full scan computes, not just on reals): none of them can be better.
  An instance whose bound equals the best TTFT can only tie, and a tie goes to the lower
  index: when the best's index is lower than the next walked one, the walk skips the rest
  of that floor value (they come in index order) and goes on at the next one.

What the bounded set may miss: nothing. It misses an instance only when its lower bound
proves it cannot win (or can only tie from a higher index), so the choice is the full
scan's, instance and TTFT. The cost is the explicit instances plus the walked instances
whose floor is within the best TTFT's reach; it grows with the fleet only where the
fleet's queues are all within that reach of each other and of the best (every instance
about as loaded: then the scan is the answer, and the walk degenerates to it). A waited
request (its queue priced 0 or infinite) and the other policies use the full scan.
`ConductorParams.full_scan` keeps the full scan everywhere, the reference the property
test (tests/conductor/test_candidates.py) and the simulator comparison use.

Pure logic: no clock, no I/O.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right, insort
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mooncake.conductor.policy import PrefillPlan, prefix_ratio

if TYPE_CHECKING:
    from mooncake.conductor.load import PrefillQueue

MAX_EXPLICIT = 16  # prefill instances of one prefix length priced one by one, at most


class LoadOrder:
    """The prefill queues sorted by their floor (`PrefillQueue.floor_s`), then index.
    `moved` is called by a queue whenever its floor may have changed."""

    def __init__(self) -> None:
        self.entries: list[tuple[float, int]] = []  # (floor, instance index), sorted
        self._key: dict[int, tuple[float, int]] = {}  # id(queue) -> its entry
        self._idx: dict[int, int] = {}  # id(queue) -> instance index

    def rebuild(self, queues: list[PrefillQueue]) -> None:
        """Index the queues by position (after instances were added or removed)."""
        self._idx = {id(q): i for i, q in enumerate(queues)}
        self._key = {id(q): (q.floor_s, i) for i, q in enumerate(queues)}
        self.entries = sorted(self._key.values())

    def moved(self, queue: object, floor_s: float) -> None:
        i = self._idx.get(id(queue))
        if i is None:
            return
        old = self._key[id(queue)]
        if old[0] == floor_s:
            return
        entries = self.entries
        del entries[bisect_left(entries, old)]
        new = (floor_s, i)
        insort(entries, new)
        self._key[id(queue)] = new

    def check(self, queues: list[PrefillQueue]) -> None:
        """Assert the order holds every queue at its current floor."""
        want = sorted((q.floor_s, i) for i, q in enumerate(queues))
        assert self.entries == want, (self.entries[:8], want[:8])


@dataclass(slots=True)
class Prices:
    """What Algorithm 1 prices per instance, for one request (units: seconds, blocks)."""

    threshold: float  # kvcache_balancing_threshold
    can_fetch: bool  # False when instances cannot read each other's cache
    best_len: int  # longest prefix anywhere, blocks
    best_idx: int  # where it is (a match index; -1: nowhere)
    queue_s: Callable[[int], float]  # instance -> T_queue now
    recompute_s: Callable[[int], float]  # reused blocks -> R(p)
    transfer_s: Callable[[int, int, int], float]  # (src, dst, blocks) -> T_transfer
    transfer_floor_s: Callable[[int], float]  # blocks -> T_transfer's floor over every dst


def choose(
    prices: Prices,
    explicit: dict[int, int],
    walked: list[tuple[int, int]],
    node_bits: list[int],
    order: LoadOrder,
) -> PrefillPlan:
    """Algorithm 1's plan (module docstring). `explicit`: instance -> its prefix length,
    priced one by one; `walked`: (prefix length, mask of index bits) of the instances
    priced in the walk, an instance in no mask holding nothing (length 0); `node_bits`:
    each instance's bit in the prefix index."""
    best_len, thr, can_fetch = prices.best_len, prices.threshold, prices.can_fetch
    best_ttft, best_idx, best_reused, best_src = math.inf, len(node_bits), 0, -1
    full_fetch_s = prices.recompute_s(best_len)
    recompute: dict[int, float] = {}

    def is_recompute(p: int) -> bool:
        return not can_fetch or best_len == p or bool(p and best_len / p < thr)

    def price(i: int, p: int) -> None:
        nonlocal best_ttft, best_idx, best_reused, best_src
        if is_recompute(p):
            t = recompute.get(p)
            if t is None:
                t = recompute[p] = prices.recompute_s(p)
            ttft, reused, src = prices.queue_s(i) + t, p, -1
        else:
            ttft = prices.queue_s(i) + full_fetch_s
            if ttft > best_ttft:
                return  # NOTE: T_transfer >= 0, so it cannot win; skip pricing it
            ttft += prices.transfer_s(prices.best_idx, i, best_len - p)
            reused, src = best_len, prices.best_idx
        if ttft < best_ttft or (ttft == best_ttft and i < best_idx):
            best_ttft, best_idx, best_reused, best_src = ttft, i, reused, src

    for i, p in explicit.items():
        price(i, p)
    # the bound's terms, one per prefix length among the walked: (is a recompute, seconds)
    terms = [
        (True, prices.recompute_s(p))
        if is_recompute(p)
        else (False, prices.transfer_floor_s(best_len - p))
        for p in dict.fromkeys([length for length, _ in walked] + [0])
    ]
    entries, k, n = order.entries, 0, len(order.entries)
    while k < n:
        floor, i = entries[k]
        bound = math.inf
        for recomputes, s in terms:
            b = floor + s if recomputes else (floor + full_fetch_s) + s
            if b < bound:
                bound = b
        if bound > best_ttft:
            break
        if bound == best_ttft and i > best_idx:  # can only tie, from a higher index
            k = bisect_right(entries, (floor, math.inf), k)
            continue
        k += 1
        if i not in explicit:
            price(i, walked_len(walked, node_bits[i]))
    p_idx = explicit.get(best_idx)
    if p_idx is None:
        p_idx = walked_len(walked, node_bits[best_idx])
    replicate = best_src >= 0 and prefix_ratio(best_len, p_idx) > thr
    return PrefillPlan(best_idx, best_reused, best_src, best_ttft, replicate)


def walked_len(walked: list[tuple[int, int]], bit: int) -> int:
    """Prefix length of the instance of index bit `bit` among the walked: its mask's, else 0."""
    for length, mask in walked:
        if mask & bit:
            return length
    return 0
