"""A request in the cluster as the master tracks it: where it is placed, what it has
streamed, and what a new placement sends after a node failure (the prompt and the output so
far, for the tokens still owed)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import msgspec

from mooncake.api.backend import GenerateRequest
from mooncake.conductor.types import Decision
from mooncake.engine.params import SamplingParams
from mooncake.roles.messages import TokenMsg
from mooncake.roles.timeline import Moments


@dataclass
class Flight:
    """A request in the cluster."""

    req_id: int
    gen: GenerateRequest
    block_hashes: list[int]  # the prompt's, hashed once (placing again reuses them)
    queue: asyncio.Queue[TokenMsg]
    decision: Decision
    phase: str = "queued"  # queued (at prefill) | prefilling | decoding
    num_cached_tokens: int = 0
    done: bool = False
    output_ids: list[int] = field(default_factory=list)  # tokens streamed so far
    num_placements: int = 1
    is_replacing: bool = False  # a re-placement is under way (one at a time)
    last_error: str = ""  # why its last placement failed, as its prefill node said
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
