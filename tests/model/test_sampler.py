"""Sampling: truncation keeps what it should, draws follow the distribution, a seed
reproduces its tokens in any batch, penalties are OpenAI's and vLLM's, logprobs are the
model's, and a step's sampling runs on the device without waiting for it."""

from __future__ import annotations

import math
import re
import statistics
from collections import Counter
from collections.abc import Sequence

import msgspec
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mooncake.errors import ApiError, ProtocolError
from mooncake.model.decode import DecodeRunner
from mooncake.model.kvcache import PagedKVCache
from mooncake.model.params import Guided, InvalidSamplingParams
from mooncake.model.sampler import (
    SampleOutput,
    SamplingBatch,
    SamplingParams,
    _penalize,
    sample,
)
from mooncake.model.sequence import Sequence as Seq
from mooncake.rpc.wire import HEAD, KIND_REQUEST, VERSION, Msg, decode_frame, msg_type
from tests.model.conftest import BLOCK, prompt

LOGITS = torch.tensor([[0.0, 3.0, 1.0, 2.9, -1.0]])


def _build(
    params: Sequence[SamplingParams],
    seeds: Sequence[int] | None = None,
    positions: Sequence[int] | None = None,
    history: Sequence[Sequence[int]] | None = None,
    prompt_lens: Sequence[int] | None = None,
) -> SamplingBatch:
    seeds = [0] * len(params) if seeds is None else seeds
    positions = [0] * len(params) if positions is None else positions
    return SamplingBatch.build(params, seeds, positions, history, prompt_lens, "cpu")


def _sample(logits: torch.Tensor, params: Sequence[SamplingParams], **kw) -> SampleOutput:
    return sample(logits, _build(params, **kw)).to_host()


def _draws_list(
    params: SamplingParams, n: int, logits: torch.Tensor = LOGITS, seed: int = 0
) -> list[int]:
    """`n` draws of one seeded request, one per position (the rows of one batch)."""
    rows = logits.expand(n, logits.shape[1])
    return _sample(rows, [params] * n, seeds=[seed] * n, positions=range(n)).token_ids


def _draws(params: SamplingParams, n: int, logits: torch.Tensor = LOGITS, seed: int = 0) -> Counter:
    return Counter(_draws_list(params, n, logits, seed))


def test_greedy_is_the_first_argmax_and_truncation_keeps_only_the_allowed_tokens():
    assert _sample(LOGITS, [SamplingParams(temperature=0)]).token_ids == [1]
    tie = torch.tensor([[1.0, 4.0, 4.0, 0.0]])
    assert _sample(tie, [SamplingParams(temperature=0)]).token_ids == [1]
    assert set(_draws(SamplingParams(top_k=1), 200)) == {1}
    assert set(_draws(SamplingParams(top_k=2, temperature=5), 200)) == {1, 3}
    assert set(_draws(SamplingParams(top_p=0.01), 200)) == {1}  # the top token always stays
    assert set(_draws(SamplingParams(top_p=0.6), 200)) == {1, 3}  # p(1) ~ 0.47
    # p / p_top: 1, 0.9 (token 3), 0.135 (token 2), 0.05, 0.018
    assert set(_draws(SamplingParams(min_p=0.5), 200)) == {1, 3}
    assert set(_draws(SamplingParams(min_p=0.1), 400)) == {1, 3, 2}
    assert set(_draws(SamplingParams(min_p=1.0), 200)) == {1}
    assert set(_draws(SamplingParams(temperature=100), 400)) == {0, 1, 2, 3, 4}


