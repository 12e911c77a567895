"""Sampling: greedy, temperature, top-k, top-p, per-request seeds, logprobs.

Greedy rows (temperature 0) take the argmax, batched. Other rows are sampled one by one
with the request's own `torch.Generator`, so a seeded request draws the same tokens
whatever else shares its batch. Logprobs are of the raw model distribution (before
temperature and truncation), as the OpenAI API reports them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from mooncake.engine.params import SamplingParams


def make_generator(seed: int | None, device: str = "cpu") -> torch.Generator:
    """A request's generator: seeded when asked, else from the OS."""
    value = seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
    return torch.Generator(device=device).manual_seed(value)


@dataclass
class SampleOutput:
    token_ids: list[int]
    logprobs: list[float | None]  # of the chosen token
    top_logprobs: list[list[tuple[int, float]] | None]  # (token id, logprob), best first


def _truncate(logits: Tensor, top_k: int, top_p: float) -> Tensor:
    # logits: (vocab,) float32, already divided by the temperature
    if 0 < top_k < logits.shape[0]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= top_p  # NOTE: the top token always stays
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def sample(
    logits: Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> SampleOutput:
    """One token per row of `logits` (batch, vocab) float32; changes the generators' state."""
    out = logits.argmax(-1).tolist()
    for i, p in enumerate(params):
        if p.is_greedy:
            continue
        row = _truncate(logits[i] / p.temperature, p.top_k, p.top_p)
        gen = generators[i]
        assert gen is not None, "a sampled request needs a generator"
        probs = row.softmax(-1).to(gen.device)
        out[i] = int(torch.multinomial(probs, 1, generator=gen).item())
    chosen: list[float | None] = [None] * len(params)
    top: list[list[tuple[int, float]] | None] = [None] * len(params)
    if any(p.logprobs is not None for p in params):
        logp = logits.log_softmax(-1)
        for i, p in enumerate(params):
            if p.logprobs is None:
                continue
            chosen[i] = float(logp[i, out[i]])
            if p.logprobs:
                values, ids = torch.topk(logp[i], p.logprobs)
                top[i] = list(zip(ids.tolist(), values.tolist(), strict=True))
    return SampleOutput(out, chosen, top)
