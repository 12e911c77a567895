"""The Conductor's books: each accepted request's ticket, moved along by progress reports.

A ticket is (prefill queue, decode slots, prompt KV tokens). The Conductor's decisions
open it (`_book`); the reports of the instances move it through queue -> reservation ->
batch and close it (decode finished, or the request dropped), keeping the prefill queues,
the decode reservations and batches, and the §7.4 forecast in step. Pure logic: `now` is
passed in.
"""

from __future__ import annotations

from collections.abc import Hashable

from mooncake.conductor.forecast import DecodeForecast
from mooncake.conductor.load import DecodeSlots, PrefillQueue


class Books:
    """Load bookkeeping shared by the Conductor's decisions and its progress reports."""

    def __init__(self, forecast: DecodeForecast):
        self.forecast = forecast
        self.prefill: list[PrefillQueue] = []
        self.decode: list[DecodeSlots] = []
        self._tickets: dict[Hashable, tuple[PrefillQueue, DecodeSlots, int]] = {}
        self._decode_by_name: dict[str, DecodeSlots] = {}

    def _book(
        self,
        req_id: Hashable,
        queue: PrefillQueue,
        prefill_s: float,
        slots: DecodeSlots,
        tokens: int,
        ready_at: float,
        new_tokens: int = 0,
    ) -> None:
        """An accepted request: a prefill of `prefill_s` (whole model, `new_tokens`
        computed) queued on `queue`, `tokens` of KV reserved on `slots`, its prefill
        predicted to end at `ready_at`."""
        queue.add(req_id, prefill_s, new_tokens)
        slots.reserve(req_id, tokens)
        self.forecast.add_prefilling(req_id, ready_at, tokens)
        self._tickets[req_id] = (queue, slots, tokens)

    def _rebind(self, req_id: Hashable, slots: DecodeSlots) -> None:
        """The request's KV goes to `slots` instead (its reservation moves there)."""
        queue, old, tokens = self._tickets[req_id]
        if old is not slots:
            old.release(req_id)
            slots.reserve(req_id, tokens)
            self._tickets[req_id] = (queue, slots, tokens)

    def _start_prefill(self, req_id: Hashable, now: float, prefill_s: float | None) -> None:
        queue, slots, _ = self._tickets[req_id]
        queue.start(req_id, now, prefill_s)
        ready = now + queue.latency(req_id)
        if req_id in slots.reserved:
            slots.incoming[req_id] = ready
        self.forecast.prefill_ends_at(req_id, ready)

    @property
    def num_tickets(self) -> int:
        """Accepted requests whose ticket is still open (not finished, not dropped)."""
        return len(self._tickets)

    # -- progress reports --------------------------------------------------------------
    def on_prefill_started(self, req_id: Hashable, now: float) -> None:
        """The request's prefill started (its predicted end refreshes the forecast)."""
        if req_id in self._tickets:
            self._start_prefill(req_id, now, None)

    def on_prefill_finished(self, req_id: Hashable, now: float) -> None:
        ticket = self._tickets.get(req_id)
        if ticket:
            ticket[0].finish(req_id, now)
            if req_id in ticket[1].incoming:
                ticket[1].incoming[req_id] = now
            self.forecast.prefill_ends_at(req_id, now)

    def on_decode_started(self, req_id: Hashable, now: float) -> None:
        ticket = self._tickets.get(req_id)
        if ticket:
            ticket[1].activate(req_id, now)
            self.forecast.start_decode(req_id, now)

    def on_decode_finished(self, req_id: Hashable, now: float) -> None:
        ticket = self._tickets.pop(req_id, None)
        if ticket:
            ticket[1].release(req_id)
            self.forecast.finish_decode(req_id, now)

    def on_decode_report(
        self, name: str, kv_tokens: int, batch_size: int, step_s: float, now: float
    ) -> None:
        """Decode (or coupled) instance `name` reports its batch: `batch_size` requests
        holding `kv_tokens` of KV at `now`, one step every `step_s` seconds."""
        slots = self._decode_by_name.get(name)
        if slots is None:
            return
        slots.report(kv_tokens, batch_size, step_s, now)
        running = sum(len(s.active) for s in self.decode)
        if running:  # NOTE: tokens/s per decoding request, batch-weighted over the pool
            self.forecast.gen_per_s = sum(s.gen_per_s for s in self.decode) / running

    def on_request_dropped(self, req_id: Hashable, now: float) -> None:
        """The request ended early (rejected by its decode instance, failed, cancelled)."""
        ticket = self._tickets.pop(req_id, None)
        if ticket:
            ticket[0].finish(req_id)
            ticket[1].release(req_id)
            self.forecast.drop(req_id)

    @property
    def num_inflight(self) -> int:
        return len(self._tickets)

    def check_books(self) -> None:
        """Assert every load entry belongs to a live ticket and the totals add up."""
        for q in self.prefill:
            assert set(q.req_s) <= set(self._tickets), (q.name, set(q.req_s) - set(self._tickets))
            assert abs(q.pending_s - sum(q.req_s.values())) < 1e-6, (q.name, q.pending_s)
        for s in self.decode:
            assert s.active_tokens == sum(s.active.values()), s.name
            assert list(s.since) == list(s.active), s.name
            assert s.reserved_tokens == sum(s.reserved.values()), s.name
            assert s.num == len(s.active) + len(s.reserved), (s.name, s.num)
            assert s.tokens == s.active_tokens + s.reserved_tokens, (s.name, s.tokens)
            assert not (set(s.active) | set(s.reserved)) - set(self._tickets), s.name
            assert set(s.incoming) <= set(s.reserved), (s.name, set(s.incoming) - set(s.reserved))