def test_min_p_and_top_k_combine_and_top_p_truncates_what_they_left():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -2.0, -3.0]])
    # p = 0.634, 0.233, 0.086, 0.032, 0.012, 0.004; p / p_top = 1, 0.37, 0.14, 0.05, ...
    assert set(_draws(SamplingParams(top_k=4, min_p=0.1), 2000, logits)) == {0, 1, 2}
    assert set(_draws(SamplingParams(top_k=2, min_p=0.1), 2000, logits)) == {0, 1}
    # tokens 0, 1, 2 renormalised: 0.665, 0.245, 0.090; token 0 alone reaches 0.65 there,
    # not in the whole distribution
    assert set(_draws(SamplingParams(top_p=0.65), 2000, logits)) == {0, 1}
    assert set(_draws(SamplingParams(top_k=3, top_p=0.65), 2000, logits)) == {0}
    assert set(_draws(SamplingParams(min_p=0.1, top_p=0.65), 2000, logits)) == {0}
    assert set(_draws(SamplingParams(top_k=3, top_p=0.7), 2000, logits)) == {0, 1}


# -- the draws follow the distribution: chi-square goodness of fit ----------------------

ALPHA = 1e-3  # each test wrongly fails once in a thousand seeds; the seeds here are fixed


def _chi2_critical(dof: int, alpha: float = ALPHA) -> float:
    """The (1 - alpha) quantile of chi-square with `dof` degrees of freedom, by Wilson and
    Hilferty's approximation (within 1% for dof >= 3; e.g. 16.27 for dof 3 at 1e-3)."""
    z = statistics.NormalDist().inv_cdf(1 - alpha)
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def _assert_fits(counts: Counter, expected: torch.Tensor, n: int) -> None:
    """`counts` of `n` draws fit the probabilities `expected` (V,): no draw outside its
    support, and Pearson's statistic below the critical value."""
    support = {i for i, q in enumerate(expected.tolist()) if q > 0}
    assert set(counts) <= support, (sorted(counts), sorted(support))
    exp = [n * q for q in expected.tolist() if q > 0]
    assert min(exp) >= 5, "too few draws for the chi-square test"
    obs = [counts[i] for i in sorted(support)]
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp, strict=True))
    assert stat < _chi2_critical(len(exp) - 1), (stat, obs, exp)


FIT = torch.tensor([[1.2, 0.3, -0.4, 2.0, 0.9, -1.5, 0.0, 1.7]])  # (1, 8)
N_FIT = 40_000


def _truncated(probs: torch.Tensor, keep: list[int]) -> torch.Tensor:
    mask = torch.zeros_like(probs, dtype=torch.bool)
    mask[keep] = True
    kept = probs.masked_fill(~mask, 0.0)
    return kept / kept.sum()


@pytest.mark.parametrize(
    ("params", "keep"),
    [
        (SamplingParams(), list(range(8))),
        (SamplingParams(temperature=0.7), list(range(8))),
        (SamplingParams(temperature=1.6), list(range(8))),
        (SamplingParams(top_k=3), [3, 7, 0]),
        # by probability: 3 (0.33), 7 (0.24), 0 (0.16), 4 (0.12); 0.8 needs all four
        (SamplingParams(top_p=0.8), [3, 7, 0, 4]),
        (SamplingParams(top_k=5, top_p=0.7, temperature=0.9), [3, 7, 0]),
        (SamplingParams(min_p=0.3), [3, 7, 0, 4]),  # 1.2 - 2.0 >= log 0.3 = -1.2
    ],
)
def test_draws_at_many_positions_of_one_seed_fit_the_truncated_distribution(params, keep):
    probs = (FIT[0] / params.temperature).softmax(-1)
    if params.top_p < 1:  # the smallest set by probability whose mass reaches top_p
        top_k = params.top_k or 8
        order = probs.argsort(descending=True)[:top_k]
        mass = probs[order] / probs[order].sum()
        num = int((mass.cumsum(-1) - mass < params.top_p).sum())
        assert sorted(order[:num].tolist()) == sorted(keep)
    _assert_fits(_draws(params, N_FIT, FIT, seed=12345), _truncated(probs, keep), N_FIT)


def test_draws_of_many_seeds_at_one_position_fit_the_distribution():
    n = N_FIT
    rows = FIT.expand(n, 8)
    seeds = [(i * 0x9E3779B97F4A7C15) % 2**64 - 2**63 for i in range(n)]  # negative ones too
    out = _sample(rows, [SamplingParams()] * n, seeds=seeds, positions=[17] * n)
    _assert_fits(Counter(out.token_ids), FIT[0].softmax(-1), n)


