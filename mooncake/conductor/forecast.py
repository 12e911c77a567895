"""The §7.4 decode forecast: how long requests decode, the decode pool's load at a future
time, and how far such forecasts turned out to be.

- `DecodeTimes`: how long requests decode, measured: the survival of decode durations and
  the share of the KV decoding now that still decodes h seconds later.
- `DecodeForecast`: the decode pool's (requests, KV tokens) at a future time t: the
  running requests that will still decode at t, plus the requests in prefill whose
  prefill ends by t and that will still decode at t.
- `ForecastError`: the forecasts scored as they come due; predictive rejection at arrival
  takes a margin of a few times this error.

Pure logic: time is passed in; nothing here reads a clock.
"""

from __future__ import annotations

import heapq
import itertools
import math
from bisect import bisect_left, bisect_right
from collections import deque
from collections.abc import Hashable
from itertools import accumulate

import numpy as np

GRID = 64  # points of the DecodeTimes tables


class DecodeTimes:
    """How long requests decode, from the durations measured (decode start to finish).

    - `survival(x)`: the share of requests that decode for longer than x seconds;
    - `residual(h)`: the share of the KV decoding now that still decodes h seconds later.
      A running request is caught at a uniformly random point of its decode, so this is
      E[max(D - h, 0)] / E[D] over the measured durations D (the residual-life law);
    - `mean_survival(h)`: survival averaged over [0, h] = E[min(D, h)] / h, the share of
      requests landing at a steady rate over the last h seconds that still decode;
    - `still_decoding(ages, h)`: for requests decoding for `ages` seconds now, the chance
      each still decodes h seconds later, survival(age + h) / survival(age) (1 for a
      request older than every duration measured: nothing says when it ends).
    Until `min_samples` are measured every request decodes for `mean_s`, §7.4's uniform
    t_d: survival is a step at t_d, residual(h) = max(0, 1 - h / t_d) and mean_survival(h)
    = min(1, t_d / h). `mean_s` starts at the configured t_d, then is the mean of the
    durations measured and, once 1/ewma of them are, an exponential moving average. The
    tables cover the last `window` durations on a grid of GRID points, rebuilt every
    `min_samples` measurements.
    NOTE: output lengths are long-tailed and unknown in advance (conversation trace: mean
    343 tokens, standard deviation 250), so a uniform t_d mispredicts which requests still
    decode. Against it the measured law cuts the spread of the pool forecast a TTFT ahead
    from 0.10 to 0.08 of the pool's KV (5P+1D at 2x) and from 0.084 to 0.051 (9P+2D at
    4x); what is left is why predictive rejection at arrival takes a margin.
    """

    def __init__(self, prior_s: float, ewma: float, window: int = 1024, min_samples: int = 32):
        self.mean_s = prior_s  # t_d, s
        self.num_measured = 0
        self._ewma = ewma
        self._samples: deque[float] = deque(maxlen=window)
        self._min = min_samples
        self._refresh = min_samples
        self._step = 0.0  # s between grid points; 0 = no tables yet (uniform t_d)
        self._surv: list[float] = []
        self._resid: list[float] = []
        self._upto: list[float] = []  # E[min(D, x)], s
        self._grid: np.ndarray = np.zeros(0)  # s, the grid points, for vectorized survival

    def add(self, seconds: float) -> None:
        self.num_measured += 1
        weight = max(1.0 / self.num_measured, self._ewma)
        self.mean_s += weight * (seconds - self.mean_s)
        self._samples.append(seconds)
        if len(self._samples) >= self._min and self.num_measured % self._refresh == 0:
            self._rebuild()

    def _rebuild(self) -> None:
        d = sorted(self._samples)
        n, total = len(d), sum(d)
        if total <= 0:
            return
        step = d[-1] / GRID
        suffix = list(accumulate(reversed(d)))[::-1] + [0.0]  # suffix[k] = sum(d[k:])
        surv, resid, upto = [], [], []
        for i in range(GRID + 1):
            x = i * step
            k = bisect_right(d, x)
            surv.append((n - k) / n)
            resid.append((suffix[k] - x * (n - k)) / total)
            upto.append((total - suffix[k] + x * (n - k)) / n)
        self._step, self._surv, self._resid, self._upto = step, surv, resid, upto
        self._grid = np.arange(GRID + 1) * step

    @property
    def longest_s(self) -> float:
        """No request is expected to decode longer than this, seconds."""
        return self._step * GRID if self._step else self.mean_s

    def survival(self, x: float) -> float:
        if not self._step:
            return 1.0 if x < self.mean_s else 0.0
        return _interp(self._surv, x / self._step)

    def residual(self, h: float) -> float:
        if not self._step:
            return 1.0 - h / self.mean_s if h < self.mean_s else 0.0
        return _interp(self._resid, h / self._step)

    def still_decoding(self, ages: np.ndarray, h: float) -> np.ndarray:
        if not self._step:
            now_s = ages < self.mean_s
            return np.where(now_s, (ages + h < self.mean_s).astype(float), 1.0)
        s_now = np.interp(ages, self._grid, self._surv)
        s_then = np.interp(ages + h, self._grid, self._surv)
        return np.where(s_now > 0.0, s_then / np.maximum(s_now, 1e-12), 1.0)

    def mean_survival(self, h: float) -> float:
        if h <= 0.0:
            return 1.0
        if not self._step:
            return 1.0 if h < self.mean_s else self.mean_s / h
        i = h / self._step
        return (_interp(self._upto, i) if i < GRID else self._upto[-1]) / h


