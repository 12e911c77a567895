"""logit_bias and min_tokens in the batched sampler: on random batches of greedy and
sampled rows the batched result is exactly a per-request reference's (vLLM's order:
min_tokens mask, bias, penalties, then greedy or the draw), the ops run only when a row
uses them and never wait for the device, and the decode loop stops no earlier than
min_tokens."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from mooncake.model.decode import DecodeRunner
from mooncake.model.kvcache import PagedKVCache
from mooncake.model.sampler import SamplingBatch, SamplingParams, _adjust, sample
from mooncake.model.sequence import Sequence as Seq
from mooncake.model.tokenizer import ByteTokenizer
from tests.model.conftest import BLOCK, prompt
from tests.model.test_sampler import SYNCING_OPS, _HostReads, _Ops

VOCAB = 40
EOS = (3, 17)


def _random_params(rng: random.Random) -> SamplingParams:
    is_greedy = rng.random() < 0.4
    bias = ()
    if rng.random() < 0.6:
        ids = rng.sample(range(VOCAB + 5), rng.randint(1, 8))  # a few past the vocabulary
        bias = tuple((t, rng.choice([-100.0, 100.0, rng.uniform(-100, 100)])) for t in ids)
    return SamplingParams(
        max_tokens=64,
        temperature=0.0 if is_greedy else rng.choice([0.3, 1.0, 2.5]),
        top_k=rng.choice([0, 0, 5]),
        top_p=rng.choice([1.0, 0.8]),
        min_p=rng.choice([0.0, 0.05]),
        presence_penalty=rng.choice([0.0, 0.0, 1.5]),
        frequency_penalty=rng.choice([0.0, -0.5]),
        repetition_penalty=rng.choice([1.0, 1.0, 1.3]),
        stop_token_ids=tuple(rng.sample(range(VOCAB), rng.randint(0, 3))),
        ignore_eos=rng.random() < 0.2,
        logit_bias=bias,
        min_tokens=rng.choice([0, 0, 3, 10]),
        seed=rng.randrange(2**63),
        logprobs=rng.choice([None, 2]),
    )


def _reference_logits(row: torch.Tensor, seq: Seq) -> torch.Tensor:
    """One request's adjusted logits, token by token in float32 (vLLM's order)."""
    p, x = seq.params, row.clone()
    is_under_min = len(seq.output_ids) < p.min_tokens
    for token, bias in p.logit_bias:
        if token < VOCAB:
            x[token] = x[token] + torch.tensor(bias, dtype=torch.float32)
    r = torch.tensor(p.repetition_penalty, dtype=torch.float32)
    for token in set(seq.token_ids):
        if p.repetition_penalty != 1:
            x[token] = x[token] / r if x[token] > 0 else x[token] * r
    counts = torch.zeros(VOCAB)
    for token, n in Counter(seq.output_ids).items():
        counts[token] = n
    f = torch.tensor(p.frequency_penalty, dtype=torch.float32)
    pres = torch.tensor(p.presence_penalty, dtype=torch.float32)
    x = x - f * counts - pres * (counts > 0)
    if is_under_min:  # the stop tokens: EOS unless ignore_eos, and stop_token_ids
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(EOS))
        for token in stops:
            x[token] = float("-inf")
    return x


def _neutral(p: SamplingParams) -> SamplingParams:
    """`p`'s draw settings without what the reference applied by hand."""
    return SamplingParams(
        max_tokens=p.max_tokens,
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p,
        min_p=p.min_p,
        seed=p.seed,
    )