def test_consecutive_positions_of_a_seed_are_independent():
    """Pairs (token at position 2i, token at 2i + 1) of a uniform 4-way draw fit the
    uniform distribution over the 16 pairs."""
    n = 2 * N_FIT
    out = _draws_list(SamplingParams(), n, torch.zeros(1, 4), seed=99)
    pairs = Counter(4 * a + b for a, b in zip(out[::2], out[1::2], strict=True))
    _assert_fits(pairs, torch.full((16,), 1 / 16), n // 2)


# -- seeds ------------------------------------------------------------------------------


def test_a_seed_draws_the_same_tokens_at_any_row_of_any_batch():
    params = SamplingParams(seed=42, temperature=1.5)
    logits = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    others = [
        SamplingParams(temperature=0),
        SamplingParams(top_k=5),
        SamplingParams(top_p=0.5, min_p=0.1),
        SamplingParams(presence_penalty=1.0, repetition_penalty=1.3, logprobs=3),
        SamplingParams(seed=7),
        SamplingParams(temperature=0.2),
        SamplingParams(seed=42, temperature=0.5),  # the same seed, other params
    ]
    history = [[1, 2, 3, 4]] * 8
    for pos in (0, 5, 1000):
        alone = _sample(logits[3:4], [params], seeds=[42], positions=[pos]).token_ids[0]
        for row in (0, 3, 7):
            batch = [*others]
            batch.insert(row, params)
            rows = logits[3:4].expand(8, 64).clone()
            rows[[i for i in range(8) if i != row]] = logits[1:8]
            seeds = [p.seed if p.seed is not None else 1000 + i for i, p in enumerate(batch)]
            positions = [pos if i == row else 3 * i for i in range(8)]
            out = _sample(
                rows,
                batch,
                seeds=seeds,
                positions=positions,
                history=history,
                prompt_lens=[2] * 8,
            )
            assert out.token_ids[row] == alone, (pos, row)


def test_seeds_and_positions_give_different_draws_and_64_bit_seeds_work():
    logits = torch.zeros(1, 1000)
    seeds = [0, 1, -1, 2**63 - 1, -(2**63), 2**32, 2**32 + 1]
    by_seed = [_sample(logits, [SamplingParams()], seeds=[s]).token_ids[0] for s in seeds]
    assert len(set(by_seed)) == len(seeds), by_seed
    assert len(set(_draws_list(SamplingParams(), 20, logits, seed=5))) >= 19


def test_a_sequence_carries_its_seed_or_a_random_one():
    assert Seq(0, [1], SamplingParams(seed=-3)).seed == -3
    a, b = Seq(0, [1], SamplingParams()).seed, Seq(1, [1], SamplingParams()).seed
    assert a != b and 0 <= a < 2**63 and 0 <= b < 2**63


def _decode(
    model, params_by_id: dict[int, SamplingParams], num_blocks: int = 64
) -> tuple[dict[int, list[int]], DecodeRunner]:
    cache = PagedKVCache.for_model(model, num_blocks, BLOCK)
    runner = DecodeRunner(model, cache, max_batch=8)
    for i, p in params_by_id.items():
        runner.add(Seq(i, prompt(5 + i % 100, seed=i), p))
    events = runner.run_until_done()
    cache.allocator.check_integrity()
    return {i: [e.token_id for e in es] for i, es in events.items()}, runner


def test_a_seeded_request_decodes_the_same_tokens_alone_and_in_any_row_of_a_batch(tiny):
    """Through the decode runner on dummy:tiny: request 100 (seed 42) alone, then at the
    first, a middle and the last row of a batch of 8 with other params around it."""
    seeded = SamplingParams(seed=42, max_tokens=12, temperature=1.3, ignore_eos=True)
    others = [
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=12, top_k=20, ignore_eos=True),
        SamplingParams(max_tokens=9, top_p=0.8, ignore_eos=True),
        SamplingParams(max_tokens=12, seed=7, min_p=0.05, ignore_eos=True),
        SamplingParams(max_tokens=12, frequency_penalty=1.5, ignore_eos=True),
        SamplingParams(max_tokens=12, repetition_penalty=1.4, logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=4, temperature=0.5, ignore_eos=True),
    ]
    alone = _decode(tiny, {100: seeded})[0][100]
    assert len(alone) == 12 and len(set(alone)) > 1
    for row in (0, 4, 7):
        ids = list(range(7))
        ids.insert(row, 100)
        params = {i: (seeded if i == 100 else others[i]) for i in ids}
        assert _decode(tiny, params)[0][100] == alone, row


