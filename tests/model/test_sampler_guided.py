"""The sampler's allowed-token bitmask: a constrained row never takes a banned token
(greedy, sampled, truncated, penalized, broken), the other rows draw exactly what they draw
without it, logprobs stay raw, and it adds no host read or sync."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mooncake.model.sampler import (
    SamplingBatch,
    SamplingParams,
    _bias_on_device,
    _bias_on_host,
    sample,
)
from tests.model.conftest import prompt
from tests.model.test_sampler import MIX, SYNCING_OPS, _HostReads, _Ops

V = 300  # not a multiple of 32: the last word's high bits name no token
W = (V + 31) // 32


def _bits(allowed: list[set[int] | None]) -> torch.Tensor:
    """(B, W) int32: a row's allowed ids, or every bit set for None."""
    flags = np.ones((len(allowed), W * 32), dtype=np.uint8)
    for i, ids in enumerate(allowed):
        if ids is not None:
            flags[i] = 0
            flags[i, sorted(ids)] = 1
    return torch.from_numpy(np.packbits(flags, axis=1, bitorder="little").view(np.int32).copy())


def _batch(params, allowed=None, num_history=10):  # type: ignore[no-untyped-def]
    n = len(params)
    history = [prompt(num_history + i, seed=i, vocab=V) for i in range(n)]
    bits = _bits(allowed) if allowed is not None else None
    return SamplingBatch.build(
        params, range(n), [len(h) for h in history], history, [4] * n, "cpu", bits
    )


PARAMS = [
    *MIX,
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=2.0, seed=3),
    SamplingParams(temperature=0, repetition_penalty=1.5),
]


@pytest.mark.parametrize("seed", range(5))
def test_a_constrained_row_never_takes_a_banned_token(seed):
    rng = np.random.default_rng(seed)
    logits = torch.from_numpy(rng.normal(size=(len(PARAMS), V)).astype(np.float32) * 4)
    # few allowed ids, none of them the row's top token
    allowed: list[set[int] | None] = []
    for row in logits:
        order = row.argsort(descending=True).tolist()
        allowed.append(set(rng.choice(order[5:], size=3, replace=False).tolist()))
    for _ in range(3):
        out = sample(logits, _batch(PARAMS, allowed)).to_host()
        for i, t in enumerate(out.token_ids):
            assert t in (allowed[i] or ()), (i, PARAMS[i], t)


def test_unconstrained_rows_draw_exactly_what_they_draw_without_a_bitmask():
    logits = torch.randn(len(PARAMS), V, generator=torch.Generator().manual_seed(1))
    allowed: list[set[int] | None] = [None if i % 2 else {7, 8} for i in range(len(PARAMS))]
    free = sample(logits, _batch(PARAMS)).to_host()
    held = sample(logits, _batch(PARAMS, allowed)).to_host()
    for i in range(len(PARAMS)):
        if allowed[i] is None:
            assert held.token_ids[i] == free.token_ids[i]
            assert held.logprobs[i] == free.logprobs[i]
            assert held.top_logprobs[i] == free.top_logprobs[i]
        else:
            assert held.token_ids[i] in (7, 8)


def test_a_single_allowed_token_is_taken_and_its_logprob_stays_raw():
    logits = torch.randn(len(PARAMS), V, generator=torch.Generator().manual_seed(2))
    allowed = [{V - 1}] * len(PARAMS)  # the last id, in the last, partial word
    out = sample(logits, _batch(PARAMS, allowed)).to_host()
    assert out.token_ids == [V - 1] * len(PARAMS)
    raw = logits.log_softmax(-1)[:, V - 1]
    for i, p in enumerate(PARAMS):
        if p.logprobs is not None:
            assert out.logprobs[i] == pytest.approx(float(raw[i]), abs=1e-5)


def test_a_broken_constrained_row_takes_its_top_allowed_token():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(3))
    logits[:, 11] = float("nan")
    logits[:, 12] = math.inf  # would win, but is banned
    logits[:, 40] = 5.0
    params = [SamplingParams(temperature=0), SamplingParams(seed=1), MIX[3]]
    out = sample(logits, _batch(params, [{12 - 1, 40, 41}] * 3)).to_host()
    assert out.token_ids == [40, 40, 40]


def test_the_bitmask_adds_no_host_read_or_sync(monkeypatch):
    logits = torch.randn(len(MIX), V, generator=torch.Generator().manual_seed(4))
    batch = _batch(MIX, [{1, 2, 3}, None, {4}, None, {5, 6}])
    reads = _HostReads(monkeypatch)
    with _Ops() as ops:
        sampled = sample(logits, batch)
    assert not [n for n in ops.names if n in SYNCING_OPS], ops.names
    assert not reads.counts, reads.counts
    out = sampled.to_host()
    assert reads.counts == {"tolist": 1}, reads.counts
    assert out.token_ids[0] in (1, 2, 3) and out.token_ids[2] == 4


def test_the_gpu_expansion_of_the_bits_equals_the_cpu_one():
    """The ops a GPU runs on the uploaded bits (checked here on the CPU) against numpy's."""
    bits = torch.randint(-(2**31), 2**31 - 1, (5, W), dtype=torch.int32)
    bits[0] = -1
    bits[1] = 0
    host, device = _bias_on_host(bits), _bias_on_device(bits)
    assert torch.equal(host, device)
    assert (host[0] == 0).all() and (host[1] == -math.inf).all()
    flags = np.unpackbits(bits.numpy().view(np.uint8), axis=1, bitorder="little")
    assert torch.equal(host == 0, torch.from_numpy(flags.astype(bool)))
