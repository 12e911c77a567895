"""The serving roles' settings: `[prefill]`, `[decode]` and `[scheduler]` (the Conductor),
one frozen struct per section, part of `mooncake.config.settings.Config`."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from mooncake.config.knob import STRUCT as _STRUCT
from mooncake.config.knob import knob
from mooncake.config.sizes import Size, format_size

# "auto" KV caches (roles/node/kvsize.py): on a GPU this share of the memory left once the
# weights are loaded and a warm-up ran at the largest batch, less its activation peak; on a
# CPU node fixed bytes, since the host's RAM also holds the pool's DRAM tier
AUTO_KV_GPU_SHARE = 0.9
PREFILL_CPU_KV_BYTES = 1 << 30
DECODE_CPU_KV_BYTES = 2 << 30


def _kv_help(what: str, warmup: str, cpu_bytes: int) -> str:
    share = f"{AUTO_KV_GPU_SHARE * 100:g}%"
    return (
        f'Device memory for the paged KV cache of {what}: "auto" (on a GPU {share} of '
        f"the memory still free once the model is loaded and {warmup} ran, less the "
        f"activation peak of that run; on a CPU node {format_size(cpu_bytes)}), bytes, or a "
        "percentage (on a GPU of that same free memory; on a CPU node of the available "
        "RAM)."
    )


class PrefillConfig(msgspec.Struct, **_STRUCT):
    """[prefill]: prefill nodes."""

    chunk_tokens: Annotated[int, knob("Tokens per prefill chunk.", ge=1)] = 1024
    pipeline_group_size: Annotated[
        int, knob("Nodes per chunked pipeline-parallel prefill group; 0 = automatic.", ge=0)
    ] = 1
    kv_cache_bytes: Annotated[
        Size,
        knob(
            _kv_help("prompts being prefilled", "one chunk of chunk_tokens", PREFILL_CPU_KV_BYTES),
            "size",
            allows_auto=True,
        ),
    ] = Size(is_auto=True)
    stage_retry_s: Annotated[
        float,
        knob(
            "Longest pause between a pipeline leader's attempts to reach its next stage "
            "after the link broke (it asks the master where that stage is now, backing "
            "off from a tenth of this); its group takes no requests meanwhile.",
            gt=0,
        ),
    ] = 2.0
    stage_timeout_s: Annotated[
        float, knob("Leader's wait (s) per chunk on its next stage, then the task moves on.", gt=0)
    ] = 30.0
    max_inflight: Annotated[
        int,
        knob(
            "Requests in flight per prefill group: the first stage starts the next prompt "
            "while later stages finish this one, and KV streams out meanwhile.",
            ge=1,
        ),
    ] = 4
    reserve_timeout_s: Annotated[
        float,
        knob(
            "Wait (s) for room for a prompt's KV on its decode node before the prefill "
            "starts; past it the request fails, naming the full node.",
            gt=0,
        ),
    ] = 30.0
    decode_call_timeout_s: Annotated[
        float,
        knob(
            "Seconds a prefill node waits for its decode node to answer one call (reserve, "
            "submit, release); past it the decode node counts as unreachable and the master "
            "places the request again.",
            gt=0,
        ),
    ] = 10.0
    reserve_poll_s: Annotated[
        float,
        knob("Pause (s) between asks for room on a decode node that has none yet.", gt=0),
    ] = 0.02


class DecodeConfig(msgspec.Struct, **_STRUCT):
    """[decode]: decode nodes."""

    max_batch: Annotated[int, knob("Most requests decoded together in one step.", ge=1)] = 128
    max_tokens_default: Annotated[
        int, knob("Output tokens when a request does not say max_tokens.", ge=1)
    ] = 256
    kv_cache_bytes: Annotated[
        Size,
        knob(
            _kv_help(
                "decoding requests",
                "one decode step of max_batch requests (one of them prefilled locally "
                "first, a chunk of prefill.chunk_tokens)",
                DECODE_CPU_KV_BYTES,
            ),
            "size",
            allows_auto=True,
        ),
    ] = Size(is_auto=True)
    drain_s: Annotated[
        float,
        knob(
            "Seconds a stopping decode node lets its running requests finish before it "
            "ends them with an error.",
            ge=0,
        ),
    ] = 30.0
    reserve_ttl_s: Annotated[
        float,
        knob(
            "Seconds blocks reserved for a prefill node's KV stay set aside without the "
            "request being submitted; then they are freed (its prefill node died or "
            "gave up).",
            gt=0,
        ),
    ] = 120.0
    max_step_failures: Annotated[
        int,
        knob(
            "Consecutive failed decode steps (each ends the requests of that step with "
            "an error) after which the node stops reporting ready and exits, for its "
            "supervisor to restart it.",
            ge=1,
        ),
    ] = 3
    stall_timeout_s: Annotated[
        float,
        knob(
            "Seconds one decode step may run before the node declares its step loop "
            "stuck, fails its requests and exits (for its supervisor to restart it).",
            gt=0,
        ),
    ] = 120.0
    step_interval_s: Annotated[
        float,
        knob(
            "Least seconds from one decode step's start to the next's (0: back to back). "
            "A decode node sharing its cores with prefill work leaves them the time its "
            "steps do not need (a step of a fraction of the TBT SLO); keep it well under "
            "scheduler.tbt_slo_s, and at 0 on a node with devices of its own.",
            ge=0,
        ),
    ] = 0.0
    poll_s: Annotated[
        float,
        knob(
            "Seconds the idle step loop, and a draining node, wait between looks at their "
            "work (a submitted request wakes the loop at once).",
            gt=0,
        ),
    ] = 0.05
    token_resend_s: Annotated[
        float,
        knob(
            "Seconds a decode node waits for the master to acknowledge a token event before "
            "it sends the event again (the master drops duplicates and restores the order).",
            gt=0,
        ),
    ] = 1.0
    token_max_resends: Annotated[
        int,
        knob(
            "Times one token event is sent again without an acknowledgement before the "
            "decode node gives its request up (ends it here; the master ends the HTTP "
            "request with an error by its deadline).",
            ge=0,
        ),
    ] = 5


class SchedulerConfig(msgspec.Struct, **_STRUCT):
    """[scheduler]: the Conductor (paper Algorithm 1)."""

    policy: Annotated[
        Literal["random", "round_robin", "load_balance", "cache_aware", "kvcache_centric"],
        knob("How the Conductor picks prefill and decode instances."),
    ] = "kvcache_centric"
    ttft_slo_s: Annotated[float, knob("Time-to-first-token SLO, seconds.", gt=0)] = 30.0
    tbt_slo_s: Annotated[float, knob("Time-between-tokens SLO, seconds.", gt=0)] = 0.1
    balancing_threshold: Annotated[
        float,
        knob(
            "Algorithm 1's kvcache_balancing_threshold: a prefill node fetches a longer prefix "
            "from another node only if best_prefix_len / its own prefix_len reaches this ratio, "
            "else it recomputes.",
            ge=1.0,
        ),
    ] = 1.5
    rejection: Annotated[
        Literal["none", "basic", "predictive"],
        knob(
            "Early rejection under overload: none; basic (reject on the current max of "
            "TTFT/SLO and TBT/SLO); predictive (on the decode load predicted for when the "
            "request's prefill ends, which avoids load oscillation)."
        ),
    ] = "predictive"
    forecast_sigmas: Annotated[
        float,
        knob(
            "Predictive rejection at arrival waits for the predicted decode load to exceed 1 "
            "by this many standard deviations of the forecast's own measured error.",
            ge=0,
        ),
    ] = 2.0
    defer_s: Annotated[
        float,
        knob(
            "A request refused only for the prefill queue ahead of it (its own TTFT meets "
            "ttft_slo_s) waits up to this many seconds for a prefill group with nothing "
            "queued and runs there, late but in capacity no queued request needed; then "
            "429. It waits only if a group is predicted idle for it within this time, "
            "behind the requests already waiting (oldest first); else 429 at once. "
            "0 = refused at once, as the paper's early rejection does.",
            ge=0,
        ),
    ] = 10.0
    defer_window_s: Annotated[
        float,
        knob(
            "A request may start waiting (defer_s) only while the prefill work that "
            "arrived over about this many seconds (an exponential average) fits the groups' "
            "capacity: bursts wait, sustained overload is refused at once.",
            gt=0,
        ),
    ] = 30.0
    cost_model_path: Annotated[
        str,
        knob(
            'Cost model from `mooncake profile`, a path on the master\'s machine; "" = '
            "analytic roofline of the model's shape on the GPUs of the first prefill node "
            "that reports known ones (until then the master's, else H800 x8)."
        ),
    ] = ""
    node_wait_s: Annotated[
        float,
        knob(
            "Seconds a request waits for a prefill group and a decode node when none can "
            "take it (a node restarting): a new request, or one whose node died and is "
            "placed again; then it fails (503). 0 = fail at once.",
            ge=0,
        ),
    ] = 60.0
    node_poll_s: Annotated[
        float,
        knob("Pause (s) between attempts to place a request waiting for a node.", gt=0),
    ] = 0.25
    commit_wait_s: Annotated[
        float,
        knob(
            "Seconds the master holds a request's last output for its prefill node's report, "
            "which comes once the request's new KV blocks are committed to the pool: an "
            "immediate repeat then reuses them, and the usage's cached_tokens is exact. "
            "Past it (a report lost) the request ends without them.",
            ge=0,
        ),
    ] = 5.0
    miss_memory_blocks: Annotated[
        int,
        knob(
            "Evicted blocks the master remembers (hash and age at eviction, about 175 bytes "
            "each) to tell an evicted block from a cold one in its miss attribution; past it "
            "the oldest eviction is forgotten, and that block, missed again, counts as cold.",
            ge=0,
        ),
    ] = 1_000_000
    deadline_factor: Annotated[
        float,
        knob(
            "A request's deadline, counted from its arrival, is deadline_slack_s + "
            "deadline_factor x (ttft_slo_s + max_tokens x tbt_slo_s): past it the HTTP request "
            "ends with an error and everything it held is released.",
            gt=0,
        ),
    ] = 3.0
    deadline_slack_s: Annotated[
        float,
        knob(
            "Seconds added to every request's deadline (see deadline_factor): room for "
            "waiting on a restarting node and for a re-placement.",
            ge=0,
        ),
    ] = 60.0
