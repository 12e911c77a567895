"""A request in the cluster as the master tracks it (`Flight`: its placement, its output so
far, what a new placement after a node failure sends, its deadline), and the master's
requests in flight by id (`Flights`).

A request's deadline, from its arrival (`request_deadline_s`):

    deadline_slack_s + deadline_factor x (ttft_slo_s + max_tokens x tbt_slo_s)

([scheduler] keys): the time its SLOs allow for the first token and every later one,
scaled, plus room for waiting on a restarting node and for a re-placement.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from dataclasses import dataclass, field

import msgspec

from mooncake.api.backend import GenerateRequest, Output
from mooncake.conductor.misses import MissCounts
from mooncake.conductor.types import Decision
from mooncake.config.roles import SchedulerConfig
from mooncake.model.params import SamplingParams
from mooncake.roles.master.timeline import Moments
from mooncake.roles.node.delivery import Inbox
from mooncake.roles.node.messages import TokenAck, TokenMsg


def request_deadline_s(sched: SchedulerConfig, max_tokens: int) -> float:
    """Seconds a request of `max_tokens` output tokens may take (module docstring)."""
    slos = sched.ttft_slo_s + max_tokens * sched.tbt_slo_s
    return sched.deadline_slack_s + sched.deadline_factor * slos


@dataclass
class Flight:
    """A request in the cluster."""

    req_id: int
    gen: GenerateRequest
    block_hashes: list[int]  # the prompt's, hashed once (placing again reuses them)
    queue: asyncio.Queue[TokenMsg]
    decision: Decision
    ends_at: float = float("inf")  # time.monotonic() of its deadline
    phase: str = "queued"  # queued (at prefill) | prefilling | decoding
    num_cached_tokens: int = 0  # as its prefill node reported (tokens reused)
    kv_blocks: MissCounts | None = None  # its blocks by cause, as the master attributed them
    is_handed_off: bool = False  # its prefill node reported its KV with the decode node
    # NOTE: set once its prefill node reported (after committing the new blocks to the
    # pool) or died; cleared when it is placed again
    reported: asyncio.Event = field(default_factory=asyncio.Event)
    is_report_out: bool = False  # an output carried the report already
    done: bool = False
    output_ids: list[int] = field(default_factory=list)  # tokens streamed so far (all choices)
    num_placements: int = 1
    is_replacing: bool = False  # a re-placement is under way (one at a time)
    last_error: str = ""  # why its last placement failed, as its prefill node said
    inbox: Inbox = field(default_factory=Inbox)  # its decode node's token stream
    moments: Moments = field(init=False)  # its first placement's, for the TTFT phases

    def __post_init__(self) -> None:
        self.moments = Moments(self.req_id, time.monotonic(), self.decision.ttft_s)

    @property
    def task_prompt(self) -> list[int]:
        """What the next placement prefills: the prompt and the output so far."""
        return self.gen.prompt_ids + self.output_ids

    @property
    def task_params(self) -> SamplingParams:
        """The sampling of the next placement: only the tokens still owed."""
        params = self.gen.params
        if not self.output_ids:
            return params
        owed = max(1, params.max_tokens - len(self.output_ids))
        return msgspec.structs.replace(params, max_tokens=owed)

    def output(self, tok: TokenMsg) -> Output:
        """The API's output for a token event; the first one after the prefill node's
        report carries it (tokens reused, blocks by cause)."""
        cached, kv_blocks = 0, None
        if self.reported.is_set() and not self.is_report_out:
            self.is_report_out = True
            cached, kv_blocks = self.num_cached_tokens, self.kv_blocks
        return Output(
            token_id=tok.token_id,
            text=tok.text,
            logprob=tok.logprob,
            top_logprobs=tok.top_logprobs,
            finish_reason=tok.finish_reason,
            error=tok.error,
            num_cached_tokens=cached,
            kv_blocks=kv_blocks,
            index=tok.index,
            more_choices=tok.more_choices,
        )

    async def wait_reported(self, timeout_s: float) -> None:
        """Until its prefill node reported, at most `timeout_s` (a lost report)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.reported.wait(), timeout_s)

    @property
    def where(self) -> str:
        """Where it is, for an error message."""
        d = self.decision
        if self.is_replacing:
            return f"waiting to be placed again ({self.last_error or 'its node failed'})"
        if self.phase == "decoding":
            return f"decoding on {d.decode}, {len(self.output_ids)} tokens streamed"
        if self.is_handed_off:
            return f"its KV handed to {d.decode}, no token received from it"
        if self.phase == "prefilling":
            return f"prefilling on {d.prefill} for {d.decode}"
        return f"queued at prefill node {d.prefill}"


class Flights(dict[int, Flight]):
    """The requests in flight by their current id. The event loop adds, moves (a new id)
    and ends them; the RPC thread looks them up for token events. `lock` makes a move
    and an end atomic for `receive`; it is held for dictionary work and one batch of
    events."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()
        # NOTE: ids never repeat across master restarts (nodes outlive the master)
        self._ids = itertools.count(time.time_ns() // 1000)

    def new_id(self) -> int:
        return next(self._ids)

    def end(self, flight: Flight) -> bool:
        """It ended: False when it had already (late events of it are refused from now)."""
        with self.lock:
            if flight.done:
                return False
            flight.done = True
            self.pop(flight.req_id, None)
            return True

    def move(self, flight: Flight) -> int:
        """A new id for its next placement (whose token stream starts again at 0); returns
        the old id (events for it are refused from now)."""
        with self.lock:
            old = flight.req_id
            self.pop(old, None)
            flight.req_id = self.new_id()
            flight.inbox = Inbox()
            self[flight.req_id] = flight
        return old

    def receive(
        self, node_id: str, tokens: list[TokenMsg]
    ) -> tuple[list[tuple[Flight, TokenMsg]], list[TokenAck]]:
        """Token events from decode node `node_id`: those now due to each request's client
        (in seq order, each once) and the acknowledgements (`is_known` False for a request
        not tracked: ended, placed again, or not placed on that node)."""
        acks: dict[int, TokenAck] = {}
        ready: list[tuple[Flight, TokenMsg]] = []
        with self.lock:
            for tok in tokens:
                flight = self.get(tok.req_id)
                if flight is None or flight.done or flight.decision.decode != node_id:
                    acks[tok.req_id] = TokenAck(tok.req_id, 0, is_known=False)
                    continue
                ready += [(flight, t) for t in flight.inbox.accept(tok)]
                acks[tok.req_id] = TokenAck(tok.req_id, flight.inbox.next_seq)
        return ready, list(acks.values())
