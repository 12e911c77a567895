"""The master as a KV-aware router in front of vLLM instances (`[router] backends`).

- `blockmap.py`: `BlockMap`, a backend's vLLM block hashes -> our prefix hashes, its KV
  events applied to the Conductor's prefix index (pure logic).
- `feed.py`: `BackendFeed`, one backend's KV event subscription (gaps and restarts
  replayed through its replay socket), on a thread of its own.
- `backend.py`: `RouterBackend`, the API's backend: Algorithm 1 picks the instance, the
  request is streamed from its OpenAI API.
"""
