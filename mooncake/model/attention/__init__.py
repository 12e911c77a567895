"""Paged attention over the engine's KV cache for a whole step: decode rows and prefill
chunks in one batch.

- `backend`       the model's seam: `select_backend` (torch, triton, flash), one call per layer
- `metadata`      `AttentionMetadata`: a step's block tables, lengths, query offsets, slots
- `reference`     the torch oracle and baseline: a sequence at a time through SDPA
- `triton_paged`  `paged_attention`: one Triton launch per layer, split-KV for small decode
- `kvwrite`       `write_kv`: new K/V into the cache by slot mapping (Triton)
- `timing`        microseconds per call on a GPU (L2 flushed, CUDA graphs), the copy ceiling
- `gpucheck`      `python -m mooncake.model.attention.gpucheck`: correctness and speed on a GPU

`triton_paged` and `kvwrite` need triton (`timing` on a GPU too); all need torch.
"""