def _interp(table: list[float], i: float) -> float:
    """table at fractional index i, linear between points, flat beyond the ends."""
    if i <= 0.0:
        return table[0]
    k = int(i)
    if k >= len(table) - 1:
        return table[-1]
    return table[k] + (i - k) * (table[k + 1] - table[k])


class _TimedSet:
    """Requests sorted by a time, with their KV tokens; sums over a time window."""

    __slots__ = ("times", "tokens", "ids", "total_tokens", "total_time")

    def __init__(self) -> None:
        self.times: list[float] = []
        self.tokens: list[int] = []
        self.ids: list[Hashable] = []
        self.total_tokens = 0
        self.total_time = 0.0  # sum of times, s

    def add(self, req_id: Hashable, t: float, tokens: int) -> None:
        i = bisect_right(self.times, t)  # usually the end: times mostly arrive in order
        self.times.insert(i, t)
        self.tokens.insert(i, tokens)
        self.ids.insert(i, req_id)
        self.total_tokens += tokens
        self.total_time += t

    def remove(self, req_id: Hashable, t: float) -> int | None:
        """Remove the request filed at time t; returns its tokens (None if absent)."""
        i = bisect_left(self.times, t)
        ids = self.ids
        while i < len(ids) and ids[i] != req_id:
            i += 1
        if i == len(ids):
            return None
        self.total_time -= self.times.pop(i)
        del self.ids[i]
        tokens = self.tokens.pop(i)
        self.total_tokens -= tokens
        if not ids:
            self.total_time = 0.0  # NOTE: stops float drift from accumulating
        return tokens

    def window(self, lo: float, hi: float) -> tuple[int, int, float]:
        """(count, tokens, sum of times) of the entries with lo < time <= hi."""
        times = self.times
        i, j = bisect_right(times, lo), bisect_right(times, hi)
        if 2 * (j - i) <= len(times):
            return j - i, sum(self.tokens[i:j]), sum(times[i:j])
        # NOTE: a wide window is summed as the total minus its two short ends
        tokens = self.total_tokens - sum(self.tokens[:i]) - sum(self.tokens[j:])
        return j - i, tokens, self.total_time - sum(times[:i]) - sum(times[j:])


