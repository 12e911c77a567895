"""Decode placement at arrival over a bounded candidate set, and the decode pool's totals.

`placement.place_decode` scans every decode instance: among those whose KV room fits the
request, the first with the least predicted TBT, step(num + 1, tokens) (tokens = the
batch's KV at `now` + reservations + the request); when none fits, the first with the
least TBT. `DecodeOrder.place` returns the same instance without the scan when the step
polynomial is non-decreasing in both arguments (every coefficient >= 0, as the roofline's
and any fitted profile of a real GPU): the instances are bucketed by `num` (requests,
running + reserved), each bucket sorted by the floor of its KV (`floor_tokens`: the
batch's KV at its last report + reservations; the KV at `now` is never less) and index.
A bucket's next instance has the least bound in it, step(num + 1, floor + input_len); the
buckets are merged in bound order (a heap) and each instance popped is priced exactly. The
walk stops at the first bound above the best fitting TBT found: every instance left is
priced at least that bound (the polynomial is monotone and IEEE arithmetic rounds
monotonically). A bound equal to the best can only tie, and from a higher index the rest
of that floor value in the bucket is skipped. What it may miss: nothing; it walks the
whole fleet only when no instance fits the request (there is no fitting best to stop at)
or every instance's bound is within reach of the best. With a polynomial that has a
negative coefficient, or `ConductorParams.full_scan`, the Conductor scans.

`DecodeTotals`: the pool's requests decoding now and their KV at `now`, kept as instances
change rather than summed over the fleet per decision: an exact integer sum of prompt and
reported tokens, and exact sums of each instance's generation rate and rate x report time
(floats summed as integers of 2**-1074, so the totals do not drift and do not depend on
the order of the changes), read as held(now) = tokens + now x rates - rate-times. A
report from the future (report_t > now) would count negative growth where the scan counts
none: reports carry times no later than the decisions that follow them, as the master's
and the simulator's do.

Pure logic: no clock, no I/O.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left, bisect_right, insort
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mooncake.conductor.load import DecodeSlots

_SCALE = 1 << 1074  # every finite double is an integer multiple of 2**-1074


def _exact(x: float) -> int:
    n, d = x.as_integer_ratio()
    return n * (_SCALE // d)


class DecodeTotals:
    """The decode pool's (requests decoding, KV held at `now`), kept as instances change."""

    def __init__(self) -> None:
        self.num_active = 0  # requests decoding now, over the pool
        self._tokens = 0  # sum of active + generated tokens
        self._rate = 0  # exact sum of gen_per_s, in 2**-1074
        self._rate_t = 0  # exact sum of gen_per_s * report_t (each product as computed)
        self._of: dict[int, tuple[int, int, int, int]] = {}  # id(slots) -> its terms

    def update(self, s: DecodeSlots) -> None:
        terms = (
            len(s.active),
            s.active_tokens + s.generated,
            _exact(s.gen_per_s),
            _exact(s.gen_per_s * s.report_t),
        )
        old = self._of.get(id(s), (0, 0, 0, 0))
        if old != terms:
            self.num_active += terms[0] - old[0]
            self._tokens += terms[1] - old[1]
            self._rate += terms[2] - old[2]
            self._rate_t += terms[3] - old[3]
            self._of[id(s)] = terms

    def forget(self, s: DecodeSlots) -> None:
        old = self._of.pop(id(s), None)
        if old is not None:
            self.num_active -= old[0]
            self._tokens -= old[1]
            self._rate -= old[2]
            self._rate_t -= old[3]

    @property
    def gen_per_s(self) -> float:
        """Sum of the instances' generation rates, tokens/s."""
        return self._rate / _SCALE

    def held(self, now: float) -> float:
        """KV tokens the pool's batches hold at `now`."""
        n, d = now.as_integer_ratio()
        return self._tokens + (self._rate * n - self._rate_t * d) / (d * _SCALE)

    def check(self, decode: list[DecodeSlots]) -> None:
        fresh = DecodeTotals()
        for s in decode:
            fresh.update(s)
        assert (fresh.num_active, fresh._tokens, fresh._rate, fresh._rate_t) == (
            self.num_active,
            self._tokens,
            self._rate,
            self._rate_t,
        ), "decode totals out of sync"


