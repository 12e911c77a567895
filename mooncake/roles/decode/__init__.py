"""A decode node: reserve and receive a request's KV, continuous batching, tokens out.

- `role`  `run_decode`: the node, its handlers and the loop that owns the runner
- `kv`    what it checks and keeps of a request's KV (layers landed, output KV to the pool)
"""
