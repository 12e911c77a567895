"""How long a prefill takes on a pipeline group, shared by the Conductor and the simulator.

A group of S stages holds the model's layers split S ways. A prompt of C chunks (the
tokens it computes, `chunk_tokens` at a time) flows through the stages like a pipeline:
stage k works on chunk j while stage k+1 works on chunk j-1. With T the prefill time of
the whole model on one node (the cost model's), one chunk on one stage takes T / (S C), so

    stage_s   = T / S                     stage 0 is busy this long: the group takes a
                                          new request every stage_s (requests pipeline too)
    latency_s = T / S * (C + S - 1) / C   first chunk in -> last chunk out of the last stage

S = 1 gives T either way. The KV streams to the decode node layer by layer while the next
layers compute, so the hand-off ends one layer's write after the last layer's compute
(`stream_tail_s`), not a whole prompt's transfer after it.

Pure arithmetic, no state.
"""

from __future__ import annotations


def num_chunks(new_tokens: int, chunk_tokens: int) -> int:
    """Chunks a prefill of `new_tokens` computed tokens runs in (at least 1; 0 = one chunk)."""
    if chunk_tokens <= 0 or new_tokens <= chunk_tokens:
        return 1
    return -(-new_tokens // chunk_tokens)


def pipeline_times(prefill_s: float, chunks: int, stages: int) -> tuple[float, float]:
    """(stage_s, latency_s) of a prefill taking `prefill_s` on the whole model, run in
    `chunks` chunks through `stages` stages (module docstring)."""
    if stages <= 1:
        return prefill_s, prefill_s
    stage_s = prefill_s / stages
    return stage_s, stage_s * (chunks + stages - 1) / chunks


def inflight_bound(prompts: int, chunks: int, stages: int) -> float:
    """The throughput gain of a group given `prompts` equal prompts at once over the same
    group taking them one at a time, if compute were all: N latency_s against (N - 1)
    stage_s + latency_s. A prompt of many chunks already keeps every stage busy but for
    its first and last chunks, so the gain shrinks as chunks grow (2 stages: 4 prompts of
    4 chunks 1.18x, of 1 chunk 1.6x)."""
    stage_s, latency_s = pipeline_times(1.0, chunks, stages)
    return prompts * latency_s / ((prompts - 1) * stage_s + latency_s)


def stream_tail_s(chunk_kv_bytes: float, num_layers: int, bytes_per_s: float) -> float:
    """Seconds the streamed hand-off lasts past the last layer's compute: one layer's KV
    of the last chunk written to the decode node."""
    return chunk_kv_bytes / max(num_layers, 1) / bytes_per_s if chunk_kv_bytes > 0 else 0.0