def test_seeded_requests_preempted_and_recomputed_draw_the_same_tokens(tiny):
    """The noise is keyed by position, not by a generator's state, so a request that is
    preempted (its KV dropped and recomputed) continues exactly as it would have."""
    params = {
        i: SamplingParams(seed=i, max_tokens=16, temperature=1.2, ignore_eos=True) for i in range(5)
    }
    expected, _ = _decode(tiny, params)
    got, runner = _decode(tiny, params, num_blocks=9)
    assert runner.num_preemptions > 0
    assert got == expected


# -- penalties --------------------------------------------------------------------------


def _penalized(logits: list[float], params: SamplingParams, history, prompt_len) -> list[float]:
    """The penalized logits by hand: OpenAI's presence and frequency penalties over the
    output tokens, vLLM's repetition penalty over prompt and output."""
    out = list(logits)
    counts = Counter(history[prompt_len:])
    for t in range(len(out)):
        if t in history:
            r = params.repetition_penalty
            out[t] = out[t] / r if out[t] > 0 else out[t] * r
        out[t] -= params.presence_penalty * (counts[t] > 0) + params.frequency_penalty * counts[t]
    return out


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(presence_penalty=1.5),
        SamplingParams(frequency_penalty=0.7),
        SamplingParams(frequency_penalty=-0.4, presence_penalty=-1.0),
        SamplingParams(repetition_penalty=1.8),
        SamplingParams(repetition_penalty=0.5),
        SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25),
    ],
)
def test_penalties_match_a_hand_computation(params):
    base = [1.0, -0.5, 2.0, 0.5, -1.0, 1.5, 0.0, 3.0]
    # rows: prompt [2, 7, 7] + output [4, 2, 2, 5]; prompt [1] + output [1, 1, 3]; nothing
    history, prompt_lens = [[2, 7, 7, 4, 2, 2, 5], [1, 1, 1, 3], []], [3, 1, 0]
    neutral = SamplingParams()
    batch = _build([params, params, neutral], history=history, prompt_lens=prompt_lens)
    got = _penalize(torch.tensor([base] * 3), batch)
    for row in range(2):
        expected = _penalized(base, params, history[row], prompt_lens[row])
        assert got[row].tolist() == pytest.approx(expected, abs=1e-6), row
    assert got[2].tolist() == base  # a row without penalties is untouched, bit for bit


def test_penalties_count_what_they_should_and_logprobs_stay_raw():
    """presence and frequency see the output tokens only, repetition the prompt too; the
    greedy pick follows the penalized logits; the reported logprob is the raw model's."""
    logits = torch.tensor([[2.0, 1.9, 0.0]])
    logp = logits[0].log_softmax(-1)
    freq = SamplingParams(temperature=0, frequency_penalty=2.0, logprobs=1)
    in_prompt = _sample(logits, [freq], history=[[0, 0, 0]], prompt_lens=[3])
    assert in_prompt.token_ids == [0]  # 0 only in the prompt: not penalized
    in_output = _sample(logits, [freq], history=[[0, 0, 0, 0]], prompt_lens=[3])
    assert in_output.token_ids == [1]  # 2 - 2 * 1 < 1.9
    assert in_output.logprobs[0] == pytest.approx(float(logp[1]))
    assert in_output.top_logprobs[0] == [(0, pytest.approx(float(logp[0])))]
    rep = SamplingParams(temperature=0, repetition_penalty=1.5)
    assert _sample(logits, [rep], history=[[0, 0]], prompt_lens=[2]).token_ids == [1]
    assert _sample(logits, [rep], history=[[0, 1]], prompt_lens=[2]).token_ids == [0]


