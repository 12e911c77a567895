"""The decode role: continuous-batching decode of requests whose KV a prefill node wrote
into this node's cache; tokens stream back to the master after every step.

    reserve   a prefill node asks for blocks; they are set aside for that request
    submit    its KV is in them: the request joins the waiting queue
    step      DecodeRunner: schedule -> run -> postprocess; the step's tokens go to the master
    retire    a finished request's new full blocks (its output's KV) go to the pool, so the
              conversation's next turn hits the cache

The runner is not thread-safe: RPC handlers and the step loop share `lock`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from mooncake.conductor.costmodel import CostModel
from mooncake.engine.decode import DecodeRunner
from mooncake.engine.kvhandoff import place_cache_in_segments
from mooncake.engine.sequence import Sequence, TokenEvent
from mooncake.errors import MooncakeError
from mooncake.roles.common import MasterLink, NodeContext, install_signal_handlers, report_ready
from mooncake.roles.messages import (
    AckMsg,
    DecodeAbortMsg,
    DecodeReleaseMsg,
    DecodeReserveMsg,
    DecodeReserveReplyMsg,
    DecodeSubmitMsg,
    NodeInfoMsg,
    NodeLoadMsg,
    TokenMsg,
    TokensMsg,
)
from mooncake.roles.worker import Worker, close_pool, connect_pool, load_worker, mount_local_tiers
from mooncake.rpc import RpcServer

log = logging.getLogger(__name__)
DRAIN_S = 30.0  # seconds a stopping decode node lets its running requests finish


class StoringDecodeRunner(DecodeRunner):
    """A DecodeRunner that hands a finished request's blocks to `on_retire` before it
    frees them."""

    def __init__(self, *args: Any, on_retire: Callable[[Sequence], None], **kw: Any):
        super().__init__(*args, **kw)
        self.on_retire = on_retire

    def _retire(self, seq: Sequence) -> None:
        if seq.block_ids and seq.finish_reason in ("stop", "length"):
            try:
                self.on_retire(seq)
            except Exception:  # storing is an optimisation; the request already succeeded
                log.exception("req %d: storing its output KV failed", seq.seq_id)
        super()._retire(seq)


class DecodeNode:
    def __init__(self, ctx: NodeContext):
        self.ctx = ctx
        cfg = ctx.config
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.halt = threading.Event()  # set after draining: the step loop ends
        self.reserved: dict[int, list[int]] = {}  # req_id -> blocks set aside for its KV
        self.store_node = mount_local_tiers(ctx)
        self.worker: Worker = load_worker(ctx, cfg.decode.kv_cache_bytes)
        w = self.worker
        self.store, self.pool = connect_pool(ctx, w, self.store_node)
        self.kv_prefix = f"{ctx.node_id}.kv."
        place_cache_in_segments(self.store.engine, w.cache, self.kv_prefix)
        step_fn = None
        if cfg.scheduler.cost_model_path:
            step_fn = CostModel.load(cfg.scheduler.cost_model_path).decode_step_time
        self.runner = StoringDecodeRunner(
            w.model, w.cache, max_batch=cfg.decode.max_batch,
            max_step_time_s=cfg.scheduler.tbt_slo_s if step_fn else None,
            step_time_fn=step_fn, chunk_tokens=cfg.prefill.chunk_tokens,
            on_retire=self._store_output_kv,
        )  # fmt: skip
        self.server = RpcServer(f"tcp://{ctx.host}:0", ctx.secret, name="decode")
        self.server.register(DecodeReserveMsg, self._on_reserve)
        self.server.register(DecodeSubmitMsg, self._on_submit)
        self.server.register(DecodeReleaseMsg, self._on_release)
        self.server.register(DecodeAbortMsg, self._on_abort)
        self.server.start()
        info = NodeInfoMsg(
            ctx.node_id, "decode", self.server.address, ctx.gpu_names, ctx.nic_names,
            w.fingerprint.hex(), kv_capacity_tokens=w.cache.num_blocks * w.cache.block_tokens,
            max_batch=cfg.decode.max_batch,
        )  # fmt: skip
        self.link = MasterLink(ctx, info, self._load)
        self.link.register()
        self.link.start()

    # -- RPC handlers (server thread) --
    def _on_reserve(self, msg: DecodeReserveMsg, _peer: object) -> DecodeReserveReplyMsg:
        with self.lock:
            cache = self.worker.cache
            # NOTE: keep room for the running batch to grow by a block each
            spare = cache.allocator.num_free - len(self.runner.running)
            need = cache.blocks_for(msg.num_tokens)
            ids = cache.allocator.allocate(need) if need <= spare else None
            if ids is None:
                return DecodeReserveReplyMsg([])
            self.reserved[msg.req_id] = ids
        ep = self.store.engine.endpoints[0]
        return DecodeReserveReplyMsg(ids, self.kv_prefix, f"{ep.host}:{ep.port}")

    def _on_submit(self, msg: DecodeSubmitMsg, _peer: object) -> AckMsg:
        w = self.worker
        with self.lock:
            blocks = self.reserved.pop(msg.req_id, [])
            if msg.block_ids != blocks[: len(msg.block_ids)]:
                self.worker.cache.free(blocks)
                raise MooncakeError(f"req {msg.req_id}: submitted blocks were not reserved")
            seq = Sequence(
                msg.req_id, msg.prompt_ids, msg.params, eos_token_ids=w.info.eos_token_ids,
                max_model_len=w.max_model_len, tokenizer=w.tokenizer, block_ids=blocks,
                num_cached_tokens=msg.num_cached_tokens,
            )  # fmt: skip
            self.runner.add(seq)
        self.wake.set()
        return AckMsg()

    def _on_release(self, msg: DecodeReleaseMsg, _peer: object) -> AckMsg:
        with self.lock:
            self.worker.cache.free(self.reserved.pop(msg.req_id, []))
        return AckMsg()

    def _on_abort(self, msg: DecodeAbortMsg, _peer: object) -> AckMsg:
        with self.lock:
            self.worker.cache.free(self.reserved.pop(msg.req_id, []))
            self.runner.abort(msg.req_id)
        return AckMsg()

    def _load(self) -> NodeLoadMsg:
        r = self.runner
        return NodeLoadMsg(
            num_queued=len(r.waiting), num_running=len(r.running),
            load=len(r.running) / r.max_batch,
            context_tokens=sum(len(s.token_ids) for s in r.running),
        )  # fmt: skip

    # -- the step loop --
    def serve(self) -> None:
        self.link.state = "ready"
        report_ready(node_id=self.ctx.node_id, role="decode")
        loop = threading.Thread(target=self._loop, name="decode-loop", daemon=True)
        loop.start()
        self.ctx.stop.wait()
        self.link.drain()
        deadline = time.monotonic() + DRAIN_S
        while (self.runner.has_work or self.reserved) and time.monotonic() < deadline:
            time.sleep(0.05)  # running requests finish; nothing new is placed here
        self.halt.set()
        loop.join(timeout=30)
        self.close()

    def _loop(self) -> None:
        while not self.halt.is_set():
            with self.lock:
                events = self.runner.step() if self.runner.has_work else []
            if events:
                self._send(events)
            elif not self.runner.has_work:
                self.wake.wait(0.05)
                self.wake.clear()
        with self.lock:  # stopping: end what is still running, clearly
            ended = [self.runner.abort(s.seq_id) for s in [*self.runner.running,
                                                           *self.runner.waiting]]  # fmt: skip
        self._send([e for e in ended if e is not None], error="the decode node is shutting down")

    def _send(self, events: list[TokenEvent], error: str = "") -> None:
        if not events:
            return
        tokens = [TokenMsg(e.seq_id, e.token_id, e.text, e.logprob, e.top_logprobs,
                           e.finish_reason, error if e.finish_reason == "abort" else "")
                  for e in events]  # fmt: skip
        try:
            self.link.client.send_event(TokensMsg(self.ctx.node_id, tokens))
        except MooncakeError as e:
            log.warning("could not send %d tokens to the master: %s", len(tokens), e)

    def _store_output_kv(self, seq: Sequence) -> None:
        """Put the full blocks the prefill node did not store (those holding output) into
        the pool; copies the blocks first, since they are freed right after."""
        w, bt = self.worker, self.worker.cache.block_tokens
        num_full = seq.num_cached_tokens // bt
        first = (seq.prompt_len - 1) // bt
        if num_full <= first:
            return
        ids = seq.token_ids[: num_full * bt]
        hashes = w.hasher.hash_blocks(ids)[first:]
        put = self.pool.begin(hashes, [ids[b * bt : (b + 1) * bt] for b in range(first, num_full)])
        idx = torch.tensor(seq.block_ids[first:num_full])
        positions = list(range(num_full - first))
        for layer in w.model.layer_ids:
            k, v = w.cache.layer(layer)
            kb, vb = k.index_select(0, idx), v.index_select(0, idx)
            put.write_layer(layer, positions, list(kb), list(vb))
        put.commit()

    def close(self) -> None:
        self.link.deregister()
        self.server.stop()
        close_pool(self.store, self.pool, self.store_node)


def run_decode(ctx: NodeContext) -> None:
    install_signal_handlers(ctx.stop)
    DecodeNode(ctx).serve()
