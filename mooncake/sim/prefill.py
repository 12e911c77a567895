"""A simulated prefill group: its queue in the Conductor's order, its stages pipelined.

The group takes its queue's head when its first stage is free, fewer than `max_inflight`
of its requests are in flight, and the prefix blocks the head fetches from another node
have arrived. Just before it starts, the Conductor has the last word (`admit_prefill`): it
may choose another decode node for the KV, or reject the request (predictive early
rejection), and the next one is taken instead. Then (`reserve_at_start`, the cluster's
path) the group reserves room for the prompt's KV on that decode node; while the node
has none the whole group waits (head of line), and after `reserve_timeout_s` the request
fails and the next one is taken.

The request reuses the leading blocks its group actually holds then (the Conductor's plan
may have been overtaken by an eviction) and computes the rest: T_prefill(len, reused) on
the whole model, in chunks flowing through the S stages (`mooncake.conductor.pipelining`:
stage k starts a request once stage k-1 has done its first chunk and stage k is free), so
the first stage is free again after T/S and the last layer is done after about
T/S * (C + S - 1)/C. Its KV streams to the decode node from the start (booked on the
network then), and lands one layer's write after the compute ends, or when the link has
carried it all, whichever is later. New blocks go into the pool when the prefill ends
(the group's node first, `sim/pool.py`); fetched blocks get a copy here only if the
Conductor ordered a replica and the pool has room and budget for it. As it starts, each
block it does not reuse gets its cause (`MissLedger.attribute`).

On a shared host (the twin of `up --local`: `SimConfig.host_cores`) the group computes at
its CPU share (`sim/host.py`): whenever a group or a decode node starts or stops
computing, the rest of every running prefill is stretched or shrunk by the new slowdown
over the old (`reprice`), and decode steps are priced again from their next boundary.
"""

from __future__ import annotations

import math
from collections import deque

import msgspec

from mooncake.conductor.pipelining import num_chunks, stream_tail_s
from mooncake.sim.context import SimContext
from mooncake.sim.metrics import SimRequest
from mooncake.sim.pool import NodePool


