"""`RouterBackend`: the master's API backend when it routes across vLLM instances.

A request's way: hash its prompt (the chained hashes `BlockMap` indexes each instance's
cache under) -> `Conductor.schedule` over the instances as coupled ones (Algorithm 1:
each instance's prefix in its own cache, the pool's prefix when store nodes are
registered, each instance's queue) -> stream it from the chosen instance's
`/v1/completions` as token ids (vLLM's `return_token_ids`) -> report its progress to the
Conductor's books (prefill started, first token, finished or dropped) so the next choice
sees the load. A rejection by the Conductor's admission is HTTP 429 as on the cluster.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import httpx

from mooncake.api.backend import BaseBackend, FinishReason, GenerateRequest, Output, Rejected
from mooncake.api.status import BackendStatus
from mooncake.conductor.conductor import Conductor
from mooncake.conductor.types import Decision, ScheduleRequest
from mooncake.config.router import RouterConfig
from mooncake.config.settings import Config
from mooncake.errors import ApiError, MooncakeError
from mooncake.kv.hashing import PrefixHasher
from mooncake.model.tokenizer import BaseTokenizer
from mooncake.router.blockmap import BlockMap
from mooncake.router.feed import BackendFeed

log = logging.getLogger(__name__)
T = TypeVar("T")


class BackendError(MooncakeError):
    """A vLLM instance did not serve a request (names the instance and its answer)."""


class RouterBackend(BaseBackend):
    """Routes each request to one vLLM instance; owns the instances' event feeds."""

    def __init__(
        self,
        config: RouterConfig,
        conductor: Conductor,
        lock: threading.Lock,  # guards the Conductor (the master's)
        hasher: PrefixHasher,
        tokenizer: BaseTokenizer,
        model_name: str,
        max_model_len: int,
    ):
        self.conductor, self.lock, self.hasher = conductor, lock, hasher
        self.tokenizer, self.model_name, self.max_model_len = tokenizer, model_name, max_model_len
        self.timeout_s = config.timeout_s
        self.urls: dict[str, str] = {}  # instance name -> its API base URL
        self.feeds: list[BackendFeed] = []
        self.routed: dict[str, int] = {}  # instance name -> requests sent to it
        self._served: dict[str, str] = {}  # instance name -> the model id it serves
        for i, b in enumerate(config.backend_list):
            name = f"vllm-{i}"
            self.urls[name] = b.url
            self.routed[name] = 0
            conductor.add_coupled_instance(name)
            blocks = BlockMap(name, conductor.index, hasher)
            self.feeds.append(
                BackendFeed(
                    b,
                    config.topic,
                    blocks,
                    lock,
                    resync_s=config.resync_s,
                    replay_timeout_s=config.replay_timeout_s,
                    max_batch_bytes=config.max_batch_bytes,
                )
            )
        self._ids = itertools.count(1)
        self._client: httpx.AsyncClient | None = None

    def start(self) -> None:
        for f in self.feeds:
            f.start()

    def stop(self) -> None:
        for f in self.feeds:
            f.stop()

    def statuses(self) -> list[BackendStatus]:
        """Each instance's row of /v1/status (takes the Conductor's lock)."""
        with self.lock:
            return [
                BackendStatus(
                    name=f.blocks.name,
                    url=self.urls[f.blocks.name],
                    num_blocks=len(f.blocks),
                    num_routed=self.routed[f.blocks.name],
                    num_batches=f.num_batches,
                    num_replayed=f.num_replayed,
                )
                for f in self.feeds
            ]

    async def _locked(self, fn: Callable[..., T], *args: Any) -> T:
        def call() -> T:
            with self.lock:
                return fn(*args)

        return await asyncio.to_thread(call)

    async def generate(self, req: GenerateRequest) -> AsyncIterator[Output]:
        if req.params.n > 1:
            raise ApiError(
                f"n: {req.params.n} choices (or best_of) are not served when the master "
                "routes to vLLM instances (router.backends); send n=1 requests"
            )
        rid = next(self._ids)
        hashes = self.hasher.hash_blocks(req.prompt_ids)
        sched = ScheduleRequest(rid, len(req.prompt_ids), hashes)
        decision: Decision = await self._locked(self.conductor.schedule, sched, time.monotonic())
        if not decision.is_accepted:
            raise Rejected(f"request {req.req_id} rejected by admission: {decision.reason}")
        name = decision.prefill
        self.routed[name] += 1
        log.debug(
            "req %s -> %s (%d of %d blocks cached there)",
            req.req_id,
            name,
            decision.local_blocks,
            len(hashes),
        )
        await self._locked(self.conductor.on_prefill_started, rid, time.monotonic())
        is_done = False
        try:
            first = True
            async for out in self._stream(name, req):
                if first:
                    first = False
                    await self._locked(self._first_token, rid, time.monotonic())
                yield out
            is_done = True
        finally:
            end = (
                self.conductor.on_decode_finished if is_done else self.conductor.on_request_dropped
            )
            await self._locked(end, rid, time.monotonic())

    def _first_token(self, rid: int, now: float) -> None:
        self.conductor.on_prefill_finished(rid, now)
        self.conductor.on_decode_started(rid, now)

    async def _stream(self, name: str, req: GenerateRequest) -> AsyncIterator[Output]:
        """The request's tokens from instance `name` (raises BackendError before the first)."""
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self.timeout_s)
        url, p = self.urls[name], req.params
        body = {
            "model": await self._model(name),
            "prompt": req.prompt_ids,
            "stream": True,
            "max_tokens": p.max_tokens,
            "temperature": p.temperature,
            "top_p": p.top_p,
            "top_k": p.top_k or -1,
            "seed": p.seed,
            "ignore_eos": p.ignore_eos,
            "stop": list(p.stop),
            "stop_token_ids": list(p.stop_token_ids),
            "return_token_ids": True,
            "logit_bias": {str(t): b for t, b in p.logit_bias},
            "min_tokens": p.min_tokens,
        }
        try:
            async with self._client.stream("POST", url + "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    text = (await r.aread()).decode(errors="replace")[:300]
                    raise BackendError(f"{name} ({url}) answered {r.status_code}: {text}")
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    for out in _outputs(json.loads(line[6:])):
                        yield out
        except httpx.HTTPError as e:
            raise BackendError(f"{name} ({url}) failed: {e}") from e

    async def _model(self, name: str) -> str:
        model = self._served.get(name)
        if model is None:
            assert self._client is not None
            r = await self._client.get(self.urls[name] + "/v1/models")
            model = self._served[name] = r.json()["data"][0]["id"]
        return model


def _outputs(chunk: dict[str, Any]) -> list[Output]:
    """A vLLM stream chunk's tokens as Outputs (the text goes with the chunk's last)."""
    choices = chunk.get("choices") or []
    if not choices:
        return []
    c = choices[0]
    ids, text, finish = c.get("token_ids") or [], c.get("text") or "", c.get("finish_reason")
    outs = [Output(token_id=t, text="") for t in ids[:-1]]
    last = ids[-1] if ids else None
    reason: FinishReason | None = "length" if finish == "length" else ("stop" if finish else None)
    if last is not None or reason is not None:
        outs.append(Output(token_id=last, text=text, finish_reason=reason))
    return outs


def create_router(
    config: Config,
    conductor: Conductor,
    lock: threading.Lock,
    tokenizer: BaseTokenizer,
    model_name: str,
    max_model_len: int,
) -> RouterBackend | None:
    """The router `config.router` describes (None when it lists no backends), hashing
    prompts as the pool does for `config.model`."""
    if not config.router.backends:
        return None
    from mooncake.model.info import kv_fingerprint, load_model_info, resolve_dtype

    info = load_model_info(config.model.path)
    dtype = resolve_dtype(info, config.model.dtype, "cpu")
    secret = config.cluster.require_secret()
    hasher = PrefixHasher(config.model.block_tokens, secret, kv_fingerprint(info, dtype))
    return RouterBackend(
        config.router, conductor, lock, hasher, tokenizer, model_name, max_model_len
    )