def test_rows_without_a_penalty_are_untouched_by_a_penalized_neighbour():
    logits = torch.tensor([[2.0, 1.9, 0.0]]).expand(2, 3)
    params = [SamplingParams(temperature=0, presence_penalty=2.0), SamplingParams(temperature=0)]
    out = _sample(logits, params, history=[[0, 0], [0, 0]], prompt_lens=[1, 1])
    assert out.token_ids == [1, 0]


# -- logprobs ---------------------------------------------------------------------------


def test_logprobs_are_the_raw_distribution_with_each_rows_own_top_n():
    params = [
        SamplingParams(temperature=0, logprobs=2),
        SamplingParams(temperature=0),
        SamplingParams(logprobs=0),
        SamplingParams(logprobs=4),
    ]
    out = _sample(LOGITS.expand(4, 5), params)
    logp = LOGITS[0].log_softmax(-1)
    assert out.logprobs[0] == pytest.approx(float(logp[1]))
    assert [t for t, _ in out.top_logprobs[0] or []] == [1, 3]
    assert out.logprobs[1] is None and out.top_logprobs[1] is None
    assert out.logprobs[2] == pytest.approx(float(logp[out.token_ids[2]]))
    assert out.top_logprobs[2] is None
    assert [t for t, _ in out.top_logprobs[3] or []] == [1, 3, 2, 0]
    assert out.top_logprobs[3][0][1] == pytest.approx(float(logp[1]))  # type: ignore[index]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_p": 0}, "top_p"),
        ({"temperature": -1}, "temperature"),
    ],
)
def test_bad_parameters_are_refused_by_name(kwargs, message):
    with pytest.raises(ApiError, match=message):
        SamplingParams(**kwargs).validate()


# -- parameters the sampler cannot compute with, and logits a broken model produces --

ISSUE_VALUES = [{"temperature": 1e-300}, {"top_p": 5e-324}]  # killed the decode step


@pytest.mark.parametrize("kwargs", ISSUE_VALUES)
def test_the_issue_values_are_refused_when_built_and_when_decoded_from_the_wire(kwargs):
    (param,) = kwargs
    with pytest.raises(InvalidSamplingParams, match=f"{param} must be") as e:
        SamplingParams(max_tokens=4, **kwargs)
    assert e.value.param == param
    data = msgspec.msgpack.encode({"max_tokens": 4, **kwargs})  # as a peer would send it
    with pytest.raises(InvalidSamplingParams, match=param):
        msgspec.msgpack.decode(data, type=SamplingParams)


