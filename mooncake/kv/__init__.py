"""KV bytes and their movement, apart from the model that makes them and the processes
that move them.

- `hashing`   chained prefix block hashes (torch-free)
- `keys`      pool keys of KV blocks (torch-free)
- `object`    the pool's KV object format: header, token ids, per-layer digests, K/V
- `layerio`   `BaseKVSource`/`BaseKVSink`, the in-process DRAM pool, the layer-wise loader
- `stream`    KV streamed out layer by layer while a prefill computes
- `pool`      `StoreKVPool`: the engine's KV source and sink over the cluster's Store
- `handoff`   a paged KV cache as Transfer Engine segments, the ends of every hand-off
"""
