"""Sampling: greedy, temperature, top-k, top-p, per-request seeds, logprobs.

Greedy rows (temperature 0) take the argmax, batched. Other rows are sampled one by one
with the request's own `torch.Generator`, so a seeded request draws the same tokens
whatever else shares its batch. Logprobs are of the raw model distribution (before
temperature and truncation), as the OpenAI API reports them. Sampling is computed in
float32 so that it never fails: logits are shifted so the top token sits at 0 before the
temperature divides them, the top token survives every truncation, and a row holding inf
or NaN takes its top token.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from mooncake.model.params import MAX_TEMPERATURE, MIN_TEMPERATURE, SamplingParams


def make_generator(seed: int | None, device: str = "cpu") -> torch.Generator:
    """A request's generator: seeded when asked, else from the OS."""
    value = seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
    return torch.Generator(device=device).manual_seed(value)


@dataclass
class SampleOutput:
    token_ids: list[int]
    logprobs: list[float | None]  # of the chosen token
    top_logprobs: list[list[tuple[int, float]] | None]  # (token id, logprob), best first


def _probs(row: Tensor, p: SamplingParams) -> Tensor:
    """What to draw from: `row` (vocab,) finite float32 logits -> weights, the top token's > 0."""
    # NOTE: the params were validated; the clamp keeps the division finite whatever arrives
    t = p.temperature
    if not MIN_TEMPERATURE <= t <= MAX_TEMPERATURE:  # NaN too
        t = MAX_TEMPERATURE if t > MAX_TEMPERATURE else MIN_TEMPERATURE
    # <= 0 with the top token at 0, so the softmax neither overflows nor divides by 0
    scaled = (row - row.max()) / t
    if 0 < p.top_k < scaled.shape[0]:
        kth = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = scaled.softmax(-1)
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= p.top_p
        drop[0] = False  # NOTE: the top token always stays, whatever float32 made of top_p
        probs = probs.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), 0.0)
    return probs


def sample(
    logits: Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> SampleOutput:
    """One token per row of `logits` (batch, vocab); changes the generators' state.

    Never raises for what the model produced: a row holding inf or NaN (a broken model or
    an overflow) takes its top token (the first +inf; NaN never wins) and reports no logprobs."""
    logits = logits.float()
    is_finite = torch.isfinite(logits).all(-1).tolist()  # per row
    top = logits if all(is_finite) else logits.masked_fill(logits.isnan(), float("-inf"))
    out = top.argmax(-1).tolist()
    for i, p in enumerate(params):
        if p.is_greedy or not is_finite[i]:
            continue
        gen = generators[i]
        assert gen is not None, "a sampled request needs a generator"
        probs = _probs(logits[i], p).to(gen.device)
        out[i] = int(torch.multinomial(probs, 1, generator=gen).item())
    chosen: list[float | None] = [None] * len(params)
    tops: list[list[tuple[int, float]] | None] = [None] * len(params)
    if any(p.logprobs is not None for p in params):
        logp = logits.log_softmax(-1)
        for i, p in enumerate(params):
            if p.logprobs is None or not is_finite[i]:
                continue
            chosen[i] = float(logp[i, out[i]])
            if p.logprobs:
                values, ids = torch.topk(logp[i], min(p.logprobs, logp.shape[1]))
                tops[i] = list(zip(ids.tolist(), values.tolist(), strict=True))
    return SampleOutput(out, chosen, tops)