@pytest.mark.parametrize(
    ("kwargs", "allowed"),
    [
        ({"temperature": 1e-6}, "0 (greedy) or in [1e-05, 1e+06], got 1e-06"),
        ({"temperature": 1e300}, "0 (greedy) or in [1e-05, 1e+06]"),
        ({"temperature": float("nan")}, "0 (greedy)"),
        ({"temperature": float("inf")}, "0 (greedy)"),
        ({"top_p": 1e-6}, "in [1e-05, 1]"),
        ({"top_p": float("nan")}, "in [1e-05, 1]"),
        ({"top_k": 2**31}, "in [0, 2147483647]"),
        ({"min_p": -0.1}, "in [0, 1] (0 = off), got -0.1"),
        ({"min_p": 1.5}, "in [0, 1]"),
        ({"min_p": float("nan")}, "in [0, 1]"),
        ({"presence_penalty": 2.5}, "in [-2, 2] (0 = off), got 2.5"),
        ({"presence_penalty": float("nan")}, "in [-2, 2]"),
        ({"frequency_penalty": -2.01}, "in [-2, 2] (0 = off)"),
        ({"repetition_penalty": 0.0}, "in (0, 2] (1 = off), got 0.0"),
        ({"repetition_penalty": 2.5}, "in (0, 2]"),
        ({"repetition_penalty": float("inf")}, "in (0, 2]"),
        ({"stop_token_ids": (1, -1)}, "token ids in [0, 2147483647], got -1"),
        ({"stop_token_ids": (2**64,)}, "token ids in [0, 2147483647]"),
        ({"seed": 2**64}, "a signed 64-bit integer"),
        ({"logprobs": 21}, "in [0, 20]"),
        ({"logit_bias": ((5, 100.5),)}, "biases in [-100, 100], got 100.5"),
        ({"logit_bias": ((5, float("nan")),)}, "biases in [-100, 100]"),
        ({"logit_bias": ((-1, 1.0),)}, "token ids in [0, 2147483647], got -1"),
        ({"logit_bias": ((5, 1.0), (5, -1.0))}, "distinct token ids"),
        ({"logit_bias": tuple((i, 1.0) for i in range(1025))}, "at most 1024 tokens"),
        ({"min_tokens": -1}, "in [0, max_tokens=256], got -1"),
        ({"min_tokens": 257}, "in [0, max_tokens=256]"),
    ],
)
def test_values_out_of_range_are_refused_saying_what_is_allowed(kwargs, allowed):
    with pytest.raises(InvalidSamplingParams) as e:
        SamplingParams(**kwargs)
    assert e.value.param == next(iter(kwargs)) and allowed in str(e.value)


@pytest.mark.parametrize(
    ("guided", "allowed"),
    [
        ({"kind": "xml"}, "one of json_object, json_schema, regex, choice, grammar, got 'xml'"),
        ({"kind": "regex", "spec": "a" * (256 * 1024 + 1)}, "at most 262144 bytes"),
    ],
)
def test_a_bad_guided_constraint_is_refused_built_and_from_the_wire(guided, allowed):
    with pytest.raises(InvalidSamplingParams, match=re.escape(allowed)) as e:
        Guided(**guided)
    assert e.value.param == "guided"
    data = msgspec.msgpack.encode({"max_tokens": 4, "guided": guided})  # as a peer sends it
    with pytest.raises(InvalidSamplingParams, match=re.escape(allowed)):
        msgspec.msgpack.decode(data, type=SamplingParams)


def test_params_from_a_peer_without_the_new_fields_decode_with_neutral_values():
    old = msgspec.msgpack.encode({"max_tokens": 4, "temperature": 0.5})
    p = msgspec.msgpack.decode(old, type=SamplingParams)
    assert (p.min_p, p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (
        0.0,
        0.0,
        0.0,
        1.0,
    )
    assert not p.has_penalty
    new = SamplingParams(min_p=0.1, frequency_penalty=0.5, repetition_penalty=1.1)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(new), type=SamplingParams) == new


def _unchecked(params: SamplingParams, **values: float) -> SamplingParams:
    """`params` with values validation would refuse (as a buggy peer could produce)."""
    for name, value in values.items():
        msgspec.structs.force_setattr(params, name, value)
    return params


