"""A whole model in this process behind the API: the coupled baseline (like one vLLM server).

One background thread owns the engine (`DecodeRunner`: prefill on admission, continuous
batching) and loops `apply commands -> step -> deliver`. Requests come from asyncio as
"add"/"abort" commands through a locked inbox; each step's `TokenEvent`s go back to their
requests' asyncio queues with one `loop.call_soon_threadsafe` per event loop and step.
Closing a request's iterator early queues an "abort", which frees its KV blocks.
With `prefix_caching` (the default, as in vLLM) a request reuses the KV blocks an earlier
one computed for the same prefix (`model/prefixcache.py`) and its first output says how
many prompt tokens that saved (`usage.prompt_tokens_details.cached_tokens`).

    backend = EngineBackend(ModelConfig(path="dummy:tiny", block_tokens=16), max_batch=8)
    app = create_app(backend); ...; backend.close()
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import socket
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Literal

from mooncake.api.backend import BaseBackend, GenerateRequest, Output
from mooncake.api.stats import RequestStats
from mooncake.api.status import NodeStatus, Status
from mooncake.config.settings import ModelConfig
from mooncake.errors import ApiError, ConfigError, MooncakeError
from mooncake.model.grammar import try_create_grammar_engine
from mooncake.model.prefill import check_token_ids
from mooncake.model.sequence import Sequence, TokenEvent
from mooncake.model.tokenizer import create_tokenizer

log = logging.getLogger(__name__)
DEFAULT_KV_CACHE_BYTES = 512 * 1024 * 1024


@dataclass
class _Pending:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[Output]
    seq: Sequence
    is_started: bool = False  # its first output was sent


class EngineBackend(BaseBackend):
    """Serves `model` from this process; call `close()` when done (stops the thread)."""

    def __init__(
        self,
        model: ModelConfig | None = None,
        *,
        max_batch: int = 128,
        chunk_tokens: int = 1024,
        kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
        device: str = "cpu",
        served_model_name: str = "",
        num_threads: int | None = None,  # torch threads (process-wide); None = torch's default
        prefix_caching: bool = True,
    ):
        import torch

        from mooncake.model.decode import DecodeRunner
        from mooncake.model.info import load_model_info, resolve_dtype
        from mooncake.model.kvcache import PagedKVCache
        from mooncake.model.parallel import TPGroup, local_kv_heads, resolve_tensor_parallel
        from mooncake.model.prefixcache import PrefixCache
        from mooncake.model.tprun import TensorParallel
        from mooncake.model.weights import create_model

        config = model or ModelConfig()
        info = load_model_info(config.path)
        if num_threads:
            torch.set_num_threads(num_threads)
        spec = info.spec
        dtype = resolve_dtype(info, config.dtype, device)
        tp = resolve_tensor_parallel(config.tensor_parallel, device, spec, dtype)
        self.model = create_model(  # NOTE: rank 0's slice only when tp > 1
            info,
            dtype,
            device,
            cpu_gemm=config.cpu_gemm,
            attention_backend=config.attention_backend,
            block_tokens=config.block_tokens,
            tp=TPGroup(0, tp) if tp > 1 else None,
        )
        elem = next(self.model.parameters()).element_size()
        block_bytes = spec.num_layers * PagedKVCache.block_bytes_per_layer(
            config.block_tokens, local_kv_heads(spec.num_kv_heads, tp), spec.head_dim, elem
        )
        num_blocks = kv_cache_bytes // block_bytes
        if num_blocks < 1:
            raise ConfigError(
                f"KV cache: {kv_cache_bytes} bytes hold no block of "
                f"{config.block_tokens} tokens ({block_bytes} bytes); give more or smaller blocks"
            )
        self.tp: TensorParallel | None = None
        if tp > 1:
            self.tp = TensorParallel.start(
                self.model,
                tp,
                model_path=config.path,
                dtype=dtype,
                num_blocks=num_blocks,
                block_tokens=config.block_tokens,
                cpu_gemm=config.cpu_gemm,
            )
        self.cache = PagedKVCache.for_model(self.model, num_blocks, config.block_tokens)
        self.prefix_cache = PrefixCache(self.cache) if prefix_caching else None
        self.tokenizer = create_tokenizer(config.path, info.eos_token_ids)
        self.vocab_size = spec.vocab_size
        # NOTE: one engine for the API's compiles and the runner's matchers (one cache)
        self.grammar = try_create_grammar_engine(self.tokenizer, self.vocab_size)
        self.runner = DecodeRunner(
            self.model,
            self.cache,
            max_batch=max_batch,
            chunk_tokens=chunk_tokens,
            prefix_cache=self.prefix_cache,
            cuda_graphs=None if config.cuda_graphs and tp == 1 else False,
            max_model_len=config.max_model_len,
            grammar=self.grammar,
        )
        self.model_name = served_model_name or config.path
        limit = config.max_model_len or spec.max_position_embeddings
        self.max_model_len = min(limit, num_blocks * config.block_tokens)
        if self.max_model_len < limit:
            log.warning(
                "max_model_len cut to %d tokens: the KV cache holds no more", self.max_model_len
            )
        self._ids = itertools.count()
        self._cond = threading.Condition()
        self._inbox: list[tuple[Literal["add", "abort"], Sequence | int]] = []
        self._pending: dict[int, _Pending] = {}  # seq_id -> where its outputs go
        self._is_stopping = False
        self.num_generated_tokens = 0  # output tokens the engine produced (aborted ones too)
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()

    # -- asyncio side -------------------------------------------------------------------
    async def generate(self, req: GenerateRequest) -> AsyncIterator[Output]:
        ids, params = req.prompt_ids, req.params
        params.validate()
        check_token_ids(ids, self.vocab_size)
        if not ids:
            raise ApiError("the prompt is empty")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ApiError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"max_model_len ({self.max_model_len})"
            )
        kv_tokens = self.cache.num_blocks * self.cache.block_tokens
        if len(ids) + params.n * params.max_tokens > kv_tokens:
            raise ApiError(
                f"prompt ({len(ids)} tokens) + n ({params.n}) x max_tokens "
                f"({params.max_tokens}) exceeds the KV cache's {kv_tokens} tokens; ask for "
                "fewer choices or tokens"
            )
        seq = Sequence(
            next(self._ids),
            ids,
            params,
            eos_token_ids=self.tokenizer.eos_token_ids,
            max_model_len=self.max_model_len,
            tokenizer=self.tokenizer,
        )
        self.runner.bind_grammar(seq)  # NOTE: compiled when the API checked the request
        queue: asyncio.Queue[Output] = asyncio.Queue()
        with self._cond:
            if self._is_stopping or not self._thread.is_alive():
                raise MooncakeError("the engine has stopped")
            self._pending[seq.seq_id] = _Pending(asyncio.get_running_loop(), queue, seq)
            self._inbox.append(("add", seq))
            self._cond.notify()
        is_done = False
        try:
            while not is_done:
                out = await queue.get()
                is_done = out.ends_request
                yield out
        finally:
            if not is_done:  # the consumer went away: free the request's blocks
                self._submit("abort", seq.seq_id)

    async def health(self) -> dict[str, object]:
        if not self._thread.is_alive():
            raise MooncakeError("the engine thread has stopped")
        return {"status": "ok", "model": self.model_name, **self.load()}

    def load(self) -> dict[str, int]:
        """Requests waiting for and in the running batch (read without a lock: a glance)."""
        return {"num_waiting": len(self.runner.waiting), "num_running": len(self.runner.running)}

    def status(
        self,
        stats: RequestStats,
        *,
        uptime_s: float,
        cluster: str = "serve",
        ttft_slo_s: float = 0.0,
        tbt_slo_s: float = 0.0,
    ) -> Status:
        """The `/v1/status` snapshot of this single-process server: one node, no pool."""
        snap, load, pc = stats.snapshot(), self.load(), self.prefix_cache
        hit_rate = (
            pc.num_hit_tokens / pc.num_queried_tokens if pc and pc.num_queried_tokens else 0.0
        )
        node = NodeStatus(
            node_id=f"{socket.gethostname()}-coupled",
            role="coupled",
            address="",
            state="ready",
            num_queued=load["num_waiting"],
            num_running=load["num_running"],
            load=load["num_running"] / self.runner.max_batch,
        )
        return Status(
            cluster=cluster,
            model=self.model_name,
            uptime_s=uptime_s,
            nodes=[node],
            pool=[],
            hit_rate=hit_rate,
            local_hit_rate=hit_rate,
            num_queued=load["num_waiting"],
            num_running=load["num_running"],
            ttft_slo_s=ttft_slo_s,
            tbt_slo_s=tbt_slo_s,
            **snap.status_fields(),
        )

    def close(self) -> None:
        """Stop the engine thread; requests still pending end with an abort."""
        with self._cond:
            self._is_stopping = True
            self._cond.notify()
        self._thread.join(timeout=30)
        if self.grammar is not None:
            self.grammar.close()
        if self.tp is not None:
            self.tp.stop()

    def _submit(self, kind: Literal["add", "abort"], item: Sequence | int) -> None:
        with self._cond:
            self._inbox.append((kind, item))
            self._cond.notify()

    # -- engine thread ------------------------------------------------------------------
    def _loop(self) -> None:
        runner = self.runner
        while True:
            with self._cond:
                while not (self._inbox or runner.has_work or self._is_stopping):
                    self._cond.wait()
                if self._is_stopping:
                    break
                inbox, self._inbox = self._inbox, []
            try:
                self._apply(inbox)
                events = runner.step() if runner.has_work else []
            except Exception as e:  # a bug or out of memory: fail the batch, keep serving
                log.exception("engine step failed; aborting %d requests", len(self._pending))
                self._fail_all(f"engine step failed: {e!r}")
                continue
            self.num_generated_tokens += sum(e.token_id is not None for e in events)
            self._deliver(events, "")
        self._fail_all("the engine stopped")

    def _apply(self, inbox: list[tuple[Literal["add", "abort"], Sequence | int]]) -> None:
        for kind, item in inbox:
            if kind == "add":
                assert isinstance(item, Sequence), item
                self.runner.add(item)  # NOTE: token ids were checked in generate()
            else:
                assert isinstance(item, int), item
                self.runner.abort(item)  # its final event goes nowhere: drop the request
                with self._cond:
                    self._pending.pop(item, None)

    def _fail_all(self, error: str) -> None:
        runner = self.runner
        held = {s.seq_id for s in [*runner.running, *runner.waiting]}
        events = [e for seq_id in held for e in runner.abort(seq_id)]
        with self._cond:
            known = {e.seq_id for e in events}
            events += [
                TokenEvent(i, None, "", finish_reason="abort")
                for i in self._pending
                if i not in known
            ]
        self._deliver(events, error)

    def _deliver(self, events: list[TokenEvent], error: str) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Output], Output]]] = {}
        with self._cond:
            for e in events:
                pending = self._pending.get(e.seq_id)
                if pending is None:
                    continue  # aborted by its consumer
                if e.finish_reason == "abort" or (e.finish_reason and not e.more_choices):
                    del self._pending[e.seq_id]
                why = ""
                if e.finish_reason == "abort":  # not asked for by its consumer: see above
                    why = error or "the KV cache cannot hold this request"
                cached = 0 if pending.is_started else pending.seq.num_reused_tokens
                pending.is_started = True
                out = Output(
                    token_id=e.token_id,
                    text=e.text,
                    logprob=e.logprob,
                    top_logprobs=e.top_logprobs,
                    finish_reason=e.finish_reason,
                    error=why,
                    num_cached_tokens=cached,
                    index=e.index,
                    more_choices=e.more_choices,
                )
                by_loop.setdefault(pending.loop, []).append((pending.queue, out))
        for loop, batch in by_loop.items():
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening
                loop.call_soon_threadsafe(_put_all, batch)


def _put_all(batch: list[tuple[asyncio.Queue[Output], Output]]) -> None:
    for queue, out in batch:
        queue.put_nowait(out)
