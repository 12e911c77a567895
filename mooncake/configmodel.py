"""[model] and [prefill]: the model the cluster serves and how its prompts are computed."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from mooncake.configbase import STRUCT as _STRUCT
from mooncake.configbase import knob
from mooncake.sizes import Size


class ModelConfig(msgspec.Struct, **_STRUCT):
    """[model]: the model every prefill and decode node serves."""

    path: Annotated[
        str,
        knob('A local model directory, or "dummy:NAME" for a built-in test model.', "modelpath"),
    ] = "dummy:tiny"
    dtype: Annotated[
        Literal["auto", "float32", "bfloat16", "float16"],
        knob("Weight and KV dtype; auto = the model's own."),
    ] = "auto"
    block_tokens: Annotated[
        int,
        knob(
            "Tokens per KV block, the prefix-hashing unit (public traces use 512).", ge=1, le=65536
        ),
    ] = 512
    max_model_len: Annotated[
        int, knob("Longest prompt+output in tokens; 0 = from the model.", ge=0)
    ] = 0


class PrefillConfig(msgspec.Struct, **_STRUCT):
    """[prefill]: prefill nodes."""

    chunk_tokens: Annotated[int, knob("Tokens per prefill chunk.", ge=1)] = 1024
    pipeline_group_size: Annotated[
        int, knob("Nodes per chunked pipeline-parallel prefill group; 0 = automatic.", ge=0)
    ] = 1
    kv_cache_bytes: Annotated[
        Size,
        knob(
            "Device memory for the paged KV cache of prompts being prefilled: bytes, or a "
            "percentage of the free GPU (CPU: available) memory.",
            "size",
        ),
    ] = Size(num_bytes=1 << 30)
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
