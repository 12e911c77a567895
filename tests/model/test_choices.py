"""Several choices of one request (SamplingParams.n) in the decode runner: the prompt's KV
is computed once, its full blocks shared and its partly filled last block copied (or, under
tensor parallelism, recomputed), each choice draws the tokens a single request seeded with
seed + index would, an abort ends every choice, and every block comes back."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from mooncake.model.decode import DecodeRunner
from mooncake.model.kvcache import PagedKVCache
from mooncake.model.prefill import PrefillRunner
from mooncake.model.prefixcache import PrefixCache
from mooncake.model.sampler import SamplingParams
from mooncake.model.sequence import Sequence
from tests.model.conftest import BLOCK, prompt

EOS = 257


def _runner(model, num_blocks: int = 64, prefix: bool = False) -> DecodeRunner:
    cache = PagedKVCache.for_model(model, num_blocks, BLOCK)
    pc = PrefixCache(cache) if prefix else None
    return DecodeRunner(model, cache, max_batch=16, prefix_cache=pc)


@contextlib.contextmanager
def _as_tensor_parallel(model, is_on: bool) -> Iterator[None]:
    """While on, the model announces its forwards (as rank 0 of a tensor-parallel group
    does, to nobody here): the runner cannot copy blocks and recomputes instead."""
    if is_on:
        model.on_step = lambda kind, step: None
    try:
        yield
    finally:
        model.on_step = None


def _check_all_free(runner: DecodeRunner) -> None:
    if runner.prefix_cache is not None:
        runner.prefix_cache.check_integrity()
        assert runner.prefix_cache.num_free == runner.cache.num_blocks
    else:
        runner.cache.allocator.check_integrity()
        assert runner.cache.allocator.num_free == runner.cache.num_blocks


def _by_choice(events) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for e in events:
        if e.token_id is not None:
            out.setdefault(e.index, []).append(e.token_id)
    return out


@pytest.mark.parametrize("is_tp", [False, True])
@pytest.mark.parametrize("prefix", [False, True])
@pytest.mark.parametrize("prompt_len", [5, 12, 17])  # within a block, past one, on a boundary
def test_n_choices_share_one_prefill_and_each_is_its_seed_plus_index(
    tiny, prefix, prompt_len, is_tp
):
    params = SamplingParams(max_tokens=10, temperature=1.2, seed=41, n=3, ignore_eos=True)
    ids = prompt(prompt_len, seed=prompt_len, vocab=256)
    runner = _runner(tiny, prefix=prefix)
    runner.add(Sequence(7, ids, params, eos_token_ids=(EOS,)))
    with _as_tensor_parallel(tiny, is_tp):
        events = runner.run_until_done()[7]
    tokens = _by_choice(events)
    assert sorted(tokens) == [0, 1, 2] and all(len(t) == 10 for t in tokens.values())
    assert len({tuple(t) for t in tokens.values()}) == 3  # distinct draws
    finishes = [e for e in events if e.finish_reason is not None]
    assert sorted(e.index for e in finishes) == [0, 1, 2]
    assert [e.more_choices for e in finishes] == [True, True, False]
    assert events[-1] is finishes[-1]
    # the prompt once; its last, partly filled block copied, or recomputed by each other
    # choice under tensor parallelism
    tail = (prompt_len - 1) % BLOCK
    assert runner.num_prefill_tokens == prompt_len - 1 + (2 * tail if is_tp else 0)
    _check_all_free(runner)
    for index in range(3):  # choice i is what the request seeded 41 + i draws alone
        alone = _runner(tiny)
        single = SamplingParams(max_tokens=10, temperature=1.2, seed=41 + index, ignore_eos=True)
        alone.add(Sequence(1, ids, single, eos_token_ids=(EOS,)))
        assert _by_choice(alone.run_until_done()[1])[0] == tokens[index], index


@pytest.mark.parametrize("is_tp", [False, True])
def test_choices_of_a_submitted_request_fork_from_kv_written_elsewhere(tiny, is_tp):
    """As on a decode node: the prompt's KV arrives in reserved blocks; nothing is
    prefilled here (under tensor parallelism: the other choices' last partial block)."""
    ids = prompt(20, seed=3, vocab=256)
    ref = _runner(tiny)
    p1 = SamplingParams(max_tokens=6, temperature=0, n=1, ignore_eos=True)
    ref.add(Sequence(1, ids, p1))
    expected = _by_choice(ref.run_until_done()[1])[0]
    runner = _runner(tiny)
    result = PrefillRunner(tiny, runner.cache, chunk_tokens=64).prefill(ids[:-1])
    blocks = result.block_ids + runner.cache.allocator.allocate(
        runner.cache.blocks_for(len(ids)) - len(result.block_ids)
    )
    greedy = SamplingParams(max_tokens=6, temperature=0, n=4, ignore_eos=True)
    runner.add(Sequence(2, ids, greedy, block_ids=blocks, num_cached_tokens=len(ids) - 1))
    with _as_tensor_parallel(tiny, is_tp):
        tokens = _by_choice(runner.run_until_done()[2])
    assert tokens == {i: expected for i in range(4)}  # greedy: every choice alike
    assert runner.num_prefill_tokens == (3 * ((len(ids) - 1) % BLOCK) if is_tp else 0)
    _check_all_free(runner)


def test_an_abort_ends_every_choice_and_frees_their_blocks(tiny):
    runner = _runner(tiny)
    params = SamplingParams(max_tokens=50, n=3, ignore_eos=True)
    runner.add(Sequence(5, prompt(19, vocab=256), params))
    runner.step()
    runner.step()
    assert len(runner.running) == 3
    events = runner.abort(5)
    assert sorted(e.index for e in events) == [0, 1, 2]
    assert all(e.finish_reason == "abort" for e in events)
    assert [e.more_choices for e in events] == [True, True, False]
    assert not runner.has_work and runner.abort(5) == []
    _check_all_free(runner)


def test_choices_preempted_and_recomputed_draw_the_same_tokens(tiny):
    params = SamplingParams(max_tokens=24, temperature=1.1, seed=5, n=4, ignore_eos=True)
    ids = prompt(13, seed=9, vocab=256)
    roomy = _runner(tiny)
    roomy.add(Sequence(3, ids, params))
    expected = _by_choice(roomy.run_until_done()[3])
    tight = _runner(tiny, num_blocks=12)
    tight.add(Sequence(3, ids, params))
    events = tight.run_until_done()[3]
    assert tight.num_preemptions > 0
    assert _by_choice(events) == expected
    assert [e.more_choices for e in events if e.finish_reason] == [True, True, True, False]
    _check_all_free(tight)


def test_copied_blocks_hold_the_source_blocks_kv_in_every_layer(tiny):
    cache = PagedKVCache.for_model(tiny, 8, BLOCK)
    for t in [*cache.k, *cache.v]:
        t.normal_()
    cache.copy_blocks([2, 2, 5], [0, 7, 3])
    for t in [*cache.k, *cache.v]:
        assert t[0].equal(t[2]) and t[7].equal(t[2]) and t[3].equal(t[5])
        assert not t[1].equal(t[2])


def test_block_sharing_frees_a_block_at_its_last_holder():
    cache = PagedKVCache(4, BLOCK, 1, 4, (0, 1))
    a = cache.allocator
    ids = a.allocate(2)
    a.share(ids)
    a.share(ids[:1])
    a.free(ids)
    assert a.num_free == 2
    a.free(ids)
    assert a.num_free == 3
    a.check_integrity()
    a.free(ids[:1])
    assert a.num_free == 4
    a.check_integrity()
