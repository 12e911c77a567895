"""The Conductor: places each request on a prefill and a decode instance, or rejects it.

`schedule` reads as the paper's loop: match -> estimate -> place -> admit.

- match: the global prefix index gives each prefill instance's local prefix and the best
  prefix anywhere;
- estimate + choose: the policy (Algorithm 1 for kvcache_centric) predicts TTFT per
  instance from its queue, the cost model (reading blocks held on SSD only at the SSD's
  read bandwidth) and the network load, and picks one;
- place: the decode instance with the lowest predicted TBT that has room for the KV;
- admit: early rejection (`mooncake.conductor.admission`).

`admit_prefill` is the second look, when the prefill is about to start: it re-chooses the
decode instance the KV streams to from the §7.4 forecast (late binding, in every mode
unless `late_binding` is off), and in predictive mode may still reject (before any prefill
is spent). Everything else is bookkeeping: progress reports (`on_prefill_started`, ...)
move each accepted request's ticket (`mooncake.conductor.tickets`), and store events
feed the prefix index (`index`). Pure logic: no sockets, threads or clock; `now` is
passed in. `create_conductor` builds the master's, over `roofline.master_cost_model`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mooncake.conductor.admission import decide
from mooncake.conductor.candidates import MAX_EXPLICIT, LoadOrder, Prices, walked_len
from mooncake.conductor.candidates import choose as choose_bounded
from mooncake.conductor.costmodel import CostModel
from mooncake.conductor.decodeorder import DecodeOrder, is_monotone
from mooncake.conductor.forecast import DecodeForecast, ForecastError
from mooncake.conductor.index import PrefixIndex
from mooncake.conductor.load import DecodeSlots, PrefillQueue
from mooncake.conductor.network import NetworkState
from mooncake.conductor.pipelining import num_chunks, pipeline_times
from mooncake.conductor.placement import place_at_start, place_decode
from mooncake.conductor.policy import PrefillPlan, PrefillView, create_policy
from mooncake.conductor.roofline import master_cost_model, roofline_cost_model
from mooncake.conductor.tickets import OpenTickets
from mooncake.conductor.types import (
    ConductorParams,
    Decision,
    PrefillAdmission,
    ReplicationOrder,
    ScheduleRequest,
)
from mooncake.conductor.waiting import WaitingRoom, next_idle_s
from mooncake.errors import SchedulingError

if TYPE_CHECKING:
    from mooncake.config.settings import Config, SchedulerConfig
    from mooncake.model.info import ModelInfo

log = logging.getLogger(__name__)


class Conductor:
    """Global scheduler over prefill and decode (or coupled) instances."""

    def __init__(self, params: ConductorParams, cost: CostModel):
        self.forecast = DecodeForecast(params.decode_time_s, params.decode_time_ewma)
        self.tickets = OpenTickets(self.forecast)  # the accepted requests' load
        self.prefill: list[PrefillQueue] = []
        self.decode: list[DecodeSlots] = []
        self._decode_by_name: dict[str, DecodeSlots] = {}
        self.params = params
        self.cost = cost
        self.index = PrefixIndex()
        self.network = NetworkState(cost.link_bytes_per_s)
        self.policy = create_policy(params.policy, params.balancing_threshold, params.seed)
        self.forecast_error = ForecastError()  # of the arrival-time forecasts (predictive)
        self.is_coupled = False
        self._pool_nodes: dict[str, None] = {}  # nodes whose blocks prefill may fetch, in order
        self._prefill_names: set[str] = set()
        self._match_table: MatchTable | None = None  # built at the first decision after a change
        self._block_bytes = cost.kv_bytes_per_token * params.block_tokens
        self._load_order = LoadOrder()  # the prefill queues by floor (candidates.py)
        self._decode_order = DecodeOrder()  # the decode instances by load (decodeorder.py)
        self._step_monotone = is_monotone([t.coef for t in cost.spec.decode.terms])
        # first-stage seconds of prefill offered per group, decaying over defer_window_s
        self._offered_s, self._offered_at = 0.0, 0.0
        self.waiting = WaitingRoom(params.defer_s)  # refused for the queue alone, waiting

    @classmethod
    def from_config(
        cls,
        cfg: SchedulerConfig,
        *,
        model: str = "llama2-70b",
        gpu: str = "A800",
        tp: int = 8,
        block_tokens: int = 512,
        seed: int = 0,
        cost: CostModel | None = None,
        stages: int = 1,
        chunk_tokens: int = 0,
    ) -> Conductor:
        """A Conductor from the `[scheduler]` settings; the cost model is `cost` when given
        (the master passes `roofline.master_cost_model`'s), else the profile file at
        `cfg.cost_model_path`, else the roofline of `model` on `tp` x `gpu`. `stages` and
        `chunk_tokens`: the prefill groups' pipeline stages and chunk size."""
        path = cfg.cost_model_path
        if cost is None:
            cost = CostModel.load(path) if path else roofline_cost_model(model, gpu, tp)
        params = ConductorParams(
            policy=cfg.policy,
            rejection=cfg.rejection,
            ttft_slo_s=cfg.ttft_slo_s,
            tbt_slo_s=cfg.tbt_slo_s,
            balancing_threshold=cfg.balancing_threshold,
            forecast_sigmas=cfg.forecast_sigmas,
            defer_s=cfg.defer_s,
            defer_window_s=cfg.defer_window_s,
            block_tokens=block_tokens,
            stages=stages,
            chunk_tokens=chunk_tokens,
            seed=seed,
        )
        return cls(params, cost)

    def use_cost_model(self, cost: CostModel) -> None:
        """Schedule with `cost` from now on; links that had the old default NIC bandwidth
        take the new one (nodes added before it came)."""
        net, old = self.network, self.cost.link_bytes_per_s
        for name, bw in list(net._bw.items()):  # NOTE: its own package's link table
            if bw == old:
                net.add_node(name, cost.link_bytes_per_s)
        net.default_bytes_per_s = cost.link_bytes_per_s
        self.cost = cost
        self._step_monotone = is_monotone([t.coef for t in cost.spec.decode.terms])

    # -- instances ---------------------------------------------------------------------
    def add_prefill_instance(self, name: str, link_bytes_per_s: float | None = None) -> None:
        assert not self.is_coupled, "a cluster is either coupled or disaggregated"
        self._add_prefill(name, link_bytes_per_s)

    def add_decode_instance(
        self,
        name: str,
        kv_capacity_tokens: int | None = None,
        link_bytes_per_s: float | None = None,
    ) -> None:
        assert not self.is_coupled, "a cluster is either coupled or disaggregated"
        self._add_decode(name, kv_capacity_tokens)
        self.add_pool_node(name, link_bytes_per_s)  # its DRAM is part of the pool too

    def add_pool_node(self, name: str, link_bytes_per_s: float | None = None) -> None:
        """A node that holds pool blocks a prefill instance may fetch (a store node)."""
        if name not in self._pool_nodes:
            self._pool_nodes[name] = None
            self.network.add_node(name, link_bytes_per_s)
            self._match_table = None

    def add_coupled_instance(self, name: str, kv_capacity_tokens: int | None = None) -> None:
        """An instance that prefills and decodes (vLLM-style); it reads only its own cache."""
        assert not self.decode or self.is_coupled, "a cluster is either coupled or disaggregated"
        self.is_coupled = True
        self._add_prefill(name, None)
        self._add_decode(name, kv_capacity_tokens)

    def _add_decode(self, name: str, kv_capacity_tokens: int | None) -> None:
        if name in self._decode_by_name:
            raise SchedulingError(f"decode instance {name!r} is already registered")
        capacity = kv_capacity_tokens or self.cost.kv_capacity_tokens
        slots = DecodeSlots(name, capacity, self._decode_order)
        self.decode.append(slots)
        self._decode_order.add(slots, len(self.decode) - 1)
        self._decode_by_name[name] = slots
        self.forecast.capacity_tokens += slots.capacity_tokens

    def _add_prefill(self, name: str, link_bytes_per_s: float | None) -> None:
        if name in self._prefill_names:
            raise SchedulingError(f"prefill instance {name!r} is already registered")
        p = self.params
        queue = PrefillQueue(
            name, self.index.bit(name), p.stages, p.chunk_tokens, p.speed_ewma, self._load_order
        )
        self.prefill.append(queue)
        self._prefill_names.add(name)
        self._load_order.add(queue)
        # NOTE: every stage of a group moves its own layers' KV over its own NIC
        self.network.add_node(name, (link_bytes_per_s or self.cost.link_bytes_per_s) * p.stages)
        self._match_table = None

    @property
    def _match(self) -> MatchTable:
        """The match step's nodes and masks, rebuilt once after instances change."""
        if self._match_table is None:
            self._match_table = MatchTable.build(
                [q.name for q in self.prefill], list(self._pool_nodes), self.index, self.is_coupled
            )
        return self._match_table

    def remove_instance(self, name: str) -> None:
        """The instance's node is gone: stop placing on it and forget its blocks."""
        self.prefill = [q for q in self.prefill if q.name != name]
        self.decode = [s for s in self.decode if s.name != name]
        self._decode_by_name.pop(name, None)
        self._decode_order.rebuild(self.decode)
        self.forecast.capacity_tokens = sum(s.capacity_tokens for s in self.decode)
        self._pool_nodes.pop(name, None)
        self._prefill_names.discard(name)
        self.index.remove_node(name)
        self.network.remove_node(name)
        self._load_order.rebuild(self.prefill)
        self._match_table = None

    # -- the loop ----------------------------------------------------------------------
    def schedule(self, req: ScheduleRequest, now: float, waited: bool = False) -> Decision:
        """Decide where `req` runs, or reject it; an accepted decision is recorded as
        load (queue, reservation, forecast) until the progress reports retire it.

        A request refused for the queue ahead of it alone joins the waiting room
        (`Decision.can_wait`) if the prefill work arriving (`offered_load`) fits the
        groups (a burst, not sustained overload, where it would take the place of the
        next requests able to meet the SLO) and a group is predicted idle for it within
        `defer_s` (`mooncake.conductor.waiting`). `waited`: it is offered again; it goes
        only to a prefill group with no first-stage work queued, in its turn, so it takes
        capacity no queued request needs; otherwise it is refused again, can_wait still
        set while it may wait on."""
        if not self.prefill or not self.decode:
            return Decision(req_id=req.req_id, is_accepted=False, reason="no_instance")
        p = self.params
        if waited and (not_yet := self.waiting.turn(req.req_id, self._free_s(now), now)):
            return not_yet
        hashes, input_len = req.block_hashes, req.input_len
        if p.full_scan or waited or self.policy.name != "kvcache_centric":
            plan, local_len, own_queue_s, best_len, best_blocks = self._plan_full(req, now, waited)
        else:
            plan, local_len, own_queue_s, best_len, best_blocks = self._plan_bounded(req, now)
        if waited and not plan.ttft_s < math.inf:
            return self.waiting.wait_on(req.req_id, self._free_s(now))
        names = self._match.names
        # place
        slots, tbt, running = self._place_decode(plan.idx, input_len, now)
        # admit
        prefill_load, decode_load, reason = decide(
            self.cost,
            p,
            self.forecast,
            self.forecast_error,
            len(self.decode),
            running,
            input_len,
            plan.ttft_s,
            now,
        )
        own_s = plan.ttft_s - own_queue_s  # its TTFT with no queue ahead
        queue = self.prefill[plan.idx]
        reused = min(plan.reused_blocks * p.block_tokens, input_len)
        prefill_s = self.cost.prefill_time(input_len, reused)
        can_wait, wait_s = False, 0.0
        if p.defer_s > 0 and not waited:  # each request counts once, when it arrives
            chunks = num_chunks(input_len - reused, queue.chunk_tokens)
            stage_s = queue.times(prefill_s, chunks)[0]
            load = self.offered_load(now, stage_s)
            if reason == "ttft_slo" and own_s <= p.ttft_slo_s and load < 1.0:
                free_s = self._free_s(now)
                can_wait = self.waiting.enter(req.req_id, stage_s, free_s, now)
                wait_s = next_idle_s(free_s) if can_wait else 0.0
        elif waited:  # placed, or refused for another reason: it waits no more
            self.waiting.leave(req.req_id)
        src = names[plan.fetch_from] if plan.fetch_from >= 0 else ""
        replications: tuple[ReplicationOrder, ...] = ()
        if plan.replicate and plan.reused_blocks > local_len:
            blocks = tuple(hashes[local_len : plan.reused_blocks])
            replications = (ReplicationOrder(blocks, src, queue.name),)
        decision = Decision(
            req_id=req.req_id,
            is_accepted=not reason,
            reason=reason,
            prefill=queue.name,
            decode=slots.name,
            local_blocks=local_len,
            best_blocks=best_blocks,
            reused_blocks=plan.reused_blocks,
            fetch_from=src,
            ttft_s=plan.ttft_s,
            tbt_s=tbt,
            prefill_load=prefill_load,
            decode_load=decode_load,
            replications=replications,
            can_wait=can_wait,
            wait_s=wait_s,
        )
        if not reason:
            self.tickets.open(
                req.req_id,
                queue,
                prefill_s,
                slots,
                input_len,
                now + plan.ttft_s,
                input_len - reused,
            )
        return decision

    def _plan_full(
        self, req: ScheduleRequest, now: float, waited: bool
    ) -> tuple[PrefillPlan, int, float, int, int]:
        """match + estimate + choose over every prefill instance (the reference scan):
        (plan, the chosen instance's local prefix, its T_queue as priced, the longest
        reachable prefix, the longest prefix anywhere), blocks and seconds."""
        p, hashes, input_len = self.params, req.block_hashes, req.input_len
        m = self._match
        # match: every prefill instance's local prefix, and the longest one anywhere
        held = self.index.prefix_lens(hashes, m.bits, m.full)
        lens = held[: len(self.prefill)]
        # NOTE: coupled instances (vLLM's) read their own cache and the pool, never each other's
        first = len(self.prefill) if self.is_coupled else 0
        best_len = max(held[first:], default=0)
        best_idx = held.index(best_len, first) if best_len else -1
        if best_len < len(hashes) and p.global_pool:  # the pool's prefix, maybe split
            pool_len = self.index.pool_prefix_len(hashes, m.reach_full)
            if pool_len > best_len:  # NOTE: priced from the holder of the first block past
                mask = self.index.holders_mask(hashes[best_len])  # the longest run
                bits = m.bits
                best_idx = next(i for i in range(first, len(bits)) if bits[i] & mask)
                best_len = pool_len
        names = m.names
        # estimate (blocks the pool holds on SSD only are priced at the SSD's read cost)
        view = PrefillView(
            input_len=input_len,
            num_blocks=len(hashes),
            names=names[: len(self.prefill)],
            prefix_lens=lens,
            queue_s=[q.queue_time(now) for q in self.prefill],
            best_len=best_len,
            best_idx=best_idx,
            can_fetch=self._can_fetch,
            prefill_s=lambda blocks: self._prefill_latency(input_len, blocks),
            transfer_s=lambda src, dst, blocks: self.network.estimate(
                names[src], names[dst], blocks * self._block_bytes, now
            ),
            read_s=self._read_s(hashes),
        )
        if waited:  # NOTE: a busy group's TTFT is infinite to it: the policy picks an idle one
            view.queue_s = [0.0 if q <= 0.0 else math.inf for q in view.queue_s]
        plan = self.policy.choose(view)
        best_blocks = max(best_len, max(held, default=0))  # coupled: anywhere, reachable or not
        return plan, lens[plan.idx], view.queue_s[plan.idx], best_len, best_blocks

    def _plan_bounded(
        self, req: ScheduleRequest, now: float
    ) -> tuple[PrefillPlan, int, float, int, int]:
        """`_plan_full`'s answer for Algorithm 1 from a bounded candidate set
        (`mooncake.conductor.candidates`): the instances holding a prefix few others hold,
        then the rest in order of their queue's floor, until none can win."""
        hashes, input_len = req.block_hashes, req.input_len
        m = self._match
        groups = self.index.prefix_groups(hashes, m.full)
        explicit: dict[int, int] = {}  # prefill instance -> its prefix length
        walked: list[tuple[int, int]] = []  # (prefix length, mask of prefill bits)
        bit_to_idx, prefill_full = m.bit_to_idx, m.prefill_full
        best_len, best_idx = 0, -1
        for length, mask in groups:
            mine = mask & prefill_full
            if mine.bit_count() <= MAX_EXPLICIT:
                while mine:
                    low = mine & -mine
                    explicit[bit_to_idx[low]] = length
                    mine ^= low
            else:
                walked.append((length, mine))
            if mask & m.best_full:  # groups come shortest first
                best_len, best_idx = length, self._first_match(mask & m.best_full)
        if best_len < len(hashes) and self.params.global_pool:  # as in _plan_full
            pool_len = self.index.pool_prefix_len(hashes, m.reach_full)
            if pool_len > best_len:
                best_idx = self._first_match(
                    self.index.holders_mask(hashes[best_len]) & m.best_full
                )
                best_len = pool_len
        bits = m.prefill_bits
        if 0 <= best_idx < len(bits) and best_idx not in explicit:  # NOTE: the fetch source
            explicit[best_idx] = walked_len(walked, bits[best_idx])  # is priced one by one
        names, block_bytes, net = m.names, self._block_bytes, self.network
        read_s = self._read_s(hashes)
        queues = self.prefill
        prices = Prices(
            threshold=self.policy.threshold,
            can_fetch=self._can_fetch,
            best_len=best_len,
            best_idx=best_idx,
            queue_s=lambda i: queues[i].queue_time(now),
            recompute_s=lambda blocks: self._prefill_latency(input_len, blocks) + read_s(blocks),
            transfer_s=lambda src, dst, blocks: net.estimate(
                names[src], names[dst], blocks * block_bytes, now
            ),
            transfer_floor_s=lambda blocks: net.floor_estimate(
                names[best_idx], blocks * block_bytes, now
            ),
        )
        plan = choose_bounded(prices, explicit, walked, bits, self._load_order, now)
        local = explicit.get(plan.idx)
        if local is None:
            local = walked_len(walked, bits[plan.idx])
        best_blocks = max(best_len, groups[-1][0] if groups else 0)
        return plan, local, queues[plan.idx].queue_time(now), best_len, best_blocks

    @property
    def _can_fetch(self) -> bool:
        return self.params.global_pool and (not self.is_coupled or bool(self._pool_nodes))

    def _read_s(self, hashes: Sequence[Hashable]) -> Callable[[int], float]:
        """reused blocks -> seconds reading those of them the pool holds on SSD only."""
        ssd = self.index.ssd_only_counts(hashes, self._match.full)
        if not ssd:
            return _no_read
        return lambda blocks: self.cost.ssd_read_time(
            ssd[min(blocks, len(ssd) - 1)] * self._block_bytes
        )

    def _first_match(self, mask: int) -> int:
        """The lowest match index whose node's bit is in `mask` (not 0)."""
        m = self._match
        if m.bits_increasing:
            return m.bit_to_idx[mask & -mask]
        idx = len(m.bits)
        while mask:
            low = mask & -mask
            idx = min(idx, m.bit_to_idx.get(low, idx))
            mask ^= low
        return idx

    def _free_s(self, now: float) -> list[float]:
        """Each prefill group's queued first-stage seconds at `now`."""
        return [q.queue_time(now) for q in self.prefill]

    def end_wait(self, req_id: int) -> None:
        """A waiting request was refused after its wait (or its client went away)."""
        self.waiting.leave(req_id)

    def offered_load(self, now: float, stage_s: float = 0.0) -> float:
        """The prefill groups' offered load at `now`, after adding an arrival's first-stage
        seconds `stage_s`: first-stage seconds arriving per second per group, averaged with
        an exponential decay of time constant `defer_window_s` (1 = the groups' capacity)."""
        tau = self.params.defer_window_s
        if now > self._offered_at:
            self._offered_s *= math.exp((self._offered_at - now) / tau)
            self._offered_at = now
        self._offered_s += stage_s / max(1, len(self.prefill))
        return self._offered_s / tau

    def _prefill_latency(self, input_len: int, reused_blocks: int) -> float:
        """T_prefill of Algorithm 1 on a group of `params.stages` stages: first chunk in
        to last chunk out (`mooncake.conductor.pipelining`); the KV streams to the decode
        node meanwhile, so no hand-off transfer is added."""
        p = self.params
        reused = min(reused_blocks * p.block_tokens, input_len)
        prefill_s = self.cost.prefill_time(input_len, reused)
        if p.stages <= 1:
            return prefill_s
        chunks = num_chunks(input_len - reused, p.chunk_tokens)
        return pipeline_times(prefill_s, chunks, p.stages)[1]

    def _place_decode(
        self, prefill_idx: int, input_len: int, now: float
    ) -> tuple[DecodeSlots, float, tuple[int, float]]:
        """The decode instance with the lowest predicted TBT among those with room for the
        request's KV (its batch's KV now, plus reservations), that TBT in seconds, and the
        (requests, KV tokens) decoding now over the whole decode pool."""
        totals = self._decode_order.totals
        running = (totals.num_active, totals.held(now))
        if self.is_coupled:
            s = self.decode[prefill_idx]
            tbt = self.cost.step_fn(s.num + 1, s.held_tokens(now) + s.reserved_tokens + input_len)
            return s, tbt, running
        if self.params.full_scan or not self._step_monotone:
            slots, tbt, _ = place_decode(self.decode, self.cost.step_fn, input_len, now)
        else:
            slots, tbt = self._decode_order.place(self.decode, self.cost.step_fn, input_len, now)
        return slots, tbt, running

    def admit_prefill(
        self, req_id: int, now: float, prefill_s: float | None = None
    ) -> PrefillAdmission:
        """The request's prefill is about to start and will take `prefill_s` seconds (default:
        as predicted when it was scheduled). Records the start (as `on_prefill_started`)
        and returns where its KV streams. With late binding (or in predictive mode) it
        first refreshes the §7.4 forecast for the moment the KV lands: the decode instance
        with the lowest predicted load gets it (its reservation moves there); in
        predictive mode, when even that load is over 1, the request is rejected and
        dropped, before any prefill is spent. A request the Conductor does not track is
        not accepted."""
        ticket = self.tickets.get(req_id)
        if ticket is None:
            return PrefillAdmission(req_id=req_id, is_accepted=False, reason="unknown_request")
        queue, slots, tokens = ticket
        if prefill_s is None or req_id not in queue.req_chunks:
            latency_s = queue.latency(req_id)
        else:
            latency_s = queue.times(prefill_s, queue.req_chunks[req_id])[1]
        load = 0.0
        predictive = self.params.rejection == "predictive"
        if (predictive or self.params.late_binding) and not self.is_coupled:
            best, load = place_at_start(
                self.cost,
                self.params.tbt_slo_s,
                self.forecast,
                self.decode,
                req_id,
                tokens,
                now,
                now + latency_s,
                None if self.params.full_scan else self._decode_order.start_candidates(),
            )
            if predictive and load > 1.0:
                self.on_request_dropped(req_id, now)
                return PrefillAdmission(
                    req_id=req_id,
                    is_accepted=False,
                    decode=slots.name,
                    reason="decode_load",
                    decode_load=load,
                )
            self.tickets.rebind(req_id, best)
            slots = best
        self.tickets.start_prefill(req_id, now, prefill_s)
        return PrefillAdmission(
            req_id=req_id, is_accepted=True, decode=slots.name, decode_load=load
        )

    # -- progress reports: each moves the request's ticket ----------------------------
    def on_prefill_started(self, req_id: Hashable, now: float) -> None:
        """The request's prefill started (its predicted end refreshes the forecast)."""
        self.tickets.prefill_started(req_id, now)

    def on_prefill_finished(self, req_id: Hashable, now: float) -> None:
        self.tickets.prefill_finished(req_id, now)

    def on_decode_started(self, req_id: Hashable, now: float) -> None:
        self.tickets.decode_started(req_id, now)

    def on_decode_finished(self, req_id: Hashable, now: float) -> None:
        self.tickets.decode_finished(req_id, now)

    def on_request_dropped(self, req_id: Hashable, now: float) -> None:
        """The request ended early (rejected by its decode instance, failed, cancelled)."""
        self.tickets.drop(req_id)

    def on_decode_report(
        self, name: str, kv_tokens: int, batch_size: int, step_s: float, now: float
    ) -> None:
        """Decode (or coupled) instance `name` reports its batch: `batch_size` requests
        holding `kv_tokens` of KV at `now`, one step every `step_s` seconds."""
        slots = self._decode_by_name.get(name)
        if slots is None:
            return
        slots.report(kv_tokens, batch_size, step_s, now)
        totals = self._decode_order.totals
        if totals.num_active:  # NOTE: tokens/s per decoding request, batch-weighted
            self.forecast.gen_per_s = totals.gen_per_s / totals.num_active

    @property
    def num_tickets(self) -> int:
        """Accepted requests whose ticket is still open (not finished, not dropped)."""
        return len(self.tickets)

    @property
    def num_inflight(self) -> int:
        return len(self.tickets)

    def check_integrity(self) -> None:
        """Assert the index is consistent and every load entry belongs to a live ticket."""
        self.index.check_integrity()
        self.tickets.check(self.prefill, self.decode)
        self._load_order.check(self.prefill)
        self._decode_order.totals.check(self.decode)


@dataclass(frozen=True, slots=True)
class MatchTable:
    """The nodes the match step asks the prefix index about, and their masks."""

    names: list[str]  # prefill instances, then the other pool nodes (match indices)
    bits: list[int]  # their bits in the prefix index
    full: int  # OR of bits
    reach_full: int  # of those, where any instance may read (coupled: the pool's)
    prefill_bits: list[int]  # the prefill instances' bits (`bits`' head)
    prefill_full: int  # OR of prefill_bits
    best_full: int  # where the longest prefix counts (coupled: not the instances)
    bit_to_idx: dict[int, int]  # bit -> match index
    bits_increasing: bool  # bits in increasing order (the lowest bit is the first index)

    @classmethod
    def build(
        cls, prefill: list[str], pool: list[str], index: PrefixIndex, is_coupled: bool
    ) -> MatchTable:
        own = set(prefill)
        names = prefill + [n for n in pool if n not in own]
        bits = [index.bit(n) for n in names]
        full = reach = prefill_full = best = 0
        first = len(prefill) if is_coupled else 0
        for k, (name, bit) in enumerate(zip(names, bits, strict=True)):
            full |= bit
            if not is_coupled or name not in own:
                reach |= bit  # where a prefix may be read from
            if k < len(prefill):
                prefill_full |= bit
            if k >= first:
                best |= bit
        return cls(
            names=names,
            bits=bits,
            full=full,
            reach_full=reach,
            prefill_bits=bits[: len(prefill)],
            prefill_full=prefill_full,
            best_full=best,
            bit_to_idx={bit: i for i, bit in enumerate(bits)},
            bits_increasing=all(a < b for a, b in zip(bits, bits[1:], strict=False)),
        )


def _no_read(_blocks: int) -> float:
    return 0.0


def create_conductor(cfg: Config, info: ModelInfo) -> Conductor:
    """The master's Conductor over `master_cost_model` (a profile, or the model's roofline
    on the detected or default GPUs); `mooncake config check` builds the same cost model."""
    cost, source = master_cost_model(cfg, info)
    log.info("cost model: %s", source)
    return Conductor.from_config(
        cfg.scheduler,
        cost=cost,
        block_tokens=cfg.model.block_tokens,
        stages=max(1, cfg.prefill.pipeline_group_size),
        chunk_tokens=cfg.prefill.chunk_tokens,
    )
