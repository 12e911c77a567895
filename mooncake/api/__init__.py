"""The OpenAI-compatible HTTP API: what a client of the cluster talks to.

- `backend.py`: the contract behind the API (`BaseBackend`, `GenerateRequest`, `Output`,
  `Rejected`); the master's cluster backend and `EngineBackend` implement it.
- `app.py`: `create_app(backend, ...)`: routes, API keys, OpenAI error bodies.
- `schemas.py` / `bodies.py`: request bodies in (msgspec), response bodies and chunks out.
- `openapi.py`: the OpenAPI 3.1 document of the routes, served at `/openapi.json`.
- `serving.py`: one generation request: parse, tokenize, start, stream (SSE) or collect.
- `tools/`: tool calling: the request's tool plan, the prompt's tools, calls read from the
  output (Hermes, Llama 3 JSON, `required` / named under a grammar) as deltas and message.
- `stats.py`: `RequestStats`: outcome counts and recent TTFT/TBT, plus Prometheus metrics.
- `status.py`: the `/v1/status` snapshot that `mooncake status` reads.
- `server.py`: `ApiServer`: uvicorn on a pre-bound socket, in this thread or another.
- `engine_backend.py`: `EngineBackend`: a whole model in this process (`mooncake serve`).

Importing this package imports none of them (the CLI stays quick to start).
"""
