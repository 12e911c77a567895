"""Prefill scheduling policies, in a registry: random, round_robin, load_balance, cache_aware,
kvcache_centric.

A policy sees one request through a `PrefillView` (each prefill instance's local prefix
match and queue time, the longest match anywhere, and the cost model's estimators) and
returns a `PrefillPlan`: which instance, how many blocks it reuses, where it fetches them
from, the predicted TTFT, and whether to replicate. Every policy reuses the prefix the
chosen instance already holds; only kvcache_centric fetches from other nodes.

`kvcache_centric` is the paper's Algorithm 1 (see PAPER.md), for each prefill instance p:

    if best_prefix_len / p.prefix_len < threshold:     # remote barely better: recompute
        TTFT_p = T_queue(p) + T_prefill(len, p.prefix_len)
    else:                                              # fetch the extra blocks
        TTFT_p = T_transfer(best_prefix_len - p.prefix_len) + T_queue(p)
                 + T_prefill(len, best_prefix_len)
    choose the p with the smallest TTFT (ties: the first registered);
    replicate blocks [p.prefix_len, best_prefix_len) from best_instance to p
        if best_prefix_len / p.prefix_len > threshold.

T_prefill(len, n) here includes reading the first n blocks' KV where the pool holds it on
SSD only (`PrefillView.read_s`: the SSD's read cost; memory-resident blocks cost nothing
locally and T_transfer remotely).

NOTE: the paper leaves p.prefix_len = 0 open; here a zero local match counts as "remote is
better" (ratio = infinity) whenever best_prefix_len > 0, and as recompute when nothing is
cached anywhere. At ratio == threshold p fetches but does not replicate, as written.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from mooncake.errors import ConfigError


@dataclass(slots=True)
class PrefillView:
    """One request as the policies see it (lists are indexed like `names`)."""

    input_len: int  # tokens
    num_blocks: int  # blocks of the prompt
    names: list[str]  # prefill instances
    prefix_lens: list[int]  # blocks each instance holds locally (leading)
    queue_s: list[float]  # T_queue per instance, seconds
    best_len: int  # best_prefix_len, blocks
    best_idx: int  # best_instance (-1 when nothing is cached; may be >= len(names): a pool node)
    can_fetch: bool  # False when instances cannot read each other's cache
    prefill_s: Callable[[int], float]  # reused blocks -> T_prefill, seconds
    transfer_s: Callable[[int, int, int], float]  # (src, dst, blocks) -> T_transfer, seconds
    # reused blocks -> seconds reading those of them held on SSD only (0: none on SSD)
    read_s: Callable[[int], float] = lambda _blocks: 0.0


@dataclass(slots=True, frozen=True)
class PrefillPlan:
    idx: int  # chosen prefill instance
    reused_blocks: int  # leading blocks not recomputed
    fetch_from: int  # instance to fetch [local, reused) from; -1 = none
    ttft_s: float  # predicted TTFT, seconds
    replicate: bool  # Algorithm 1 line 5: replicate the fetched blocks to idx


def prefix_ratio(best_len: int, local_len: int) -> float:
    """best_prefix_len / p.prefix_len, with a zero local match counting as infinitely worse."""
    if local_len == 0:
        return math.inf if best_len > 0 else 1.0
    return best_len / local_len


class BasePolicy:
    """Chooses a prefill instance for one request; may keep state (a random generator)."""

    name = ""

    def __init__(self, threshold: float = 1.5, seed: int = 0):
        self.threshold = threshold
        self.seed = seed

    def choose(self, view: PrefillView) -> PrefillPlan:
        raise NotImplementedError

    @staticmethod
    def local(view: PrefillView, i: int) -> PrefillPlan:
        """Run on instance i, reusing only what it holds."""
        n = view.prefix_lens[i]
        ttft = view.queue_s[i] + view.prefill_s(n) + view.read_s(n)
        return PrefillPlan(i, n, -1, ttft, False)


class RandomPolicy(BasePolicy):
    name = "random"

    def __init__(self, threshold: float = 1.5, seed: int = 0):
        super().__init__(threshold, seed)
        self._rng = random.Random(seed)

    def choose(self, view: PrefillView) -> PrefillPlan:
        return self.local(view, self._rng.randrange(len(view.names)))


class RoundRobinPolicy(BasePolicy):
    """Each instance in turn, whatever it holds (the baseline a KV-aware router beats)."""

    name = "round_robin"

    def __init__(self, threshold: float = 1.5, seed: int = 0):
        super().__init__(threshold, seed)
        self._next = 0

    def choose(self, view: PrefillView) -> PrefillPlan:
        i, self._next = self._next % len(view.names), self._next + 1
        return self.local(view, i)


class LoadBalancePolicy(BasePolicy):
    """The instance with the shortest queue."""

    name = "load_balance"

    def choose(self, view: PrefillView) -> PrefillPlan:
        q = view.queue_s
        return self.local(view, min(range(len(q)), key=q.__getitem__))


class CacheAwarePolicy(BasePolicy):
    """The instance with the longest local prefix hit; ties go to the shorter queue."""

    name = "cache_aware"

    def choose(self, view: PrefillView) -> PrefillPlan:
        lens, q = view.prefix_lens, view.queue_s
        return self.local(view, min(range(len(q)), key=lambda i: (-lens[i], q[i])))


class KVCacheCentricPolicy(BasePolicy):
    """Algorithm 1 (module docstring): minimum TTFT over recompute-or-fetch per instance."""

    name = "kvcache_centric"

    def choose(self, view: PrefillView) -> PrefillPlan:
        best_len, best_idx, thr = view.best_len, view.best_idx, self.threshold
        queue, lens = view.queue_s, view.prefix_lens
        recompute_s: dict[int, float] = {}  # prefix_len -> T_prefill (few distinct values)
        fetch_prefill_s = view.prefill_s(best_len) + view.read_s(best_len)
        best_ttft, idx, reused, src = math.inf, 0, 0, -1
        for i, p_len in enumerate(lens):
            if (
                not view.can_fetch
                or best_len == p_len
                or (p_len and best_len / p_len < thr)  # prefix_ratio(), inlined
            ):
                t = recompute_s.get(p_len)
                if t is None:
                    t = recompute_s[p_len] = view.prefill_s(p_len) + view.read_s(p_len)
                ttft = queue[i] + t
                if ttft < best_ttft:
                    best_ttft, idx, reused, src = ttft, i, p_len, -1
            else:
                ttft = queue[i] + fetch_prefill_s
                if ttft >= best_ttft:  # NOTE: T_transfer >= 0, so it cannot win; skip pricing it
                    continue
                ttft += view.transfer_s(best_idx, i, best_len - p_len)
                if ttft < best_ttft:
                    best_ttft, idx, reused, src = ttft, i, best_len, best_idx
        replicate = src >= 0 and prefix_ratio(best_len, lens[idx]) > thr
        return PrefillPlan(idx, reused, src, best_ttft, replicate)


POLICY_REGISTRY: dict[str, type[BasePolicy]] = {
    cls.name: cls
    for cls in (
        RandomPolicy,
        RoundRobinPolicy,
        LoadBalancePolicy,
        CacheAwarePolicy,
        KVCacheCentricPolicy,
    )
}


def create_policy(name: str, threshold: float, seed: int = 0) -> BasePolicy:
    """A fresh policy by registry name."""
    try:
        cls = POLICY_REGISTRY[name]
    except KeyError:
        raise ConfigError(
            f"unknown scheduling policy {name!r}; known: {', '.join(POLICY_REGISTRY)}"
        ) from None
    return cls(threshold, seed)
