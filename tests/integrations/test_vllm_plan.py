"""The vLLM connector's scheduler side as pure logic: what a prompt's pool hit is, what
each step loads and stores, and the vLLM versions it accepts. No vLLM, no pool: the pool
lookup is a set of block hashes."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from mooncake.errors import ConfigError
from mooncake.integrations.vllm.plan import (
    SUPPORTED_VLLM,
    PoolPlanner,
    Scheduled,
    check_vllm_version,
)
from mooncake.kv.hashing import PrefixHasher

BT = 4  # tokens per block


class Pool:
    """The pool as the planner sees it: which block hashes it holds; counts the lookups."""

    def __init__(self) -> None:
        self.held: set[int] = set()
        self.num_lookups = 0

    def lookup(self, hashes: Sequence[int]) -> int:
        self.num_lookups += 1
        return next((i for i, h in enumerate(hashes) if h not in self.held), len(hashes))


def planner() -> tuple[PoolPlanner, Pool]:
    pool = Pool()
    return PoolPlanner(PrefixHasher(BT, b"s" * 32, b"f" * 16), pool.lookup), pool


def test_a_hit_is_the_pools_whole_blocks_past_vllms_own_and_never_the_last_token() -> None:
    p, pool = planner()
    tokens = list(range(17))  # 4 full blocks and one token
    hashes = p.hasher.hash_blocks(tokens)
    assert p.match("a", tokens, 0) == 0 and pool.num_lookups == 1
    pool.held.update(hashes[:3])
    assert p.match("a", tokens, 0) == 12  # blocks 0-2
    assert p.match("a", tokens, 4) == 8  # vLLM holds block 0: the pool adds 1-2
    pool.held.update(hashes)
    assert p.match("a", tokens, 0) == 16  # every full block: token 16 is computed
    assert p.match("a", tokens[:16], 0) == 12  # 16 tokens: the last block holds the last one
    assert p.match("a", tokens, 16) == 0 and pool.num_lookups == 5  # nothing to ask


def test_a_hit_loads_into_the_blocks_vllm_allocated_then_new_full_blocks_are_saved() -> None:
    p, pool = planner()
    tokens = list(range(22))  # 5 full blocks and 2 tokens
    hashes = p.hasher.hash_blocks(tokens)
    pool.held.update(hashes[:3])
    assert p.match("a", tokens, 4) == 8  # vLLM holds block 0
    p.allocated("a", 8)
    plan = p.build([Scheduled("a", [7, 8, 9, 10, 11, 12], 12, 10, is_new=True)])
    (load,) = plan.loads
    assert load.block_ids == [8, 9] and load.block_hashes == hashes[1:3]
    assert load.token_ids == tokens[4:12]
    (save,) = plan.saves  # tokens 12..21 computed: blocks 3, 4 are full
    assert save.block_ids == [10, 11] and save.block_hashes == hashes[3:5]
    assert save.token_ids == tokens[12:20]
    assert p.build([Scheduled("a", [], 22, 1)]).saves == []  # a decode step: nothing new
    assert p.num_matched_tokens == 8


def test_chunked_prefill_saves_each_block_once_as_it_fills() -> None:
    p, _ = planner()
    tokens = list(range(13))
    hashes = p.hasher.hash_blocks(tokens)
    assert p.match("a", tokens, 0) == 0
    p.allocated("a", 0)
    first = p.build([Scheduled("a", [3, 4], 0, 6, is_new=True)])  # tokens 0..5
    assert first.loads == [] and [s.block_ids for s in first.saves] == [[3]]
    second = p.build([Scheduled("a", [5, 6], 6, 7)])  # tokens 6..12
    assert [s.block_ids for s in second.saves] == [[4, 5]]
    assert second.saves[0].block_hashes == hashes[1:3]


def test_a_resumed_request_takes_its_new_blocks_and_a_finished_one_is_forgotten() -> None:
    p, pool = planner()
    tokens = list(range(9))
    pool.held.update(p.hasher.hash_blocks(tokens))
    p.match("a", tokens, 0)
    p.allocated("a", 8)
    p.build([Scheduled("a", [1, 2, 3], 8, 1, is_new=True)])
    p.match("a", tokens, 0)  # preempted, then matched again
    p.allocated("a", 8)
    plan = p.build([Scheduled("a", [5, 6, 7], 8, 1, is_new=True)])
    assert [r.block_ids for r in plan.loads] == [[5, 6]] and plan.saves == []
    p.finished("a")
    assert p.num_requests == 0
    assert p.build([Scheduled("a", [9], 9, 1)]).loads == []  # unknown: nothing planned


def test_no_external_tokens_means_no_load() -> None:
    p, pool = planner()
    tokens = list(range(9))
    pool.held.update(p.hasher.hash_blocks(tokens))
    assert p.match("a", tokens, 0) == 8
    p.allocated("a", 0)  # vLLM took none (e.g. skip_reading_prefix_cache)
    plan = p.build([Scheduled("a", [1, 2, 3], 0, 9, is_new=True)])
    assert plan.loads == [] and [s.block_ids for s in plan.saves] == [[1, 2]]


@pytest.mark.parametrize("version", [*SUPPORTED_VLLM, f"{SUPPORTED_VLLM[0]}+cpu"])
def test_supported_versions_pass(version: str) -> None:
    check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.31.9", "0.33.0", "0.32.0rc1", "1.0"])
def test_other_versions_are_refused_naming_the_supported_ones(version: str) -> None:
    with pytest.raises(ConfigError) as e:
        check_vllm_version(version)
    assert version in str(e.value) and SUPPORTED_VLLM[0] in str(e.value)
    assert "scripts/vllm-venv" in str(e.value)


def test_a_computed_count_that_is_not_whole_blocks_gets_no_hit() -> None:
    """vLLM passes its hit in whole blocks; anything else is answered with 0, never a hit
    that would start mid-block."""
    p, pool = planner()
    tokens = list(range(17))
    pool.held.update(p.hasher.hash_blocks(tokens))
    assert p.match("a", tokens, 6) == 0 and pool.num_lookups == 0
