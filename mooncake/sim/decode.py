"""A simulated decode instance: continuous batching without an event per token.

The batch runs in segments: between two changes of its membership every step takes the
same time tau = T_step(batch, context at the segment's start), so a segment is one entry
(tau, steps, start time) in the instance's step log. A change (a request joins or one
finishes) closes the open segment at the first step boundary at or after the change, and
only the next finish is scheduled as an event. A step counter makes token accounting
O(1): a request that joined at step s and must emit `output_len - 1` decode tokens finishes
at step s + output_len - 1, and the batch's context is `ctx_base + n * step`.

At the end a request's token gaps are read back from the log: its first gap (first token
from prefill -> first decode step), then every step of every segment it lived through.
After every change the instance reports its batch to the Conductor (KV held, batch size,
step time), as a real decode instance reports its load, so the Conductor sees the KV the
batch has generated, not only the prompts it placed.

With `reserve_at_start` (the cluster's path) a prefill reserves the prompt's KV room here
before it starts (`try_reserve`: the batch's KV now, the other reservations and a block of
growth per running request must leave room), waiting (`waiters`) until a finish frees
some; the request then always joins when its KV lands, and its first token is the end of
the first step it takes part in. Otherwise (the paper's §7 path) the instance checks the
request when its KV lands (`decode_can_admit`) and may reject it then.
"""

from __future__ import annotations

import heapq
import math

from mooncake.conductor.admission import decode_can_admit
from mooncake.sim.context import SimContext, Waiter
from mooncake.sim.metrics import SimRequest, slowest_share_mean


