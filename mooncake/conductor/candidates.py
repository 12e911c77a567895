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
  of a lower bound of their queue (`LoadOrder`). T_queue(now) = max(floor, drain - now):
  the floor is the queued first-stage seconds less all of the running request's, the
  drain time run_started + queued seconds (when the queue would be at its floor had the
  running request no end); both change only at the queue's own events. A queue whose
  running request is within its first stage is kept sorted by drain time (bound: drain -
  now, less a rounding margin), every other by floor (bound: the floor), and the two
  sorted lists are walked merged in bound order. Each instance is priced exactly; the
  walk stops at the first instance whose lower bound is above the best TTFT found:

      bound_j = min over the walked prefix lengths p of
                q_j + R(p)                                    (recompute)
                (q_j + R(best_len)) + T_transfer_floor(best_len - p)    (fetch)

  with q_j the queue's bound, and T_transfer_floor the transfer at the fastest link of
  the fleet and the source's egress queue alone (`NetworkState.floor_estimate`), below
  any destination's real estimate. Every instance after j in either list has a queue
  bound >= q_j, so its TTFT is >= bound_j (IEEE addition and division round
  monotonically, so the inequality holds on the floats the full scan computes, not just
  on reals; the drain bound's margin covers the rounding of drain - now against
  `queue_time`'s pending - (now - run_started)): none of them can be better. An
  instance whose bound equals the best TTFT can only tie, and a tie goes to the lower
  index: when the best's index is lower than the next walked one, the walk skips the rest
  of that key in its list (they come in index order) and goes on at the next one.

What the bounded set may miss: nothing. It misses an instance only when its lower bound
proves it cannot win (or can only tie from a higher index), so the choice is the full
scan's, instance and TTFT. The cost is the explicit instances plus the walked instances
whose queue is within the best TTFT's reach; it grows with the fleet only where the
fleet's queues are all within that reach of each other and of the best (every instance
about as loaded: then the scan is the answer, and the walk degenerates to it). A waited
request (its queue priced 0 or infinite) and the other policies use the full scan.
`ConductorParams.full_scan` keeps the full scan everywhere, the reference the property
test (tests/conductor/test_candidates.py) and the simulator comparison use.

Pure logic: no clock, no I/O.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left, bisect_right, insort
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mooncake.conductor.policy import PrefillPlan, prefix_ratio

if TYPE_CHECKING:
    from mooncake.conductor.load import PrefillQueue

MAX_EXPLICIT = 16  # prefill instances of one prefix length priced one by one, at most


MARGIN = 2.0**-46  # relative rounding margin of a drain bound (the error is < 8 * 2**-53)