@pytest.mark.parametrize("case", range(40))
def test_batched_bias_and_min_tokens_equal_a_per_request_reference(case):
    """A random batch (greedy and sampled rows, biases, min_tokens under and past their
    bound, penalties): the batched adjusted logits equal the reference's bit for bit, and
    each row's token is what the reference's logits give alone (same seed and position)."""
    rng = random.Random(case)
    num_rows = rng.randint(1, 12)
    seqs = []
    for i in range(num_rows):
        p = _random_params(rng)
        prompt_ids = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 6))]
        output_ids = [rng.randrange(VOCAB) for _ in range(rng.randint(0, 12))]
        seqs.append(Seq(i, prompt_ids, p, eos_token_ids=EOS, output_ids=output_ids))
    logits = torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(case)) * 3
    batch = SamplingBatch.build(
        [s.params for s in seqs],
        [s.seed for s in seqs],
        [len(s.token_ids) for s in seqs],
        [s.token_ids for s in seqs],
        [s.prompt_len for s in seqs],
        "cpu",
        min_tokens_stops=[s.min_tokens_stops for s in seqs],
    )
    got = sample(logits, batch).to_host()
    adjusted = _adjust(logits, batch)
    raw_logp = logits.log_softmax(-1)
    for i, s in enumerate(seqs):
        expected = _reference_logits(logits[i], s)
        assert torch.equal(adjusted[i], expected), (case, i)
        alone = SamplingBatch.build(
            [_neutral(s.params)], [s.seed], [len(s.token_ids)], None, None, "cpu"
        )
        # NOTE: alone, a -inf would make the row "broken" (it takes its top token); a huge
        # negative logit is never drawn either and drops out of every softmax the same
        token = sample(expected.clamp(min=-1e30)[None], alone).to_host().token_ids[0]
        assert got.token_ids[i] == token, (case, i, s.params)
        if len(s.output_ids) < s.params.min_tokens:
            assert token not in s.stop_token_ids
        if s.params.logprobs is not None:  # still the raw model's
            assert got.logprobs[i] == pytest.approx(float(raw_logp[i, token]))


def test_bias_forces_and_bans_tokens_and_other_rows_are_untouched():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.9, -1.0]]).expand(3, 5)
    params = [
        SamplingParams(temperature=0, logit_bias=((4, 100.0),)),
        SamplingParams(logit_bias=((1, -100.0), (3, -100.0), (99, 50.0))),
        SamplingParams(temperature=0),
    ]
    seeds, positions = [0, 1, 2], [0, 0, 0]
    for pos in range(30):
        positions = [pos] * 3
        batch = SamplingBatch.build(params, seeds, positions, None, None, "cpu")
        out = sample(logits, batch).to_host()
        assert out.token_ids[0] == 4 and out.token_ids[1] not in (1, 3), out.token_ids
        assert out.token_ids[2] == 1
    assert torch.equal(_adjust(logits, batch)[2], logits[2])  # bit for bit


def test_ops_run_only_for_rows_that_use_them_and_never_read_the_host(monkeypatch):
    """A batch with neither bias nor min_tokens runs no scatter; with them the ops do not
    depend on the batch size, and nothing reads a device value on the host."""
    plain = [SamplingParams(temperature=0.7, seed=i) for i in range(4)]
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0))
    with _Ops() as ops:
        sample(logits, SamplingBatch.build(plain, range(4), [5] * 4, None, None, "cpu"))
    assert not {"scatter_add", "scatter_add_", "masked_fill"} & set(ops.names), ops.names
    names = []
    for num_rows in (2, 8):
        params = [
            SamplingParams(temperature=0 if i % 2 else 0.9, logit_bias=((i, 5.0),), min_tokens=4)
            for i in range(num_rows)
        ]
        seqs = [Seq(i, [1, 2], p, eos_token_ids=EOS) for i, p in enumerate(params)]
        rows = torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(1))
        batch = SamplingBatch.build(
            params,
            [s.seed for s in seqs],
            [2] * num_rows,
            None,
            None,
            "cpu",
            min_tokens_stops=[s.min_tokens_stops for s in seqs],
        )
        reads = _HostReads(monkeypatch)
        with _Ops() as ops:
            sample(rows, batch)
        assert not reads.counts, reads.counts
        monkeypatch.undo()
        assert not [n for n in ops.names if n in SYNCING_OPS], ops.names
        assert ops.names.count("scatter_add") == 1, ops.names  # the bias
        assert ops.names.count("scatter_add_") == 1, ops.names  # the mask
        names.append(ops.names)
    assert names[0] == names[1]


