"""The Conductor's view of instance load, kept from its own decisions and progress reports.

- `PrefillQueue`: T_queue(p) = the predicted prefill times of the requests queued on p,
  minus what the running one has already done (§6.1).
- `DecodeSlots`: a decode instance's batch (running) and reservations (requests still in
  prefill that will join it; `incoming` = those whose prefill has started, with its
  predicted end), as request counts and prompt KV tokens, plus the KV its batch has
  generated since (from the instance's load reports: KV grows one token per request per
  step, and the instance refuses a request whose KV would not fit).
- `DecodeTimes`: how long requests decode, measured: the survival of decode durations and
  the share of the KV decoding now that still decodes h seconds later.
- `DecodeForecast`: the decode pool's load at a future time t for §7.4's prediction-based
  early rejection: the running requests that will still decode at t, plus the requests in
  prefill whose prefill ends by t and that will still decode at t.

Pure logic: time is passed in; nothing here reads a clock.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import deque
from collections.abc import Hashable
from itertools import accumulate

import numpy as np

GRID = 64  # points of the DecodeTimes tables


class PrefillQueue:
    """Predicted work queued on one prefill instance."""

    __slots__ = ("name", "bit", "pending_s", "req_s", "running", "run_started", "run_s")

    def __init__(self, name: str, bit: int):
        self.name = name
        self.bit = bit  # the instance's bit in the prefix index
        self.pending_s = 0.0  # predicted seconds of every unfinished request, incl. running
        self.req_s: dict[Hashable, float] = {}  # req_id -> predicted prefill seconds
        self.running: Hashable | None = None
        self.run_started = 0.0  # s
        self.run_s = 0.0  # predicted seconds of the running request

    def queue_time(self, now: float) -> float:
        """T_queue at `now`, seconds."""
        q = self.pending_s
        if self.running is not None:
            done = now - self.run_started
            q -= done if done < self.run_s else self.run_s
        return q if q > 0.0 else 0.0

    def add(self, req_id: Hashable, predicted_s: float) -> None:
        self.req_s[req_id] = predicted_s
        self.pending_s += predicted_s

    def start(self, req_id: Hashable, now: float, predicted_s: float | None = None) -> None:
        """The request's prefill starts; `predicted_s` corrects its predicted duration."""
        if req_id in self.req_s:
            if predicted_s is not None:
                self.pending_s += predicted_s - self.req_s[req_id]
                self.req_s[req_id] = predicted_s
            self.running, self.run_started, self.run_s = req_id, now, self.req_s[req_id]

    def finish(self, req_id: Hashable) -> None:
        self.pending_s -= self.req_s.pop(req_id, 0.0)
        if not self.req_s:
            self.pending_s = 0.0  # NOTE: stops float drift from accumulating
        if self.running == req_id:
            self.running = None


class DecodeSlots:
    """One decode instance's running batch and reservations (counts and KV tokens)."""

    __slots__ = (
        "name",
        "capacity_tokens",
        "active",
        "active_tokens",
        "reserved",
        "reserved_tokens",
        "incoming",
        "since",
        "num",
        "tokens",
        "generated",
        "gen_per_s",
        "report_t",
    )

    def __init__(self, name: str, capacity_tokens: int):
        self.name = name
        self.capacity_tokens = capacity_tokens  # KV tokens the instance's VRAM holds
        self.active: dict[Hashable, int] = {}  # req_id -> prompt KV tokens, decoding now
        self.active_tokens = 0
        self.reserved: dict[Hashable, int] = {}  # req_id -> prompt KV tokens, still in prefill
        self.reserved_tokens = 0
        self.incoming: dict[Hashable, float] = {}  # reserved ones in prefill -> predicted end, s
        self.since: dict[Hashable, float] = {}  # req_id -> decode start, s (same order as active)
        self.num = 0  # requests, running + reserved
        self.tokens = 0  # prompt KV tokens, running + reserved
        self.generated = 0  # KV tokens the batch generated, as of its last report
        self.gen_per_s = 0.0  # tokens/s the batch adds: batch size / step time, last report
        self.report_t = 0.0  # s, time of the last report

    def reserve(self, req_id: Hashable, tokens: int) -> None:
        assert req_id not in self.reserved and req_id not in self.active, req_id
        self.reserved[req_id] = tokens
        self.reserved_tokens += tokens
        self.num += 1
        self.tokens += tokens

    def activate(self, req_id: Hashable, now: float) -> None:
        tokens = self.reserved.pop(req_id, None)
        self.incoming.pop(req_id, None)
        if tokens is not None:
            self.reserved_tokens -= tokens
            self.active[req_id] = tokens
            self.since[req_id] = now
            self.active_tokens += tokens

    def release(self, req_id: Hashable) -> None:
        self.incoming.pop(req_id, None)
        self.since.pop(req_id, None)
        for table in (self.reserved, self.active):
            tokens = table.pop(req_id, None)
            if tokens is not None:
                if table is self.reserved:
                    self.reserved_tokens -= tokens
                else:
                    self.active_tokens -= tokens
                self.num -= 1
                self.tokens -= tokens

    def report(self, kv_tokens: int, batch_size: int, step_s: float, now: float) -> None:
        """The instance's own load report: its batch of `batch_size` holds `kv_tokens` of
        KV at `now` and takes `step_s` seconds a step (one more token per request)."""
        self.generated = max(0, kv_tokens - self.active_tokens)
        self.gen_per_s = batch_size / step_s if batch_size and step_s > 0 else 0.0
        self.report_t = now

    def held_tokens(self, now: float) -> float:
        """KV tokens the running batch holds at `now`: prompts + generated tokens."""
        dt = now - self.report_t
        return self.active_tokens + self.generated + (self.gen_per_s * dt if dt > 0 else 0.0)


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
