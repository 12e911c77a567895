"""What `mooncake bench repeats` measures: distinct prompts on a fresh local cluster, each
sent again as soon as its answer ended. A block committed to the pool before a request is
placed must be reused by it, so every repeat should reuse every full block of its prompt.

    start      a fresh `up --local` of the plan's shape (its cost model cached per shape)
    warm up    two prompts of other tokens, not counted
    measure    per prompt (seeded random tokens: distinct blocks): send it, then
               the same prompt again at once; each answer's usage: cached_tokens and the
               server's kv_blocks (the blocks it could have reused, by cause)

A repeat's full blocks are those a prefill can reuse: `(prompt_len - 2) // block_tokens`
(the decode node computes the last token). The blocks a repeat did not reuse are misses of
committed blocks: its first's answer ended only after its blocks were committed.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx
import msgspec
import numpy as np

from mooncake.bench.calibrate import COST_CACHE
from mooncake.errors import MooncakeError
from mooncake.local.cost import ensure_cost_model
from mooncake.local.launcher import LocalLauncher, LocalPlan
from mooncake.replay.report import KV_BLOCK_KEYS


class RepeatsResult(msgspec.Struct, kw_only=True):
    """What `bench repeats` reports (seconds unless named otherwise)."""

    cluster: str  # its shape and model
    prompts: int  # distinct prompts, each sent twice
    prompt_len: int  # tokens per prompt
    block_tokens: int
    full_blocks: int  # blocks each repeat could reuse
    whole_repeats: int  # repeats that reused every full block
    committed_misses: int  # full blocks the repeats did not reuse (the figure: 0)
    first_kv_blocks: dict[str, int]  # the first sends' blocks by cause, as the server said
    repeat_kv_blocks: dict[str, int]  # the repeats'
    first_p50_s: float  # request time, first send (max_tokens tokens)
    repeat_p50_s: float  # request time, repeat
    worst: list[int]  # the fewest blocks a repeat reused, lowest first (up to 5)


def _send(client: httpx.Client, model: str, prompt: list[int], max_tokens: int) -> Any:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    try:
        r = client.post("/v1/completions", json=body)
    except httpx.HTTPError as e:
        raise MooncakeError(f"bench repeats: the request failed: {e}") from e
    if r.status_code != 200:
        raise MooncakeError(f"bench repeats: HTTP {r.status_code}: {r.text[:300]}")
    return r.json()["usage"]["prompt_tokens_details"]


def run_repeats(
    plan: LocalPlan,
    num_prompts: int,
    prompt_len: int,
    max_tokens: int,
    seed: int = 0,
    on_progress: Callable[[str], None] = lambda _: None,
) -> RepeatsResult:
    """Start a fresh cluster of `plan`, send each prompt twice in a row, stop it; raises
    MooncakeError when a request fails."""
    if prompt_len < plan.block_tokens + 2:
        raise MooncakeError(
            f"--prompt-len {prompt_len} holds no full block a prefill can reuse; use at least "
            f"block_tokens + 2 = {plan.block_tokens + 2}"
        )
    cost = ensure_cost_model(plan, COST_CACHE, on_progress)
    launcher = LocalLauncher(plan, on_progress)
    launcher.runfile = plan.run_dir / "local.json"  # NOTE: never the user's own cluster's
    on_progress("starting the local cluster")
    launcher.start(str(cost))
    full = (prompt_len - 2) // plan.block_tokens
    rng = random.Random(seed)
    headers = {"Authorization": f"Bearer {launcher.api_key}"} if launcher.api_key else {}
    firsts: Counter[str] = Counter()
    repeats: Counter[str] = Counter()
    times: tuple[list[float], list[float]] = ([], [])
    reused: list[int] = []
    try:
        with httpx.Client(base_url=launcher.url, headers=headers, timeout=300) as client:
            model = client.get("/v1/models").json()["data"][0]["id"]
            vocab = 250  # NOTE: within every model's vocabulary; ids 0-2 left to specials
            for _ in range(2):  # warm-up: other tokens, not counted
                _send(client, model, [rng.randrange(3, vocab) for _ in range(prompt_len)], 1)
            for i in range(num_prompts):
                prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
                for k, counts in enumerate((firsts, repeats)):
                    t0 = time.perf_counter()
                    details = _send(client, model, prompt, max_tokens)
                    times[k].append(time.perf_counter() - t0)
                    blocks = details.get("kv_blocks") or {}
                    counts.update({key: int(blocks.get(key, 0)) for key in KV_BLOCK_KEYS})
                reused.append(min(full, int(details["cached_tokens"]) // plan.block_tokens))
                if (i + 1) % 20 == 0:
                    on_progress(f"{i + 1} of {num_prompts} prompts sent twice")
    finally:
        on_progress("stopping the local cluster")
        launcher.stop()
    shape = f"{plan.num_prefill}P (groups of {plan.group_size}) + {plan.num_decode}D"
    return RepeatsResult(
        cluster=f"{shape} + {plan.num_store} store, {plan.model}",
        prompts=num_prompts,
        prompt_len=prompt_len,
        block_tokens=plan.block_tokens,
        full_blocks=full,
        whole_repeats=sum(n == full for n in reused),
        committed_misses=sum(full - n for n in reused),
        first_kv_blocks=dict(firsts),
        repeat_kv_blocks=dict(repeats),
        first_p50_s=float(np.median(times[0])) if times[0] else 0.0,
        repeat_p50_s=float(np.median(times[1])) if times[1] else 0.0,
        worst=sorted(reused)[:5],
    )