class DecodeForecast:
    """The decode pool's predicted (requests, KV tokens) at a future time (§7.4).

    The paper: at time t the pool holds the requests decoding now whose decode has not
    ended by t, plus the requests in prefill whose prefill has ended by t and whose decode
    has not; every request decodes for the same time t_d. Here the decode durations are
    the measured law (`DecodeTimes`; the paper's uniform t_d until enough are measured):
    a share residual(t - now) of the KV decoding now is still there at t, and the requests
    whose prefill ends by t are there with the survival averaged over the horizon, each
    holding its prompt plus the tokens generated since its prefill ended, at the pool's
    rate (`gen_per_s` tokens per second per request, from the instances' load reports).
    """

    def __init__(self, decode_time_s: float, ewma: float):
        self.times = DecodeTimes(decode_time_s, ewma)
        self.capacity_tokens = 0  # KV tokens of the whole decode pool
        self.gen_per_s = 0.0  # KV tokens a decoding request adds per second
        self._prefilling = _TimedSet()  # by predicted prefill end
        self._when: dict[Hashable, tuple[bool, float]] = {}  # req_id -> (is decoding, time)

    @property
    def decode_time_s(self) -> float:
        """t_d: the mean decode time, seconds."""
        return self.times.mean_s

    def add_prefilling(self, req_id: Hashable, ready_at: float, tokens: int) -> None:
        self._prefilling.add(req_id, ready_at, tokens)
        self._when[req_id] = (False, ready_at)

    def prefill_ends_at(self, req_id: Hashable, ready_at: float) -> None:
        """A new prediction (prefill started) or the fact (it ended) of its prefill's end."""
        where = self._when.get(req_id)
        if where is not None and not where[0] and where[1] != ready_at:
            tokens = self._prefilling.remove(req_id, where[1])
            assert tokens is not None, req_id
            self.add_prefilling(req_id, ready_at, tokens)

    def start_decode(self, req_id: Hashable, now: float) -> None:
        self.drop(req_id)
        self._when[req_id] = (True, now)

    def finish_decode(self, req_id: Hashable, now: float) -> None:
        where = self._when.get(req_id)
        if where is not None and where[0]:
            self.times.add(now - where[1])
        self.drop(req_id)

    def drop(self, req_id: Hashable) -> None:
        """Forget the request (it finished, or will not decode)."""
        where = self._when.pop(req_id, None)
        if where is not None and not where[0]:
            self._prefilling.remove(req_id, where[1])

    def at(
        self, t: float, now: float, running: float, running_tokens: float
    ) -> tuple[float, float]:
        """Predicted (requests, KV tokens) decoding at t >= now, when `running` requests
        holding `running_tokens` of KV decode now (expected values, hence floats)."""
        times, g, h = self.times, self.gen_per_s, t - now
        share = times.residual(h)
        n = share * running
        tokens = share * (running_tokens + running * g * h)
        # the requests whose prefill ends by t land at a roughly steady rate over the
        # horizon: each still decodes at t with the survival averaged over it
        # NOTE: one window, so a prefill overdue at `now` counts as landed in the horizon;
        # one that ended longer ago than any decode lasts cannot be decoding at t
        count, tok, tsum = self._prefilling.window(t - times.longest_s, t)
        if count:
            s = times.mean_survival(h)
            n += s * count
            tokens += s * (tok + g * (count * t - tsum))
        return n, tokens


class ForecastError:
    """How far the arrival-time forecasts of the decode pool's KV were from what the pool
    then held: the root mean square of (predicted - held) / the pool's KV room, over the
    forecasts that have come due (their mean, then an exponential moving average once
    1/weight are counted). Pure: the caller says what the pool holds when."""

    def __init__(self, weight: float = 0.01):
        self.mean_sq = 0.0
        self.num = 0
        self._weight = weight
        self._due: list[tuple[float, int, float]] = []  # heap of (t, seq, predicted KV)
        self._seq = itertools.count()

    @property
    def rms(self) -> float:
        return math.sqrt(self.mean_sq)

    def expect(self, t: float, tokens: float) -> None:
        """A forecast: the pool will hold `tokens` of KV at time t."""
        heapq.heappush(self._due, (t, next(self._seq), tokens))

    def settle(self, now: float, held_tokens: float, capacity_tokens: float) -> None:
        """The pool holds `held_tokens` at `now`: score every forecast due by now."""
        due = self._due
        while due and due[0][0] <= now:
            err = (heapq.heappop(due)[2] - held_tokens) / capacity_tokens
            self.num += 1
            w = max(1.0 / self.num, self._weight)
            self.mean_sq += w * (err * err - self.mean_sq)