class DecodeInstance:
    """Decode batch of one instance, advanced lazily segment by segment."""

    def __init__(self, name: str, sim: SimContext, capacity_tokens: int):
        self.name = name
        self.sim = sim
        self.cost = sim.cost
        self.scale = sim.cfg.decode_scale  # the real step's cost over the profiled one
        self.capacity_tokens = capacity_tokens  # KV tokens VRAM holds
        self.step = 0  # steps completed when the open segment starts
        self.seg_t0 = 0.0  # start of the open segment, s
        self.tau = 0.0  # step time of the open segment, s
        self.n = 0  # requests in the batch
        self.ctx_base = 0  # batch context (tokens) = ctx_base + n * step
        self.targets: list[tuple[int, int, SimRequest]] = []  # (finish step, rid, req) heap
        self.log_tau: list[float] = []  # closed segments: step time, s
        self.log_k: list[int] = []  # closed segments: number of steps
        self.log_t0: list[float] = []  # closed segments: start time, s
        self.version = 0  # NOTE: bumped on every reschedule; older tick events are stale
        self.busy_s = 0.0  # simulated seconds with a non-empty batch
        self.work_s = 0.0  # of those, the steps' compute as on a host of its own
        self.slow = 1.0  # the shared host's slowdown of the open segment's steps
        self.step_work = 0.0  # the open segment's step compute as on a host of its own
        self.pace = sim.cfg.decode_step_interval_s  # least seconds from step to step
        self.duty = 1.0  # the share of a step's time spent computing (< 1 when paced)
        self.reserve = sim.cfg.reserve_at_start
        self.reserved_tokens = 0  # KV room reserved by prefills streaming here
        self.slack_tokens = sim.block_tokens  # room kept per running request to grow
        self.waiters: set[Waiter] = set()  # groups waiting for room

    @property
    def context_tokens(self) -> int:
        return self.ctx_base + self.n * self.step

    # -- segment machinery ---------------------------------------------------------------
    def advance(self, t: float) -> None:
        """Bring the batch to the first step boundary at or after `t`."""
        if self.n == 0:
            if t > self.seg_t0:
                self.seg_t0 = t
            return
        if t <= self.seg_t0:
            return
        k = math.ceil((t - self.seg_t0) / self.tau - 1e-9)
        self.close(min(k, self.targets[0][0] - self.step))
        self.finish_due()

    def close(self, k: int) -> None:
        """End the open segment after `k` steps."""
        if k <= 0:
            return
        self.log_tau.append(self.tau)
        self.log_k.append(k)
        self.log_t0.append(self.seg_t0)
        self.step += k
        self.seg_t0 += k * self.tau
        self.busy_s += k * self.tau
        self.work_s += k * self.step_work

    def finish_due(self) -> None:
        """Retire the requests whose last token was produced by the closed steps."""
        targets, now, n_before = self.targets, self.seg_t0, self.n
        while targets and targets[0][0] <= self.step:
            req = heapq.heappop(targets)[2]
            self.n -= 1
            self.ctx_base -= req.ctx_key
            req.tbt = self._tbt(req)
            self.sim.decode_finished(req, now)
            if not self.n:
                self.sim.host_changed(now)
        if self.waiters and self.n < n_before:  # room freed: waiting groups try again
            for group in self.waiters:
                group.wake(now)
            self.waiters.clear()

    def _tbt(self, req: SimRequest) -> float:
        j = req.join_seg
        since = req.prefill_end if req.first_token < 0 else self.log_t0[j]  # the first token
        gaps = [(self.log_t0[j] + self.log_tau[j] - since, 1)]
        gaps.append((self.log_tau[j], self.log_k[j] - 1))
        gaps.extend(zip(self.log_tau[j + 1 :], self.log_k[j + 1 :], strict=True))
        assert sum(k for _, k in gaps) == req.output_len - 1, (req.rid, gaps)
        if self.sim.gap_runs is not None:
            self.sim.gap_runs.extend(gaps)
        return slowest_share_mean(gaps, self.sim.tbt_share)

    def reschedule(self) -> None:
        """Price the open segment, schedule the next finish and report the batch's load
        to the Conductor (the batch changed)."""
        self.version += 1
        if self.n == 0:
            self.report()
            return
        self.step_work = self.cost.decode_step_time(self.n, self.context_tokens) * self.scale
        self.slow = self.sim.compute_factor("decode")
        compute = max(self.step_work * self.slow, 1e-6)
        self.tau = max(compute, self.pace)  # paced: a step starts once per interval at most
        self.duty = compute / self.tau
        end = self.seg_t0 + (self.targets[0][0] - self.step) * self.tau
        self.sim.push(end, self._tick, self.version)
        self.report()

    def report(self) -> None:
        """Tell the Conductor the KV the batch holds and how fast it grows."""
        self.sim.conductor.on_decode_report(
            self.name, self.context_tokens, self.n, self.tau, self.seg_t0
        )

    def _tick(self, t: float, version: int) -> None:
        if version != self.version:
            return
        self.close(self.targets[0][0] - self.step)
        self.finish_due()
        self.reschedule()

    def join(self, req: SimRequest) -> None:
        """Add `req` to the batch from the open segment on."""
        ctx = req.input_len + 1  # the prompt and the token prefill produced
        req.join_seg = len(self.log_tau)
        req.ctx_key = ctx - self.step
        self.ctx_base += req.ctx_key
        self.n += 1
        if self.n == 1:
            self.sim.host_changed(self.seg_t0)
        heapq.heappush(self.targets, (self.step + req.output_len - 1, req.rid, req))

    # -- arrivals ----------------------------------------------------------------------
    def try_reserve(self, t: float, req: SimRequest) -> bool:
        """Reserve room for the request's KV at `t`, if there is any."""
        held = self.context_tokens
        if self.n and t > self.seg_t0:  # the open segment's steps so far grew the batch
            held += self.n * int((t - self.seg_t0) / self.tau)
        need = req.input_len + 1
        if held + self.reserved_tokens + self.n * self.slack_tokens + need > self.capacity_tokens:
            return False
        self.reserved_tokens += need
        req.reserved = True
        return True

    def offer(self, t: float, req: SimRequest) -> None:
        """The request's KV has arrived: admit it into the batch or reject it."""
        self.advance(t)
        if self.reserve:  # its room was reserved when its prefill started
            self.reserved_tokens -= req.input_len + 1
            self.join(req)
            self.sim.conductor.on_decode_started(req.rid, t)
            self.reschedule()
            req.first_token = self.seg_t0 + self.tau * self.duty  # its step's compute
            return
        ok = decode_can_admit(
            self.cost,
            self.sim.tbt_slo_s,
            self.n,
            self.context_tokens,
            req.input_len + 1,
            self.capacity_tokens,
        )
        if not ok:
            self.sim.rejected_late(req, t)
            return
        self.join(req)
        self.sim.conductor.on_decode_started(req.rid, t)
        self.reschedule()
