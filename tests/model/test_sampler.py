"""Sampling: truncation keeps what it should, seeds reproduce, logprobs are the model's."""

from __future__ import annotations

import msgspec
import pytest
import torch

from mooncake.errors import ApiError, ProtocolError
from mooncake.model.params import InvalidSamplingParams
from mooncake.model.sampler import SamplingParams, make_generator, sample
from mooncake.rpc.wire import HEAD, KIND_REQUEST, VERSION, Msg, decode_frame, msg_type

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
        ({"stop_token_ids": (1, -1)}, "token ids in [0, 2147483647], got -1"),
        ({"stop_token_ids": (2**64,)}, "token ids in [0, 2147483647]"),
        ({"seed": 2**64}, "a signed 64-bit integer"),
        ({"logprobs": 21}, "in [0, 20]"),
    ],
)
def test_values_out_of_range_are_refused_saying_what_is_allowed(kwargs, allowed):
    with pytest.raises(InvalidSamplingParams) as e:
        SamplingParams(**kwargs)
    assert e.value.param == next(iter(kwargs)) and allowed in str(e.value)


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
    _unchecked(SamplingParams(), temperature=1e-300),
    _unchecked(SamplingParams(), top_p=5e-324),
    _unchecked(SamplingParams(), temperature=float("nan"), top_p=float("nan")),
    _unchecked(SamplingParams(), temperature=float("inf")),
    _unchecked(SamplingParams(), temperature=1e300),
    _unchecked(SamplingParams(), top_p=-1.0),
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
    vocabulary (no exception); rows with inf/NaN take their top token, never a NaN one."""
    row = ROWS[row_name]
    batch = row.expand(len(EXTREME), VOCAB).contiguous()
    gens = [make_generator(i) for i in range(len(EXTREME))]
    for _ in range(5):
        out = sample(batch, [*EXTREME], gens)
        assert all(0 <= t < VOCAB for t in out.token_ids), out.token_ids
    if row_name == "one +inf":
        assert set(out.token_ids) == {7}
    if row_name in ("a nan", "mixed"):
        assert not any(torch.isnan(row[out.token_ids]))


def test_logprobs_of_a_broken_row_are_none_and_of_a_good_row_are_kept():
    params = SamplingParams(temperature=0, logprobs=20)  # more than this vocab of 5
    batch = torch.cat([LOGITS, torch.full((1, 5), float("nan"))])
    out = sample(batch, [params, params], [None, None])
    assert out.logprobs[1] is None and out.top_logprobs[1] is None
    assert len(out.top_logprobs[0] or []) == 5


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
