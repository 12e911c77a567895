"""Which decode instance gets a request's KV.

- At arrival (`place_decode`): the instance with the lowest predicted TBT among those with
  room for the request's KV (its batch's KV now plus reservations), as §3 step 1 pairs a
  prefill with a decode instance.
- When the prefill is about to start (`place_at_start`, late binding): the instance with
  the lowest load forecast for when the KV lands (§7.4's forecast per instance, each batch
  known with its ages). The destination is needed only then: KV streams layer by layer
  from the prefill's start. This is placement, not rejection: the Conductor does it in
  every rejection mode (`ConductorParams.late_binding`); predictive mode also rejects
  when even the best load is over 1.

Pure logic: time is passed in.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable

import numpy as np

from mooncake.conductor.admission import decode_load
from mooncake.conductor.costmodel import CostModel
from mooncake.conductor.forecast import DecodeForecast
from mooncake.conductor.load import DecodeSlots


def place_decode(
    decode: list[DecodeSlots], step: Callable[[float, float], float], input_len: int, now: float
) -> tuple[DecodeSlots, float, tuple[int, float]]:
    """At arrival: the decode instance with the lowest predicted TBT (`step(batch, KV
    tokens)`, seconds) among those with room for the request's KV, that TBT, and the
    (requests, KV tokens) decoding now over the whole pool (for the admission check)."""
    best, best_t, best_fits = decode[0], float("inf"), False
    pool_n, pool_held = 0, 0.0
    for s in decode:
        dt = now - s.report_t  # NOTE: held_tokens(now), inlined: this loop is hot
        held = s.active_tokens + s.generated + (s.gen_per_s * dt if dt > 0 else 0.0)
        pool_n += len(s.active)
        pool_held += held
        tokens = held + s.reserved_tokens + input_len
        fits = tokens <= s.capacity_tokens
        if best_fits and not fits:
            continue
        t = step(s.num + 1, tokens)
        if t < best_t or (fits and not best_fits):
            best, best_t, best_fits = s, t, fits
    return best, best_t, (pool_n, pool_held)


def place_at_start(
    cost: CostModel,
    tbt_slo_s: float,
    forecast: DecodeForecast,
    decode: list[DecodeSlots],
    req_id: Hashable,
    input_len: int,
    now: float,
    ready_at: float,
    candidates: list[int] | None = None,
) -> tuple[DecodeSlots, float]:
    """§7.4 refreshed when the prefill starts: the decode instance with the lowest load
    predicted for when the request's KV lands (`ready_at`), and that load (> 1: reject).
    An instance's load at t = ready_at counts each request of its batch still decoding at
    t given how long it has decoded (`DecodeTimes.still_decoding`), holding its prompt and
    what it will have generated, plus the requests whose prefill has started, that are
    bound to it and predicted to end by t, plus this request. `candidates`: the indices
    of `decode` to price, in order (None: all); an instance with nothing running or
    reserved prices as every other such one of its KV room, so the candidates need only
    the busy ones and the first idle one of each room (`DecodeOrder.start_candidates`)."""
    if candidates is not None:
        return place_at_start(
            cost,
            tbt_slo_s,
            forecast,
            [decode[i] for i in candidates],
            req_id,
            input_len,
            now,
            ready_at,
        )
    t = ready_at
    times, g, h = forecast.times, forecast.gen_per_s, t - now
    sizes = [len(s.active) for s in decode]
    total = sum(sizes)
    n_run, tok_run = [0.0] * len(decode), [0.0] * len(decode)
    if total:  # NOTE: one vectorized pass over every batch of the pool
        chain = itertools.chain.from_iterable
        ages = now - np.fromiter(chain(s.since.values() for s in decode), float, total)
        prompts = np.fromiter(chain(s.active.values() for s in decode), float, total)
        owner = np.repeat(np.arange(len(decode)), sizes)
        stay = times.still_decoding(ages, h)
        n_run = np.bincount(owner, stay, len(decode)).tolist()
        tok_run = np.bincount(owner, stay * (prompts + g * (ages + h)), len(decode)).tolist()
    loads = []
    for i, slots in enumerate(decode):
        n, tokens = n_run[i] + 1.0, tok_run[i] + input_len
        reserved = slots.reserved
        for other, ready in slots.incoming.items():
            if ready <= t and other != req_id:
                lag = t - ready if ready > now else h
                s = times.survival(lag)
                n += s
                tokens += s * (reserved[other] + g * lag)
        loads.append(decode_load(cost, tbt_slo_s, n, tokens, slots.capacity_tokens))
    best = min(range(len(decode)), key=loads.__getitem__)
    return decode[best], loads[best]
