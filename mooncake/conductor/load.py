"""The Conductor's view of instance load, kept from its own decisions and progress reports.

- `PrefillQueue`: T_queue(p) = the predicted prefill times of the requests queued on p,
  minus what the running one has already done (§6.1). On a pipeline group of S stages a
  request occupies the first stage for only its prefill time / S (the next one starts
  then: `mooncake.conductor.pipelining`), so the queue drains that fast. Each queue learns
  its group's real speed: a moving average of observed / predicted prefill latency
  (`speed`) scales its predictions, so a cost model that is optimistic for this group (a
  busy or shared host, another GPU) stops over-admitting after a few requests.
- `DecodeSlots`: a decode instance's batch (running) and reservations (requests still in
  prefill that will join it; `incoming` = those whose prefill has started, with its
  predicted end), as request counts and prompt KV tokens, plus the KV its batch has
  generated since (from the instance's load reports: KV grows one token per request per
  step, and the instance refuses a request whose KV would not fit).

The decode pool's load at a future time (§7.4) is in `mooncake.conductor.forecast`.

Pure logic: time is passed in; nothing here reads a clock.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING

from mooncake.conductor.pipelining import num_chunks, pipeline_times

if TYPE_CHECKING:
    from mooncake.conductor.candidates import LoadOrder
    from mooncake.conductor.decodeorder import DecodeOrder

SPEED_MIN, SPEED_MAX = 0.25, 8.0  # bounds of one latency sample, observed / predicted


class PrefillQueue:
    """Predicted work queued on one prefill instance (a group of `stages` stages)."""

    __slots__ = (
        "name",
        "bit",
        "stages",
        "chunk_tokens",
        "pending_s",
        "req_s",
        "req_chunks",
        "running",
        "run_started",
        "run_s",
        "speed",
        "speed_ewma",
        "req_raw",
        "started",
        "order",
    )

    def __init__(
        self,
        name: str,
        bit: int,
        stages: int = 1,
        chunk_tokens: int = 0,
        speed_ewma: float = 0.0,
        order: LoadOrder | None = None,
    ):
        self.name = name
        self.bit = bit  # the instance's bit in the prefix index
        self.stages = stages  # pipeline stages of the group
        self.chunk_tokens = chunk_tokens  # tokens per prefill chunk (0: one chunk)
        # predicted first-stage seconds of every request not yet past the first stage
        self.pending_s = 0.0
        self.req_s: dict[Hashable, float] = {}  # req_id -> predicted first-stage seconds
        self.req_chunks: dict[Hashable, int] = {}  # req_id -> chunks it computes
        self.running: Hashable | None = None  # on the first stage
        self.run_started = 0.0  # s
        self.run_s = 0.0  # predicted first-stage seconds of the running request
        self.speed = 1.0  # observed / predicted latency, learned (1: as the cost model says)
        self.speed_ewma = speed_ewma  # weight of one finished prefill in `speed`; 0 = fixed
        # req_id -> the cost model's prefill seconds and the request's chunks
        self.req_raw: dict[Hashable, tuple[float, int]] = {}
        self.started: dict[Hashable, float] = {}  # req_id -> when its prefill started, s
        self.order = order  # the Conductor's queues by their T_queue bounds, told of every change

    @property
    def floor_s(self) -> float:
        """T_queue's least value at any `now` until the queue's next event, seconds: the
        queued first-stage seconds less all of the running request's."""
        q = self.pending_s - self.run_s if self.running is not None else self.pending_s
        return q if q > 0.0 else 0.0

    def _moved(self) -> None:
        if self.order is not None:
            self.order.moved(self)

    def queue_time(self, now: float) -> float:
        """T_queue at `now`, seconds."""
        q = self.pending_s
        if self.running is not None:
            done = now - self.run_started
            q -= done if done < self.run_s else self.run_s
        return q if q > 0.0 else 0.0

    def times(self, prefill_s: float, chunks: int) -> tuple[float, float]:
        """(first-stage seconds, latency seconds) of a prefill of `prefill_s` on the whole
        model in `chunks` chunks, on this group."""
        return pipeline_times(prefill_s * self.speed, chunks, self.stages)

    def add(self, req_id: Hashable, prefill_s: float, new_tokens: int = 0) -> None:
        """Queue a prefill taking `prefill_s` on the whole model over `new_tokens`."""
        chunks = num_chunks(new_tokens, self.chunk_tokens)
        stage_s, _ = self.times(prefill_s, chunks)
        self.req_s[req_id] = stage_s
        self.req_chunks[req_id] = chunks
        self.req_raw[req_id] = (prefill_s, chunks)
        self.pending_s += stage_s
        self._moved()

    def latency(self, req_id: Hashable) -> float:
        """Predicted seconds from the request's start to its last layer computed."""
        chunks = self.req_chunks.get(req_id, 1)
        stage_s = self.req_s.get(req_id, 0.0)
        if self.stages <= 1:
            return stage_s
        return stage_s * (chunks + self.stages - 1) / chunks

    def start(self, req_id: Hashable, now: float, prefill_s: float | None = None) -> None:
        """The request's prefill starts; `prefill_s` (whole model) corrects its prediction.
        The request that held the first stage has left it."""
        if req_id in self.req_s:
            if self.running is not None and self.running != req_id:
                self._pass(self.running)
            if prefill_s is not None:
                stage_s, _ = self.times(prefill_s, self.req_chunks[req_id])
                self.pending_s += stage_s - self.req_s[req_id]
                self.req_s[req_id] = stage_s
                self.req_raw[req_id] = (prefill_s, self.req_chunks[req_id])
            self.running, self.run_started, self.run_s = req_id, now, self.req_s[req_id]
            self.started[req_id] = now
            self._moved()

    def _pass(self, req_id: Hashable) -> None:
        """`req_id` is past the first stage: no longer queue for the next ones."""
        self.pending_s -= self.req_s.pop(req_id, 0.0)
        self.req_chunks.pop(req_id, None)
        if not self.req_s:
            self.pending_s = 0.0  # NOTE: stops float drift from accumulating

    def finish(self, req_id: Hashable, now: float | None = None) -> None:
        """The request's prefill ended (`now`: it finished, and its latency teaches the
        queue its speed; None: it was dropped)."""
        raw, started = self.req_raw.pop(req_id, None), self.started.pop(req_id, None)
        if now is not None and raw and raw[0] > 0 and started is not None and self.speed_ewma > 0:
            predicted = pipeline_times(raw[0], raw[1], self.stages)[1]
            sample = min(max((now - started) / predicted, SPEED_MIN), SPEED_MAX)
            self.speed += self.speed_ewma * (sample - self.speed)
        self._pass(req_id)
        if self.running == req_id:
            self.running = None
        self._moved()


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
        "order",
    )

    def __init__(self, name: str, capacity_tokens: int, order: DecodeOrder | None = None):
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
        self.order = order  # the Conductor's decode instances by load, told of every change

    def reserve(self, req_id: Hashable, tokens: int) -> None:
        assert req_id not in self.reserved and req_id not in self.active, req_id
        self.reserved[req_id] = tokens
        self.reserved_tokens += tokens
        self.num += 1
        self.tokens += tokens
        if self.order is not None:
            self.order.moved(self)

    def activate(self, req_id: Hashable, now: float) -> None:
        tokens = self.reserved.pop(req_id, None)
        self.incoming.pop(req_id, None)
        if tokens is not None:
            self.reserved_tokens -= tokens
            self.active[req_id] = tokens
            self.since[req_id] = now
            self.active_tokens += tokens
            if self.order is not None:
                self.order.moved(self)

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
                if self.order is not None:
                    self.order.moved(self)

    def report(self, kv_tokens: int, batch_size: int, step_s: float, now: float) -> None:
        """The instance's own load report: its batch of `batch_size` holds `kv_tokens` of
        KV at `now` and takes `step_s` seconds a step (one more token per request)."""
        self.generated = max(0, kv_tokens - self.active_tokens)
        self.gen_per_s = batch_size / step_s if batch_size and step_s > 0 else 0.0
        self.report_t = now
        if self.order is not None:
            self.order.moved(self)

    def held_tokens(self, now: float) -> float:
        """KV tokens the running batch holds at `now`: prompts + generated tokens."""
        dt = now - self.report_t
        return self.active_tokens + self.generated + (self.gen_per_s * dt if dt > 0 else 0.0)
