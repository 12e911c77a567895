"""Admission and early rejection (paper §7): is there room for this request, before prefill?

Loads (§7.1): prefill load = predicted TTFT / TTFT SLO; decode load = predicted TBT / TBT
SLO, or the share of the decode KV room the batch would use, whichever is greater (a batch
that does not fit cannot run at any TBT). Load > 1 means an SLO breaks. The decode pool's
load is the instances' average (§7.4): the step-time polynomial at the mean batch and mean
KV, which equals the mean of the instances' TBTs when the polynomial is linear, as the
roofline's is.

Modes (`ConductorParams.rejection`):

- `none`: no early rejection. Algorithm 1 still rejects a request whose predicted TTFT
  breaks the SLO (that costs nothing), but the decode side is checked only by the decode
  instance when the KV arrives (`decode_can_admit`), after the prefill was spent.
- `basic` (§7.2): also reject at arrival when the decode pool's load now (the requests
  decoding now, with the KV they hold, plus this request) is over 1. This ignores the
  requests still in prefill and those about to finish, which is what makes it oscillate
  (§7.3): the request reaches decode only a TTFT later.
- `predictive` (§7.4): at arrival, the decode pool's load is predicted for the moment this
  request's prefill ends, t = now + its predicted TTFT (`DecodeForecast.at`), plus this
  request; the request is rejected when that load is over 1 by more than
  `forecast_sigmas` (2) times the forecast's own error, measured as each forecast comes
  due (`ForecastError`: zero at first, so the paper's rule; 0.07-0.09 of the pool's KV
  a TTFT ahead on the conversation trace, where decode times are long-tailed). The
  forecast is refreshed when the prefill is about to start (`place_at_start`): the queue
  wait is behind the request and the horizon is only its prefill time, and each batch's
  requests are known with their ages, so the forecast is sharp. The KV is streamed to
  the decode instance with the lowest predicted load when it lands (the destination is
  needed only then: KV streams layer by layer from the prefill's start), and the request
  is rejected, still before any prefill is spent, when even that load is over 1.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Hashable

import numpy as np

from mooncake.conductor.costmodel import CostModel
from mooncake.conductor.load import DecodeForecast, DecodeSlots
from mooncake.conductor.types import ConductorParams, RejectReason


class ForecastError:
    """How far the arrival-time forecasts of the decode pool's KV were from what the pool
    then held: the root mean square of (predicted - held) / the pool's KV room, over the
    forecasts that have come due (their mean, then an exponential moving average once
    1/weight are counted). Pure: the caller says what the pool holds when."""

    def __init__(self, weight: float = 0.01):
        self.mean_sq = 0.0
        self.num = 0
        self._weight = weight
        self._due: list[tuple[float, int, float]] = []  # heap of (t, seq, predicted KV)
        self._seq = itertools.count()

    @property
    def rms(self) -> float:
        return math.sqrt(self.mean_sq)

    def expect(self, t: float, tokens: float) -> None:
        """A forecast: the pool will hold `tokens` of KV at time t."""
        heapq.heappush(self._due, (t, next(self._seq), tokens))

    def settle(self, now: float, held_tokens: float, capacity_tokens: float) -> None:
        """The pool holds `held_tokens` at `now`: score every forecast due by now."""
        due = self._due
        while due and due[0][0] <= now:
            err = (heapq.heappop(due)[2] - held_tokens) / capacity_tokens
            self.num += 1
            w = max(1.0 / self.num, self._weight)
            self.mean_sq += w * (err * err - self.mean_sq)


def decode_load(
    cost: CostModel, tbt_slo_s: float, n: float, tokens: float, capacity: float
) -> float:
    """max(TBT / SLO, KV tokens / room) of a batch of `n` requests holding `tokens`."""
    tbt = cost.decode_step_time(n, tokens) / tbt_slo_s
    mem = tokens / capacity
    return tbt if tbt > mem else mem


def pool_load(
    cost: CostModel, params: ConductorParams, capacity: int, num: int, n: float, tokens: float
) -> float:
    """Average load of `num` decode instances of `capacity` KV tokens in total holding
    `n` requests and `tokens` KV tokens."""
    return decode_load(cost, params.tbt_slo_s, n / num, tokens / num, capacity / num)


def predicted_decode_load(
    cost: CostModel,
    params: ConductorParams,
    forecast: DecodeForecast,
    num_decode: int,
    running: tuple[int, float],
    input_len: int,
    now: float,
    t: float,
) -> float:
    """§7.4: the decode pool's average load at time t with this request added, when
    `running` = (requests, KV tokens) decode now."""
    n, tokens = forecast.at(t, now, running[0], running[1])
    return pool_load(cost, params, forecast.capacity_tokens, num_decode, n + 1, tokens + input_len)


def decide(
    cost: CostModel,
    params: ConductorParams,
    forecast: DecodeForecast,
    errors: ForecastError,
    num_decode: int,
    running: tuple[int, float],
    input_len: int,
    ttft_s: float,
    now: float,
) -> tuple[float, float, RejectReason]:
    """(prefill load, decode load, reason) for a request at arrival; reason "" = admit.
    `running` = (requests, KV tokens) decoding now over the decode pool. In predictive
    mode this also scores the forecasts now due and files this one."""
    prefill = ttft_s / params.ttft_slo_s
    mode = params.rejection
    limit = 1.0
    capacity = forecast.capacity_tokens
    if mode == "basic":  # §7.2: the pool now, with this request
        n, tokens = running[0] + 1, running[1] + input_len
        dec = pool_load(cost, params, capacity, num_decode, n, tokens)
    elif mode == "predictive":
        errors.settle(now, running[1], capacity)
        t = now + ttft_s
        n_at, tokens_at = forecast.at(t, now, running[0], running[1])
        dec = pool_load(cost, params, capacity, num_decode, n_at + 1, tokens_at + input_len)
        limit += params.forecast_sigmas * errors.rms
    else:
        dec = 0.0
    reason: RejectReason = "ttft_slo" if prefill > 1.0 else "decode_load" if dec > limit else ""
    if mode == "predictive":  # the pool at t, with this request if it is admitted
        errors.expect(t, tokens_at + (0 if reason else input_len))
    return prefill, dec, reason


def instance_loads_at(
    cost: CostModel,
    tbt_slo_s: float,
    forecast: DecodeForecast,
    decode: list[DecodeSlots],
    req_id: Hashable,
    input_len: int,
    now: float,
    t: float,
) -> list[float]:
    """Each decode instance's predicted load at t >= now if this request joins it then:
    each request of its batch still decoding at t given how long it has decoded
    (`DecodeTimes.still_decoding`), holding its prompt and what it will have generated,
    plus the requests whose prefill has started, that are bound to it and predicted to
    end by t, plus this request."""
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
    return loads


def place_at_start(
    cost: CostModel,
    tbt_slo_s: float,
    forecast: DecodeForecast,
    decode: list[DecodeSlots],
    req_id: Hashable,
    input_len: int,
    now: float,
    ready_at: float,
) -> tuple[DecodeSlots, float]:
    """§7.4 refreshed when the prefill starts: the decode instance with the lowest load
    predicted for when the request's KV lands (`ready_at`), and that load (> 1: reject)."""
    loads = instance_loads_at(cost, tbt_slo_s, forecast, decode, req_id, input_len, now, ready_at)
    best = min(range(len(decode)), key=loads.__getitem__)
    return decode[best], loads[best]


def decode_can_admit(
    cost: CostModel,
    tbt_slo_s: float,
    batch_size: int,
    context_tokens: int,
    input_len: int,
    capacity_tokens: int,
) -> bool:
    """The decode instance's own check when a request's KV arrives (paper §3 step 4): the
    KV fits and the next step keeps the TBT SLO."""
    tokens = context_tokens + input_len
    return tokens <= capacity_tokens and cost.decode_step_time(batch_size + 1, tokens) <= tbt_slo_s