VOCAB = 50
EXTREME = [
    SamplingParams(temperature=1e-5),
    SamplingParams(temperature=1e6),
    SamplingParams(top_p=1e-5),
    SamplingParams(top_p=1e-5, temperature=1e-5, top_k=3),
    SamplingParams(top_k=2**31 - 1, temperature=0.7, top_p=0.9),
    SamplingParams(min_p=1.0, temperature=1e-5),
    SamplingParams(repetition_penalty=1e-300, presence_penalty=-2, frequency_penalty=-2),
    SamplingParams(temperature=0, repetition_penalty=2, frequency_penalty=2, logprobs=20),
    _unchecked(SamplingParams(), temperature=1e-300),
    _unchecked(SamplingParams(), top_p=5e-324),
    _unchecked(SamplingParams(), temperature=float("nan"), top_p=float("nan")),
    _unchecked(SamplingParams(), temperature=float("inf")),
    _unchecked(SamplingParams(), temperature=1e300),
    _unchecked(SamplingParams(), top_p=-1.0),
    _unchecked(SamplingParams(), min_p=float("nan"), repetition_penalty=float("nan")),
    _unchecked(SamplingParams(), frequency_penalty=1e300, repetition_penalty=1e300),
]
ROWS = {
    "ordinary": torch.linspace(-3, 3, VOCAB),
    "huge": torch.tensor([3e38, -3e38] * (VOCAB // 2)),
    "tiny": torch.full((VOCAB,), 1e-38),
    "one +inf": torch.zeros(VOCAB).index_fill(0, torch.tensor([7]), float("inf")),
    "a nan": torch.zeros(VOCAB).index_fill(0, torch.tensor([3]), float("nan")),
    "all nan": torch.full((VOCAB,), float("nan")),
    "all -inf": torch.full((VOCAB,), float("-inf")),
    "mixed": torch.tensor([float("nan"), float("inf"), float("-inf"), 1.0] * 12 + [0.0, 0.0]),
}


@pytest.mark.parametrize("row_name", sorted(ROWS))
def test_sample_returns_a_valid_token_for_any_params_and_logits(row_name):
    """Every pairing of extreme params with every logits row gives a token id in the
    vocabulary (no exception); rows with inf/NaN take their top token, never a NaN one,
    and report no logprobs."""
    row = ROWS[row_name]
    batch = row.expand(len(EXTREME), VOCAB).contiguous()
    history = [[0, 1, 2, 2, 7, 3]] * len(EXTREME)
    for pos in range(5):
        out = _sample(
            batch,
            EXTREME,
            seeds=range(len(EXTREME)),
            positions=[pos] * len(EXTREME),
            history=history,
            prompt_lens=[2] * len(EXTREME),
        )
        assert all(0 <= t < VOCAB for t in out.token_ids), out.token_ids
    if row_name == "one +inf":
        assert set(out.token_ids) == {7}
    if row_name in ("a nan", "mixed"):
        assert not any(torch.isnan(row[out.token_ids]))
    if row_name == "mixed":
        assert set(out.token_ids) == {1}  # the first +inf
    is_broken = not bool(torch.isfinite(row).all())
    assert (out.logprobs[7] is None) == is_broken


def test_logprobs_of_a_broken_row_are_none_and_of_a_good_row_are_kept():
    params = SamplingParams(temperature=0, logprobs=20)  # more than this vocab of 5
    batch = torch.cat([LOGITS, torch.full((1, 5), float("nan"))])
    out = _sample(batch, [params, params])
    assert out.logprobs[1] is None and out.top_logprobs[1] is None
    assert len(out.top_logprobs[0] or []) == 5


# -- no host sync, and a fixed set of ops ---------------------------------------------

# a value read on the host, or a shape only the device knows (boolean-mask indexing is
# `index`/`index_put` with a bool index; `sample` indexes by slices only)
SYNCING_OPS = (
    "_local_scalar_dense",
    "nonzero",
    "masked_select",
    "multinomial",
    "index",
    "index_put",
    "index_put_",
)


class _Ops(TorchDispatchMode):
    """Records the name of every aten op dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


class _HostReads:
    """Counts calls of the Tensor methods that read a value on the host."""

    METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__")

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.counts: Counter = Counter()
        for name in self.METHODS:
            real = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._counting(name, real))

    def _counting(self, name, real):
        def method(tensor, *args, **kwargs):
            self.counts[name] += 1
            return real(tensor, *args, **kwargs)

        return method


MIX = [
    SamplingParams(temperature=0, logprobs=3),
    SamplingParams(temperature=0.8, top_k=5, seed=1),
    SamplingParams(top_p=0.9, min_p=0.05),
    SamplingParams(presence_penalty=0.5, frequency_penalty=0.3, logprobs=0),
    SamplingParams(repetition_penalty=1.2, top_k=3, top_p=0.5, min_p=0.1, logprobs=5),
]
EVERYTHING = SamplingParams(
    temperature=0.8,
    top_k=5,
    top_p=0.9,
    min_p=0.05,
    presence_penalty=0.5,
    frequency_penalty=0.3,
    repetition_penalty=1.2,
    logprobs=5,
)


def _mixed_batch(num_rows: int) -> tuple[torch.Tensor, SamplingBatch]:
    """A batch of `num_rows` whose rows between them use every feature (one row: all)."""
    params = [EVERYTHING] if num_rows == 1 else [MIX[i % len(MIX)] for i in range(num_rows)]
    logits = torch.randn(num_rows, 300, generator=torch.Generator().manual_seed(num_rows))
    logits[0, 5] = float("nan")
    history = [prompt(10 + i, seed=i, vocab=300) for i in range(num_rows)]
    batch = _build(
        params,
        seeds=range(num_rows),
        positions=[len(h) for h in history],
        history=history,
        prompt_lens=[4] * num_rows,
    )
    return logits, batch


def test_sample_reads_nothing_on_the_host_and_to_host_reads_once(monkeypatch):
    logits, batch = _mixed_batch(8)
    reads = _HostReads(monkeypatch)
    with _Ops() as ops:
        sampled = sample(logits, batch)
    assert not [n for n in ops.names if n in SYNCING_OPS], ops.names
    assert not reads.counts, reads.counts
    with _Ops() as ops:
        out = sampled.to_host()
    assert not [n for n in ops.names if n in SYNCING_OPS], ops.names
    assert reads.counts == {"tolist": 1}, reads.counts
    assert out.logprobs[0] is None  # row 0 holds a NaN
    assert len(out.top_logprobs[4] or []) == 5 and len(out.top_logprobs[5] or []) == 3


def test_the_ops_of_sample_do_not_depend_on_the_batch_size():
    names = []
    for num_rows in (1, 8, 32):
        logits, batch = _mixed_batch(num_rows)
        with _Ops() as ops:
            sample(logits, batch)
        names.append(ops.names)
    assert names[0] == names[1] == names[2], [len(n) for n in names]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_a_step_synchronises_only_in_to_host():
    """CUDA's own sync check: any synchronising op in build or sample raises."""
    logits, batch_cpu = _mixed_batch(32)
    history = [prompt(10 + i, seed=i, vocab=300) for i in range(32)]
    params = list(batch_cpu.params)
    logits = logits.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        batch = SamplingBatch.build(
            params, range(32), [len(h) for h in history], history, [4] * 32, "cuda"
        )
        sampled = sample(logits, batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    out = sampled.to_host()
    expected = sample(logits.cpu(), batch_cpu).to_host()
    assert all(0 <= t < 300 for t in out.token_ids)
    greedy = [i for i, p in enumerate(params) if p.is_greedy]
    assert [out.token_ids[i] for i in greedy] == [expected.token_ids[i] for i in greedy]


class _CarriesParams(Msg, frozen=True, tag="test.carries_params"):
    params: SamplingParams


@pytest.mark.parametrize("kwargs", ISSUE_VALUES)
def test_a_peer_message_carrying_the_issue_values_is_refused_as_a_protocol_error(kwargs):
    """What a decode node does with a submit whose params it cannot sample with."""
    info = msg_type(_CarriesParams)
    body = msgspec.msgpack.encode({"type": info.tag, "params": {"max_tokens": 4, **kwargs}})
    frame = HEAD.pack(VERSION, KIND_REQUEST, 1, len(info.tag_bytes)) + info.tag_bytes + body
    with pytest.raises(
        ProtocolError, match=f"invalid test.carries_params message: .*{next(iter(kwargs))}"
    ):
        decode_frame(frame, {info.tag_bytes: info})
