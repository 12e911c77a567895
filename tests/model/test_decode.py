"""Continuous batching: batching, preemption and admission never change a greedy output."""

from __future__ import annotations

from mooncake.model.decode import DecodeRunner
from mooncake.model.kvcache import PagedKVCache
from mooncake.model.prefill import PrefillRunner
from mooncake.model.sampler import SamplingParams
from mooncake.model.sequence import Sequence
from mooncake.model.tokenizer import ByteTokenizer
from tests.model.conftest import BLOCK, prompt

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
PROMPTS = [prompt(n, seed=n) for n in (3, 17, 9, 30, 1)]


def _decode(model, prompts, num_blocks=48, **kw) -> tuple[dict[int, list[int]], DecodeRunner]:
    cache = PagedKVCache.for_model(model, num_blocks, BLOCK)
    runner = DecodeRunner(model, cache, **kw)
    for i, p in enumerate(prompts):
        runner.add(Sequence(i, p, GREEDY))
    events = runner.run_until_done()
    cache.allocator.check_integrity()
    assert cache.allocator.num_free == num_blocks, "every block comes back"
    return {i: [e.token_id for e in es] for i, es in events.items()}, runner


def test_greedy_decode_of_a_batch_equals_each_request_alone(tiny):
    batched, _ = _decode(tiny, PROMPTS, max_batch=8)
    for i, p in enumerate(PROMPTS):
        alone, _ = _decode(tiny, [p], max_batch=1)
        assert batched[i] == alone[0], f"request {i}"
        assert len(batched[i]) == GREEDY.max_tokens


def test_prompts_admitted_together_are_prefilled_in_shared_forwards(tiny):
    """Five prompts (55 tokens of KV to fill: token_ids[:-1] of 3, 17, 9, 30 and 1) in
    forwards of at most 16 tokens, split and mixed: the outputs equal each alone."""
    forwards: list[list[int]] = []
    cache = PagedKVCache.for_model(tiny, 48, BLOCK)
    runner = DecodeRunner(tiny, cache, max_batch=8, chunk_tokens=16)
    run = runner._prefill_pieces

    def spy(pieces):  # type: ignore[no-untyped-def]
        forwards.append([end - start for _, start, end in pieces])
        run(pieces)

    runner._prefill_pieces = spy  # type: ignore[method-assign]
    for i, p in enumerate(PROMPTS):
        runner.add(Sequence(i, p, GREEDY))
    got = {i: [e.token_id for e in es] for i, es in runner.run_until_done().items()}
    assert forwards == [[2, 14], [2, 8, 6], [16], [7]]
    for i, p in enumerate(PROMPTS):
        assert got[i] == _decode(tiny, [p], max_batch=1)[0][0], f"request {i}"


def test_preemption_when_the_cache_runs_out_keeps_outputs_exact(tiny):
    """With too few blocks for all requests' growth, the newest are preempted and
    recomputed later; outputs still equal the unconstrained run."""
    expected, _ = _decode(tiny, PROMPTS, max_batch=8)
    got, runner = _decode(tiny, PROMPTS, num_blocks=7, max_batch=8)
    assert runner.num_preemptions > 0
    assert got == expected


def test_admission_respects_max_batch_and_the_predicted_step_time(tiny):
    cache = PagedKVCache.for_model(tiny, 48, BLOCK)
    runner = DecodeRunner(
        tiny, cache, max_batch=3, max_step_time_s=1.0, step_time_fn=lambda b, ctx: 0.1 * ctx / 20
    )
    for i, p in enumerate(PROMPTS[:4]):  # lengths 3, 17, 9, 30
        runner.add(Sequence(i, p, GREEDY))
    runner.step()
    # 3 + 17 = 20 tokens -> 0.1 s; + 9 -> 0.145 s: all under 1 s but max_batch stops at 3
    assert [s.seq_id for s in runner.running] == [0, 1, 2]
    slow = DecodeRunner(
        tiny, cache, max_batch=8, max_step_time_s=0.12, step_time_fn=lambda b, ctx: 0.1 * ctx / 20
    )
    for i, p in enumerate(PROMPTS[:4]):
        slow.add(Sequence(10 + i, p, GREEDY))
    slow.step()
    assert [s.seq_id for s in slow.running] == [10, 11]  # a third would predict 0.145 s


def test_a_request_prefilled_elsewhere_joins_with_its_kv(tiny):
    """KV handed over in cache blocks (as from a prefill node) plus the first token
    continues exactly like a request decoded from scratch."""
    expected = _decode(tiny, [PROMPTS[3]])[0][0]
    cache = PagedKVCache.for_model(tiny, 48, BLOCK)
    pre = PrefillRunner(tiny, cache).prefill(PROMPTS[3])
    assert pre.logits is not None
    first = int(pre.logits.argmax())
    runner = DecodeRunner(tiny, cache)
    runner.add(
        Sequence(
            0,
            PROMPTS[3],
            GREEDY,
            output_ids=[first],
            block_ids=pre.block_ids,
            num_cached_tokens=len(PROMPTS[3]),
        )
    )
    rest = [e.token_id for e in runner.run_until_done()[0]]
    assert [first, *rest] == expected


def test_stop_strings_stop_tokens_and_abort():
    tok = ByteTokenizer()
    seq = Sequence(1, [1], SamplingParams(stop=("lo w",), max_tokens=50), tokenizer=tok)
    texts = [seq.append(t).text for t in b"hello world"[:7]]
    assert "".join(texts) == "hel" and seq.finish_reason == "stop"  # "lo w" never streamed
    seq = Sequence(2, [1], SamplingParams(max_tokens=50), eos_token_ids=[257], tokenizer=tok)
    assert seq.append(ord("a")).text == "a"
    event = seq.append(257)
    assert (event.text, event.finish_reason) == ("", "stop")
    seq = Sequence(3, [1], SamplingParams(max_tokens=2, ignore_eos=True), eos_token_ids=[257])
    seq.append(257)
    assert seq.append(5).finish_reason == "length"
    utf8 = Sequence(4, [1], SamplingParams(max_tokens=9), tokenizer=tok)
    assert [utf8.append(b).text for b in "é!".encode()] == ["", "é", "!"]


def test_abort_frees_the_blocks(tiny):
    cache = PagedKVCache.for_model(tiny, 48, BLOCK)
    runner = DecodeRunner(tiny, cache)
    runner.add(Sequence(7, PROMPTS[3], GREEDY))
    runner.step()
    (event,) = runner.abort(7)
    assert event.finish_reason == "abort" and not event.more_choices
    assert cache.allocator.num_free == 48 and not runner.has_work
    assert runner.abort(7) == []
