"""Measurements behind `mooncake bench ...` and `mooncake soak` (the CLI verbs are thin
wrappers in `mooncake.cli`).

- `store`, `storeprocs`, `upstream`, `upstream_driver`   Store put/get against upstream
- `transfer`, `transferbase`   Transfer Engine GB/s against same-run socket and memcpy
- `engine`, `handoff`   engine throughput, layer-wise store, pipeline, streamed hand-off
- `stepops`   ops dispatched and host syncs of one decode step, counted on a CPU
- `ggufload`   a GGUF file's load and decode against transformers on the same file
- `calibrate`, `phases`, `hostprobe`   a real local cluster against its simulated twin
- `repeats`, `faults`   prefix reuse on repeats; a replay under an injected fault
- `versus`, `routing`, `servers`, `checkpoint`   against vLLM on one random checkpoint
- `soak/`   a local cluster under load and faults for a set time
- `stepops`   the ops and host syncs of one decode step, counted on a CPU
- `gpubench/`   `scripts/gpubench`: the engine on one GPU against its physical limits
"""
