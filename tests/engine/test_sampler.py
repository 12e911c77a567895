"""Sampling: truncation keeps what it should, seeds reproduce, logprobs are the model's."""

from __future__ import annotations

import pytest
import torch

from mooncake.engine.sampler import SamplingParams, make_generator, sample
from mooncake.errors import ApiError

LOGITS = torch.tensor([[0.0, 3.0, 1.0, 2.9, -1.0]])


def _draw(params: SamplingParams, n: int = 200, seed: int = 0) -> set[int]:
    gen = make_generator(seed)
    return {sample(LOGITS, [params], [gen]).token_ids[0] for _ in range(n)}


def test_greedy_top_k_and_top_p_keep_only_the_allowed_tokens():
    assert sample(LOGITS, [SamplingParams(temperature=0)], [None]).token_ids == [1]
    assert _draw(SamplingParams(top_k=1)) == {1}
    assert _draw(SamplingParams(top_k=2, temperature=5)) == {1, 3}
    assert _draw(SamplingParams(top_p=0.01)) == {1}  # the top token always stays
    assert _draw(SamplingParams(top_p=0.6, temperature=1)) == {1, 3}  # p(1) ~ 0.47
    assert _draw(SamplingParams(temperature=100), n=400) == {0, 1, 2, 3, 4}


def test_a_seed_reproduces_the_same_tokens_whatever_shares_the_batch():
    params = SamplingParams(seed=42)
    alone = [
        sample(LOGITS, [params], [g]).token_ids[0] for g in [make_generator(42)] for _ in range(20)
    ]
    gen, other = make_generator(42), make_generator(7)
    batch = torch.cat([LOGITS, LOGITS])
    both = [sample(batch, [params, SamplingParams()], [gen, other]).token_ids[0] for _ in range(20)]
    assert alone == both


def test_logprobs_are_the_raw_distribution_with_the_top_n():
    out = sample(LOGITS, [SamplingParams(temperature=0, logprobs=2)], [None])
    logp = LOGITS[0].log_softmax(-1)
    assert out.logprobs[0] == pytest.approx(float(logp[1]))
    assert [t for t, _ in out.top_logprobs[0] or []] == [1, 3]
    assert sample(LOGITS, [SamplingParams(temperature=0)], [None]).logprobs == [None]


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
