"""The prefill role: prefill prompts with prefix reuse from the pool, store new KV in the
pool layer by layer, and hand each request's KV to its decode node.

One task at a time, first come first served (the Conductor keeps the queue short and
knows its length). A node is one stage of a pipeline group; the master assigns groups on
registration. Stage 0 (the leader) receives tasks and drives the group; later stages
serve their upstream link. Per task on the leader:

    reuse+compute   PrefillRunner (alone, or `prefill_pipelined` through the group) over
                    prompt[:-1]: the decode node computes the last prompt token itself
    hand off        reserve blocks on the decode node, write the KV into them, submit
    report          started / finished / failed events to the master
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

import msgspec

from mooncake.engine.kvhandoff import place_cache_in_segments, send_kv
from mooncake.engine.pipeline import StageServer, prefill_pipelined
from mooncake.engine.prefill import PrefillResult, PrefillRunner
from mooncake.engine.stagelink import StageListener, TcpStageLink
from mooncake.errors import AuthError, MooncakeError, TransferError
from mooncake.roles.common import MasterLink, NodeContext, install_signal_handlers, report_ready
from mooncake.roles.messages import (
    AckMsg,
    DecodeReleaseMsg,
    DecodeReserveMsg,
    DecodeReserveReplyMsg,
    DecodeSubmitMsg,
    GroupMsg,
    GroupQueryMsg,
    NodeInfoMsg,
    NodeLoadMsg,
    PrefillAbortMsg,
    PrefillEventMsg,
    PrefillStartMsg,
    PrefillStartReplyMsg,
    PrefillTaskMsg,
    TokenMsg,
    TokensMsg,
)
from mooncake.roles.worker import Worker, close_pool, connect_pool, load_worker, mount_local_tiers
from mooncake.rpc import RpcClient, RpcServer

log = logging.getLogger(__name__)
RESERVE_TIMEOUT_S = 30.0  # seconds to wait for room on the decode node


class PrefillNode:
    def __init__(self, ctx: NodeContext):
        self.ctx = ctx
        cfg = ctx.config
        self.tasks: queue.Queue[PrefillTaskMsg | None] = queue.Queue()
        self.queued: set[int] = set()  # req ids in `tasks`
        self.aborted: set[int] = set()  # of those, the ones to skip
        self.busy = False
        self.server = RpcServer(f"tcp://{ctx.host}:0", ctx.secret, name="prefill")
        self.server.register(PrefillTaskMsg, self._on_task)
        self.server.register(PrefillAbortMsg, self._on_abort)
        self.server.start()
        self.store_node = mount_local_tiers(ctx)
        info = NodeInfoMsg(ctx.node_id, "prefill", self.server.address, ctx.gpu_names,
                           ctx.nic_names, device_memory_bytes=ctx.device_memory_bytes)  # fmt: skip
        self.link = MasterLink(ctx, info, self._load)
        reply = self.link.register()
        self.link.start()  # heartbeats (state "starting") while the model loads
        assert reply.group is not None, "the master assigns every prefill node a group"
        self.group: GroupMsg = reply.group
        layers = (self.group.first_layer, self.group.end_layer)
        self.worker: Worker = load_worker(ctx, cfg.prefill.kv_cache_bytes, layers)
        self.store, self.pool = connect_pool(ctx, self.worker, self.store_node)
        self.kv_prefix = f"{ctx.node_id}.kv."
        place_cache_in_segments(self.store.engine, self.worker.cache, self.kv_prefix)
        w = self.worker
        self.runner = PrefillRunner(
            w.model, w.cache, chunk_tokens=cfg.prefill.chunk_tokens, hasher=w.hasher,
            source=self.pool, sink=self.pool if self.group.stage == 0 else None,
            fingerprint=w.fingerprint,
        )  # fmt: skip
        self.next_link: TcpStageLink | None = None
        self.listener: StageListener | None = None
        if self.group.stage > 0:
            self.listener = StageListener(ctx.secret, ctx.host, 0)
            self.link.info = NodeInfoMsg(
                ctx.node_id, "prefill", self.server.address, ctx.gpu_names, ctx.nic_names,
                w.fingerprint.hex(), stage_address=f"{ctx.host}:{self.listener.port}",
            )  # fmt: skip
        else:
            self.link.info = NodeInfoMsg(
                ctx.node_id, "prefill", self.server.address, ctx.gpu_names, ctx.nic_names,
                w.fingerprint.hex(),
            )  # fmt: skip
        self.link.info = msgspec.structs.replace(
            self.link.info, group_id=self.group.group_id, stage=self.group.stage,
            group_size=self.group.group_size, device_memory_bytes=ctx.device_memory_bytes,
        )  # fmt: skip
        self.link.register()  # again, with what loading the model told us
        self._decoders: dict[str, RpcClient] = {}

    # -- RPC handlers (server thread) --
    def _on_task(self, msg: PrefillTaskMsg, _peer: object) -> AckMsg:
        if self.group.stage != 0:
            raise MooncakeError(
                f"node {self.ctx.node_id} is stage {self.group.stage}, not a leader"
            )
        self.queued.add(msg.req_id)
        self.tasks.put(msg)
        return AckMsg()

    def _on_abort(self, msg: PrefillAbortMsg, _peer: object) -> AckMsg:
        if msg.req_id in self.queued:  # only a task still waiting can be skipped
            self.aborted.add(msg.req_id)
        return AckMsg()

    def _load(self) -> NodeLoadMsg:
        q = self.tasks.qsize()
        return NodeLoadMsg(num_queued=q, num_running=int(self.busy), load=float(self.busy))

    # -- serving --
    def serve(self) -> None:
        """Serve until stopped; then drain the queue's current task, deregister, clean up."""
        if self.group.stage > 0:
            threading.Thread(target=self._serve_stage, name="stage", daemon=True).start()
        elif self.group.group_size > 1:
            self._connect_next()
        self.link.state = "ready"
        report_ready(node_id=self.ctx.node_id, role="prefill", stage=self.group.stage,
                     group=self.group.group_id)  # fmt: skip
        worker = threading.Thread(target=self._work, name="prefill-worker", daemon=True)
        worker.start()
        self.ctx.stop.wait()
        self.link.drain()  # queued tasks still run; nothing new is placed here
        self.tasks.put(None)
        worker.join(timeout=30)
        self.close()

    def _connect_next(self) -> None:
        while not self.ctx.stop.is_set():
            group = self.link.client.call(GroupQueryMsg(self.ctx.node_id), GroupMsg)
            if group.next_stage_address:
                host, _, port = group.next_stage_address.rpartition(":")
                self.next_link = TcpStageLink.connect(host, int(port), self.ctx.secret)
                log.info("pipeline group %s: connected to stage 1 at %s", group.group_id,
                         group.next_stage_address)  # fmt: skip
                return
            self.ctx.stop.wait(0.1)

    def _serve_stage(self) -> None:
        assert self.listener is not None
        while not self.ctx.stop.is_set():
            try:
                upstream = self.listener.accept(timeout=0.5)
            except TimeoutError:
                continue
            except OSError:  # the listener closed: stopping
                return
            except AuthError as e:
                log.warning("%s", e)
                continue
            StageServer(self.runner, upstream).serve()

    def _work(self) -> None:
        while (task := self.tasks.get()) is not None:
            self.queued.discard(task.req_id)
            if task.req_id in self.aborted:
                self.aborted.discard(task.req_id)
                continue
            self.busy = True
            try:
                self._run(task)
            except Exception as e:  # a failed request never stops the node
                log.exception("req %d failed", task.req_id)
                self._event(task.req_id, "failed", error=str(e))
                self._fail_to_client(task.req_id, f"prefill failed on {self.ctx.node_id}: {e}")
            finally:
                self.busy = False

    def _admit(self, task: PrefillTaskMsg) -> PrefillTaskMsg | None:
        """Ask the master whether the task still runs and where its KV goes now; None =
        skip it. An unreachable master keeps the task as it was placed."""
        try:
            reply = self.link.client.call(
                PrefillStartMsg(task.req_id, self.ctx.node_id), PrefillStartReplyMsg
            )
        except MooncakeError as e:
            log.warning("req %d: admission check failed, running it as placed: %s",
                        task.req_id, e)  # fmt: skip
            return task
        if not reply.is_accepted:
            log.info("req %d: not prefilled (%s)", task.req_id, reply.reason)
            return None
        if reply.decode_node and reply.decode_node != task.decode_node:
            return msgspec.structs.replace(task, decode_node=reply.decode_node,
                                           decode_address=reply.decode_address)  # fmt: skip
        return task

    def _run(self, task: PrefillTaskMsg) -> None:
        admitted = self._admit(task)
        if admitted is None:
            return
        task = admitted
        log.debug("req %d: prefill of %d tokens", task.req_id, len(task.prompt_ids))
        prompt = task.prompt_ids[:-1]
        kw: dict[str, Any] = {}
        if task.max_reuse_blocks >= 0:
            kw["max_reuse_blocks"] = task.max_reuse_blocks
        if len(prompt) == 0:
            result = None  # one-token prompt: the decode node computes it
        elif self.next_link is not None:
            result = prefill_pipelined(self.runner, prompt, self.next_link, req_id=task.req_id,
                                       store_remote_kv=True, **kw)  # fmt: skip
        else:
            result = self.runner.prefill(prompt, req_id=task.req_id, **kw)
        try:
            kv_bytes = self._hand_off(task, result, len(prompt))
        finally:
            if result is not None:
                self.worker.cache.free(result.block_ids)
        stats = result.stats if result is not None else None
        self._event(task.req_id, "finished",
                    num_reused_tokens=stats.num_reused_tokens if stats else 0,
                    num_stored_blocks=stats.num_stored_blocks if stats else 0,
                    kv_bytes=kv_bytes)  # fmt: skip

    def _hand_off(self, task: PrefillTaskMsg, result: PrefillResult | None, n: int) -> int:
        client = self._decoder(task.decode_address)
        reply = DecodeReserveReplyMsg([])
        deadline = time.monotonic() + RESERVE_TIMEOUT_S
        while n > 0:
            reply = client.call(DecodeReserveMsg(task.req_id, n), DecodeReserveReplyMsg)
            if reply.block_ids:
                break
            if time.monotonic() > deadline:
                raise TransferError(f"decode node {task.decode_node} had no room for "
                                    f"{n} tokens of KV within {RESERVE_TIMEOUT_S} s")  # fmt: skip
            time.sleep(0.02)
        sent = 0
        if n > 0:
            assert result is not None
            try:
                sent = send_kv(self.store.engine, self.worker.cache, self.kv_prefix,
                               result.block_ids, n, reply.segment_prefix, reply.endpoint,
                               reply.block_ids, result.remote_kv)  # fmt: skip
            except BaseException:
                client.call(DecodeReleaseMsg(task.req_id), AckMsg)
                raise
        log.debug("req %d: %d bytes of KV written to %s", task.req_id, sent, task.decode_node)
        client.call(DecodeSubmitMsg(task.req_id, task.prompt_ids, task.params,
                                    list(reply.block_ids), n), AckMsg)  # fmt: skip
        return sent

    def _decoder(self, address: str) -> RpcClient:
        if address not in self._decoders:
            self._decoders[address] = RpcClient(address, self.ctx.secret, timeout_s=10.0)
        return self._decoders[address]

    def _event(self, req_id: int, phase: str, **kw: object) -> None:
        msg = PrefillEventMsg(req_id, self.ctx.node_id, phase, **kw)  # type: ignore[arg-type]
        try:
            self.link.client.send_event(msg)
        except MooncakeError as e:
            log.warning("req %d: could not tell the master (%s): %s", req_id, phase, e)

    def _fail_to_client(self, req_id: int, error: str) -> None:
        end = TokenMsg(req_id, -1, "", finish_reason="abort", error=error)
        try:
            self.link.client.send_event(TokensMsg(self.ctx.node_id, [end]))
        except MooncakeError as e:
            log.warning("req %d: could not report its failure: %s", req_id, e)

    def close(self) -> None:
        self.link.deregister()
        if self.next_link is not None:
            self.next_link.close()
        if self.listener is not None:
            self.listener.close()
        self.server.stop()
        for c in self._decoders.values():
            c.close()
        close_pool(self.store, self.pool, self.store_node)


def run_prefill(ctx: NodeContext) -> None:
    install_signal_handlers(ctx.stop)
    PrefillNode(ctx).serve()


__all__ = ["PrefillNode", "run_prefill"]
