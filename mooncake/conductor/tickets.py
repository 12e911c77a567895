"""The Conductor's open tickets: one per accepted request, moved along by progress reports.

A ticket is the load one accepted request puts on the cluster: (the prefill queue it
waits in, the decode slots holding its KV reservation, its prompt's KV tokens). The
Conductor's decision opens it (`open`); the instances' progress reports move it through
queue -> reservation -> batch and close it (decode finished, or the request dropped),
keeping the prefill queues, the decode reservations and batches, and the §7.4 forecast
in step. Pure logic: `now` is passed in.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

from mooncake.conductor.forecast import DecodeForecast
from mooncake.conductor.load import DecodeSlots, PrefillQueue

Ticket = tuple[PrefillQueue, DecodeSlots, int]  # (prefill queue, decode slots, KV tokens)


class OpenTickets:
    """The accepted requests not yet finished or dropped, and the load each one holds."""

    def __init__(self, forecast: DecodeForecast):
        self.forecast = forecast
        self._tickets: dict[Hashable, Ticket] = {}

    def __len__(self) -> int:
        return len(self._tickets)

    def get(self, req_id: Hashable) -> Ticket | None:
        return self._tickets.get(req_id)

    def open(
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

    def rebind(self, req_id: Hashable, slots: DecodeSlots) -> None:
        """The request's KV goes to `slots` instead (its reservation moves there)."""
        queue, old, tokens = self._tickets[req_id]
        if old is not slots:
            old.release(req_id)
            slots.reserve(req_id, tokens)
            self._tickets[req_id] = (queue, slots, tokens)

    def start_prefill(self, req_id: Hashable, now: float, prefill_s: float | None) -> None:
        """The request's prefill starts at `now`, taking `prefill_s` (None: as predicted)."""
        queue, slots, _ = self._tickets[req_id]
        queue.start(req_id, now, prefill_s)
        ready = now + queue.latency(req_id)
        if req_id in slots.reserved:
            slots.incoming[req_id] = ready
        self.forecast.prefill_ends_at(req_id, ready)

    # -- progress reports --------------------------------------------------------------
    def prefill_started(self, req_id: Hashable, now: float) -> None:
        if req_id in self._tickets:
            self.start_prefill(req_id, now, None)

    def prefill_finished(self, req_id: Hashable, now: float) -> None:
        ticket = self._tickets.get(req_id)
        if ticket:
            ticket[0].finish(req_id, now)
            if req_id in ticket[1].incoming:
                ticket[1].incoming[req_id] = now
            self.forecast.prefill_ends_at(req_id, now)

    def decode_started(self, req_id: Hashable, now: float) -> None:
        ticket = self._tickets.get(req_id)
        if ticket:
            ticket[1].activate(req_id, now)
            self.forecast.start_decode(req_id, now)

    def decode_finished(self, req_id: Hashable, now: float) -> None:
        ticket = self._tickets.pop(req_id, None)
        if ticket:
            ticket[1].release(req_id)
            self.forecast.finish_decode(req_id, now)

    def drop(self, req_id: Hashable) -> None:
        """The request ended early: its queue entry, reservation and forecast go."""
        ticket = self._tickets.pop(req_id, None)
        if ticket:
            ticket[0].finish(req_id)
            ticket[1].release(req_id)
            self.forecast.drop(req_id)

    def check(self, prefill: Iterable[PrefillQueue], decode: Iterable[DecodeSlots]) -> None:
        """Assert every load entry of `prefill` and `decode` belongs to an open ticket and
        the totals add up."""
        for q in prefill:
            assert set(q.req_s) <= set(self._tickets), (q.name, set(q.req_s) - set(self._tickets))
            assert abs(q.pending_s - sum(q.req_s.values())) < 1e-6, (q.name, q.pending_s)
        for s in decode:
            assert s.active_tokens == sum(s.active.values()), s.name
            assert list(s.since) == list(s.active), s.name
            assert s.reserved_tokens == sum(s.reserved.values()), s.name
            assert s.num == len(s.active) + len(s.reserved), (s.name, s.num)
            assert s.tokens == s.active_tokens + s.reserved_tokens, (s.name, s.tokens)
            assert not (set(s.active) | set(s.reserved)) - set(self._tickets), s.name
            assert set(s.incoming) <= set(s.reserved), (s.name, set(s.incoming) - set(s.reserved))
