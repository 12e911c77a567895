"""The master's event feeds' settings: `[kv_events]` (the pool's KV events in vLLM's
format, `mooncake.kvevents`) and `[router]` (vLLM instances the master routes across,
`mooncake.router`); part of `mooncake.config.settings.Config`."""

from __future__ import annotations

from typing import Annotated

import msgspec

from mooncake.config.knob import STRUCT as _STRUCT
from mooncake.config.knob import knob
from mooncake.errors import ConfigError


class KvEventsConfig(msgspec.Struct, **_STRUCT):
    """[kv_events]: the master publishes every pool change as vLLM KV events."""

    enabled: Annotated[bool, knob("Publish the pool's KV events (vLLM's ZeroMQ format).")] = True
    endpoint: Annotated[
        str,
        knob(
            "ZeroMQ PUB address the master binds for KV event batches, tcp://HOST:PORT "
            "(port 0 = any free; `mooncake status --json` names the bound one) or ipc://PATH. "
            "Unauthenticated (vLLM's format has none): whoever reaches it learns no tokens, "
            "but every request's block count and timing; bind it to loopback or a private "
            "network.",
            min_length=1,
        ),
    ] = "tcp://127.0.0.1:0"
    replay_endpoint: Annotated[
        str,
        knob(
            "ZeroMQ ROUTER address answering replay requests (an 8-byte start sequence "
            'number) from the last buffer_steps batches; "" = no replay. Unauthenticated, '
            "as endpoint: loopback or a private network."
        ),
    ] = "tcp://127.0.0.1:0"
    topic: Annotated[str, knob("Topic frame of every batch (subscribers filter on it).")] = ""
    buffer_steps: Annotated[int, knob("Batches kept for replay.", ge=1)] = 10_000


class VllmBackend(msgspec.Struct, frozen=True, kw_only=True):
    """One vLLM instance behind the router (an entry of `router.backends`, parsed)."""

    url: str  # its OpenAI API base URL
    events: str  # its KV event PUB address (vLLM's kv_events_config endpoint)
    replay: str = ""  # its replay ROUTER address ("" = none)


def parse_backend(text: str) -> VllmBackend:
    """`"URL EVENTS [REPLAY]"` -> VllmBackend; raises ConfigError naming the entry."""
    parts = text.split()
    urls_ok = len(parts) in (2, 3) and parts[0].startswith(("http://", "https://"))
    if not urls_ok or not all(p.startswith(("tcp://", "ipc://")) for p in parts[1:]):
        raise ConfigError(
            f'router.backends: {text!r} is not "URL EVENTS [REPLAY]", e.g. '
            '"http://10.0.0.5:8000 tcp://10.0.0.5:5557 tcp://10.0.0.5:5558" (the instance\'s '
            "API, its --kv-events-config endpoint and replay_endpoint)"
        )
    return VllmBackend(url=parts[0].rstrip("/"), events=parts[1], replay=(parts[2:] or [""])[0])


class RouterConfig(msgspec.Struct, **_STRUCT):
    """[router]: with backends, the master routes OpenAI requests across vLLM instances."""

    backends: Annotated[
        tuple[str, ...],
        knob(
            'vLLM instances to route across, each "URL EVENTS [REPLAY]": its API base URL, '
            "its KV event PUB address and (optional) replay address (vLLM's "
            "--kv-events-config endpoint and replay_endpoint); requests are placed by "
            "Algorithm 1 (their caches from their KV events, their load); model.path must be "
            "their checkpoint and model.block_tokens their --block-size; empty = serve with "
            "our own prefill/decode nodes."
        ),
    ] = ()
    topic: Annotated[str, knob("Topic of the backends' KV events (vLLM's default: none).")] = ""
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

    replay_timeout_s: Annotated[
        float, knob("Seconds a backend's replay socket may take to answer a replay request.", gt=0)
    ] = 5.0
    max_batch_bytes: Annotated[
        int,
        knob(
            "Largest KV event batch a backend's sockets may deliver (a size without %); a "
            "larger frame drops that connection before it is buffered (ZeroMQ reconnects), so "
            "a peer cannot make the master hold it.",
            "bytes",
            ge=65536,
        ),
    ] = 16 << 20

    @property
    def backend_list(self) -> list[VllmBackend]:
        """The backends, parsed (raises ConfigError naming a malformed entry)."""
        return [parse_backend(b) for b in self.backends]
