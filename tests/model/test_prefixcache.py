"""Instance-local prefix caching: reused blocks give the same greedy tokens, unheld cached
blocks are evicted oldest first when the cache needs room, and no block is ever lost."""

from __future__ import annotations

from mooncake.model.decode import DecodeRunner
from mooncake.model.kvcache import PagedKVCache
from mooncake.model.prefixcache import PrefixCache
from mooncake.model.sampler import SamplingParams
from mooncake.model.sequence import Sequence
from tests.model.conftest import BLOCK, prompt

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def _runner(model, num_blocks: int, cached: bool) -> tuple[DecodeRunner, PrefixCache | None]:
    cache = PagedKVCache.for_model(model, num_blocks, BLOCK)
    pc = PrefixCache(cache) if cached else None
    return DecodeRunner(model, cache, max_batch=8, prefix_cache=pc), pc


def _run(runner: DecodeRunner, seq_id: int, ids: list[int]) -> tuple[list[int], Sequence]:
    seq = Sequence(seq_id, ids, GREEDY)
    runner.add(seq)
    events = runner.run_until_done()[seq_id]
    return [e.token_id for e in events], seq


def test_a_shared_prefix_is_reused_and_gives_the_same_greedy_tokens(tiny):
    base = prompt(5 * BLOCK + 3, seed=1)
    longer = [*base, *prompt(11, seed=2)]
    plain, _ = _runner(tiny, 48, cached=False)
    runner, pc = _runner(tiny, 48, cached=True)
    assert pc is not None
    first, seq = _run(runner, 0, base)
    assert seq.num_reused_tokens == 0
    assert first == _run(plain, 0, base)[0]
    again, seq = _run(runner, 1, base)  # the same prompt: every full block but the last token's
    assert seq.num_reused_tokens == 5 * BLOCK
    assert again == first
    got, seq = _run(runner, 2, longer)  # prompt and output blocks of request 0 are cached
    assert seq.num_reused_tokens >= 5 * BLOCK
    assert got == _run(plain, 1, longer)[0]
    pc.check_integrity()
    assert pc.num_free == 48, "every block comes back, free or evictable"


def test_least_recently_used_unheld_blocks_are_evicted_for_room(tiny):
    runner, pc = _runner(tiny, 12, cached=True)
    assert pc is not None
    a, b = prompt(4 * BLOCK + 1, seed=3), prompt(4 * BLOCK + 1, seed=4)
    _run(runner, 0, a)
    _run(runner, 1, b)  # a's blocks are the oldest evictable ones
    _run(runner, 2, b)
    assert pc.num_cached_blocks > 0
    _, seq = _run(runner, 3, prompt(7 * BLOCK, seed=5))  # 8 blocks: 4 free, then a's 4
    assert seq.num_reused_tokens == 0
    pc.check_integrity()
    _, seq = _run(runner, 4, b)
    assert seq.num_reused_tokens == 4 * BLOCK, "b was used more recently: its prefix survives"
    _, seq = _run(runner, 5, a)
    assert seq.num_reused_tokens == 0, "a was evicted"
    pc.check_integrity()


def test_requests_sharing_blocks_in_one_batch_and_under_preemption_stay_exact(tiny):
    shared = prompt(3 * BLOCK, seed=6)
    prompts = [[*shared, *prompt(n, seed=n)] for n in (1, 5, 9, 2)]
    plain, _ = _runner(tiny, 48, cached=False)
    expected = {}
    for i, p in enumerate(prompts):
        expected[i] = _run(plain, i, p)[0]
    runner, pc = _runner(tiny, 9, cached=True)  # too few blocks: preemption
    assert pc is not None
    _run(runner, 99, shared + [1])  # warm the cache
    for i, p in enumerate(prompts):
        runner.add(Sequence(i, p, GREEDY))
    got = {i: [e.token_id for e in es] for i, es in runner.run_until_done().items()}
    assert got == expected
    pc.check_integrity()
    assert pc.num_free == 9


def test_a_request_admitted_beside_another_shares_its_prompt_blocks_at_once(tiny):
    shared = prompt(4 * BLOCK, seed=7)
    a, b = [*shared, 1, 2], [*shared, 3]
    runner, pc = _runner(tiny, 48, cached=True)
    assert pc is not None
    seqs = [Sequence(0, a, GREEDY), Sequence(1, b, GREEDY)]
    for seq in seqs:
        runner.add(seq)
    got = {i: [e.token_id for e in es] for i, es in runner.run_until_done().items()}
    assert [s.num_reused_tokens for s in seqs] == [0, 4 * BLOCK]  # in the same step
    plain, _ = _runner(tiny, 48, cached=False)
    assert got == {0: _run(plain, 0, a)[0], 1: _run(plain, 1, b)[0]}
    pc.check_integrity()