def test_min_tokens_masks_eos_and_stop_ids_until_reached_then_eos_may_end(tiny):
    """dummy:tiny, EOS forced by a +100 bias: the output is exactly min_tokens tokens that
    are no stop token, then EOS (finish_reason stop); a stop token id is masked as well."""
    eos = 257
    cache = PagedKVCache.for_model(tiny, 32, BLOCK)
    runner = DecodeRunner(tiny, cache, max_batch=4)
    cases = {
        0: SamplingParams(max_tokens=20, temperature=0, logit_bias=((eos, 100.0),), min_tokens=5),
        1: SamplingParams(max_tokens=20, logit_bias=((eos, 100.0), (9, 90.0)), min_tokens=7),
        2: SamplingParams(
            max_tokens=20,
            temperature=0,
            logit_bias=((9, 100.0),),
            stop_token_ids=(9,),
            min_tokens=3,
        ),
        3: SamplingParams(max_tokens=20, temperature=0, logit_bias=((eos, 100.0),)),
    }
    for i, p in cases.items():
        runner.add(Seq(i, prompt(6, seed=i, vocab=256), p, eos_token_ids=(eos,)))
    events = runner.run_until_done()
    cache.allocator.check_integrity()
    tokens = {i: [e.token_id for e in es] for i, es in events.items()}
    assert tokens[0][-1] == eos and len(tokens[0]) == 6 and eos not in tokens[0][:-1]
    assert tokens[1][-1] == eos and len(tokens[1]) == 8 and set(tokens[1][:-1]) == {9}
    assert tokens[2][-1] == 9 and len(tokens[2]) == 4 and 9 not in tokens[2][:-1]
    assert tokens[3] == [eos]
    assert all(es[-1].finish_reason == "stop" for es in events.values())


def test_stop_strings_count_only_past_min_tokens():
    """vLLM's detokenizer looks for stop strings once the output is past min_tokens."""
    tok = ByteTokenizer()
    text = "ab.cd.ef"
    ids = tok.encode(text, add_special_tokens=False)
    for min_tokens, expected in ((0, "ab"), (2, "ab"), (3, "ab.cd"), (6, "ab.cd.ef")):
        seq = Seq(
            0,
            [1],
            SamplingParams(stop=(".",), min_tokens=min_tokens, max_tokens=20),
            tokenizer=tok,
        )
        out = ""
        for t in ids:
            out += seq.append(t).text
            if seq.is_finished:
                break
        assert out == expected, (min_tokens, out)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_bias_and_min_tokens_never_synchronise_and_match_the_cpu():
    """CUDA's own sync check over build and sample of a random batch with biases and
    min_tokens masks; its greedy rows take what the CPU's take."""
    rng = random.Random(7)
    seqs = [
        Seq(i, [1, 2, 3], _random_params(rng), eos_token_ids=EOS, output_ids=[4] * (i % 5))
        for i in range(32)
    ]
    logits = torch.randn(32, VOCAB, generator=torch.Generator().manual_seed(7))

    def build(device: str) -> SamplingBatch:
        return SamplingBatch.build(
            [s.params for s in seqs],
            [s.seed for s in seqs],
            [len(s.token_ids) for s in seqs],
            [s.token_ids for s in seqs],
            [s.prompt_len for s in seqs],
            device,
            min_tokens_stops=[s.min_tokens_stops for s in seqs],
        )

    on_gpu = logits.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        sampled = sample(on_gpu, build("cuda"))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    out = sampled.to_host()
    expected = sample(logits, build("cpu")).to_host()
    greedy = [i for i, s in enumerate(seqs) if s.params.is_greedy]
    assert greedy and [out.token_ids[i] for i in greedy] == [expected.token_ids[i] for i in greedy]
