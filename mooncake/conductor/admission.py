"""Admission and early rejection (paper §7): is there room for this request, before prefill?

Loads (§7.1): prefill load = predicted TTFT / TTFT SLO; decode load = predicted TBT / TBT
SLO, or the share of the decode instance's KV room the batch would use, whichever is
greater (a batch that does not fit cannot run at any TBT). Load > 1 means an SLO breaks.

Modes (`ConductorParams.rejection`):

- `none`: no early rejection. Algorithm 1 still rejects a request whose predicted TTFT
  breaks the SLO (that costs nothing), but the decode side is checked only by the decode
  instance when the KV arrives (`decode_can_admit`), after the prefill was spent.
- `basic` (§7.2): also reject at arrival when the chosen decode instance's load, with its
  current batch plus this request, is over 1. This ignores the requests already in
  prefill, which is what makes it oscillate (§7.3).
- `predictive` (§7.4): the decode load is predicted for the moment this request's prefill
  ends, t = now + TTFT: running requests leave once the uniform decode time t_d has passed,
  requests in prefill join once their predicted prefill end has passed, and the load is the
  pool's average TBT / SLO (the step-time polynomial at the mean batch and mean context,
  which equals the mean of the instances' TBTs when the polynomial is linear, as the
  roofline's is).
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
    num = len(decode)
    capacity = forecast.capacity_tokens / num
    return decode_load(cost, params.tbt_slo_s, (n + 1) / num, (tokens + input_len) / num, capacity)


def decide(
    cost: CostModel,
    params: ConductorParams,
    forecast: DecodeForecast,
    decode: list[DecodeSlots],
    slots: DecodeSlots,
    input_len: int,
    ttft_s: float,
    now: float,
) -> tuple[float, float, RejectReason]:
    """(prefill load, decode load, reason) for a request; reason "" means admit."""
    prefill = ttft_s / params.ttft_slo_s
    mode = params.rejection
    if mode == "basic":
        tokens = slots.active_tokens + input_len
        dec = decode_load(
            cost, params.tbt_slo_s, len(slots.active) + 1, tokens, slots.capacity_tokens
        )
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
