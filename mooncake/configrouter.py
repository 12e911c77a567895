"""The master's event feeds' settings: `[kv_events]` (the pool's KV events in vLLM's
format, `mooncake.kvevents`) and `[router]` (vLLM instances the master routes across,
`mooncake.router`); part of `mooncake.config.Config`."""

from __future__ import annotations

from typing import Annotated

import msgspec

from mooncake.configknob import STRUCT as _STRUCT
from mooncake.configknob import knob


class KvEventsConfig(msgspec.Struct, **_STRUCT):
    """[kv_events]: the master publishes every pool change as vLLM KV events."""

    enabled: Annotated[bool, knob("Publish the pool's KV events (vLLM's ZeroMQ format).")] = True
    endpoint: Annotated[
        str,
        knob(
            "ZeroMQ PUB address the master binds for KV event batches, tcp://HOST:PORT "
            "(port 0 = any free; `mooncake status --json` names the bound one) or ipc://PATH.",
            min_length=1,
        ),
    ] = "tcp://127.0.0.1:0"
    replay_endpoint: Annotated[
        str,
        knob(
            "ZeroMQ ROUTER address answering replay requests (an 8-byte start sequence "
            'number) from the last buffer_steps batches; "" = no replay.'
        ),
    ] = "tcp://127.0.0.1:0"
    topic: Annotated[str, knob("Topic frame of every batch (subscribers filter on it).")] = ""
    buffer_steps: Annotated[int, knob("Batches kept for replay.", ge=1)] = 10_000


class VllmBackendConfig(msgspec.Struct, **_STRUCT):
    """One vLLM instance behind the router."""

    url: Annotated[str, knob("Its OpenAI API base URL, e.g. http://10.0.0.5:8000.", min_length=1)]
    events: Annotated[
        str, knob("Its KV event PUB address (vLLM's kv_events_config endpoint).", min_length=1)
    ]
    replay: Annotated[str, knob('Its replay ROUTER address; "" = none.')] = ""
    topic: Annotated[str, knob("Its KV event topic.")] = ""


class RouterConfig(msgspec.Struct, **_STRUCT):
    """[router]: with backends, the master routes OpenAI requests across vLLM instances by
    the Conductor's Algorithm 1 (their prefix caches from their KV events, their load).
    model.path names the backends' checkpoint (its tokenizer) and model.block_tokens must
    be their --block-size."""

    backends: Annotated[
        tuple[VllmBackendConfig, ...],
        knob(
            "vLLM instances to route across, as [[router.backends]] tables with url, events "
            "and optionally replay and topic; empty = serve with our own prefill/decode nodes."
        ),
    ] = ()
    timeout_s: Annotated[
        float, knob("Seconds a backend may take to answer a request's headers.", gt=0)
    ] = 60.0
    resync_s: Annotated[
        float,
        knob(
            "Seconds without an event from a backend before its feed is checked for a gap "
            "(a replay request for what may have been missed).",
            gt=0,
        ),
    ] = 1.0
