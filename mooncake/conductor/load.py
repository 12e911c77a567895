"""The Conductor's view of instance load, kept from its own decisions and progress reports.

- `PrefillQueue`: T_queue(p) = the predicted prefill times of the requests queued on p,
  minus what the running one has already done (§6.1).
- `DecodeSlots`: a decode instance's batch (running) and reservations (requests still in
  prefill that will join it), as request counts and KV tokens.
- `DecodeForecast`: the decode pool's load at a future time t for §7.4's prediction-based
  early rejection: running requests leave when their uniform decode time t_d has passed,
  requests in prefill join when their predicted prefill end has passed.

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
    )

    def __init__(self, name: str, capacity_tokens: int):
        self.name = name
        self.capacity_tokens = capacity_tokens  # KV tokens the instance's VRAM holds
        self.active: dict[Hashable, int] = {}  # req_id -> KV tokens, decoding now
        self.active_tokens = 0
        self.reserved: dict[Hashable, int] = {}  # req_id -> KV tokens, still in prefill
        self.reserved_tokens = 0
        self.num = 0  # requests, running + reserved
        self.tokens = 0  # KV tokens, running + reserved

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


class _TimedSet:
    """Requests sorted by a time, with their KV tokens: count and tokens up to a time."""

    __slots__ = ("times", "tokens", "ids", "total_tokens")

    def __init__(self) -> None:
        self.times: list[float] = []
        self.tokens: list[int] = []
        self.ids: list[Hashable] = []
        self.total_tokens = 0

    def add(self, req_id: Hashable, t: float, tokens: int) -> None:
        i = bisect_right(self.times, t)  # usually the end: times mostly arrive in order
        self.times.insert(i, t)
        self.tokens.insert(i, tokens)
        self.ids.insert(i, req_id)
        self.total_tokens += tokens

    def remove(self, req_id: Hashable, t: float) -> bool:
        i = bisect_left(self.times, t)
        ids = self.ids
        while i < len(ids) and ids[i] != req_id:
            i += 1
        if i == len(ids):
            return False
        del self.times[i], self.ids[i]
        self.total_tokens -= self.tokens.pop(i)
        return True

    def upto(self, t: float) -> tuple[int, int]:
        """(count, tokens) of entries with time <= t."""
        k = bisect_right(self.times, t)
        return k, sum(self.tokens[:k])


class DecodeForecast:
    """The decode pool's predicted (requests, KV tokens) at a future time (§7.4).

    As the paper states it: every request decodes for the same time t_d (a running mean of
    measured decode times); at time t the requests decoding now whose t_d will have passed
    are gone, and the requests in prefill whose predicted end is before t have joined.
    NOTE: with long-tailed output lengths this under-counts: a request still decoding after
    t_d is predicted gone although it is the kind that stays longest.
    """

    def __init__(self, decode_time_s: float, ewma: float):
        self.decode_time_s = decode_time_s  # t_d: uniform decode time per request, seconds
        self.capacity_tokens = 0  # KV tokens of the whole decode pool
        self._ewma = ewma
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
            self.decode_time_s += self._ewma * (now - where[1] - self.decode_time_s)
        self.drop(req_id)

    def drop(self, req_id: Hashable) -> None:
        """Forget the request (it finished, or will not decode)."""
        where = self._when.pop(req_id, None)
        if where is not None:
            (self._running if where[0] else self._prefilling).remove(req_id, where[1])

    def at(self, t: float) -> tuple[int, int]:
        """Predicted (requests, KV tokens) decoding at time t: the running requests that
        started after t - t_d, plus the prefilling ones predicted to be ready by t."""
        running = self._running
        gone_n, gone_tok = running.upto(t - self.decode_time_s)
        come_n, come_tok = self._prefilling.upto(t)
        n = len(running.times) - gone_n + come_n
        return n, running.total_tokens - gone_tok + come_tok
