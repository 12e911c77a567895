"""Where TTFT went, on the real cluster and on its simulated twin, phase by phase.

The master splits each request's TTFT into queue, prefill (start until every layer's KV
landed on the decode node) and first step (`roles/master/timeline.py`, `ttft_phases` in its
status). The twin's requests are split the same way: queue from placement (after the
control plane's fixed latency) to prefill start, prefill until the KV landed, first step
until the first token. Side by side they say which phase the twin gets wrong, which a
TTFT percentile alone cannot.
"""

from __future__ import annotations

from collections.abc import Iterable

from mooncake.api.status import Status, TtftPhases
from mooncake.roles.master.timeline import phase_summary
from mooncake.sim.metrics import SimRequest


def sim_phases(requests: Iterable[SimRequest], overhead_s: float) -> TtftPhases:
    """The TTFT phases of the twin's completed requests (`overhead_s`: the control plane's
    latency before placement, which the master's queue does not count)."""
    rows = []
    for r in requests:
        if r.status != "done" or r.prefill_start < 0:
            continue
        landed = min(max(r.stream_end, r.prefill_end), r.first_token_at)
        rows.append(
            (
                r.prefill_start - (r.arrival + overhead_s),
                landed - r.prefill_start,
                r.first_token_at - landed,
            )
        )
    return phase_summary(rows)


def master_status(url: str, api_key: str) -> Status | None:
    """The master's status snapshot now (None when it cannot be read: what `bench
    cluster` takes from it is a diagnosis, never a reason to fail the run)."""
    import httpx

    from mooncake.cli.status import Master, fetch_status
    from mooncake.errors import MooncakeError

    try:
        with httpx.Client(timeout=30.0) as client:
            return fetch_status(client, Master(url, api_key, "bench cluster"))
    except MooncakeError:
        return None
