"""A simulated coupled instance, modelled on vLLM: prefill and decode share the GPUs.

Each iteration runs one decode step for every running request plus prefill chunks of
waiting requests, up to `chunk_tokens` tokens in total (decode first: chunked prefill);
its time is T_step(batch, context) plus each chunk's prefill cost, so a prefill stretches
the token gaps of every request decoding beside it. A request enters prefill when its KV
fits next to the running batch, and reuses only the prefix blocks cached on this instance
(vLLM's automatic prefix caching, in VRAM, LRU). With no prefill work the instance
decodes in lazy segments exactly like a decode instance.
"""

from __future__ import annotations

from collections import deque

from mooncake.sim.context import SimContext
from mooncake.sim.decode import DecodeInstance
from mooncake.sim.metrics import SimRequest
from mooncake.sim.pool import NodePool


class CoupledInstance(DecodeInstance):
    """Continuous batching with chunked prefill and an instance-local prefix cache."""

    def __init__(
        self, name: str, sim: SimContext, capacity_tokens: int, chunk_tokens: int, pool: NodePool
    ):
        super().__init__(name, sim, capacity_tokens)
        self.pool = pool
        self.chunk_tokens = chunk_tokens  # tokens per iteration (decode + prefill)
        self.waiting: deque[SimRequest] = deque()
        self.prefilling: list[list] = []  # [req, tokens done], in admission order
        self.prefill_reserved = 0  # KV tokens held by requests in prefill
        self.iterating = False
        self.plan: list[tuple[list, int]] = []  # (entry of prefilling, chunk end)

    def enqueue(self, t: float, req: SimRequest) -> None:
        self.waiting.append(req)
        if not self.iterating:
            self.advance(t)
            self._start_iteration()

    def _admit_waiting(self) -> None:
        sim = self.sim
        while self.waiting:
            req = self.waiting[0]
            tokens = self.context_tokens + self.prefill_reserved + req.input_len + 1
            if tokens > self.capacity_tokens and (self.n or self.prefilling):
                return  # no room until something finishes
            self.waiting.popleft()
            reused = self.pool.prefix_len(req.hashes)
            d = req.decision
            req.misses = sim.ledger.attribute(req.hashes, reused, d.best_blocks, d.reused_blocks)
            self.pool.store(req.hashes[:reused], self.seg_t0)
            req.reused_blocks = reused
            req.prefill_start = self.seg_t0
            done = min(reused * sim.block_tokens, req.input_len - 1)
            req.prefill_s = sim.cost.prefill_time(req.input_len, done)
            self.prefilling.append([req, done])
            self.prefill_reserved += req.input_len + 1
            sim.conductor.on_prefill_started(req.rid, self.seg_t0)

    def _start_iteration(self) -> None:
        """Plan the iteration starting at the open segment's start, or go lazy."""
        self._admit_waiting()
        budget = max(self.chunk_tokens - self.n, 1)
        plan = []
        for entry in self.prefilling:
            if budget <= 0:
                break
            take = min(budget, entry[0].input_len - entry[1])
            plan.append((entry, entry[1] + take))
            budget -= take
        if not plan:
            self.iterating = False
            self.reschedule()
            return
        self.iterating, self.plan = True, plan
        chunks = [(end, entry[1]) for entry, end in plan]
        self.tau = max(self.cost.mixed_step_time(self.n, self.context_tokens, chunks), 1e-6)
        self.version += 1
        self.sim.push(self.seg_t0 + self.tau, self._iteration_end, self.version)

    def _iteration_end(self, t: float, version: int) -> None:
        if version != self.version:
            return
        if self.n:
            self.close(1)
            self.finish_due()
        else:
            self.seg_t0 += self.tau
        self.seg_t0 = t
        for entry, end in self.plan:
            entry[1] = end
            req = entry[0]
            if end < req.input_len:
                continue
            self.prefilling.remove(entry)
            self.prefill_reserved -= req.input_len + 1
            self.pool.store(req.hashes[req.reused_blocks :], t)
            self.sim.prefill_finished(req, t)
            if req.output_len > 1:
                self.join(req)
                self.sim.conductor.on_decode_started(req.rid, t)
        self._start_iteration()
        if self.iterating:
            self.report()
