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
- `predictive` (§7.4): the decode pool's load is predicted for the moment this request's
  prefill ends, t = now + its predicted TTFT (`DecodeForecast.at`), plus this request.
"""

from __future__ import annotations

from mooncake.conductor.costmodel import CostModel
from mooncake.conductor.load import DecodeForecast, DecodeSlots
from mooncake.conductor.types import ConductorParams, RejectReason


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


def current_decode_load(
    cost: CostModel, params: ConductorParams, decode: list[DecodeSlots], input_len: int, now: float
) -> float:
    """§7.2: the decode pool's load now, with this request added."""
    n = sum(len(s.active) for s in decode) + 1
    tokens = sum(s.held_tokens(now) for s in decode) + input_len
    capacity = sum(s.capacity_tokens for s in decode)
    return pool_load(cost, params, capacity, len(decode), n, tokens)


def predicted_decode_load(
    cost: CostModel,
    params: ConductorParams,
    forecast: DecodeForecast,
    decode: list[DecodeSlots],
    input_len: int,
    t: float,
) -> float:
    """§7.4: the decode pool's average load at time t with this request added."""
    n, tokens = forecast.at(t)
    return pool_load(cost, params, forecast.capacity_tokens, len(decode), n + 1, tokens + input_len)


def decide(
    cost: CostModel,
    params: ConductorParams,
    forecast: DecodeForecast,
    decode: list[DecodeSlots],
    input_len: int,
    ttft_s: float,
    now: float,
) -> tuple[float, float, RejectReason]:
    """(prefill load, decode load, reason) for a request; reason "" means admit."""
    prefill = ttft_s / params.ttft_slo_s
    mode = params.rejection
    if mode == "basic":
        dec = current_decode_load(cost, params, decode, input_len, now)
    elif mode == "predictive":
        dec = predicted_decode_load(cost, params, forecast, decode, input_len, now + ttft_s)
    else:
        dec = 0.0
    if prefill > 1.0:
        return prefill, dec, "ttft_slo"
    if dec > 1.0:
        return prefill, dec, "decode_load"
    return prefill, dec, ""


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
