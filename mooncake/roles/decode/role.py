"""The decode role: continuous-batching decode of requests whose KV a prefill node wrote
into this node's cache; tokens stream back to the master after every step.

    reserve   a prefill node asks for blocks; they are set aside for that request (for
              `decode.reserve_ttl_s` at most: a prefill node that dies never submits)
    submit    its KV is in them: the request joins the waiting queue
    step      DecodeRunner: schedule -> run -> postprocess; the step's tokens go to the master
    retire    a finished request's new full blocks (its output's KV) go to the pool, so the
              conversation's next turn hits the cache

A step that raises ends the requests of its batch with an error and the loop goes on;
`decode.max_step_failures` failed steps in a row, a dead loop or a step stuck for
`decode.stall_timeout_s` make the node report "failed", end every request it holds with an
error and exit, for its supervisor to restart it (roles/node/watchdog.py). A node the master
marked down (it was unreachable: stopped, partitioned) drops what it held when it registers
again: the master has re-placed or failed those requests meanwhile.

Threads: the step loop owns the runner (its queues); RPC handlers never wait for a step.
They hand what changes the runner (a request to add, one to abort) to the loop as commands,
applied in order before its next step, and keep the reservations under `held`, a lock
held only for dictionary work (the KV cache's allocator has its own, as short). Tokens go
out through an `Outbox` (roles/node/delivery.py) on a sender thread: numbered per request, sent
again until the master acknowledges them.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from mooncake.conductor.costmodel import CostModel
from mooncake.errors import MooncakeError
from mooncake.kv.handoff import place_cache_in_segments
from mooncake.model.grammar import try_create_grammar_engine
from mooncake.model.prefill import check_token_ids
from mooncake.model.sequence import Sequence, TokenEvent
from mooncake.roles.decode.kv import StoringDecodeRunner, missing_layers, store_output_kv
from mooncake.roles.node.common import (
    HEARTBEAT_S,
    MasterLink,
    NodeContext,
    install_signal_handlers,
    report_ready,
)
from mooncake.roles.node.delivery import Outbox
from mooncake.roles.node.messages import (
    AckMsg,
    DecodeAbortMsg,
    DecodeReleaseMsg,
    DecodeReserveMsg,
    DecodeReserveReplyMsg,
    DecodeSubmitMsg,
    NodeInfoMsg,
    NodeLoadMsg,
    RegisterReplyMsg,
    TokenAck,
    TokenMsg,
    TokensAckMsg,
    TokensMsg,
)
from mooncake.roles.node.watchdog import LoopWatch, NodeFailed
from mooncake.roles.node.worker import (
    Worker,
    close_pool,
    connect_pool,
    load_worker,
    mount_local_tiers,
)
from mooncake.rpc import RpcServer

log = logging.getLogger(__name__)


class DecodeNode:
    def __init__(self, ctx: NodeContext):
        self.ctx = ctx
        cfg = ctx.config
        # NOTE: guards `reserved` and `cancelled`, held for dictionary work only
        self.held = threading.Lock()
        self.commands: queue.SimpleQueue[Callable[[], object]] = queue.SimpleQueue()
        self.wake = threading.Event()
        self.halt = threading.Event()  # set after draining: the step loop ends
        self.reserved: dict[int, tuple[list[int], float]] = {}  # req_id -> (blocks, when)
        # NOTE: aborted while its prefill node may still stream KV into its blocks: they are
        # freed when that node submits or releases (or past reserve_ttl_s), never before
        self.cancelled: set[int] = set()
        self.store_node = mount_local_tiers(ctx)
        self.worker: Worker = load_worker(ctx, "decode")
        w = self.worker
        self.store, self.pool = connect_pool(ctx, w, self.store_node)
        self.kv_prefix = f"{ctx.node_id}.kv."
        self.rank_caches = place_cache_in_segments(self.store.engine, w.cache, self.kv_prefix, w.tp)
        step_fn = None
        if cfg.scheduler.cost_model_path:
            step_fn = CostModel.load(cfg.scheduler.cost_model_path).decode_step_time
        self.runner = StoringDecodeRunner(
            w.model,
            w.cache,
            max_batch=cfg.decode.max_batch,
            max_step_time_s=cfg.scheduler.tbt_slo_s if step_fn else None,
            step_time_fn=step_fn,
            chunk_tokens=cfg.prefill.chunk_tokens,
            on_retire=self._store_output_kv,
            grammar=try_create_grammar_engine(w.tokenizer, w.model.spec.vocab_size),
            # NOTE: not under tensor parallelism: a capture would record rank 0's broadcast
            # of the step without sending it (as `mooncake serve`)
            cuda_graphs=None if cfg.model.cuda_graphs and w.tensor_parallel == 1 else False,
            max_model_len=cfg.model.max_model_len,
        )
        self.server = RpcServer(f"tcp://{ctx.host}:0", ctx.secret, name="decode", ports=ctx.ports)
        self.server.register(DecodeReserveMsg, self._on_reserve)
        self.server.register(DecodeSubmitMsg, self._on_submit)
        self.server.register(DecodeReleaseMsg, self._on_release)
        self.server.register(DecodeAbortMsg, self._on_abort)
        self.server.start()
        info = NodeInfoMsg(
            ctx.node_id,
            "decode",
            self.server.address,
            ctx.gpu_names,
            ctx.nic_names,
            w.fingerprint.hex(),
            kv_capacity_tokens=w.cache.num_blocks * w.cache.block_tokens,
            max_batch=cfg.decode.max_batch,
        )
        self.is_registered = False
        self.watch = LoopWatch("decode-loop", self._loop, cfg.decode.stall_timeout_s)
        self.link = MasterLink(ctx, info, self._load, self._on_registered)
        d = cfg.decode
        self.outbox = Outbox(
            self._send_tokens, d.token_resend_s, d.token_max_resends, self._on_stream_dropped
        )
        self._sender = threading.Thread(target=self.outbox.run, name="tokens-out", daemon=True)
        self._sender.start()
        self.link.register()
        self.link.start()

    # -- RPC handlers (server thread) --
    def _on_reserve(self, msg: DecodeReserveMsg, _peer: object) -> DecodeReserveReplyMsg:
        cache = self.worker.cache
        # NOTE: keep room for the running batch to grow by a block each (a glance at the
        # loop's batch: a step may change it meanwhile)
        spare = cache.allocator.num_free - len(self.runner.running)
        need = cache.blocks_for(msg.num_tokens)
        ids = cache.allocator.allocate(need) if need <= spare else None
        if ids is None:
            return DecodeReserveReplyMsg([])
        with self.held:
            self.reserved[msg.req_id] = (ids, time.monotonic())
        ep = self.store.engine.endpoints[0]
        ranks = self.worker.tensor_parallel
        return DecodeReserveReplyMsg(ids, self.kv_prefix, f"{ep.host}:{ep.port}", ranks)

    def _on_submit(self, msg: DecodeSubmitMsg, _peer: object) -> AckMsg:
        w = self.worker
        with self.held:
            blocks = self.reserved.pop(msg.req_id, ([], 0.0))[0]
            is_cancelled = msg.req_id in self.cancelled
            self.cancelled.discard(msg.req_id)
        if is_cancelled:
            w.cache.free(blocks)
            raise MooncakeError(f"req {msg.req_id} was aborted while its KV streamed in")
        if msg.block_ids != blocks[: len(msg.block_ids)]:
            w.cache.free(blocks)
            raise MooncakeError(f"req {msg.req_id}: submitted blocks were not reserved")
        if missing := missing_layers(msg, w.model.spec.num_layers):
            w.cache.free(blocks)  # NOTE: never decode from partial KV
            raise MooncakeError(f"req {msg.req_id}: KV incomplete, {missing}")
        try:
            check_token_ids(msg.prompt_ids, w.model.spec.vocab_size)
        except MooncakeError:
            w.cache.free(blocks)
            raise
        seq = Sequence(
            msg.req_id,
            msg.prompt_ids,
            msg.params,
            eos_token_ids=w.info.eos_token_ids,
            max_model_len=w.max_model_len,
            tokenizer=w.tokenizer,
            block_ids=blocks,
            num_cached_tokens=msg.num_cached_tokens,
            num_resumed=msg.num_resumed,
        )
        try:  # NOTE: here, so that a grammar it cannot resume fails the submit
            self.runner.bind_grammar(seq)
        except MooncakeError:
            w.cache.free(blocks)
            raise
        self._command(lambda: self.runner.add(seq))
        return AckMsg()

    def _command(self, fn: Callable[[], object]) -> None:
        """Have the step loop run `fn` before its next step (in the order given)."""
        self.commands.put(fn)
        self.wake.set()

    def _on_release(self, msg: DecodeReleaseMsg, _peer: object) -> AckMsg:
        with self.held:
            self.cancelled.discard(msg.req_id)
            blocks = self.reserved.pop(msg.req_id, ([], 0.0))[0]
        self.worker.cache.free(blocks)
        return AckMsg()

    def _on_abort(self, msg: DecodeAbortMsg, _peer: object) -> AckMsg:
        """Free its reservation (or mark it, while its prefill node still writes there),
        and have the loop drop it before its next step."""
        blocks: list[int] = []
        with self.held:
            if msg.req_id in self.reserved and not msg.is_writer_down:
                self.cancelled.add(msg.req_id)
            else:
                blocks = self.reserved.pop(msg.req_id, ([], 0.0))[0]
        self.worker.cache.free(blocks)
        self.outbox.forget(msg.req_id)  # NOTE: the master awaits nothing more of it
        self._command(lambda: self.runner.abort(msg.req_id))
        return AckMsg()

    def _on_stream_dropped(self, req_id: int, why: str) -> None:
        """The master does not track the request, or its tokens could not be delivered:
        nobody awaits its output (sender thread)."""
        log.info("req %d: stopped: %s", req_id, why)
        self._command(lambda: self.runner.abort(req_id))

    def _send_tokens(self, tokens: list[TokenMsg]) -> list[TokenAck]:
        reply = self.link.client.call(TokensMsg(self.ctx.node_id, tokens), TokensAckMsg)
        return reply.acks

    def _on_registered(self, reply: RegisterReplyMsg) -> None:
        """Registered again (the master restarted, or marked this node down while it was
        unreachable): every request held here was failed or re-placed meanwhile."""
        if not self.is_registered:
            self.is_registered = True
            return  # the first registration: nothing is held yet
        with self.held:
            held = [blocks for blocks, _ in self.reserved.values()]
            self.reserved.clear()
            self.cancelled.clear()
        for blocks in held:
            self.worker.cache.free(blocks)
        self.outbox.clear()
        self._command(self._drop_all)
        if held:
            log.warning("registered again: dropped %d reservations", len(held))

    def _drop_all(self) -> None:
        """Drop every request (on the loop): the master no longer tracks them."""
        r = self.runner
        dropped = {s.seq_id for s in [*r.running, *r.waiting]}
        for req_id in dropped:
            r.abort(req_id)
        if dropped:
            log.warning("registered again: dropped %d requests", len(dropped))

    def _expire_reservations(self, now: float) -> None:
        ttl = self.ctx.config.decode.reserve_ttl_s
        with self.held:
            old = [r for r, (_, at) in self.reserved.items() if now - at > ttl]
            freed = [self.reserved.pop(req_id)[0] for req_id in old]
            self.cancelled.difference_update(old)
        for blocks in freed:
            self.worker.cache.free(blocks)
        if old:
            log.warning(
                "freed %d reservations never submitted within %.0f s: %s", len(old), ttl, old[:8]
            )

    def _load(self) -> NodeLoadMsg:
        r = self.runner
        return NodeLoadMsg(
            num_queued=len(r.waiting) + self.commands.qsize(),
            num_running=len(r.running),
            load=len(r.running) / r.max_batch,
            context_tokens=sum(len(s.token_ids) for s in r.running),
            num_reserved=len(self.reserved),
            transfer_bytes=self.store.engine.bytes_by_transport(),
        )

    # -- the step loop --
    def serve(self) -> None:
        """Serve until stopped (drain, then close); raises NodeFailed when the step loop
        died or is stuck (the node is closed first)."""
        self.link.state = "ready"
        self.link.beat()  # NOTE: placeable once its ready line is out, not a heartbeat later
        report_ready(node_id=self.ctx.node_id, role="decode")
        self.watch.start()
        problem = ""
        while not problem and not self.ctx.stop.wait(HEARTBEAT_S):
            now = time.monotonic()
            problem = self.watch.problem(now)
            self._expire_reservations(now)
        if problem:
            self._fail(problem)
            raise NodeFailed(f"decode node {self.ctx.node_id}: {problem}")
        self.link.drain()
        deadline = time.monotonic() + self.ctx.config.decode.drain_s
        poll_s = self.ctx.config.decode.poll_s
        while (self.has_work or self.reserved) and time.monotonic() < deadline:
            if self.watch.problem():
                break
            time.sleep(poll_s)  # running requests finish; nothing new is placed here
        self.halt.set()
        self.watch.join(timeout_s=self.ctx.config.decode.stall_timeout_s)
        self.close()

    @property
    def has_work(self) -> bool:
        return self.runner.has_work or not self.commands.empty() or self.outbox.num_streams > 0

    def _fail(self, problem: str) -> None:
        """The loop cannot serve: not ready any more, every held request ended with an
        error naming why, then leave the cluster."""
        log.error("%s; ending every request held here and exiting", problem)
        self.link.state = "failed"
        self.link.beat()  # placements stop now, not at the next heartbeat
        self.halt.set()
        # NOTE: a stuck step owns the runner: a glance at its queues
        held = [*self.runner.running, *self.runner.waiting]
        held_ids = {s.seq_id for s in held}
        events = [TokenEvent(i, None, "", finish_reason="abort") for i in held_ids]
        self._send(events, error=f"the decode node failed: {problem}")
        self.close()

    def _loop(self, watch: LoopWatch) -> None:
        failures = 0
        max_failures = self.ctx.config.decode.max_step_failures
        poll_s = self.ctx.config.decode.poll_s
        pace_s = self.ctx.config.decode.step_interval_s
        while not self.halt.is_set():
            started = time.monotonic()
            with watch.busy():
                try:
                    events = []
                    self._run_commands()
                    if self.runner.has_work:
                        events = self.runner.step()
                        failures = 0
                except Exception as e:
                    failures += 1
                    log.exception("decode step failed (%d in a row)", failures)
                    events = self._end_running()
                    error = f"the decode step failed: {type(e).__name__}: {e}"
                    if failures >= max_failures:
                        watch.fail(f"{failures} decode steps failed in a row, the last: {e}")
                else:
                    error = ""
            if events:
                self._send(events, error)
                left = started + pace_s - time.monotonic() if self.runner.running else 0.0
                if left > 0:  # paced (decode.step_interval_s); newcomers join the next step
                    self.halt.wait(left)
            elif not self.runner.has_work and self.commands.empty():
                self.wake.wait(poll_s)
                self.wake.clear()
            if watch.failure:
                return
        self._run_commands()  # stopping: end what is still running, clearly
        r = self.runner
        ended = [
            e for req_id in {s.seq_id for s in [*r.running, *r.waiting]} for e in r.abort(req_id)
        ]
        self._send(ended, error="the decode node is shutting down")

    def _run_commands(self) -> None:
        """Apply the handlers' commands, in order (on the loop, between steps)."""
        while True:
            try:
                fn = self.commands.get_nowait()
            except queue.Empty:
                return
            fn()

    def _end_running(self) -> list[TokenEvent]:
        """End the running batch after a failed step (lock held); waiting requests stay."""
        running = {s.seq_id for s in self.runner.running}
        return [e for req_id in running for e in self.runner.abort(req_id)]

    def _send(self, events: list[TokenEvent], error: str = "") -> None:
        if not events:
            return
        tokens = [
            TokenMsg(
                req_id=e.seq_id,
                token_id=e.token_id,
                text=e.text,
                logprob=e.logprob,
                top_logprobs=e.top_logprobs,
                finish_reason=e.finish_reason,
                error=error if e.finish_reason == "abort" else "",
                kind="output",
                index=e.index,
                more_choices=e.more_choices,
            )
            for e in events
        ]
        self.outbox.put(tokens)

    def _store_output_kv(self, seq: Sequence) -> None:
        store_output_kv(self.worker, self.pool, seq, self.rank_caches)

    def close(self) -> None:
        # NOTE: the last events (aborts at a stop or a failure) reach the master first
        if not self.outbox.flush(self.ctx.config.cluster.call_timeout_s):
            log.warning("%d requests' last tokens not acknowledged", self.outbox.num_streams)
        self.outbox.close()
        self.link.deregister()
        self.server.stop()
        close_pool(self.store, self.pool, self.store_node)
        self.worker.close()


def run_decode(ctx: NodeContext) -> None:
    """Serve as a decode node until SIGINT/SIGTERM; raises NodeFailed when the step loop
    failed (the process then exits with an error, for its supervisor to restart it)."""
    install_signal_handlers(ctx.stop)
    DecodeNode(ctx).serve()
