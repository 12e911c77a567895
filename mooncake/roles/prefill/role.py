"""The prefill role: prefill prompts with prefix reuse from the pool, store new KV in the
pool layer by layer, and hand each request's KV to its decode node.

A node is one stage of a pipeline group; the master assigns groups on registration.
Stage 0 (the leader) receives tasks, in the Conductor's order, and drives the group;
later stages serve their upstream link. Per task on the leader (roles/prefill/flow.py):

    admit       ask the master whether the task still runs and where its KV goes
    begin       reserve the prompt's blocks on the decode node; compute this stage's
                layers (alone, or through the group: the later stages compute theirs),
                every finished layer's KV streaming into those blocks and the pool
    finish      (completer thread, while the worker begins the next task) wait for every
                stage's stream report, seal the pool objects, submit to the decode node
    report      finished / failed events to the master (calls it answers)

Up to [prefill] max_inflight tasks are between begin and finish at once.

A leader of a group of 2+ holds a link to stage 1 (`_keep_group`). When it breaks (stage
1 died, or stayed silent past `[prefill] stage_timeout_s` per chunk: stopped, or its
network dark), the leader reports "starting" at once, so the master stops placing on the
group, and only then reports the task it was running and those it holds as failed before
any KV reached a decode node (the master may place them again). It asks the master where
stage 1 listens now and dials it, backing off, until the restarted stage answers: then
it is ready again. A later stage serves one upstream link at a time; a new one (its
leader restarted, or dialled again) replaces it, and the requests the old one left half
done give their KV blocks back.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

import msgspec

from mooncake.errors import MooncakeError, TransferError
from mooncake.kv.handoff import place_cache_in_segments
from mooncake.model.cpugemm import PREFILL_SHAPE_ENTRIES, limit_shape_caches
from mooncake.model.kvcache import CacheFullError
from mooncake.model.prefill import PrefillRunner, ReuseMismatchError
from mooncake.roles.node.common import (
    MasterLink,
    NodeContext,
    install_signal_handlers,
    report_ready,
)
from mooncake.roles.node.messages import (
    AckMsg,
    GroupMsg,
    NodeInfoMsg,
    NodeLoadMsg,
    PrefillAbortMsg,
    PrefillEventMsg,
    PrefillStartMsg,
    PrefillStartReplyMsg,
    PrefillTaskMsg,
)
from mooncake.roles.node.worker import (
    Worker,
    close_pool,
    connect_pool,
    load_worker,
    mount_local_tiers,
)
from mooncake.roles.prefill.flow import PrefillFlow, TaskInFlight
from mooncake.roles.prefill.group.leaderlink import NextStage
from mooncake.roles.prefill.group.link import StageTimeoutError, TcpStageLink
from mooncake.roles.prefill.group.listener import StageListener
from mooncake.roles.prefill.group.stage import StageServer
from mooncake.roles.prefill.handoff import DecodeHandoff, DecodeTarget, DecodeUnreachable
from mooncake.roles.prefill.taskqueue import TaskQueue
from mooncake.rpc import RpcServer

log = logging.getLogger(__name__)


class GroupBroken(TransferError):
    """The leader has no working link to its next stage: the task goes back to the master."""


class PrefillNode:
    def __init__(self, ctx: NodeContext):
        self.ctx = ctx
        cfg = ctx.config
        self.tasks = TaskQueue()  # waiting to begin, in the Conductor's order
        self.num_inflight = 0  # tasks between begin and finish
        self.done: queue.Queue[TaskInFlight | None] = queue.Queue()  # begun, for the completer
        self._slots = threading.BoundedSemaphore(cfg.prefill.max_inflight)
        self._flight_ended = threading.Condition()
        self.server = RpcServer(f"tcp://{ctx.host}:0", ctx.secret, name="prefill", ports=ctx.ports)
        self.server.register(PrefillTaskMsg, self._on_task)
        self.server.register(PrefillAbortMsg, self._on_abort)
        self.server.start()
        self.store_node = mount_local_tiers(ctx)
        info = NodeInfoMsg(
            ctx.node_id,
            "prefill",
            self.server.address,
            ctx.gpu_names,
            ctx.nic_names,
            device_memory_bytes=ctx.device_memory_bytes,
        )
        self.link = MasterLink(ctx, info, self._load)
        reply = self.link.register()
        self.link.start()  # heartbeats (state "starting") while the model loads
        assert reply.group is not None, "the master assigns every prefill node a group"
        self.group: GroupMsg = reply.group
        layers = (self.group.first_layer, self.group.end_layer)
        self.worker: Worker = load_worker(ctx, "prefill", layers)
        self.store, self.pool = connect_pool(ctx, self.worker, self.store_node)
        self.kv_prefix = f"{ctx.node_id}.kv."
        w = self.worker
        caches = place_cache_in_segments(self.store.engine, w.cache, self.kv_prefix, w.tp)
        self.runner = PrefillRunner(
            w.model,
            w.cache,
            chunk_tokens=cfg.prefill.chunk_tokens,
            hasher=w.hasher,
            source=self.pool,
            fingerprint=w.fingerprint,
        )
        self.runner.rank_caches = caches
        later = self.runner.layout.num_layers - len(w.model.layer_ids)
        self.next = NextStage(ctx, self.link, self.group, later)  # used by a leader of 2+
        self.listener: StageListener | None = None
        if self.group.stage > 0:
            t = cfg.transfer
            self.listener = StageListener(
                ctx.secret,
                ctx.host,
                ctx.ports,
                handshake_timeout_s=t.handshake_timeout_s,
                max_pending_handshakes=t.max_pending_handshakes,
            )
        stage_address = f"{ctx.host}:{self.listener.port}" if self.listener else ""
        self.link.info = msgspec.structs.replace(
            info,
            model_fingerprint=w.fingerprint.hex(),
            stage_address=stage_address,
            group_id=self.group.group_id,
            stage=self.group.stage,
            group_size=self.group.group_size,
            kv_capacity_tokens=w.cache.num_blocks * w.cache.block_tokens,
        )
        self.link.register()  # again, with what loading the model told us
        self.handoff = DecodeHandoff(ctx.secret, cfg.prefill)
        self.flow = PrefillFlow(
            self.runner,
            self.store.engine,
            self.kv_prefix,
            self.pool,
            self.handoff,
            cfg.transfer.timeout_s,
        )

    # -- RPC handlers (server thread) --
    def _on_task(self, msg: PrefillTaskMsg, _peer: object) -> AckMsg:
        if self.group.stage != 0:
            raise MooncakeError(
                f"node {self.ctx.node_id} is stage {self.group.stage}, not a leader"
            )
        self.tasks.put(msg)
        return AckMsg()

    def _on_abort(self, msg: PrefillAbortMsg, _peer: object) -> AckMsg:
        self.tasks.abort(msg.req_id)  # NOTE: only a task still waiting can be skipped
        return AckMsg()

    def _load(self) -> NodeLoadMsg:
        q = self.tasks.qsize()
        # NOTE: heartbeats begin while the model loads, before the pool (and its engine) is up
        store = getattr(self, "store", None)
        running = self.num_inflight
        return NodeLoadMsg(
            num_queued=q,
            num_running=running,
            load=float(running > 0),
            transfer_bytes=store.engine.bytes_by_transport() if store is not None else {},
        )

    # -- serving --
    def serve(self) -> None:
        """Serve until stopped; then drain the queue's current task, deregister, clean up."""
        is_leader = self.group.stage == 0 and self.group.group_size > 1
        if self.group.stage > 0:
            threading.Thread(target=self._serve_stage, name="stage-accept", daemon=True).start()
        if is_leader:  # ready once stage 1 answers
            threading.Thread(target=self.next.keep, name="stage-keeper", daemon=True).start()
        else:
            self.link.state = "ready"
        worker = threading.Thread(target=self._work, name="prefill-worker", daemon=True)
        worker.start()
        completer = threading.Thread(target=self._complete, name="prefill-done", daemon=True)
        completer.start()
        while is_leader and not (self.next.formed.is_set() or self.ctx.stop.is_set()):
            self.next.formed.wait(self.ctx.config.prefill.stage_retry_s)
        if not self.ctx.stop.is_set():
            self.link.beat()  # NOTE: the master knows it is ready before its ready line
            g = self.group
            report_ready(node_id=self.ctx.node_id, role="prefill", stage=g.stage, group=g.group_id)
        self.ctx.stop.wait()
        self.link.drain()  # queued tasks still run; nothing new is placed here
        self.tasks.close()
        worker.join(timeout=30)
        self.done.put(None)  # NOTE: after the worker: tasks begun still finish
        completer.join(timeout=30)
        self.close()

    def _serve_stage(self) -> None:
        """Stage > 0: take each authenticated upstream link for the stage thread. A new one
        (the leader came back, or dialled again after its link broke) replaces the one
        being served: that one is cut off, and the requests it left half done give their
        KV blocks back before the new one is served."""
        assert self.listener is not None
        links: queue.SimpleQueue[TcpStageLink | None] = queue.SimpleQueue()
        threading.Thread(target=self._serve_links, args=(links,), name="stage", daemon=True).start()
        latest: TcpStageLink | None = None
        while True:
            try:
                upstream = self.listener.accept()
            except OSError:  # the listener closed: stopping
                break
            if latest is not None:
                if not latest.ended.is_set():
                    log.info("a new link from the leader replaces the one being served")
                latest.abort()
            links.put(upstream)
            latest = upstream
        if latest is not None:
            latest.abort()
        links.put(None)

    def _serve_links(self, links: queue.SimpleQueue[TcpStageLink | None]) -> None:
        """Serve upstream links one after another on this one thread. NOTE: one thread
        for the node's life: the store client keeps each calling thread's connections
        until it closes, so a thread per link would leave a socket behind per link."""
        while (upstream := links.get()) is not None:
            try:
                StageServer(self.runner, upstream, streamer=self.flow.streamer).serve()
            except Exception:  # a bug of ours on one link never stops the stage
                log.exception("serving the link from the leader failed")
                upstream.abort()

    def _work(self) -> None:
        """Begin tasks in order, up to [prefill] max_inflight at once."""
        while (task := self.tasks.get()) is not None:
            self._slots.acquire()
            with self._flight_ended:
                self.num_inflight += 1
            begun = None
            try:
                begun = self._begin(task)
            except Exception as e:  # a failed request never stops the node
                self._failed(task, e)
            if begun is not None:
                self.done.put(begun)
            else:
                self._end_flight()

    def _complete(self) -> None:
        """Finish begun tasks in the order they began."""
        while (begun := self.done.get()) is not None:
            try:
                stats, kv_bytes = self.flow.finish(begun)
                self._event(
                    begun.task.req_id,
                    "finished",
                    num_reused_tokens=stats.num_reused_tokens if stats else 0,
                    num_stored_blocks=stats.num_stored_blocks if stats else 0,
                    num_rejected_blocks=stats.num_rejected_blocks if stats else 0,
                    seal_s=stats.seal_s if stats else 0.0,
                    kv_bytes=kv_bytes,
                )
            except ReuseMismatchError as e:  # a later stage could not load every reused block
                log.warning("req %d: %s; prefilling again with less reuse", begun.task.req_id, e)
                # NOTE: it goes again to where its KV went (its admission may move it again)
                task = msgspec.structs.replace(
                    begun.task,
                    decode_node=begun.decode.node,
                    decode_address=begun.decode.address,
                    max_reuse_blocks=e.num_good_blocks,
                )
                self.tasks.put(task)
            except TransferError as e:
                link = begun.answers.link if begun.answers is not None else None
                # NOTE: a stage that went silent (stopped, its network dark) never closes
                # the link: past its deadline it counts as broken, as a closed one does
                if isinstance(link, TcpStageLink) and (
                    link.ended.is_set() or isinstance(e, StageTimeoutError)
                ):
                    self.next.lose(link)
                    e = GroupBroken(f"the link to stage 1 broke: {e}")
                self._failed(begun.task, e)
            except Exception as e:
                self._failed(begun.task, e)
            finally:
                self._end_flight()

    def _end_flight(self) -> None:
        with self._flight_ended:
            self.num_inflight -= 1
            self._flight_ended.notify_all()
        self._slots.release()

    def _failed(self, task: PrefillTaskMsg, e: Exception) -> None:
        """Tell the master: it places the task again, or ends the request with `error`."""
        node = self.ctx.node_id
        if isinstance(e, DecodeUnreachable):  # the master marks it down, places it again
            log.warning("req %d: %s", task.req_id, e)
            error = f"prefill node {node}: {e}"
            self._event(task.req_id, "failed", error=error, unreachable_address=e.address)
        elif isinstance(e, GroupBroken):  # NOTE: the master now knows the group is not ready
            log.warning("req %d: %s", task.req_id, e)
            self._event(task.req_id, "failed", error=f"prefill node {node}: {e}")
        else:
            log.error("req %d failed: %s", task.req_id, e, exc_info=e)
            self._event(task.req_id, "failed", error=f"prefill failed on {node}: {e}")

    def _begin(self, task: PrefillTaskMsg) -> TaskInFlight | None:
        link, answers = self.next.link, self.next.answers
        is_piped = self.group.group_size > 1 and len(task.prompt_ids) > 1
        if is_piped and (link is None or answers is None or link.ended.is_set()):
            self.next.lose(link)
            raise GroupBroken(f"pipeline group {self.group.group_id} has lost its stage 1")
        decode = self._admit(task)
        if decode is None:
            return None
        log.debug("req %d: prefill of %d tokens", task.req_id, len(task.prompt_ids))
        kw: dict[str, Any] = {}
        if task.max_reuse_blocks is not None:
            kw["max_reuse_blocks"] = task.max_reuse_blocks
        try:
            while True:
                try:
                    return self.flow.begin(task, decode, answers if is_piped else None, **kw)
                except CacheFullError:
                    # NOTE: prompts in flight hold the cache: wait for one to end, retry
                    with self._flight_ended:
                        if self.num_inflight <= 1:
                            raise
                        self._flight_ended.wait()
        except TransferError as e:
            if is_piped and link is not None and link.ended.is_set():
                self.next.lose(link)
                raise GroupBroken(f"the link to stage 1 broke: {e}") from e
            raise

    def _admit(self, task: PrefillTaskMsg) -> DecodeTarget | None:
        """Ask the master whether the task still runs and where its KV goes now (the
        Conductor's second, later decision); None = skip it. An unreachable master, or a
        reply naming no decode node, keeps it where it was placed."""
        try:
            reply = self.link.client.call(
                PrefillStartMsg(task.req_id, self.ctx.node_id), PrefillStartReplyMsg
            )
        except MooncakeError as e:
            log.warning("req %d: admission check failed, running it as placed: %s", task.req_id, e)
            return DecodeTarget.placed(task)
        if not reply.is_accepted:
            log.info("req %d: not prefilled (%s)", task.req_id, reply.reason)
            return None
        # NOTE: a decode node restarted under its id answers at a new address
        if reply.decode_node:
            return DecodeTarget(reply.decode_node, reply.decode_address)
        return DecodeTarget.placed(task)

    def _event(self, req_id: int, phase: str, **kw: object) -> None:
        """Report a task's end to the master, a call it answers (one not answered within
        cluster.call_timeout_s is logged; the request's deadline ends it then)."""
        msg = PrefillEventMsg(req_id, self.ctx.node_id, phase, **kw)  # type: ignore[arg-type]
        try:
            self.link.client.call(msg, AckMsg)
        except MooncakeError as e:
            log.warning("req %d: the master did not confirm it %s: %s", req_id, phase, e)

    def close(self) -> None:
        self.link.deregister()
        self.next.close()
        if self.listener is not None:
            self.listener.close()
        self.server.stop()
        self.flow.close()
        self.handoff.close()
        close_pool(self.store, self.pool, self.store_node)
        self.worker.close()


def run_prefill(ctx: NodeContext) -> None:
    install_signal_handlers(ctx.stop)
    limit_shape_caches(PREFILL_SHAPE_ENTRIES)  # NOTE: before the model's first product
    PrefillNode(ctx).serve()


__all__ = ["PrefillNode", "run_prefill"]
