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
  requests are known with their ages, so the forecast is sharp; the request is rejected,
  still before any prefill is spent, when even the best instance's load is over 1.

A request refused only for the prefill queue ahead of it (its own TTFT meets the SLO) may
wait (`ConductorParams.defer_s`, `Decision.can_wait`) in the Conductor's waiting room
(`mooncake.conductor.waiting`): it runs, oldest first, on a prefill group with nothing
queued (`Conductor.schedule(waited=True)`), late, in capacity no queued request needed.
It enters only while the prefill work offered over the last `defer_window_s` or so fits
the groups (`Conductor.offered_load`) and a group is predicted idle for it within
`defer_s` behind those already waiting; else it is refused at once. Arrivals come in
bursts (the conversation trace's timestamps are bucketed to ~1 s: 10-16 requests at one
instant); without the wait a burst the cluster drains in seconds is mostly refused while
the cluster then idles. Under sustained overload a waiting request would take an idle
group from the next burst's first requests, which could still meet the SLO: the offered-
load bound keeps it out. And a request that would wait `defer_s` only to be refused then
is refused on arrival: the client learns at once, and a run under overload does not end
with a tail of late refusals. Simulated on 145 requests of the trace (2 prefill stages
and 1 decode node on 2 CPU cores, TTFT SLO 2 s, `defer_s` 10, window 30 s): at replay
speeds 0.1 and 0.2, 112 and 98 served instead of 54, SLO attainment 0.37 and 0.36 against
0.35; at 0.35 (about the cluster's capacity) 69 against 54, attainment 0.30 against 0.35;
at 4, 8 and 16 (overload) 1-4 more served, attainment equal or better. On the real
`up --local` (same slice and shape): speed 0.2, 92 served instead of 50, attainment 0.35
against 0.30; speeds 4, 8 and 16, output 1.7-2.6x, 1.7-1.9x and 4.0-4.2x vLLM for
CPU's over two runs (with waiting bounded by the offered load alone, where requests
waited 10 s to be refused: 1.0x, 1.4x and 1.0x).

Which decode instance gets the KV is placement (`mooncake.conductor.placement`), and late
binding at prefill start applies in every mode, so the modes differ only in their
rejection rule. Measured on the conversation trace (9P+2D, 15P+3D, 18P+4D, 3-4 speeds
each) the three rules then reject within a few percent of each other, in no stable order:
decode KV room binds, the decode instance's own check at landing sees it exactly, and an
arrival-time view is a TTFT (~25 s, the saturated prefill queue) stale, longer than a
request decodes (~20 s).
"""

from __future__ import annotations

from mooncake.conductor.costmodel import CostModel
from mooncake.conductor.forecast import DecodeForecast, ForecastError
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