class PrefillInstance:
    """FIFO queue and pipeline stages of one prefill group."""

    def __init__(self, name: str, sim: SimContext, pool: NodePool, stages: int = 1):
        cfg = sim.cfg
        self.name = name
        self.sim = sim
        self.pool = pool
        self.stages = stages
        self.max_inflight = cfg.max_inflight
        self.chunk_tokens = cfg.chunk_tokens
        self.queue: deque[SimRequest] = deque()
        self.stage_free = [0.0] * stages  # when each stage has done its last chunk, s
        self.inflight = 0  # requests started whose compute has not ended
        self.slow = 1.0  # the shared host's slowdown its in-flight compute runs at
        # in flight: rid -> (request, compute end, KV landed by the link, stream tail), s
        self.ends: dict[int, tuple[SimRequest, float, float, float]] = {}
        self.wake_at = math.inf  # earliest pending wake-up event, s
        self.busy_s = 0.0  # simulated seconds spent computing (whole model)

    @property
    def running(self) -> bool:
        return self.inflight > 0

    def enqueue(self, t: float, req: SimRequest) -> None:
        self.queue.append(req)
        self._start_next(t)

    def wake(self, t: float) -> None:
        """Try the head again at `t` (a stage, the fetch or decode room frees up then)."""
        if t < self.wake_at:
            self.wake_at = t
            self.sim.push(t, self._on_wake, None)

    def _on_wake(self, t: float, _: object) -> None:
        if t >= self.wake_at:
            self.wake_at = math.inf
        self._start_next(t)

    def _start_next(self, t: float) -> None:
        sim = self.sim
        while self.queue and self.inflight < self.max_inflight:
            if self.stage_free[0] > t:
                self.wake(self.stage_free[0])
                return
            head = self.queue[0]
            if head.fetch_ready > t:
                self.wake(head.fetch_ready)
                return
            if head.reserve_deadline < 0 and not self._admit(t, head):
                self.queue.popleft()
                continue
            if sim.cfg.reserve_at_start and not head.reserved:
                decode = sim.decode[head.decision.decode]
                if not decode.try_reserve(t, head):
                    if t >= head.reserve_deadline:  # the cluster fails the request
                        self.queue.popleft()
                        sim.conductor.on_request_dropped(head.rid, t)
                        head.status, head.done_at = "failed", t
                        continue
                    decode.waiters.add(self)  # head of line: the group waits
                    self.wake(head.reserve_deadline)
                    return
                if t > head.prefill_start:  # it waited for room: tell the Conductor
                    sim.conductor.on_prefill_started(head.rid, t)
            self.queue.popleft()
            self._start(t, head)

    def _admit(self, t: float, req: SimRequest) -> bool:
        """The Conductor's look as the prefill is about to start; False: rejected."""
        sim, d = self.sim, req.decision
        local = self.pool.prefix_len(req.hashes)
        reused = local
        if d.fetch_from and local >= d.local_blocks:
            reused = max(local, d.reused_blocks)  # fetched blocks extend the local prefix
        else:
            req.ssd_blocks = 0  # nothing fetched is used
        prefill_s = sim.cost.prefill_time(req.input_len, reused * sim.block_tokens)
        ssd = self.pool.ssd.blocks if self.pool.ssd is not None else {}
        on_ssd = sum(h in ssd for h in req.hashes[:local])  # read before the compute
        prefill_s += sim.cost.ssd_read_time(on_ssd * sim.block_tokens * sim.cost.kv_bytes_per_token)
        grant = sim.conductor.admit_prefill(req.rid, t, prefill_s)
        if not grant.is_accepted:
            sim.rejected_at_start(req, t)
            return False
        if grant.decode != d.decode:
            req.decision = d = msgspec.structs.replace(d, decode=grant.decode)
        req.misses = sim.ledger.attribute(req.hashes, reused, d.best_blocks, d.reused_blocks)
        self.pool.store(req.hashes[:local], t)  # reading refreshes the LRU order
        if d.replications and reused > local:
            self.pool.replicate(req.hashes[local:reused], t)  # the ordered replica, if room
        req.reused_blocks = reused
        req.ssd_blocks += on_ssd
        req.prefill_s = prefill_s * sim.cfg.prefill_scale  # NOTE: the Conductor's is unscaled
        req.prefill_start = t
        req.reserve_deadline = t + sim.cfg.reserve_timeout_s
        return True

    def _start(self, t: float, req: SimRequest) -> None:
        sim, cost = self.sim, self.sim.cost
        new = max(1, req.input_len - req.reused_blocks * sim.block_tokens)
        chunks = num_chunks(new, self.chunk_tokens)
        if not self.inflight:
            self.slow = sim.compute_factor("prefill", self.stages)
        chunk_s = req.prefill_s * self.slow / (self.stages * chunks)  # one chunk on one stage
        free, start = self.stage_free, t
        for k in range(self.stages):  # stage k runs its chunks back to back from `start`
            if free[k] > start:
                start = free[k]
            free[k] = start + chunks * chunk_s
            start += chunk_s
        req.prefill_start = t
        self.inflight += 1
        if self.inflight == 1:
            sim.host_changed(t)
        bw = sim.network.bandwidth(self.name, req.decision.decode)
        kv = cost.kv_bytes_per_token
        landed = sim.network.reserve(self.name, req.decision.decode, req.input_len * kv, t)
        tail = -math.inf  # the stream ends when the link has carried the KV
        if sim.cfg.reserve_at_start:  # the cluster's streamed hand-off ends after the compute
            tail = stream_tail_s(min(new, self.chunk_tokens or new) * kv, sim.num_layers, bw)
        self._finish_at(req, free[-1], landed, tail)

    def _finish_at(self, req: SimRequest, end: float, landed: float, tail: float) -> None:
        self.ends[req.rid] = (req, end, landed, tail)
        req.stream_end = max(landed, end + tail)
        self.sim.push(end, self._done, req)

    def reprice(self, t: float) -> None:
        """The shared host's load changed at `t`: the group's remaining compute runs at
        the new slowdown from now on (every stage alike), its compute ends move."""
        if not self.inflight:
            return
        slow = self.sim.compute_factor("prefill")
        if slow == self.slow:
            return
        r, self.slow = slow / self.slow, slow
        self.stage_free = [f if f <= t else t + (f - t) * r for f in self.stage_free]
        for req, end, landed, tail in list(self.ends.values()):
            self._finish_at(req, t + (end - t) * r, landed, tail)
        if self.queue:
            self.wake(max(t, self.stage_free[0]))

    def _done(self, t: float, req: SimRequest) -> None:
        now = self.ends.get(req.rid)
        if now is None or now[1] != t:
            return  # NOTE: repriced since: another event ends it
        del self.ends[req.rid]
        self.pool.store(req.hashes[req.reused_blocks :], t)
        self.busy_s += req.prefill_s
        self.inflight -= 1
        if not self.inflight:
            self.sim.host_changed(t)
        self.sim.prefill_finished(req, t)
        self._start_next(t)
