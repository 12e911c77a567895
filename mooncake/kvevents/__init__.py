"""KV events in vLLM's wire format: the pool's changes published for KV-aware routers.

- `wire.py`: vLLM's `KVEventBatch` and its events (both encodings read, vLLM 0.32's written).
- `publisher.py`: `Publisher`, the ZeroMQ PUB socket and the replay ROUTER socket.
- `pool.py`: `PoolEvents`, Store events -> batches, one data_parallel_rank per pool node.
- `feed.py`: `PoolFeed`, the master's feed: the two above, wired to the Store's events.
"""
