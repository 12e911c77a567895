"""The Conductor's view of instance load, kept from its own decisions and progress reports.

- `PrefillQueue`: T_queue(p) = the predicted prefill times of the requests queued on p,
  minus what the running one has already done (§6.1).
- `DecodeSlots`: a decode instance's batch (running) and reservations (requests still in
  prefill that will join it), as request counts and prompt KV tokens, plus the KV its
  batch has generated since (from the instance's load reports: KV grows one token per
  request per step, and the instance refuses a request whose KV would not fit).
- `DecodeForecast`: the decode pool's load at a future time t for §7.4's prediction-based
  early rejection: every request decodes for the same time t_d, so the requests decoding
  at t are those whose decode started (or whose prefill is predicted to end) in
  (t - t_d, t].

Pure logic: time is passed in; nothing here reads a clock.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Hashable


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

    def start(self, req_id: Hashable, now: float) -> None:
        if req_id in self.req_s:
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

    def activate(self, req_id: Hashable) -> None:
        tokens = self.reserved.pop(req_id, None)
        if tokens is not None:
            self.reserved_tokens -= tokens
            self.active[req_id] = tokens
            self.active_tokens += tokens

    def release(self, req_id: Hashable) -> None:
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

    def remove(self, req_id: Hashable, t: float) -> bool:
        i = bisect_left(self.times, t)
        ids = self.ids
        while i < len(ids) and ids[i] != req_id:
            i += 1
        if i == len(ids):
            return False
        self.total_time -= self.times.pop(i)
        del self.ids[i]
        self.total_tokens -= self.tokens.pop(i)
        if not ids:
            self.total_time = 0.0  # NOTE: stops float drift from accumulating
        return True

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

    As the paper states it: every request decodes for the same time t_d (the mean of the
    measured decode times; an exponential moving average once 1/ewma are measured), so at
    time t the pool holds the requests decoding now that started after t - t_d, and the
    requests in prefill whose predicted end is in (t - t_d, t]. Each holds its prompt's KV
    plus the tokens it has generated by t, at the pool's current rate (`gen_per_s` tokens
    per second per request, from the instances' load reports).
    NOTE: real decode times vary (output lengths are long-tailed and unknown in advance),
    so the forecast is noisy: a request still decoding after t_d is predicted gone, a
    short one is predicted present. On the conversation trace replayed at 2x onto one
    saturated decode instance its error at a 10-30 s horizon has a standard deviation of
    about 10% of the pool's KV.
    """

    def __init__(self, decode_time_s: float, ewma: float):
        self.decode_time_s = decode_time_s  # t_d: uniform decode time per request, seconds
        self.capacity_tokens = 0  # KV tokens of the whole decode pool
        self.gen_per_s = 0.0  # KV tokens a decoding request adds per second
        self._ewma = ewma
        self._num_measured = 0  # decode durations measured
        self._running = _TimedSet()  # decoding now, by decode start
        self._prefilling = _TimedSet()  # by predicted prefill end
        self._when: dict[Hashable, tuple[bool, float]] = {}  # req_id -> (is running, time)

    def add_prefilling(self, req_id: Hashable, ready_at: float, tokens: int) -> None:
        self._prefilling.add(req_id, ready_at, tokens)
        self._when[req_id] = (False, ready_at)

    def prefill_done(self, req_id: Hashable, now: float) -> None:
        """The prefill ended (maybe early or late): it reaches decode now."""
        where = self._when.get(req_id)
        if where is not None and not where[0] and where[1] != now:
            tokens = self._prefilling.tokens[self._prefilling.ids.index(req_id)]
            self._prefilling.remove(req_id, where[1])
            self.add_prefilling(req_id, now, tokens)

    def start_decode(self, req_id: Hashable, now: float, tokens: int) -> None:
        self.drop(req_id)
        self._running.add(req_id, now, tokens)
        self._when[req_id] = (True, now)

    def finish_decode(self, req_id: Hashable, now: float) -> None:
        where = self._when.get(req_id)
        if where is not None and where[0]:
            # the mean of the durations seen so far, then an exponential moving average
            self._num_measured += 1
            weight = max(1.0 / self._num_measured, self._ewma)
            self.decode_time_s += weight * (now - where[1] - self.decode_time_s)
        self.drop(req_id)

    def drop(self, req_id: Hashable) -> None:
        """Forget the request (it finished, or will not decode)."""
        where = self._when.pop(req_id, None)
        if where is not None:
            (self._running if where[0] else self._prefilling).remove(req_id, where[1])

    def at(self, t: float) -> tuple[int, float]:
        """Predicted (requests, KV tokens) decoding at time t: the running requests that
        started after t - t_d and the prefilling ones predicted ready in (t - t_d, t]."""
        since = t - self.decode_time_s
        n_run, tok_run, t_run = self._running.window(since, float("inf"))
        n_new, tok_new, t_new = self._prefilling.window(since, t)
        n = n_run + n_new
        # a request decoding since s has generated (t - s) * gen_per_s tokens by t
        generated = self.gen_per_s * (n * t - t_run - t_new)
        return n, tok_run + tok_new + generated