class LoadOrder:
    """The prefill queues in two sorted lists whose keys bound T_queue below at any `now`:

    - `floors`: (floor, index) of the queues at their floor (nothing running, or the
      running request past its predicted first-stage seconds): T_queue >= floor;
    - `drains`: (drain, index) of the queues whose running request is within its first
      stage: T_queue(now) >= drain - now, drain = run_started + pending_s (a constant).

    T_queue(now) = max(floor, drain - now) on reals, and each bound holds at every `now`,
    so a queue in either list is bounded correctly; the lists only make the bound tight.
    `moved` is called by a queue whenever its state may have changed; `advance(now)`
    moves the queues whose running request's first stage has ended to `floors` (a heap
    of those ends, stale entries skipped)."""

    def __init__(self) -> None:
        self.floors: list[tuple[float, int]] = []  # (floor, instance index), sorted
        self.drains: list[tuple[float, int]] = []  # (drain time, instance index), sorted
        self.span = 0.0  # s, the largest |run_started| + |pending_s| + |drain| keyed
        self._queues: list[PrefillQueue] = []
        self._idx: dict[int, int] = {}  # id(queue) -> instance index
        self._key: list[tuple[bool, float, float]] = []  # index -> (in drains, key, end)
        self._past: list[float] = []  # index -> first-stage end seen passed (nan: none)
        self._ends: list[tuple[float, int]] = []  # heap of (first-stage end, index)

    def rebuild(self, queues: list[PrefillQueue]) -> None:
        """Index the queues by position (after instances were removed)."""
        self.floors, self.drains, self.span, self._ends = [], [], 0.0, []
        self._queues, self._idx, self._key, self._past = [], {}, [], []
        for q in queues:
            self.add(q)

    def add(self, queue: PrefillQueue) -> None:
        """A new queue, at the next instance index."""
        i = len(self._queues)
        self._queues.append(queue)
        self._idx[id(queue)] = i
        self._past.append(math.nan)
        self._key.append((False, 0.0, math.nan))
        self.floors.insert(bisect_left(self.floors, (0.0, i)), (0.0, i))
        self.moved(queue)

    def _key_of(self, q: PrefillQueue, i: int) -> tuple[bool, float, float]:
        if q.running is not None and q.run_s > 0.0:
            end = q.run_started + q.run_s
            if end != self._past[i]:
                return True, q.run_started + q.pending_s, end
        return False, q.floor_s, math.nan

    def moved(self, queue: object) -> None:
        i = self._idx.get(id(queue))
        if i is None:
            return
        old, new = self._key[i], self._key_of(self._queues[i], i)
        if old[:2] == new[:2] and (not new[0] or old[2] == new[2]):
            return
        self._move(i, old, new)

    def _move(self, i: int, old: tuple[bool, float, float], new: tuple[bool, float, float]) -> None:
        entries = self.drains if old[0] else self.floors
        del entries[bisect_left(entries, (old[1], i))]
        insort(self.drains if new[0] else self.floors, (new[1], i))
        self._key[i] = new
        if new[0]:
            q = self._queues[i]
            span = abs(q.run_started) + abs(q.pending_s) + abs(new[1])
            if span > self.span:
                self.span = span
            heapq.heappush(self._ends, (new[2], i))
            if len(self._ends) > 4 * len(self._queues) + 64:  # NOTE: drop stale entries
                self._ends = [(k[2], j) for j, k in enumerate(self._key) if k[0]]
                heapq.heapify(self._ends)

    def advance(self, now: float) -> None:
        """Move to `floors` the queues whose running request's first stage ended by `now`."""
        ends = self._ends
        while ends and ends[0][0] <= now:
            end, i = heapq.heappop(ends)
            old = self._key[i]
            if old[0] and old[2] == end:  # else stale: the queue moved since
                self._past[i] = end
                self._move(i, old, self._key_of(self._queues[i], i))

    def drain_bound(self, drain: float, now: float) -> float:
        """A floor of T_queue(now) as `PrefillQueue.queue_time` computes it (floats) for a
        queue in `drains` at `drain`: drain - now less a rounding margin, at least 0;
        non-decreasing in `drain`."""
        x = (drain - now) - (abs(now) + self.span) * MARGIN
        return x if x > 0.0 else 0.0

    def check(self, queues: list[PrefillQueue]) -> None:
        """Assert the lists hold every queue once, at its current key."""
        assert self._queues == queues, "load order indexes other queues"
        want_f: list[tuple[float, int]] = []
        want_d: list[tuple[float, int]] = []
        for i, q in enumerate(queues):
            key = self._key_of(q, i)
            assert key[:2] == self._key[i][:2], (q.name, key, self._key[i])
            (want_d if key[0] else want_f).append((key[1], i))
        assert self.floors == sorted(want_f), (self.floors[:8], sorted(want_f)[:8])
        assert self.drains == sorted(want_d), (self.drains[:8], sorted(want_d)[:8])


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
    now: float,
) -> PrefillPlan:
    """Algorithm 1's plan (module docstring). `explicit`: instance -> its prefix length,
    priced one by one; `walked`: (prefix length, mask of index bits) of the instances
    priced in the walk, an instance in no mask holding nothing (length 0); `node_bits`:
    each instance's bit in the prefix index."""
    best_len, thr, can_fetch = prices.best_len, prices.threshold, prices.can_fetch
    best_ttft, best_idx, best_reused, best_src = math.inf, len(node_bits), 0, -1
    order.advance(now)
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

    def bound(x: float) -> float:  # the least TTFT of a walked instance of T_queue >= x
        b = math.inf
        for recomputes, s in terms:
            v = x + s if recomputes else (x + full_fetch_s) + s
            if v < b:
                b = v
        return b

    # NOTE: two walks merged in bound order; each list's entries come in bound order
    floors, drains, drain_bound = order.floors, order.drains, order.drain_bound
    ka, kb, na, nb = 0, 0, len(floors), len(drains)
    ba = bound(floors[0][0]) if na else math.inf
    bb = bound(drain_bound(drains[0][0], now)) if nb else math.inf
    while ka < na or kb < nb:
        if kb >= nb or (ka < na and ba <= bb):
            if ba > best_ttft:
                break  # NOTE: bb >= ba: no entry left in either list can win
            key, i = floors[ka]
            if ba == best_ttft and i > best_idx:  # can only tie, from a higher index
                ka = bisect_right(floors, (key, math.inf), ka)
            else:
                ka += 1
                if i not in explicit:
                    price(i, walked_len(walked, node_bits[i]))
            ba = bound(floors[ka][0]) if ka < na else math.inf
        else:
            if bb > best_ttft:
                break
            key, i = drains[kb]
            if bb == best_ttft and i > best_idx:
                kb = bisect_right(drains, (key, math.inf), kb)
            else:
                kb += 1
                if i not in explicit:
                    price(i, walked_len(walked, node_bits[i]))
            bb = bound(drain_bound(drains[kb][0], now)) if kb < nb else math.inf
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
