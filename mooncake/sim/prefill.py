"""A simulated prefill instance: one request at a time, first come first served.

A request starts when the instance is free and the prefix blocks it fetches from another
node have arrived. It reuses the leading blocks it actually holds then (the Conductor's
plan may have been overtaken by an eviction), computes the rest in T_prefill(len, reused),
and streams its KV layer by layer to its decode node while computing (the stream is
booked on the network from the prefill's start). Just before it starts, the Conductor has
the last word (`admit_prefill`): it may choose another decode node for the KV, or reject
the request (predictive early rejection), and the next one starts instead. New blocks go
into the node's pool when the prefill ends; fetched blocks stay only if the Conductor
ordered a replica.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

import msgspec

from mooncake.sim.metrics import SimRequest
from mooncake.sim.pool import NodePool

if TYPE_CHECKING:
    from mooncake.sim.simulator import Simulator


class PrefillInstance:
    """FIFO prefill queue of one instance."""

    def __init__(self, name: str, sim: Simulator, pool: NodePool):
        self.name = name
        self.sim = sim
        self.pool = pool
        self.queue: deque[SimRequest] = deque()
        self.running: SimRequest | None = None
        self.waking = False  # a wake-up event for the head's fetch is pending
        self.busy_s = 0.0  # simulated seconds spent computing

    def enqueue(self, t: float, req: SimRequest) -> None:
        self.queue.append(req)
        if self.running is None and not self.waking:
            self._start_next(t)

    def _wake(self, t: float, _: object) -> None:
        self.waking = False
        if self.running is None:
            self._start_next(t)

    def _start_next(self, t: float) -> None:
        while self.queue and self.running is None:
            head = self.queue[0]
            if head.fetch_ready > t:
                self.waking = True
                self.sim.push(head.fetch_ready, self._wake, None)
                return
            self.queue.popleft()
            self._start(t, head)

    def _start(self, t: float, req: SimRequest) -> None:
        sim, d = self.sim, req.decision
        local = self.pool.prefix_len(req.hashes)
        reused = local
        if d.fetch_from and local >= d.local_blocks:
            reused = max(local, d.reused_blocks)  # fetched blocks extend the local prefix
        prefill_s = sim.cost.prefill_time(req.input_len, reused * sim.block_tokens)
        grant = sim.conductor.admit_prefill(req.rid, t, prefill_s)
        if not grant.is_accepted:
            sim.rejected_at_start(req, t)
            return
        if grant.decode != d.decode:
            req.decision = d = msgspec.structs.replace(d, decode=grant.decode)
        self.pool.store(req.hashes[:local])  # reading refreshes the LRU order
        if d.replications and reused > local:
            self.pool.store(req.hashes[local:reused])  # the ordered replica lands here
        req.reused_blocks = reused
        req.prefill_start = t
        req.prefill_s = prefill_s
        self.running = req
        kv_bytes = req.input_len * sim.cost.kv_bytes_per_token
        req.stream_end = sim.network.reserve(self.name, d.decode, kv_bytes, t)
        sim.push(t + req.prefill_s, self._done, req)

    def _done(self, t: float, req: SimRequest) -> None:
        self.pool.store(req.hashes[req.reused_blocks :])
        self.busy_s += req.prefill_s
        self.running = None
        self.sim.prefill_finished(req, t)
        self._start_next(t)
