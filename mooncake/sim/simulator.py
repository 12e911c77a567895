"""The discrete-event loop: replays a trace through the real Conductor and simulated instances.

Events are (time, seq, callback, argument) in one heap; `seq` breaks ties in push order,
so a run is a pure function of the config and the trace. Arrivals are merged from the
sorted trace instead of being pushed up front. Per request:

    arrive -> Conductor.schedule -> [fetch booked on the network] -> prefill queue
    -> Conductor.admit_prefill -> [decode room reserved] -> prefill through the group's
    stages (KV streamed to decode) -> [decode admission] -> batch -> finish

and the same Conductor hears every step back (`on_prefill_started`, ...), while the pool
reports every block it gains or loses to the Conductor's prefix index and to the miss
ledger, which gives each block a request does not reuse its cause (`conductor/misses.py`).
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from mooncake.conductor import Conductor, ScheduleRequest
from mooncake.conductor.misses import MissLedger
from mooncake.conductor.types import Decision
from mooncake.conductor.waiting import MIN_OFFER_GAP_S
from mooncake.errors import ConfigError
from mooncake.model.spec import get_model_spec
from mooncake.sim.cluster import SimConfig
from mooncake.sim.coupled import CoupledInstance
from mooncake.sim.decode import DecodeInstance
from mooncake.sim.host import slowdown
from mooncake.sim.metrics import SimReport, SimRequest, summarize
from mooncake.sim.pool import NodePool, SimPool
from mooncake.sim.prefill import PrefillInstance
from mooncake.sim.trace import TraceRecord, trace_span_s


class Simulator:
    """One run of one config over one trace."""

    def __init__(self, cfg: SimConfig, records: list[TraceRecord]):
        self.cfg = cfg
        self.cost = cfg.cost_model()
        self.conductor = Conductor(cfg.conductor_params(), self.cost)
        self.network = self.conductor.network
        self.block_tokens = cfg.block_tokens
        self.tbt_slo_s = cfg.tbt_slo_s
        self.tbt_share = cfg.tbt_share
        self.num_layers = _num_layers(self.cost.spec.model)
        # every completed request's token gaps as (seconds, count) runs, when a list
        self.gap_runs: list[tuple[float, int]] | None = None
        self._heap: list[tuple[float, int, Callable[[float, Any], None], Any]] = []
        self._seq = itertools.count()
        top, ssd = cfg.pool_blocks_per_node(self.cost)
        self.pools: dict[str, NodePool] = {}
        self.prefill: dict[str, PrefillInstance] = {}
        self.decode: dict[str, DecodeInstance] = {}
        self.coupled: dict[str, CoupledInstance] = {}
        capacity = self.cost.kv_capacity_tokens
        index = self.conductor.index
        self.ledger = MissLedger(index)  # why requests missed (conductor/misses.py)
        # NOTE: coupled instances cache on their own; the disaggregated pool is one Store
        pool = SimPool(index, self.ledger, replica_budget=cfg.replica_budget)
        if cfg.is_coupled:
            for i in range(cfg.num_coupled):
                name = f"c{i}"
                self.conductor.add_coupled_instance(name, capacity)
                self.pools[name] = NodePool(name, top, 0, index, "vram", self.ledger)
                self.coupled[name] = CoupledInstance(
                    name, self, capacity, cfg.chunk_tokens, self.pools[name]
                )
        else:
            for i in range(cfg.num_groups):  # one instance per pipeline group
                name = f"p{i}"
                self.conductor.add_prefill_instance(name)
                self.pools[name] = NodePool(name, top, ssd, pool=pool)
                self.prefill[name] = PrefillInstance(name, self, self.pools[name], cfg.group_size)
            for i in range(cfg.num_decode):
                name = f"d{i}"
                self.conductor.add_decode_instance(name, capacity)
                self.decode[name] = DecodeInstance(name, self, capacity)
        records = records[: cfg.limit] if cfg.limit else records
        t0, scale = records[0].timestamp, 1.0 / (1000.0 * cfg.speed)
        self.requests = [
            SimRequest(i, (r.timestamp - t0) * scale, r.input_length, r.output_length, r.hash_ids)
            for i, r in enumerate(records)
        ]
        self.span_s = trace_span_s(records) / cfg.speed
        # requests refused for the queue alone, waiting for an idle group (`defer_s`):
        # (when they give up, the request, the Conductor's first decision)
        self.waiting: deque[tuple[float, SimRequest, Decision]] = deque()
        self._poll_at = math.inf  # the next poll of the waiting requests (inf: none pending)

    def push(self, t: float, fn: Callable[[float, Any], None], arg: Any) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), fn, arg))

    def run(self) -> SimReport:
        """Replay every request to completion and summarize."""
        wall = time.perf_counter()
        heap, pop = self._heap, heapq.heappop
        overhead = self.cfg.request_overhead_s  # NOTE: TTFT still counts from `arrival`
        for req in self.requests:
            while heap and heap[0][0] <= req.arrival + overhead:
                t, _, fn, arg = pop(heap)
                fn(t, arg)
            self._arrive(req.arrival + overhead, req)
        while heap:
            t, _, fn, arg = pop(heap)
            fn(t, arg)
        cfg = self.cfg
        report = summarize(
            self.requests,
            ttft_slo_s=cfg.ttft_slo_s,
            tbt_slo_s=cfg.tbt_slo_s,
            gpus_per_instance=cfg.tp,
            span_s=self.span_s,
            speed=cfg.speed,
        )
        report.result.wall_s = time.perf_counter() - wall
        return report

    def compute_factor(self, kind: str, starting: int = 0) -> float:
        """How much slower a `kind` ("prefill" or "decode") node computes now on a shared
        host (SimConfig.host_cores, prefill_nice: `sim/host.py`), with `starting` more
        prefill stages about to start; 1 when every node has its own device."""
        cfg = self.cfg
        if cfg.host_cores <= 0:
            return 1.0
        return slowdown(
            kind,
            cfg.host_cores,
            prefill_busy=starting + sum(p.stages for p in self.prefill.values() if p.inflight),
            decode_busy=len(busy := [d.duty for d in self.decode.values() if d.n > 0]),
            decode_duty=sum(busy) / len(busy) if busy else 1.0,
            background_cores=cfg.background_cores,
            prefill_nice=cfg.prefill_nice,
            prefill_cpu=cfg.prefill_cpu,
            decode_cpu=cfg.decode_cpu,
        )

    def host_changed(self, t: float) -> None:
        """A prefill group or a decode node started or stopped computing: on a shared host
        the others' compute is priced again (decode steps from their next boundary)."""
        if self.cfg.host_cores > 0:
            self.push(t, self._reprice, None)

    def _reprice(self, t: float, _: object) -> None:
        for group in self.prefill.values():
            group.reprice(t)
        for d in self.decode.values():
            if d.n:
                d.advance(t)
                d.reschedule()

    # -- request lifecycle -----------------------------------------------------------------
    def _arrive(self, t: float, req: SimRequest) -> None:
        d = self.conductor.schedule(ScheduleRequest(req.rid, req.input_len, req.hashes), t)
        if d.can_wait:  # refused for the queue alone: it waits for an idle group
            self.waiting.append((t + self.cfg.defer_s, req, d))
            self._poll_soon(t, d.wait_s)
            return
        self._placed(t, req, d)

    def _poll_soon(self, t: float, wait_s: float) -> None:
        """Poll the waiting requests when the next group is predicted idle, within `poll_s`
        (as the master offers each again)."""
        at = t + min(self.cfg.poll_s, max(wait_s, MIN_OFFER_GAP_S))
        if at < self._poll_at:
            self._poll_at = at
            self.push(at, self._poll, None)

    def _poll(self, t: float, _: object) -> None:
        """Offer the waiting requests again, oldest first; one past its `defer_s` is
        refused (and leaves the Conductor's waiting room)."""
        if t != self._poll_at:
            return  # an earlier poll replaced this one
        self._poll_at, wait_s = math.inf, math.inf
        waiting, self.waiting = self.waiting, deque()
        for give_up, req, first in waiting:
            if t >= give_up:
                self.conductor.end_wait(req.rid)
                self._placed(t, req, first)
                continue
            d = self.conductor.schedule(
                ScheduleRequest(req.rid, req.input_len, req.hashes), t, waited=True
            )
            if d.can_wait:
                self.waiting.append((give_up, req, first))
                wait_s = min(wait_s, d.wait_s, give_up - t)
            else:
                req.waited = d.is_accepted
                self._placed(t, req, d if d.is_accepted else first)
        if self.waiting:
            self._poll_soon(t, wait_s)

    def _placed(self, t: float, req: SimRequest, d: Decision) -> None:
        """The Conductor's final word on the request: rejected, or on its way to prefill."""
        req.decision = d
        if not d.is_accepted:
            req.status = "rejected_early"
            return
        if d.fetch_from:
            hashes = req.hashes[d.local_blocks : d.reused_blocks]
            source = self.pools[d.fetch_from]
            ssd = source.ssd.blocks if source.ssd is not None else {}
            req.ssd_blocks = sum(h in ssd for h in hashes)  # read there, then sent
            source.touch(hashes, t)  # the read refreshes the source's LRU
            block_bytes = self.block_tokens * self.cost.kv_bytes_per_token
            req.fetch_ready = self.network.reserve(
                d.fetch_from, d.prefill, len(hashes) * block_bytes, t
            ) + self.cost.ssd_read_time(req.ssd_blocks * block_bytes)
        if self.coupled:
            self.coupled[d.prefill].enqueue(t, req)
        else:
            self.prefill[d.prefill].enqueue(t, req)

    def prefill_finished(self, req: SimRequest, t: float) -> None:
        """The first token is out; route the request on to decode (unless coupled)."""
        req.prefill_end = t
        self.conductor.on_prefill_finished(req.rid, t)
        instance = self.decode.get(req.decision.decode)
        if req.output_len <= 1:
            if req.reserved and instance is not None:  # the cluster decodes nothing more
                instance.reserved_tokens -= req.input_len + 1
                req.first_token = max(t, req.stream_end)
            self.conductor.on_decode_started(req.rid, t)
            self.decode_finished(req, t)
            return
        if instance is None:  # coupled
            return
        ready = max(t, req.stream_end)
        if ready > t:
            self.push(ready, instance.offer, req)
        else:
            instance.offer(t, req)

    def decode_finished(self, req: SimRequest, t: float) -> None:
        req.status, req.done_at = "done", t
        self.conductor.on_decode_finished(req.rid, t)

    def rejected_at_start(self, req: SimRequest, t: float) -> None:
        """The Conductor rejected the request as its prefill was about to start (it has
        already closed its ticket)."""
        req.status, req.done_at = "rejected_start", t

    def rejected_late(self, req: SimRequest, t: float) -> None:
        """The decode instance refused the request after its prefill was spent."""
        req.status, req.done_at = "rejected_late", t
        self.conductor.on_request_dropped(req.rid, t)


def _num_layers(model: str) -> int:
    """Layers of the cost model's model (1 when its shape is unknown: the hand-off's tail
    is then a whole chunk's KV, an upper bound)."""
    try:
        return get_model_spec(model).num_layers
    except ConfigError:
        return 1


def run_sim(cfg: SimConfig, records: list[TraceRecord]) -> SimReport:
    """Simulate `records` on the cluster `cfg` describes."""
    return Simulator(cfg, records).run()
