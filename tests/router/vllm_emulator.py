"""A strict stand-in for a vLLM instance with prefix caching and KV events, for the router
tests where vLLM is not installed: `python -m tests.router.vllm_emulator --model PATH
--port P --block-size B --kv-events-config JSON` (vLLM's own flags).

What the router sees is vLLM 0.32's: `/v1/models`, a streaming `/v1/completions` taking
token-id prompts with `return_token_ids` (chunks with `token_ids`, the last with
`finish_reason`), `/metrics` with `vllm:prefix_cache_{queries,hits}_total` and
`vllm:request_success_total`, `/reset_prefix_cache` (vLLM's dev endpoint), and KV events
as vLLM publishes them: one `BlockStored` per request for its new full blocks (64-bit
int hashes chained from the parent's, the blocks' token ids, `medium` "GPU",
`extra_keys` None per block, `group_idx` 0, `kv_cache_spec_kind` "full_attention"), sent
and replayed by the same PUB/ROUTER protocol (`mooncake.kvevents.publisher`, whose bytes
tests/kvevents/test_wire.py checks against vLLM's). The output is one fixed token
repeated: no model runs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from collections.abc import AsyncIterator

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from mooncake.kvevents.publisher import Publisher
from mooncake.kvevents.wire import AllBlocksCleared, BlockStored, KVEventBatch

OUTPUT_TOKEN = 7


class PrefixCache:
    """vLLM's prefix cache as its events describe it: chained block hashes, never evicted."""

    def __init__(self, block_size: int, publisher: Publisher):
        self.block_size = block_size
        self.publisher = publisher
        self.blocks: set[int] = set()
        self.hits = self.queries = self.done = 0

    def admit(self, tokens: list[int]) -> None:
        bs, parent, first_parent = self.block_size, None, None
        new: list[bytes | int] = []
        new_tokens: list[int] = []
        self.queries += len(tokens)
        for i in range(len(tokens) // bs):
            chunk = tokens[i * bs : (i + 1) * bs]
            digest = hashlib.sha256(json.dumps([parent, chunk]).encode()).digest()
            h = int.from_bytes(digest[:8], "big")
            if h in self.blocks and not new:
                self.hits += bs
            else:
                if not new:
                    first_parent = parent
                new.append(h)
                new_tokens += chunk
                self.blocks.add(h)
            parent = h
        if new:
            ev = BlockStored(
                block_hashes=new,
                parent_block_hash=first_parent,
                token_ids=new_tokens,
                block_size=bs,
                lora_id=None,
                medium="GPU",
                lora_name=None,
                extra_keys=[None] * len(new),
                group_idx=0,
                kv_cache_spec_kind="full_attention",
            )
            self.publisher.publish(
                [KVEventBatch(ts=time.time(), events=[ev], data_parallel_rank=0)]
            )

    def reset(self) -> None:
        """vLLM's /reset_prefix_cache: every block dropped, one AllBlocksCleared."""
        self.blocks.clear()
        batch = KVEventBatch(ts=time.time(), events=[AllBlocksCleared()], data_parallel_rank=0)
        self.publisher.publish([batch])


def create_app(model: str, cache: PrefixCache) -> Starlette:
    async def models(_: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": model, "object": "model"}]})

    async def completions(request: Request) -> Response:
        body = await request.json()
        prompt = body["prompt"]
        if not (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
            return JSONResponse({"error": {"message": "token-id prompts only"}}, status_code=400)
        cache.admit(prompt)
        n = int(body.get("max_tokens") or 16)

        async def chunks() -> AsyncIterator[str]:
            for i in range(n):
                last = i == n - 1
                choice = {
                    "index": 0,
                    "text": "x",
                    "token_ids": [OUTPUT_TOKEN],
                    "finish_reason": "length" if last else None,
                }
                yield f"data: {json.dumps({'choices': [choice]})}\n\n"
            cache.done += 1
            yield "data: [DONE]\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    async def reset(_: Request) -> Response:
        cache.reset()
        return PlainTextResponse("")

    async def metrics(_: Request) -> Response:
        labels = f'{{engine="0",model_name="{model}"}}'
        lines = [
            f"vllm:prefix_cache_queries_total{labels} {float(cache.queries)}",
            f"vllm:prefix_cache_hits_total{labels} {float(cache.hits)}",
            f'vllm:request_success_total{{engine="0"}} {float(cache.done)}',
        ]
        return PlainTextResponse("\n".join(lines) + "\n")

    return Starlette(
        routes=[
            Route("/v1/models", models),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/metrics", metrics),
            Route("/reset_prefix_cache", reset, methods=["POST"]),
        ]
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--block-size", type=int, required=True)
    ap.add_argument("--kv-events-config", required=True)
    args, _ = ap.parse_known_args()
    kv = json.loads(args.kv_events_config)
    publisher = Publisher(
        kv["endpoint"], kv.get("replay_endpoint") or "", topic=kv.get("topic", "")
    )
    cache = PrefixCache(args.block_size, publisher)
    try:
        uvicorn.run(
            create_app(args.model, cache), host=args.host, port=args.port, log_level="warning"
        )
    finally:
        publisher.close()


if __name__ == "__main__":
    main()