def floor_tokens(s: DecodeSlots) -> float:  # NOTE: summed as place_decode sums held
    """The least KV tokens `s` holds at any time from its last report on, reservations in."""
    return (s.active_tokens + s.generated + 0.0) + s.reserved_tokens


class DecodeOrder:
    """The decode instances bucketed by `num`, each bucket sorted by (floor, index)."""

    def __init__(self) -> None:
        self.buckets: dict[int, list[tuple[float, int]]] = {}  # num -> sorted entries
        self._key: dict[int, tuple[int, float, int]] = {}  # id(slots) -> (num, floor, idx)
        self._idx: dict[int, int] = {}  # id(slots) -> index
        self.totals = DecodeTotals()
        # KV room -> the indices of the instances of that room with nothing running or reserved
        self.idle: dict[int, list[int]] = {}

    def rebuild(self, decode: list[DecodeSlots]) -> None:
        self.buckets, self._key, self.totals, self.idle = {}, {}, DecodeTotals(), {}
        self._idx = {id(s): i for i, s in enumerate(decode)}
        for s in decode:
            self.moved(s)

    def add(self, s: DecodeSlots, idx: int) -> None:
        """A new instance at index `idx` (appended to the Conductor's list)."""
        self._idx[id(s)] = idx
        self.moved(s)

    def moved(self, s: DecodeSlots) -> None:
        i = self._idx.get(id(s))
        if i is None:
            return
        self.totals.update(s)
        key = (s.num, floor_tokens(s), i)
        old = self._key.get(id(s))
        if old == key:
            return
        if old is not None:
            bucket = self.buckets[old[0]]
            del bucket[bisect_left(bucket, old[1:])]
            if not bucket:
                del self.buckets[old[0]]
        insort(self.buckets.setdefault(key[0], []), key[1:])
        self._key[id(s)] = key
        was_idle, is_idle = old is not None and old[0] == 0, key[0] == 0
        if was_idle != is_idle:
            idle = self.idle.setdefault(s.capacity_tokens, [])
            if is_idle:
                insort(idle, i)
            else:
                del idle[bisect_left(idle, i)]

    def start_candidates(self) -> list[int]:
        """The instances `placement.place_at_start` needs to price, by index: every busy
        one (requests running or reserved) and the first idle one of each KV room."""
        busy = [i for num, entries in self.buckets.items() if num for _, i in entries]
        busy += [idle[0] for idle in self.idle.values() if idle]
        busy.sort()
        return busy

    def place(
        self,
        decode: list[DecodeSlots],
        step: Callable[[float, float], float],
        input_len: int,
        now: float,
    ) -> tuple[DecodeSlots, float]:
        """`placement.place_decode`'s instance and TBT (module docstring)."""
        heap: list[tuple[float, int, int, int]] = []  # (bound, num, position, index)
        for num, entries in self.buckets.items():
            floor, i = entries[0]
            heap.append((step(num + 1, floor + input_len), num, 0, i))
        heapq.heapify(heap)
        fit_t, fit_i = math.inf, len(decode)  # the best fitting instance so far
        any_t, any_i = math.inf, len(decode)  # the best of all, for when none fits
        while heap:
            bound, num, k, i = heap[0]
            if bound > fit_t:
                break
            entries = self.buckets[num]
            if bound == fit_t and i > fit_i:  # can only tie, from a higher index
                k = bisect_right(entries, (entries[k][0], math.inf), k)
            else:
                s = decode[i]
                dt = now - s.report_t  # NOTE: as place_decode prices it
                held = s.active_tokens + s.generated + (s.gen_per_s * dt if dt > 0 else 0.0)
                tokens = held + s.reserved_tokens + input_len
                t = step(s.num + 1, tokens)
                if tokens <= s.capacity_tokens:
                    if t < fit_t or (t == fit_t and i < fit_i):
                        fit_t, fit_i = t, i
                elif t < any_t or (t == any_t and i < any_i):
                    any_t, any_i = t, i
                k += 1
            if k < len(entries):
                floor, j = entries[k]
                heapq.heapreplace(heap, (step(num + 1, floor + input_len), num, k, j))
            else:
                heapq.heappop(heap)
        if fit_i < len(decode):
            return decode[fit_i], fit_t
        return decode[any_i], any_t


def is_monotone(coefs: list[float]) -> bool:
    """Whether a polynomial with these coefficients is non-decreasing on x, y >= 0."""
    return all(c >= 0 for c in coefs)
